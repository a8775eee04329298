"""specbatch's tiny model kit: a small Llama target trained on the Python stdlib's source,
its EAGLE-3.1 and plain EAGLE-3 drafters, and a mismatched drafter (issue 3).

``KIT_DIR`` is the committed kit: `models/tinykit/` of the checkout, outside the package so its
17 MB of weights are not in the wheel (``SPECBATCH_KIT_DIR`` points elsewhere, e.g. in an image);
``kit_paths()`` gives its model directories.
Rebuild with ``python -m tinykit.build OUT`` (see build.py).
"""

from __future__ import annotations

import os
from pathlib import Path

KIT_DIR = os.environ.get("SPECBATCH_KIT_DIR") or str(Path(__file__).resolve().parents[1] / "models" / "tinykit")


def kit_paths(kit_dir: str | None = None) -> dict:
    root = Path(kit_dir or KIT_DIR)
    return {
        "target": str(root / "target"),
        "drafter_eagle31": str(root / "drafter-eagle31"),
        "drafter_eagle3": str(root / "drafter-eagle3"),
        "drafter_mismatched": str(root / "drafter-mismatched"),
    }

"""specbatch's tiny model kit: a small Llama target trained on the Python stdlib's source,
its EAGLE-3.1 and plain EAGLE-3 drafters, and a mismatched drafter (issue 3).

``KIT_DIR`` is the committed kit; ``kit_paths()`` gives its model directories.
Rebuild with ``python -m pipeline.tinykit.build OUT`` (see build.py).
"""
from __future__ import annotations

from pathlib import Path

KIT_DIR = str(Path(__file__).resolve().parent / "kit")


def kit_paths(kit_dir: str | None = None) -> dict:
    root = Path(kit_dir or KIT_DIR)
    return {
        "target": str(root / "target"),
        "drafter_eagle31": str(root / "drafter-eagle31"),
        "drafter_eagle3": str(root / "drafter-eagle3"),
        "drafter_mismatched": str(root / "drafter-mismatched"),
    }

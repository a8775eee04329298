"""Export the JSON Schema of every contract to schemas/json/ (run: python -m schemas.export)."""

from __future__ import annotations

import json
from pathlib import Path

from schemas.registry import DOCUMENTS, TABLES

JSON_DIR = Path(__file__).parent / "json"


def json_schemas() -> dict[str, str]:
    """File name -> JSON text, for every table row and document contract."""
    return {
        f"{name}.schema.json": json.dumps(model.model_json_schema(), indent=2, sort_keys=True) + "\n"
        for name, model in {**TABLES, **DOCUMENTS}.items()
    }


def main() -> None:
    JSON_DIR.mkdir(exist_ok=True)
    for file_name, text in json_schemas().items():
        (JSON_DIR / file_name).write_text(text)
        print(JSON_DIR / file_name)


if __name__ == "__main__":
    main()

"""The job's inputs: the check before any engine, from Parquet footers (check.py), the rows'
shape (shape.py), ids (ids.py), prefix grouping (prefixes.py) and OpenAI batch files."""

from pipeline.inputs.check import InputError, InputReport, inspect_inputs, inspect_listed, short_name

__all__ = ["InputError", "InputReport", "inspect_inputs", "inspect_listed", "short_name"]

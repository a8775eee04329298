"""Every table row and document contract by its exported name (schemas/export.py writes their
JSON Schema to schemas/json/)."""

from __future__ import annotations

from schemas.contracts import CommitMarker, Contract, ErrorRow, JobManifest, Lease, OutputRow, PromptRow, UnitStats
from schemas.drafter import DrafterReport, ProbeResult
from schemas.plan import DryRunPlan
from schemas.report import CalibrationReport, CalibrationRow, CostReport, JobFigures
from schemas.status import StatusReport

JobManifest.model_rebuild(_types_namespace={"ProbeResult": ProbeResult})  # its `probe` field is a ProbeResult

TABLES: dict[str, type[Contract]] = {
    "prompt_row": PromptRow,
    "output_row": OutputRow,
    "error_row": ErrorRow,
    "unit_stats": UnitStats,
    "report_job_figures": JobFigures,
    "calibration_row": CalibrationRow,
}
DOCUMENTS: dict[str, type[Contract]] = {
    "job_manifest": JobManifest,
    "commit_marker": CommitMarker,
    "lease": Lease,
    "cost_report": CostReport,
    "calibration_report": CalibrationReport,
    "drafter_report": DrafterReport,
    "status_report": StatusReport,
    "dry_run_plan": DryRunPlan,
}

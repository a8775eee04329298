"""Tooling around the job: the report, calibration, the drafter check command, export and the demo."""

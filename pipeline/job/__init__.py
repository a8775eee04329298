"""The driver: a job's plan (read without writing), the checks before any engine, its
attempts (pipeline/job/runner.py), the error breaker and the console."""

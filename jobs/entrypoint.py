"""What `ray job submit` runs:

    ray job submit --working-dir . --runtime-env jobs/runtime_env.yaml -- \
        python jobs/entrypoint.py --config CONFIG_URI [--output-uri URI] [--job-id ID] [--restart] \
        [--take-over] [--retry-errors]

RAY_ADDRESS, set by the job submission, makes the runner join that cluster.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the working dir, when not pip-installed

from pipeline.cli import run_from_config  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--output-uri")
    parser.add_argument("--job-id")
    parser.add_argument("--restart", action="store_true", help="wipe the output location and start over")
    parser.add_argument(
        "--take-over", action="store_true", help="take the location over at once from a run known to be dead"
    )
    parser.add_argument("--retry-errors", action="store_true", help="run again every unit with error rows")
    args = parser.parse_args()
    sys.exit(
        run_from_config(
            args.config,
            args.output_uri,
            job_id=args.job_id,
            restart=args.restart,
            take_over=args.take_over,
            retry_errors=args.retry_errors,
        )
    )

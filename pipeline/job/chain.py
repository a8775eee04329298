"""Jobs chained: a finished job's output location as the next job's input.

`input_uri` naming a specbatch output location (it holds `_job.json`) reads that job's committed
output rows: the files its commit markers name, never a unit's files a dead run left behind,
and only once that job has ended. Its rows keep their `id`, its generated `text` and every
other output column, and the columns it copied; the next job builds its prompts from them with
a template (`rows.prompt_template`), and records the job it read in its own manifest."""

from __future__ import annotations

from typing import Optional

from pipeline.commit.outputs import OutputLocation
from pipeline.config import JobConfig
from pipeline.inputs import InputError, InputReport, inspect_listed
from pipeline.inputs.shape import RowShape
from pipeline.storage import Storage
from schemas import InputFile, InputJob


def chained_inputs(
    config: JobConfig, storage: Storage, known: Optional[list[InputFile]]
) -> Optional[tuple[InputReport, InputJob]]:
    """The committed output files of the job at `config.input_uri`, checked as any input is;
    None when input_uri is not a job's output location."""
    first = OutputLocation(storage, config.input_uri)
    if config.input_format != "parquet" or not first.has_manifest():
        return None
    manifest = first.job_manifest()
    if manifest.status == "running":
        raise InputError(
            f"input_uri {config.input_uri} is the output of job {manifest.job_id}, which has not ended (its _job.json "
            "says running: it runs, or its driver was killed). Let it end, or rerun it to finish it, then run this job."
        )
    files = set(first.committed_files("outputs"))
    if not files:
        raise InputError(f"input_uri {config.input_uri}: job {manifest.job_id} committed no output rows to read")
    listed = {
        uri: info for uri, info in storage.list_details(first.path("outputs"), ".parquet").items() if uri in files
    }
    report = inspect_listed(config.input_uri, listed, storage, known, RowShape.for_job(config))
    return report, InputJob(
        job_id=manifest.job_id,
        output_uri=first.uri,
        status=manifest.status,
        results_fingerprint=manifest.results_fingerprint,
    )

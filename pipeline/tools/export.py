"""`specbatch export --format openai_batch OUTPUT_URI`: a finished job's outputs and errors as
OpenAI batch output files (results.jsonl, errors.jsonl in OpenAI's response shapes)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from typing import Any, Optional

from pipeline.commit.outputs import OutputLocation
from pipeline.inputs.openai_batch import MARKERS_PER_READ, atomic_file, identity_hash
from pipeline.inputs.openai_requests import URLS
from pipeline.storage import Storage
from schemas import JobManifest


class ExportError(ValueError):
    pass


def _request_ids(job_id: str, custom_id: str) -> tuple[str, str]:
    digest = identity_hash(job_id, custom_id)
    return f"batch_req_{digest[:24]}", f"req_{digest[24:48]}"


def _chat_logprobs(entries: Optional[list[dict]]) -> Optional[dict]:
    if entries is None:
        return None

    def one(e: dict) -> dict:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode("utf-8"))}

    return {
        "content": [{**one(e), "top_logprobs": [one(t) for t in e.get("top_logprobs") or []]} for e in entries],
        "refusal": None,
    }


def _completion_logprobs(entries: Optional[list[dict]]) -> Optional[dict]:
    if entries is None:
        return None
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs") or []} for e in entries],
        "text_offset": offsets,
    }


def _meta(row: dict, where: str) -> dict:
    try:
        meta = json.loads(row["metadata"]) if isinstance(row.get("metadata"), str) else None
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or meta.get("url") not in URLS:
        raise ExportError(
            f"{where}: row of id {row['id']!r} has no OpenAI batch metadata (not converted from a batch file)"
        )
    return meta


def result_line(samples: list[dict], job_id: str, created: int, where: str) -> dict:
    """One custom_id's output rows (its samples) -> its line of results.jsonl."""
    first = samples[0]
    meta = _meta(first, where)
    batch_id, request_id = _request_ids(job_id, first["id"])
    chat = URLS[meta["url"]] == "chat"
    choices = []
    for s in sorted(samples, key=lambda s: s.get("sample_index") or 0):
        choice = {
            "index": s.get("sample_index") or 0,
            "finish_reason": s["finish_reason"],
            "stop_reason": s.get("stop_reason"),
        }
        if chat:
            message = {"role": "assistant", "content": s["text"], "refusal": None}
            if s.get("reasoning") is not None:
                message["reasoning"] = s["reasoning"]
            choice.update(message=message, logprobs=_chat_logprobs(s.get("logprobs")))
        else:
            choice.update(text=s["text"], logprobs=_completion_logprobs(s.get("logprobs")))
        choices.append(choice)
    completion_tokens = sum(s["generated_tokens"] for s in samples)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id[4:]}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": first["model"],  # what generated it (`<folder>@<config sha256>`), whatever name the line asked for
        "choices": choices,
        "usage": {
            "prompt_tokens": first["prompt_tokens"],
            "completion_tokens": completion_tokens,
            "total_tokens": first["prompt_tokens"] + completion_tokens,
        },
    }
    if first.get("prompt_logprobs") is not None:
        body["prompt_logprobs"] = first["prompt_logprobs"]
    return {
        "id": batch_id,
        "custom_id": first["id"],
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def error_line(row: dict, job_id: str) -> dict:
    """One custom_id's error row -> its line of errors.jsonl: a 400 for the request's own
    fault, a 500 for what the engine or the infrastructure failed."""
    batch_id, request_id = _request_ids(job_id, row["id"])
    server = bool(row.get("retryable")) or row.get("stage") == "generate"
    error = {
        "message": row["message"],
        "type": "server_error" if server else "invalid_request_error",
        "param": row.get("field"),
        "code": row["error_kind"],
    }
    return {
        "id": batch_id,
        "custom_id": row["id"],
        "response": {"status_code": 500 if server else 400, "request_id": request_id, "body": {"error": error}},
        "error": {"code": row["error_kind"], "message": row["message"]},
    }


def _grouped(rows: list[dict]) -> list[list[dict]]:
    groups: dict[str, list[dict]] = {}
    for row in sorted(rows, key=lambda r: (r.get("row") or 0, r.get("sample_index") or 0)):
        groups.setdefault(row["id"], []).append(row)
    return list(groups.values())


def export_openai_batch(storage: Storage, output_uri: str, dest: Optional[str] = None) -> dict[str, Any]:
    """Write DEST/results.jsonl and DEST/errors.jsonl from the committed units of a job that is
    not running; returns what was written."""
    location = OutputLocation(storage, output_uri)
    try:
        manifest = JobManifest.model_validate(location.read_manifest())
    except FileNotFoundError:
        raise ExportError(f"{output_uri}: no _job.json (not a specbatch job output)") from None
    if manifest.status == "running":
        raise ExportError(
            f"{output_uri}: job {manifest.job_id} is running (or its driver was killed: _job.json still says running). "
            "Wait for it to end, or rerun `specbatch run` on its config to finish it, then export."
        )
    if manifest.config.get("input_format", "parquet") != "openai_batch":
        raise ExportError(
            f"{output_uri}: job {manifest.job_id} did not read OpenAI batch files (input_format is not openai_batch)"
        )
    dest = (dest or location.path("export", "openai_batch")).rstrip("/")
    ended = manifest.ended_at or manifest.started_at
    created = int(dt.datetime.fromisoformat(ended).timestamp())
    units = sorted(location.committed_units())
    counts = {"results": 0, "errors": 0, "units": len(units)}
    with (
        atomic_file(storage, storage.join(dest, "results.jsonl")) as results,
        atomic_file(storage, storage.join(dest, "errors.jsonl")) as errors,
    ):
        for start in range(0, len(units), MARKERS_PER_READ):
            for marker in location.markers(units[start : start + MARKERS_PER_READ]).values():
                if "outputs" in marker.files:
                    uri = location.path(marker.files["outputs"])
                    for samples in _grouped(storage.read_parquet(uri).to_pylist()):
                        results.write((json.dumps(result_line(samples, manifest.job_id, created, uri)) + "\n").encode())
                        counts["results"] += 1
                if "errors" in marker.files:
                    seen = set()
                    for row in storage.read_parquet(location.path(marker.files["errors"])).to_pylist():
                        if row["id"] not in seen:
                            seen.add(row["id"])
                            errors.write((json.dumps(error_line(row, manifest.job_id)) + "\n").encode())
                            counts["errors"] += 1
    counts.update(dest=dest, status=manifest.status, input_rows=manifest.totals.input_rows)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specbatch export",
        description="Write a finished job's outputs as OpenAI batch output files: DEST/results.jsonl (one line per "
        "custom_id, its samples as the choices of one chat.completion or text_completion) and DEST/errors.jsonl (one "
        "line per failed custom_id). The job must have read OpenAI batch files (input_format: openai_batch) and must "
        "not be running.",
        epilog="example:\n  specbatch export --format openai_batch s3://bucket/outputs/2026-11-29 --to s3://bucket/exports/2026-11-29",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("output_uri", metavar="OUTPUT_URI", help="the job's output location (local or s3://...)")
    parser.add_argument("--format", required=True, choices=["openai_batch"], help="what to write")
    parser.add_argument(
        "--to", dest="dest", metavar="DEST", help="where the files go (default OUTPUT_URI/export/openai_batch/)"
    )
    parser.add_argument("--endpoint-url", help="S3-compatible endpoint (as storage.endpoint_url in job configs)")
    parser.add_argument("--region")
    args = parser.parse_args(argv)
    storage = Storage(endpoint_url=args.endpoint_url, region=args.region)
    try:
        done = export_openai_batch(storage, args.output_uri, args.dest)
    except (ExportError, FileNotFoundError) as exc:
        print(f"specbatch export: refused: {exc}", file=sys.stderr)
        return 2
    print(
        f"specbatch export: {done['results']:,} results and {done['errors']:,} errors from {done['units']:,} units "
        f"written to {done['dest']}/ (results.jsonl, errors.jsonl)"
    )
    if done["status"] in ("failed", "interrupted"):
        print(
            f"specbatch export: warning: the job {done['status']}; requests of units it never committed are in neither "
            "file (rerun `specbatch run` to finish them, then export again)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

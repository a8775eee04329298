"""What a data set as it is costs before and beside the engines (issue 44): the id check across
the whole input, and prompts rendered from a template.

    python benchmarks/rows_cost.py [--rows 10000000] [--render-rows 1000000] [--repeats 3]
    python benchmarks/rows_cost.py --rows 200000 --render-rows 50000 --repeats 1   # smoke run

Writes, in a temporary folder on local disk, `--rows` rows of a passage-and-question table in
files of 100,000 rows (`uid` int64 with one id in 10,000 repeated, `context` ~300 characters,
`question` ~60, `topic`), then measures, each in a fresh process, `--repeats` times, medians:

  id check     pipeline/inputs/ids.find_duplicate_ids over every file, as the plan runs it:
               wall seconds, CPU seconds, and the process's peak resident memory above what it
               held before (the driver's cost), with the duplicates it found
  render       RowShape.apply over `--render-rows` rows read as a unit's read reads them, with
               the template and without (the prompt column read as it is): CPU seconds per 1M
               rows of each, and the template's extra
  key pass     pipeline/inputs/prefixes.read_keys with the template (resources.group_prefixes
               auto renders every prompt in the driver to find shared prefixes), then without it
               (the rows' own `context` column as the prompt): wall, CPU, peak memory
  preprocess   the whole preprocess stage's work on templated units (read_unit, then the
               Preprocessor: checks, the kit's tokenizer, sampling), CPU seconds per 1M rows over
               --preprocess-rows rows
  engine       for scale: the engine seconds per 1M rows of a job of this shape, from
               --engine-rows-per-second (default: 2,048 rows in 37.4 s, benchmarks/prefix_sharing.py
               (b) grouped steady engine time on this machine, 16 tokens per answer)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FILE_ROWS = 100_000
TEMPLATE = "Passage: {{ context }}\nQuestion: {{ question }}\nAnswer:"
WORDS = "the river stone bridge farmer market old new small large quiet bright dark morning evening winter".split()


def write_table(folder: Path, rows: int) -> list[str]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(55)) for _ in range(1000)]  # ~300 characters each
    questions = [f"What does the passage say about the {rng.choice(WORDS)}?" for _ in range(1000)]
    files = []
    for start in range(0, rows, FILE_ROWS):
        n = min(FILE_ROWS, rows - start)
        uid = np.arange(start, start + n, dtype=np.int64)
        uid[::10_000] = np.maximum(uid[::10_000] - 1, 0)  # one id in 10,000 repeats the row before it
        pick = np.arange(start, start + n) % 1000
        path = folder / f"{start // FILE_ROWS:05d}.parquet"
        pq.write_table(
            pa.table(
                {
                    "uid": uid,
                    "context": pa.array([sentences[i] for i in pick]),
                    "question": pa.array([questions[i] for i in pick]),
                    "topic": pa.array([WORDS[i % len(WORDS)] for i in pick]),
                }
            ),
            path,
            row_group_size=8192,
        )
        files.append(str(path))
    return files


CHILD = (
    r"""
import json, resource, sys, time
from pipeline.config import InputRowsConfig
from pipeline.inputs import inspect_inputs
from pipeline.inputs.ids import find_duplicate_ids
from pipeline.inputs.shape import RowShape
from pipeline.storage import Storage

kind, folder, render_rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
templated = RowShape(InputRowsConfig(id_column="uid", prompt_template=%r))
plain = RowShape(InputRowsConfig(id_column="uid", prompt_column="context"))
inputs = inspect_inputs(folder, Storage(), shape=templated)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
wall, cpu = time.time(), time.process_time()
if kind in ("keys", "keys-plain"):
    from pipeline.inputs.prefixes import read_keys
    keys = read_keys(Storage(), inputs.files, templated if kind == "keys" else plain)
    print("RESULT " + json.dumps({"wall": time.time() - wall, "cpu": time.process_time() - cpu, "rows": len(keys),
          "peak_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}))
elif kind == "ids":
    found = len(find_duplicate_ids(Storage(), inputs.files, templated))
    print("RESULT " + json.dumps({"wall": time.time() - wall, "cpu": time.process_time() - cpu, "rows": inputs.rows,
          "duplicates": found, "peak_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}))
elif kind == "preprocess":
    from pipeline.inputs.units import plan_units, read_unit
    from pipeline.stages.preprocess import Preprocessor, PreprocessSettings
    from pipeline.tools.demo import trained_kit
    preprocessor = Preprocessor(PreprocessSettings(trained_kit()["target"], 2048))
    done, read = 0.0, 0
    for unit in plan_units(inputs.files, 4096):
        started = time.process_time()
        preprocessor(read_unit(Storage(), unit, templated))
        done += time.process_time() - started
        read += unit.rows
        if read >= render_rows:
            break
    print("RESULT " + json.dumps({"cpu_per_million": done / read * 1e6, "rows": read}))
else:
    import pyarrow.parquet as pq
    from pipeline.inputs.units import LAYOUT
    shape = templated if kind == "template" else plain
    read, done = 0, 0.0
    for file in inputs.files:
        parquet = pq.ParquetFile(file.uri)
        for batch in parquet.iter_batches(4096, columns=shape.source_columns(parquet.schema_arrow.names, LAYOUT)):
            import pyarrow as pa
            table = pa.Table.from_batches([batch])
            started = time.process_time()
            shape.apply(table)
            done += time.process_time() - started
            read += table.num_rows
            if read >= render_rows:
                break
        if read >= render_rows:
            break
    print("RESULT " + json.dumps({"cpu_per_million": done / read * 1e6, "rows": read}))
"""
    % TEMPLATE
)


def child(kind: str, folder: str, render_rows: int) -> dict:  # render_rows: rows shaped or preprocessed
    done = subprocess.run(
        [sys.executable, "-c", CHILD, kind, folder, str(render_rows)], capture_output=True, text=True, cwd=ROOT
    )
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--render-rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preprocess-rows", type=int, default=50_000)
    parser.add_argument(
        "--key-pass", action="store_true", help="also the prefix key pass with and without the template"
    )
    parser.add_argument("--engine-rows-per-second", type=float, default=2048 / 37.4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="specbatch-rows-") as tmp:
        started = time.time()
        files = write_table(Path(tmp) / "in", args.rows)
        print(f"{args.rows:,} rows in {len(files)} files written in {time.time() - started:.0f} s", flush=True)
        runs = {
            kind: []
            for kind in ("ids", "template", "plain", "preprocess", *(("keys", "keys-plain") if args.key_pass else ()))
        }
        for _ in range(args.repeats):
            for kind in runs:
                rows = args.preprocess_rows if kind == "preprocess" else args.render_rows
                runs[kind].append(child(kind, str(Path(tmp) / "in"), rows))
        ids = runs["ids"]
        med = lambda key, rs: statistics.median(r[key] for r in rs)  # noqa: E731
        print(
            f"id check, {ids[0]['rows']:,} rows: {med('wall', ids):.1f} s wall, {med('cpu', ids):.1f} s CPU, "
            f"peak memory +{med('peak_mb', ids):,.0f} MB, {ids[0]['duplicates']:,} duplicates found "
            f"(min-max wall {min(r['wall'] for r in ids):.1f}-{max(r['wall'] for r in ids):.1f} s)"
        )
        template, plain = med("cpu_per_million", runs["template"]), med("cpu_per_million", runs["plain"])
        engine = 1e6 / args.engine_rows_per_second
        print(
            f"rows shaped, CPU s per 1M rows: template {template:.1f}, plain column {plain:.1f}; the template's extra "
            f"{template - plain:.1f} s = {(template - plain) / engine:.2%} of the engine's {engine:,.0f} s per 1M rows"
        )
        for kind in ("keys", "keys-plain") if args.key_pass else ():
            rs = runs[kind]
            print(
                f"key pass {'with the template' if kind == 'keys' else 'on a plain column'}, {rs[0]['rows']:,} rows: "
                f"{med('wall', rs):.1f} s wall, {med('cpu', rs):.1f} s CPU, peak memory +{med('peak_mb', rs):,.0f} MB"
            )
        preprocess = med("cpu_per_million", runs["preprocess"])
        print(
            f"preprocess stage on templated units, CPU s per 1M rows: {preprocess:.1f} = {preprocess / engine:.2%} of "
            f"the engine's time (over {runs['preprocess'][0]['rows']:,} rows)"
        )


if __name__ == "__main__":
    main()

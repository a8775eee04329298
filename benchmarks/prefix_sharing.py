"""Prompts that share prefixes (issue 43): specbatch with its rows grouped by prefix, and not,
against vLLM alone and Ray Data LLM, whole processes, in alternating rounds.

    python benchmarks/prefix_sharing.py [--datasets a,b,c] [--rounds 3] [--drafter]
                                        [--kinds grouped,ungrouped,vllm,raydatallm] [--scale 1]
    python benchmarks/prefix_sharing.py --check-identical [--datasets a,b,c] [--drafter]

Every run is one process started from here (pipeline_tax.py's timed_run), on the same prompts
(8 Parquet files, read in name order) and engine settings: the kit's target, no drafter unless
--drafter (then the kit's EAGLE-3.1 drafter at k=3 in every run, with specbatch's probe, trial
and guard off so that every run speculates throughout), greedy, eager, fp32, max_num_seqs 64,
max_tokens 16, vLLM's prefix caching on (its default), the same KV cache bytes:
  grouped     `specbatch run CONFIG` with resources.group_prefixes: auto (the default: it groups
              when sorting pays, so on (c) it measures what the decision costs)
  ungrouped   the same with resources.group_prefixes: false
  vllm        a plain script: read the Parquet prompts, one `LLM.generate` in input order, write Parquet
  sorted      the same script with the prompts sorted by their text: a grouping that costs nothing,
              the ceiling of what any order gives this engine (not a run a user has: it needs the
              whole input in one process's memory)
  raydatallm  Ray Data LLM: read_parquet -> build_processor(vLLMEngineProcessorConfig) -> write_parquet
In each round the runs take turns (their order rotates from round to round). Three data sets,
written here, rows shuffled (seed 0) across the 8 files, plain prompts (no chat template):
  (a) passages  512 passages of ~300 tokens (seeded pseudo-text), 4 questions each:
                instruction + passage + question; 2,048 rows
  (b) judging   512 prompts of ~150 tokens, 4 candidate responses of ~100 tokens each:
                judge instruction + prompt + response + "Score:"; 2,048 rows
  (c) unique    2,048 prompts of ~300 tokens sharing only a ~20-token preamble
The KV cache holds a quarter (--kv-fraction) of the data set's distinct prefix tokens ((a)'s for
(c), which shares nothing), as a large model's cache on a GPU would, in blocks of 32 tokens
(--block-size; the CPU build's smallest, nearer a GPU's 16 than the CPU build's default of 128,
which caches a shared prefix only in whole 128-token blocks); max_num_seqs comes down when the
running requests would not fit in it. Printed per data set, medians (min-max):
  wall s          whole process, from start to exit
  gen tok/s       generated tokens / wall s
  hit rate        prompt tokens served from the prefix cache / prompt tokens: vllm the sum of
                  RequestOutput.num_cached_tokens; specbatch its job's cached_prompt_tokens;
                  raydatallm not known (its rows do not carry vLLM's cached-token count)
  prefill tokens  prompt tokens computed: prompt tokens - cached ones
  steady          generated tokens / the time the engine generated (engine time): vllm its
                  generate() call; specbatch first unit into the engine to last unit out
and per round, ratios of gen tok/s: grouped / vllm, grouped / raydatallm, grouped / ungrouped,
by wall time and by steady engine time (what a long job's ratio tends to, start-up aside).
"What the data allows" is the hit rate with an infinite cache: the tokenized prompts sorted,
each caches its LCP with its sorted predecessor in whole blocks, at most its length - 1 in whole
blocks (vLLM caches full blocks and always computes the last prompt token); and grouped's hit
rate / that. "Distinct prefix tokens" are tokens of prefixes two or more prompts share, each
counted once. --check-identical runs grouped and ungrouped once per data set and prints how
many rows' greedy outputs differ between them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline_tax as tax  # noqa: E402  (puts the repository on sys.path)

# pipeline_tax sets VLLM_CPU_KVCACHE_SPACE=1 (GiB), which would win over kv_cache_memory_bytes:
# here the cache size is the point, so every run gets the bytes of its config.
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)

ROOT = tax.ROOT
ARMS = ("grouped", "ungrouped", "vllm", "sorted", "raydatallm")
DATASETS = {"a": "passages", "b": "judging", "c": "unique"}
BLOCK = 32  # KV cache block, tokens (--block-size): the CPU build's smallest; a GPU's default is 16
MAX_TOKENS = 16
MAX_NUM_SEQS = 64
MAX_MODEL_LEN = 512
SEED = 0
CHILD_RUNS = {
    "vllm": tax.run_vllm,
    "sorted": lambda config: tax.run_vllm(config, sort_prompts=True),
    "raydatallm": tax.run_ray_data_llm,
}
RAYDATA_CACHED = (
    "Ray Data LLM's output rows (vLLMOutputData) carry prompt_token_ids, num_input_tokens and metrics "
    "(vLLM's RequestStateStats: timings, preemptions), not RequestOutput.num_cached_tokens; vLLM's prefix-cache "
    "counters leave the engine only through its Prometheus export (log_engine_metrics) and its log line's hit rate "
    "over the last 1,000 requests, neither a per-job count"
)
WORDS = """the a of and to in river stone bridge farmer market old new small large quiet bright dark morning evening
winter summer village city road field garden house window door letter book story song music teacher student
doctor child mother father friend neighbour horse dog cat bird tree forest hill valley lake sea ship train station
clock bell lamp table chair bread water milk salt iron gold silver paper ink coin price rain snow wind cloud sun
moon star north south east west walked carried opened closed found lost built painted counted wrote read sang
watched waited crossed followed remembered slowly quickly often never always later early together alone near far
under over behind between before after because while when although every each many few several""".split()


# ---------------------------------------------------------------- the data sets


def pseudo_text(rng: random.Random, tokenizer, n_tokens: int) -> str:
    """Seeded sentences of words from WORDS, cut to `n_tokens` tokens of the kit's tokenizer."""
    words, left = [], 0
    while len(words) < n_tokens:  # a word is a token at least
        start, left = left == 0, left or rng.randint(8, 16)  # sentences of 8-16 words
        word = rng.choice(WORDS)
        words.append(word.capitalize() if start else word)
        left -= 1
        if left == 0:
            words[-1] += "."
    text = " ".join(words)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return text[: offsets[n_tokens - 1][1]]


def passages(rng: random.Random, tokenizer, groups: int) -> list[tuple[str, str]]:
    rows = []
    for p in range(groups):
        passage = pseudo_text(rng, tokenizer, rng.randint(290, 310))
        topics = rng.sample(sorted(set(w.strip(".").lower() for w in passage.split())), 8)
        for q in range(4):
            question = f"What does the passage say about the {topics[2 * q]} and the {topics[2 * q + 1]}?"
            prompt = (
                "Read the passage below and answer the question in a few words.\n\n"
                f"Passage: {passage}\n\nQuestion: {question}\nAnswer:"
            )
            rows.append((f"a-{p:04d}-q{q}", prompt))
    return rows


def judging(rng: random.Random, tokenizer, groups: int) -> list[tuple[str, str]]:
    judge = (
        "You are a strict judge. Read the prompt and the candidate response, then rate how well the response "
        "answers the prompt on a scale from 1 to 10. Reply with the score only."
    )
    rows = []
    for p in range(groups):
        prompt = pseudo_text(rng, tokenizer, rng.randint(140, 160))
        for c in range(4):
            response = pseudo_text(rng, tokenizer, rng.randint(90, 110))
            rows.append((f"b-{p:04d}-r{c}", f"{judge}\n\nPrompt: {prompt}\n\nResponse: {response}\n\nScore:"))
    return rows


def unique(rng: random.Random, tokenizer, n: int) -> list[tuple[str, str]]:
    preamble = "You are a helpful writing assistant. Continue the text below in the same style.\n\n"
    return [(f"c-{i:04d}", preamble + pseudo_text(rng, tokenizer, rng.randint(270, 290))) for i in range(n)]


def make_dataset(key: str, tokenizer, scale: float) -> list[tuple[str, str]]:
    rng = random.Random(f"{SEED}-{key}")
    groups = max(1, round(512 * scale))
    return {"a": passages, "b": judging, "c": lambda r, t, g: unique(r, t, 4 * g)}[key](rng, tokenizer, groups)


def write_shards(folder: Path, rows: list[tuple[str, str]]) -> None:
    """The rows shuffled (seed 0) into 8 files, 000.parquet ... 007.parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = rows[:]
    random.Random(SEED).shuffle(rows)
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(rows) // tax.SHARDS)
    for s in range(tax.SHARDS):
        chunk = rows[s * per : (s + 1) * per]
        pq.write_table(
            pa.table({"id": [r[0] for r in chunk], "prompt": [r[1] for r in chunk]}), folder / f"{s:03d}.parquet"
        )


# ---------------------------------------------------------------- what the data allows


def common_prefix(x: list[int], y: list[int]) -> int:
    n = 0
    for a, b in zip(x, y):
        if a != b:
            break
        n += 1
    return n


def prefix_figures(token_lists: list[list[int]]) -> dict:
    """prompt tokens; distinct prefix tokens (shared by two or more prompts, each counted once);
    cacheable tokens with an infinite cache (whole blocks of the LCP with the sorted predecessor,
    at most len - 1 in whole blocks); the longest prompt."""
    seqs = sorted(token_lists)
    lcp = [0] + [common_prefix(x, y) for x, y in zip(seqs, seqs[1:])]
    cacheable = sum(min(n // BLOCK, (len(s) - 1) // BLOCK) * BLOCK for s, n in zip(seqs, lcp))
    return {
        "rows": len(seqs),
        "prompt_tokens": sum(map(len, seqs)),
        "distinct_prefix_tokens": sum(max(0, n - before) for before, n in zip(lcp, lcp[1:])),
        "cacheable_tokens": cacheable,
        "max_prompt": max(map(len, seqs)),
    }


# ---------------------------------------------------------------- KV cache and configs


def kv_bytes_per_token(model_dir: str) -> int:
    """K and V of every layer, fp32: 2 x layers x KV heads x head dim x 4 bytes (config.json)."""
    c = json.loads(Path(model_dir, "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4


def kv_cache(distinct_prefix_tokens: int, fraction: float, datasets: dict[str, dict]) -> dict:
    """Cache blocks holding `fraction` of the distinct prefix tokens (one block at least, and one
    max_model_len request, or vLLM refuses to start), and the max_num_seqs whose requests fit in it."""
    blocks = max(round(distinct_prefix_tokens * fraction / BLOCK), 1)
    floor = -(-MAX_MODEL_LEN // BLOCK)
    per_seq = max(-(-(d["max_prompt"] + MAX_TOKENS) // BLOCK) for d in datasets.values())
    return {
        "blocks": max(blocks, floor),
        "raised": blocks < floor,
        "per_seq": per_seq,
        "max_num_seqs": min(MAX_NUM_SEQS, max(blocks, floor) // per_seq),
    }


def write_configs(folder: Path, models: dict, cache: dict, args) -> dict[str, str]:
    """The job config of each specbatch arm, and `plain` (no group_prefixes key) for vllm and raydatallm."""
    import yaml

    base = yaml.safe_load((ROOT / "jobs" / "configs" / "local.yaml").read_text())
    base.update(job_name=f"prefix-{folder.name}", input_uri=str(folder / "in"))
    base["model"]["path"] = models["target"]
    base["engine"].update(
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=cache["max_num_seqs"],
        cpu_kv_cache_gib=cache["bytes"] / 2**30,  # a multiple of 2^17 B: exact
        extra_args={"block_size": BLOCK},
    )  # every run's engine arguments (engine_kwargs)
    base["sampling"].update(max_tokens=MAX_TOKENS, temperature=0.0)
    base["resources"]["rows_per_unit"] = args.rows_per_unit
    if args.drafter:
        base["speculative"] = {
            "enabled": True,
            "drafter": models["drafter"],
            "num_speculative_tokens": 3,
            "probe": {"rows": 0},
            "trial": None,
            "guard": None,
        }
    else:
        base["speculative"] = {"enabled": False}
    paths = {}
    for name, group in (("plain", None), ("grouped", "auto"), ("ungrouped", False)):
        config = json.loads(json.dumps(base))
        config["output_uri"] = str(folder / "out" / name)
        if group is not None:
            config["resources"]["group_prefixes"] = group
        paths[name] = str(folder / f"{name}.yaml")
        Path(paths[name]).write_text(yaml.safe_dump(config))
    return paths


# ---------------------------------------------------------------- runs


def specbatch_figures(config_path: str) -> dict:
    """Prompt and cached prompt tokens from the job's totals or its stats (None when the stats
    have no cached_prompt_tokens), and the job's grouping decision."""
    from pipeline.commit.outputs import OutputLocation
    from pipeline.config import load_config
    from pipeline.storage import Storage

    config = load_config(config_path)
    location = OutputLocation(Storage.from_config(config.storage), config.output_uri)
    manifest, stats = location.read_manifest(), location.read_table("stats")
    cached = manifest["totals"].get("cached_prompt_tokens")
    if cached is None and "cached_prompt_tokens" in stats.column_names:
        cached = sum(stats.column("cached_prompt_tokens").to_pylist())
    g = manifest.get("grouping")
    grouping = (
        f"{'grouped' if g['grouped'] else 'not grouped'} ({g['setting']}): {g['reason']}" if g else "not recorded"
    )
    return {
        "prompt_tokens": sum(stats.column("prompt_tokens").to_pylist()),
        "cached_tokens": cached,
        "grouping": grouping,
    }


def run_arm(arm: str, configs: dict[str, str]) -> dict:
    config = configs["plain" if arm in CHILD_RUNS else arm]
    tax.clear_outputs(config)
    kind = arm if arm in CHILD_RUNS else "specbatch"
    result = tax.timed_run(kind, config, script=__file__)
    if kind == "specbatch":
        result.update(specbatch_figures(config))
    return result


def outputs_by_id(config_path: str) -> dict[str, str]:
    from pipeline.commit.outputs import OutputLocation
    from pipeline.config import load_config
    from pipeline.storage import Storage

    config = load_config(config_path)
    table = OutputLocation(Storage.from_config(config.storage), config.output_uri).read_table("outputs")
    return {
        r["id"]: r["text"] for r in table.select(["id", "sample_index", "text"]).to_pylist() if r["sample_index"] == 0
    }


# ---------------------------------------------------------------- the report


def med(values: list, digits: int = 1) -> str:
    return tax.med([v for v in values if v is not None], digits) if any(v is not None for v in values) else "not known"


def hit_rate(r: dict):
    return (
        r["cached_tokens"] / r["prompt_tokens"]
        if r.get("cached_tokens") is not None and r.get("prompt_tokens")
        else None
    )


def prefill(r: dict):
    return r["prompt_tokens"] - r["cached_tokens"] if r.get("cached_tokens") is not None else None


def kv_line(cache: dict, figures: dict) -> str:
    tokens = cache["blocks"] * BLOCK
    share = tokens / figures["distinct_prefix_tokens"] if figures["distinct_prefix_tokens"] else math.inf
    return (
        f"KV cache {tokens:,} tokens ({cache['blocks']} blocks, {cache['bytes'] / 2**20:,.1f} MiB) = {share:.0%} of "
        f"the data set's distinct prefix tokens ({figures['distinct_prefix_tokens']:,})"
    )


def report(key: str, figures: dict, cache: dict, runs: dict[str, list[dict]]) -> None:
    arms = [a for a in ARMS if runs.get(a)]
    allowed = figures["cacheable_tokens"] / figures["prompt_tokens"]
    print(
        f"\n== ({key}) {DATASETS[key]}: {figures['rows']:,} rows, {figures['prompt_tokens']:,} prompt tokens, "
        f"{max(len(runs[a]) for a in arms)} rounds, medians (min-max)"
    )
    print(kv_line(cache, figures))
    print(
        f"what the data allows: hit rate {allowed:.3f} with an infinite cache "
        f"({figures['cacheable_tokens']:,} cacheable prompt tokens)"
    )
    print(f"{'':<12}{'wall s':>22}{'gen tok/s (wall)':>22}{'hit rate':>24}{'prefill tokens':>30}")
    for arm in arms:
        rs = runs[arm]
        print(
            f"{arm:<12}{med([r['wall'] for r in rs]):>22}{med([r['tokens'] / r['wall'] for r in rs], 0):>22}"
            f"{med([hit_rate(r) for r in rs], 3):>24}{med([prefill(r) for r in rs], 0):>30}"
        )
    for arm in (a for a in ("grouped", "ungrouped", "vllm", "sorted") if runs.get(a)):
        print(
            f"{arm:<12}steady: {med([r['engine_seconds'] for r in runs[arm]])} s of generation, "
            f"{med([r['tokens'] / r['engine_seconds'] for r in runs[arm]], 0)} gen tok/s"
        )
    for other in ("vllm", "sorted", "raydatallm", "ungrouped"):
        if runs.get("grouped") and runs.get(other):
            pairs = list(zip(runs["grouped"], runs[other]))
            print(
                f"grouped / {other} gen tok/s (wall), per round: "
                f"{med([(g['tokens'] / g['wall']) / (o['tokens'] / o['wall']) for g, o in pairs], 2)}"
            )
            if other != "raydatallm":
                print(
                    f"grouped / {other} steady gen tok/s, per round: "
                    f"{med([o['engine_seconds'] / g['engine_seconds'] for g, o in pairs], 2)}"
                )
    if runs.get("grouped"):
        rates = [hit_rate(r) / allowed if hit_rate(r) is not None and allowed else None for r in runs["grouped"]]
        print(f"grouped hit rate / allowed: {med(rates, 2) if allowed else '- (the data allows no cache hit)'}")
    for arm in ("grouped", "ungrouped"):
        if runs.get(arm):
            print(f"{arm} job's grouping decision: {' | '.join(sorted({r['grouping'] for r in runs[arm]}))}")
    if runs.get("sorted") and runs.get("vllm"):
        pairs = list(zip(runs["sorted"], runs["vllm"]))
        print(
            f"sorted / vllm gen tok/s (wall), per round: {med([v['wall'] / s['wall'] for s, v in pairs], 2)}; "
            f"steady: {med([v['engine_seconds'] / s['engine_seconds'] for s, v in pairs], 2)} "
            "(the most any order of these rows gives this engine)"
        )
    blocks = {r.get("kv_cache_blocks") for r in runs.get("vllm", [])}
    if blocks:
        print(f"vllm's engine reported {' / '.join(map(str, blocks))} KV cache blocks (asked: {cache['blocks']})")


# ---------------------------------------------------------------- main


def prepare(workdir: Path, args) -> tuple[dict, dict, dict]:
    """The data sets' files and figures, the KV cache, and each data set's configs."""
    from transformers import AutoTokenizer

    from pipeline.tools.demo import trained_kit

    models = trained_kit()
    if models is None:
        raise SystemExit("the trained kit is needed (models/tinykit)")
    tokenizer = AutoTokenizer.from_pretrained(models["target"])
    rows = {k: make_dataset(k, tokenizer, args.scale) for k in sorted({"a", *args.datasets})}
    figures = {k: prefix_figures(tokenizer([p for _, p in r]).input_ids) for k, r in rows.items()}
    per_token = kv_bytes_per_token(models["target"]) + (kv_bytes_per_token(models["drafter"]) if args.drafter else 0)
    print(
        f"KV cache: {per_token:,} bytes per token (K and V in fp32 of every layer of the target"
        f"{' and the drafter' if args.drafter else ''}, from config.json), blocks of {BLOCK} tokens"
    )
    caches, configs = {}, {}
    for k in args.datasets:
        caches[k] = size_cache(k, figures, per_token, args)
        write_shards(workdir / DATASETS[k] / "in", rows[k])
        configs[k] = write_configs(workdir / DATASETS[k], models, caches[k], args)
    return figures, caches, configs


def size_cache(key: str, figures: dict, per_token: int, args) -> dict:
    """A quarter (--kv-fraction) of the data set's distinct prefix tokens; (c), which shares
    nothing to size a cache by, gets (a)'s. The same bytes in each of the data set's runs."""
    sized_by = "a" if key == "c" else key
    cache = kv_cache(figures[sized_by]["distinct_prefix_tokens"], args.kv_fraction, {key: figures[key]})
    cache.update(bytes=cache["blocks"] * BLOCK * per_token, per_token=per_token)
    print(
        f"({key}) {DATASETS[key]}: {cache['blocks']} blocks = {args.kv_fraction:.0%} of ({sized_by})'s "
        f"{figures[sized_by]['distinct_prefix_tokens']:,} distinct prefix tokens, {cache['bytes']:,} bytes; "
        f"{kv_line(cache, figures[key])}"
    )
    if cache["raised"]:
        print(
            f"  raised to {cache['blocks']} blocks: vLLM refuses a cache smaller than one request of max_model_len "
            f"({MAX_MODEL_LEN})"
        )
    if cache["max_num_seqs"] < MAX_NUM_SEQS:
        print(
            f"  max_num_seqs {cache['max_num_seqs']} instead of {MAX_NUM_SEQS}: {MAX_NUM_SEQS} requests of up to "
            f"{cache['per_seq']} blocks (longest prompt + {MAX_TOKENS}) would not fit in {cache['blocks']} blocks"
        )
    print(
        f"  while the engine is full, its {cache['max_num_seqs']} running requests hold up to "
        f"{cache['max_num_seqs'] * cache['per_seq']} of the {cache['blocks']} blocks"
    )
    return cache


def check_identical(configs: dict[str, dict[str, str]]) -> None:
    for key, paths in configs.items():
        texts = {}
        for arm in ("grouped", "ungrouped"):
            run = run_arm(arm, paths)
            rate = hit_rate(run)
            print(
                f"  ({key}) {arm}: {run['wall']:.1f} s, hit rate {'not known' if rate is None else f'{rate:.3f}'}; "
                f"{run['grouping']}",
                flush=True,
            )
            texts[arm] = outputs_by_id(paths[arm])
        g, u = texts["grouped"], texts["ungrouped"]
        differ = sorted(i for i in g.keys() & u.keys() if g[i] != u[i])
        print(
            f"({key}) {DATASETS[key]}: {len(differ)} of {len(g.keys() & u.keys())} rows differ between grouped and "
            f"ungrouped (greedy){'; first: ' + ', '.join(differ[:5]) if differ else ''}; "
            f"{len(g.keys() ^ u.keys())} ids in one only"
        )


def main() -> None:
    global BLOCK
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default="a,b,c", help="a (passages), b (judging), c (unique), comma-separated")
    parser.add_argument(
        "--kinds", default=",".join(ARMS), help="which runs, comma-separated (ratios need grouped and the other)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--scale", type=float, default=1.0, help="row counts times this (e.g. 0.03125: 64 rows per data set)"
    )
    parser.add_argument("--drafter", action="store_true", help="the kit's EAGLE-3.1 drafter (k=3) in every run")
    parser.add_argument(
        "--kv-fraction", type=float, default=0.25, help="the KV cache as a share of (a)'s distinct prefix tokens"
    )
    parser.add_argument("--rows-per-unit", type=int, default=64, help="specbatch's units, and Ray Data LLM's batches")
    parser.add_argument(
        "--block-size",
        type=int,
        default=BLOCK,
        help="KV cache block in tokens, every run (vLLM's CPU build: a multiple of 32, default 128)",
    )
    parser.add_argument(
        "--check-identical", action="store_true", help="grouped and ungrouped once each; compare outputs"
    )
    parser.add_argument("--child", nargs=2, metavar=("KIND", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    BLOCK = args.block_size
    if args.child:
        kind, config = args.child
        print("RESULT " + json.dumps(CHILD_RUNS[kind](config)), flush=True)
        return
    args.datasets = [k for k in DATASETS if k in args.datasets.split(",")]
    kinds = ("grouped", "ungrouped") if args.check_identical else tuple(a for a in ARMS if a in args.kinds.split(","))
    workdir = Path(tempfile.mkdtemp(prefix="specbatch-prefix-"))
    print(f"work folder {workdir}", flush=True)
    figures, caches, configs = prepare(workdir, args)
    if args.check_identical:
        check_identical(configs)
        return
    for key in args.datasets:
        runs: dict[str, list[dict]] = {a: [] for a in kinds}
        for r in range(args.rounds):
            for arm in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                runs[arm].append(run_arm(arm, configs[key]))
                print(f"  round {r + 1} ({key}) {arm}: {runs[arm][-1]['wall']:.1f} s", flush=True)
        report(key, figures[key], caches[key], runs)
        (workdir / f"runs-{key}.json").write_text(json.dumps(runs, default=str))
    if "raydatallm" in kinds:
        print(f"\nraydatallm's hit rate is not known: {RAYDATA_CACHED}")


if __name__ == "__main__":
    main()

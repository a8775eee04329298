"""One engine at one speculation depth over a set of prepared prompts: tokens/s and acceptance
at a chosen concurrency. `specbatch check-drafter --probe` runs it; `specbatch calibrate` runs it
per depth, each in its own process, so every engine starts clean. A job's probe runs on the
job's own engine and shares `figures`."""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional, Sequence

from pipeline.config import JobConfig
from pipeline.stages.stats import Acceptance

WARMUP_PROMPTS = 4  # a short untimed warm-up: the first steps of an engine are slow


def concurrency_sample(prompts: Sequence[Any], concurrency: Optional[int]) -> list:
    """The prompts measured at one concurrency: all of them at once (None), or enough to keep
    `concurrency` sequences running for a while (twice as many, at least 8)."""
    if concurrency is None:
        return list(prompts)
    return list(prompts[: max(2 * concurrency, 8)])


def generate_at_concurrency(
    llm, token_prompts: list, params: list, concurrency: Optional[int], loras: Optional[list] = None
) -> list:
    """Outputs in prompt order, with at most `concurrency` requests in the engine: a new one is
    added as soon as one finishes, as in an offline job's steady state. None: all at once.
    `loras`: each prompt's LoRARequest (None: the base model)."""
    loras = loras or [None] * len(token_prompts)
    if concurrency is None or concurrency >= len(token_prompts):
        return llm.generate(token_prompts, params, use_tqdm=False, lora_request=loras)
    engine, waiting, outputs = llm.llm_engine, list(range(len(token_prompts))), {}
    running = 0
    while waiting or running:
        while waiting and running < concurrency:
            i = waiting.pop(0)
            engine.add_request(f"calibrate-{i}", token_prompts[i], params[i], lora_request=loras[i])
            running += 1
        for output in engine.step():
            if output.finished:
                outputs[int(output.request_id.split("-", 1)[1])] = output
                running -= 1
    return [outputs[i] for i in range(len(token_prompts))]


def measure_depth(
    config: JobConfig,
    depth: Optional[int],
    prompts: Sequence[dict[str, Any]],
    repeats: int = 1,
    concurrencies: Sequence[Optional[int]] = (None,),
) -> list[dict[str, Any]]:
    """Runs in a fresh process: one engine at this depth (0 = off), a warm-up, then per
    concurrency the sample `repeats` times. With a depth schedule in the config, depth None
    measures it."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from pipeline.stages.engine import engine_kwargs, lora_requests, prepare_process_env

    prepare_process_env(config)
    engine_started = time.perf_counter()
    llm = LLM(**engine_kwargs(config, speculative=depth != 0, num_speculative_tokens=depth or None))
    engine_start_seconds = time.perf_counter() - engine_started
    llm.generate(
        [TokensPrompt(prompt_token_ids=p["prompt_token_ids"]) for p in prompts[:WARMUP_PROMPTS]],
        SamplingParams(max_tokens=4, temperature=0.0),
        use_tqdm=False,
    )
    adapters = lora_requests(config)
    results = [_measure_at(llm, prompts, concurrency, repeats, adapters) for concurrency in concurrencies]
    for result in results:
        result.update(depth=depth, engine_start_seconds=engine_start_seconds)
    llm.llm_engine.engine_core.shutdown()  # the engine's processes and memory go now, not at interpreter exit
    return results


def _measure_at(
    llm, prompts: Sequence[dict[str, Any]], concurrency: Optional[int], repeats: int, adapters: dict
) -> dict[str, Any]:
    """The sample at one concurrency, `repeats` times, each row on its own adapter (`adapters`:
    LoRARequest by name). Every run's time is kept: a speedup carries the spread they allow
    (pipeline/speculation/policy.py); `seconds` is their median."""
    from vllm.inputs import TokensPrompt

    from pipeline.stages.sampling import row_sampling_params

    sample = concurrency_sample(prompts, concurrency)
    params = [row_sampling_params(p) for p in sample]
    token_prompts = [TokensPrompt(prompt_token_ids=p["prompt_token_ids"]) for p in sample]
    return timed_runs(llm, token_prompts, params, concurrency, repeats, [adapters.get(p.get("lora")) for p in sample])


def timed_runs(
    llm, token_prompts: list, params: list, concurrency: Optional[int], repeats: int, loras: Optional[list] = None
) -> dict[str, Any]:
    """The prompts generated `repeats` times at `concurrency`, every run timed and kept, each from
    an empty prefix cache: a repeat would otherwise find its prompts cached, as no job's first
    pass does."""
    runs, outputs = [], []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        started = time.perf_counter()
        outputs = generate_at_concurrency(llm, token_prompts, params, concurrency, loras)
        runs.append(time.perf_counter() - started)
    return {
        "concurrency": concurrency or len(outputs),
        **figures(outputs, statistics.median(runs)),
        "seconds_runs": runs,
    }


def figures(outputs: Sequence[Any], seconds: float) -> dict[str, Any]:
    """Tokens and acceptance of finished RequestOutputs generated in `seconds`."""
    acceptance = Acceptance()
    for output in outputs:
        for completion in output.outputs:  # every one of n samples drafted
            acceptance = acceptance + Acceptance.from_request(completion.spec_decode_metrics)
    return {
        "prompts": len(outputs),
        "completions": sum(len(o.outputs) for o in outputs),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outputs),  # served from vLLM's prefix cache
        "generated_tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs),
        "seconds": seconds,
        "num_drafts": acceptance.num_drafts,
        "draft_tokens": acceptance.draft_tokens,
        "accepted_tokens": acceptance.accepted_tokens,
        "accepted_per_position": acceptance.accepted_per_position,
    }

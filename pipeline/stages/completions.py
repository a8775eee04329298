"""A finished vLLM request as output rows: one per sample (`sampling.n`), each with its text,
finish and stop reasons, its own acceptance counts, its logprobs when asked for, whether it
parses under the row's response_format, and its reasoning split off by a reasoning parser.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from pipeline.stages.stats import Acceptance
from pipeline.stages.structured import parse_check


def logprob_entries(token_ids, positions, k: int, decode: Callable[[int], str]) -> list[dict[str, Any]]:
    """vLLM's per-position {token id: Logprob} as TokenLogprob rows (schemas): the token at each
    position with its logprob, and the k most likely tokens there. A position vLLM has no
    logprobs for (the prompt's first token) has logprob null."""
    entries = []
    for token_id, position in zip(token_ids, positions):
        if position is None:
            entries.append({"token_id": token_id, "token": decode(token_id), "logprob": None, "top_logprobs": []})
            continue
        chosen = position.get(token_id)
        ranked = sorted(
            ((t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= k), key=lambda e: e[1].rank
        )
        entries.append(
            {
                "token_id": token_id,
                "token": chosen.decoded_token if chosen and chosen.decoded_token is not None else decode(token_id),
                "logprob": chosen.logprob if chosen else None,
                "top_logprobs": [
                    {
                        "token_id": t,
                        "token": lp.decoded_token if lp.decoded_token is not None else decode(t),
                        "logprob": lp.logprob,
                    }
                    for t, lp in ranked
                ],
            }
        )
    return entries


def reasoning_parser(name: Optional[str], tokenizer):
    """One of vLLM's reasoning parsers over the model's tokenizer; None without a name. Raises
    KeyError for a name vLLM does not know, and the parser's own error when the tokenizer lacks
    its markers (e.g. deepseek_r1 without <think> tokens)."""
    if name is None:
        return None
    from vllm.reasoning import ReasoningParserManager

    if name not in ReasoningParserManager.list_registered():
        raise KeyError(
            f"{name!r} is not one of vLLM's reasoning parsers: "
            f"{', '.join(sorted(ReasoningParserManager.list_registered()))}"
        )
    return ReasoningParserManager.get_reasoning_parser(name)(tokenizer)


def split_reasoning(parser, text: str) -> tuple[Optional[str], str]:
    """(reasoning, answer) by one of vLLM's reasoning parsers; (None, text) without one."""
    if parser is None:
        return None, text
    reasoning, content = parser.extract_reasoning(text, None)
    return reasoning, content or ""


def output_rows(
    result, sampling: dict[str, Any], decode: Callable[[int], str], reasoning_parser=None
) -> tuple[list[dict], Acceptance]:
    """The rows of one finished request (without the columns every row of the unit shares) and
    its acceptance over every sample: vLLM keeps speculative-decoding metrics per sample."""
    rows, total = [], Acceptance()
    prompt_ids = result.prompt_token_ids or []
    prompt_logprobs = None
    if sampling.get("prompt_logprobs") is not None and result.prompt_logprobs is not None:
        prompt_logprobs = logprob_entries(prompt_ids, result.prompt_logprobs, sampling["prompt_logprobs"], decode)
    for completion in sorted(result.outputs, key=lambda c: c.index):
        acceptance = Acceptance.from_request(completion.spec_decode_metrics)
        total = total + acceptance
        reasoning, text = split_reasoning(reasoning_parser, completion.text)
        parsed, parse_error = parse_check(sampling.get("response_format"), text)
        logprobs = None
        if sampling.get("logprobs") is not None and completion.logprobs is not None:
            logprobs = logprob_entries(completion.token_ids, completion.logprobs, sampling["logprobs"], decode)
        rows.append(
            {
                "sample_index": completion.index,
                "text": text,
                "finish_reason": completion.finish_reason or "unknown",
                "stop_reason": None if completion.stop_reason is None else str(completion.stop_reason),
                "parsed": parsed,
                "parse_error": parse_error,
                "reasoning": reasoning,
                "logprobs": logprobs,
                "prompt_logprobs": prompt_logprobs if completion.index == 0 else None,  # once per prompt
                "prompt_tokens": len(prompt_ids),
                "generated_tokens": len(completion.token_ids),
                "draft_tokens": acceptance.draft_tokens,
                "accepted_tokens": acceptance.accepted_tokens,
                "num_drafts": acceptance.num_drafts,
                "mean_acceptance_length": acceptance.mean_acceptance_length or 1.0,
            }
        )
    return rows, total

"""An offline simulator of vLLM's greedy EAGLE-3 speculative decoding, using the
training-side drafter (drafter.py) and the HF target. It reproduces vLLM's loop:

  prefill -> first token; then repeat until max_tokens: the drafter proposes k tokens
  (first pass over the whole sequence: position i gets token i+1 and the target's aux
  state at i; then k-1 chained steps fed the drafter's own output hidden state and its
  draft token), the target verifies greedily, accepted + 1 tokens are appended.

vLLM counts accepted drafts that run past max_tokens, so the reference continuation is
extended by k tokens. Used for quick acceptance estimates during the build and to test
that the training-side drafter matches vLLM's (tests/test_tinykit.py).
"""

from __future__ import annotations

import torch

from .drafter import DraftAttention, Eagle3Drafter
from .model import greedy_generate, target_forward


@torch.no_grad()
def propose(target, drafter: Eagle3Drafter, seq: list[int], k: int) -> list[int]:
    ids = torch.tensor([seq])
    _, aux = target_forward(target, ids[:, :-1], drafter.c.aux_layer_ids)
    embed = target.model.embed_tokens
    T = ids.shape[1] - 1
    pos = torch.arange(T)[None]
    attn = DraftAttention()
    hidden = drafter.combine_hidden_states(aux)
    tokens = ids[:, 1:]
    drafts = []
    for j in range(k):
        h, hidden = drafter(embed(tokens), pos + j, hidden, attn)
        d = int(drafter.compute_logits(h[0, -1]).argmax())
        drafts.append(d)
        tokens = torch.full((1, T), d)
    return drafts


@torch.no_grad()
def simulate(target, drafter: Eagle3Drafter, prompt: list[int], max_tokens: int, k: int) -> dict:
    ref = greedy_generate(target, torch.tensor([prompt]), max_tokens + k)[0, len(prompt) :].tolist()
    seq, gen = list(prompt) + ref[:1], 1
    per_pos, drafts, steps = [0] * k, 0, []
    while gen < max_tokens:
        d = propose(target, drafter, seq, k)
        a = 0
        while a < k and d[a] == ref[gen + a]:
            a += 1
        for i in range(a):
            per_pos[i] += 1
        drafts += 1
        steps.append(a)
        seq += ref[gen : gen + a + 1]
        gen += a + 1
    return {"num_drafts": drafts, "accepted_per_pos": per_pos, "per_step_accepted": steps, "output": ref[:max_tokens]}

"""Training: the target (next-token LM on the corpus) and the drafters (training-time
test against the target's own hidden states and greedy continuations).

Everything is seeded; the data for drafter training is produced by the target with its
weights already rounded to the stored dtype, so the drafter sees exactly what vLLM will.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .drafter import Eagle3Drafter
from .model import greedy_generate, target_forward


def log(msg: str) -> None:
    print(f"[tinykit {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def random_windows(stream: torch.Tensor, n: int, length: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length, (n,), generator=g)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


# ---------------------------------------------------------------- target
def autocast(dtype: str | None):
    """bf16 autocast roughly halves a training step on AVX-512-bf16 CPUs; master weights,
    losses and everything saved stay fp32 (then rounded to the stored dtype)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=(dtype == "bfloat16"))


def train_target(
    model,
    stream: torch.Tensor,
    *,
    steps: int,
    batch: int,
    seq: int,
    lr: float,
    seed: int,
    eval_stream: torch.Tensor | None = None,
    amp: str | None = None,
) -> dict:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    t0, first = time.time(), None
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=max(1, steps // 20))
        x = random_windows(stream, batch, seq + 1, g)
        with autocast(amp):
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        first = first if first is not None else loss.item()
        if step % 50 == 0 or step == steps - 1:
            log(f"target step {step}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    model.eval()
    out = {"loss_first": round(first, 4), "loss_last": round(loss.item(), 4)}
    if eval_stream is not None:
        out["held_out_loss"] = round(eval_loss(model, eval_stream, seq, seed), 4)
    return out


@torch.no_grad()
def eval_loss(model, stream: torch.Tensor, seq: int, seed: int, n: int = 32) -> float:
    x = random_windows(stream, n, seq + 1, torch.Generator().manual_seed(seed + 7))
    logits = model(input_ids=x[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).item()


# ---------------------------------------------------------------- drafter data
@dataclass
class DrafterData:
    tokens: torch.Tensor  # [N, S] prompt (P tokens of corpus text) + greedy continuation
    aux: torch.Tensor  # [N, S, n*H] target aux states (vLLM convention), fp16 to save RAM
    top_ids: torch.Tensor  # [N, S, K] target's top-K next-token ids at each position
    top_p: torch.Tensor  # [N, S, K] their probabilities
    prompt_len: int


@torch.no_grad()
def make_drafter_data(
    target,
    stream: torch.Tensor,
    *,
    n: int,
    prompt_len: int,
    gen_len: int,
    aux_layer_ids,
    seed: int,
    topk: int = 16,
    gen_batch: int = 128,
) -> DrafterData:
    g = torch.Generator().manual_seed(seed)
    prompts = random_windows(stream, n, prompt_len, g)
    t0 = time.time()
    seqs = torch.cat([greedy_generate(target, prompts[i : i + gen_batch], gen_len) for i in range(0, n, gen_batch)])
    log(f"drafter data: {n} greedy continuations of {gen_len} tokens ({time.time() - t0:.0f}s)")
    aux, ids, ps = [], [], []
    for i in range(0, n, 64):
        logits, a = target_forward(target, seqs[i : i + 64], aux_layer_ids)
        p, idx = torch.softmax(logits, -1).topk(topk, dim=-1)
        aux.append(a.half()), ids.append(idx), ps.append(p)
    log(f"drafter data: aux states and top-{topk} targets ({time.time() - t0:.0f}s)")
    return DrafterData(seqs, torch.cat(aux), torch.cat(ids), torch.cat(ps), prompt_len)


def choose_draft_vocab(data: DrafterData, stream: torch.Tensor, size: int) -> tuple[torch.Tensor, float]:
    """The `size` target ids the target predicts most often (greedy), ties by corpus
    frequency then id; returns (ids sorted, coverage of the target's greedy predictions)."""
    vocab = int(max(data.top_ids.max(), stream.max())) + 1
    pred = torch.bincount(data.top_ids[..., 0].reshape(-1), minlength=vocab).double()
    corpus = torch.bincount(stream, minlength=vocab).double()
    score = pred * 1e9 + corpus * 1e-3 - torch.arange(vocab).double() * 1e-12
    ids = score.topk(size).indices.sort().values
    coverage = (pred[ids].sum() / pred.sum()).item()
    return ids, coverage


# ---------------------------------------------------------------- drafter
def train_drafter(
    drafter: Eagle3Drafter,
    embed: torch.nn.Embedding,
    data: DrafterData,
    *,
    steps: int,
    batch: int,
    lr: float,
    ttt_steps: int,
    seed: int,
    step_decay: float = 0.8,
    amp: str | None = None,
) -> dict:
    """Soft cross-entropy against the target's (top-K) distribution, unrolled over
    `ttt_steps` draft steps weighted step_decay**j. Step 0 trains at every position;
    later steps only where the tokens fed as drafts are the target's greedy continuation."""
    N, S = data.tokens.shape
    T = S - ttt_steps
    t2d = torch.full((drafter.c.vocab_size,), -1, dtype=torch.long)
    t2d[drafter.draft_to_target()] = torch.arange(drafter.c.draft_vocab_size)
    idx = torch.arange(T)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(
        [p for p in drafter.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95), weight_decay=0.0
    )
    embed.requires_grad_(False)
    drafter.train()
    t0 = time.time()
    hist = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=max(1, steps // 20))
        b = torch.randint(0, N, (batch,), generator=g)
        tokens, aux = data.tokens[b], data.aux[b, :T].float()
        with autocast(amp):
            outs = drafter.unroll(embed, aux, tokens, ttt_steps)
        loss, accs = 0.0, []
        for j, logits in enumerate(outs):
            ids = t2d[data.top_ids[b, j + 1 : j + 1 + T]]  # [B, T, K] draft ids
            p = data.top_p[b, j + 1 : j + 1 + T] * (ids >= 0)
            p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
            logq = torch.log_softmax(logits.float(), -1).gather(-1, ids.clamp_min(0))
            ce = -(p * logq).sum(-1)  # [B, T]
            mask = torch.ones_like(ce) if j == 0 else (idx >= data.prompt_len - 2).float().expand_as(ce)
            loss = loss + step_decay**j * (ce * mask).sum() / mask.sum()
            hit = (logits.argmax(-1) == ids[..., 0]).float()
            accs.append(((hit * mask).sum() / mask.sum()).item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        hist.append(accs)
        if step % 50 == 0 or step == steps - 1:
            log(
                f"drafter step {step}/{steps} loss {loss.item():.3f} acc/step "
                f"{[round(a, 3) for a in accs]} ({time.time() - t0:.0f}s)"
            )
    drafter.eval()
    last = hist[-10:]
    return {
        "loss_last": round(loss.item(), 4),
        "train_acc_per_step": [round(sum(h[j] for h in last) / len(last), 4) for j in range(ttt_steps)],
    }

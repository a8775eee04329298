"""Training-side EAGLE-3 / EAGLE-3.1 drafter, a one-to-one mirror of vLLM's
``vllm/model_executor/models/llama_eagle3.py`` (``Eagle3LlamaForCausalLM``, one layer).

Same parameter names as the checkpoint vLLM loads (``fc``, ``fc_norm.{i}``, ``midlayer.*``
with separate q/k/v and gate/up projections, ``norm``, ``lm_head``, ``d2t``), same
forward:

  combine_hidden_states(aux)   [fc_norm per aux chunk (3.1)] -> fc      (target aux states only)
  layer 0:  e = input_layernorm(embed(token))
            residual = h; h = hidden_norm(h)          (norm_before_residual=False)
            h = attn(cat[e, h]); h, residual = post_attention_layernorm(h, residual)
            h = mlp(h)
  h, prenorm = norm(h, residual)
  returns (h, h if norm_output else prenorm)     the 2nd is fed to the next draft step
  compute_logits: lm_head over the draft vocab, scattered to target ids via d2t, -inf elsewhere.

Attention is given by a ``DraftAttention`` context that reproduces what vLLM's KV cache
holds: the first pass is causal over the sequence; at draft step j the chain started at
index i (query at position i + j) sees the first-pass keys 0..i plus its own keys from
steps 1..j. Training unrolls all chains in parallel (training-time test).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DrafterConfig:
    hidden_size: int = 256
    intermediate_size: int = 768
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024
    vocab_size: int = 2048
    draft_vocab_size: int = 1024
    target_hidden_size: int = 256
    aux_layer_ids: tuple[int, ...] = (1, 2, 4)
    fc_norm: bool = True  # EAGLE-3.1
    norm_output: bool = True  # EAGLE-3.1
    norm_before_residual: bool = False

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d


class RMSNorm(nn.Module):
    """vLLM's RMSNorm (forward_native), including the fused residual add."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, residual=None):
        dtype = x.dtype
        x = x.float()
        if residual is not None:
            x = x + residual.float()
            residual = x.to(dtype)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = x.to(dtype) * self.weight
        return x if residual is None else (x, residual)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (vLLM's Llama default). x: [B, T, heads, D]; positions [B, T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    cos, sin = freqs.cos()[:, :, None, :], freqs.sin()[:, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DraftAttention:
    """The KV cache as vLLM's drafter sees it, for all chains of a batch at once."""

    def __init__(self):
        self.k0 = self.v0 = None
        self.ks: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []

    def __call__(self, q, k, v, scale):
        # q: [B, H, T, D]; k, v: [B, H, T, D] (kv heads already repeated)
        if self.k0 is None:  # first pass: causal over the sequence
            self.k0, self.v0 = k, v
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        self.ks.append(k)
        self.vs.append(v)
        T = q.shape[2]
        s0 = torch.matmul(q, self.k0.transpose(-1, -2)) * scale  # [B,H,T,T]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        s0 = s0.masked_fill(~causal, float("-inf"))
        s_own = torch.stack([(q * kj).sum(-1) for kj in self.ks], dim=-1) * scale  # [B,H,T,j]
        p = torch.softmax(torch.cat([s0, s_own], dim=-1).float(), dim=-1).to(q.dtype)
        out = torch.matmul(p[..., :T], self.v0)
        for j, vj in enumerate(self.vs):
            out = out + p[..., T + j, None] * vj
        return out


class Attention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, positions, x, attn: DraftAttention):
        c = self.c
        B, T, _ = x.shape
        q = rope(self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim), positions, c.rope_theta)
        k = rope(self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim), positions, c.rope_theta)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)
        rep = c.num_attention_heads // c.num_key_value_heads
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = attn(q, k, v, c.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, positions, embeds, hidden, attn):
        embeds = self.input_layernorm(embeds)
        if self.c.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        h = self.self_attn(positions, torch.cat([embeds, hidden], dim=-1), attn)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Eagle3Drafter(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        n = len(c.aux_layer_ids)
        self.fc_norm = (
            nn.ModuleList([RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(n)]) if c.fc_norm else None
        )
        self.fc = nn.Linear(n * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # draft id -> target id offset (target = draft + d2t); t2d marks target ids in the draft vocab
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    def set_draft_vocab(self, draft_to_target: torch.Tensor) -> None:
        ids = torch.as_tensor(draft_to_target, dtype=torch.long)
        assert ids.numel() == self.c.draft_vocab_size
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(self.c.draft_vocab_size) + self.d2t

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """aux: the target's aux states concatenated in sorted-layer-id order [..., n*Ht]."""
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(ch) for norm, ch in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def forward(self, embeds, positions, hidden, attn: DraftAttention):
        """One drafter pass (vLLM's LlamaModel.forward): returns (normed, aux_output)."""
        h, residual = self.midlayer(positions, embeds, hidden, attn)
        h, prenorm = self.norm(h, residual)
        return h, (h if self.c.norm_output else prenorm)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocab, -inf outside the draft vocab (vLLM's compute_logits)."""
        logits = self.lm_head(h)
        full = logits.new_full((*logits.shape[:-1], self.c.vocab_size), float("-inf"))
        full[..., self.draft_to_target()] = logits
        return full

    def unroll(self, embed: nn.Embedding, aux: torch.Tensor, tokens: torch.Tensor, steps: int):
        """Training-time test over all chains of a batch.

        aux: [B, T, n*Ht] target aux states at positions 0..T-1; tokens: [B, T + steps]
        token ids (position p of the first pass gets tokens[:, p + 1]; step j at chain i gets
        tokens[:, i + j + 1], i.e. the accepted continuation).
        Returns a list of draft-vocab logits [B, T, Vd], one per step; step j at index i
        predicts tokens[:, i + j + 2].
        """
        B, T, _ = aux.shape
        attn = DraftAttention()
        pos = torch.arange(T, device=aux.device).expand(B, T)
        hidden = self.combine_hidden_states(aux)
        outs = []
        for j in range(steps):
            emb = embed(tokens[:, j + 1 : j + 1 + T])
            h, hidden = self(emb, pos + j, hidden, attn)
            outs.append(self.lm_head(h))
        return outs

"""The target: a small Llama (transformers' LlamaForCausalLM, so vLLM loads it as is),
and its auxiliary hidden states exactly as vLLM hands them to an EAGLE-3 drafter.

vLLM's aux id i is the residual stream ENTERING decoder layer i (hidden + residual,
before any norm): id 0 is the embeddings, id L the last layer's output before the final
norm. transformers' ``output_hidden_states[L]`` is after the final norm, so we use forward
hooks on the decoder layers instead. Ids are sorted and de-duplicated, like vLLM.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def target_config(
    vocab_size: int = 2048,
    hidden_size: int = 256,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 768,
    max_position_embeddings: int = 1024,
    bos_token_id: int = 0,
    eos_token_id: int = 0,
) -> LlamaConfig:
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=hidden_size // num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        initializer_range=0.02,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def new_target(cfg: LlamaConfig, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    model.config.use_cache = False
    return model


def round_weights_(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round every floating parameter to `dtype` and back, in place (what is saved)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).to(p.dtype))


@torch.no_grad()
def target_forward(model: LlamaForCausalLM, input_ids: torch.Tensor, aux_layer_ids) -> tuple:
    """Returns (logits [B,T,V], aux [B,T,n*H]) with vLLM's aux-state convention."""
    ids = sorted(set(aux_layer_ids))
    layers = model.model.layers
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    if 0 in ids:
        hooks.append(model.model.embed_tokens.register_forward_hook(lambda m, a, out: captured.__setitem__(0, out)))
    for i in ids:
        if i >= 1:

            def hook(m, a, out, i=i):
                captured[i] = out[0] if isinstance(out, tuple) else out

            hooks.append(layers[i - 1].register_forward_hook(hook))
    try:
        logits = model(input_ids=input_ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    return logits.float(), torch.cat([captured[i].float() for i in ids], dim=-1)


@torch.no_grad()
def greedy_generate(model: LlamaForCausalLM, prompts: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy continuation of equal-length prompts [B, P] -> [B, P + max_new_tokens] (no EOS stop)."""
    out = model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        use_cache=True,
        pad_token_id=model.config.pad_token_id,
    )
    return out

"""A LoRA adapter for a Llama-style target, written by hand in PEFT's format (no peft needed):
adapter_config.json and adapter_model.safetensors with tensors named as vLLM parses them
(`vllm/lora/utils.py`, parse_fine_tuned_lora_name):

    base_model.model.model.layers.{i}.self_attn.{q,v}_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.{q,v}_proj.lora_B.weight   [out, r]

lora_B is random and nonzero (PEFT initialises it to zero, which would change nothing), so the
adapted model's greedy output differs from the base model's. The delta is
(lora_alpha / r) * B @ A added to each projection's weight.
"""

from __future__ import annotations

import json
from pathlib import Path

PROJ_SHAPES = {  # module: (in, out) from a Llama config
    "q_proj": lambda c, hd: (c["hidden_size"], c["num_attention_heads"] * hd),
    "k_proj": lambda c, hd: (c["hidden_size"], c["num_key_value_heads"] * hd),
    "v_proj": lambda c, hd: (c["hidden_size"], c["num_key_value_heads"] * hd),
    "o_proj": lambda c, hd: (c["num_attention_heads"] * hd, c["hidden_size"]),
}


def write_lora_adapter(
    target_path: str,
    out_dir: str,
    rank: int = 8,
    seed: int = 0,
    target_modules: tuple[str, ...] = ("q_proj", "v_proj"),
    scale: float = 0.05,
    lora_alpha: int | None = None,
) -> str:
    """Write a random LoRA adapter for the Llama model at `target_path` into `out_dir`;
    returns `out_dir`. Entries of A and B are N(0, scale^2)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(target_path) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(config["num_hidden_layers"]):
        for module in target_modules:
            d_in, d_out = PROJ_SHAPES[module](config, head_dim)
            prefix = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * scale
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(Path(target_path).resolve()),
                "r": rank,
                "lora_alpha": lora_alpha or 2 * rank,
                "lora_dropout": 0.0,
                "target_modules": list(target_modules),
                "bias": "none",
                "fan_in_fan_out": False,
                "inference_mode": True,
            },
            indent=2,
        )
        + "\n"
    )
    return str(out)

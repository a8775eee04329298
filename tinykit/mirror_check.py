"""Check that the training-side drafter (drafter.py) computes what vLLM's own drafter
module (vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM) computes, on the
same weights (loaded by vLLM's own loader from the saved checkpoint) and the same inputs
(the target's real aux states for a prompt).

vLLM's paged-attention kernel needs the engine's forward context, so inside vLLM's module
the attention op (``self_attn.attn``) is swapped for a plain KV cache: the first pass is
causal, each later draft step appends its key and attends to everything cached, exactly the
cache contents vLLM's proposer builds. Everything else (weight names and stacking, d2t,
fc_norm, hidden_norm/residual order, rotary embedding, fused norms, norm_output,
compute_logits) is vLLM's code. The engine itself is compared in tests/test_tinykit.py.

Runs in its own process (it initialises torch.distributed):
    python -m tinykit.mirror_check TARGET DRAFTER [DRAFTER...] [--steps 4]  -> JSON on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch


class PlainKVAttention(torch.nn.Module):
    """Stand-in for vLLM's Attention op: q [N, h*d], k/v [N, kvh*d] -> [N, h*d]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.h, self.kvh, self.d, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k = self.v = None

    def forward(self, q, k, v):
        n = q.shape[0]
        first = self.k is None
        self.k = k if first else torch.cat([self.k, k])
        self.v = v if first else torch.cat([self.v, v])
        rep = self.h // self.kvh
        qh = q.view(n, self.h, self.d).transpose(0, 1)
        kh = self.k.view(-1, self.kvh, self.d).transpose(0, 1).repeat_interleave(rep, 0)
        vh = self.v.view(-1, self.kvh, self.d).transpose(0, 1).repeat_interleave(rep, 0)
        s = qh @ kh.transpose(-1, -2) * self.scale
        L = kh.shape[1]
        qpos = torch.arange(L - n, L)[:, None]
        s = s.masked_fill(torch.arange(L)[None, :] > qpos, float("-inf"))
        return (torch.softmax(s, -1) @ vh).transpose(0, 1).reshape(n, -1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@torch.no_grad()
def check(target_dir: str, drafter_dir: str, prompt: str, steps: int) -> dict:
    """One drafter; torch.distributed is initialised on the first call of the process."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    from .drafter import DraftAttention
    from .layout import load_drafter, load_target
    from .model import target_forward

    vc = EngineArgs(
        model=target_dir,
        speculative_config={"method": "eagle3", "model": drafter_dir, "num_speculative_tokens": steps},
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
    ).create_engine_config()
    with set_current_vllm_config(vc):
        if not torch.distributed.is_initialized():
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            )
            initialize_model_parallel(1, 1)
        vm = Eagle3LlamaForCausalLM(vllm_config=vc).float().eval()
        vm.load_weights(load_file(os.path.join(drafter_dir, "model.safetensors")).items())
        process_weights_after_loading(vm, vc.speculative_config.draft_model_config, torch.device("cpu"))
        sa = vm.model.layers[0].self_attn
        sa.attn = PlainKVAttention(sa.num_heads, sa.num_kv_heads, sa.head_dim, sa.scaling)

        ours = load_drafter(drafter_dir)
        target = load_target(target_dir)
        # vLLM's proposer shares the target's embedding with a drafter that has none
        vm.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        ids = AutoTokenizer.from_pretrained(target_dir)(prompt, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([ids])
        _, aux = target_forward(target, ids, ours.c.aux_layer_ids)  # aux at positions 0..T-1
        T = ids.shape[1] - 1
        embed = target.model.embed_tokens
        diffs: dict[str, float] = {}

        def md(name, a, b):
            diffs[name] = max(diffs.get(name, 0.0), (a.float() - b.float()).abs().max().item())

        # first pass: position i gets token i+1 and the target's aux state at i
        v_h = vm.combine_hidden_states(aux[0, :T])
        o_h = ours.combine_hidden_states(aux[:, :T])
        md("combine_hidden_states", v_h, o_h[0])
        pos = torch.arange(T)
        v_out, v_aux = vm(ids[0, 1:], pos, v_h)
        attn = DraftAttention()
        o_out, o_aux = ours(embed(ids[:, 1:]), pos[None], o_h, attn)
        md("first_pass_hidden", v_out, o_out[0])
        md("first_pass_aux_output", v_aux, o_aux[0])
        v_logits, o_logits = vm.compute_logits(v_out), ours.compute_logits(o_out[0])
        same_inf = bool(torch.equal(torch.isinf(v_logits), torch.isinf(o_logits)))
        fin = torch.isfinite(v_logits)
        md("logits", v_logits[fin], o_logits[fin])
        v_tok, o_tok = [int(v_logits[-1].argmax())], [int(o_logits[-1].argmax())]
        first_pass_argmax_equal = bool(torch.equal(v_logits.argmax(-1), o_logits.argmax(-1)))

        # later draft steps of the last chain, each fed its own draft token + aux output
        v_prev, o_prev = v_aux[-1:], o_aux
        for j in range(1, steps):
            v_out, v_prev = vm(torch.tensor([v_tok[-1]]), torch.tensor([T - 1 + j]), v_prev)
            o_out, o_prev = ours(embed(torch.full((1, T), o_tok[-1])), pos[None] + j, o_prev, attn)
            md(f"step{j}_hidden", v_out[0], o_out[0, -1])
            md(f"step{j}_aux_output", v_prev[0], o_prev[0, -1])
            v_tok.append(int(vm.compute_logits(v_out)[-1].argmax()))
            o_tok.append(int(ours.compute_logits(o_out[0, -1:])[-1].argmax()))
    return {
        "max_abs_diff": diffs,
        "same_inf_mask": same_inf,
        "first_pass_argmax_equal": first_pass_argmax_equal,
        "vllm_drafts": v_tok,
        "ours_drafts": o_tok,
        "prompt_tokens": ids.shape[1],
        "vllm_fc_norm": vm.model.fc_norm is not None,
        "vllm_norm_output": bool(vm.model.norm_output),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("drafters", nargs="+")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompt", default="import os\nimport sys\n\n\ndef main(argv=None):\n    parser = ")
    a = ap.parse_args(argv)
    res = {d: check(a.target, d, a.prompt, a.steps) for d in a.drafters}
    sys.stdout.write("MIRROR_CHECK " + json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

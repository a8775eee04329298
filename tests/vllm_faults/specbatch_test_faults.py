"""Fault injection for specbatch's tests, as a vLLM general plugin (vLLM loads general plugins
in every engine process). It is importable only where a test puts this folder on PYTHONPATH;
production code knows nothing of it.

SPECBATCH_TEST_POISON_TOKENS="id,id,...": EngineCore kills itself with SIGKILL when it is
given a request whose prompt holds that token sequence, the way a GPU fault, a CUDA OOM or
the kernel's OOM killer ends the engine on one poisoned request, every time it is tried.
"""

import os
import signal


def _contains(haystack, needle) -> bool:
    n = len(needle)
    return any(list(haystack[i : i + n]) == needle for i in range(len(haystack) - n + 1))


def register() -> None:
    poison = os.environ.get("SPECBATCH_TEST_POISON_TOKENS")
    if not poison:
        return
    needle = [int(t) for t in poison.split(",")]
    from vllm.v1.engine.core import EngineCore

    add_request = EngineCore.add_request

    def add_poisoned_request(self, request, *args, **kwargs):
        if _contains(request.prompt_token_ids or [], needle):
            os.kill(os.getpid(), signal.SIGKILL)
        return add_request(self, request, *args, **kwargs)

    EngineCore.add_request = add_poisoned_request

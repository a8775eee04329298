"""Fault injection for specbatch's tests, as a vLLM general plugin (vLLM loads general plugins
in every engine process). It is importable only where a test puts this folder on PYTHONPATH;
production code knows nothing of it.

SPECBATCH_TEST_POISON_TOKENS="id,id,...": EngineCore kills itself with SIGKILL when it is
given a request whose prompt holds that token sequence, the way a GPU fault, a CUDA OOM or
the kernel's OOM killer ends the engine on one poisoned request, every time it is tried.

SPECBATCH_TEST_FREEZE_EVERY=1: EngineCore stops (SIGSTOP) its own child processes and then
itself at its first request, the way a GPU or NCCL hang leaves an engine: alive, never
answering. Every engine started with it freezes.
"""

import os
import signal


def _contains(haystack, needle) -> bool:
    n = len(needle)
    return any(list(haystack[i : i + n]) == needle for i in range(len(haystack) - n + 1))


def _freeze_at_first_request() -> None:
    from vllm.v1.engine.core import EngineCore

    add_request = EngineCore.add_request

    def freeze(self, request, *args, **kwargs):
        import psutil

        for child in psutil.Process().children(recursive=True):
            child.send_signal(signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)
        return add_request(self, request, *args, **kwargs)

    EngineCore.add_request = freeze


def register() -> None:
    if os.environ.get("SPECBATCH_TEST_FREEZE_EVERY"):
        _freeze_at_first_request()
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

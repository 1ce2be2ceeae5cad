"""The server's child processes (scheduler, detokenizer): how they start, the endpoints joining
them, and what each does first: tie its life to the launcher.

They are started by the name of their entry point (`run_child`), so the launcher imports none of
their modules (torch, the model code) before starting them: their imports and the model load run
while the launcher imports its HTTP stack, instead of after it.

A child that outlives its launcher holds the model and its GPU memory with nobody to stop it (the
next server then fails with out-of-memory). Two independent ties, because either alone has a gap:
- Linux's parent-death signal (prctl PR_SET_PDEATHSIG): the kernel SIGKILLs the child the moment
  the launcher dies, even by SIGKILL. It is not inherited across fork and is tied to the thread
  that started the child, so it is set here, in the child, and checked once against a launcher
  that died before it was set.
- A watchdog thread that polls the parent's pid (every platform, and any gap in the first).
Ctrl-C in a terminal sends SIGINT to the whole process group: children ignore it and let the
launcher stop them in order.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

PR_SET_PDEATHSIG = 1
WATCHDOG_PERIOD_S = 0.5


@dataclass
class IpcPaths:
    """ZMQ endpoints of the three processes (ipc:// in a private temporary folder), and of the
    tensor-parallel ranks 1..N-1 that follow rank 0's scheduler (managers/rank_mirror.py)."""
    scheduler: str
    detokenizer: str
    tokenizer_manager: str
    rank_commands: list[str] = field(default_factory=list)


SCHEDULER_ENTRY = "sglang_shadowkv.managers.scheduler_process:run_scheduler_process"


def rank_process_name(rank: int, tp_size: int) -> str:
    return "sglang-shadowkv-scheduler" + (f" rank {rank}" if tp_size > 1 else "")


def rank_command_paths(folder: str, tp_size: int) -> list[str]:
    """Where tensor-parallel rank r > 0 listens for rank 0's calls (managers/rank_mirror.py)."""
    return [f"ipc://{folder}/rank{r}" for r in range(1, tp_size)]


def rendezvous(dist_init_addr: str | None) -> str:
    """Where the tensor-parallel ranks meet: --dist-init-addr, or a free port on this host."""
    if dist_init_addr:
        return f"tcp://{dist_init_addr}"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def run_child(entry_point: str, *args) -> None:
    """A multiprocessing target: import "package.module:function" here, in the child, and call it."""
    module, _, function = entry_point.partition(":")
    getattr(importlib.import_module(module), function)(*args)


def die_with_parent() -> None:
    """Call first thing in a multiprocessing child: it exits as soon as its parent is gone."""
    parent_pid = multiprocessing.parent_process().pid
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), name="parent-watchdog",
                     daemon=True).start()


def _set_parent_death_signal(sig: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:  # a child whose parent dies is re-parented
        time.sleep(WATCHDOG_PERIOD_S)
    os._exit(1)

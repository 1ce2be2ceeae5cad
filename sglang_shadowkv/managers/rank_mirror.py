"""Rank 0 shares every call that changes a scheduler with the other tensor-parallel ranks, so that
all of them take the same decisions (mini-sglang's arrangement: one scheduler per rank, rank 0
receives the requests and shares them).

Each rank runs a whole Scheduler over its share of the model. Rank 0's is wrapped in a
MirroredScheduler: the engine or the server loop calls it as it would a Scheduler; each call that
changes state (a request added or aborted, a step, a flush, the idle-time work) goes first, over
a ZMQ socket per rank, to the other ranks, which run it in `follow`; then it runs on rank 0.
Everything a scheduler decides follows from the calls it got and from its pools, which are of one
size on every rank (ModelRunner._same_on_every_rank), so the ranks' caches, evictions, demotions,
compressions and graph buckets stay identical. Two decisions come from outside a scheduler and
are taken by rank 0 alone and sent along: which compiled grammars join the queue (a thread
finishes compiling them whenever it does), and the sampled tokens (broadcast in the step). Only
rank 0 sends outputs on; the integrity check also compares the ranks' accounting
(scheduler/integrity.py).
"""

from __future__ import annotations

import logging

import zmq

from sglang_shadowkv.scheduler.scheduler import Scheduler
from sglang_shadowkv.scheduler.server_info import server_info

from .watchdog import StepWatchdog

logger = logging.getLogger(__name__)

SHUTDOWN = "shutdown"


class MirroredScheduler:
    """Rank 0's scheduler: reads pass through; calls that change state reach every rank."""

    def __init__(self, scheduler: Scheduler, command_paths: list[str]):
        self.scheduler = scheduler
        self._context = zmq.Context()
        self._sockets = []
        for path in command_paths:
            sock = self._context.socket(zmq.PUSH)
            sock.connect(path)
            self._sockets.append(sock)

    def __getattr__(self, name):
        return getattr(self.scheduler, name)

    def _share(self, call: str, *args) -> None:
        for sock in self._sockets:
            sock.send_pyobj((call, args))

    def add_request(self, *args):
        self._share("add_request", *args)
        return self.scheduler.add_request(*args)

    def abort(self, rid: str) -> bool:
        self._share("abort", rid)
        return self.scheduler.abort(rid)

    def step(self):
        ready = self.scheduler.grammars_ready()
        self._share("step", ready)
        return self.scheduler.step(ready)

    def flush_cache(self) -> bool:
        self._share("flush_cache")
        return self.scheduler.flush_cache()

    def run_when_idle(self) -> None:
        self._share("run_when_idle")
        self.scheduler.run_when_idle()

    def server_info(self) -> dict:
        self._share("server_info")
        return server_info(self.scheduler)

    def close(self) -> None:
        """Tell the other ranks to stop following (the engine's shutdown)."""
        self._share(SHUTDOWN)
        self._context.destroy(linger=1000)


FOLLOWED = {
    "add_request": Scheduler.add_request,
    "abort": Scheduler.abort,
    "step": Scheduler.step,
    "flush_cache": Scheduler.flush_cache,
    "run_when_idle": Scheduler.run_when_idle,
    "server_info": server_info,
}


def follow(scheduler: Scheduler, command_path: str, watchdog: StepWatchdog) -> None:
    """A rank > 0: run rank 0's calls, in order, until it says to stop. A call that fails here
    fails on rank 0 too (the same call on the same state), which handles it (the server aborts the
    running requests, and the aborts come here); if only this rank failed, the ranks have parted and
    the next collective never completes, which the watchdog reports."""
    context = zmq.Context()
    sock = context.socket(zmq.PULL)
    sock.bind(command_path)
    try:
        while True:
            call, args = sock.recv_pyobj()
            if call == SHUTDOWN:
                return
            with watchdog.watch(call):
                try:
                    FOLLOWED[call](scheduler, *args)
                except ValueError:  # a refused request: refused on rank 0 as well
                    pass
                except Exception:
                    logger.exception("rank %d: %s failed (as on rank 0, which handles it)", scheduler.runner.tp.rank, call)
    finally:
        context.destroy(linger=0)

"""Starting the ranks of a tensor-parallel group: where they meet, and what each does to come up.

The server starts every rank as a scheduler process (entrypoints/launcher.py); an Engine runs
rank 0 in its own process and starts the others here (FollowerRanks). Each rank joins the group,
builds its Scheduler over its share of the model (pools sized alike on every rank) and runs the
warmup, whose steps are the same on every rank, so their collectives meet.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time

import torch

from sglang_shadowkv.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from sglang_shadowkv.managers.child_process import (SCHEDULER_ENTRY, IpcPaths, rank_command_paths, rank_process_name,
                                                    rendezvous, run_child)
from sglang_shadowkv.model_executor.model_runner import resolve_device
from sglang_shadowkv.scheduler.scheduler import Scheduler
from sglang_shadowkv.scheduler.warmup import warm_up
from sglang_shadowkv.server_args import ServerArgs

STOP_TIMEOUT_S = 10.0


def start_rank(args: ServerArgs, rank: int, init_method: str) -> Scheduler:
    """Join the group, build this rank's scheduler and warm it up (on a GPU, unless
    --skip-server-warmup). On a CPU the ranks share the cores rather than each taking all."""
    started = time.perf_counter()
    device = resolve_device(args, rank)
    if device.index is not None:
        torch.cuda.set_device(device)
    elif args.tp_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp_size))
    init_tensor_parallel(rank, args.tp_size, init_method, device, args.watchdog_timeout)
    scheduler = Scheduler(args)
    if device.type == "cuda" and not args.skip_server_warmup:
        warm_up(scheduler)
    scheduler.startup_seconds = time.perf_counter() - started
    return scheduler


class FollowerRanks:
    """An Engine's ranks 1..N-1: scheduler processes that follow rank 0 (this process)."""

    def __init__(self, args: ServerArgs):
        self._folder = tempfile.TemporaryDirectory(prefix="sglang-shadowkv-tp-")
        self.init_method = rendezvous(args.dist_init_addr)
        self.command_paths = rank_command_paths(self._folder.name, args.tp_size)
        paths = IpcPaths("", "", "", self.command_paths)
        ctx = mp.get_context("spawn")
        self.processes, self._status = [], []
        for rank in range(1, args.tp_size):
            reader, writer = ctx.Pipe(duplex=False)
            process = ctx.Process(target=run_child, name=rank_process_name(rank, args.tp_size), daemon=True,
                                  args=(SCHEDULER_ENTRY, args, paths, writer, rank, self.init_method))
            process.start()
            self.processes.append(process)
            self._status.append(reader)

    def wait_ready(self, timeout_s: float) -> None:
        """Raises RuntimeError naming the first rank that failed or died while starting."""
        deadline = time.monotonic() + timeout_s
        for rank, (process, reader) in enumerate(zip(self.processes, self._status), start=1):
            while not reader.poll(0.2):
                if not process.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not start: {self.failure(rank)}")
            ready = reader.recv()
            if "error" in ready:
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {ready['error']}")

    def failure(self, rank: int) -> str:
        """Why rank `rank` is gone (its last words, or how it ended), or that it is alive."""
        process, reader = self.processes[rank - 1], self._status[rank - 1]
        try:
            if reader.poll():
                return reader.recv().get("error", "it exited")
        except EOFError:
            pass
        if process.is_alive():
            return "it is running but did not answer in time"
        code = process.exitcode
        return f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"

    def dead(self) -> list[int]:
        return [rank for rank, p in enumerate(self.processes, start=1) if not p.is_alive()]

    def stop(self) -> None:
        """After rank 0 told them to stop (MirroredScheduler.close): join, or terminate stragglers."""
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        destroy_tensor_parallel()
        self._folder.cleanup()

"""Start the server's processes in SGLang's arrangement, serve HTTP, and stop them all together.

scheduler process (model, caches, step loop; one per tensor-parallel rank, rank 0 sharing its calls
with the others) → detokenizer process → this process (HTTP + tokenizer manager), joined by ZMQ ipc
sockets in a private temporary folder. Both children start
first, by the name of their entry points, and this process imports its HTTP stack while they load
(a server on 2 CPU cores is up in ~11 s instead of 17). The scheduler reports readiness (with the
tokenizer, so it is loaded once, then handed to the detokenizer) through a pipe; a failed or slow
start ends the launch with the reason.

Stopping: SIGTERM or SIGINT ends every in-flight request at once with a 503, stops uvicorn, then
terminates the children and waits for them. uvicorn re-raises the signal it caught after its own
shutdown; with the default SIGTERM disposition that killed this process before the children were
stopped, and they lived on holding the model (issue 18). A handler installed here first turns
that re-raise into a no-op. A child that dies (a crash, the OOM killer) is noticed at once through
its sentinel; the server then stops with EXIT_PROCESS_DIED and a log line naming the process and
the cause. Children also die with this process if it is killed outright (managers/child_process.py).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from sglang_shadowkv.managers.child_process import (SCHEDULER_ENTRY, IpcPaths, rank_command_paths, rank_process_name,
                                                    rendezvous, run_child)
from sglang_shadowkv.server_args import ServerArgs

if TYPE_CHECKING:  # imported for real only once the children are starting (see _serve)
    from sglang_shadowkv.managers.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

EXIT_STOPPED = 0  # stopped by SIGTERM or SIGINT, every process joined
EXIT_LAUNCH_FAILED = 2  # bad flags, port in use, the model did not load
EXIT_PROCESS_DIED = 3  # the scheduler or detokenizer died while serving
EXIT_CODES_HELP = (f"exit codes: {EXIT_STOPPED} stopped by SIGTERM/SIGINT; {EXIT_LAUNCH_FAILED} could not "
                   f"start (bad flags, port in use, model failed to load); {EXIT_PROCESS_DIED} a server "
                   "process died while serving (the log names it and the cause)")
CHILD_STOP_TIMEOUT_S = 5.0


class LaunchError(RuntimeError):
    pass


class Stop:
    """Why the server stops (the first reason wins) and what to tell whoever is still waiting."""

    def __init__(self):
        self.reason: str | None = None
        self.exit_code = EXIT_STOPPED
        self.server: uvicorn.Server | None = None
        self.tm: TokenizerManager | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def on_signal(self, sig: int, frame=None) -> None:
        self.request(f"stopped by {signal.Signals(sig).name}", EXIT_STOPPED)

    def request(self, reason: str, exit_code: int) -> None:
        if self.reason is None:
            self.reason, self.exit_code = reason, exit_code
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.tm.shut_down, f"the server is shutting down ({self.reason})")
        if self.server is not None:
            self.server.should_exit = True


class _Uvicorn(uvicorn.Server):
    """uvicorn, with a stop signal also failing the in-flight requests at once (otherwise its
    graceful shutdown waits for them while they wait for a scheduler that is about to go)."""

    def __init__(self, config: uvicorn.Config, stop: Stop):
        super().__init__(config)
        self.stop = stop

    def handle_exit(self, sig: int, frame) -> None:
        # uvicorn first: it reads a SIGINT that finds should_exit already set as a second Ctrl-C
        # and exits at once, cutting open streams before their abort reaches them
        super().handle_exit(sig, frame)
        self.stop.on_signal(sig, frame)


def served_model_name(args: ServerArgs, model_path: str) -> str:
    if args.served_model_name:
        return args.served_model_name
    name = Path(model_path).name
    return name.removesuffix(".gguf") if name else model_path


def _wait_ready(reader, process: mp.Process, timeout_s: float, stop: Stop) -> dict | None:
    """A child's readiness report, or None when a stop signal came first."""
    name = _short_name(process)
    deadline = time.monotonic() + timeout_s
    while not reader.poll(0.2):
        if stop.reason is not None:
            return None
        if not process.is_alive():
            raise LaunchError(describe_exit(process, None) + " while starting")
        if time.monotonic() > deadline:
            raise LaunchError(f"the {name} was not ready within {timeout_s:.0f} s (--startup-timeout)")
    try:
        ready = reader.recv()
    except EOFError:  # it died before reporting: the closed pipe polls as readable
        process.join(timeout=5)
        raise LaunchError(describe_exit(process, None) + " while starting") from None
    if "error" in ready:
        raise LaunchError(f"the {name} failed to start: {ready['error']}")
    return ready


def _short_name(process: mp.Process) -> str:
    return process.name.removeprefix("sglang-shadowkv-")


def describe_exit(process: mp.Process, last_words: str | None) -> str:
    """'the scheduler process was killed by SIGKILL (...)' or '... exited with code 1: <error>'."""
    code = process.exitcode
    name = _short_name(process)
    if code is not None and code < 0:
        sig = signal.Signals(-code).name
        hint = " (the kernel's out-of-memory killer sends SIGKILL)" if -code == signal.SIGKILL else ""
        return f"the {name} process was killed by {sig}{hint}"
    return f"the {name} process exited with code {code}" + (f": {last_words}" if last_words else "")


def _watch_children(processes: list[mp.Process], status_readers: dict, stop: Stop) -> None:
    """From inside the event loop: when any child's sentinel fires, stop the server naming it.
    status_readers: the scheduler processes' (one per tensor-parallel rank) status pipes, which
    may hold their last words."""
    loop = asyncio.get_running_loop()

    def exited(process: mp.Process) -> None:
        for p in processes:
            loop.remove_reader(p.sentinel)
        process.join(timeout=1)
        last_words = _last_words(status_readers[process]) if process in status_readers else None
        reason = describe_exit(process, last_words)
        logger.error("%s; stopping the server", reason)
        stop.request(reason, EXIT_PROCESS_DIED)

    for process in processes:
        loop.add_reader(process.sentinel, exited, process)


def _last_words(status_reader) -> str | None:
    """The error the scheduler sent before it died, if it sent one (a killed one leaves EOF)."""
    try:
        return status_reader.recv().get("error") if status_reader.poll() else None
    except EOFError:
        return None


def _stop_children(processes: list[mp.Process]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + CHILD_STOP_TIMEOUT_S
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            logger.warning("%s did not stop on SIGTERM; killing it", process.name)
            process.kill()
            process.join()


def launch_server(args: ServerArgs) -> int:
    """Serve until stopped; returns the exit code (EXIT_*)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = Stop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop.on_signal)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))  # fail fast, before loading the model
    except OSError as err:
        raise LaunchError(f"cannot listen on {args.host}:{args.port}: {err}") from None
    processes: list[mp.Process] = []
    with tempfile.TemporaryDirectory(prefix="sglang-shadowkv-") as ipc_dir:
        paths = IpcPaths(*(f"ipc://{ipc_dir}/{name}" for name in ("scheduler", "detokenizer", "tokenizer_manager")),
                         rank_command_paths(ipc_dir, args.tp_size))
        try:
            _serve(args, paths, sock, processes, stop)
        finally:
            _stop_children(processes)
            sock.close()
    logger.warning("%s; all server processes stopped", stop.reason or "uvicorn exited")
    return stop.exit_code


def _serve(args: ServerArgs, paths: IpcPaths, sock: socket.socket, processes: list[mp.Process],
           stop: Stop) -> None:
    """Start the children (appending them to processes as they start) and serve HTTP until stopped."""
    ctx = mp.get_context("spawn")
    init_method = rendezvous(args.dist_init_addr) if args.tp_size > 1 else ""
    status_readers = {}
    for rank in range(args.tp_size):  # one scheduler process per tensor-parallel rank
        status_reader, writer = ctx.Pipe(duplex=False)
        scheduler = ctx.Process(target=run_child, name=rank_process_name(rank, args.tp_size), daemon=True,
                                args=(SCHEDULER_ENTRY, args, paths, writer, rank, init_method))
        scheduler.start()
        processes.append(scheduler)
        status_readers[scheduler] = status_reader
    tokenizer_reader, tokenizer_writer = ctx.Pipe(duplex=False)
    detokenizer_reader, writer = ctx.Pipe(duplex=False)
    detokenizer = ctx.Process(target=run_child, name="sglang-shadowkv-detokenizer", daemon=True,
                              args=("sglang_shadowkv.managers.detokenizer_manager:run_detokenizer_process",
                                    tokenizer_reader, paths.detokenizer, paths.tokenizer_manager, writer))
    detokenizer.start()  # now: its start-up overlaps the scheduler's
    processes.append(detokenizer)
    # the HTTP side's imports (torch, through the tokenizer manager and xgrammar), while the
    # children start
    from sglang_shadowkv.diagnostics.metrics import ServerMetrics
    from sglang_shadowkv.managers.tokenizer_manager import ModelInfo, TokenizerManager

    from .http_server import build_app
    ranks = list(status_readers.items())
    ready = _wait_ready(ranks[0][1], ranks[0][0], args.startup_timeout, stop)
    if ready is None:
        return
    for rank_process, rank_status in ranks[1:]:
        if _wait_ready(rank_status, rank_process, args.startup_timeout, stop) is None:
            return
    tokenizer_writer.send(ready["tokenizer"])
    if _wait_ready(detokenizer_reader, detokenizer, args.startup_timeout, stop) is None:
        return
    args.served_model_name = served_model_name(args, ready["model_path"])
    metrics = ServerMetrics(args.served_model_name) if args.enable_metrics else None
    tm = TokenizerManager(ModelInfo(**ready), paths.scheduler, paths.tokenizer_manager, metrics)
    url = f"http://{args.host}:{args.port}"

    def on_startup() -> None:
        stop.tm, stop.loop = tm, asyncio.get_running_loop()
        _watch_children(processes, status_readers, stop)
        print(f"sglang-shadowkv serving {args.served_model_name} ({args.attention} attention) "
              f"at {url} (pid {os.getpid()})", flush=True)

    app = build_app(tm, args, alive=lambda: all(p.is_alive() for p in processes), on_startup=on_startup)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=CHILD_STOP_TIMEOUT_S)
    stop.server = _Uvicorn(config, stop)
    if stop.reason is None:
        stop.server.run(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m sglang_shadowkv.launch_server",
        description="Serve a model over HTTP with SGLang's native API and the OpenAI API. "
                    "Without --model-path it serves the embedded SmolLM2-135M-Instruct. "
                    "SIGTERM or SIGINT stops it and all its processes.",
        epilog=EXIT_CODES_HELP)
    ServerArgs.add_cli_args(parser)
    try:
        return launch_server(ServerArgs.from_cli_args(parser.parse_args(argv)))
    except (ValueError, LaunchError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_LAUNCH_FAILED

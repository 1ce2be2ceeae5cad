"""Start the server's processes in SGLang's arrangement and serve HTTP until interrupted.

scheduler process (model, caches, step loop) → detokenizer process → this process (HTTP +
tokenizer manager), joined by ZMQ ipc sockets in a private temporary folder. The scheduler reports
readiness (with the tokenizer, so it is loaded once) through a pipe; a failed or slow start ends
the launch with the reason.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import sys
import tempfile
import time
from pathlib import Path

import uvicorn

from sglang_shadowkv.managers.detokenizer_manager import run_detokenizer_process
from sglang_shadowkv.managers.scheduler_process import IpcPaths, run_scheduler_process
from sglang_shadowkv.managers.tokenizer_manager import ModelInfo, TokenizerManager
from sglang_shadowkv.server_args import ServerArgs

from .http_server import build_app

logger = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    pass


def served_model_name(args: ServerArgs, model_path: str) -> str:
    if args.served_model_name:
        return args.served_model_name
    name = Path(model_path).name
    return name.removesuffix(".gguf") if name else model_path


def _wait_ready(reader, process: mp.Process, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while not reader.poll(0.5):
        if not process.is_alive():
            raise LaunchError(f"the scheduler process exited (code {process.exitcode}) while loading")
        if time.monotonic() > deadline:
            raise LaunchError(f"the scheduler was not ready within {timeout_s:.0f} s (--startup-timeout)")
    ready = reader.recv()
    if "error" in ready:
        raise LaunchError(f"the scheduler failed to start: {ready['error']}")
    return ready


def launch_server(args: ServerArgs) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))  # fail fast, before loading the model
    except OSError as err:
        raise LaunchError(f"cannot listen on {args.host}:{args.port}: {err}") from None
    ctx = mp.get_context("spawn")
    processes: list[mp.Process] = []
    with tempfile.TemporaryDirectory(prefix="sglang-shadowkv-") as ipc_dir:
        paths = IpcPaths(*(f"ipc://{ipc_dir}/{name}" for name in ("scheduler", "detokenizer", "tokenizer_manager")))
        try:
            reader, writer = ctx.Pipe(duplex=False)
            scheduler = ctx.Process(target=run_scheduler_process, args=(args, paths, writer),
                                    name="sglang-shadowkv-scheduler", daemon=True)
            scheduler.start()
            processes.append(scheduler)
            ready = _wait_ready(reader, scheduler, args.startup_timeout)
            detokenizer = ctx.Process(target=run_detokenizer_process,
                                      args=(ready["tokenizer"], paths.detokenizer, paths.tokenizer_manager),
                                      name="sglang-shadowkv-detokenizer", daemon=True)
            detokenizer.start()
            processes.append(detokenizer)
            tm = TokenizerManager(ModelInfo(**ready), paths.scheduler, paths.tokenizer_manager)
            args.served_model_name = served_model_name(args, ready["model_path"])
            url = f"http://{args.host}:{args.port}"
            app = build_app(tm, args, alive=lambda: all(p.is_alive() for p in processes),
                            on_startup=lambda: print(f"sglang-shadowkv serving {args.served_model_name} "
                                                     f"({args.attention} attention) at {url}", flush=True))
            config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5)
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.join(timeout=10)
            sock.close()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m sglang_shadowkv.launch_server",
        description="Serve a model over HTTP with SGLang's native API and the OpenAI API. "
                    "Without --model-path it serves the embedded SmolLM2-135M-Instruct.")
    ServerArgs.add_cli_args(parser)
    try:
        args = ServerArgs.from_cli_args(parser.parse_args(argv))
        launch_server(args)
    except (ValueError, LaunchError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0

"""The server's scheduler process: owns the model and the caches, runs the step loop.

It takes requests from the tokenizer manager, steps the Scheduler while there is work (blocking
on its socket when idle), sends each step's new tokens to the detokenizer and answers control
calls (flush, server info) straight to the tokenizer manager. A request the Scheduler rejects comes
back as a finished output carrying the error, so the client gets it as an HTTP 400.

The status pipe to the launcher carries readiness (or why loading failed) and, if the loop itself
crashes or the step watchdog fires, the reason, so the launcher can name it when it takes the
server down.

Under tensor parallelism there is one such process per rank: rank 0 runs the loop over a
MirroredScheduler, which shares every call with the other ranks; they `follow` it
(managers/rank_mirror.py) and send nothing on.
"""

from __future__ import annotations

import faulthandler
import logging
import signal

import zmq

from sglang_shadowkv.server_args import ServerArgs

from sglang_shadowkv.managers.rank_mirror import MirroredScheduler, follow
from sglang_shadowkv.managers.ranks import start_rank
from sglang_shadowkv.managers.watchdog import StepWatchdog
from sglang_shadowkv.managers.child_process import IpcPaths, die_with_parent
from sglang_shadowkv.managers.request_output import meta_info
from sglang_shadowkv.managers.io_struct import AbortReq, ControlOut, ControlReq, GenerateReq, TokenOut
from sglang_shadowkv.scheduler.request import Req
from sglang_shadowkv.scheduler.scheduler import Scheduler
from sglang_shadowkv.diagnostics.step_profiler import StepProfiler

logger = logging.getLogger(__name__)


def run_scheduler_process(args: ServerArgs, paths: IpcPaths, status_pipe, rank: int = 0,
                          init_method: str = "") -> None:
    die_with_parent()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: every thread's stack, to the log
    name = "scheduler" if args.tp_size == 1 else f"scheduler rank {rank}"
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {name} %(levelname)s %(message)s")
    try:
        scheduler = start_rank(args, rank, init_method)
    except Exception as err:  # reported to the launcher, which exits with the message
        logger.exception("%s failed to start", name)
        status_pipe.send({"error": f"{type(err).__name__}: {err}"})
        return
    runner = scheduler.runner
    status_pipe.send({"tokenizer": scheduler.tokenizer, "model_path": runner.loaded.model_path,
                      "context_length": runner.context_length, "vocab_size": runner.config.vocab_size,
                      "max_total_tokens": scheduler.pool.capacity * scheduler.page_size} if rank == 0 else {})
    watchdog = StepWatchdog(args.watchdog_timeout, rank, lambda message: status_pipe.send({"error": message}))
    try:
        if rank == 0:
            SchedulerLoop(MirroredScheduler(scheduler, paths.rank_commands), paths, watchdog).run()
        else:
            follow(scheduler, paths.rank_commands[rank - 1], watchdog)
    except Exception as err:  # outside the per-step handler: the server cannot go on
        logger.exception("the %s loop crashed", name)
        status_pipe.send({"error": f"{type(err).__name__}: {err}"})
        raise SystemExit(1) from None


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler | MirroredScheduler, paths: IpcPaths, watchdog: StepWatchdog):
        self.scheduler, self.watchdog = scheduler, watchdog
        context = zmq.Context()
        self.recv = context.socket(zmq.PULL)
        self.recv.bind(paths.scheduler)
        self.to_detokenizer = context.socket(zmq.PUSH)
        self.to_detokenizer.connect(paths.detokenizer)
        self.to_tokenizer_manager = context.socket(zmq.PUSH)
        self.to_tokenizer_manager.connect(paths.tokenizer_manager)
        self.reqs: dict[str, Req] = {}
        self.profiler = StepProfiler()

    def run(self) -> None:
        while True:
            outs: list[TokenOut] = []
            for msg in self._receive(block=not self.scheduler.has_work):
                with self.watchdog.watch(type(msg).__name__):
                    outs.extend(self._handle(msg))
            stepped = self.scheduler.has_work
            if stepped:
                with self.watchdog.watch("step"):
                    outs.extend(self._step())
            if outs:
                self.to_detokenizer.send_pyobj(outs)
            if stepped and not self.scheduler.has_work:
                with self.watchdog.watch("idle-time work"):
                    self.scheduler.run_when_idle()

    def _receive(self, block: bool) -> list:
        msgs = []
        if block:
            self.recv.poll()
        while True:
            try:
                msgs.append(self.recv.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return msgs

    def _handle(self, msg) -> list[TokenOut]:
        if isinstance(msg, GenerateReq):
            try:
                req = self.scheduler.add_request(msg.rid, msg.input_ids, msg.sampling, msg.logprob)
            except ValueError as err:
                meta = {"id": msg.rid, "finish_reason": {"type": "abort", "message": str(err)}}
                return [TokenOut(msg.rid, [], True, meta, msg.sampling, error=str(err))]
            self.reqs[msg.rid] = req
        elif isinstance(msg, AbortReq):
            req = self.reqs.pop(msg.rid, None)
            if req is not None and self.scheduler.abort(msg.rid):
                return [token_out(req, [], True)]
        elif isinstance(msg, ControlReq):
            calls = {"flush_cache": self.scheduler.flush_cache, "server_info": self.scheduler.server_info,
                     "start_profile": self.profiler.start, "stop_profile": self.profiler.stop}
            try:
                result = calls[msg.kind](**msg.args)
            except ValueError as err:  # bad arguments: the route answers 400 with the message
                result = {"error": str(err)}
            self.to_tokenizer_manager.send_pyobj(ControlOut(msg.call_id, result))
        return []

    def _step(self) -> list[TokenOut]:
        try:
            updates = self.scheduler.step()
            self.profiler.after_step()
        except Exception as err:  # a bug must not take the server down: fail the running requests
            logger.exception("scheduler step failed; aborting the running requests")
            outs = []
            for rid in list(self.reqs):
                req = self.reqs.pop(rid)
                self.scheduler.abort(rid)
                outs.append(TokenOut(rid, [], True, meta_info(req), req.sampling,
                                     error=f"internal error: {type(err).__name__}: {err}"))
            return outs
        outs = []
        for update in updates:
            req = update.req
            if update.finished:
                self.reqs.pop(req.rid, None)
            outs.append(token_out(req, update.new_ids, update.finished))
        return outs


def token_out(req: Req, new_ids: list[int], finished: bool) -> TokenOut:
    """A request's step output; one that ended on bad input (a grammar that failed to compile)
    carries the reason as its error, which the client gets as a 400."""
    reason = req.finish_reason or {}
    error = reason.get("message") if reason.get("status_code") == 400 else None
    return TokenOut(req.rid, new_ids, finished, meta_info(req), req.sampling, error=error,
                    logprobs=None if req.logprob is None else req.logprob.take_delta())

"""The HTTP process's side of the server: tokenize, check, send to the scheduler, and route the
detokenizer's outputs back to the waiting HTTP handlers (one asyncio queue per request id).

Everything a client can get wrong is checked here or by the scheduler and surfaces as a
ValueError naming the field; the HTTP layer turns it into a 400. When the server stops or a
child process dies, `shut_down` ends every waiting request with ServerUnavailable (a 503) at
once, instead of leaving it to wait for outputs that will never come.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zmq
import zmq.asyncio

from sglang_shadowkv.sampling_params import SamplingParams

from sglang_shadowkv.managers.io_struct import AbortReq, ControlOut, ControlReq, GenerateReq, TextOut
from sglang_shadowkv.managers.request_output import merge_logprobs
from sglang_shadowkv.scheduler.logprobs import LogprobOptions
from sglang_shadowkv.managers.parallel_sampling import expand_parallel
from sglang_shadowkv.diagnostics.metrics import ServerMetrics


# threads that parse and tokenize request bodies. Off the event loop: 48 chat turns over 17K-token
# documents arriving at once took 50-65 ms each to tokenize, and done in the loop they held back
# every other request's streamed tokens for seconds; HF's fast tokenizers release the GIL
PARSE_THREADS = min(8, os.cpu_count() or 1)


class ServerUnavailable(RuntimeError):
    """The server is stopping or its scheduler is gone: nothing can be served (HTTP 503)."""


@dataclass
class ModelInfo:
    """What the scheduler reported when it came up."""
    tokenizer: object
    model_path: str
    context_length: int
    vocab_size: int
    max_total_tokens: int


class TokenizerManager:
    def __init__(self, info: ModelInfo, scheduler_path: str, own_path: str,
                 metrics: ServerMetrics | None = None):
        self.info = info
        self.metrics = metrics
        self.unavailable: str | None = None  # why, once shut_down
        self.tokenizer = info.tokenizer
        self.context = zmq.asyncio.Context()
        self.to_scheduler = self.context.socket(zmq.PUSH)
        self.to_scheduler.connect(scheduler_path)
        self.recv = self.context.socket(zmq.PULL)
        self.recv.bind(own_path)
        self.queues: dict[str, asyncio.Queue] = {}
        self.calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._recv_task: asyncio.Task | None = None
        self._parse_pool = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="parse")
        if self.tokenizer is not None:  # the first encode may reset the backend's padding/truncation
            self.tokenizer.encode("", add_special_tokens=False)  # (a write): here, before threads share it

    def start(self) -> None:
        """Start routing outputs (call from inside the server's event loop)."""
        self._recv_task = asyncio.get_running_loop().create_task(self._route_outputs())

    async def _route_outputs(self) -> None:
        while True:
            msg = await self.recv.recv_pyobj()
            if isinstance(msg, ControlOut):
                future = self.calls.pop(msg.call_id, None)
                if future is not None and not future.done():
                    future.set_result(msg.result)
                continue
            for out in msg:
                queue = self.queues.get(out.rid)
                if queue is not None:
                    queue.put_nowait(out)

    # ---- requests -----------------------------------------------------------------------------
    async def parse(self, parse_fn, *args):
        """parse_fn(*args) (a request body's checks and tokenization) on a parsing thread, so the
        event loop keeps streaming other requests' tokens meanwhile; its ValueError comes back."""
        return await asyncio.get_running_loop().run_in_executor(self._parse_pool, parse_fn, *args)

    def input_ids_of(self, text, input_ids, field: str = "text") -> list[int]:
        """Token ids of one prompt (range and length are the scheduler's checks)."""
        if (text is None) == (input_ids is None):
            raise ValueError(f"give exactly one of {field} or input_ids")
        if text is not None:
            if not isinstance(text, str):
                raise ValueError(f"{field} must be a string, got {type(text).__name__}")
            return self.tokenizer.encode(text, add_special_tokens=False)
        if not isinstance(input_ids, list):
            raise ValueError(f"input_ids must be a list of token ids, got {type(input_ids).__name__}")
        return input_ids

    async def start_batch(self, reqs: list[GenerateReq]) -> list[AsyncIterator[TextOut]]:
        """Output streams of several requests, in order; a request with sampling n > 1 becomes n
        streams after its prompt has been prefilled once (parallel_sampling.py)."""
        prefixes, runs = expand_parallel(reqs)
        await asyncio.gather(*(_drain(self.generate(ids, SamplingParams(max_new_tokens=0)))
                               for ids in prefixes))
        return [self.generate(r.input_ids, r.sampling, r.rid, r.logprob) for r in runs]

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None,
                       logprob: LogprobOptions | None = None) -> AsyncIterator[TextOut]:
        """Outputs of one request as they come; the last has finished=True. Raises ValueError if
        the scheduler rejects it. If the server stops first: ServerUnavailable before the first
        output, else a last output finished as "abort" with the reason (a stream ends cleanly).
        If the consumer stops early (client gone), the request is aborted. With logprob, each
        output's meta has the logprobs so far (SGLang's meta_info keys)."""
        self._check_available()
        sampling.check_token_ids(self.info.vocab_size)
        rid = rid or uuid.uuid4().hex
        if rid in self.queues:
            raise ValueError(f"rid {rid!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = queue
        last: TextOut | None = None
        logprobs: dict[str, list] = {}
        timing = self.metrics.request_started() if self.metrics else None
        try:
            await self.to_scheduler.send_pyobj(GenerateReq(rid, input_ids, sampling, logprob))
            while last is None or not last.finished:
                out: TextOut | ServerUnavailable = await queue.get()
                if isinstance(out, ServerUnavailable):
                    if last is None:
                        raise out
                    out = TextOut(rid, last.text, [], True, {**last.meta, "finish_reason": {
                        "type": "abort", "message": str(out)}})
                if out.error is not None:
                    last = out
                    raise ValueError(out.error)
                if out.logprobs is not None:
                    merge_logprobs(out.meta, logprobs, out.logprobs)
                if timing:
                    self.metrics.observe_output(timing, out)
                last = out
                yield out
        finally:
            self.queues.pop(rid, None)
            if last is None or not last.finished:
                if timing:
                    self.metrics.observe_abandoned()
                if self.unavailable is None:
                    await self.abort(rid)

    async def abort(self, rid: str) -> None:
        await self.to_scheduler.send_pyobj(AbortReq(rid))

    async def control(self, kind: str, timeout: float = 60.0, **args):
        self._check_available()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self.calls[call_id] = future
        await self.to_scheduler.send_pyobj(ControlReq(call_id, kind, args))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self.calls.pop(call_id, None)

    def shut_down(self, reason: str) -> None:
        """Refuse new work and end every waiting request and control call with ServerUnavailable."""
        if self.unavailable is not None:
            return
        self.unavailable = reason
        for queue in self.queues.values():
            queue.put_nowait(ServerUnavailable(reason))
        for future in self.calls.values():
            if not future.done():
                future.set_exception(ServerUnavailable(reason))

    def _check_available(self) -> None:
        if self.unavailable is not None:
            raise ServerUnavailable(self.unavailable)

    def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        self._parse_pool.shutdown(wait=False, cancel_futures=True)
        self.context.destroy(linger=0)


async def _drain(stream: AsyncIterator) -> None:
    async for _ in stream:
        pass

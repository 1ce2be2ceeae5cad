"""The HTTP server: SGLang's native API (this module) and the OpenAI API (openai_api.py) over one
TokenizerManager. Bad input gets a 400 with a JSON error naming the field; nothing a client
sends can take the server down."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from sglang_shadowkv.managers.io_struct import TextOut
from sglang_shadowkv.managers.tokenizer_manager import ServerUnavailable, TokenizerManager
from sglang_shadowkv.sampling_params import SamplingParams
from sglang_shadowkv.server_args import ServerArgs

from .http_util import (SSE_DONE, ClientGone, error_response, json_body, json_response, peek, sse,
                        wait_or_abort_on_disconnect)
from .openai_api import add_openai_routes

logger = logging.getLogger(__name__)

# Fields of SGLang's GenerateReqInput that are accepted and ignored at their default value.
IGNORED_AT_DEFAULT = {"logprob_start_len": (None, -1, 0), "top_logprobs_num": (None, 0),
                      "return_text_in_logprobs": (None, False, True), "image_data": (None,),
                      "modalities": (None,), "lora_path": (None,), "custom_logit_processor": (None,)}
GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "rid", "stream", "return_logprob"}


def build_app(tm: TokenizerManager, args: ServerArgs, alive=lambda: True,
              on_startup=lambda: None) -> FastAPI:
    """alive(): whether the scheduler and detokenizer processes still run (for /health).
    /metrics is served when the tokenizer manager has metrics (--enable-metrics)."""

    def healthy() -> bool:
        return alive() and tm.unavailable is None

    @asynccontextmanager
    async def lifespan(app):
        tm.start()
        on_startup()
        yield
        tm.close()

    app = FastAPI(title="sglang-shadowkv", lifespan=lifespan)
    served_name = args.served_model_name

    @app.exception_handler(ValueError)
    async def bad_request(request: Request, err: ValueError):
        return error_response(str(err))

    @app.exception_handler(ServerUnavailable)
    async def unavailable(request: Request, err: ServerUnavailable):
        return error_response(str(err), 503, "service_unavailable")

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, err: ClientGone):
        return Response(status_code=499)

    @app.get("/health")
    async def health():
        return PlainTextResponse("ok") if healthy() else PlainTextResponse(_down(tm), status_code=503)

    @app.get("/health_generate")
    async def health_generate(request: Request):
        """A one-token generation end to end."""
        if not healthy():
            return PlainTextResponse(_down(tm), status_code=503)
        stream = tm.generate([tm.tokenizer.encode("ok", add_special_tokens=False)[0]],
                             SamplingParams(max_new_tokens=1, temperature=0.0))
        await wait_or_abort_on_disconnect(request, _last(stream))
        return PlainTextResponse("ok")

    @app.get("/get_model_info")
    async def get_model_info():
        info = tm.info
        return json_response({"model_path": info.model_path, "tokenizer_path": args.tokenizer_path or info.model_path,
                              "served_model_name": served_name, "is_generation": True,
                              "context_length": info.context_length, "max_total_tokens": info.max_total_tokens})

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info():
        info = await tm.control("server_info")
        return json_response({**args.as_dict(), **info, "served_model_name": served_name})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if await tm.control("flush_cache"):
            return PlainTextResponse("Cache flushed.")
        return PlainTextResponse("Cache not flushed: requests are running.", status_code=400)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await json_body(request)
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise ValueError("rid must be a string")
        await tm.abort(rid)
        return json_response({"rid": rid, "aborted": True})

    @app.post("/generate")
    async def generate(request: Request):
        body = await json_body(request)
        prompts, single, stream = _parse_generate(tm, body)
        streams = [tm.generate(ids, sp, rid, logprob) for ids, sp, rid, logprob in prompts]
        if not stream:
            outs = await wait_or_abort_on_disconnect(request, asyncio.gather(*(_last(s) for s in streams)))
            results = [_native_result(out, ids) for out, ids in outs]
            return json_response(results[0] if single else results)
        merged = _merge(streams)
        _, events = await peek(merged, request)

        async def sse_events():
            async for index, out, ids in events:
                payload = _native_result(out, ids)
                if not single:
                    payload["index"] = index
                yield sse(payload)
            yield SSE_DONE

        return StreamingResponse(sse_events(), media_type="text/event-stream")

    if tm.metrics is not None:
        @app.get("/metrics")
        async def metrics():
            info = await tm.control("server_info")
            return Response(tm.metrics.render(info), media_type=CONTENT_TYPE_LATEST)

    add_openai_routes(app, tm, served_name)
    return app


def _down(tm: TokenizerManager) -> str:
    return tm.unavailable or "a server process is down"


def _parse_generate(tm: TokenizerManager, body: dict):
    """[(input_ids, SamplingParams, rid, return_logprob)], whether it was one prompt, stream."""
    unknown = sorted(set(body) - GENERATE_FIELDS - set(IGNORED_AT_DEFAULT))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} in /generate request")
    for key, allowed in IGNORED_AT_DEFAULT.items():
        if body.get(key) not in allowed:
            raise ValueError(f"{key} is not supported by this server")
    text, input_ids = body.get("text"), body.get("input_ids")
    single = isinstance(text, str) or (isinstance(input_ids, list) and input_ids
                                       and not isinstance(input_ids[0], list))
    if text is None and input_ids is None:
        raise ValueError("give text or input_ids")
    if single:
        prompts = [tm.input_ids_of(text, input_ids)]
    elif text is not None:
        if not isinstance(text, list) or not text:
            raise ValueError("text must be a string or a non-empty list of strings")
        prompts = [tm.input_ids_of(t, None, "text[i]") for t in text]
    else:
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError("input_ids must be a list of ints or a non-empty list of such lists")
        prompts = [tm.input_ids_of(None, ids) for ids in input_ids]
    n = len(prompts)
    params, rids, logprobs = (_per_prompt(body.get(k), n, k) for k in ("sampling_params", "rid", "return_logprob"))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ValueError("stream must be a boolean")
    for rid in rids:
        if rid is not None and not isinstance(rid, str):
            raise ValueError("rid must be a string (or a list of strings for a batch)")
    for lp in logprobs:
        if lp is not None and not isinstance(lp, bool):
            raise ValueError("return_logprob must be a boolean")
    return ([(ids, SamplingParams.from_dict(sp), rid, bool(lp))
             for ids, sp, rid, lp in zip(prompts, params, rids, logprobs)], single, stream)


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


async def _last(stream: AsyncIterator[TextOut]) -> tuple[TextOut, list[int]]:
    ids: list[int] = []
    out = None
    async for out in stream:
        ids.extend(out.new_ids)
    return out, ids


async def _merge(streams: list[AsyncIterator[TextOut]]):
    """(index, output, output ids so far) from several request streams, as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index, stream):
        ids: list[int] = []
        try:
            async for out in stream:
                ids = ids + out.new_ids
                await queue.put((index, out, ids))
        except Exception as err:
            await queue.put(err)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _native_result(out: TextOut, ids: list[int]) -> dict:
    return {"text": out.text, "output_ids": ids, "meta_info": out.meta}


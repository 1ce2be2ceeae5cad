"""The HTTP server: SGLang's native API (this module) and the OpenAI API (openai_api.py) over one
TokenizerManager. Bad input gets a 400 with a JSON error naming the field; nothing a client
sends can take the server down."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from sglang_shadowkv.managers.io_struct import TextOut
from sglang_shadowkv.managers.tokenizer_manager import ServerUnavailable, TokenizerManager
from sglang_shadowkv.sampling_params import SamplingParams
from sglang_shadowkv.server_args import ServerArgs

from .generate_request import parse_generate
from .http_util import (SSE_DONE, ClientGone, error_response, json_body, json_response, last_output,
                        merge_streams, peek, sse, wait_or_abort_on_disconnect)
from .openai_api import add_openai_routes

logger = logging.getLogger(__name__)


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
        await wait_or_abort_on_disconnect(request, last_output(stream))
        return PlainTextResponse("ok")

    @app.get("/get_model_info")
    @app.get("/model_info")  # the name sglang-router asks first
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

    @app.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(request: Request):
        """torch.profiler over the next num_steps scheduler steps (or until /stop_profile)."""
        body = await json_body(request) if await request.body() else {}
        result = await tm.control("start_profile", output_dir=body.get("output_dir"), num_steps=body.get("num_steps"))
        if isinstance(result, dict):
            raise ValueError(result["error"])
        return PlainTextResponse(result)

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile():
        """Ends the profile; returns its summary (per-step times, the top ops)."""
        result = await tm.control("stop_profile", timeout=300.0)
        if "error" in result:
            raise ValueError(result["error"])
        return json_response(result)

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
        reqs, single, stream = await tm.parse(parse_generate, tm, body)
        streams = await wait_or_abort_on_disconnect(request, tm.start_batch(reqs))
        single = single and len(streams) == 1  # n > 1 answers a list, as SGLang does
        if not stream:
            outs = await wait_or_abort_on_disconnect(request, asyncio.gather(*(last_output(s) for s in streams)))
            results = [_native_result(out, ids) for out, ids in outs]
            return json_response(results[0] if single else results)
        merged = merge_streams(streams)
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


def _native_result(out: TextOut, ids: list[int]) -> dict:
    return {"text": out.text, "output_ids": ids, "meta_info": out.meta}


"""What the native and the OpenAI endpoints share: JSON bodies, 400s, server-sent events, and
waiting on a request while watching for the client to go away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable

import orjson
from fastapi import Request
from fastapi.responses import Response

SSE_DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before its request finished (the request has been aborted)."""


def json_response(content, status_code: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status_code, media_type="application/json")


def error_response(message: str, status_code: int = 400, err_type: str = "invalid_request_error",
                   param: str | None = None) -> Response:
    """OpenAI's error shape, which SGLang uses for its native endpoints too."""
    return json_response({"object": "error", "error": {"message": message, "type": err_type,
                                                       "param": param, "code": status_code},
                          "message": message}, status_code)


async def json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise ValueError(f"request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise ValueError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def sse(payload) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def wait_or_abort_on_disconnect(request: Request, work: Awaitable, poll_s: float = 0.5):
    """Await `work`; if the client disconnects first, cancel it (which aborts its request)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass


async def peek(stream: AsyncIterator, request: Request):
    """The first item of a stream (so a rejected request is still a plain 400) and the stream
    with that item put back in front."""
    first = await wait_or_abort_on_disconnect(request, stream.__anext__())

    async def rest():
        yield first
        async for item in stream:
            yield item

    return first, rest()


async def last_output(stream: AsyncIterator) -> tuple:
    """The last output of a request stream and every output id it produced."""
    ids: list[int] = []
    out = None
    async for out in stream:
        ids.extend(out.new_ids)
    return out, ids


async def merge_streams(streams: list[AsyncIterator]):
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

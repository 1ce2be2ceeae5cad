"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions (stream and not),
in the response shapes the `openai` client parses. One choice per request (n = 1)."""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from sglang_shadowkv.managers.tokenizer_manager import TokenizerManager
from sglang_shadowkv.sampling_params import SamplingParams

from .http_util import SSE_DONE, json_body, json_response, peek, sse, wait_or_abort_on_disconnect

# OpenAI request field -> SGLang sampling parameter (same meaning)
SAMPLING_FIELDS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                   "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "stop": "stop", "stop_token_ids": "stop_token_ids", "seed": "sampling_seed",
                   "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
                   "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos",
                   "logit_bias": "logit_bias", "n": "n", "min_tokens": "min_new_tokens",
                   "skip_special_tokens": "skip_special_tokens"}
# Accepted and ignored (OpenAI bookkeeping, or features that are off at these values).
IGNORED = {"user": None, "stream_options": None, "echo": (None, False), "logprobs": (None, False, 0),
           "top_logprobs": (None, 0), "suffix": (None,), "best_of": (None, 1), "metadata": None,
           "store": (None, False), "parallel_tool_calls": None, "tool_choice": (None, "none"),
           "tools": (None, []), "response_format": (None, {"type": "text"})}
COMMON_FIELDS = {"model", "stream"} | set(SAMPLING_FIELDS) | set(IGNORED)
DEFAULT_MAX_TOKENS = {"completions": 16, "chat": None}


def add_openai_routes(app: FastAPI, tm: TokenizerManager, served_name: str) -> None:
    def check_model(body: dict) -> str:
        model = body.get("model", served_name)
        if model not in (served_name, tm.info.model_path):
            raise ValueError(f"model {model!r} is not served here; available: [{served_name!r}]")
        return served_name

    @app.get("/v1/models")
    async def models():
        return json_response({"object": "list", "data": [{
            "id": served_name, "object": "model", "created": int(time.time()), "owned_by": "sglang-shadowkv",
            "root": tm.info.model_path, "max_model_len": tm.info.context_length}]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_body(request)
        _check_fields(body, COMMON_FIELDS | {"prompt"})
        model = check_model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = tm.input_ids_of(prompt, None, "prompt")
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = tm.input_ids_of(None, prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids (one prompt per request)")
        return await _respond(request, tm, body, ids, model, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await json_body(request)
        _check_fields(body, COMMON_FIELDS | {"messages"})
        model = check_model(body)
        text = tm.tokenizer.apply_chat_template(_messages(body.get("messages")), tokenize=False,
                                                add_generation_prompt=True)
        ids = tm.input_ids_of(text, None, "messages")
        return await _respond(request, tm, body, ids, model, chat=True)


def _check_fields(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}")
    for key, allowed in IGNORED.items():
        if allowed is not None and key in body and body[key] not in allowed:
            raise ValueError(f"{key}={body[key]!r} is not supported by this server")


def _messages(messages) -> list[dict]:
    """Chat messages as the chat template wants them: role and text content."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ("system", "user", "assistant", "developer"):
            raise ValueError(f"messages[{i}] must be an object with role system, user or assistant")
        content = msg.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"messages[{i}].content parts must be text parts")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")
        out.append({"role": "system" if msg["role"] == "developer" else msg["role"], "content": content})
    return out


def _sampling(body: dict, chat: bool) -> SamplingParams:
    params = {}
    for field, name in SAMPLING_FIELDS.items():
        if body.get(field) is not None:
            params[name] = body[field]
    default = DEFAULT_MAX_TOKENS["chat" if chat else "completions"]
    if "max_new_tokens" not in params and default is not None:
        params["max_new_tokens"] = default
    try:
        return SamplingParams.from_dict(params)
    except ValueError as err:  # name the OpenAI field, not ours
        message = str(err)
        for field, name in SAMPLING_FIELDS.items():
            if f"sampling_params.{name} " in message and field in body:
                message = message.replace(f"sampling_params.{name}", field)
        raise ValueError(message.replace("sampling_params.", "")) from None


async def _respond(request: Request, tm: TokenizerManager, body: dict, ids: list[int], model: str, chat: bool):
    sampling = _sampling(body, chat)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ValueError("stream must be a boolean")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    outputs = tm.generate(ids, sampling, rid)
    created = int(time.time())
    kind = "chat.completion" if chat else "text_completion"
    if not stream:
        last = None

        async def collect():
            nonlocal last
            async for last in outputs:
                pass

        await wait_or_abort_on_disconnect(request, collect())
        choice = {"index": 0, "finish_reason": _finish_reason(last.meta), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": last.text}
        else:
            choice["text"] = last.text
        return json_response({"id": rid, "object": kind, "created": created, "model": model,
                              "choices": [choice], "usage": _usage(last.meta)})

    _, events = await peek(outputs, request)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    def chunk(delta: str, finish_reason, first: bool) -> dict:
        if chat:
            choice = {"index": 0, "delta": ({"role": "assistant", "content": delta} if first else {"content": delta}),
                      "finish_reason": finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta, "finish_reason": finish_reason, "logprobs": None}
        return {"id": rid, "object": kind + ".chunk" if chat else kind, "created": created,
                "model": model, "choices": [choice]}

    async def sse_events():
        sent, first, last = 0, True, None
        async for last in events:
            delta = last.text[sent:]
            sent = len(last.text)
            if delta or first or last.finished:
                yield sse(chunk(delta, _finish_reason(last.meta) if last.finished else None, first))
                first = False
        if include_usage and last is not None:
            yield sse({"id": rid, "object": kind + ".chunk" if chat else kind, "created": created,
                       "model": model, "choices": [], "usage": _usage(last.meta)})
        yield SSE_DONE

    return StreamingResponse(sse_events(), media_type="text/event-stream")


def _finish_reason(meta: dict) -> str | None:
    reason = meta.get("finish_reason")
    return None if reason is None else reason["type"]


def _usage(meta: dict) -> dict:
    prompt, completion = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0)}}

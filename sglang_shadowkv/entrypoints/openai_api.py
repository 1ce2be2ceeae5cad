"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions (stream and not),
in the response shapes the `openai` client parses, translated to the same requests /generate
makes: n choices per prompt (parallel sampling), a batch of prompts, echo, logprobs,
response_format (constrained decoding), stream_options.include_usage. Any model name is served,
as SGLang does; responses name the model the request named.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from sglang_shadowkv.managers.io_struct import GenerateReq
from sglang_shadowkv.scheduler.logprobs import LogprobOptions
from sglang_shadowkv.managers.tokenizer_manager import TokenizerManager
from sglang_shadowkv.sampling_params import SamplingParams

from .http_util import (SSE_DONE, json_body, json_response, last_output, merge_streams, peek, sse,
                        wait_or_abort_on_disconnect)
from .openai_format import CompletionLogprobs, chat_logprobs, finish_reason, matched_stop, usage
from .request_fields import CHAT_FIELDS, COMPLETION_FIELDS, OPENAI_SAMPLING, check_fields

DEFAULT_MAX_TOKENS = {"completions": 16, "chat": None}


def add_openai_routes(app: FastAPI, tm: TokenizerManager, served_name: str) -> None:
    @app.get("/v1/models")
    async def models():
        return json_response({"object": "list", "data": [{
            "id": served_name, "object": "model", "created": int(time.time()), "owned_by": "sglang-shadowkv",
            "root": tm.info.model_path, "max_model_len": tm.info.context_length}]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_body(request)
        check_fields(body, COMPLETION_FIELDS, "/v1/completions")
        prompts = await tm.parse(_completion_prompts, tm, body.get("prompt"))
        top = body.get("logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
            raise ValueError(f"logprobs must be a non-negative integer (top logprobs per token), got {top!r}")
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise ValueError("echo must be a boolean")
        logprob = None if top is None else LogprobOptions(0 if echo else -1, top, None, True)
        sampling = _sampling(body, chat=False)
        echoes = [tm.tokenizer.decode(ids) if text is None else text for text, ids in prompts] if echo else None
        reqs = [GenerateReq(rid, ids, sampling, logprob)
                for rid, (_, ids) in zip(_rids(body, len(prompts)), prompts)]
        return await _respond(request, tm, body, reqs, CompletionRenderer(echoes, sampling.n), served_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await json_body(request)
        check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
        ids = await tm.parse(_chat_prompt, tm, body)
        wants = body.get("logprobs") or False
        if not isinstance(wants, bool):
            raise ValueError("logprobs must be a boolean")
        top = body.get("top_logprobs") or 0
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise ValueError(f"top_logprobs must be a non-negative integer, got {top!r}")
        logprob = LogprobOptions(-1, top, None, True) if wants else None
        reqs = [GenerateReq(_rids(body, 1)[0], ids, _sampling(body, chat=True), logprob)]
        return await _respond(request, tm, body, reqs, ChatRenderer(), served_name)


class CompletionRenderer:
    """Choices of /v1/completions: text (after the prompt when echoing) and logprobs."""
    kind = "text_completion"
    chunk_kind = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, echoes: list[str] | None, n: int):
        self.echoes, self.n = echoes, n
        self.logprobs: dict[int, CompletionLogprobs] = {}

    def choice(self, index: int, text: str, meta: dict, first: bool, sent: int, final: bool,
               stream: bool = False) -> dict:
        """first: this choice's first piece (a stream's first chunk, or the whole answer);
        sent: output logprobs already sent for it; stream: a chunk rather than a whole choice."""
        if first and self.echoes is not None:
            text = self.echoes[index // self.n] + text
        logprobs = None
        if "output_token_logprobs" in meta:
            with_prompt = first and self.echoes is not None
            entries = (meta["input_token_logprobs"] if with_prompt else []) + meta["output_token_logprobs"][sent:]
            tops = None
            if "output_top_logprobs" in meta:
                tops = (meta["input_top_logprobs"] if with_prompt else []) + meta["output_top_logprobs"][sent:]
            # a prompt's first token has no logprob (None) and, decoded alone, may have no text
            entries = [[v, t, text_ or ""] for v, t, text_ in entries]
            logprobs = self.logprobs.setdefault(index, CompletionLogprobs()).render(entries, tops)
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason(meta) if final else None,
                "matched_stop": matched_stop(meta) if final else None}


class ChatRenderer:
    """Choices of /v1/chat/completions: the assistant message (a delta when streaming)."""
    kind = "chat.completion"
    chunk_kind = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def choice(self, index: int, text: str, meta: dict, first: bool, sent: int, final: bool,
               stream: bool = False) -> dict:
        logprobs = None
        if "output_token_logprobs" in meta:
            logprobs = chat_logprobs(meta["output_token_logprobs"][sent:],
                                     meta.get("output_top_logprobs", [])[sent:])
        message = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, ("delta" if stream else "message"): message, "logprobs": logprobs,
                "finish_reason": finish_reason(meta) if final else None,
                "matched_stop": matched_stop(meta) if final else None}


async def _respond(request: Request, tm: TokenizerManager, body: dict, reqs: list[GenerateReq], renderer,
                   served_name: str):
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ValueError("stream must be a boolean")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or options.get("continuous_usage_stats"):
        raise ValueError("stream_options must be an object with include_usage; "
                         "continuous_usage_stats is not supported")
    streams = await wait_or_abort_on_disconnect(request, tm.start_batch(reqs))
    n = reqs[0].sampling.n
    model = body.get("model") or served_name
    created = int(time.time())
    rid = reqs[0].rid or renderer.id_prefix + uuid.uuid4().hex
    head = {"id": rid, "created": created, "model": model}
    if not stream:
        outs = await wait_or_abort_on_disconnect(request, _gather_last(streams))
        choices = [renderer.choice(i, out.text, out.meta, True, 0, True) for i, out in enumerate(outs)]
        return json_response({**head, "object": renderer.kind, "choices": choices,
                              "usage": usage([out.meta for out in outs], n)})

    _, events = await peek(merge_streams(streams), request)
    async def sse_events():
        sent_text, sent_logprobs, last = {}, {}, {}
        async for index, out, _ in events:
            first = index not in sent_text
            delta = out.text[sent_text.get(index, 0):]
            sent_text[index] = len(out.text)
            last[index] = out.meta
            if delta or first or out.finished:
                choice = renderer.choice(index, delta, out.meta, first, sent_logprobs.get(index, 0),
                                         out.finished, stream=True)
                sent_logprobs[index] = len(out.meta.get("output_token_logprobs", ()))
                yield sse({**head, "object": renderer.chunk_kind, "choices": [choice]})
        if options.get("include_usage") and last:
            yield sse({**head, "object": renderer.chunk_kind, "choices": [],
                       "usage": usage([last[i] for i in sorted(last)], n)})
        yield SSE_DONE

    return StreamingResponse(sse_events(), media_type="text/event-stream")


async def _gather_last(streams) -> list:
    outs = []
    for stream in streams:  # each runs in the scheduler meanwhile: waiting in order costs nothing
        out, _ = await last_output(stream)
        outs.append(out)
    return outs


def _completion_prompts(tm: TokenizerManager, prompt) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) of each prompt: a string, a list of strings, token ids or a list
    of token-id lists."""
    if isinstance(prompt, str):
        return [(prompt, tm.input_ids_of(prompt, None, "prompt"))]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [(None, tm.input_ids_of(None, prompt))]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [(p, tm.input_ids_of(p, None, "prompt[i]")) for p in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return [(None, tm.input_ids_of(None, p)) for p in prompt]
    raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of "
                     "token-id lists")


def _rids(body: dict, n: int) -> list:
    """Each prompt's request id: the given list, or the given string (suffixed "-i" for a batch)."""
    rid = body.get("rid")
    if rid is None or (isinstance(rid, str) and n == 1):
        return [rid] * n
    if isinstance(rid, str):
        return [f"{rid}-{i}" for i in range(n)]
    if isinstance(rid, list) and len(rid) == n and all(isinstance(r, str) for r in rid):
        return rid
    raise ValueError("rid must be a string, or a list of strings with one per prompt")


def _chat_prompt(tm: TokenizerManager, body: dict) -> list[int]:
    if body.get("input_ids") is not None:  # SGLang: given ids bypass the chat template
        return tm.input_ids_of(None, body["input_ids"])
    continue_final = body.get("continue_final_message", False)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(continue_final, bool) or not isinstance(kwargs, dict):
        raise ValueError("continue_final_message must be a boolean and chat_template_kwargs an object")
    messages = _messages(body.get("messages"))
    try:
        text = tm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not continue_final,
                                                continue_final_message=continue_final, **kwargs)
    except Exception as err:  # the template's own checks (e.g. no final assistant message to continue)
        raise ValueError(f"messages could not be formatted by the chat template: {err}") from None
    return tm.input_ids_of(text, None, "messages")


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
    params = {name: body[field] for field, name in OPENAI_SAMPLING.items() if body.get(field) is not None}
    default = DEFAULT_MAX_TOKENS["chat" if chat else "completions"]
    if "max_new_tokens" not in params and default is not None:
        params["max_new_tokens"] = default
    if body.get("json_schema") is not None:
        params["json_schema"] = body["json_schema"]
    params.update(_response_format(body.get("response_format")))
    try:
        return SamplingParams.from_dict(params)
    except ValueError as err:  # name the OpenAI field, not ours
        message = str(err)
        for field, name in OPENAI_SAMPLING.items():
            if f"sampling_params.{name} " in message and field in body:
                message = message.replace(f"sampling_params.{name}", field)
        raise ValueError(message.replace("sampling_params.", "")) from None


def _response_format(fmt) -> dict:
    """response_format as a grammar, as SGLang maps it: json_object -> any JSON object,
    json_schema -> its schema."""
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return {"json_schema": json.dumps(schema)}
    if kind == "structural_tag":
        raise ValueError("response_format structural_tag is not supported (tool calling is not supported)")
    raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")

"""OpenAI response pieces from SGLang-shaped outputs: logprobs (completions and chat), finish
reasons and usage, as SGLang's serving_completions.py / serving_chat.py build them.

A logprob entry here is SGLang's [logprob, token_id, text] (the routes ask for texts).
"""

from __future__ import annotations


class CompletionLogprobs:
    """Completions' logprobs object ({tokens, token_logprobs, top_logprobs, text_offset}) of one
    choice, built piecewise so a stream sends each token once; text_offset counts the characters
    of the tokens before, from the first token reported."""

    def __init__(self):
        self.offset = 0

    def render(self, entries: list, tops: list | None) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for value, _, text in entries:
            out["tokens"].append(text)
            out["token_logprobs"].append(value)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        for top in tops or ():
            out["top_logprobs"].append(None if top is None else {text: value for value, _, text in top})
        return out


def chat_logprobs(entries: list, tops: list | None) -> dict:
    """Chat's logprobs object: {content: [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for k, (value, _, text) in enumerate(entries):
        top = (tops[k] if tops else None) or []
        content.append({**_chat_token(value, text),
                        "top_logprobs": [_chat_token(v, t) for v, _, t in top]})
    return {"content": content}


def _chat_token(value: float, text: str) -> dict:
    return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}


def finish_reason(meta: dict) -> str | None:
    reason = meta.get("finish_reason")
    return None if reason is None else reason["type"]


def matched_stop(meta: dict):
    return (meta.get("finish_reason") or {}).get("matched")


def usage(metas: list[dict], n: int) -> dict:
    """Token counts of a response whose outputs come n per prompt: each prompt counted once."""
    prompt = sum(m.get("prompt_tokens", 0) for m in metas[::n])
    completion = sum(m.get("completion_tokens", 0) for m in metas)
    cached = sum(m.get("cached_tokens", 0) for m in metas[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}

"""Token ids to the text a client sees: special tokens skipped, stop strings trimmed.

Used by the offline Engine (`output_dict`) and by the server's detokenizer process
(detokenizer_manager.py).
"""

from __future__ import annotations

from sglang_shadowkv.sampling_params import SamplingParams

from .logprob_format import format_logprobs, merge_logprobs
from .request import Req


def decode_text(tokenizer, output_ids: list[int], sampling: SamplingParams,
                finish_reason: dict | None, final: bool = True) -> str:
    """The completion's text. Unfinished (final=False), it leaves out what may still change: a
    trailing incomplete UTF-8 sequence and a tail that could begin a stop string."""
    text = tokenizer.decode(output_ids, skip_special_tokens=sampling.skip_special_tokens,
                            spaces_between_special_tokens=sampling.spaces_between_special_tokens)
    matched = (finish_reason or {}).get("matched")
    if isinstance(matched, str) and not sampling.no_stop_trim:
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    if final:
        return text
    text = text.rstrip("\ufffd")
    hold = max((k for stop in sampling.stop for k in range(1, len(stop)) if text.endswith(stop[:k])),
               default=0)
    return text[:len(text) - hold]


def meta_info(req: Req) -> dict:
    now = req.first_token_time
    return {
        "id": req.rid,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "finish_reason": req.finish_reason,
        "ttft": None if now is None else now - req.created,
        "shadowkv": req.shadowkv_info or {"compressed_tokens": 0},
    }


def output_dict(tokenizer, req: Req) -> dict:
    """The SGLang-shaped result of a finished request (with its logprobs, if it asked for them)."""
    text = decode_text(tokenizer, req.output_ids, req.sampling, req.finish_reason)
    meta = meta_info(req)
    if req.logprob is not None:
        merge_logprobs(meta, {}, format_logprobs(tokenizer, req.logprob.everything()))
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

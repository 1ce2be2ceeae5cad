"""Token ids to the text a client sees: special tokens skipped, stop strings trimmed."""

from __future__ import annotations

from .request import Req


def output_text(tokenizer, req: Req) -> str:
    sp = req.sampling
    text = tokenizer.decode(req.output_ids, skip_special_tokens=sp.skip_special_tokens,
                            spaces_between_special_tokens=sp.spaces_between_special_tokens)
    matched = (req.finish_reason or {}).get("matched")
    if isinstance(matched, str) and not sp.no_stop_trim:
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    return text


def output_dict(tokenizer, req: Req) -> dict:
    """The SGLang-shaped result of a finished request."""
    now = req.first_token_time
    meta = {
        "id": req.rid,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "finish_reason": req.finish_reason,
        "ttft": None if now is None else now - req.created,
        "shadowkv": req.shadowkv_info or {"compressed_tokens": 0},
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [
            (lp, tid, None) for lp, tid in zip(req.output_logprobs, req.output_ids)]
    return {"text": output_text(tokenizer, req), "output_ids": list(req.output_ids), "meta_info": meta}

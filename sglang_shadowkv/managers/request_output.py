"""A request's output as a client sees it, in SGLang's shape: the text (special tokens skipped,
stop strings trimmed), meta_info, and logprobs as lists of [logprob, token_id, text-or-None].

Used by the offline Engine (`output_dict`) and by the server's detokenizer process
(detokenizer_manager.py).

Logprob meta_info keys (as SGLang's tokenizer manager fills them): input_token_logprobs,
output_token_logprobs, output_token_logprobs_length; with top_logprobs_num > 0 also
input_top_logprobs / output_top_logprobs (per position None or a list of entries); with
token_ids_logprob also input_token_ids_logprobs / output_token_ids_logprobs. Text is each token
decoded alone, and only with return_text_in_logprobs. The server formats each step's delta in
the detokenizer process and the tokenizer manager appends it (`merge_logprobs`), so a stream never
re-sends what it sent.
"""

from __future__ import annotations

from sglang_shadowkv.sampling_params import SamplingParams
from sglang_shadowkv.scheduler.logprobs import LogprobDelta, TokenLogprobs
from sglang_shadowkv.scheduler.request import Req


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




def format_logprobs(tokenizer, delta: LogprobDelta) -> dict[str, list]:
    """The meta_info lists of a delta (only its new entries)."""
    opts = delta.options
    texts = _texts(tokenizer, delta) if opts.return_text else {}
    out: dict[str, list] = {}
    for side, span in (("input", delta.input), ("output", delta.output)):
        span = span or TokenLogprobs()
        out[f"{side}_token_logprobs"] = [[v, t, texts.get(t)] for v, t in zip(span.values, span.ids)]
        if opts.top_logprobs_num:
            out[f"{side}_top_logprobs"] = [
                None if top is None else [[v, t, texts.get(t)] for v, t in zip(*top)] for top in span.top]
        if opts.token_ids_logprob:
            out[f"{side}_token_ids_logprobs"] = [
                None if values is None else [[v, t, texts.get(t)] for v, t in zip(values, opts.token_ids_logprob)]
                for values in span.asked]
    return out


def merge_logprobs(meta: dict, acc: dict[str, list], formatted: dict[str, list]) -> None:
    """Extend the accumulated lists with a formatted delta and put them in meta."""
    for key, entries in formatted.items():
        acc.setdefault(key, []).extend(entries)
    meta.update(acc)
    meta["output_token_logprobs_length"] = len(acc["output_token_logprobs"])


def _texts(tokenizer, delta: LogprobDelta) -> dict[int, str]:
    ids = set()
    for span in (delta.input, delta.output):
        if span is None:
            continue
        ids.update(span.ids)
        ids.update(t for top in span.top if top is not None for t in top[1])
    ids.update(delta.options.token_ids_logprob or ())
    ordered = sorted(ids)
    return dict(zip(ordered, tokenizer.batch_decode([[t] for t in ordered])))

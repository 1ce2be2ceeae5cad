"""Logprobs in the shape SGLang's meta_info has them: lists of [logprob, token_id, text-or-None].

meta_info keys (as SGLang's tokenizer manager fills them): input_token_logprobs,
output_token_logprobs, output_token_logprobs_length; with top_logprobs_num > 0 also
input_top_logprobs / output_top_logprobs (per position None or a list of entries); with
token_ids_logprob also input_token_ids_logprobs / output_token_ids_logprobs. Text is each token
decoded alone, and only with return_text_in_logprobs. The server formats each step's delta in
the detokenizer process and the tokenizer manager appends it (`merge_logprobs`), so a stream never
re-sends what it sent.
"""

from __future__ import annotations

from .logprobs import LogprobDelta, TokenLogprobs


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

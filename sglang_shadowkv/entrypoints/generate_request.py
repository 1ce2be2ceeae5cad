"""A /generate body (SGLang's GenerateReqInput) as requests for the tokenizer manager.

One prompt or a batch (text or input_ids); per-prompt fields may be one value for all or a list
with one per prompt, as in SGLang. Every problem is a ValueError naming the field.
"""

from __future__ import annotations

from sglang_shadowkv.managers.io_struct import GenerateReq
from sglang_shadowkv.scheduler.logprobs import LogprobOptions
from sglang_shadowkv.managers.tokenizer_manager import TokenizerManager
from sglang_shadowkv.sampling_params import SamplingParams

from .request_fields import GENERATE_FIELDS, check_fields

# fields that may differ per prompt of a batch (a list with one entry per prompt)
PER_PROMPT = ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num")


def parse_generate(tm: TokenizerManager, body: dict) -> tuple[list[GenerateReq], bool, bool]:
    """(the requests, whether the body had a single prompt, whether to stream)."""
    check_fields(body, GENERATE_FIELDS, "/generate")
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
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ValueError("stream must be a boolean")
    per_prompt = {k: _per_prompt(body.get(k), len(prompts), k) for k in PER_PROMPT}
    reqs = []
    for i, ids in enumerate(prompts):
        field = {k: values[i] for k, values in per_prompt.items()}
        if field["rid"] is not None and not isinstance(field["rid"], str):
            raise ValueError("rid must be a string (or a list of strings for a batch)")
        if not isinstance(field["return_logprob"], (bool, type(None))):
            raise ValueError("return_logprob must be a boolean")
        logprob = None
        if field["return_logprob"]:
            logprob = LogprobOptions.from_fields(field["logprob_start_len"], field["top_logprobs_num"],
                                                 _token_ids_logprob(body.get("token_ids_logprob"), i),
                                                 body.get("return_text_in_logprobs"))
        reqs.append(GenerateReq(field["rid"], ids, SamplingParams.from_dict(field["sampling_params"]),
                                logprob))
    return reqs, single, stream


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def _token_ids_logprob(value, i: int):
    """One list of ids for every prompt, or a list of such lists (one per prompt)."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        if i >= len(value):
            raise ValueError("token_ids_logprob has fewer lists than there are prompts")
        return value[i]
    return value

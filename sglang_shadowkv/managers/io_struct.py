"""Messages between the server's processes (pickled over ZMQ sockets).

tokenizer manager → scheduler: GenerateReq, AbortReq, ControlReq
scheduler → detokenizer: lists of TokenOut;  detokenizer → tokenizer manager: lists of TextOut
scheduler → tokenizer manager: ControlOut (answers to ControlReq)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglang_shadowkv.sampling_params import SamplingParams

from sglang_shadowkv.scheduler.logprobs import LogprobDelta, LogprobOptions


@dataclass
class GenerateReq:
    rid: str | None  # None: the tokenizer manager names it
    input_ids: list[int]
    sampling: SamplingParams
    logprob: LogprobOptions | None = None  # None: return_logprob is off


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    call_id: int
    kind: str  # "flush_cache" | "server_info" | "start_profile" | "stop_profile"
    args: dict = field(default_factory=dict)


@dataclass
class ControlOut:
    call_id: int
    result: Any


@dataclass
class TokenOut:
    """One request's progress in one scheduler step (or its rejection, with `error`)."""
    rid: str
    new_ids: list[int]
    finished: bool
    meta: dict
    sampling: SamplingParams
    error: str | None = None
    logprobs: LogprobDelta | None = None  # what this step added (return_logprob)


@dataclass
class TextOut:
    rid: str
    text: str  # cumulative, as SGLang's /generate streams it
    new_ids: list[int]
    finished: bool
    meta: dict
    error: str | None = None
    logprobs: dict | None = None  # this step's logprobs in SGLang's meta_info shape (logprob_format.py)

"""A request's life in the scheduler: its tokens, its pages, how far its KV is computed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_shadowkv.mem_cache.radix_cache import TreeNode
from sglang_shadowkv.sampling_params import SamplingParams

from sglang_shadowkv.scheduler.logprobs import ReqLogprobs


def valid_token_ids(input_ids: list, vocab_size: int) -> bool:
    """Whether every id is an int (not a bool) in [0, vocab_size), checked by C-level builtins: a
    Python test per token cost ~8 ms for a 128K-token prompt, in every request's time to first
    token."""
    return set(map(type, input_ids)) <= {int} and 0 <= min(input_ids) and max(input_ids) < vocab_size


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    logprob: ReqLogprobs | None = None  # what return_logprob asked for and has got (logprobs.py)
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    num_sampled: int = 0  # tokens sampled so far, including one whose step is still on the device
    grammar: Any = None  # the constrained-decoding matcher (constrained/), once its grammar compiled
    # cache state
    pool_row: int | None = None
    # token i lives in pages[i // page_size]: a dense page id or a compressed ChunkRef
    pages: list = field(default_factory=list)
    num_borrowed: int = 0  # leading entries that belong to the radix tree (the matched prefix)
    last_node: TreeNode | None = None  # locked radix node of the matched prefix (then of the prompt)
    duplicate_entries: list = field(default_factory=list)  # own copies of entries another request cached first
    cached_tokens: int = 0  # prompt tokens reused from the radix cache
    num_computed: int = 0  # tokens whose K/V are in the pool
    reserved_pages: int = 0  # pages promised at admission, not yet allocated
    max_total_len: int = 0  # prompt + the most tokens it may generate
    shadowkv: Any = None  # ShadowKVReqState when its prefix is (or its prompt will be) compressed
    shadowkv_info: dict | None = None  # the request's ShadowKV memory report, set when it finishes
    document_key: int | None = None  # its long prompt's identity for the compressed tier (prefill.py)
    arrival_tokens: int = 0  # the prefill manager's token clock when it arrived (hrrn's aging)
    finish_reason: dict[str, Any] | None = None
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def prompt_done(self) -> bool:
        return self.num_computed >= len(self.input_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def over_compressed_prefix(self) -> bool:
        """Whether its prefix holds compressed chunks (matched at admission or its own, compressed)."""
        return self.shadowkv is not None and self.shadowkv.layout is not None

    @property
    def may_sample(self) -> bool:
        """Whether another token may be sampled (counting tokens still on the device)."""
        return len(self.input_ids) + self.num_sampled < self.max_total_len

    @property
    def needs_host_tokens(self) -> bool:
        """Its next step needs its last token seen on the host (penalties over the output so far,
        a grammar's mask, logprobs recorded per sampled token), so the scheduler processes the
        pending step before launching the next."""
        return self.sampling.has_penalties or self.grammar is not None or self.logprob is not None

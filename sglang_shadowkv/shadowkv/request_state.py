"""What ShadowKV keeps for one running request between steps."""

from __future__ import annotations

from dataclasses import dataclass

from sglang_shadowkv.mem_cache.shadow_pool import Segment


@dataclass
class ShadowReqState:
    segment: Segment  # reserved at admission, filled when the prompt's prefill completes
    scratch_row: int  # the request's chunk-cache scratch in the SparseDecoder
    compress_now: bool = False  # this step completes the prompt: compress after each layer's attention
    compressed: bool = False  # decode runs the sparse path; the segment's dense pages are freed

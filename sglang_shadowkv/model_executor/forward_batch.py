"""What one scheduled step asks of the model: a StepItem per request, built into the ForwardBatch
the attention backends read (layers/attention/base.py). Shared by the model runner and the
CUDA-graph runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_shadowkv.layers.attention.base import ForwardBatch
from sglang_shadowkv.mem_cache.kv_pool import ReqToTokenPool, to_device


@dataclass
class StepItem:
    """One request's share of a step: compute its new tokens starting at position `start`.

    A prefill chunk brings its prompt tokens; a decode step's one token is the request's last
    sampled token, which stays on the device (ModelRunner.next_input) so the step can be launched
    before the previous step's tokens reach the host (overlap scheduling).
    """
    pool_row: int
    token_ids: list[int]  # prompt tokens of a prefill chunk ([] for a decode step)
    start: int
    shadowkv: object | None = None  # the request's ShadowKVReqState (its compressed prefix), if any
    prompt_len: int | None = None  # the request's prompt length (None: not tracked)
    cached_len: int = 0  # prompt tokens the radix cache supplied (this request did not prefill them)

    @property
    def is_decode(self) -> bool:
        return not self.token_ids

    @property
    def over_compressed_prefix(self) -> bool:
        """Whether the request's prefix is compressed and its tokens take ShadowKV's sparse paths (a
        prompt over a compressed prefix loaded dense does not: ShadowKVReqState.reads_compressed)."""
        return self.shadowkv is not None and self.shadowkv.reads_compressed

    @property
    def num_new(self) -> int:
        return len(self.token_ids) or 1

    @property
    def seq_len(self) -> int:
        return self.start + self.num_new


def build_forward_batch(items: list[StepItem], table: ReqToTokenPool, next_input: torch.Tensor,
                        device: torch.device) -> ForwardBatch:
    """The step's batch: positions, slots and token ids on the device, without a host sync. A
    decode item's input token is its request's last sampled token, read from next_input (by
    request-to-token row) on the device."""
    q_lens = [it.num_new for it in items]
    seq_lens = [it.seq_len for it in items]
    rows = [it.pool_row for it in items]
    q_indptr = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    kv_indptr = torch.tensor([0] + seq_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    kv_indices = table.span_slots(rows, [0] * len(items), seq_lens)
    out_cache_loc = table.span_slots(rows, [it.start for it in items], seq_lens).long()
    positions = torch.cat([torch.arange(it.start, it.seq_len) for it in items])
    input_ids = to_device(torch.tensor([t for it in items for t in (it.token_ids or [0])]), device)
    decode = [i for i, it in enumerate(items) if it.is_decode]
    if decode:  # decode tokens: each request's last sampled token, already on the device
        starts = q_indptr.tolist()  # a host tensor: no sync
        at = to_device(torch.tensor([[starts[i] for i in decode], [rows[i] for i in decode]]), device)
        input_ids[at[0]] = next_input[at[1]]
    return ForwardBatch(
        input_ids=input_ids, positions=to_device(positions, device), out_cache_loc=out_cache_loc,
        q_indptr=to_device(q_indptr, device), kv_indptr=to_device(kv_indptr, device), kv_indices=kv_indices,
        extend_lens=q_lens, seq_lens=seq_lens, pool_rows=rows,
        shadowkv=[it.shadowkv for it in items], prompt_lens=[it.prompt_len for it in items],
        cached_lens=[it.cached_len for it in items])

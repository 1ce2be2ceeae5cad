"""KV-eviction baselines as attention modes: StreamingLLM and SnapKV, to compare ShadowKV against.

Both keep the dense pool and hide evicted keys with a mask per (slot, KV head), so attention is
exactly what the evicting method computes while memory is not saved (these modes exist to measure
accuracy). The mask belongs to the slots, so the radix cache shares the evicted state: a later
turn that reuses a cached prefix sees only what survived, i.e. eviction is permanent. Attention
runs through the torch reference path, the one that takes per-head masks.

- StreamingLLM: after a prompt and at every decode step, keep the first `sinks` tokens and the
  most recent `budget - sinks` tokens.
- SnapKV: when a prompt's own (not cached) part is longer than `budget`, the queries of its last
  `window` tokens score the part's keys (softmax, summed over the window and the KV group's query
  heads, max-pooled over neighbouring tokens); per KV head the top `budget - window` tokens and
  the window stay, the rest of the part is evicted. Later tokens are never evicted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_shadowkv.kernels.ragged_paged_attention import causal_mask, ragged_paged_attention_reference

from .base import AttentionBackend, ForwardBatch

EVICTION_POLICIES = ("streamingllm", "snapkv")
SNAPKV_POOL_KERNEL = 7


class StreamingLLMPolicy:
    def __init__(self, budget: int, sinks: int):
        self.budget, self.sinks = budget, sinks

    def after_attention(self, hidden, q, k_pool, slots, seq_len, prompt_len, cached_len, sm_scale):
        if seq_len >= prompt_len:  # the prompt is complete: from now on the cache rolls
            hidden[slots[self.sinks:max(self.sinks, seq_len - (self.budget - self.sinks))]] = True


class SnapKVPolicy:
    def __init__(self, budget: int, window: int):
        self.budget, self.window = budget, window

    def after_attention(self, hidden, q, k_pool, slots, seq_len, prompt_len, cached_len, sm_scale):
        if seq_len != prompt_len or prompt_len - cached_len <= self.budget:
            return  # not the step that completes a long prompt
        num_kv_heads = k_pool.shape[1]
        group = q.shape[1] // num_kv_heads
        window = min(self.window, q.shape[0])
        candidates = slice(cached_len, prompt_len - window)
        q_win = q[-window:].float().transpose(0, 1)  # [Hq, w, D]
        keys = k_pool[slots[:prompt_len]].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (q_win @ keys.transpose(1, 2)) * sm_scale  # [Hq, w, L]
        unhidden = ~hidden[slots[:prompt_len]].T.repeat_interleave(group, dim=0)  # [Hq, L]
        visible = causal_mask(window, prompt_len, q.device)[None] & unhidden[:, None, :]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).sum(1)  # [Hq, L]
        votes = probs.view(num_kv_heads, group, prompt_len).sum(1)[:, candidates]  # [Hkv, candidates]
        votes = F.max_pool1d(votes[None], SNAPKV_POOL_KERNEL, 1, SNAPKV_POOL_KERNEL // 2)[0]
        keep = votes.topk(self.budget - window, dim=-1).indices
        evict = torch.ones_like(votes, dtype=torch.bool).scatter_(1, keep, False)  # [Hkv, candidates]
        hidden[slots[candidates]] |= evict.T


def make_eviction_policy(args):
    if args.attention == "streamingllm":
        return StreamingLLMPolicy(args.eviction_budget, args.streamingllm_sinks)
    return SnapKVPolicy(args.eviction_budget, args.snapkv_window)


class EvictionAttentionBackend(AttentionBackend):
    supports_graphs = False  # its per-slot masks are updated by host-side policies after each layer

    def __init__(self, pool, num_heads: int, head_dim: int, policy):
        super().__init__(pool, num_heads, head_dim)
        self.policy = policy
        num_slots, num_kv_heads = pool.k_buffers[0].shape[:2]
        self.hidden = [torch.zeros(num_slots, num_kv_heads, dtype=torch.bool, device=pool.device)
                       for _ in pool.k_buffers]

    def forward(self, q, k, v, layer, batch):
        self.hidden[layer].index_fill_(0, batch.out_cache_loc, False)  # a reused slot starts visible
        return super().forward(q, k, v, layer, batch)

    def attend(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        hidden, k_pool = self.hidden[layer], self.pool.k_buffers[layer]
        out = ragged_paged_attention_reference(q, k_pool, self.pool.v_buffers[layer], batch.q_indptr,
                                               batch.kv_indptr, batch.kv_indices, self.sm_scale, hidden)
        if batch.prompt_lens is None:
            return out
        q_ptr, kv_ptr = batch.q_indptr.tolist(), batch.kv_indptr.tolist()
        for i, prompt_len in enumerate(batch.prompt_lens):
            if prompt_len is not None:
                slots = batch.kv_indices[kv_ptr[i]:kv_ptr[i + 1]].long()
                self.policy.after_attention(hidden, q[q_ptr[i]:q_ptr[i + 1]], k_pool, slots, batch.seq_lens[i],
                                            prompt_len, batch.cached_lens[i], self.sm_scale)
        return out

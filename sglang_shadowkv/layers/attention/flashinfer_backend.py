"""FlashInfer paged attention (GPU): the decode wrapper for pure decode steps, the prefill
wrapper (causal, ragged queries over paged KV) for steps that carry prefill chunks."""

from __future__ import annotations

import torch

from .base import AttentionBackend, ForwardBatch

WORKSPACE_BYTES = 256 * 1024 * 1024


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, pool, num_heads, head_dim):
        super().__init__(pool, num_heads, head_dim)
        import flashinfer  # deferred: only the GPU extra installs it

        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        ps = pool.page_size
        self._paged = [(k.view(-1, ps, *k.shape[1:]), v.view(-1, ps, *v.shape[1:]))
                       for k, v in zip(pool.k_buffers, pool.v_buffers)]

    def begin_step(self, batch: ForwardBatch) -> None:
        ps = self.pool.page_size
        page_indptr, page_ids, last_len = batch.page_table(ps)  # indptrs on the host: no sync
        kv_dtype = self.pool.k_buffers[0].dtype
        num_kv_heads = self.pool.k_buffers[0].shape[1]
        self._use_decode = batch.is_decode
        if self._use_decode:
            self._decode.plan(page_indptr, page_ids, last_len, self.num_heads, num_kv_heads,
                              self.head_dim, ps, pos_encoding_mode="NONE", q_data_type=kv_dtype,
                              kv_data_type=kv_dtype, sm_scale=self.sm_scale)
        else:
            self._prefill.plan(batch.q_indptr.cpu(), page_indptr, page_ids, last_len, self.num_heads,
                               num_kv_heads, self.head_dim, ps, causal=True, sm_scale=self.sm_scale,
                               q_data_type=kv_dtype, kv_data_type=kv_dtype)

    def attend(self, q, layer, batch):
        wrapper = self._decode if self._use_decode else self._prefill
        return wrapper.run(q.contiguous(), self._paged[layer])

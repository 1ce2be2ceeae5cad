"""Triton attention over the paged pool (GPU, or CPU under TRITON_INTERPRET=1)."""

from sglang_shadowkv.kernels.ragged_paged_attention import ragged_paged_attention

from .base import AttentionBackend


class TritonAttentionBackend(AttentionBackend):
    def begin_step(self, batch):
        self._max_q_len = max(batch.extend_lens)

    def attend(self, q, layer, batch):
        return ragged_paged_attention(
            q, self.pool.k_buffers[layer], self.pool.v_buffers[layer],
            batch.q_indptr, batch.kv_indptr, batch.kv_indices, self.sm_scale,
            max_q_len=self._max_q_len)

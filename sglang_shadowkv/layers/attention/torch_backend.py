"""Reference attention in plain torch: runs anywhere, defines what the fast backends must equal."""

from sglang_shadowkv.kernels.ragged_paged_attention import ragged_paged_attention_reference

from .base import AttentionBackend


class TorchAttentionBackend(AttentionBackend):
    capturable = False  # the reference walks the ragged batch on the host (.tolist())

    def attend(self, q, layer, batch):
        return ragged_paged_attention_reference(
            q, self.pool.k_buffers[layer], self.pool.v_buffers[layer],
            batch.q_indptr, batch.kv_indptr, batch.kv_indices, self.sm_scale)

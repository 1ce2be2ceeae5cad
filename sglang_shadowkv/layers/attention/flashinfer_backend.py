"""FlashInfer paged attention (GPU): the decode wrapper for pure decode steps, the prefill
wrapper (causal, ragged queries over paged KV) for steps that carry prefill chunks, and one
CUDA-graph decode wrapper per captured batch size, planned before each replay into its fixed
page-table buffers (as SGLang's FlashInfer backend does). The graphs' wrappers have a workspace of
their own: a ShadowKV mixed step replays a decode graph beside its eager prompt chunk."""

from __future__ import annotations

import torch

from .base import AttentionBackend, ForwardBatch

WORKSPACE_BYTES = 256 * 1024 * 1024
# the head dims FlashInfer's kernels are dispatched for (its DISPATCH_HEAD_DIM, 0.7.2): another one
# failed inside a step ("Unsupported head_dim: 16" from its state merge), not at startup
HEAD_DIMS = (64, 128, 256, 512)


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, pool, num_heads, head_dim):
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"attention_backend flashinfer: FlashInfer's kernels take head dims "
                             f"{', '.join(map(str, HEAD_DIMS))}; this model's is {head_dim} "
                             f"(--attention-backend triton serves it)")
        super().__init__(pool, num_heads, head_dim)
        import flashinfer  # deferred: only the GPU extra installs it

        self._flashinfer = flashinfer
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._graph_decode: dict[int, object] = {}  # batch size -> CUDA-graph decode wrapper
        self._graph_workspace: torch.Tensor | None = None  # made with the graph state
        ps = pool.page_size
        self._paged = [(k.view(-1, ps, *k.shape[1:]), v.view(-1, ps, *v.shape[1:]))
                       for k, v in zip(pool.k_buffers, pool.v_buffers)]
        self._planned: dict[int, torch.cuda.Event] = {}  # per wrapper: its last plan's copy
        self._wrapper = None

    def _plan(self, wrapper, *args, **kwargs) -> None:
        """plan() stages its tables in the wrapper's page-locked buffer and copies them to the
        device asynchronously; with overlap scheduling that wrapper's last copy may still be queued
        behind the step in flight, so wait for it before the buffer is written again (only the same
        wrapper's: another's copy does not touch this buffer)."""
        planned = self._planned.get(id(wrapper))
        if planned is not None:
            planned.synchronize()
        wrapper.plan(*args, **kwargs)
        planned = self._planned[id(wrapper)] = torch.cuda.Event()
        planned.record()
        self._wrapper = wrapper

    def _plan_decode(self, wrapper, batch: ForwardBatch) -> None:
        ps = self.pool.page_size
        page_indptr, page_ids, last_len = batch.page_table(ps)  # indptrs on the host: no sync
        kv_dtype = self.pool.k_buffers[0].dtype
        self._plan(wrapper, page_indptr, page_ids, last_len, self.num_heads, self.pool.k_buffers[0].shape[1],
                   self.head_dim, ps, pos_encoding_mode="NONE", q_data_type=kv_dtype,
                   kv_data_type=kv_dtype, sm_scale=self.sm_scale)

    def begin_step(self, batch: ForwardBatch) -> None:
        if batch.is_decode:
            self._plan_decode(self._decode, batch)
            return
        ps = self.pool.page_size
        page_indptr, page_ids, last_len = batch.page_table(ps)
        kv_dtype = self.pool.k_buffers[0].dtype
        q_indptr = torch.tensor([0, *batch.extend_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self._plan(self._prefill, q_indptr, page_indptr, page_ids, last_len, self.num_heads,
                   self.pool.k_buffers[0].shape[1], self.head_dim, ps, causal=True, sm_scale=self.sm_scale,
                   q_data_type=kv_dtype, kv_data_type=kv_dtype)

    def init_graph_state(self, max_bs, max_kv_tokens, req_to_token):
        super().init_graph_state(max_bs, max_kv_tokens, req_to_token)
        dev, ps = self.pool.device, self.pool.page_size
        self._graph_page_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self._graph_page_ids = torch.zeros(max_kv_tokens // ps + max_bs, dtype=torch.int32, device=dev)
        self._graph_last_len = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self._graph_workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)

    def begin_graph_step(self, batch: ForwardBatch, variant) -> None:
        bs = batch.batch_size
        wrapper = self._graph_decode.get(bs)
        if wrapper is None:
            wrapper = self._graph_decode[bs] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._graph_workspace, "NHD", use_cuda_graph=True,
                paged_kv_indptr_buffer=self._graph_page_indptr[:bs + 1],
                paged_kv_indices_buffer=self._graph_page_ids,
                paged_kv_last_page_len_buffer=self._graph_last_len[:bs])
        self.fill_graph_kv(batch)  # the slots the page ids are read from
        self._plan_decode(wrapper, batch)

    def attend(self, q, layer, batch):
        return self._wrapper.run(q.contiguous(), self._paged[layer])

"""Exact attention beside ShadowKV on one prompt: the selection report of every layer
(`Engine.shadowkv_report`, benchmarks/fidelity.py).

One dense prefill of the prompt records each layer's queries of its last tokens. Then, per
configuration, the prompt's long span is compressed into a private pool exactly as the server
compresses it, and each layer is compared with exact attention (shadowkv/selection_report.py);
the decoder's own step also runs for the last query, so the report and the engine are seen to agree.
"""

from __future__ import annotations

import torch

from sglang_shadowkv.kernels.ragged_paged_attention import ragged_paged_attention_reference
from sglang_shadowkv.kernels.scratch_blocks import scratch_blocks
from sglang_shadowkv.mem_cache.compressed_layout import segment_pages, slot_layout
from sglang_shadowkv.mem_cache.compressed_pool import ShadowKVPool
from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool
from sglang_shadowkv.shadowkv.compress import compress_layer
from sglang_shadowkv.shadowkv.config import ShadowKVConfig
from sglang_shadowkv.shadowkv.decode import SparseDecoder, SparseRequest
from sglang_shadowkv.shadowkv.request_state import segment_layout
from sglang_shadowkv.shadowkv.selection_report import SCORING_RULES, layer_report, summarize

from sglang_shadowkv.model_executor.forward_batch import StepItem
from sglang_shadowkv.model_executor.model_runner import ModelRunner


class QueryRecorder:
    """Wraps a dense backend; keeps each layer's queries of the step's last `keep` tokens."""

    def __init__(self, inner, keep: int):
        self.inner, self.keep, self.queries = inner, keep, {}

    def begin_step(self, batch):
        self.inner.begin_step(batch)

    def forward(self, q, k, v, layer, batch):
        self.queries[layer] = q[-self.keep:].clone()
        return self.inner.forward(q, k, v, layer, batch)


def shadowkv_report(runner: ModelRunner, ids: list[int], configs: list[ShadowKVConfig],
                    num_queries: int = 16, rules=SCORING_RULES) -> list[dict]:
    """Per configuration: the chosen ranks, GPU bytes, and per layer the selection report of the
    prompt's last num_queries queries (each attending as a decode query would) and the decoder's
    output error for the last one."""
    pool, table, model = runner.pool, runner.req_to_token, runner.model
    dense_backend = getattr(runner.backend, "dense", runner.backend)  # ShadowKV wraps a dense one
    row = table.alloc()
    pages = pool.alloc(-(-len(ids) // pool.page_size))
    if row is None or pages is None:
        raise RuntimeError("shadowkv_report: no free request row or KV pages (is the engine busy?)")
    try:
        table.write(row, 0, pool.slots_of_pages(pages, len(ids)))
        recorder = QueryRecorder(dense_backend, num_queries)
        batch = runner.build_batch([StepItem(row, ids, 0)])
        recorder.begin_step(batch)
        with torch.inference_mode():
            model(batch, recorder)
        slots = table.table[row, :len(ids)].long()
        return [_one_config(runner, row, slots, recorder.queries, cfg, rules) for cfg in configs]
    finally:
        pool.free(pages)
        table.free(row)


def _one_config(runner: ModelRunner, row: int, slots: torch.Tensor, queries: dict, cfg: ShadowKVConfig,
                rules) -> dict:
    pool, model, mc, dev = runner.pool, runner.model, runner.config, runner.device
    s, nq = slots.numel(), queries[0].shape[0]
    span = cfg.compressed_len(s, pool.page_size)
    if span == 0 or span > s - nq:
        raise ValueError(f"a {s}-token prompt leaves nothing to compress with shadowkv_min_context="
                         f"{cfg.min_context} and {nq} queries (shadowkv_local_window={cfg.local_window})")
    n = span // cfg.chunk_size
    store = private_store(runner, cfg, n)
    decoder = SparseDecoder(store, cfg, model.rotary, 1, n, dev.type == "cuda")
    seg = store.alloc_segment(0, span, cfg.num_outliers(n))
    plan = decoder.plan_step(runner.req_to_token, [SparseRequest(row, decoder.alloc_row(),
                                                                 segment_layout(seg, cfg.chunk_size), s)])
    positions = torch.arange(s - nq, s, device=dev)
    layers = []
    with torch.inference_mode():
        for layer in range(mc.num_layers):
            k, v = pool.k_buffers[layer][slots], pool.v_buffers[layer][slots]
            compress_layer(store, seg, layer, k[:span], v[:span], model.rotary, cfg)
            outliers = (store.outlier_pos[layer][seg.outlier_blocks.long()] - seg.start) // cfg.chunk_size
            k_held, v_held = held_kv(decoder, seg, layer, plan.rows, k[:span], v[:span], outliers)
            landmarks = store.landmarks_of(layer, seg.chunk_slots)
            report = layer_report(queries[layer], positions, k, v, k_held, v_held, landmarks, outliers, cfg, rules)
            q_last = queries[layer][-1:]
            want = ragged_paged_attention_reference(
                q_last, pool.k_buffers[layer], pool.v_buffers[layer], torch.tensor([0, 1], device=dev),
                torch.tensor([0, s], device=dev), slots.int(), mc.head_dim ** -0.5).float()
            got = decoder.attend(q_last, layer, plan, pool).float()
            report["decode_output_error"] = float((got - want).norm() / want.norm())
            report["rank"] = int(seg.ranks[layer])
            layers.append(report)
    saving = _gpu_bytes(store, seg, decoder, runner, s - span)
    return {"config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}, "prompt_tokens": s,
            "compressed_tokens": span, "queries": nq, "ranks": seg.settle_ranks(), **saving, "layers": layers,
            "summary": summarize([{"layers": layers, "gpu_saving_vs_full": saving["gpu_saving_vs_full"],
                                   "gpu_saving_vs_full_with_bounds": saving["gpu_saving_vs_full_with_bounds"]}])}


def private_store(runner: ModelRunner, cfg: ShadowKVConfig, num_chunks: int) -> ShadowKVPool:
    """A compressed pool of its own (in a page pool of its own) for one segment of num_chunks and
    one chunk-cache scratch row."""
    mc, max_rank = runner.config, cfg.max_rank(runner.config.kv_dim)
    layout = slot_layout(cfg.chunk_size, mc.num_kv_heads, mc.head_dim, max_rank, runner.dtype,
                         cfg.landmark_torch_dtype or runner.dtype, cfg.host_value_torch_dtype or runner.dtype)
    pages = segment_pages(layout, num_chunks, cfg.num_outliers(num_chunks), max_rank, cfg.chunk_size)
    scratch = cfg.budget_chunks(num_chunks)  # SparseDecoder.row_pages of a decoder for num_chunks
    kv = PagedKVPool(pages + scratch + 2, cfg.chunk_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, runner.dtype,
                     runner.device)
    return ShadowKVPool(kv, max_rank, num_chunks, 1, cfg.host_value_torch_dtype, cfg.landmark_torch_dtype)


def held_kv(decoder: SparseDecoder, seg, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            outliers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What decode attends for every compressed chunk of one layer [span, Hkv, D]: keys rebuilt and
    values gathered through the decoder's own chunk-cache fetch (a scratch-full at a time), outlier
    chunks [Hkv, o] exact (k, v: the exact keys and values of the span)."""
    n, c, (h, d) = seg.num_chunks, decoder.pool.chunk_size, k.shape[1:]
    size = decoder.max_entries
    k_held, v_held = k.clone().view(n, c, h, d), v.clone().view(n, c, h, d)
    heads = torch.arange(h, device=k.device)[:, None]
    for a in range(0, n, size):
        piece = seg.chunk_slots[a:a + size].long()
        m = piece.numel()
        selected = torch.nn.functional.pad(piece.expand(h, m), (0, size - m), value=-1)[None]
        entries = decoder.fetch_selected(layer, rows, selected)[:, :, :m]  # [1, Hkv, m]
        blocks = scratch_blocks(decoder.scratch_pages, rows, entries)[0]
        for held, memory in ((k_held, decoder.pool.blocks_k), (v_held, decoder.pool.blocks_v)):
            held[a:a + m] = memory[layer][blocks].permute(1, 2, 0, 3).to(held.dtype)
    for held, exact in ((k_held, k), (v_held, v)):  # outlier chunks stay exact on the GPU
        exact = exact.view(n, c, h, d)
        held[outliers.T.long(), :, heads.T] = exact[outliers.T.long(), :, heads.T]
    return k_held.view(n * c, h, d), v_held.view(n * c, h, d)


def _gpu_bytes(store: ShadowKVPool, seg, decoder: SparseDecoder, runner: ModelRunner, dense_tokens: int) -> dict:
    """GPU bytes of the compressed prompt against a full KV cache, with the mean landmarks
    (`mean` scoring) and with the two bound landmarks per chunk that `bounds` scoring keeps."""
    sizes = store.segment_bytes(seg)
    per_token = runner.pool.bytes_per_token
    gpu = sizes["gpu_compressed_bytes"] + decoder.scratch_bytes_per_request + dense_tokens * per_token
    full = (seg.num_tokens + dense_tokens) * per_token
    landmark = store.landmarks[0]  # one landmark row per chunk slot and layer
    landmark_bytes = seg.num_chunks * landmark[0].numel() * landmark.element_size() * store.num_layers
    bounds_gpu = gpu + landmark_bytes  # two landmarks (min, max) for one mean
    return {"gpu_bytes": {**sizes, "gpu_scratch_bytes": decoder.scratch_bytes_per_request,
                          "dense_kv_bytes": dense_tokens * per_token, "gpu_total_bytes": gpu, "full_kv_bytes": full},
            "gpu_saving_vs_full": full / gpu, "gpu_saving_vs_full_with_bounds": full / bounds_gpu}

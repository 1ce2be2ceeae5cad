"""Sparse decode of compressed requests (DESIGN.md §2, decode steps 1-5), one batch per launch.

Per layer: landmark logits → softmax per query head → max over each KV group → top-k per KV head
→ chunk-cache plan (only misses move) → key rebuild on the compute stream while the value gather
reads pinned host memory on a second stream → exact attention over [outliers; selected; window].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from kernels import gather_values as gv
from kernels import landmark_scores as ls
from kernels import rebuild_keys as rk
from kernels import sparse_decode_attention as sda
from sglang_shadowkv.layers.rotary import RotaryEmbedding
from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool
from sglang_shadowkv.mem_cache.shadow_pool import ShadowKVPool

from .chunk_cache import plan_chunk_cache
from .config import ShadowKVConfig
from .request_state import CompressedLayout, pad_outliers


@dataclass
class SparseRequest:
    table_row: int  # row of the request-to-token table (the dense tokens' slots)
    scratch_row: int  # its chunk-cache scratch
    layout: CompressedLayout  # its compressed chunks and dense spans
    seq_len: int  # tokens including this step's


@dataclass
class StepPlan:
    """Per-step tables shared by all layers."""
    rows: torch.Tensor  # [B] int32 scratch rows
    chunk_slots: torch.Tensor  # [B, Nmax] int32, padded with slot 0 (never selectable)
    outliers: torch.Tensor  # [B, Hkv, Omax] int32 outlier blocks, -1 padded
    outlier_lo: torch.Tensor  # [B, Hkv, Omax] a block counts if its chunk starts in [lo, hi)
    outlier_hi: torch.Tensor
    budgets: torch.Tensor  # [B] chunks each KV head selects
    top_k: int  # the largest budget
    window_indptr: torch.Tensor  # [B+1] int32
    window_indices: torch.Tensor  # [sum] int32 dense pool slots


class SparseDecoder:
    def __init__(self, pool: ShadowKVPool, cfg: ShadowKVConfig, rotary: RotaryEmbedding,
                 max_rows: int, max_chunks: int, use_triton: bool):
        self.pool, self.cfg, self.rotary = pool, cfg, rotary
        self.use_triton = use_triton
        self.max_entries = cfg.budget_chunks(max(1, max_chunks))
        h, c, d = pool.num_kv_heads, pool.chunk_size, pool.head_dim
        shape = (max_rows, h, self.max_entries, c, d)
        gpu = dict(dtype=pool.dtype, device=pool.device)
        layers = len(pool.a_rows)
        self.scratch_k = [torch.zeros(shape, **gpu) for _ in range(layers)]
        self.scratch_v = [torch.zeros(shape, **gpu) for _ in range(layers)]
        self.held = [torch.full(shape[:3], -1, dtype=torch.int64, device=pool.device) for _ in range(layers)]
        self.hits = torch.zeros(max_rows, 2, dtype=torch.int64, device=pool.device)  # hits, lookups
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self.copy_stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
        self._plan_key: tuple | None = None
        self._plan_static: tuple | None = None

    @property
    def scratch_bytes_per_request(self) -> int:
        k = self.scratch_k[0]
        return 2 * len(self.scratch_k) * k[0].numel() * k.element_size()

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int | None:
        """A scratch row for a new compressed request (None when all are taken)."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        for held in self.held:  # forget the chunks the row's previous owner held
            held[row] = -1
        self.hits[row] = 0
        return row

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def hit_counts(self, row: int) -> tuple[int, int]:
        hits, lookups = self.hits[row].tolist()
        return hits, lookups

    # ---- per step ------------------------------------------------------------------------------
    def plan_step(self, table: torch.Tensor, reqs: list[SparseRequest]) -> StepPlan:
        dev = self.pool.device
        # The tables change only when the set of requests does (layouts compared by identity).
        key = tuple((r.scratch_row, r.layout) for r in reqs)
        if self._plan_key is None or len(key) != len(self._plan_key) or any(
                row != old_row or lay is not old_lay for (row, lay), (old_row, old_lay) in zip(key, self._plan_key)):
            layouts = [r.layout for r in reqs]
            chunk_slots = pad_sequence([lay.chunk_slots for lay in layouts], batch_first=True).int()
            outliers = pad_outliers(layouts)
            budgets = [self.cfg.budget_chunks(lay.num_chunks - lay.num_outliers) for lay in layouts]
            rows = torch.tensor([r.scratch_row for r in reqs], dtype=torch.int32, device=dev)
            self._plan_static = (rows, chunk_slots, *outliers, torch.tensor(budgets, device=dev), max(budgets))
            self._plan_key = key
        rows, chunk_slots, outliers, lo, hi, budgets, top_k = self._plan_static
        spans = [[*r.layout.dense_spans, (r.layout.compressed_end, r.seq_len)] for r in reqs]
        window_indices = torch.cat([table[r.table_row, a:b] for r, sp in zip(reqs, spans) for a, b in sp])
        lens = torch.tensor([sum(b - a for a, b in sp) for sp in spans])
        window_indptr = torch.zeros(len(reqs) + 1, dtype=torch.int32)
        window_indptr[1:] = lens.cumsum(0)
        return StepPlan(rows, chunk_slots, outliers, lo, hi, budgets, top_k, window_indptr.to(dev), window_indices)

    def attend(self, q: torch.Tensor, layer: int, plan: StepPlan, kv_pool: PagedKVPool) -> torch.Tensor:
        """q [B, Hq, D] (one decode token per request) -> attention output [B, Hq, D]; the dense
        window is read from kv_pool."""
        pool, b = self.pool, q.shape[0]
        h, k_max = pool.num_kv_heads, self.max_entries
        sm_scale = q.shape[-1] ** -0.5
        logits_fn = ls.landmark_logits if self.use_triton else ls.landmark_logits_reference
        logits = logits_fn(q, pool.landmarks[layer], plan.chunk_slots, pool.selectable[layer], sm_scale,
                           None if pool.landmark_scale is None else pool.landmark_scale[layer])
        logits = logits.view(b, h, -1, logits.shape[-1])
        scores = logits.softmax(-1).amax(2).masked_fill(logits[:, :, 0].isinf(), -1.0)
        top = scores.topk(plan.top_k, dim=-1).indices  # [B, H, k]
        selected = plan.chunk_slots.long().gather(1, top.view(b, -1)).view(b, h, -1)
        in_budget = torch.arange(plan.top_k, device=q.device) < plan.budgets[:, None, None]
        selected = torch.where(in_budget, selected, -1)
        selected = torch.nn.functional.pad(selected, (0, k_max - plan.top_k), value=-1)

        rows = plan.rows.long()
        jobs, entries, new_held = plan_chunk_cache(self.held[layer][rows].view(b * h, k_max),
                                                   selected.view(b * h, k_max))
        self.held[layer][rows] = new_held.view(b, h, k_max)
        jobs, entries = jobs.view(b, h, k_max), entries.view(b, h, k_max)
        lookups = (entries >= 0).sum((1, 2))
        self.hits.index_add_(0, rows, torch.stack([lookups - (jobs >= 0).sum((1, 2)), lookups], 1))
        self._fetch(jobs, layer, plan.rows)

        # Outlier chunks differ per layer: keep those inside the part of the segment this prefix holds.
        pos = pool.outlier_pos[layer][plan.outliers.clamp(min=0).long()]
        outliers = torch.where((plan.outliers >= 0) & (pos >= plan.outlier_lo) & (pos < plan.outlier_hi),
                               plan.outliers, -1)
        attend_fn = sda.sparse_decode_attention if self.use_triton else sda.sparse_decode_attention_reference
        return attend_fn(q, pool.outlier_k[layer], pool.outlier_v[layer], outliers,
                         self.scratch_k[layer], self.scratch_v[layer], plan.rows, entries.int(),
                         kv_pool.k_buffers[layer], kv_pool.v_buffers[layer],
                         plan.window_indptr, plan.window_indices, sm_scale)

    def _fetch(self, jobs: torch.Tensor, layer: int, rows: torch.Tensor) -> None:
        """Rebuild the missed keys and gather their values, on two streams when on a GPU."""
        pool = self.pool
        rebuild_fn = rk.rebuild_keys if self.use_triton else rk.rebuild_keys_reference
        gather_fn = gv.gather_values if self.use_triton else gv.gather_values_reference

        def gather():
            gather_fn(pool.host_v[layer], jobs, self.scratch_v[layer], rows,
                      None if pool.value_scale is None else pool.value_scale[layer])

        if self.copy_stream is None:
            gather()
        else:
            main = torch.cuda.current_stream(pool.device)
            self.copy_stream.wait_stream(main)
            with torch.cuda.stream(self.copy_stream):
                gather()
            jobs.record_stream(self.copy_stream)
            rows.record_stream(self.copy_stream)
        rebuild_fn(pool.a_rows[layer], pool.basis[layer], self.rotary.cos_cache, self.rotary.sin_cache,
                   pool.chunk_pos, pool.chunk_basis, jobs, self.scratch_k[layer], rows, pool.chunk_size)
        if self.copy_stream is not None:
            torch.cuda.current_stream(pool.device).wait_stream(self.copy_stream)

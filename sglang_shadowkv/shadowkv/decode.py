"""Sparse decode of compressed requests (DESIGN.md §2, decode steps 1-5), one batch per launch.

Per layer: landmark logits → softmax per query head → max over each KV group → top-k per KV head
→ chunk-cache plan (only misses move) → key rebuild on the compute stream while the value gather
reads pinned host memory (or the segment's GPU values, when it has them) on a second stream →
exact attention over [outliers; selected; window].

A request's chunk-cache scratch is a row of `row_pages` pages of the dense pool, taken when it is
admitted and given back when it ends (kernels/scratch_blocks.py: entry e of KV head h is a [c, D]
block of page scratch_pages[row, e], in every layer's K and V memory). So no scratch is set aside
at startup: while nothing is compressed the dense pool holds its pages, and the number of rows
(shadowkv_max_requests, by default the running-request limit) costs only a small page table.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from sglang_shadowkv.kernels import chunk_cache_plan as ccp
from sglang_shadowkv.kernels import chunk_selection as cs
from sglang_shadowkv.kernels import gather_values as gv
from sglang_shadowkv.kernels import landmark_scores as ls
from sglang_shadowkv.kernels import rebuild_keys as rk
from sglang_shadowkv.kernels import sparse_decode_attention as sda
from sglang_shadowkv.kernels.rotary import RotaryTables
from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool, ReqToTokenPool, to_device
from sglang_shadowkv.mem_cache.compressed_pool import ShadowKVPool

from .config import ShadowKVConfig
from .request_state import CompressedLayout, copy_padded, selection_tables
from .selection import budget_summary, select_chunks


@dataclass
class ChunkMemory:
    """Where fetched chunks land and attention reads them: the K and V memory as [c, D] blocks, and
    a table of each row's pages (entry e of row r for KV head h is block pages[r, e]·Hkv + h,
    kernels/scratch_blocks.py). The requests' chunk-cache scratch (`SparseDecoder.scratch`), or a
    workspace of the step's own (suffix_prefill.py's every-chunk rounds)."""
    blocks_k: torch.Tensor
    blocks_v: torch.Tensor
    pages: torch.Tensor


@dataclass
class SparseRequest:
    table_row: int  # row of the request-to-token table (the dense tokens' slots)
    scratch_row: int | None  # its chunk-cache scratch (None: a dense request, nothing to select)
    layout: CompressedLayout | None  # its compressed chunks and dense spans (None: all dense)
    seq_len: int  # tokens including this step's

    def window_spans(self) -> list[tuple[int, int]]:
        """Token spans attended densely: the dense spans of the prefix, then everything from the
        end of the compressed part on (a dense request: its whole sequence)."""
        if self.layout is None:
            return [(0, self.seq_len)]
        return [*self.layout.dense_spans, (self.layout.compressed_end, self.seq_len)]

    def window_tokens(self) -> int:
        return sum(b - a for a, b in self.window_spans())


# a request attending more dense tokens than this (a dense document decoding beside compressed
# ones) has every program's keys split MAX_SPLITS ways: else one program per KV head would walk
# its whole window alone (16 such requests at 128K took 237 ms a step on the H100)
LONG_WINDOW_TOKENS = 8192


def window_splits(reqs: list[SparseRequest]) -> int | None:
    """The key splits a step needs for its longest window (None: the kernel's own choice)."""
    longest = max((r.window_tokens() for r in reqs), default=0)
    return sda.MAX_SPLITS if longest > LONG_WINDOW_TOKENS else None


@dataclass
class StepPlan:
    """Per-step tables shared by all layers."""
    rows: torch.Tensor  # [B] int32 scratch rows
    chunk_slots: torch.Tensor  # [B, N] int32, padded with the pool's null slot (never selectable)
    outliers: torch.Tensor  # [B, Hkv, O] int32 outlier blocks, -1 padded
    outlier_lo: torch.Tensor  # [B, Hkv, O] a block counts if its chunk starts in [lo, hi)
    outlier_hi: torch.Tensor
    budgets: torch.Tensor  # [B] chunks each KV head selects
    top_k: int  # the largest budget the plan's shapes allow
    window_indptr: torch.Tensor  # [B+1] int32
    window_indices: torch.Tensor  # [>= sum] int32 dense pool slots
    splits: int | None = None  # key splits of the attention kernel (window_splits)
    live: torch.Tensor | None = None  # [1] int32: rows before it are requests, the rest a graph's padding (None: all)


class SparseDecoder:
    def __init__(self, pool: ShadowKVPool, cfg: ShadowKVConfig, rotary: RotaryTables,
                 max_rows: int, max_chunks: int, use_triton: bool):
        self.pool, self.cfg, self.rotary = pool, cfg, rotary
        self.use_triton = use_triton
        self.max_chunks = max(1, max_chunks)
        self.max_entries = cfg.budget_chunks(self.max_chunks)
        # one extra row: the scratch of dense and padded batch entries, which never select a chunk;
        # it holds no pages (its entries name the null page: never read, never written)
        self.max_rows = max_rows
        self.dummy_row = max_rows
        dev, layers, rows = pool.device, pool.num_layers, max_rows + 1
        # each taken row's pages (alloc_row); an entry is read only once written (held), readers mask the rest
        self.scratch_pages = torch.full((rows, self.max_entries), pool.null_page, dtype=torch.int32, device=dev)
        self._row_pages: dict[int, list[int]] = {}
        # [layers, rows, Hkv, max_entries]: the chunk each scratch entry holds (-1: none); one tensor,
        # so that a new owner's row is reset by one fill, not one per layer
        self.held = torch.full((layers, rows, pool.num_kv_heads, self.max_entries), -1, dtype=torch.int64, device=dev)
        self.hits = torch.zeros(rows, 2, dtype=torch.int64, device=dev)  # hits, lookups
        self.finished_hits = torch.zeros(2, dtype=torch.int64, device=dev)
        # per scratch row and layer, how many KV-head steps selected k chunks (column k)
        self.budget_hist = torch.zeros(rows, layers, self.max_entries + 1, dtype=torch.int64, device=dev)
        self.finished_budget_hist = torch.zeros(layers, self.max_entries + 1, dtype=torch.int64, device=dev)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self.copy_stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
        self.stats_stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None  # row_stats
        self._plan_key: tuple | None = None
        self._plan_static: tuple | None = None
        self.graph_plan: StepPlan | None = None  # static buffers of CUDA-graph steps (init_graph_state)

    @property
    def row_pages(self) -> int:
        """Dense-pool pages a scratch row takes: one per entry."""
        return self.max_entries

    @property
    def scratch_bytes_per_request(self) -> int:
        return self.row_pages * self.pool.chunk_size * self.pool.kv.bytes_per_token

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def taken_row_pages(self) -> int:
        """Dense-pool pages the taken scratch rows hold."""
        return (self.max_rows - self.free_rows) * self.row_pages

    def free_row_ids(self) -> list[int]:
        """The free scratch rows (a copy; for accounting checks)."""
        return list(self._free_rows)

    def pages_of_row(self, row: int) -> list[int]:
        """The dense-pool pages a row holds (a copy, empty for a free row; for accounting checks)."""
        return list(self._row_pages.get(row, []))

    def alloc_row(self) -> int | None:
        """A scratch row for a new compressed request, with its row_pages pages of the dense pool
        (None, nothing taken, when every row is taken or the pool has too few free pages)."""
        if not self._free_rows:
            return None
        pages = self.pool.kv.alloc(self.row_pages)
        if pages is None:
            return None
        row = self._free_rows.pop()
        self._row_pages[row] = pages
        self.scratch_pages[row] = to_device(torch.tensor(pages, dtype=torch.int32), self.pool.device)
        self.held[:, row] = -1  # forget the chunks the row's previous owner held
        self.hits[row] = 0
        self.budget_hist[row] = 0
        return row

    def free_row(self, row: int) -> None:
        """Give the row and its pages back (a step still queued on the device that reads them runs
        before any later writer of those pages: one stream)."""
        self.finished_budget_hist += self.budget_hist[row]
        self.finished_hits += self.hits[row]
        self.pool.kv.free(self._row_pages.pop(row))
        self._free_rows.append(row)

    def row_stats(self, row: int) -> tuple[int, int, dict]:
        """(chunk-cache hits, lookups, budget_stats) of one scratch row, for a request's report when
        it ends. Read on a stream of their own: a plain read would wait for the step in flight
        (overlap scheduling launches it before the previous step's requests are released) and
        leave the GPU idle while the host then prepares the next. The step that produced the
        request's last token has completed (its tokens were read), so its counters are final; one
        found finished a step late (a stop token) may count that in-flight step in part."""
        with torch.cuda.stream(self.stats_stream) if self.stats_stream is not None else contextlib.nullcontext():
            snapshot = torch.cat([self.hits[row], self.budget_hist[row].flatten()]).cpu()
        hits, lookups = snapshot[:2].tolist()
        return hits, lookups, budget_summary(snapshot[2:].view(self.budget_hist.shape[1:]), self.max_entries)

    def chunk_cache_stats(self) -> dict:
        """Chunk-cache hits and lookups since start (finished and running requests): the share of
        selected chunks that were already in a request's scratch from its previous step."""
        hits, lookups = (self.finished_hits + self.hits[:self.dummy_row].sum(0)).tolist()
        return {"hits": hits, "lookups": lookups, "hit_rate": hits / lookups if lookups else 0.0}

    def budget_stats(self) -> dict:
        """Chunks selected per KV head and step, per layer, of every request so far (the finished
        ones and the running ones)."""
        hist = self.finished_budget_hist + self.budget_hist[:self.dummy_row].sum(0)
        return budget_summary(hist.cpu(), self.max_entries)

    # ---- per step ------------------------------------------------------------------------------
    def init_graph_state(self, max_bs: int, max_window_tokens: int, max_outliers: int) -> None:
        """Fixed buffers that CUDA-graph steps read their plan from (written by plan_step(static=True))."""
        dev, h = self.pool.device, self.pool.num_kv_heads

        def ints(*shape, fill=0):
            return torch.full(shape, fill, dtype=torch.int32, device=dev)

        self.graph_plan = StepPlan(
            rows=ints(max_bs, fill=self.dummy_row), chunk_slots=ints(max_bs, self.max_chunks, fill=self.pool.null_slot),
            outliers=ints(max_bs, h, max_outliers, fill=-1), outlier_lo=ints(max_bs, h, max_outliers),
            outlier_hi=ints(max_bs, h, max_outliers), budgets=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            top_k=0, window_indptr=ints(max_bs + 1), window_indices=ints(max_window_tokens), live=ints(1))

    def graph_fits(self, reqs: list[SparseRequest], width: int) -> bool:
        """Whether the graph buffers can hold this batch's plan with `width` chunk columns."""
        plan = self.graph_plan
        return (plan is not None and len(reqs) <= plan.rows.numel() and width <= self.max_chunks
                and all(r.layout is None or (r.layout.num_chunks <= width
                                             and r.layout.num_outliers <= plan.outliers.shape[2])
                        for r in reqs)
                and sum(r.window_tokens() for r in reqs) <= plan.window_indices.numel())

    def plan_step(self, table: ReqToTokenPool, reqs: list[SparseRequest], width: int | None = None,
                  static: bool = False, splits: int | None = None, live: int | None = None) -> StepPlan:
        """The step's selection tables for a batch of requests (dense ones attend their window only).

        width: chunk columns of the plan (default: the batch's most chunks); the budget shape top_k
        follows from it. static: write into the CUDA-graph buffers, whose shapes a captured graph
        has fixed (the caller pads the batch to a captured size and picks width from the captured
        ones); otherwise fresh tensors. Only the windows change from step to step: the rest is
        rebuilt when the set of requests changes (compared by row and layout identity). splits:
        the attention kernel's key splits of a static plan, fixed by its graph's variant; an eager
        plan takes its batch's own (window_splits). live: a static plan's requests before its
        padding (kernels/padding_rows.py; default all).
        """
        dev = self.pool.device
        if width is None:
            width = max([r.layout.num_chunks for r in reqs if r.layout is not None], default=1)
        key = (static, width, *((r.scratch_row, r.layout) for r in reqs))
        if self._plan_key is None or len(key) != len(self._plan_key) or key[:2] != self._plan_key[:2] or any(
                row != old_row or lay is not old_lay for (row, lay), (old_row, old_lay) in zip(key[2:], self._plan_key[2:])):
            self._plan_static = self._selection_tables(reqs, width, static)
            self._plan_key = key
        rows, chunk_slots, outliers, lo, hi, budgets, top_k = self._plan_static
        spans = [r.window_spans() for r in reqs]
        flat = [(r.table_row, a, b) for r, sp in zip(reqs, spans) for a, b in sp]
        window = table.span_slots(*map(list, zip(*flat)))
        lens = torch.tensor([sum(b - a for a, b in sp) for sp in spans])
        indptr = torch.zeros(len(reqs) + 1, dtype=torch.int32)
        indptr[1:] = lens.cumsum(0)
        if static:
            plan = self.graph_plan
            plan.window_indptr[:len(reqs) + 1].copy_(to_device(indptr, dev), non_blocking=True)
            plan.window_indices[:window.numel()].copy_(window)
            plan.live.fill_(len(reqs) if live is None else live)
            return StepPlan(rows, chunk_slots, outliers, lo, hi, budgets, top_k, plan.window_indptr[:len(reqs) + 1],
                            plan.window_indices, splits, plan.live)
        return StepPlan(rows, chunk_slots, outliers, lo, hi, budgets, top_k, to_device(indptr, dev), window,
                        window_splits(reqs))

    def _selection_tables(self, reqs: list[SparseRequest], width: int, static: bool) -> tuple:
        dev, b, null = self.pool.device, len(reqs), self.pool.null_slot
        slots, outliers, budget_list = selection_tables([r.layout for r in reqs], self.cfg, null,
                                                        self.pool.num_kv_heads, dev)
        budgets = to_device(torch.tensor(budget_list, dtype=torch.int64), dev)
        rows = to_device(torch.tensor([self.dummy_row if r.scratch_row is None else r.scratch_row for r in reqs],
                                      dtype=torch.int32), dev)
        if not static:
            slots = torch.nn.functional.pad(slots, (0, width - slots.shape[1]), value=null)
            return rows, slots, *outliers, budgets, max(budget_list, default=0)
        plan = self.graph_plan
        width_o = plan.outliers.shape[2]
        plan.rows[:b].copy_(rows)
        copy_padded(plan.chunk_slots[:b, :width], slots, null)
        for dst, src, fill in zip((plan.outliers, plan.outlier_lo, plan.outlier_hi), outliers, (-1, 0, 0)):
            copy_padded(dst[:b], src, fill)
        plan.budgets[:b].copy_(budgets)
        return (plan.rows[:b], plan.chunk_slots[:b, :width], plan.outliers[:b, :, :width_o],
                plan.outlier_lo[:b, :, :width_o], plan.outlier_hi[:b, :, :width_o], plan.budgets[:b],
                self.cfg.budget_chunks(width))

    def attend(self, q: torch.Tensor, layer: int, plan: StepPlan, kv_pool: PagedKVPool) -> torch.Tensor:
        """q [B, Hq, D] (one decode token per request) -> attention output [B, Hq, D]; the dense
        window is read from kv_pool."""
        logits = self.landmark_logits(q, layer, plan.chunk_slots, plan.live)
        select_fn = cs.select_decode_chunks if self.use_triton else cs.select_decode_chunks_reference
        selected = select_fn(logits, self.pool.num_kv_heads, plan.chunk_slots, plan.budgets, plan.top_k,
                             self.max_entries, self.cfg.top_p_or_none, self.cfg.min_budget_chunks, self.budget_hist,
                             plan.rows, layer, plan.live)
        entries = self.fetch_selected(layer, plan.rows, selected, count_hits=True, live=plan.live)
        outliers = self.live_outliers(layer, plan.outliers, plan.outlier_lo, plan.outlier_hi)
        return self.attend_selected(q, layer, outliers, plan.rows, entries, plan.window_indptr,
                                    plan.window_indices, kv_pool, splits=plan.splits, live=plan.live)

    # ---- the parts of a step (shared with the suffix prefill) -----------------------------------
    def landmark_logits(self, q: torch.Tensor, layer: int, chunk_slots: torch.Tensor,
                        live: torch.Tensor | None = None) -> torch.Tensor:
        """[B, Hq, N] float32 q · landmark of each request's chunks (-inf where not selectable)."""
        pool = self.pool
        logits_fn = ls.landmark_logits if self.use_triton else ls.landmark_logits_reference
        return logits_fn(q, pool.landmarks[layer], chunk_slots, pool.selectable[layer], q.shape[-1] ** -0.5,
                         None if pool.landmark_scale is None else pool.landmark_scale[layer], live)

    def select(self, scores: torch.Tensor, chunk_slots: torch.Tensor, budgets: torch.Tensor,
               top_k: int) -> torch.Tensor:
        """scores [R, Hkv, N] (-1 where not selectable) -> the chunk slots [R, Hkv, max_entries] each KV
        head attends (best first; -1 padded). budgets [R]: a fixed budget's count, or the adaptive
        budget's cap (shadowkv_top_p, floor shadowkv_min_budget_chunks); top_k >= every budget."""
        return select_chunks(scores, chunk_slots, budgets, top_k, self.max_entries, self.cfg.top_p_or_none,
                             self.cfg.min_budget_chunks)

    def scratch(self, layer: int) -> ChunkMemory:
        """The requests' chunk-cache scratch in this layer's K and V memory."""
        return ChunkMemory(self.pool.blocks_k[layer], self.pool.blocks_v[layer], self.scratch_pages)

    def fetch_selected(self, layer: int, rows: torch.Tensor, selected: torch.Tensor,
                       count_hits: bool = False, live: torch.Tensor | None = None) -> torch.Tensor:
        """Bring the selected chunks [R, Hkv, K] into the scratch rows [R] (int32; only chunks not
        already there move) and return the scratch entry of each [R, Hkv, K] (-1 for padding)."""
        plan_fn = ccp.plan_chunk_cache_in_place if self.use_triton else ccp.plan_chunk_cache_in_place_reference
        jobs, entries = plan_fn(self.held[layer], rows, selected.contiguous(), live,
                                self.hits if count_hits else None)
        self.fetch(jobs, layer, rows, self.scratch(layer), live)
        return entries

    def live_outliers(self, layer: int, outliers: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """Outlier chunks differ per layer: keep those inside the part of the segment a prefix holds."""
        pos = self.pool.outlier_pos[layer][outliers.clamp(min=0).long()]
        return torch.where((outliers >= 0) & (pos >= lo) & (pos < hi), outliers, -1)

    def attend_selected(self, q: torch.Tensor, layer: int, outliers: torch.Tensor, rows: torch.Tensor,
                        entries: torch.Tensor, window_indptr: torch.Tensor, window_indices: torch.Tensor,
                        kv_pool: PagedKVPool, lse: torch.Tensor | None = None,
                        queries_per_request: int = 1, splits: int | None = None,
                        out_dtype: torch.dtype | None = None, live: torch.Tensor | None = None,
                        memory: ChunkMemory | None = None) -> torch.Tensor:
        """Exact attention of q [B·Q, Hq, D] (Q queries per request, 1 when decoding) over each
        request's outliers, scratch entries and dense window (splits: the kernel's key splits,
        None: its own choice; out_dtype: the output's, default q's). memory: where the entries
        are (default the scratch); the outliers are read from the pool."""
        pool_blocks = (self.pool.blocks_k[layer], self.pool.blocks_v[layer])
        memory = memory or self.scratch(layer)
        args = (q, memory.blocks_k, memory.blocks_v, outliers, memory.pages, rows, entries.int(),
                kv_pool.k_buffers[layer], kv_pool.v_buffers[layer], window_indptr, window_indices, q.shape[-1] ** -0.5)
        kwargs = dict(lse=lse, queries_per_request=queries_per_request, out_dtype=out_dtype, live=live,
                      outlier_memory=pool_blocks)
        if not self.use_triton:
            return sda.sparse_decode_attention_reference(*args, **kwargs)
        return sda.sparse_decode_attention(*args, splits=splits, **kwargs)

    def fetch(self, jobs: torch.Tensor, layer: int, rows: torch.Tensor, memory: ChunkMemory,
              live: torch.Tensor | None = None) -> None:
        """Rebuild the keys of the jobs' chunks [R, Hkv, K] (-1: none) and gather their values into
        the memory's rows [R], on two streams when on a GPU."""
        pool = self.pool
        rebuild_fn = rk.rebuild_keys if self.use_triton else rk.rebuild_keys_reference
        self._beside_value_gather(
            jobs, rows, lambda: self._gather(pool.host_v[layer], pool.host_slot, jobs, memory.blocks_v, memory, rows,
                                             None if pool.value_scale is None else pool.value_scale[layer],
                                             pool.resident(layer), live),
            lambda: rebuild_fn(pool.a_lo[layer], pool.a_hi[layer], *pool.basis_memory(layer), self.rotary.cos_cache,
                               self.rotary.sin_cache, pool.chunk_pos, pool.chunk_basis, jobs, memory.blocks_k,
                               memory.pages, rows, pool.basis_rank[layer], live))

    def fetch_copies(self, jobs: torch.Tensor, layer: int, rows: torch.Tensor, memory: ChunkMemory) -> None:
        """As `fetch`, from the chunks' exact copies (every job's segment has one: exact_copies.py):
        their keys as the dense pool held them, their values unrounded."""
        pool, copies = self.pool, self.pool.copies
        if copies.v is not None:
            host_v, host_slot, resident = copies.v[layer], copies.slot_of, None
        else:  # the host pool holds them exactly
            host_v, host_slot, resident = pool.host_v[layer], pool.host_slot, pool.resident(layer)
        self._beside_value_gather(
            jobs, rows, lambda: self._gather(host_v, host_slot, jobs, memory.blocks_v, memory, rows, resident=resident),
            lambda: self._gather(copies.k[layer], copies.slot_of, jobs, memory.blocks_k, memory, rows))

    def _gather(self, host: torch.Tensor, host_slot: torch.Tensor, jobs: torch.Tensor, blocks: torch.Tensor,
                memory: ChunkMemory, rows: torch.Tensor, scale: torch.Tensor | None = None,
                resident: tuple | None = None, live: torch.Tensor | None = None) -> None:
        gather_fn = gv.gather_values if self.use_triton else gv.gather_values_reference
        gather_fn(host, host_slot, jobs, blocks, memory.pages, rows, scale, resident=resident, live=live)

    def _beside_value_gather(self, jobs: torch.Tensor, rows: torch.Tensor, gather_values, fill_keys) -> None:
        """Run gather_values on the copy stream while fill_keys runs on the compute stream (both
        here, in order, off a GPU); the compute stream then waits for both."""
        if self.copy_stream is None:
            gather_values()
            fill_keys()
            return
        main = torch.cuda.current_stream(self.pool.device)
        self.copy_stream.wait_stream(main)
        with torch.cuda.stream(self.copy_stream):
            gather_values()
        jobs.record_stream(self.copy_stream)
        rows.record_stream(self.copy_stream)
        fill_keys()
        main.wait_stream(self.copy_stream)

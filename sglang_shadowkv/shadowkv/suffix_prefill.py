"""Prefill of suffixes over compressed prefixes, without bringing a prefix back dense.

A question over a cached document, or a chat's next turn, prefills a short suffix that attends to
the whole compressed document. A step's suffixes are served together: every layer runs a fixed
number of batched operations for all of them, however many requests there are. Each query's
attention is split in two parts merged by log-sum-exp (exact: softmax over the union of disjoint
key sets):
- the dense tokens: each prefix's dense spans and the suffix itself, causally, for every suffix
  in one ragged kernel call (the dense tokens are the last of each key list, so its causal rule
  holds).
- the compressed chunks, read the way decode reads them: per tile of TILE suffix queries, the
  landmark softmax mass summed over the tile's queries (max over each KV group) picks the budget's
  best chunks per KV head; their keys are rebuilt and values fetched into the request's own
  chunk-cache scratch, and the tile's queries attend them and the outlier chunks exactly (one
  batched matmul: a tile's queries share those keys). A tile per 64 queries (not one selection
  for the whole suffix, as the ShadowKV reference does) lets a long question that touches several
  parts of the document find them all. Round k serves the k-th tile of every suffix that has one,
  so a step of short questions is one round. An `exact` request (a suffix longer than
  shadowkv_sparse_prefill_max, or one that asks for prompt logprobs) attends every chunk instead,
  streamed through its scratch a scratch-full at a time: never the whole document dense at once.
The scratch ends holding the last tile's selection: the request's decode starts from it.

A step whose only work is short suffixes (questions on cached compressed documents with nothing
else running) can replay a CUDA graph: `plan_static` writes its plan into fixed buffers, each
suffix padded to a captured token count (GRAPH_TOKENS) with queries that read and write only the
reserved page, so the per-layer work above costs one replay instead of ~200 launches a layer.
"""

from __future__ import annotations

import itertools
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from sglang_shadowkv.kernels import landmark_scores as ls
from sglang_shadowkv.kernels import ragged_paged_attention as rpa
from sglang_shadowkv.kernels.scratch_blocks import scratch_blocks
from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool, ReqToTokenPool, to_device

from .decode import SparseDecoder
from .request_state import CompressedLayout, copy_padded, selection_tables

TILE = 64  # suffix queries that share one chunk selection
WORK_BYTES = 1 << 29  # float32 scores a batched selection or attention may hold at once
# suffix lengths a CUDA graph is captured for: past TILE, whole tiles, so that every round of a
# padded suffix holds at least one real query (an empty round would fetch chunks nobody needs)
GRAPH_TOKENS = (16, 32, 64, 128, 192, 256)
GRAPH_REQUESTS = (1, 2, 4, 8, 16)  # suffixes in one graph step


# a tile's chunk columns are padded to a multiple of this (with the null slot): Triton specializes
# integer arguments on their divisibility by 16, so each document's chunk count would otherwise be
# a kernel variant of its own
CHUNK_COLUMNS = 16


def tile_width(queries: int) -> int:
    """The width an eager round's tiles are padded to: its compile class within one tile
    (GRAPH_TOKENS[0] or TILE), the two widths the server's warmup and graphs compile the tile
    kernels for. A round of any other width compiled its own variants in a user's step: on the
    H100 a chat's turns over 32K documents (suffixes of about 320 tokens, so last tiles of every
    width) compiled 22 kernel variants while serving."""
    return min(TILE, compile_tokens(queries))


def compile_tokens(tokens: int) -> int:
    """The tokens per suffix standing for every count whose step launches the same compiled
    kernels: one 16-query block (GRAPH_TOKENS[0]), or whole 32-query blocks and 64-query tiles
    (GRAPH_TOKENS[-1]); the rest are run-time arguments."""
    return GRAPH_TOKENS[0] if tokens <= GRAPH_TOKENS[0] else GRAPH_TOKENS[-1]


@dataclass
class SuffixRequest:
    table_row: int
    scratch_row: int
    layout: CompressedLayout
    start: int  # first token of this step's chunk of the suffix
    seq_len: int  # tokens including this step's
    exact: bool

    def dense_spans(self) -> list[tuple[int, int]]:
        """Token spans it attends densely: its prefix's dense spans, then everything from the end
        of the compressed part on (its own tokens included)."""
        return [*self.layout.dense_spans, (self.layout.compressed_end, self.seq_len)]

    def dense_tokens(self) -> int:
        return sum(b - a for a, b in self.dense_spans())


@dataclass
class SuffixRound:
    """Tiles of several requests attended together (one tile each)."""
    q_index: torch.Tensor  # [R, t] long: the tiles' rows among the step's suffix queries (padded)
    q_valid: torch.Tensor  # [R, t] bool
    take: tuple[torch.Tensor, torch.Tensor]  # the valid tile rows: their flat positions in [R * t], their query rows
    rows: torch.Tensor  # [R] int32 scratch rows
    chunk_slots: torch.Tensor  # [R, N] int32 (padded with the pool's null slot: never selectable)
    outliers: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # [R, Hkv, O] blocks, lo, hi
    budgets: torch.Tensor  # [R]
    top_k: int
    exact: bool  # one request, every chunk, streamed


@dataclass
class SuffixPlan:
    """What every layer needs for a step's suffixes."""
    q_rows: torch.Tensor  # [T] long: the step's query rows that belong to suffixes, request by request
    q_indptr: torch.Tensor  # [R + 1] int32 over q_rows
    dense_indptr: torch.Tensor  # [R + 1] int32 over dense_slots
    dense_slots: torch.Tensor  # per request: slots of its dense spans, then of [compressed_end, seq_len)
    rounds: list[SuffixRound]
    max_q_len: int  # the longest suffix of the step (the dense kernel's grid: no device sync)


@dataclass
class SuffixGraphBuffers:
    """Where a graph step's plan lives: up to GRAPH_REQUESTS[-1] suffixes of up to GRAPH_TOKENS[-1]
    query rows each (a suffix's real queries first, then padding). The query offsets are the
    graph batch's own q_indptr."""
    dense_indptr: torch.Tensor  # [R + 1] int32
    dense_slots: torch.Tensor  # [R * (max dense tokens + max(GRAPH_TOKENS))] int32
    q_valid: torch.Tensor  # [R, max(GRAPH_TOKENS)] bool: the real queries
    rows: torch.Tensor  # [R] int32
    chunk_slots: torch.Tensor  # [R, max_chunks] int32
    outliers: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # [R, Hkv, O] blocks, lo, hi
    budgets: torch.Tensor  # [R]


class SuffixPrefill:
    def __init__(self, decoder: SparseDecoder, use_triton: bool):
        self.decoder, self.use_triton = decoder, use_triton
        self.graph: SuffixGraphBuffers | None = None
        self._static_plans: dict[tuple[int, int, int], SuffixPlan] = {}  # by (requests, tokens, width)

    # ---- once per step ------------------------------------------------------------------------
    def plan(self, table: ReqToTokenPool, reqs: list[SuffixRequest], q_starts: list[int]) -> SuffixPlan:
        """reqs and where each one's queries start among the step's rows (q_starts[i])."""
        dev, ints = self.decoder.pool.device, dict(dtype=torch.int32)
        n_q = [r.seq_len - r.start for r in reqs]
        dense = [r.dense_spans() for r in reqs]
        spans = [(r.table_row, a, b) for r, req_spans in zip(reqs, dense) for a, b in req_spans]
        dense_indptr = [0, *itertools.accumulate(r.dense_tokens() for r in reqs)]
        offsets = [0, *itertools.accumulate(n_q)]
        q_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(q_starts, n_q)])
        rounds = []
        sparse = [i for i, r in enumerate(reqs) if not r.exact]
        for k in range(max((math.ceil(n_q[i] / TILE) for i in sparse), default=0)):
            members = [i for i in sparse if n_q[i] > k * TILE]
            counts = [min(TILE, n_q[i] - k * TILE) for i in members]
            rounds.append(self._round(reqs, members, [offsets[i] + k * TILE for i in members], counts,
                                      tile_width(max(counts)), False))
        for i, r in enumerate(reqs):
            if r.exact:
                rounds.append(self._round(reqs, [i], [offsets[i]], [n_q[i]], n_q[i], True))
        return SuffixPlan(to_device(q_rows, dev), to_device(torch.tensor(offsets, **ints), dev),
                          to_device(torch.tensor(dense_indptr, **ints), dev),
                          table.span_slots(*map(list, zip(*spans))), rounds, max(n_q))

    def _round(self, reqs: list[SuffixRequest], members: list[int], firsts: list[int], counts: list[int],
               width: int, exact: bool) -> SuffixRound:
        dev, decoder = self.decoder.pool.device, self.decoder
        q_index = torch.tensor(firsts)[:, None] + torch.arange(width)
        q_valid = torch.arange(width) < torch.tensor(counts)[:, None]
        slots, outliers, budgets = selection_tables([reqs[i].layout for i in members], decoder.cfg,
                                                    decoder.pool.null_slot, decoder.pool.num_kv_heads, dev)
        slots = torch.nn.functional.pad(slots, (0, -slots.shape[1] % CHUNK_COLUMNS), value=decoder.pool.null_slot)
        flat = torch.arange(q_index.numel()).view_as(q_index)
        take = (to_device(flat[q_valid], dev), to_device(q_index[q_valid], dev))  # here: no device sync
        return SuffixRound(to_device(torch.where(q_valid, q_index, q_index[:, :1]), dev), to_device(q_valid, dev), take,
                           to_device(torch.tensor([reqs[i].scratch_row for i in members], dtype=torch.int32), dev),
                           slots, outliers, to_device(torch.tensor(budgets), dev), max(budgets), exact)

    # ---- CUDA-graph steps: suffixes padded to a fixed shape -----------------------------------
    def init_graph_state(self, max_dense_tokens: int, max_outliers: int) -> None:
        decoder, dev = self.decoder, self.decoder.pool.device
        r, t, h = GRAPH_REQUESTS[-1], GRAPH_TOKENS[-1], decoder.pool.num_kv_heads

        def ints(*shape, fill=0):
            return torch.full(shape, fill, dtype=torch.int32, device=dev)

        self._static_plans.clear()  # views of the buffers replaced here
        self.graph = SuffixGraphBuffers(
            ints(r + 1), ints(r * (max_dense_tokens + t)), torch.zeros(r, t, dtype=torch.bool, device=dev),
            ints(r, fill=decoder.dummy_row), ints(r, decoder.max_chunks, fill=decoder.pool.null_slot),
            (ints(r, h, max_outliers, fill=-1), ints(r, h, max_outliers), ints(r, h, max_outliers)),
            torch.zeros(r, dtype=torch.int64, device=dev))

    def graph_fits(self, reqs: list[SuffixRequest], width: int) -> bool:
        """Whether the graph buffers hold these requests' plan with `width` chunk columns."""
        g = self.graph
        per_request = g.dense_slots.numel() // GRAPH_REQUESTS[-1] - GRAPH_TOKENS[-1]
        return g is not None and len(reqs) <= GRAPH_REQUESTS[-1] and width <= self.decoder.max_chunks and all(
            not req.exact and req.layout.num_chunks <= width and req.layout.num_outliers <= g.outliers[0].shape[2]
            and req.seq_len - req.start <= GRAPH_TOKENS[-1] and req.dense_tokens() <= per_request for req in reqs)

    def plan_static(self, table: ReqToTokenPool, reqs: list[SuffixRequest], q_indptr: torch.Tensor, tokens: int,
                    width: int, padding_row: int) -> SuffixPlan:
        """The plan of a graph step of suffixes of `tokens` query rows each (q_indptr [R + 1]: the
        graph batch's, i * tokens; sizes from GRAPH_REQUESTS and GRAPH_TOKENS), written into the
        fixed buffers. A suffix's real queries come first; its padding queries come last and
        attend only slots of the reserved page, appended after its keys, so the causal rule keeps
        them invisible to the real ones. Requests past len(reqs) are all padding (a capture:
        none). The plan's shapes depend only on (R, tokens, width), so every step of that shape
        replays one graph."""
        g, decoder, dev = self.graph, self.decoder, self.decoder.pool.device
        num = q_indptr.numel() - 1
        n_q = [r.seq_len - r.start for r in reqs] + [0] * (num - len(reqs))
        order = []  # per request: its dense spans, then its padding keys (slot 0 of the padding row)
        for i, n in enumerate(n_q):
            if i < len(reqs):
                order += [(reqs[i].table_row, a, b) for a, b in reqs[i].dense_spans()]
            order.append((padding_row, 0, tokens - n))
        lens = [(reqs[i].dense_tokens() if i < len(reqs) else 0) + tokens - n for i, n in enumerate(n_q)]
        indptr = [0, *itertools.accumulate(lens)]
        g.dense_indptr[:num + 1].copy_(to_device(torch.tensor(indptr, dtype=torch.int32), dev))
        g.dense_slots[:indptr[-1]].copy_(table.span_slots(*map(list, zip(*order))))
        g.q_valid[:num].copy_(to_device(torch.arange(g.q_valid.shape[1]) < torch.tensor(n_q)[:, None], dev))
        slots, outliers, budgets = selection_tables([r.layout for r in reqs] + [None] * (num - len(reqs)), decoder.cfg,
                                                    decoder.pool.null_slot, decoder.pool.num_kv_heads, dev)
        rows = [r.scratch_row for r in reqs] + [decoder.dummy_row] * (num - len(reqs))
        g.rows[:num].copy_(to_device(torch.tensor(rows, dtype=torch.int32), dev))
        copy_padded(g.chunk_slots[:num], slots, decoder.pool.null_slot)
        for buf, src, fill in zip(g.outliers, outliers, (-1, 0, 0)):
            copy_padded(buf[:num], src, fill)
        g.budgets[:num].copy_(to_device(torch.tensor(budgets), dev))
        key = (num, tokens, width)
        if key not in self._static_plans:
            self._static_plans[key] = self._static_plan(q_indptr, tokens, width)
        return self._static_plans[key]

    def _static_plan(self, q_indptr: torch.Tensor, tokens: int, width: int) -> SuffixPlan:
        """The plan's tensors for one graph shape: views of the buffers, and constant indices."""
        g, dev, r = self.graph, self.decoder.pool.device, q_indptr.numel() - 1
        t = min(TILE, tokens)
        rounds = []
        for first in range(0, tokens, t):
            q_index = (torch.arange(r, device=dev)[:, None] * tokens + first + torch.arange(t, device=dev))
            rounds.append(SuffixRound(q_index, g.q_valid[:r, first:first + t], (torch.arange(r * t, device=dev),
                                      q_index.flatten()), g.rows[:r], g.chunk_slots[:r, :width],
                                      tuple(o[:r] for o in g.outliers), g.budgets[:r],
                                      self.decoder.cfg.budget_chunks(width), False))
        return SuffixPlan(torch.arange(r * tokens, device=dev), q_indptr, g.dense_indptr[:r + 1], g.dense_slots,
                          rounds, tokens)

    # ---- per layer ----------------------------------------------------------------------------
    def attend(self, q: torch.Tensor, layer: int, plan: SuffixPlan, kv_pool: PagedKVPool) -> torch.Tensor:
        """q [T, Hq, D]: the suffixes' queries (rows plan.q_rows of the step) -> their attention
        output [T, Hq, D]."""
        out, lse = self._dense(q, layer, plan, kv_pool)
        out = out.float()
        for rnd in plan.rounds:
            qt = q[rnd.q_index]  # [R, t, Hq, D]
            o, o_lse = out[rnd.q_index], lse[rnd.q_index]
            outliers = self.decoder.live_outliers(layer, *rnd.outliers)
            pieces = self._exact_pieces(layer, rnd) if rnd.exact else [self._select(qt, rnd, layer)]
            attend = self._compressed_shared if rnd.exact else self._compressed_tiles
            for k, selected in enumerate(pieces):
                entries = self.decoder.fetch_selected(layer, rnd.rows, selected)
                part, part_lse = attend(qt, layer, outliers if k == 0 else torch.full_like(outliers, -1),
                                        rnd.rows, entries, kv_pool)  # outliers once, with the first piece
                o, o_lse = merge(o, o_lse, part, part_lse)
            src, dst = rnd.take
            out[dst], lse[dst] = o.flatten(0, 1)[src], o_lse.flatten(0, 1)[src]
        return out.to(q.dtype)

    def _select(self, qt: torch.Tensor, rnd: SuffixRound, layer: int) -> torch.Tensor:
        """[R, Hkv, max_entries] each tile's chunks: landmark mass summed over its queries, one fused
        two-pass kernel on the GPU (kernels/landmark_scores.py); the reference, a few requests at a
        time within WORK_BYTES, elsewhere."""
        pool = self.decoder.pool
        r, t, hq, d = qt.shape
        landmarks, selectable = pool.landmarks[layer], pool.selectable[layer]
        scale = None if pool.landmark_scale is None else pool.landmark_scale[layer]
        if self.use_triton:
            masses = ls.tile_landmark_mass(qt, rnd.q_valid, landmarks, rnd.chunk_slots, selectable, d ** -0.5, scale)
        else:
            n = rnd.chunk_slots.shape[1]
            per_request = t * hq * n * 4 + n * pool.num_kv_heads * d * 4  # probabilities, landmarks
            masses = torch.cat([ls.tile_landmark_mass_reference(qt[a:b], rnd.q_valid[a:b], landmarks,
                                                                rnd.chunk_slots[a:b], selectable, d ** -0.5, scale)
                                for a, b in _groups(r, per_request)])
        return self.decoder.select(masses, rnd.chunk_slots, rnd.budgets, rnd.top_k)

    def _exact_pieces(self, layer: int, rnd: SuffixRound) -> list[torch.Tensor]:
        """Every selectable chunk of the round's one request, as [1, Hkv, max_entries] pieces that
        fit the scratch."""
        slots = rnd.chunk_slots[0].long()
        ok = self.decoder.pool.selectable[layer][slots].T.bool()  # [Hkv, N]
        per_head = torch.where(ok, slots, -1)
        size = self.decoder.max_entries
        return [torch.nn.functional.pad(per_head[:, a:a + size], (0, size - per_head[:, a:a + size].shape[1]),
                                        value=-1)[None] for a in range(0, slots.numel(), size)]

    def _compressed_tiles(self, qt: torch.Tensor, layer: int, outliers: torch.Tensor, rows: torch.Tensor,
                              entries: torch.Tensor, kv_pool: PagedKVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """`_compressed_shared` for tiles of at most TILE queries: the sparse decode kernel with a
        tile as a request of t queries (no window), one kernel instead of ~30 gathers, matmuls and
        elementwise ops, each program reading the keys once for a block of the tile's queries.
        The queries in the model's dtype (bf16 on a GPU: the kernel's dots on bf16 tensor cores,
        as exact as in float32 for bf16 values, with float32 accumulation; no upcast copy), the
        output float32 for the merge. On the H100, 16 questions on a 16K document spent 24 ms in
        it with float32 queries and 22 ms with bf16: its gathered chunk loads, not its dots, set
        its time."""
        r, t, hq, d = qt.shape
        n = r * t
        no_window = torch.zeros(r + 1, dtype=torch.int32, device=qt.device)
        lse = torch.empty(n, hq, dtype=torch.float32, device=qt.device)
        out = self.decoder.attend_selected(qt.reshape(n, hq, d), layer, outliers, rows, entries, no_window,
                                           no_window, kv_pool, lse=lse, queries_per_request=t,
                                           out_dtype=torch.float32)
        return out.view(r, t, hq, d), lse.view(r, t, hq)

    def _compressed_shared(self, qt: torch.Tensor, layer: int, outliers: torch.Tensor, rows: torch.Tensor,
                           entries: torch.Tensor, kv_pool: PagedKVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the tiles' queries qt [R, t, Hq, D] over each request's outliers [R, Hkv, O]
        and scratch entries [R, Hkv, K]: (output [R, t, Hq, D] float32, lse [R, t, Hq]). A tile's
        queries share their keys, so each KV head's keys are gathered once and scored as one
        matmul, a block of queries at a time: for the long tiles of exact requests, where reading
        every chunk once per query would cost their count times more."""
        decoder, pool = self.decoder, self.decoder.pool
        r, t, hq, d = qt.shape
        h, c = pool.num_kv_heads, pool.chunk_size
        g = hq // h
        # the outlier blocks, then the blocks of the scratch entries: [R, Hkv, O + K] (-1: none)
        blocks = torch.cat([outliers.long(), scratch_blocks(decoder.scratch_pages, rows, entries)], 2)
        ids, valid = blocks.clamp(min=0), (blocks >= 0).repeat_interleave(c, dim=2)
        keys = pool.blocks_k[layer][ids].reshape(r, h, -1, d).float()
        # entries never written hold whatever their pages held before: zero their values, so that a
        # zero probability times them stays zero
        values = pool.blocks_v[layer][ids].reshape(r, h, -1, d).float().masked_fill(~valid[..., None], 0.0)
        invalid = ~valid[:, :, None, :]
        q = qt.float().view(r, t, h, g, d).permute(0, 2, 1, 3, 4).reshape(r, h, t * g, d)  # [R, Hkv, t * G, D]
        out, lse = torch.empty_like(q), q.new_empty(r, h, t * g)
        block = max(g, WORK_BYTES // (4 * r * h * keys.shape[2]) // g * g)
        for a in range(0, t * g, block):
            with exact_bf16_matmul(q.is_cuda):
                scores = (q[:, :, a:a + block] @ keys.transpose(2, 3) * d ** -0.5).masked_fill(invalid, float("-inf"))
                lse[:, :, a:a + block] = part_lse = scores.logsumexp(-1)  # -inf where a head has no keys
                probs = torch.exp(scores - part_lse.nan_to_num(neginf=0.0)[..., None])
                out[:, :, a:a + block] = probs @ values
        out = out.view(r, h, t, g, d).permute(0, 2, 1, 3, 4).reshape(r, t, hq, d)
        return out, lse.view(r, h, t, g).permute(0, 2, 1, 3).reshape(r, t, hq)

    def _dense(self, q, layer, plan, kv_pool):
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        fn = rpa.ragged_paged_attention if self.use_triton else rpa.ragged_paged_attention_reference
        extra = dict(max_q_len=plan.max_q_len) if self.use_triton else {}
        out = fn(q, kv_pool.k_buffers[layer], kv_pool.v_buffers[layer], plan.q_indptr, plan.dense_indptr,
                 plan.dense_slots, q.shape[-1] ** -0.5, lse=lse, **extra)
        return out, lse


@contextmanager
def exact_bf16_matmul(on_gpu: bool):
    """float32 matmuls on TF32 tensor cores (GPU): exact for operands that are bf16 values (TF32
    keeps 10 mantissa bits, bf16 has 7), with float32 accumulation and output, as an attention
    kernel computes them, at tensor-core speed instead of float32 FMA speed."""
    if not on_gpu:
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _groups(count: int, bytes_each: int) -> list[tuple[int, int]]:
    """Slices of count items, each holding at most WORK_BYTES (at least one item)."""
    step = max(1, WORK_BYTES // max(1, bytes_each))
    return [(a, min(a + step, count)) for a in range(0, count, step)]


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """Attention over the union of two disjoint key sets from each set's output [..., H, D] and
    log-sum-exp [..., H] (float32; a set with no keys has lse -inf and contributes nothing)."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    out = (o1 * w1[..., None] + o2 * w2[..., None]) / total[..., None]
    return out, m + torch.log(total)

"""Prefill of suffixes over compressed prefixes, without bringing a prefix back dense.

A question over a cached document, or a chat's next turn, prefills a short suffix that attends to
the whole compressed document. A step's suffixes are served together: every layer runs a fixed
number of batched operations for all of them, however many requests there are. Each query's
attention is split in two parts merged by log-sum-exp (exact: softmax over the union of disjoint
key sets):
- the dense tokens: each prefix's dense spans and the suffix itself, causally, for every suffix
  in one ragged kernel call (the dense tokens are the last of each key list, so its causal rule
  holds).
- the compressed chunks. An `exact` request (every suffix at the default
  shadowkv_sparse_prefill_max 0; past it a longer one, or one that asks for prompt logprobs)
  attends every chunk: exact attention over the compressed document, none left out, as none is
  in the cold prefill. (By default a question whose documents have exact copies does not come
  here: the copies are loaded into dense pages and it is prefilled as a dense prompt,
  mem_cache/copy_loads.py; these rounds serve it when the pool cannot spare the pages.) Its keys
  and values are gathered from the documents' exact copies in host memory where every segment of
  them has one (then it attends the very keys and values the same question's cold prefill does:
  mem_cache/exact_copies.py), else keys rebuilt from their low-rank factors and the stored
  values. The step's exact requests are one round, whose
  documents (each once, however many of its questions the step holds) are fetched into a
  workspace of the step's own, at most WORKSPACE_BYTES at a time, and attended by the sparse
  decode kernel with every query of a request reading them, the outliers in the same pass: a
  few launches a layer.
  Otherwise the chunks are read the way decode reads them: per tile of TILE suffix queries, the
  landmark softmax mass summed over the tile's queries (max over each KV group) picks the budget's
  best chunks per KV head; their keys are rebuilt and values fetched into the request's own
  chunk-cache scratch, and the tile's queries attend them and the outlier chunks. A tile per 64
  queries (not one selection for the whole suffix, as the ShadowKV reference does) lets a long
  question that touches several parts of the document find them all. Round k serves the k-th
  tile of every suffix that has one, so a step of short questions is one round.
The scratch ends holding the last tile's selection (none after an exact round): the request's
decode starts from it.

A step whose only work is short suffixes (questions on cached compressed documents with nothing
else running, or beside decodes that replay their own graphs) can replay a CUDA graph:
`plan_static` writes its plan into fixed buffers, each suffix padded to a captured token count
(GRAPH_TOKENS) with queries that read and write only the reserved page, so the per-layer work
above costs one replay, not ~100 launches a layer whose host time set the step's (a question
on a 16K document of the 8B shape: 100 ms eagerly on the H100, 29 ms of it on the device). Exact
steps too, when their documents fit one piece of a workspace that every exact graph shares
(graph_fits): a graph per (requests, tokens, chunk width, documents), documents counted up to a
request count of GRAPH_REQUESTS.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import triton

from sglang_shadowkv.kernels import landmark_scores as ls
from sglang_shadowkv.kernels import ragged_paged_attention as rpa
from sglang_shadowkv.kernels.key_splits import power_of_two_at_most
from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool, ReqToTokenPool, to_device

from .decode import ChunkMemory, SparseDecoder
from .request_state import CompressedLayout, copy_padded, selection_tables

TILE = 64  # suffix queries that share one chunk selection
WORK_BYTES = 1 << 29  # float32 scores a batched selection or attention may hold at once
# K and V of rebuilt chunks an exact round's workspace holds at once: 64K tokens of a document of
# the 8B shape; a longer one (or several) is attended a piece at a time, merged by log-sum-exp.
# Taken from the memory that mem_fraction_static leaves beside the pools (GBs on a GPU)
WORKSPACE_BYTES = 1 << 28
# chunk columns of one row of a workspace fetch: its kernels take a row's jobs whole (the key
# rebuild ranks a row's misses in one tile), so a piece is fetched as rows of this many, the width
# decode's fetches have at the default budget cap (compiled at the server's warmup)
FETCH_ENTRIES = 256
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
    workspace: Workspace | None = None  # an exact round's (None: tiles, each attending its selection)

    @property
    def exact(self) -> bool:
        return self.workspace is not None


@dataclass
class Workspace:
    """Where an exact round's documents are fetched, layer by layer: each distinct document once,
    however many of its questions the step holds, a piece of `width` chunk columns at a time."""
    slots: torch.Tensor  # [D, pieces·width] long: each document's chunk slots, null-slot padded
    docs: torch.Tensor  # [R] int32: each request's document (its row of `memory`)
    width: int  # chunk columns of a piece: a power of two, or a CUDA graph's width (one piece)
    memory: ChunkMemory  # a piece's K and V blocks, pages [D, width]
    fetch_memory: ChunkMemory  # the same blocks, pages [D·width/r, r]: rows of r <= FETCH_ENTRIES columns
    fetch_rows: torch.Tensor  # [D·width/r] int32
    columns: torch.Tensor  # [width] int32
    no_outliers: torch.Tensor  # [R, Hkv, O] all -1: the pieces after the first
    from_copies: bool  # its documents' chunks are gathered from their exact copies, not rebuilt

    @classmethod
    def over(cls, slots: torch.Tensor, docs: torch.Tensor, width: int, blocks: tuple[torch.Tensor, torch.Tensor],
             outliers: torch.Tensor, from_copies: bool) -> "Workspace":
        """A workspace of `blocks` (K and V: D·width·Hkv blocks each) for documents' chunk slots
        [D, pieces·width] and requests' documents [R]; outliers [R, Hkv, O] gives the shape of
        the pieces' none."""
        dev, num_docs = slots.device, slots.shape[0]
        pages = torch.arange(num_docs * width, dtype=torch.int32, device=dev)
        row = min(FETCH_ENTRIES, width)
        return cls(slots, docs, width, ChunkMemory(*blocks, pages.view(-1, width)),
                   ChunkMemory(*blocks, pages.view(-1, row)), pages[:pages.numel() // row],
                   torch.arange(width, dtype=torch.int32, device=dev), torch.full_like(outliers, -1), from_copies)


def documents_of(layouts: list[CompressedLayout]) -> tuple[list[int], list[int]]:
    """Each request's document among the distinct ones (equal chunks_key: one document), and the
    first request of each distinct document, in order."""
    first: dict[tuple, int] = {}
    rows = [first.setdefault(lay.chunks_key, i) for i, lay in enumerate(layouts)]
    distinct = sorted(set(rows))
    return [distinct.index(row) for row in rows], distinct


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
    doc_slots: torch.Tensor  # [R, max_chunks] long: an exact step's distinct documents' chunk slots
    docs: torch.Tensor  # [R] int32: each exact suffix's document (its row of doc_slots)


class SuffixPrefill:
    def __init__(self, decoder: SparseDecoder, use_triton: bool):
        self.decoder, self.use_triton = decoder, use_triton
        self.graph: SuffixGraphBuffers | None = None
        self._static_plans: dict[tuple, SuffixPlan] = {}  # by (requests, tokens, width, documents, from_copies)
        self._static_blocks: tuple[torch.Tensor, torch.Tensor] | None = None  # exact graph steps' workspace

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
        exact = [i for i, r in enumerate(reqs) if r.exact]
        if exact:  # one round: every query of each, its documents rebuilt once
            rounds.append(self._round(reqs, exact, [offsets[i] for i in exact], [n_q[i] for i in exact],
                                      max(n_q[i] for i in exact), True))
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
                           slots, outliers, to_device(torch.tensor(budgets), dev), max(budgets),
                           self._workspace(slots, [reqs[i].layout for i in members], outliers[0]) if exact else None)

    def _workspace(self, slots: torch.Tensor, layouts: list[CompressedLayout], outliers: torch.Tensor) -> Workspace:
        """An exact round's workspace, for the requests' chunk slots [R, N] (rows of equal layouts'
        chunks are one document) and outlier blocks [R, Hkv, O], of at most WORKSPACE_BYTES."""
        pool, dev = self.decoder.pool, self.decoder.pool.device
        docs, distinct = documents_of(layouts)
        width = min(triton.next_power_of_2(slots.shape[1]),
                    power_of_two_at_most(WORKSPACE_BYTES // (len(distinct) * self._column_bytes())))
        doc_slots = slots[to_device(torch.tensor(distinct), dev)].long()
        doc_slots = torch.nn.functional.pad(doc_slots, (0, -doc_slots.shape[1] % width), value=pool.null_slot)
        return Workspace.over(doc_slots, to_device(torch.tensor(docs, dtype=torch.int32), dev), width,
                              self._new_blocks(len(distinct) * width), outliers, self.reads_copies(layouts))

    def reads_copies(self, layouts: list[CompressedLayout]) -> bool:
        """Whether an exact round over these prefixes gathers their exact copies: every segment
        they hold has one (mem_cache/exact_copies.py), else every chunk is rebuilt."""
        return self.decoder.pool.has_copies(seg for lay in layouts for seg in lay.segments)

    def _new_blocks(self, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh K and V blocks for `columns` document chunk columns, every KV head (the pool's block
        shape and dtype)."""
        pool = self.decoder.pool
        block = pool.blocks_k[0][0]
        return tuple(torch.empty(columns * pool.num_kv_heads, *block.shape, dtype=block.dtype, device=pool.device)
                     for _ in range(2))

    def _column_bytes(self) -> int:
        """Bytes of one chunk column of a document in a workspace: its K and V blocks, every KV head."""
        pool = self.decoder.pool
        block = pool.blocks_k[0][0]
        return 2 * pool.num_kv_heads * block.numel() * block.element_size()

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
            torch.zeros(r, dtype=torch.int64, device=dev),
            torch.full((r, decoder.max_chunks), decoder.pool.null_slot, dtype=torch.long, device=dev), ints(r))

    def graph_documents(self, reqs: list[SuffixRequest]) -> tuple[int, bool] | None:
        """The documents an exact graph step of these requests holds (their distinct documents,
        rounded up to a count of GRAPH_REQUESTS) and whether it reads their exact copies (None: a
        selecting step)."""
        if not any(req.exact for req in reqs):
            return None
        layouts = [req.layout for req in reqs]
        distinct = len(documents_of(layouts)[1])
        return next(n for n in GRAPH_REQUESTS if n >= distinct), self.reads_copies(layouts)

    def graph_fits(self, reqs: list[SuffixRequest], width: int, documents: int | None = None) -> bool:
        """Whether the graph buffers hold these requests' plan with `width` chunk columns: selecting
        suffixes (documents None), or exact ones whose `documents` rebuilt at `width` columns fit
        in one piece of the step's workspace (WORKSPACE_BYTES), fetched as whole rows."""
        g = self.graph
        if g is None or len(reqs) > GRAPH_REQUESTS[-1] or width > self.decoder.max_chunks:
            return False
        if documents is not None and (documents * width * self._column_bytes() > WORKSPACE_BYTES
                                      or width % min(FETCH_ENTRIES, width)):
            return False
        per_request = g.dense_slots.numel() // GRAPH_REQUESTS[-1] - GRAPH_TOKENS[-1]
        return all(req.exact == (documents is not None) and req.layout.num_chunks <= width
                   and req.layout.num_outliers <= g.outliers[0].shape[2]
                   and req.seq_len - req.start <= GRAPH_TOKENS[-1] and req.dense_tokens() <= per_request
                   for req in reqs)

    def plan_static(self, table: ReqToTokenPool, reqs: list[SuffixRequest], q_indptr: torch.Tensor, tokens: int,
                    width: int, padding_row: int, documents: int | None = None,
                    from_copies: bool = False) -> SuffixPlan:
        """The plan of a graph step of suffixes of `tokens` query rows each (q_indptr [R + 1]: the
        graph batch's, i * tokens; sizes from GRAPH_REQUESTS and GRAPH_TOKENS), written into the
        fixed buffers. A suffix's real queries come first; its padding queries come last and
        attend only slots of the reserved page, appended after its keys, so the causal rule keeps
        them invisible to the real ones. Requests past len(reqs) are all padding (a capture:
        none). An exact step (documents, from_copies: graph_documents) writes its distinct
        documents' chunk slots and each suffix's document; its workspace is one buffer every exact
        graph shares. The plan's shapes depend only on (R, tokens, width, documents, from_copies),
        so every step of that shape replays one graph."""
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
        if documents is not None:
            docs, distinct = documents_of([r.layout for r in reqs])
            distinct_slots = slots[to_device(torch.tensor(distinct, dtype=torch.long), dev)]
            copy_padded(g.doc_slots[:documents, :width], distinct_slots, decoder.pool.null_slot)
            g.docs[:num].copy_(to_device(torch.tensor(docs + [0] * (num - len(reqs)), dtype=torch.int32), dev))
        key = (num, tokens, width, documents, from_copies)
        if key not in self._static_plans:
            self._static_plans[key] = self._static_plan(q_indptr, tokens, width, documents, from_copies)
        return self._static_plans[key]

    def _static_plan(self, q_indptr: torch.Tensor, tokens: int, width: int, documents: int | None,
                     from_copies: bool) -> SuffixPlan:
        """The plan's tensors for one graph shape: views of the buffers, and constant indices. An
        exact step is one round of every query, over a workspace in the shared blocks."""
        g, dev, r = self.graph, self.decoder.pool.device, q_indptr.numel() - 1
        t = tokens if documents is not None else min(TILE, tokens)
        rounds = []
        for first in range(0, tokens, t):
            q_index = (torch.arange(r, device=dev)[:, None] * tokens + first + torch.arange(t, device=dev))
            rounds.append(SuffixRound(q_index, g.q_valid[:r, first:first + t], (torch.arange(r * t, device=dev),
                                      q_index.flatten()), g.rows[:r], g.chunk_slots[:r, :width],
                                      tuple(o[:r] for o in g.outliers), g.budgets[:r],
                                      self.decoder.cfg.budget_chunks(width)))
        if documents is not None:
            rounds[0].workspace = Workspace.over(g.doc_slots[:documents, :width], g.docs[:r], width,
                                                 self._graph_blocks(documents * width), g.outliers[0][:r], from_copies)
        return SuffixPlan(torch.arange(r * tokens, device=dev), q_indptr, g.dense_indptr[:r + 1], g.dense_slots,
                          rounds, tokens)

    def _graph_blocks(self, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V blocks of `columns` document chunk columns in the workspace every exact graph
        step shares (WORKSPACE_BYTES, taken at the first one: one graph replays at a time)."""
        if self._static_blocks is None:
            self._static_blocks = self._new_blocks(WORKSPACE_BYTES // self._column_bytes())
        return tuple(b[:columns * self.decoder.pool.num_kv_heads] for b in self._static_blocks)

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
            if rnd.exact:
                for part, part_lse in self._every_chunk(qt, layer, rnd, outliers, kv_pool):
                    o, o_lse = merge(o, o_lse, part, part_lse)
            else:
                entries = self.decoder.fetch_selected(layer, rnd.rows, self._select(qt, rnd, layer))
                part, part_lse = self._compressed_tiles(qt, layer, outliers, rnd.rows, entries, kv_pool)
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

    def _compressed_tiles(self, qt: torch.Tensor, layer: int, outliers: torch.Tensor, rows: torch.Tensor,
                          entries: torch.Tensor, kv_pool: PagedKVPool,
                          memory: ChunkMemory | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the tiles' queries qt [R, t, Hq, D] over each one's outliers [R, Hkv, O]
        and entries [R, Hkv, K] of rows [R] of the memory (default the scratch): (output
        [R, t, Hq, D] float32, lse [R, t, Hq]). The sparse decode kernel with a tile as a request
        of t queries (no window), each program reading the keys once for a block of the tile's
        queries; on a CPU its reference, a few tiles' queries at a time within WORK_BYTES.
        The queries in the model's dtype (bf16 on a GPU: the kernel's dots on bf16 tensor cores,
        as exact as in float32 for bf16 values, with float32 accumulation; no upcast copy), the
        output float32 for the merge. On the H100, 16 questions on a 16K document spent 24 ms in
        it with float32 queries and 22 ms with bf16: its gathered chunk loads, not its dots, set
        its time."""
        r, t, hq, d = qt.shape
        no_window = torch.zeros(r + 1, dtype=torch.int32, device=qt.device)
        keys = outliers.shape[2] + entries.shape[2]
        spans = [(0, t)] if self.use_triton else _groups(t, 4 * r * hq * keys * self.decoder.pool.chunk_size)
        parts = []
        for a, b in spans:
            q = qt[:, a:b]
            lse = torch.empty(q.shape[0] * q.shape[1], hq, dtype=torch.float32, device=qt.device)
            out = self.decoder.attend_selected(q.reshape(-1, hq, d), layer, outliers, rows, entries, no_window,
                                               no_window, kv_pool, lse=lse, queries_per_request=q.shape[1],
                                               out_dtype=torch.float32, memory=memory)
            parts.append((out.view(q.shape), lse.view(q.shape[:3])))
        if len(parts) == 1:
            return parts[0]
        return torch.cat([o for o, _ in parts], 1), torch.cat([lse for _, lse in parts], 1)

    def _every_chunk(self, qt: torch.Tensor, layer: int, rnd: SuffixRound, outliers: torch.Tensor,
                     kv_pool: PagedKVPool):
        """An exact round's attention over every selectable chunk of its documents and its
        outliers, as (output [R, t, Hq, D] float32, lse [R, t, Hq]) parts to merge: a piece of
        chunk columns at a time, its keys rebuilt and values gathered (or both gathered from the
        documents' exact copies) into the round's workspace (fetched as rows of at most FETCH_ENTRIES columns: the rows decode's fetches
        have at the default budget cap, compiled at the server's warmup), the outliers read from
        the pool with the first piece."""
        ws, hkv = rnd.workspace, self.decoder.pool.num_kv_heads
        ok = self.decoder.pool.selectable[layer][ws.slots].transpose(1, 2) != 0  # [D, Hkv, columns]
        jobs = torch.where(ok, ws.slots[:, None, :], -1).contiguous()  # (ok's layout is the transpose's)
        row = ws.fetch_memory.pages.shape[1]
        fetch = self.decoder.fetch_copies if ws.from_copies else self.decoder.fetch
        for k, a in enumerate(range(0, jobs.shape[2], ws.width)):
            piece = jobs[:, :, a:a + ws.width]
            rows = piece.reshape(piece.shape[0], hkv, ws.width // row, row).transpose(1, 2).reshape(-1, hkv, row)
            fetch(rows, layer, ws.fetch_rows, ws.fetch_memory)
            entries = torch.where(piece >= 0, ws.columns, -1)[ws.docs]  # [R, Hkv, width]
            yield self._compressed_tiles(qt, layer, outliers if k == 0 else ws.no_outliers, ws.docs, entries, kv_pool,
                                         ws.memory)

    def _dense(self, q, layer, plan, kv_pool):
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        fn = rpa.ragged_paged_attention if self.use_triton else rpa.ragged_paged_attention_reference
        extra = dict(max_q_len=plan.max_q_len) if self.use_triton else {}
        out = fn(q, kv_pool.k_buffers[layer], kv_pool.v_buffers[layer], plan.q_indptr, plan.dense_indptr,
                 plan.dense_slots, q.shape[-1] ** -0.5, lse=lse, **extra)
        return out, lse


def _groups(count: int, bytes_each: int) -> list[tuple[int, int]]:
    """Slices of count items, each holding at most WORK_BYTES (at least one item)."""
    step = max(1, WORK_BYTES // max(1, bytes_each))
    return [(a, min(a + step, count)) for a in range(0, count, step)]


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """Attention over the union of two disjoint key sets from each set's output [..., H, D] and
    log-sum-exp [..., H] (float32; a set with no keys has lse -inf and contributes nothing)."""
    lse = torch.logaddexp(lse1, lse2)
    return o1 * torch.exp(lse1 - lse)[..., None] + o2 * torch.exp(lse2 - lse)[..., None], lse

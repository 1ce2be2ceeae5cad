"""ShadowKV behind the attention-backend interface.

A step's requests take one of three paths: those without a compressed prefix (or prefilling over its
exact copy loaded dense: mem_cache/copy_loads.py) go through the wrapped dense backend; decode
tokens of requests with one go through the sparse decoder; other prompt chunks after a compressed
prefix (a question over a cached document) through the sparse suffix prefill. In the step that
completes a request's long prompt, each layer compresses its segment right after its attention has
run (the last layer also solves every layer's low-rank basis), so the prefill is exact over its own
tokens and their dense pages can be freed after the step. Outside a step, `compress_span` compresses
a request's long dense tail when it finishes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from sglang_shadowkv.kernels import chunk_selection as cs
from sglang_shadowkv.kernels import sparse_decode_attention as sda
from sglang_shadowkv.layers.rotary import RotaryEmbedding
from sglang_shadowkv.mem_cache.kv_pool import ReqToTokenPool, to_device
from sglang_shadowkv.mem_cache.compressed_pool import Segment, ShadowKVPool
from sglang_shadowkv.shadowkv.compress import SegmentCompression
from sglang_shadowkv.shadowkv.config import ShadowKVConfig
from sglang_shadowkv.shadowkv.decode import SparseDecoder, SparseRequest, window_splits
from sglang_shadowkv.shadowkv.suffix_prefill import SuffixPlan, SuffixPrefill, SuffixRequest

from .base import NO_GRAPH, AttentionBackend, ForwardBatch

DENSE_GRAPH = "dense"  # graph variants (DENSE_GRAPH, v): batches without a compressed prefix
SUFFIX_GRAPH = "suffix"  # graph variants (SUFFIX_GRAPH, width): suffixes over compressed prefixes, selecting
# graph variants (EXACT_SUFFIX_GRAPH, width, documents, from_copies): suffixes attending every chunk of their
# documents, rebuilt or from their exact copies
EXACT_SUFFIX_GRAPH = "exact_suffix"
# graph variants (LONG_WINDOW_GRAPH, width): decode batches with a long dense window (decode.window_splits);
# a plain width: the other decode batches with a compressed prefix
LONG_WINDOW_GRAPH = "long_window"
MIN_GRAPH_CHUNK_COLUMNS = 256
GRAPH_LADDER_FROM = 2048  # sparse graph widths double up to here, then step GRAPH_WIDTHS_PER_OCTAVE times a doubling
GRAPH_WIDTHS_PER_OCTAVE = 4  # (2048, 2560, 3072, 3584, 4096, 5120, ...)
GRAPH_OUTLIER_SEGMENTS = 2  # a decode graph holds the outliers of this many segments per request


@dataclass
class SpanCompression:
    """A segment being compressed from dense-pool slots: a prompt's span, or a demoted document's pages."""
    compression: SegmentCompression
    slots: torch.Tensor


def graph_widths(max_chunks: int) -> list[int]:
    """Chunk widths of the sparse graphs: 256, 512, 1024, then GRAPH_WIDTHS_PER_OCTAVE steps per
    doubling (2048, 2560, 3072, 3584, 4096, 5120, ...), and max_chunks. A step scores and ranks
    every column of its width, so a document just past a power of two (a 16K document plus a chat
    template: 2049 chunks) scores at most 1.25x its chunks, not 2x; graphs are captured on first
    use, so only the widths serving meets cost capture time."""
    widths, w = [], MIN_GRAPH_CHUNK_COLUMNS
    while w < max_chunks:
        widths.append(w)
        octave = 1 << (w.bit_length() - 1)
        w += octave // GRAPH_WIDTHS_PER_OCTAVE if w >= GRAPH_LADDER_FROM else w
    return widths + [max_chunks]


class ShadowKVAttentionBackend(AttentionBackend):
    def __init__(self, dense: AttentionBackend, store: ShadowKVPool, cfg: ShadowKVConfig,
                 rotary: RotaryEmbedding, req_to_token: ReqToTokenPool, decoder: SparseDecoder):
        super().__init__(dense.pool, dense.num_heads, dense.head_dim)
        self.dense, self.store, self.cfg, self.rotary = dense, store, cfg, rotary
        self.capturable = dense.capturable
        self.req_to_token, self.decoder = req_to_token, decoder
        self.suffix = SuffixPrefill(decoder, decoder.use_triton)

    def begin_step(self, batch: ForwardBatch) -> None:
        shadow = batch.shadowkv or [None] * batch.batch_size
        compressed = [st is not None and st.reads_compressed for st in shadow]
        sparse = [i for i in range(batch.batch_size) if compressed[i] and batch.extend_lens[i] == 1]
        suffix = [i for i in range(batch.batch_size) if compressed[i] and batch.extend_lens[i] > 1]
        dense = [i for i in range(batch.batch_size) if not compressed[i]]
        if len(dense) == batch.batch_size:
            self.dense_batch, self.dense_rows = batch, None
        elif dense:
            self.dense_batch, self.dense_rows = batch.subset(dense)
        else:
            self.dense_batch = self.dense_rows = None
        if self.dense_batch is not None:
            self.dense.begin_step(self.dense_batch)
        self.sparse_rows = self.plan = None
        if sparse:
            self.sparse_rows = batch.q_indptr[sparse].long()  # each request's only token
            self.plan = self.decoder.plan_step(self.req_to_token, [self._sparse_request(batch, i) for i in sparse])
        q_starts = [0, *itertools.accumulate(batch.extend_lens)]
        self.suffix_plan: SuffixPlan | None = self.suffix.plan(
            self.req_to_token, [self._suffix_request(batch, i) for i in suffix],
            [q_starts[i] for i in suffix]) if suffix else None
        self.to_compress = [self.start_compression(self.request_slots(batch.pool_rows[i], st.segment), st.segment)
                            for i, st in enumerate(shadow) if st is not None and st.compress_now]

    @staticmethod
    def _sparse_request(batch: ForwardBatch, i: int) -> SparseRequest:
        st = batch.shadowkv[i] if batch.shadowkv else None
        if st is None or not st.reads_compressed:  # a dense request: its whole sequence is its window
            return SparseRequest(batch.pool_rows[i], None, None, batch.seq_lens[i])
        return SparseRequest(batch.pool_rows[i], st.scratch_row, st.layout, batch.seq_lens[i])

    @staticmethod
    def _suffix_request(batch: ForwardBatch, i: int) -> SuffixRequest:
        st = batch.shadowkv[i]
        return SuffixRequest(batch.pool_rows[i], st.scratch_row, st.layout, batch.seq_lens[i] - batch.extend_lens[i],
                             batch.seq_lens[i], st.exact_prefill)

    # ---- CUDA-graph decode steps ------------------------------------------------------------------
    def init_graph_state(self, max_bs, max_kv_tokens, req_to_token):
        """A batch without a compressed prefix replays the dense backend's own graphs (exactly full
        attention's step: documents the cache keeps dense cost nothing more). A batch with one goes
        through the sparse decoder, where a dense request attends its whole sequence as its
        window, so one graph serves compressed and mixed batches; its shapes depend on the chunk
        columns of the plan, so those graphs are captured per column count of a ladder (a batch
        replays the smallest that holds its longest compressed prefix; see graph_widths)."""
        self.dense.init_graph_state(max_bs, max_kv_tokens, req_to_token)
        self.decoder.init_graph_state(max_bs, max_kv_tokens, GRAPH_OUTLIER_SEGMENTS * self.cfg.outliers)
        self.suffix.init_graph_state(req_to_token.table.shape[1], GRAPH_OUTLIER_SEGMENTS * self.cfg.outliers)
        self._graph_widths = graph_widths(self.decoder.max_chunks)
        self._class_widest = {cs.compile_class(w): w for w in self._graph_widths}  # ascending: the widest stays

    def graph_variants(self) -> list:
        return ([(DENSE_GRAPH, v) for v in self.dense.graph_variants()] + self._graph_widths
                + [(LONG_WINDOW_GRAPH, w) for w in self._graph_widths])

    def startup_graph_variants(self) -> list:
        """The dense graphs only: which sparse widths serving needs follows from its documents'
        lengths (the narrowest width, 256 chunks, is shorter than the shortest document compressed
        by default), so those are captured on first use; the server's warmup compresses a document
        and so compiles the sparse kernels before the first request."""
        return [(DENSE_GRAPH, v) for v in self.dense.startup_graph_variants()]

    def compile_graph_variants(self) -> list:
        """The widest sparse width of each compile class of the chunk selection (chunk_selection.
        compile_class), plain and with a long dense window (whose key splits make the attention
        another variant): on the H100 the first capture of a 16K document's width waited 1.7-2.1 s
        for the Triton compiler twice in a chat's first 20 s (SGLang's client, every other
        request's step waiting with it); each width's graphs are still captured on first use."""
        return [v for w in self._widest_of_each_compile_class() for v in (w, (LONG_WINDOW_GRAPH, w))]

    def compile_suffix_variants(self) -> list:
        """Suffix steps select per KV head, not per query head: another compile of the selection
        per compile class, and of the tile scoring. On the H100 a chat's first question over a
        17K document waited 1.5 s for it (SGLang's client, every step in flight waiting too). No
        selection when every suffix attends every chunk (shadowkv_sparse_prefill_max 0, the
        default); the exact step's kernels are the same at every width (compile_variant), one set
        gathering documents' exact copies (the default) and one rebuilding them (a document whose
        copy went, or no copies)."""
        copies = [True, False] if self.decoder.pool.copies is not None else [False]
        exact = [(EXACT_SUFFIX_GRAPH, self._graph_widths[0], 1, from_copies) for from_copies in copies]
        if self.cfg.sparse_prefill_max == 0:
            return exact
        return [(SUFFIX_GRAPH, w) for w in self._widest_of_each_compile_class()] + exact

    def _widest_of_each_compile_class(self) -> list[int]:
        return list(self._class_widest.values())

    def compile_variant(self, variant):
        """Widths of one compile class launch the same kernels (the selection's register row and
        warps are the class's; every other shape is a run-time argument): the class's widest, the
        width startup compiles (compile_graph_variants), stands for them."""
        if isinstance(variant, tuple) and variant[0] == DENSE_GRAPH:
            return variant
        if isinstance(variant, tuple) and variant[0] == EXACT_SUFFIX_GRAPH:  # rows of FETCH_ENTRIES columns
            return EXACT_SUFFIX_GRAPH, variant[3]  # and entries of whole rows at any width
        kind, width = variant if isinstance(variant, tuple) else (None, variant)
        widest = self._class_widest[cs.compile_class(width)]
        return widest if kind is None else (kind, widest)

    def graph_variant(self, batch: ForwardBatch):
        if not any(st is not None and st.reads_compressed for st in batch.shadowkv or []):
            variant = self.dense.graph_variant(batch)
            return NO_GRAPH if variant is NO_GRAPH else (DENSE_GRAPH, variant)
        reqs = [self._sparse_request(batch, i) for i in range(batch.batch_size)]
        need = max((r.layout.num_chunks for r in reqs if r.layout is not None), default=0)
        width = next((w for w in self._graph_widths if w >= need), None)
        if width is None or not self.decoder.graph_fits(reqs, width):
            return NO_GRAPH
        return width if window_splits(reqs) is None else (LONG_WINDOW_GRAPH, width)

    def graph_parts(self, items: list) -> bool:
        """Yes when the step holds a request over a compressed prefix: eagerly, the sparse path
        launches ~200 kernels a layer and the host sets the step's pace (a mixed step at 16K took
        ~190 ms eagerly against ~40 ms from graphs on the H100); its decodes and short suffixes
        replay their graphs, the dense prompt chunks run eagerly beside them."""
        return any(it.over_compressed_prefix for it in items)

    def suffix_graph_variant(self, batch: ForwardBatch):
        """A graph batch of suffixes (each padded in place) replays (SUFFIX_GRAPH, the smallest
        chunk width that holds every compressed prefix), or, when they attend every chunk,
        (EXACT_SUFFIX_GRAPH, that width, their documents, whether it reads their exact copies:
        SuffixPrefill.graph_documents); unless
        one needs the eager path: a prompt that compresses itself this step, selecting and exact
        suffixes in one step, or documents that do not fit the exact step's workspace."""
        reqs = []
        for i, st in enumerate(batch.shadowkv):
            if batch.extend_lens[i] == 0:  # a padding request
                continue
            if st is None or not st.reads_compressed or st.compress_now:  # a dense prompt, or one compressing
                return NO_GRAPH
            reqs.append(self._suffix_request(batch, i))
        need = max(r.layout.num_chunks for r in reqs)
        width = next((w for w in self._graph_widths if w >= need), None)
        exact = self.suffix.graph_documents(reqs)
        if width is None or not self.suffix.graph_fits(reqs, width, None if exact is None else exact[0]):
            return NO_GRAPH
        return (SUFFIX_GRAPH, width) if exact is None else (EXACT_SUFFIX_GRAPH, width, *exact)

    def begin_graph_step(self, batch: ForwardBatch, variant) -> None:
        self.dense_batch = self.dense_rows = self.plan = self.sparse_rows = self.suffix_plan = None
        self.to_compress = []
        if isinstance(variant, tuple) and variant[0] in (SUFFIX_GRAPH, EXACT_SUFFIX_GRAPH):
            reqs = [self._suffix_request(batch, i) for i in range(batch.batch_size) if batch.extend_lens[i]]
            self.suffix_plan = self.suffix.plan_static(
                self.req_to_token, reqs, batch.q_indptr, len(batch.input_ids) // batch.batch_size, variant[1],
                self.req_to_token.padding_row, *variant[2:])
            return
        if isinstance(variant, tuple) and variant[0] == DENSE_GRAPH:  # the dense backend's variant
            self.dense.begin_graph_step(batch, variant[1])
            self.dense_batch = batch
            return
        long_window = isinstance(variant, tuple) and variant[0] == LONG_WINDOW_GRAPH
        reqs = [self._sparse_request(batch, i) for i in range(batch.batch_size)]
        padding = self.req_to_token.padding_row  # the runner pads a batch at its end
        live = next((i for i, row in enumerate(batch.pool_rows) if row == padding), batch.batch_size)
        self.plan = self.decoder.plan_step(self.req_to_token, reqs, width=variant[1] if long_window else variant,
                                           static=True, splits=sda.MAX_SPLITS if long_window else None, live=live)

    def attend(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        if self.dense_batch is not None and self.dense_rows is None:  # every row is dense
            out = self.dense.attend(q, layer, self.dense_batch)
        elif self.plan is not None and self.dense_batch is None and self.suffix_plan is None:  # all decode sparsely
            out = self.decoder.attend(q, layer, self.plan, self.pool)
        else:
            out = torch.empty_like(q)
            if self.dense_batch is not None:
                out[self.dense_rows] = self.dense.attend(q[self.dense_rows], layer, self.dense_batch)
            if self.plan is not None:
                out[self.sparse_rows] = self.decoder.attend(q[self.sparse_rows], layer, self.plan, self.pool)
            if self.suffix_plan is not None:
                rows = self.suffix_plan.q_rows
                out[rows] = self.suffix.attend(q[rows], layer, self.suffix_plan, self.pool)
        for job in self.to_compress:
            self.continue_compression(job, layer)
        return out

    # ---- compression of dense KV into a segment -----------------------------------------------------
    def request_slots(self, row: int, seg: Segment) -> torch.Tensor:
        """Dense-pool slots of the segment's span of a request's KV."""
        return self.req_to_token.table[row, seg.start:seg.start + seg.num_tokens].long()

    def page_slots(self, pages: list[int], seg: Segment) -> torch.Tensor:
        """Dense-pool slots of the segment's span held in pages of the cache (a demotion)."""
        return to_device(self.pool.slots_of_pages(pages, seg.num_tokens), self.pool.device)

    def start_compression(self, slots: torch.Tensor, seg: Segment) -> SpanCompression:
        return SpanCompression(SegmentCompression(self.store, seg, self.rotary, self.cfg), slots)

    def continue_compression(self, job: SpanCompression, layer: int) -> None:
        """Compress one layer of the job's dense KV (layers in order); after the last, solve and
        write every layer's basis."""
        keys, values = self.pool.k_buffers, self.pool.v_buffers
        job.compression.add_layer(layer, keys[layer][job.slots], values[layer][job.slots])
        if layer == len(keys) - 1:
            job.compression.finish(lambda at: (keys[at][job.slots], values[at][job.slots]))

    def compress_span(self, row: int, seg: Segment) -> None:
        """Compress the segment's span of a request's dense KV, every layer (outside a step)."""
        job = self.start_compression(self.request_slots(row, seg), seg)
        for layer in range(len(self.pool.k_buffers)):
            self.continue_compression(job, layer)

"""Decode steps as CUDA graphs, captured at startup per batch size and replayed by the scheduler;
and steps of short suffixes over compressed prefixes, captured on first use per shape.

Eager decode launches a few hundred small kernels per step (ShadowKV adds scores, top-k, the chunk
cache, key rebuild, value gather and sparse attention to every layer), so at small batches the
CPU, not the GPU, sets the pace: on the H100 a ShadowKV step at batch 8 and 32K took 80 ms eagerly
and 21 ms as a graph. A graph holds the whole step: embedding, every layer (projections, RoPE, KV
write, the attention backend including ShadowKV's two-stream fetch), the final norm and lm_head.

Graphs are captured for a list of batch sizes (and the attention backend's shape variants, e.g.
ShadowKV's chunk-column buckets); a live batch is padded up to the next captured size with entries
that read and write only the reserved page 0 (variants captured on first use: see
PAD_ROWS_BEFORE_CAPTURE). Every per-step input lives in fixed buffers owned
here (token ids, positions, KV slots) or by the backend (its metadata: page tables, ShadowKV's
plan), written before each replay, so batches that change every step replay the same graphs.
Without a GPU the same path runs eagerly over the same buffers (capture=False), which is how the
tests check it against the plain eager step.

Questions on cached compressed documents, with nothing else running, make a step of short prompt
chunks whose attention (the sparse suffix prefill) launches ~200 kernels a layer: eagerly the
host, not the GPU, sets their time to first token (188 ms against full attention's 24 ms at 16K
on the H100). Such a step replays a graph too, captured on first use per (requests, tokens each,
chunk width): each chunk is padded to the captured token count with rows that read and write
only the reserved page, and the batch with all-padding requests; the backend decides whether it
can (`suffix_graph_variant`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from sglang_shadowkv.distributed.parallel_state import get_tp
from sglang_shadowkv.layers.attention.base import NO_GRAPH, AttentionBackend, ForwardBatch
from sglang_shadowkv.mem_cache.kv_pool import ReqToTokenPool, to_device
from sglang_shadowkv.shadowkv.suffix_prefill import GRAPH_REQUESTS, GRAPH_TOKENS, compile_tokens

from .forward_batch import StepItem

logger = logging.getLogger(__name__)

# An eager run before a capture compiles the kernels and settles the libraries' lazy state
# (workspaces, plans) outside the graph. Only a shape's first capture needs one (warmup_shape): its
# other batch sizes, widths and token counts launch the same compiled kernels (no kernel specializes
# on the batch size; widths and tokens within a compile class), so they are captured straight away,
# which halves a first-use capture while serving (~0.5 s a graph on the H100, 17 graphs in a 70-s
# chat benchmark). Should a capture still fail, it is warmed up and redone.
SUFFIX = "suffix"  # graph keys ((SUFFIX, requests, tokens each), variant): suffixes; (batch size, variant): decode
SUFFIX_COMPILE_TOKENS = (GRAPH_TOKENS[0], GRAPH_TOKENS[-1])  # each compile_tokens class
# A decode batch replaying a larger graph than its bucket's runs padding rows; the sparse kernels
# skip them (kernels/padding_rows.py) but not for free: on the H100 (8B, 16K documents) 48 padding
# rows made a step of 16 1.9 ms slower, ~0.04 ms a row, where capturing a graph while serving costs
# ~0.1 s with every request waiting (a chat's batch grew through eight sizes of one chunk width and
# shrank through ten of another: 18 captures, 1.6 s). So a lazily captured variant pads until the
# padding has cost what a capture does (~2500 rows), then captures the bucket: ski rental, never
# worse than twice the better choice in hindsight.
PAD_ROWS_BEFORE_CAPTURE = 2500
# The same rule for suffix steps, whose padding would be whole prompt chunks through every GEMM: a
# step of more suffixes than any captured graph of its shape holds replays the largest captured one
# once per group of its requests, until those extra replays (~25-40 ms each at 16K on the H100)
# have cost about what the capture does (0.2-0.35 s, with every request waiting: a capture's end
# waits for the device to drain: measured, docs/design.md). The chat's first-turn phase met two
# or four turns at once a few times and captured a graph for each count.
EXTRA_SUFFIX_REPLAYS_BEFORE_CAPTURE = 8


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, 12, 16, then every 8 up to max_bs (SGLang's spacing), and max_bs itself."""
    sizes = [s for s in (1, 2, 4, 8, 12) if s < max_bs] + list(range(16, max_bs, 8))
    return sizes + [max_bs]


def pool_bytes(snapshot: list[dict], pool) -> int:
    """Bytes of the segments torch's allocator holds for one private pool (a graph pool handle),
    from torch.cuda.memory_snapshot()."""
    return sum(seg["total_size"] for seg in snapshot if tuple(seg.get("segment_pool_id", ())) == tuple(pool))


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, table: ReqToTokenPool,
                 next_input: torch.Tensor, vocab_size: int, context_length: int, max_bs: int, capture: bool,
                 only_for: list[StepItem] | None = None):
        """model and backend run the steps; table and next_input are the model runner's request rows
        and last sampled tokens. only_for: capture just the graph this decode batch replays with (a
        benchmark's fixed batch), not every batch size and variant."""
        self.model, self.backend, self.table, self.next_input = model, backend, table, next_input
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = max_bs
        self.capture = capture
        self.device = dev = next_input.device
        tokens = max(max_bs, GRAPH_REQUESTS[-1] * GRAPH_TOKENS[-1])
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.out_cache_loc = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.q_indptr = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.suffix_q_indptr = torch.zeros(GRAPH_REQUESTS[-1] + 1, dtype=torch.int32, device=dev)
        self.suffix_logit_rows = torch.zeros(GRAPH_REQUESTS[-1], dtype=torch.long, device=dev)  # each suffix's last
        self.logits = torch.zeros(max(max_bs, GRAPH_REQUESTS[-1]), vocab_size, dtype=torch.float32, device=dev)
        backend.init_graph_state(max_bs, max_bs * context_length, table)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph | None] = {}  # None: run eagerly over the buffers (capture=False)
        self.replays = 0
        self.replays_by_variant: Counter[str] = Counter()
        self.capture_seconds = 0.0
        self.capture_log: list[tuple[str, float]] = []  # (graph key, seconds) of each capture, in order
        self._pool = self._stream = None  # one memory pool and capture stream for every graph
        self._warmed: set = set()  # the shapes (warmup_shape) warmed up before a capture
        self._extra_padding: Counter[tuple] = Counter()  # per uncaptured graph key: padding rows run instead
        self._extra_suffix_replays: Counter[tuple] = Counter()  # per uncaptured suffix key: replays run instead
        keys = (self._keys_for(only_for) if only_for else
                [(bs, v) for bs in reversed(self.batch_sizes) for v in backend.startup_graph_variants()])
        if capture:
            self._capture(keys)
            if not only_for:
                self._compile(self._compile_keys())
            logger.info("CUDA graph memory: %.2f GiB", self.graph_bytes() / 2**30)
        else:
            self.graphs.update(dict.fromkeys(keys))  # what a GPU captures at startup, run eagerly here

    def warmup_shape(self, key: tuple):
        """What decides which kernels a graph's step compiles: its variant's compile variant, and
        for a suffix step also its tokens' compile class; not the batch size. On the H100 a
        chat's first question over a 17K document waited 0.48 s for its graph, half of it the
        warmup of a width whose kernels startup had compiled at another of its class."""
        size, variant = key
        kernels = self.backend.compile_variant(variant)
        return (compile_tokens(size[2]), kernels) if isinstance(size, tuple) else kernels

    def bucket(self, batch_size: int) -> int | None:
        """The captured size a batch is padded to (None: too large for the graphs)."""
        return next((s for s in self.batch_sizes if s >= batch_size), None)

    def run(self, items: list[StepItem]) -> torch.Tensor | None:
        """Logits [len(items), vocab] of a decode batch (a view, overwritten by the next replay),
        or None when no captured graph fits it (the caller runs it eagerly)."""
        bs = self.bucket(len(items))
        if bs is None:
            return None
        batch = self._padded_batch(items, bs)
        variant = self.backend.graph_variant(batch)
        if variant is NO_GRAPH:
            return None
        size = self._replay_size(len(items), bs, variant)
        if size != bs:
            batch = self._padded_batch(items, size)
        self._replay((size, variant), batch, self._write_inputs)
        return self.logits[:len(items)]

    def _replay_size(self, num: int, bs: int, variant) -> int:
        """The batch size a decode batch of num requests (bucket bs) replays: bs's graph when it
        has one (every size of the startup variants). A variant captured on first use (ShadowKV's
        chunk widths) is first captured at the largest size, which every batch of it can replay
        padded; bs is captured once its batches have run PAD_ROWS_BEFORE_CAPTURE padding rows
        more than bs's own graph would have."""
        if (bs, variant) in self.graphs:
            return bs
        held = min((size for size, v in self.graphs if v == variant and isinstance(size, int) and size >= num),
                   default=None)
        if held is None:
            return self.max_bs
        self._extra_padding[(bs, variant)] += held - bs
        return bs if self._extra_padding[(bs, variant)] > PAD_ROWS_BEFORE_CAPTURE else held

    def run_suffixes(self, items: list[StepItem]) -> torch.Tensor | None:
        """Logits [len(items), vocab] of a step of prompt chunks only, if the backend can run it
        from a graph (short suffixes over compressed prefixes), else None: the graph of its
        request count, or a smaller one's once per group of its requests (_suffix_group)."""
        num = next((n for n in GRAPH_REQUESTS if n >= len(items)), None)
        tokens = next((t for t in GRAPH_TOKENS if t >= max(it.num_new for it in items)), None)
        if num is None or tokens is None or any(it.is_decode for it in items):
            return None
        batch = self._suffix_batch(items, num, tokens)
        variant = self.backend.suffix_graph_variant(batch)
        if variant is NO_GRAPH:
            return None
        group = self._suffix_group(num, tokens, variant, len(items))
        if group == num:
            self._replay(((SUFFIX, num, tokens), variant), batch, lambda b: self._write_suffix_inputs(b, items))
            return self.logits[:len(items)]
        parts = []
        for first in range(0, len(items), group):
            members = items[first:first + group]
            self._replay(((SUFFIX, group, tokens), variant), self._suffix_batch(members, group, tokens),
                         lambda b, members=members: self._write_suffix_inputs(b, members))
            parts.append(self.logits[:len(members)].clone())  # the next replay overwrites the buffer
        return torch.cat(parts)

    def _suffix_group(self, num: int, tokens: int, variant, count: int) -> int:
        """The requests per replay for a suffix step of `count` requests (bucket num): num once its
        graph exists, or when no smaller one of the shape does (captured now); else the largest
        captured smaller count, replayed once per group, until those extra replays pass
        EXTRA_SUFFIX_REPLAYS_BEFORE_CAPTURE (ski rental, as for padded decode batches)."""
        key = ((SUFFIX, num, tokens), variant)
        held = max((n for n in GRAPH_REQUESTS if n < num and ((SUFFIX, n, tokens), variant) in self.graphs),
                   default=None)
        if key in self.graphs or held is None:
            return num
        self._extra_suffix_replays[key] += -(-count // held) - 1
        return num if self._extra_suffix_replays[key] > EXTRA_SUFFIX_REPLAYS_BEFORE_CAPTURE else held

    def _replay(self, key: tuple, batch: ForwardBatch, write_inputs) -> None:
        """Write the step's inputs and replay its graph (captured now if it is the first step of
        its shape); without capture, run the model eagerly over the same buffers."""
        backend, variant = self.backend, key[1]
        write_inputs(batch)
        backend.begin_graph_step(batch, variant)
        if self.capture:
            graph = self.graphs.get(key)
            if graph is None:  # a variant captured on first use (the backend keeps startup short)
                self._capture([key])
                graph = self.graphs[key]
                write_inputs(batch)
                backend.begin_graph_step(batch, variant)
            graph.replay()
        else:
            self.graphs[key] = None  # the shape ran over the fixed buffers (what a capture would hold)
            self._forward(batch, key)
        self.replays += 1
        self.replays_by_variant[str(variant)] += 1

    def _padded_batch(self, items: list[StepItem], bs: int) -> ForwardBatch:
        pad = bs - len(items)
        row = self.table.padding_row
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], out_cache_loc=self.out_cache_loc[:bs],
            q_indptr=self.q_indptr[:bs + 1], kv_indptr=None, kv_indices=None,
            extend_lens=[1] * bs, seq_lens=[it.seq_len for it in items] + [1] * pad,
            pool_rows=[it.pool_row for it in items] + [row] * pad,
            shadowkv=[it.shadowkv for it in items] + [None] * pad)

    def _suffix_batch(self, items: list[StepItem], num: int, tokens: int) -> ForwardBatch:
        """num requests of `tokens` rows each: the items' prompt chunks, each followed by padding
        rows, then all-padding requests (a capture's stand-in has no items). Padding rows sit on
        the table's padding row (slot 0)."""
        pad = num - len(items)
        rows = num * tokens
        return ForwardBatch(
            input_ids=self.input_ids[:rows], positions=self.positions[:rows], out_cache_loc=self.out_cache_loc[:rows],
            q_indptr=self.suffix_q_indptr[:num + 1], kv_indptr=None, kv_indices=None,
            extend_lens=[it.num_new for it in items] + [0] * pad, seq_lens=[it.seq_len for it in items] + [0] * pad,
            pool_rows=[it.pool_row for it in items] + [self.table.padding_row] * pad,
            shadowkv=[it.shadowkv for it in items] + [None] * pad)

    def _write_suffix_inputs(self, batch: ForwardBatch, items: list[StepItem]) -> None:
        num, rows = batch.batch_size, len(batch.input_ids)
        tokens = rows // num
        ids, positions = torch.zeros(num, tokens, dtype=torch.long), torch.zeros(num, tokens, dtype=torch.long)
        for i, it in enumerate(items):
            ids[i, :it.num_new] = torch.tensor(it.token_ids)
            positions[i, :it.num_new] = torch.arange(it.start, it.seq_len)
        last = [i * tokens + it.num_new - 1 for i, it in enumerate(items)] + [i * tokens for i in range(len(items), num)]
        host = to_device(torch.cat([ids.flatten(), positions.flatten(), torch.tensor(last)]), self.device)
        self.input_ids[:rows].copy_(host[:rows])
        self.positions[:rows].copy_(host[rows:2 * rows])
        self.suffix_logit_rows[:num].copy_(host[2 * rows:])
        self.suffix_q_indptr[:num + 1].copy_(torch.arange(0, rows + 1, tokens, dtype=torch.int32, device=self.device))
        spans = []  # per request: its new tokens' slots, then its padding rows' (slot 0)
        for i in range(num):
            n = items[i].num_new if i < len(items) else 0
            if n:
                spans.append((items[i].pool_row, items[i].start, items[i].seq_len))
            spans.append((self.table.padding_row, 0, tokens - n))
        self.out_cache_loc[:rows].copy_(self.table.span_slots(*map(list, zip(*spans))))

    def _forward(self, batch: ForwardBatch, key: tuple) -> None:
        """The step's logits into the fixed buffer (a suffix step: each request's last real row,
        not its last padding row)."""
        rows = self.suffix_logit_rows[:batch.batch_size] if isinstance(key[0], tuple) else None
        with get_tp().graph_collectives():
            self.logits[:batch.batch_size].copy_(self.model(batch, self.backend, rows))

    def _write_inputs(self, batch: ForwardBatch) -> None:
        """Token ids (each request's last sampled token, already on the device), positions and the
        slots receiving the new K/V, into the fixed buffers."""
        bs = batch.batch_size
        rows_pos = to_device(torch.tensor([batch.pool_rows, [n - 1 for n in batch.seq_lens]]), self.device)
        rows, positions = rows_pos
        self.positions[:bs].copy_(positions)
        torch.index_select(self.next_input, 0, rows, out=self.input_ids[:bs])
        self.out_cache_loc[:bs].copy_(self.table.table[rows, positions])

    def _keys_for(self, items: list[StepItem]) -> list[tuple]:
        bs = self.bucket(len(items))
        return [(bs, self.backend.graph_variant(self._padded_batch(items, bs)))]

    def _capture(self, keys: list[tuple]) -> None:
        """Capture each (batch size, variant), largest first, in one memory pool: only one graph
        runs at a time, so their intermediate tensors can share memory. Their memory is that
        pool's segments (what reserved memory gained would also count the warmups' cached blocks
        and lose what others freed meanwhile), counted when asked (stats)."""
        backend, dev = self.backend, self.device
        start = time.perf_counter()
        for key in keys:
            began = time.perf_counter()
            batch = self._stand_in(*key)
            backend.begin_graph_step(batch, key[1])
            shape, graph = self.warmup_shape(key), None
            if shape in self._warmed:
                try:
                    graph = self._record(batch, key, warm_up=False)
                except RuntimeError as err:  # something lazy the warmup would have settled
                    logger.warning("capturing %s without a warmup failed (%s); warming it up", key, err)
                    torch.cuda.synchronize(dev)
                    backend.begin_graph_step(batch, key[1])
            if graph is None:
                graph = self._record(batch, key, warm_up=True)
                self._warmed.add(shape)
            self.graphs[key] = graph
            self.capture_log.append((str(key), round(time.perf_counter() - began, 3)))
        seconds = time.perf_counter() - start
        self.capture_seconds += seconds
        logger.info("captured %d CUDA graph(s) (%s) in %.2f s; %d in all, %.1f s",
                    len(keys), keys if len(keys) == 1 else f"batch sizes {self.batch_sizes}", seconds,
                    len(self.graphs), self.capture_seconds)

    def _compile_keys(self) -> list[tuple]:
        """The backend's compile variants (decode and suffix) at the smallest and largest batch,
        suffixes at each query block of the sparse attention (16 tokens, and whole tiles)."""
        decode_sizes = sorted({self.batch_sizes[0], self.batch_sizes[-1]})
        suffix_sizes = [(SUFFIX, n, t) for t in SUFFIX_COMPILE_TOKENS
                        for n in sorted({GRAPH_REQUESTS[0], GRAPH_REQUESTS[-1]})]
        return ([(size, v) for v in self.backend.compile_graph_variants() for size in decode_sizes]
                + [(size, v) for v in self.backend.compile_suffix_variants() for size in suffix_sizes])

    def _compile(self, keys: list[tuple]) -> None:
        """Run each key's step once eagerly (see the backend's compile_graph_variants; kernels
        split their work differently for a few requests than for many, and are compiled for
        each): they compile now, not while requests wait. Shapes already warmed up are skipped."""
        start = time.perf_counter()
        warmed = set(self._warmed)
        for key in keys:
            if self.warmup_shape(key) in warmed:
                continue
            batch = self._stand_in(*key)
            self.backend.begin_graph_step(batch, key[1])
            self._forward(batch, key)
            self._warmed.add(self.warmup_shape(key))
        torch.cuda.synchronize(self.device)
        if keys:
            logger.info("compiled the kernels of %d graph shape(s) in %.1f s",
                        len({self.warmup_shape(k) for k in keys}),
                        time.perf_counter() - start)

    def _record(self, batch: ForwardBatch, key: tuple, warm_up: bool) -> torch.cuda.CUDAGraph:
        """One graph of the model over `batch` (its inputs and metadata written), on the capture
        stream and into the shared pool; after an eager run first with warm_up.

        Not through torch.cuda.graph: that waits for the device, empties the allocator's caches
        (device and pinned host) and may collect garbage before every capture. A capture while
        serving then stalled the GPU too (the step launched before it, under overlap scheduling,
        had to finish first) and the steps after it paid for fresh cudaMalloc and cudaHostAlloc
        calls. Recording does not run the work queued before it, so nothing needs to wait."""
        dev = self.device
        if self._pool is None:
            self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(dev)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(dev))
        if warm_up:
            with torch.cuda.stream(stream):
                self._forward(batch, key)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # under tensor parallelism NCCL's watchdog thread queries events while a graph records
        mode = "thread_local" if get_tp().size > 1 else "global"
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self._pool, capture_error_mode=mode)
            try:
                self._forward(batch, key)
            finally:
                graph.capture_end()
        return graph

    def _stand_in(self, size, variant) -> ForwardBatch:
        """A batch of only padding for capturing the graph (size, variant), its inputs written."""
        if isinstance(size, tuple):  # (SUFFIX, requests, tokens)
            batch = self._suffix_batch([], size[1], size[2])
            self._write_suffix_inputs(batch, [])
        else:
            batch = self._padded_batch([], size)
            self._write_inputs(batch)
        return batch

    def graph_bytes(self) -> int:
        """Bytes the graphs' memory pool holds."""
        return pool_bytes(torch.cuda.memory_snapshot(), self._pool) if self._pool is not None else 0

    def stats(self) -> dict:
        return {"batch_sizes": self.batch_sizes, "graphs": len(self.graphs), "captured": self.capture,
                "capture_seconds": round(self.capture_seconds, 2), "graph_bytes": self.graph_bytes(),
                "replays": self.replays, "replays_by_variant": dict(self.replays_by_variant),
                "capture_log": self.capture_log}

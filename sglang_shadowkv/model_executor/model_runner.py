"""Owns the model, the KV pool and the attention backend; turns a scheduled step into logits."""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from sglang_shadowkv.distributed.parallel_state import get_tp
from sglang_shadowkv.layers.attention import ForwardBatch, create_attention_backend
from sglang_shadowkv.layers.attention.flashinfer_backend import HEAD_DIMS as FLASHINFER_HEAD_DIMS
from sglang_shadowkv.layers.attention.eviction_backend import (
    EVICTION_POLICIES, EvictionAttentionBackend, make_eviction_policy)
from sglang_shadowkv.layers.attention.shadowkv_backend import ShadowKVAttentionBackend
from sglang_shadowkv.mem_cache.host_kv_pool import HostKVPool
from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool, ReqToTokenPool, to_device
from sglang_shadowkv.mem_cache.compressed_layout import host_bytes_per_chunk
from sglang_shadowkv.mem_cache.compressed_pool import ShadowKVPool
from sglang_shadowkv.mem_cache.memory_plan import (HOST_RESERVE_BYTES, MemoryPlan, available_host_bytes, free_gpu_bytes,
                                                   host_tier_bytes, plan_gpu_memory)
from sglang_shadowkv.models.loader import LoadedModel, load_model
from sglang_shadowkv.server_args import ServerArgs
from sglang_shadowkv.shadowkv.decode import SparseDecoder

from .cuda_graph_runner import CudaGraphRunner
from .forward_batch import StepItem, build_forward_batch

logger = logging.getLogger(__name__)

CPU_POOL_TOKENS_PER_CONTEXT = 4  # a CPU's pools: this many full context windows (dense, and host values)
MAX_SEGMENTS = 4096  # compressed segments at once (their bases and tables are small; their pages come from the pool)


def resolve_device(args: ServerArgs, tp_rank: int = 0) -> torch.device:
    """--device (default: cuda if there is one); a tensor-parallel rank takes the GPU of its number."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and args.tp_size > 1:
        if args.tp_size > torch.cuda.device_count():
            raise ValueError(f"tp_size {args.tp_size} needs {args.tp_size} GPUs; this machine has "
                             f"{torch.cuda.device_count()}")
        return torch.device("cuda", tp_rank)
    return device


def resolve_dtype(args: ServerArgs, device: torch.device) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, args.dtype)


def default_backend(device: torch.device, head_dim: int) -> str:
    """torch on a CPU; on a GPU FlashInfer where it is installed and takes the model's head dim,
    else the Triton kernels (any head dim)."""
    if device.type != "cuda":
        return "torch"
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return "triton"
    return "flashinfer" if head_dim in FLASHINFER_HEAD_DIMS else "triton"


def default_chunked_prefill_size(device: torch.device) -> int:
    """SGLang's default for the device: larger chunks on larger GPUs (fewer steps per long prompt,
    each one's fixed cost spread over more tokens); 2048 on a CPU."""
    if device.type != "cuda":
        return 2048
    gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    return 2048 if gib < 20 else 4096 if gib < 60 else 8192


class ModelRunner:
    def __init__(self, args: ServerArgs, loaded: LoadedModel | None = None):
        """loaded: a model already in memory (benchmarks build several runners over one model).
        Under tensor parallelism (distributed/parallel_state.py, joined before this) the runner
        holds this rank's share: its heads' KV pool, ShadowKV state and host values."""
        self.tp = get_tp()
        self.device = resolve_device(args, self.tp.rank)
        self.dtype = resolve_dtype(args, self.device)
        start = time.perf_counter()
        self.loaded = loaded or load_model(args.model_path, self.dtype, self.device, args.context_length,
                                           args.tokenizer_path)
        logger.info("model %s ready in %.1f s", args.model_path or "(embedded)", time.perf_counter() - start)
        self.config = cfg = self.loaded.config.for_ranks(self.tp.size)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.context_length = cfg.context_length
        page_size = args.page_size
        self.shadowkv_config = args.shadowkv.resolve_storage(self.device.type == "cuda") \
            if args.attention == "shadowkv" else None
        self.memory_plan = self._plan_memory(args)
        tokens = args.max_total_tokens or self.memory_plan.pool_tokens
        num_pages = max(2, tokens // page_size + 1)
        self.pool = PagedKVPool(num_pages, page_size, cfg.num_layers, cfg.num_kv_heads,
                                cfg.head_dim, self.dtype, self.device)
        self.compressed_pool = self.decoder = None
        if self.shadowkv_config is not None:
            self._build_shadowkv(args.max_running_requests)
        self.host_pool = self._build_host_tier(args) if args.enable_hierarchical_cache else None
        self.req_to_token = ReqToTokenPool(args.max_running_requests, self.context_length, self.device)
        # each request's last sampled token (by request-to-token row): its next decode step's input
        self.next_input = torch.zeros(args.max_running_requests + 1, dtype=torch.long, device=self.device)
        if args.attention in EVICTION_POLICIES:  # per-head masks: only the torch reference path takes them
            self.backend_name = "torch"
            self.backend = EvictionAttentionBackend(self.pool, cfg.num_heads, cfg.head_dim,
                                                    make_eviction_policy(args))
        else:
            self.backend_name = args.attention_backend or default_backend(self.device, cfg.head_dim)
            self.backend = create_attention_backend(self.backend_name, self.pool, cfg.num_heads, cfg.head_dim)
        if self.shadowkv_config is not None:
            self.backend = ShadowKVAttentionBackend(self.backend, self.compressed_pool, self.shadowkv_config,
                                                    self.model.rotary, self.req_to_token, self.decoder)
        logger.info("KV pool: %d pages of %d tokens (%.1f MiB), backend %s", num_pages, page_size,
                    num_pages * page_size * self.pool.bytes_per_token / 2**20, self.backend_name)
        self.graphs: CudaGraphRunner | None = None
        self.eager_steps = 0
        # a mixed step's graph parts replay here, beside its eager part (_forward_parts); high
        # priority, so their chains of small kernels take SMs as the prompt chunk's kernels free them
        self.parts_stream = (torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda"
                             and self.shadowkv_config is not None and not args.disable_mixed_step_overlap else None)
        if self.device.type == "cuda" and not args.disable_cuda_graph:
            self.init_graphs(args.cuda_graph_max_bs or args.max_running_requests, capture=True)

    @property
    def weight_bytes(self) -> int:
        """Bytes of this rank's weights (what each decode step reads, whatever its rows)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def _plan_memory(self, args: ServerArgs) -> MemoryPlan:
        """The pool's size: on a GPU from the free memory (mem_cache/memory_plan.py), on a CPU a few
        context windows. With ShadowKV each page also pays for its small metadata; the chunk-cache
        scratch takes pool pages while requests run (shadowkv/decode.py)."""
        cfg, skv = self.config, self.shadowkv_config
        bytes_per_token = 2 * cfg.num_layers * cfg.kv_dim * _size(self.dtype)
        host_per_chunk = 0 if skv is None else host_bytes_per_chunk(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, skv.chunk_size, skv.host_value_torch_dtype or self.dtype)
        if self.device.type != "cuda":
            tokens = CPU_POOL_TOKENS_PER_CONTEXT * self.context_length
            host_chunks = 0 if skv is None else (skv.host_tokens or tokens) // skv.chunk_size
            # sized in chunks as the values are: their fractions' ratio of the values' chunks
            copies = 0 if skv is None else int(host_chunks * skv.copy_fraction / skv.host_mem_fraction)
            return MemoryPlan(tokens, host_chunks, copy_chunks=copies)
        gpu_budget = int(free_gpu_bytes(self.device) * args.mem_fraction_static)
        if skv is None:
            return self._same_on_every_rank(plan_gpu_memory(gpu_budget, bytes_per_token, 0))
        # the ranks of one host share its memory: each takes its share
        host_budget = (skv.host_tokens // skv.chunk_size * host_per_chunk if skv.host_tokens
                       else int(available_host_bytes() * skv.host_mem_fraction / self.tp.size))
        # per page: each layer's outlier-block positions; per chunk slot (at most 64 a page) three int32s
        metadata = (4 * cfg.num_kv_heads * cfg.num_layers + 12 * 64) // skv.chunk_size + 1
        plan = plan_gpu_memory(gpu_budget, bytes_per_token, metadata, host_budget, host_per_chunk)
        # an exact copy: each chunk's keys, and its values where the host pool rounds them (int8)
        copy_per_chunk = host_bytes_per_chunk(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, skv.chunk_size,
                                              self.dtype) * (1 if skv.host_value_torch_dtype is None else 2)
        plan.copy_chunks = int(available_host_bytes() * skv.copy_fraction / self.tp.size) // copy_per_chunk
        plan = self._same_on_every_rank(plan)
        logger.info("memory: %d pool tokens (dense, compressed or chunk-cache scratch, %.1f GiB), "
                    "%.1f GiB page-locked host for %d compressed chunks, %.1f GiB for exact copies of %d",
                    plan.pool_tokens, plan.pool_tokens * bytes_per_token / 2**30,
                    plan.host_chunks * host_per_chunk / 2**30, plan.host_chunks,
                    plan.copy_chunks * copy_per_chunk / 2**30, plan.copy_chunks)
        return plan

    def _same_on_every_rank(self, plan: MemoryPlan) -> MemoryPlan:
        """The plan every rank can hold (the least over ranks): the pools must be of one size on
        all ranks, or their caches, evictions and demotions would part."""
        plan.pool_tokens, plan.host_chunks, plan.copy_chunks = self.tp.min_over_ranks(
            plan.pool_tokens, plan.host_chunks, plan.copy_chunks)
        return plan

    def _build_host_tier(self, args: ServerArgs) -> HostKVPool:
        """--enable-hierarchical-cache: --hicache-size GB, else --hicache-ratio times the GPU pool,
        at most this rank's share of the host memory still available (after ShadowKV's host
        values) less a reserve (memory_plan.host_tier_bytes)."""
        page_bytes = self.pool.bytes_per_token * self.pool.page_size
        want = args.hicache_size * 2**30 // page_bytes if args.hicache_size else int(args.hicache_ratio * self.pool.capacity)
        can = host_tier_bytes(self.tp.size) // page_bytes
        pages = self.tp.min_over_ranks(min(want, can))[0]
        if pages < 1:
            raise ValueError(f"--enable-hierarchical-cache: the host has no memory for the host tier "
                             f"({available_host_bytes() / 2**30:.1f} GiB available, "
                             f"{HOST_RESERVE_BYTES / 2**30:.0f} GiB kept for the server's processes); "
                             "free host memory, or serve without the tier")
        if pages < want:
            logger.warning("host tier: %d pages asked for, %d fit the host memory available", want, pages)
        host = HostKVPool(self.pool, pages, args.hicache_write_policy)
        logger.info("host tier: %d pages (%.1f GiB), %s", pages, pages * page_bytes / 2**30, args.hicache_write_policy)
        return host

    def _build_shadowkv(self, max_running_requests: int) -> None:
        cfg, skv = self.config, self.shadowkv_config
        start = time.perf_counter()
        self.compressed_pool = ShadowKVPool(self.pool, skv.max_rank(cfg.kv_dim), self.memory_plan.host_chunks,
                                            MAX_SEGMENTS, skv.host_value_torch_dtype, skv.landmark_torch_dtype,
                                            self.memory_plan.copy_chunks)
        self.decoder = SparseDecoder(self.compressed_pool, skv, self.model.rotary,
                                     skv.max_requests or max_running_requests,
                                     self.context_length // skv.chunk_size, self.device.type == "cuda")
        logger.info("ShadowKV: %s; %s; %d chunk slots per page; up to %d requests decode compressed, each "
                    "taking %d pages of chunk-cache scratch while it runs (pools built, host memory page-locked, "
                    "in %.1f s)", skv.describe_rank(cfg.kv_dim), skv.describe_budget(),
                    self.compressed_pool.layout.slots_per_page, self.decoder.max_rows, self.decoder.row_pages,
                    time.perf_counter() - start)

    def init_graphs(self, max_bs: int, capture: bool, only_for: list[StepItem] | None = None) -> None:
        """Decode steps of up to max_bs requests from fixed buffers: captured as CUDA graphs
        (capture=True, a GPU), or run eagerly over the same buffers (tests on a CPU)."""
        if not self.backend.supports_graphs:
            logger.info("attention %s runs eagerly: no decode graphs", type(self.backend).__name__)
            return
        if capture and not self.backend.capturable:
            logger.info("attention backend %s cannot be captured: decode steps run eagerly", self.backend_name)
            return
        self.graphs = CudaGraphRunner(self.model, self.backend, self.req_to_token, self.next_input,
                                        self.config.vocab_size, self.context_length,
                                        min(max_bs, self.req_to_token.padding_row), capture, only_for)

    def build_batch(self, items: list[StepItem]) -> ForwardBatch:
        return build_forward_batch(items, self.req_to_token, self.next_input, self.device)

    def forward(self, items: list[StepItem], logit_rows: list[int] | None = None) -> torch.Tensor:
        """Run one step; logits [len(items), vocab] of each item's last token, or of the given
        rows of the flattened step (prompt logprobs). A decode batch, or a step of short suffixes
        over compressed prefixes only, that a captured graph holds replays it; a step mixing prompt
        chunks with those (ShadowKV) runs in parts (`_forward_parts`); anything else runs eagerly."""
        if self.graphs is not None and logit_rows is None:
            if all(it.is_decode for it in items):
                logits = self.graphs.run(items)
            elif not any(it.is_decode for it in items):
                logits = self.graphs.run_suffixes(items)
            else:
                logits = None
            if logits is None and self.backend.graph_parts(items):
                logits = self._forward_parts(items)
            if logits is not None:
                return logits
        return self._forward_eager(items, logit_rows)

    def _forward_parts(self, items: list[StepItem]) -> torch.Tensor | None:
        """A mixed step in up to three launches: its decodes from a decode graph and its prompt
        chunks over compressed prefixes from a suffix graph, one after the other on parts_stream
        (when there is one), while the rest runs eagerly on the step's stream (what a graph cannot
        hold joins the eager part). The two sides share no buffer: each writes only its own
        requests' KV slots, scratch rows and logits, and the graphs' FlashInfer decode has its own
        workspace. A decode graph is a chain of small kernels a layer that leaves most SMs idle
        (~25 ms for 20 rows at 16K on the H100), so beside a prompt chunk's GEMMs it costs a
        fraction of that. None when no part can replay a graph."""
        decodes = [i for i, it in enumerate(items) if it.is_decode]
        suffixes = [i for i, it in enumerate(items) if not it.is_decode and it.over_compressed_prefix]
        step_stream = torch.cuda.current_stream(self.device) if self.parts_stream is not None else None
        if step_stream is not None:
            self.parts_stream.wait_stream(step_stream)  # the step's inputs written before the graphs read them
        parts = []
        with contextlib.nullcontext() if step_stream is None else torch.cuda.stream(self.parts_stream):
            for rows, run in ((decodes, self.graphs.run), (suffixes, self.graphs.run_suffixes)):
                logits = run([items[i] for i in rows]) if rows else None
                if logits is not None:  # the graphs share one logits buffer: keep this part's before the next replay
                    parts.append((rows, logits.clone()))
        if not parts:
            return None
        taken = {i for rows, _ in parts for i in rows}
        eager = [i for i in range(len(items)) if i not in taken]
        if eager:
            parts.append((eager, self._forward_eager([items[i] for i in eager], None)))
        if step_stream is not None:
            step_stream.wait_stream(self.parts_stream)  # the step ends when both sides have
            for _, logits in parts:
                logits.record_stream(step_stream)  # made on parts_stream, read and freed on the step's
        out = torch.empty(len(items), parts[0][1].shape[1], dtype=parts[0][1].dtype, device=self.device)
        for rows, logits in parts:
            out[to_device(torch.tensor(rows), self.device)] = logits
        return out

    def _forward_eager(self, items: list[StepItem], logit_rows: list[int] | None) -> torch.Tensor:
        batch = self.build_batch(items)
        self.backend.begin_step(batch)
        self.eager_steps += 1
        rows = None if logit_rows is None else to_device(torch.tensor(logit_rows), self.device)
        return self.model(batch, self.backend, rows)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()

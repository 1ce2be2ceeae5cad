"""Owns the model, the KV pool and the attention backend; turns a scheduled step into logits."""

from __future__ import annotations

import logging

import torch

from sglang_shadowkv.layers.attention import ForwardBatch, create_attention_backend
from sglang_shadowkv.layers.attention.eviction_backend import (
    EVICTION_POLICIES, EvictionAttentionBackend, make_eviction_policy)
from sglang_shadowkv.layers.attention.shadowkv_backend import ShadowKVAttentionBackend
from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool, ReqToTokenPool
from sglang_shadowkv.mem_cache.memory_plan import (available_host_bytes, documents_that_fit, free_gpu_bytes,
                                                   plan_shadowkv_memory)
from sglang_shadowkv.mem_cache.compressed_pool import ShadowKVPool
from sglang_shadowkv.models.loader import LoadedModel, load_model
from sglang_shadowkv.server_args import ServerArgs
from sglang_shadowkv.shadowkv.config import ShadowKVConfig
from sglang_shadowkv.shadowkv.decode import SparseDecoder

from .cuda_graph_runner import DecodeGraphRunner
from .forward_batch import StepItem, build_forward_batch

logger = logging.getLogger(__name__)

CPU_DEFAULT_POOL_TOKENS_PER_CONTEXT = 4  # CPU pool: this many full context windows
# segments live in the radix cache beyond their requests: several per running request, and one
# per SEGMENT_TOKENS of the pools' capacity (the documents the cache holds)
SEGMENTS_PER_REQUEST = 4
SEGMENT_TOKENS = 16384
CPU_HOST_TOKENS_PER_CONTEXT = 4  # ShadowKV pools on a CPU: this many full context windows


def resolve_device(args: ServerArgs) -> torch.device:
    if args.device:
        return torch.device(args.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(args: ServerArgs, device: torch.device) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, args.dtype)


def default_backend(device: torch.device) -> str:
    if device.type != "cuda":
        return "torch"
    try:
        import flashinfer  # noqa: F401
        return "flashinfer"
    except ImportError:
        return "triton"


class ModelRunner:
    def __init__(self, args: ServerArgs, loaded: LoadedModel | None = None):
        """loaded: a model already in memory (benchmarks build several runners over one model)."""
        self.device = resolve_device(args)
        self.dtype = resolve_dtype(args, self.device)
        self.loaded = loaded or load_model(args.model_path, self.dtype, self.device, args.context_length,
                                           args.tokenizer_path)
        self.config = cfg = self.loaded.config
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.context_length = cfg.context_length
        page_size = args.page_size
        self.shadowkv_config = self.compressed_pool = self.decoder = None
        bytes_per_token = 2 * cfg.num_layers * cfg.kv_dim * torch.empty((), dtype=self.dtype).element_size()
        self.dense_pool_tokens = None  # the dense pool ShadowKV's memory plan leaves (GPU)
        self.memory_plan: dict | None = None  # ShadowKV's split of GPU and host memory (GPU)
        if args.attention == "shadowkv":  # before the dense pool, which takes what memory is left
            self._build_shadowkv(args, bytes_per_token)
        tokens = args.max_total_tokens or self.dense_pool_tokens or self._default_pool_tokens(args, bytes_per_token)
        num_pages = max(2, tokens // page_size + 1)
        self.pool = PagedKVPool(num_pages, page_size, cfg.num_layers, cfg.num_kv_heads,
                                cfg.head_dim, self.dtype, self.device)
        self.req_to_token = ReqToTokenPool(args.max_running_requests, self.context_length, self.device)
        # each request's last sampled token (by request-to-token row): its next decode step's input
        self.next_input = torch.zeros(args.max_running_requests + 1, dtype=torch.long, device=self.device)
        if args.attention in EVICTION_POLICIES:  # per-head masks: only the torch reference path takes them
            self.backend_name = "torch"
            self.backend = EvictionAttentionBackend(self.pool, cfg.num_heads, cfg.head_dim,
                                                    make_eviction_policy(args))
        else:
            self.backend_name = args.attention_backend or default_backend(self.device)
            self.backend = create_attention_backend(self.backend_name, self.pool, cfg.num_heads, cfg.head_dim)
        if self.shadowkv_config is not None:
            self.backend = ShadowKVAttentionBackend(self.backend, self.compressed_pool, self.shadowkv_config,
                                                    self.model.rotary, self.req_to_token, self.decoder)
        logger.info("KV pool: %d pages of %d tokens (%.1f MiB), backend %s", num_pages, page_size,
                    num_pages * page_size * bytes_per_token / 2**20, self.backend_name)
        self.graphs: DecodeGraphRunner | None = None
        self.eager_steps = 0
        if self.device.type == "cuda" and not args.disable_cuda_graph:
            self.init_decode_graphs(args.cuda_graph_max_bs or args.max_running_requests, capture=True)

    def _build_shadowkv(self, args: ServerArgs, dense_bytes_per_token: int) -> None:
        cfg = self.config
        skv = args.shadowkv.resolve_storage(self.device.type == "cuda")
        self.shadowkv_config = skv
        host_tokens = skv.host_tokens
        if host_tokens is None:
            host_tokens = (self._plan_shadowkv_memory(args, skv, dense_bytes_per_token)
                           if self.device.type == "cuda" else CPU_HOST_TOKENS_PER_CONTEXT * self.context_length)
        segments = max(SEGMENTS_PER_REQUEST * skv.max_requests, host_tokens // SEGMENT_TOKENS)
        self.compressed_pool = ShadowKVPool(
            num_chunk_slots=host_tokens // skv.chunk_size, max_segments=segments,
            max_outliers=skv.outliers, chunk_size=skv.chunk_size, num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_rank=skv.max_rank(cfg.kv_dim),
            dtype=self.dtype, device=self.device, value_dtype=skv.host_value_torch_dtype,
            landmark_dtype=skv.landmark_torch_dtype)
        self.decoder = SparseDecoder(self.compressed_pool, skv, self.model.rotary, skv.max_requests,
                                     self.context_length // skv.chunk_size, self.device.type == "cuda")
        logger.info("ShadowKV: %s; %s", skv.describe_rank(cfg.kv_dim), skv.describe_budget())

    def _plan_shadowkv_memory(self, args: ServerArgs, skv: ShadowKVConfig, dense_bytes_per_token: int) -> int:
        """Compressed-pool tokens from the GPU and host budgets (mem_cache/memory_plan.py); sets
        the dense pool's size; logs what fits."""
        cfg = self.config
        unit = ShadowKVPool.bytes_per_unit(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, skv.chunk_size,
                                           skv.max_rank(cfg.kv_dim), skv.outliers, self.dtype,
                                           skv.host_value_torch_dtype, skv.landmark_torch_dtype)
        per_slot = unit["gpu_per_slot"] + unit["gpu_per_segment"] * skv.chunk_size // SEGMENT_TOKENS
        max_entries = skv.budget_chunks(self.context_length // skv.chunk_size)
        scratch = (2 * cfg.num_layers * (skv.max_requests + 1) * max_entries * skv.chunk_size * cfg.kv_dim
                   * torch.empty((), dtype=self.dtype).element_size())
        gpu_budget = int(free_gpu_bytes(self.device) * args.mem_fraction_static)
        host_available = available_host_bytes()
        host_budget = int(host_available * skv.host_mem_fraction)
        plan = plan_shadowkv_memory(gpu_budget, host_budget, dense_bytes_per_token, per_slot, unit["host_per_slot"],
                                    scratch, self.context_length, args.max_running_requests)
        if args.max_total_tokens is None:
            self.dense_pool_tokens = plan.dense_tokens
        tokens = plan.chunk_slots * skv.chunk_size
        self.memory_plan = {"gpu_budget_bytes": gpu_budget, "host_available_bytes": host_available,
                            "host_budget_bytes": host_budget, "dense_tokens": plan.dense_tokens,
                            "compressed_tokens": tokens, "limited_by": plan.limited_by}
        logger.info("ShadowKV memory: %d dense tokens, %d compressed tokens (%.1f GiB GPU, %.1f GiB page-locked "
                    "host; bound by the %s); documents that fit: %s", plan.dense_tokens, tokens,
                    plan.chunk_slots * per_slot / 2**30, plan.chunk_slots * unit["host_per_slot"] / 2**30,
                    plan.limited_by, documents_that_fit(plan.dense_tokens, tokens, tokens // SEGMENT_TOKENS))
        return tokens

    def _default_pool_tokens(self, args: ServerArgs, bytes_per_token: int) -> int:
        if self.device.type != "cuda":
            return CPU_DEFAULT_POOL_TOKENS_PER_CONTEXT * self.context_length
        free = free_gpu_bytes(self.device)
        return int(free * args.mem_fraction_static) // bytes_per_token

    def init_decode_graphs(self, max_bs: int, capture: bool, only_for: list[StepItem] | None = None) -> None:
        """Decode steps of up to max_bs requests from fixed buffers: captured as CUDA graphs
        (capture=True, a GPU), or run eagerly over the same buffers (tests on a CPU)."""
        if not self.backend.supports_graphs:
            logger.info("attention %s runs eagerly: no decode graphs", type(self.backend).__name__)
            return
        self.graphs = DecodeGraphRunner(self.model, self.backend, self.req_to_token, self.next_input,
                                        self.config.vocab_size, self.context_length,
                                        min(max_bs, self.req_to_token.padding_row), capture, only_for)

    def build_batch(self, items: list[StepItem]) -> ForwardBatch:
        return build_forward_batch(items, self.req_to_token, self.next_input, self.device)

    def forward(self, items: list[StepItem], logit_rows: list[int] | None = None) -> torch.Tensor:
        """Run one step; logits [len(items), vocab] of each item's last token, or of the given
        rows of the flattened step (prompt logprobs). A decode batch that a captured graph holds
        replays it; anything else runs eagerly."""
        if self.graphs is not None and logit_rows is None and all(it.is_decode for it in items):
            logits = self.graphs.run(items)
            if logits is not None:
                return logits
        batch = self.build_batch(items)
        self.backend.begin_step(batch)
        self.eager_steps += 1
        rows = None if logit_rows is None else torch.tensor(logit_rows, device=self.device)
        return self.model(batch, self.backend, rows)

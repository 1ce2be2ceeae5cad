"""Engine and server configuration: one dataclass, validated, with SGLang's flag names.

`Engine(**kwargs)` and `launch_server --flags` both build a ServerArgs, so a setting has one name
and one check wherever it is given.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from sglang_shadowkv.shadowkv.config import ShadowKVConfig

ATTENTION_MODES = ("full", "shadowkv", "streamingllm", "snapkv")
_SKV = ShadowKVConfig()  # the ShadowKV defaults live in one place
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ServerArgs:
    model_path: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    tokenizer_path: str | None = None
    served_model_name: str | None = None  # the model name of the OpenAI API; None: from model_path
    attention: str = "full"  # "full" (dense KV), "shadowkv", or a baseline: "streamingllm", "snapkv"
    attention_backend: str | None = None  # torch | triton | flashinfer; None: best for the device
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    context_length: int | None = None  # None: the model's own
    page_size: int = 8
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from mem_fraction_static
    mem_fraction_static: float = 0.85  # GPU: share of free memory after weights for the KV pool
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048  # most prompt tokens one step prefills
    disable_cuda_graph: bool = False  # GPU: run decode steps eagerly instead of replaying CUDA graphs
    cuda_graph_max_bs: int | None = None  # largest decode batch captured as a graph (None: max_running_requests)
    disable_overlap_schedule: bool = False  # wait for each step's tokens before scheduling the next
    skip_server_warmup: bool = False  # GPU: serve without first running one request of each kind
    random_seed: int = 0
    host: str = "127.0.0.1"
    port: int = 30000
    log_level: str = "warning"
    startup_timeout: float = 600.0  # seconds the server waits for the model to load
    show_progress: bool = False  # progress bar over a generate() call
    enable_metrics: bool = False  # server: Prometheus metrics at GET /metrics
    constrained_json_any_whitespace: bool = False  # JSON grammars: any whitespace (SGLang's) or compact
    # ShadowKV (used with attention="shadowkv"); meanings in shadowkv/config.py
    shadowkv_rank: int | None = _SKV.rank
    shadowkv_rank_energy: float = _SKV.rank_energy
    shadowkv_chunk_size: int = _SKV.chunk_size
    shadowkv_outliers: int = _SKV.outliers
    shadowkv_budget: str | float = _SKV.budget
    shadowkv_min_budget_chunks: int = _SKV.min_budget_chunks
    shadowkv_local_window: int = _SKV.local_window
    shadowkv_min_context: int = _SKV.min_context
    shadowkv_lowrank_method: str = _SKV.lowrank_method
    shadowkv_value_dtype: str = _SKV.value_dtype
    shadowkv_landmark_dtype: str = _SKV.landmark_dtype
    shadowkv_host_tokens: int | None = _SKV.host_tokens
    shadowkv_max_requests: int = _SKV.max_requests
    shadowkv_sparse_prefill_max: int = _SKV.sparse_prefill_max
    shadowkv_host_mem_fraction: float = 0.5  # GPU: share of the machine's available memory for host values
    shadowkv_rank_cap: int | None = _SKV.rank_cap
    shadowkv_top_p: float = _SKV.top_p
    shadowkv_max_budget: int = _SKV.max_budget
    # KV-eviction baselines (attention="streamingllm" or "snapkv"); see layers/attention/eviction_backend.py
    eviction_budget: int = 1024  # KV tokens kept per KV head
    streamingllm_sinks: int = 4  # first tokens StreamingLLM always keeps
    snapkv_window: int = 32  # prompt's last tokens whose queries choose what SnapKV keeps

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {self.attention!r}")
        if self.attention_backend not in (None, "torch", "triton", "flashinfer"):
            raise ValueError("attention_backend must be torch, triton or flashinfer, "
                             f"got {self.attention_backend!r}")
        if self.attention in ("streamingllm", "snapkv"):
            if self.attention_backend not in (None, "torch"):
                raise ValueError(f"attention={self.attention!r} runs on the torch backend (per-head "
                                 f"masks), got attention_backend={self.attention_backend!r}")
            _positive(self, "eviction_budget", "streamingllm_sinks", "snapkv_window")
            kept = "streamingllm_sinks" if self.attention == "streamingllm" else "snapkv_window"
            if self.eviction_budget <= getattr(self, kept):
                raise ValueError(f"eviction_budget ({self.eviction_budget}) must exceed {kept} "
                                 f"({getattr(self, kept)})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _positive(self, "page_size", "max_running_requests", "chunked_prefill_size")
        if self.cuda_graph_max_bs is not None:
            _positive(self, "cuda_graph_max_bs")
        if self.context_length is not None:
            _positive(self, "context_length")
        if self.max_total_tokens is not None:
            _positive(self, "max_total_tokens")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if not 0.0 < self.shadowkv_host_mem_fraction < 1.0:
            raise ValueError(f"shadowkv_host_mem_fraction must be in (0, 1), got {self.shadowkv_host_mem_fraction}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError(f"log_level must be debug, info, warning, error or critical, got {self.log_level!r}")
        if not self.startup_timeout > 0:
            raise ValueError(f"startup_timeout must be positive, got {self.startup_timeout}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        cfg = ShadowKVConfig.from_server_args(self)
        if self.page_size % cfg.chunk_size and cfg.chunk_size % self.page_size:
            raise ValueError(f"shadowkv_chunk_size ({cfg.chunk_size}) and page_size ({self.page_size}) "
                             "must divide one another")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "ServerArgs":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One --flag per field, named like SGLang's (model_path -> --model-path)."""
        helps = {
            "model_path": "HF model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)",
            "attention": "full: dense KV cache; shadowkv: compressed long-context KV cache; "
                         "streamingllm, snapkv: KV-eviction baselines (accuracy comparisons, torch backend)",
            "eviction_budget": "streamingllm/snapkv: KV tokens kept per KV head",
            "streamingllm_sinks": "streamingllm: first tokens always kept (attention sinks)",
            "snapkv_window": "snapkv: the prompt's last tokens whose attention picks what is kept",
            "attention_backend": "torch (reference), triton, flashinfer (default: best available)",
            "startup_timeout": "seconds to wait for the model to load before giving up",
            "served_model_name": "model name of the OpenAI API (default: the model file or folder name)",
            "log_level": "debug, info, warning or error",
            "enable_metrics": "serve Prometheus metrics at GET /metrics (SGLang's names: request "
                              "latencies, token counts, queue, pool usage; ShadowKV's compressed state)",
            "constrained_json_any_whitespace": "json_schema / response_format: allow any whitespace between "
                                               "JSON tokens (SGLang's default); by default JSON is compact (', ' and "
                                               "': ' separators), so a model cannot spend max_tokens on whitespace",
            "max_total_tokens": "KV pool size in tokens (default: from --mem-fraction-static)",
            "chunked_prefill_size": "most prompt tokens prefilled in one step",
            "disable_cuda_graph": "GPU: run decode steps eagerly (by default they replay CUDA graphs "
                                  "captured at startup per batch size)",
            "cuda_graph_max_bs": "largest decode batch captured as a CUDA graph; larger ones run eagerly "
                                 "(default: --max-running-requests)",
            "disable_overlap_schedule": "prepare each step only after the previous step's tokens are "
                                        "back (by default the CPU schedules step N+1 while the GPU runs step N)",
            "skip_server_warmup": "GPU: start serving without the warmup requests that compile every kernel "
                                  "first (otherwise the first user request pays for Triton/FlashInfer compilation)",
            "shadowkv_rank": "fixed low-rank key dims for every layer (default: chosen per layer by "
                             "--shadowkv-rank-energy)",
            "shadowkv_rank_energy": "per layer, the least rank keeping this share of the keys' singular-value "
                                    "energy (capped by --shadowkv-rank-cap)",
            "shadowkv_chunk_size": "tokens per chunk: one landmark, one unit of selection",
            "shadowkv_outliers": "chunks per KV head kept dense on the GPU",
            "shadowkv_budget": "chunks selected per step: auto (per step, layer and KV head, the fewest "
                               "chunks holding --shadowkv-top-p of the score mass) or a fixed fraction of the context",
            "shadowkv_min_budget_chunks": "floor of the selection budget in chunks",
            "shadowkv_local_window": "most recent prompt tokens kept dense",
            "shadowkv_min_context": "prompts shorter than this stay dense",
            "shadowkv_lowrank_method": "auto (eigh up to 256 key dims, else subspace), eigh or subspace "
                                       "(top eigenvectors of the Gram matrix) or svd (the paper's)",
            "shadowkv_value_dtype": "host values: auto (int8 on a GPU, the model dtype on a CPU), model, or int8 (a scale per chunk and KV "
                                    "head: half the host memory and PCIe traffic)",
            "shadowkv_landmark_dtype": "landmarks: auto (int8 on a GPU, the model dtype on a CPU), model, or int8 (a scale per chunk and KV "
                                       "head: half their GPU memory and the bytes scoring reads)",
            "shadowkv_host_tokens": "capacity of the compressed pools (host values) in tokens",
            "shadowkv_max_requests": "requests decoding from compressed state at once",
            "shadowkv_host_mem_fraction": "with shadowkv_host_tokens unset on a GPU: the share of the machine's "
                                          "available memory page-locked for compressed values",
            "shadowkv_sparse_prefill_max": "a prompt suffix over a cached compressed document up to this many "
                                           "tokens attends the chunks it selects (per 64 queries); a longer "
                                           "one attends every chunk, streamed; 0: always every chunk",
            "shadowkv_rank_cap": "most low-rank dims per layer, also the low-rank pool's width (default: "
                                 "160, scaled up with key dims past 1024)",
            "shadowkv_top_p": "budget auto: score mass the selected chunks must hold",
            "shadowkv_max_budget": "budget auto: most chunks selected per KV head and step",
        }
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            if f.type == "bool":
                parser.add_argument(flag, action="store_true", help=helps.get(f.name))
                continue
            kind = {"int": int, "float": float}.get(f.type.split(" ")[0], str)
            parser.add_argument(flag, type=kind, default=f.default,
                                help=f"{helps.get(f.name, '')} (default: %(default)s)".strip())

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def _positive(args: ServerArgs, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


__all__ = ["ServerArgs", "ATTENTION_MODES"]

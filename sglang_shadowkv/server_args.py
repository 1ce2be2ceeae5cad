"""Engine and server configuration: one dataclass, validated, with SGLang's flag names.

`Engine(**kwargs)` and `launch_server --flags` both build a ServerArgs, so a setting has one name,
one default, one help text and one check wherever it is given. ShadowKV's settings are one
`ShadowKVConfig` (shadowkv/config.py, where their defaults and help live), given flat as
`shadowkv_<name>` keywords and `--shadowkv-<name>` flags and built once here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from sglang_shadowkv.shadowkv.config import ShadowKVConfig

ATTENTION_MODES = ("full", "shadowkv", "streamingllm", "snapkv")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULE_POLICIES = ("hrrn", "fcfs")
WRITE_POLICIES = ("write_through", "write_back")  # --hicache-write-policy (mem_cache/host_kv_pool.py)
SHADOWKV_PREFIX = "shadowkv_"


def _field(default, help_text: str = ""):
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclass(init=False)
class ServerArgs:
    model_path: str | None = _field(None, "HF model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    tokenizer_path: str | None = _field(None, "tokenizer folder (default: the model's)")
    served_model_name: str | None = _field(None, "model name of the OpenAI API (default: the model file or folder name)")
    attention: str = _field("full", "full: dense KV cache; shadowkv: dense while the GPU holds it, compressed "
                            "(ShadowKV) when it does not; streamingllm, snapkv: KV-eviction baselines (accuracy "
                            "comparisons, torch backend)")
    attention_backend: str | None = _field(None, "torch (reference), triton, flashinfer (default: torch on a CPU; on a GPU "
                                                 "flashinfer where installed and it takes the model's head dim, 64, 128, 256 or 512; "
                                                 "else triton)")
    device: str | None = _field(None, "cuda or cpu (default: cuda if available)")
    tp_size: int = _field(1, "tensor parallelism: serve the model across this many GPUs of one host, one process "
                          "each (rank r on GPU r), its heads and MLP columns split between them; with ShadowKV each "
                          "rank compresses and decodes its own KV heads and keeps its own host values. On a CPU the "
                          "ranks are processes joined by gloo (tests)")
    dist_init_addr: str | None = _field(None, "host:port where the tensor-parallel ranks meet (default: a free port "
                                        "on 127.0.0.1)")
    watchdog_timeout: float = _field(300.0, "seconds a scheduler step may take before the server stops with an "
                                     "error naming the rank (a collective that never completes: a rank died or the "
                                     "ranks parted), as SGLang's --watchdog-timeout")
    dtype: str = _field("auto", "auto (bfloat16 on a GPU, float32 on a CPU), float32, bfloat16 or float16")
    context_length: int | None = _field(None, "most tokens per request (default: the model's)")
    page_size: int = _field(8, "tokens per KV page")
    max_total_tokens: int | None = _field(None, "KV pool size in tokens (default: from --mem-fraction-static)")
    mem_fraction_static: float = _field(0.85, "GPU: share of the free memory after the weights for the KV pools")
    max_running_requests: int = _field(64, "requests running at once; the rest wait")
    chunked_prefill_size: int | None = _field(None, "most prompt tokens prefilled in one step (default, as SGLang "
                                              "sets it: 8192 on a GPU of 60 GB or more, 4096 from 20 GB, else "
                                              "and on a CPU 2048)")
    schedule_policy: str = _field("hrrn", "order of waiting requests and of prefill chunks: hrrn (highest response "
                                  "ratio next: prefill tokens computed since a request arrived over the prompt "
                                  "tokens it still needs; a question on a cached document goes first, a cold one "
                                  "ages and never starves) or fcfs (arrival order)")
    disable_cuda_graph: bool = _field(False, "GPU: run decode steps eagerly (by default they replay CUDA graphs "
                                      "captured at startup per batch size)")
    cuda_graph_max_bs: int | None = _field(None, "largest decode batch captured as a CUDA graph; larger ones run "
                                           "eagerly (default: --max-running-requests)")
    disable_overlap_schedule: bool = _field(False, "prepare each step only after the previous step's tokens are back "
                                            "(by default the CPU schedules step N+1 while the GPU runs step N)")
    disable_mixed_step_overlap: bool = _field(False, "GPU, ShadowKV: run a mixed step's graph parts (decodes and "
                                              "questions over compressed documents) and its eager prompt chunks one "
                                              "after the other on one stream (by default the graphs replay beside "
                                              "the prompt chunks on a side stream)")
    skip_server_warmup: bool = _field(False, "GPU: start serving without the warmup requests that compile every "
                                      "kernel first (otherwise the first user request pays for the compilation)")
    check_integrity: bool = _field(False, "whenever the scheduler goes idle, check that every KV page, compressed "
                                   "slot and request row is free or owned exactly once (debugging; on in tests)")
    step_log: str | None = _field(None, "append one JSON line per scheduler step to this file (when it launched, "
                                  "what it held, its wall time, the queues): a timeline of where serving time went")
    enable_hierarchical_cache: bool = _field(False, "a host tier for dense KV (SGLang's HiCache): pages evicted "
                                             "from the GPU pool go to page-locked host memory instead of being "
                                             "dropped, and a request that matches them has them loaded back, layer "
                                             "by layer beside its first step, instead of prefilled again")
    hicache_ratio: float = _field(2.0, "the host tier's size as a multiple of the GPU KV pool (capped at the host "
                                  "memory available less 10 GiB, shared by the ranks)")
    hicache_size: int = _field(0, "the host tier's size in GB per rank; overrides --hicache-ratio when above 0")
    hicache_write_policy: str = _field("write_through", "write_through: copy each page to the host when the radix "
                                       "cache takes it (an eviction then moves no data); write_back: copy it when "
                                       "it is evicted")
    random_seed: int = _field(0, "seed of the sampling of requests without their own seed")
    host: str = _field("127.0.0.1", "address the HTTP server listens on")
    port: int = _field(30000, "port the HTTP server listens on")
    log_level: str = _field("warning", "debug, info, warning or error")
    startup_timeout: float = _field(600.0, "seconds to wait for the model to load before giving up")
    show_progress: bool = _field(False, "a progress bar over an Engine.generate() call")
    enable_metrics: bool = _field(False, "serve Prometheus metrics at GET /metrics (SGLang's names: request "
                                  "latencies, token counts, queue, pool usage; ShadowKV's compressed state)")
    constrained_json_any_whitespace: bool = _field(
        False, "json_schema / response_format: allow any whitespace between JSON tokens (SGLang's default); by "
               "default JSON is compact (', ' and ': ' separators), so a model cannot spend max_tokens on whitespace")
    # KV-eviction baselines (attention="streamingllm" or "snapkv"); see layers/attention/eviction_backend.py
    eviction_budget: int = _field(1024, "streamingllm/snapkv: KV tokens kept per KV head")
    streamingllm_sinks: int = _field(4, "streamingllm: first tokens always kept (attention sinks)")
    snapkv_window: int = _field(32, "snapkv: the prompt's last tokens whose attention picks what is kept")
    # ShadowKV (attention="shadowkv"): given as shadowkv_<name> keywords / --shadowkv-<name> flags
    shadowkv: ShadowKVConfig = dataclasses.field(default_factory=ShadowKVConfig)

    def __init__(self, **kwargs) -> None:
        """Keyword arguments are the fields; ShadowKV's may also come flat, as shadowkv_<name>
        (Engine keywords and flags name them so). Unknown names raise TypeError naming them."""
        flat = {k.removeprefix(SHADOWKV_PREFIX): kwargs.pop(k) for k in list(kwargs) if k.startswith(SHADOWKV_PREFIX)}
        fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
        unknown = sorted(set(kwargs) - set(fields)) + sorted(
            SHADOWKV_PREFIX + k for k in set(flat) - set(ShadowKVConfig.__dataclass_fields__))
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(self.flat_names())}")
        for name, f in fields.items():
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            setattr(self, name, kwargs.get(name, default))
        self.shadowkv = dataclasses.replace(self.shadowkv, **flat)
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
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _positive(self, "page_size", "max_running_requests", "tp_size")
        if self.tp_size > 1 and self.attention in ("streamingllm", "snapkv"):
            raise ValueError(f"attention={self.attention!r} (an accuracy baseline) runs on one rank; got tp_size="
                             f"{self.tp_size}")
        if not (isinstance(self.hicache_ratio, (int, float)) and self.hicache_ratio > 0):
            raise ValueError(f"hicache_ratio must be positive, got {self.hicache_ratio!r}")
        if not (isinstance(self.hicache_size, int) and self.hicache_size >= 0):
            raise ValueError(f"hicache_size must be a whole number of GB, 0 or more, got {self.hicache_size!r}")
        if self.hicache_write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {WRITE_POLICIES}, got {self.hicache_write_policy!r}")
        if not self.watchdog_timeout > 0:
            raise ValueError(f"watchdog_timeout must be positive, got {self.watchdog_timeout}")
        for name in ("cuda_graph_max_bs", "context_length", "max_total_tokens", "chunked_prefill_size"):
            if getattr(self, name) is not None:
                _positive(self, name)
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError(f"log_level must be debug, info, warning, error or critical, got {self.log_level!r}")
        if not self.startup_timeout > 0:
            raise ValueError(f"startup_timeout must be positive, got {self.startup_timeout}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.step_log is not None and not os.path.isdir(os.path.dirname(os.path.abspath(self.step_log))):
            raise ValueError(f"step_log: the folder of {self.step_log!r} does not exist")
        chunk = self.shadowkv.chunk_size
        if self.page_size % chunk and chunk % self.page_size:
            raise ValueError(f"shadowkv_chunk_size ({chunk}) and page_size ({self.page_size}) must divide one another")

    def as_dict(self) -> dict:
        """Every setting by its keyword name (ShadowKV's flat, as shadowkv_<name>)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "shadowkv"}
        out.update({SHADOWKV_PREFIX + k: v for k, v in dataclasses.asdict(self.shadowkv).items()})
        return out

    @classmethod
    def from_kwargs(cls, **kwargs) -> "ServerArgs":
        return cls(**kwargs)

    @staticmethod
    def flat_names() -> list[str]:
        return ([f.name for f in dataclasses.fields(ServerArgs) if f.name != "shadowkv"]
                + [SHADOWKV_PREFIX + f.name for f in dataclasses.fields(ShadowKVConfig)])

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One --flag per setting, named like SGLang's (model_path -> --model-path), ShadowKV's as
        --shadowkv-<name>; defaults and help from the fields."""
        settings = [(f.name, f) for f in dataclasses.fields(ServerArgs) if f.name != "shadowkv"]
        settings += [(SHADOWKV_PREFIX + f.name, f) for f in dataclasses.fields(ShadowKVConfig)]
        for name, f in settings:
            flag = "--" + name.replace("_", "-")
            help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
            if f.type == "bool":
                parser.add_argument(flag, action="store_true", help=help_text)
                continue
            kind = str if "str" in f.type else {"int": int, "float": float}.get(f.type.split(" ")[0], str)
            parser.add_argument(flag, type=kind, default=f.default, help=f"{help_text} (default: %(default)s)".strip())

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        return cls(**{name: getattr(ns, name) for name in cls.flat_names()})


def _positive(args: ServerArgs, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


__all__ = ["ServerArgs", "ATTENTION_MODES"]

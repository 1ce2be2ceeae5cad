"""ShadowKV parameters (the paper's defaults, scaled to the model) and the sizes derived from them.

Every field is set from the server flag / Engine keyword of the same name with a `shadowkv_`
prefix; errors name that keyword.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

PAPER_RANK_PER_1024_KEY_DIMS = 160
MIN_RANK = 16
LOWRANK_METHODS = ("auto", "eigh", "subspace", "svd")
# None: the model dtype; int8: a scale per chunk and KV head. "auto" is resolved by the model runner:
# int8 on a GPU (half the host memory and PCIe bytes of the values, half the landmarks' GPU bytes;
# greedy agreement equal to bf16's in benchmarks/results/fidelity_*int8*), the model dtype on a CPU
STORAGE_DTYPES = {"auto": None, "model": None, "int8": torch.int8}


@dataclass(frozen=True)
class ShadowKVConfig:
    rank: int | None = None  # low-rank key dims; None: 160 per 1024 key dims (the paper's ratio)
    rank_energy: float | None = None  # set: per layer the least rank keeping this energy, capped by rank
    chunk_size: int = 8  # tokens per chunk (one landmark, one selection unit)
    outliers: int = 48  # chunks per KV head kept dense on the GPU (the first chunk always is one)
    budget: float = 0.0156  # selected chunks per KV head per step, as a fraction of the context
    min_budget_chunks: int = 32  # ... but never fewer than this many
    local_window: int = 64  # the prompt's most recent tokens stay dense (plus every generated token)
    min_context: int = 4096  # shorter prompts stay dense: compression does not pay
    lowrank_method: str = "auto"  # Gram matrix: full eigh or subspace iteration (auto: by size); or svd
    value_dtype: str = "auto"  # host values: the model dtype, or int8 with a scale per chunk and KV head
    landmark_dtype: str = "auto"  # landmarks (GPU): likewise
    host_tokens: int | None = None  # capacity of the compressed pools in tokens; None: from the device
    max_requests: int = 32  # requests in compressed decode at once (each holds a chunk-cache scratch)
    # a suffix over a compressed prefix up to this many tokens selects chunks per tile of queries;
    # a longer one attends every chunk (streamed); 0: always every chunk
    sparse_prefill_max: int = 2048

    def __post_init__(self) -> None:
        def bad(name: str, want: str, got) -> ValueError:
            return ValueError(f"shadowkv_{name} must be {want}, got {got!r}")

        if self.rank is not None and (not isinstance(self.rank, int) or self.rank < 1):
            raise bad("rank", "a positive int or None", self.rank)
        if self.rank_energy is not None and not 0.0 < self.rank_energy <= 1.0:
            raise bad("rank_energy", "in (0, 1] or None", self.rank_energy)
        for name in ("chunk_size", "outliers", "min_budget_chunks", "min_context", "max_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise bad(name, "a positive int", value)
        if not isinstance(self.local_window, int) or self.local_window < 0:
            raise bad("local_window", "a non-negative int", self.local_window)
        if not 0.0 < self.budget <= 1.0:
            raise bad("budget", "a fraction in (0, 1]", self.budget)
        if self.lowrank_method not in LOWRANK_METHODS:
            raise bad("lowrank_method", f"one of {LOWRANK_METHODS}", self.lowrank_method)
        for name in ("value_dtype", "landmark_dtype"):
            if getattr(self, name) not in STORAGE_DTYPES:
                raise bad(name, f"one of {tuple(STORAGE_DTYPES)}", getattr(self, name))
        if not isinstance(self.sparse_prefill_max, int) or self.sparse_prefill_max < 0:
            raise bad("sparse_prefill_max", "a non-negative int", self.sparse_prefill_max)
        if self.host_tokens is not None and (not isinstance(self.host_tokens, int) or self.host_tokens < 1):
            raise bad("host_tokens", "a positive int or None", self.host_tokens)

    @classmethod
    def from_server_args(cls, args) -> "ShadowKVConfig":
        return cls(**{name: getattr(args, "shadowkv_" + name) for name in cls.__dataclass_fields__})

    @property
    def host_value_torch_dtype(self) -> torch.dtype | None:
        """dtype of the host value pool (None: the model's)."""
        return STORAGE_DTYPES[self.value_dtype]

    @property
    def landmark_torch_dtype(self) -> torch.dtype | None:
        """dtype of the landmark pool (None: the model's)."""
        return STORAGE_DTYPES[self.landmark_dtype]

    def resolve_storage(self, on_gpu: bool) -> "ShadowKVConfig":
        """'auto' storage made concrete for the device (see STORAGE_DTYPES)."""
        auto = "int8" if on_gpu else "model"
        return dataclasses.replace(self, **{name: auto for name in ("value_dtype", "landmark_dtype")
                                            if getattr(self, name) == "auto"})

    def max_rank(self, kv_dim: int) -> int:
        """Width of the low-rank pools: the fixed rank, or the cap of the energy rule."""
        if self.rank is not None:
            return min(self.rank, kv_dim)
        if self.rank_energy is not None:
            return kv_dim
        return min(kv_dim, max(MIN_RANK, round(PAPER_RANK_PER_1024_KEY_DIMS * kv_dim / 1024)))

    def compressed_len(self, prompt_len: int, page_size: int) -> int:
        """Tokens of a prompt that go into the compressed segment (0: the prompt stays dense).

        Whole chunks, aligned to whole pages too so the dense pages they covered can be freed,
        leaving at least `local_window` recent tokens dense.
        """
        if prompt_len < self.min_context:
            return 0
        unit = math.lcm(self.chunk_size, page_size)
        return (prompt_len - self.local_window) // unit * unit

    def num_outliers(self, num_chunks: int) -> int:
        """Outlier chunks per KV head: the configured count, at most half of the segment."""
        return max(1, min(self.outliers, num_chunks // 2))

    def budget_chunks(self, selectable_chunks: int) -> int:
        """Chunks each KV head selects per step (never more than it can choose from)."""
        wanted = max(self.min_budget_chunks, math.ceil(self.budget * selectable_chunks))
        return min(wanted, selectable_chunks)

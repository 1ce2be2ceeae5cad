"""ShadowKV parameters and the sizes derived from them. Rank and selection budget default to rules
that read the data (the keys' spectrum per layer; top-p of the landmark scores per step), because
the paper's fixed numbers changed a small model's answers (issue 16).

Every field is set from the server flag / Engine keyword of the same name with a `shadowkv_`
prefix (ServerArgs builds the one config from them); errors name that keyword. Defaults and help
text live here only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

PAPER_RANK, PAPER_KEY_DIMS = 160, 1024  # the paper's rank for an 8B model's 8 x 128 key dims
# 0.9999: a question over a cached compressed document attends rebuilt keys, and at 0.999 (ranks
# 15-56 of 192 on the embedded model) its answers drifted from the same question sent cold (95% of
# greedy tokens equal, 85% in multi-turn chats); at 0.9999 (24-118) they agree on every token
# (benchmarks/hit_fidelity.py). The pools are as wide as the cap whatever the rank: no memory cost.
DEFAULT_RANK_ENERGY = 0.9999
DEFAULT_TOP_P = 0.98
DEFAULT_MAX_BUDGET = 256
# A compressed span ends on a multiple of this many tokens from its start, so that a prompt and the
# same document with a question after it (or a chat's next turn) compress the same span, unless a
# multiple falls within the question: the basis is fitted and the outliers picked over one span, so
# the question over the document found cached compressed reads the very form it makes cold. On RULER
# (benchmarks/ruler.py, the embedded model on an H200, float32) hit = cold greedy tokens went from
# 0.889 to 0.915 at 4K and from 0.944 to 0.960 at 8K (without it: spans to the last whole chunk). It
# costs up to a grid step of tokens more held dense per compressed prompt (64 MB on the 8B shape).
DEFAULT_SPAN_GRID = 512
# Exact copies (mem_cache/exact_copies.py): a question's prefill over a cached compressed document
# reads the keys and values its cold prefill reads. On RULER (embedded model, H200, float32) hit =
# cold greedy tokens went from 0.915 to 0.992 at 4K and from 0.960 to 0.982 at 8K; a question's first
# token on a 16K document of the 8B shape took 66 ms against 27 ms without (full attention 66). With
# the host values (0.5), three quarters of the host's available memory page-locked. A token's copy is
# 128 KB on the 8B shape (bf16 keys and values), so a 128 GiB machine keeps copies of about 240K
# tokens: its 15 most recently used 16K documents.
DEFAULT_EXACT_COPY_FRACTION = 0.25
LOWRANK_METHODS = ("auto", "eigh", "subspace", "svd")
COMPRESS_POLICIES = ("tier", "eager")
# None: the model dtype; int8: a scale per chunk and KV head. "auto" is resolved by the model runner:
# int8 on a GPU (half the host memory and PCIe bytes of the values, half the landmarks' GPU bytes;
# greedy agreement as bf16's: benchmarks/fidelity.py --shadowkv-value-dtype int8 measures it), the
# model dtype on a CPU.
# Names of torch dtypes, not dtypes: the server's HTTP process reads this file without torch.
STORAGE_DTYPES = {"auto": None, "model": None, "int8": "int8"}


def _field(default, help_text: str):
    """A setting with its flag's help text (the flag is --shadowkv-<name>, the keyword shadowkv_<name>)."""
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class ShadowKVConfig:
    rank: int | None = _field(None, "fixed low-rank key dims for every layer (default: chosen per layer by "
                                    "--shadowkv-rank-energy)")
    rank_energy: float = _field(DEFAULT_RANK_ENERGY, "per layer, the least rank keeping this share of the keys' "
                                "singular-value energy (capped by --shadowkv-rank-cap)")
    chunk_size: int = _field(8, "tokens per chunk: one landmark, one unit of selection")
    outliers: int = _field(48, "chunks per KV head kept dense on the GPU: the first, then those the landmarks and the "
                           "low-rank keys represent worst")
    budget: float | str = _field("auto", "chunks selected per step: auto (per step, layer and KV head, the fewest "
                                 "chunks holding --shadowkv-top-p of the score mass) or a fixed fraction of the context")
    min_budget_chunks: int = _field(32, "floor of the selection budget in chunks")
    local_window: int = _field(64, "most recent prompt tokens kept dense")
    span_grid: int = _field(DEFAULT_SPAN_GRID, "a compressed span ends on a multiple of this many tokens from "
                            "its start, leaving up to that many more dense: a document compressed alone and the "
                            "same document with a question compress one span, so a question over it cached reads "
                            "the form it makes cold (1 or --shadowkv-chunk-size: spans end on the last whole "
                            "chunk)")
    min_context: int = _field(4096, "prompts shorter than this stay dense: compression does not pay; a "
                                  "shorter match of a compressed document is no hit (the prompt runs cold)")
    lowrank_method: str = _field("auto", "auto (eigh up to 256 key dims, else subspace), eigh or subspace "
                                 "(top eigenvectors of the Gram matrix) or svd (the paper's)")
    value_dtype: str = _field("auto", "host values: auto (int8 on a GPU, the model dtype on a CPU), model, or int8 "
                              "(a scale per chunk and KV head: half the host memory and PCIe traffic)")
    landmark_dtype: str = _field("auto", "landmarks: auto (int8 on a GPU, the model dtype on a CPU), model, or int8 "
                                 "(a scale per chunk and KV head: half their GPU memory and the bytes scoring reads)")
    host_tokens: int | None = _field(None, "capacity of the compressed pools (host values) in tokens "
                                     "(default: from the device and --shadowkv-host-mem-fraction)")
    host_mem_fraction: float = _field(0.5, "with --shadowkv-host-tokens unset on a GPU: the share of the machine's "
                                      "available memory page-locked for compressed values")
    exact_copy_fraction: float | None = _field(None, "on a GPU: the share of the machine's available memory "
                                               "page-locked for exact copies of compressed documents' keys and "
                                               "values, which a question's prefill over a cached compressed document "
                                               "reads, so that it computes the question as the same prompt sent cold "
                                               "does (the most recently used documents keep theirs; a document "
                                               "without one is read compressed). Default: 0.25, or half of what "
                                               "--shadowkv-host-mem-fraction leaves if less; 0: no copies. On a CPU, "
                                               "where the pools are sized in chunks, copies of this share's ratio to "
                                               "--shadowkv-host-mem-fraction of the values' chunks")
    max_requests: int | None = _field(None, "most requests decoding from compressed state at once (default: "
                                      "--max-running-requests); each takes its chunk-cache scratch (a page per "
                                      "chunk of the budget's cap) from the KV pool while it runs")
    sparse_prefill_max: int = _field(0, "a prompt suffix over a cached compressed document up to this many tokens "
                                     "attends the chunks it selects (per 64 queries); a longer one attends every "
                                     "chunk, rebuilt a layer at a time, none left out as none is in the same prompt's "
                                     "cold prefill (default 0: every suffix; both replay CUDA graphs up to 256 "
                                     "tokens)")
    rank_cap: int | None = _field(None, "most low-rank dims per layer, also the low-rank pool's width (default: "
                                  "160, scaled up with key dims past 1024)")
    compress_policy: str = _field("tier", "tier: a document stays dense while the GPU holds it and is compressed "
                                  "when memory runs short (least recently used first), or at its prefill when the "
                                  "long documents asked for at once could never be held dense; eager: every prompt "
                                  "of at least --shadowkv-min-context tokens is compressed at its prefill")
    disable_gpu_values: bool = _field(False, "keep compressed documents' values in host memory only (by default a "
                                      "compressed document also keeps them in pages the dense pool can spare, given "
                                      "back first when memory is needed: decoding over it then reads HBM, not PCIe)")
    top_p: float = _field(DEFAULT_TOP_P, "budget auto: score mass the selected chunks must hold")
    max_budget: int = _field(DEFAULT_MAX_BUDGET, "budget auto: most chunks selected per KV head and step "
                             "(the fixed shape of a step)")

    def __post_init__(self) -> None:
        def bad(name: str, want: str, got) -> ValueError:
            return ValueError(f"shadowkv_{name} must be {want}, got {got!r}")

        if not isinstance(self.rank_energy, (int, float)) or not 0.0 < self.rank_energy <= 1.0:
            raise bad("rank_energy", "in (0, 1]", self.rank_energy)
        object.__setattr__(self, "budget", parse_budget(self.budget))
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        for name in ("chunk_size", "outliers", "min_budget_chunks", "min_context", "max_budget", "span_grid"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise bad(name, "a positive int", value)
        for name in ("rank", "rank_cap", "max_requests", "host_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise bad(name, "a positive int or None", value)
        if not isinstance(self.local_window, int) or self.local_window < 0:
            raise bad("local_window", "a non-negative int", self.local_window)
        if self.budget != "auto" and not 0.0 < self.budget <= 1.0:
            raise bad("budget", "'auto' or a fraction in (0, 1]", self.budget)
        if self.compress_policy not in COMPRESS_POLICIES:
            raise bad("compress_policy", f"one of {COMPRESS_POLICIES}", self.compress_policy)
        if self.lowrank_method not in LOWRANK_METHODS:
            raise bad("lowrank_method", f"one of {LOWRANK_METHODS}", self.lowrank_method)
        for name in ("value_dtype", "landmark_dtype"):
            if getattr(self, name) not in STORAGE_DTYPES:
                raise bad(name, f"one of {tuple(STORAGE_DTYPES)}", getattr(self, name))
        if not isinstance(self.sparse_prefill_max, int) or self.sparse_prefill_max < 0:
            raise bad("sparse_prefill_max", "a non-negative int", self.sparse_prefill_max)
        if not isinstance(self.host_mem_fraction, (int, float)) or not 0.0 < self.host_mem_fraction < 1.0:
            raise bad("host_mem_fraction", "in (0, 1)", self.host_mem_fraction)
        copies = self.exact_copy_fraction
        if copies is not None and (not isinstance(copies, (int, float)) or not 0.0 <= copies < 1.0):
            raise bad("exact_copy_fraction", "in [0, 1) or None", copies)
        if copies is not None and self.host_mem_fraction + copies >= 1.0:
            raise ValueError(f"shadowkv_host_mem_fraction + shadowkv_exact_copy_fraction must be below 1 (the "
                             f"server needs host memory too), got {self.host_mem_fraction} + {copies}")

    @property
    def copy_fraction(self) -> float:
        """The exact copies' share of host memory: the one asked for, else DEFAULT_EXACT_COPY_FRACTION,
        or half of what the values leave if less (a server that gives its values more keeps room)."""
        if self.exact_copy_fraction is not None:
            return self.exact_copy_fraction
        return min(DEFAULT_EXACT_COPY_FRACTION, (1.0 - self.host_mem_fraction) / 2)

    @property
    def host_value_torch_dtype(self):
        """torch dtype of the host value pool (None: the model's)."""
        return _torch_dtype(STORAGE_DTYPES[self.value_dtype])

    @property
    def landmark_torch_dtype(self):
        """torch dtype of the landmark pool (None: the model's)."""
        return _torch_dtype(STORAGE_DTYPES[self.landmark_dtype])

    def resolve_storage(self, on_gpu: bool) -> "ShadowKVConfig":
        """'auto' storage made concrete for the device (see STORAGE_DTYPES)."""
        auto = "int8" if on_gpu else "model"
        return dataclasses.replace(self, **{name: auto for name in ("value_dtype", "landmark_dtype")
                                            if getattr(self, name) == "auto"})

    @property
    def energy(self) -> float | None:
        """The energy rule's target (None: a fixed rank)."""
        return None if self.rank is not None else self.rank_energy

    def max_rank(self, kv_dim: int) -> int:
        """Width of the low-rank pools: the fixed rank, or the cap of the energy rule."""
        if self.rank is not None:
            return min(self.rank, kv_dim)
        return min(kv_dim, self.rank_cap or rank_cap_for(kv_dim))

    def describe_rank(self, kv_dim: int) -> str:
        """The rank rule in words (startup log)."""
        if self.rank is not None:
            return f"rank {self.max_rank(kv_dim)} of {kv_dim} key dims in every layer"
        return (f"rank per layer: the least keeping {self.rank_energy} of the keys' energy, "
                f"at most {self.max_rank(kv_dim)} of {kv_dim} key dims")

    def describe_budget(self) -> str:
        """The budget rule in words (startup log)."""
        if self.budget == "auto":
            return (f"budget per step, layer and KV head: the fewest chunks holding {self.top_p} of the "
                    f"score mass, {self.min_budget_chunks} to {self.max_budget}")
        return f"budget {self.budget} of the chunks, at least {self.min_budget_chunks}"

    @property
    def top_p_or_none(self) -> float | None:
        """The adaptive budget's mass target (None: a fixed budget)."""
        return self.top_p if self.budget == "auto" else None

    def compressed_len(self, prompt_len: int, page_size: int) -> int:
        """Tokens of a prompt that go into the compressed segment (0: the prompt stays dense).

        Whole chunks, aligned to whole pages too so the dense pages they covered can be freed, and
        to the span grid, leaving at least `local_window` recent tokens dense.
        """
        if prompt_len < self.min_context:
            return 0
        unit = math.lcm(self.chunk_size, page_size, self.span_grid)
        return (prompt_len - self.local_window) // unit * unit

    def num_outliers(self, num_chunks: int) -> int:
        """Outlier chunks per KV head: the configured count, at most half of the segment."""
        return max(1, min(self.outliers, num_chunks // 2))

    def budget_chunks(self, selectable_chunks: int) -> int:
        """Chunks each KV head selects per step (never more than it can choose from); for the
        adaptive budget the most it may select, which fixes the step's shapes."""
        if self.budget == "auto":
            wanted = self.max_budget
        else:
            wanted = max(self.min_budget_chunks, math.ceil(self.budget * selectable_chunks))
        return min(wanted, selectable_chunks)


def rank_cap_for(kv_dim: int) -> int:
    """The energy rule's default cap per layer: the paper's rank 160, scaled up with the key dims
    past 1024 (never down: small models need far more than the paper's ratio), at most kv_dim.
    It is also the low-rank pool's width, so it bounds the GPU memory of compressed keys."""
    return min(kv_dim, round(PAPER_RANK * max(1.0, kv_dim / PAPER_KEY_DIMS)))


def parse_budget(value) -> float | str:
    """"auto" or a fraction, also as the text of a command-line flag."""
    if value == "auto" or isinstance(value, (int, float)):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"shadowkv_budget must be 'auto' or a fraction in (0, 1], got {value!r}") from None


def _torch_dtype(name: str | None):
    import torch
    return None if name is None else getattr(torch, name)

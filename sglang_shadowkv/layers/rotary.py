"""Rotary position embedding: one convention for every family, the others mapped onto it.

The kernels (kernels/rotary.py, kernels/rebuild_keys.py) rotate dim i of a head with dim
i + head_dim/2 by table column i. Families that differ are mapped onto that at load:
- partial rotary (GLM: half of each head): the unrotated dims sit in table columns whose cos is 1
  and sin 0, so every rotation, forward or inverse, passes them through untouched;
- interleaved pairs (GLM rotates (2i, 2i+1)) and partial half-split pairs: `half_split_order`
  reorders each head's dims of q and k (their weights, biases and per-head norms) so that every
  rotated pair is (i, i + head_dim/2). Attention only ever takes q·k, which a common reordering of
  both leaves unchanged, so the model computes what transformers computes.
- the attention scaling of yarn and longrope (transformers multiplies cos and sin by it, for q and
  k, so it scales the rotated dims' share of q·k by its square and leaves the unrotated dims'
  share): the queries' rotated dims carry its square (`rotate_queries`). Keys stay pure rotations,
  so ShadowKV's inverse rotation recovers the pre-RoPE keys exactly and rebuilt keys rotate
  forward the same way.

`apply(..., inverse=True)` rotates back: pre-RoPE keys from the post-RoPE keys the KV pool stores
(ShadowKV compresses pre-RoPE keys).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from sglang_shadowkv.kernels.rotary import apply_rotary


def rope_frequencies(rotary_dim: int, theta: float, scaling: dict[str, Any] | None,
                     context_length: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim/2] float64, attention factor) as transformers computes them
    (modeling_rope_utils), for a model serving up to context_length tokens. LongRoPE takes its
    long factors when context_length exceeds original_max_position_embeddings, else its short
    ones: transformers switches per sequence at that length, and a position's rotation must not
    depend on the request (the radix cache and ShadowKV keep keys across requests); the two agree
    on every sequence longer than it, and on every sequence when --context-length is at most it."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    inv_freq = 1.0 / theta ** exponents
    kind = None if scaling is None else scaling["rope_type"]
    if kind is None:
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, rotary_dim, theta, scaling), _yarn_attention_factor(scaling)
    if kind == "longrope":
        original = scaling["original_max_position_embeddings"]
        factors = scaling["long_factor" if context_length > original else "short_factor"]
        return inv_freq / torch.tensor(factors, dtype=torch.float64), _longrope_attention_factor(scaling)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Long wavelengths scaled down by `factor`, short ones kept, a smooth band between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    band = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(band, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Frequencies that turn fewer than beta_slow times over the original length are interpolated
    (divided by `factor`), those turning more than beta_fast times kept, a linear ramp between."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:  # the dim whose frequency turns that often over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _yarn_attention_factor(scaling: dict[str, Any]) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def _longrope_attention_factor(scaling: dict[str, Any]) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))


def half_split_order(head_dim: int, rotary_dim: int, interleaved: bool) -> list[int] | None:
    """The order of a head's dims that puts every rotated pair at (i, i + head_dim/2), rotated
    pairs first (order[j] is the checkpoint's dim at our dim j); None when the checkpoint's order
    is already so (full rotary, half-split pairs). Pairs are (2i, 2i+1) when interleaved (GLM,
    llama.cpp's GGUF rows), else (i, i + rotary_dim/2); dims past rotary_dim are not rotated."""
    if rotary_dim == head_dim and not interleaved:
        return None
    half = rotary_dim // 2
    firsts = list(range(0, rotary_dim, 2)) if interleaved else list(range(half))
    seconds = list(range(1, rotary_dim, 2)) if interleaved else list(range(half, rotary_dim))
    rest = (head_dim - rotary_dim) // 2
    unrotated = list(range(rotary_dim, head_dim))
    return firsts + unrotated[:rest] + seconds + unrotated[rest:]


def permute_head_rows(w: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Rows of w [heads·head_dim, ...] (a weight, a bias or a per-head norm) in `order` within
    each head."""
    return w.unflatten(0, (-1, len(order)))[:, order].flatten(0, 1)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, theta: float, max_positions: int,
                 scaling: dict[str, Any] | None = None, rotary_dim: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq, attention_factor = rope_frequencies(rotary_dim or head_dim, theta, scaling, max_positions)
        # table columns past the rotated pairs: cos 1, sin 0 (their dims pass through)
        inv_freq = torch.cat([inv_freq, inv_freq.new_zeros(head_dim // 2 - inv_freq.numel())])
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.register_buffer("cos_cache", freqs.cos().float(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin().float(), persistent=False)
        # per dim of a query head: the attention factor squared on the rotated dims, 1 on the others
        rotated = (inv_freq != 0).repeat(2)
        scale = None if attention_factor == 1.0 else torch.where(rotated, attention_factor ** 2, 1.0).float()
        self.register_buffer("query_scale", scale, persistent=False)

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rotate x [tokens, heads, head_dim] by its tokens' positions [tokens] (in float32; the
        result in out_dtype, default x's). One Triton pass on the GPU, the torch reference elsewhere."""
        return apply_rotary(self, x, positions, inverse, out_dtype)

    def rotate_queries(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Queries rotated, their rotated dims scaled by the rope's attention factor squared (yarn,
        longrope)."""
        q = self.apply(q, positions)
        return q if self.query_scale is None else q * self.query_scale.to(q.dtype)

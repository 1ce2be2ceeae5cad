"""Rotary position embedding (the half-split convention of HF Llama/Qwen2).

`apply` rotates forward; `apply(..., inverse=True)` rotates back, which recovers pre-RoPE keys
from the post-RoPE keys the KV pool stores (ShadowKV compresses pre-RoPE keys).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from sglang_shadowkv.kernels.rotary import apply_rotary


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: long wavelengths scaled down by `factor`, short ones kept, a smooth band between.
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    band = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(band, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, theta: float, max_positions: int,
                 scaling: dict[str, Any] | None = None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.register_buffer("cos_cache", freqs.cos().float(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin().float(), persistent=False)

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rotate x [tokens, heads, head_dim] by its tokens' positions [tokens] (in float32; the
        result in out_dtype, default x's). One Triton pass on the GPU, the torch reference elsewhere."""
        return apply_rotary(self, x, positions, inverse, out_dtype)

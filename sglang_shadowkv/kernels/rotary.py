"""Rotary position embedding of x [tokens, heads, head_dim] by each token's position, forward or
inverse (half-split convention: the first half of a head rotates with the second). Every family
is mapped onto it (layers/rotary.py): dims of table columns with cos 1 and sin 0 pass through.

The inverse recovers pre-RoPE keys for ShadowKV's prefill compression; the Triton kernel does it
in one pass (read x, write the result in the asked dtype) where the torch reference makes a
float32 copy and several temporaries of the same size.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl


def rotate_reference(x, cos_cache, sin_cache, positions, inverse: bool = False, out_dtype=None):
    """cos_cache/sin_cache [max_pos, head_dim/2] float32; positions [tokens] -> rotated x in out_dtype
    (default x's dtype), computed in float32."""
    cos = cos_cache[positions].unsqueeze(1)
    sin = sin_cache[positions].unsqueeze(1)
    if inverse:
        sin = -sin
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(out_dtype or x.dtype)


@triton.jit(do_not_specialize=["T"])  # one compiled variant for every token count (each batch size)
def _rotate_kernel(X, COS, SIN, POS, OUT, T, stride_xt, stride_xh, stride_ot, stride_oh, stride_c, sign,
                   HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    h = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_t < T)[:, None] & (offs_d < HALF)[None, :]
    pos = tl.load(POS + offs_t, mask=offs_t < T, other=0).to(tl.int64)
    cos = tl.load(COS + pos[:, None] * stride_c + offs_d[None, :], mask=mask, other=0.0)
    sin = tl.load(SIN + pos[:, None] * stride_c + offs_d[None, :], mask=mask, other=0.0) * sign
    rows = offs_t[:, None].to(tl.int64)
    x1 = tl.load(X + rows * stride_xt + h * stride_xh + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + rows * stride_xt + h * stride_xh + HALF + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    out = OUT + rows * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(out, (x1 * cos - x2 * sin).to(OUT.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(OUT.dtype.element_ty), mask=mask)


def rotate(x, cos_cache, sin_cache, positions, inverse: bool = False, out_dtype=None, block_t: int = 64):
    """Triton version of `rotate_reference` (same arguments; x's last dim contiguous)."""
    t, h, d = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty(t, h, d, dtype=out_dtype or x.dtype, device=x.device)
    if t:
        _rotate_kernel[(triton.cdiv(t, block_t), h)](
            x, cos_cache, sin_cache, positions, out, t, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
            cos_cache.stride(0), -1.0 if inverse else 1.0, HALF=d // 2,
            HALF_PAD=triton.next_power_of_2(d // 2), BLOCK_T=block_t)
    return out


class RotaryTables(Protocol):
    """What rotating needs of a model's rotary embedding (layers/rotary.py's RotaryEmbedding):
    cos/sin tables [max_pos, head_dim/2] float32."""
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor


def apply_rotary(tables: RotaryTables, x, positions, inverse: bool = False, out_dtype=None):
    """Rotate x [tokens, heads, head_dim] by positions: one Triton pass on a GPU, the torch
    reference elsewhere."""
    rotate_fn = rotate if x.is_cuda else rotate_reference
    return rotate_fn(x, tables.cos_cache, tables.sin_cache, positions, inverse, out_dtype)

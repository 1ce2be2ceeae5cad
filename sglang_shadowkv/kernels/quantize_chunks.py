"""A layer's values into the int8 host format in one pass: token-major [T, Hkv, D] (as the dense
pool holds them) to chunk-major int8 [T / c, Hkv, c, D] with one float32 scale per chunk and KV
head (its largest magnitude / 127, as `quantize_per_head`).

The torch path (a chunk-major copy, then a float32 copy, abs, max, divide, round and clamp) reads
and writes the layer ~8 times: on the H100 about 9 ms of a 16K document's compression in an 8B
model, here one read and one int8 write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_shadowkv.kernels.head_dims import dim_pad, head_dims
from sglang_shadowkv.mem_cache.compressed_layout import quantize_per_head


def chunk_major(v: torch.Tensor, chunk: int) -> torch.Tensor:
    """[T, Hkv, D] -> [T / chunk, Hkv, chunk, D] (a view)."""
    t, h, d = v.shape
    return v.view(t // chunk, chunk, h, d).permute(0, 2, 1, 3)


def quantize_chunks_reference(v: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [T / chunk, Hkv, chunk, D], float32 scale [T / chunk, Hkv]) of values v [T, Hkv, D]."""
    values, scale = quantize_per_head(chunk_major(v, chunk))
    return values.contiguous(), scale


@triton.jit
def _round_half_even(y):
    """torch.round's rounding (ties to even), from floor alone (no libdevice in the interpreter)."""
    f = tl.floor(y)
    frac = y - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    return tl.where(frac > 0.5, f + 1.0, tl.where(frac < 0.5, f, f + odd))


@triton.jit
def _quantize_chunks_kernel(V, OUT, SCALE, stride_vt, stride_vh, CHUNK: tl.constexpr, CHUNK_PAD: tl.constexpr,
                            HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """One program per (chunk, KV head): its [c, D] values read once, their int8 and scale written."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    offs_t = tl.arange(0, CHUNK_PAD)
    offs_d, d_ok = head_dims(HEAD_DIM, DIM_PAD)
    mask = (offs_t < CHUNK)[:, None] & d_ok[None, :]
    token = (n * CHUNK + offs_t).to(tl.int64)
    x = tl.load(V + token[:, None] * stride_vt + h * stride_vh + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), 1e-30), 127.0)  # (IEEE, as torch's)
    q = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(x, scale)), -127.0), 127.0)
    block = (n * heads + h).to(tl.int64) * CHUNK * HEAD_DIM
    tl.store(OUT + block + offs_t[:, None] * HEAD_DIM + offs_d[None, :], q.to(tl.int8), mask=mask)
    tl.store(SCALE + n * heads + h, scale)


def quantize_chunks(v: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `quantize_chunks_reference` (same arguments and results)."""
    t, h, d = v.shape
    if t % chunk or v.stride(2) != 1:
        raise ValueError(f"v must be [T, Hkv, D] with T a multiple of {chunk} and contiguous in D, got shape "
                         f"{tuple(v.shape)} and strides {v.stride()}")
    out = torch.empty(t // chunk, h, chunk, d, dtype=torch.int8, device=v.device)
    scale = torch.empty(t // chunk, h, dtype=torch.float32, device=v.device)
    if t:
        _quantize_chunks_kernel[(t // chunk, h)](v, out, scale, v.stride(0), v.stride(1), CHUNK=chunk,
                                                 CHUNK_PAD=triton.next_power_of_2(chunk), HEAD_DIM=d,
                                                 DIM_PAD=dim_pad(d))
    return out, scale

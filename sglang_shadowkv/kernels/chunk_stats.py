"""Per chunk and KV head of a prefill segment: the landmark (mean of the chunk's keys) and the
least cosine similarity between a key of the chunk and that mean, which ranks outlier chunks.

One read of the post-RoPE keys [s, Hkv, D] (any float dtype); float32 out. The torch reference
materialises a float32 copy of the keys and several temporaries of the same size, which cost more
than the rest of a 128K-token compression.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

EPS = 1e-8


def chunk_stats_reference(k: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k [s, H, D] with s a multiple of chunk_size -> landmarks [n, H, D], min_cos [n, H] (float32)."""
    s, h, d = k.shape
    chunks = k.float().view(s // chunk_size, chunk_size, h, d)
    landmarks = chunks.mean(1)
    dots = (chunks * landmarks[:, None]).sum(-1)
    norms = chunks.norm(dim=-1) * landmarks.norm(dim=-1)[:, None]
    return landmarks, (dots / norms.clamp(min=EPS)).amin(1)


@triton.jit(do_not_specialize=["N"])  # one compiled variant for every chunk count: a document's first
# compression with a count not divisible by 16 (the warmup's is) compiled another on the H100 (0.33 s)
def _chunk_stats_kernel(K, LM, MINCOS, N, stride_t, stride_h, stride_ln, stride_lh, stride_mn,
                        CHUNK: tl.constexpr, CHUNK_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                        DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, EPS: tl.constexpr):
    h = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, CHUNK_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    n_ok, c_ok, d_ok = offs_n < N, offs_c < CHUNK, offs_d < HEAD_DIM
    tokens = offs_n[:, None, None].to(tl.int64) * CHUNK + offs_c[None, :, None]
    mask = n_ok[:, None, None] & c_ok[None, :, None] & d_ok[None, None, :]
    x = tl.load(K + tokens * stride_t + h * stride_h + offs_d[None, None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, 1) / CHUNK  # [BLOCK_N, DIM_PAD]
    dots = tl.sum(x * mean[:, None, :], 2)  # [BLOCK_N, CHUNK_PAD]
    norms = tl.sqrt(tl.sum(x * x, 2)) * tl.sqrt(tl.sum(mean * mean, 1))[:, None]
    cos = tl.where(c_ok[None, :], dots / tl.maximum(norms, EPS), float("inf"))
    tl.store(LM + offs_n[:, None].to(tl.int64) * stride_ln + h * stride_lh + offs_d[None, :], mean,
             mask=n_ok[:, None] & d_ok[None, :])
    tl.store(MINCOS + offs_n.to(tl.int64) * stride_mn + h, tl.min(cos, 1), mask=n_ok)


def chunk_stats(k: torch.Tensor, chunk_size: int, block_n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `chunk_stats_reference` (same arguments; k's last dim contiguous)."""
    s, h, d = k.shape
    if s % chunk_size:
        raise ValueError(f"k has {s} tokens, not a multiple of chunk_size={chunk_size}")
    if k.stride(2) != 1:
        k = k.contiguous()
    n = s // chunk_size
    landmarks = torch.empty(n, h, d, dtype=torch.float32, device=k.device)
    min_cos = torch.empty(n, h, dtype=torch.float32, device=k.device)
    if n:
        _chunk_stats_kernel[(triton.cdiv(n, block_n), h)](
            k, landmarks, min_cos, n, k.stride(0), k.stride(1), landmarks.stride(0), landmarks.stride(1),
            min_cos.stride(0), CHUNK=chunk_size, CHUNK_PAD=triton.next_power_of_2(chunk_size), HEAD_DIM=d,
            DIM_PAD=triton.next_power_of_2(d), BLOCK_N=block_n, EPS=EPS)
    return landmarks, min_cos

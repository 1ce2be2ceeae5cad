"""Prefill compression of one layer of one segment (DESIGN.md §2, prefill steps 1-4).

Runs after the dense prefill attention of the layer, reading the segment's post-RoPE keys and its
values back from the dense pool; afterwards those dense pages can be freed.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from sglang_shadowkv.kernels.chunk_stats import chunk_stats, chunk_stats_reference
from sglang_shadowkv.kernels.rotary import RotaryTables, apply_rotary
from sglang_shadowkv.mem_cache.compressed_pool import Segment, ShadowKVPool

from .config import LOWRANK_METHODS, ShadowKVConfig

AUTO_EIGH_MAX_DIM = 256
OVERSAMPLE = 32  # extra block columns when the energy rule needs sorted eigenvalues


@contextmanager
def tf32_matmuls():
    """Gram matrix and projections in TF32 on the GPU: the keys come from bf16/fp16 caches, so
    TF32's 10-bit mantissa loses nothing they had, and the GEMMs run on tensor cores."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def symmetric_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.linalg.eigh, on one thread on the CPU: LAPACK's multithreaded eigh of a few hundred
    dims waits on threads that other busy processes hold the cores from (measured on a shared
    2-core machine, 192 dims: 2.3 s on 2 threads, 6 ms on one; 30 layers per compression)."""
    if matrix.is_cuda:
        return torch.linalg.eigh(matrix)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return torch.linalg.eigh(matrix)
    finally:
        torch.set_num_threads(threads)


def _orthonormal_columns(y: torch.Tensor) -> torch.Tensor:
    """Orthonormalise the columns of a tall float64 y by Cholesky-QR, twice (CholeskyQR2): two
    small GEMMs, a Cholesky and a triangular solve each, where a Householder QR on the GPU is a
    long chain of tiny kernels. The shift keeps the Cholesky defined when y is nearly rank-deficient."""
    for _ in range(2):
        gram = y.T @ y
        gram.diagonal().add_(gram.diagonal().mean() * 1e-13 + 1e-300)
        factor, _ = torch.linalg.cholesky_ex(gram)
        y = torch.linalg.solve_triangular(factor, y.T, upper=False).T
    return y


def top_subspace(gram: torch.Tensor, k: int, with_values: bool, iters: int = 4,
                  oversample: int = OVERSAMPLE) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Rows spanning the top-k eigenspace of a symmetric PSD matrix, by block power iteration in
    float64 (GEMMs on a dim × k block instead of a dim × dim eigh).

    The span is all that A·B needs, so for a fixed rank the block is exactly k wide and no small
    eigh is solved (its reconstruction error is within 1% of the SVD's after 4 iterations). The
    energy rule needs eigenvalues: then the block is oversampled and a Rayleigh-Ritz step sorts it.
    Returns (eigenvalues descending or None, rows [width, dim]).
    """
    g = gram.double()
    n = g.shape[0]
    width = min(n, k + oversample) if with_values else k
    gen = torch.Generator(device=g.device).manual_seed(0)
    q = torch.randn(n, width, device=g.device, dtype=torch.float64, generator=gen)
    for _ in range(iters):
        q = _orthonormal_columns(g @ q)
    if not with_values:
        return None, q.T.float()
    evals, evecs = symmetric_eigh(q.T @ g @ q)
    return evals.flip(0).float(), (q @ evecs).flip(1).T.float()


def resolve_lowrank_method(method: str, dim: int) -> str:
    """`auto`: a full eigh of the Gram matrix when it is small (exact, cheap), else subspace
    iteration (a 1024 × 1024 eigh alone costs ~11 ms on an H100, 3% of a 128K-token dense layer)."""
    if method != "auto":
        return method
    return "eigh" if dim <= AUTO_EIGH_MAX_DIM else "subspace"


def low_rank_basis(k_pre: torch.Tensor, max_rank: int, energy: float | None = None,
                   method: str = "auto") -> torch.Tensor:
    """Orthonormal rows B [r, dim] spanning the top-r right singular subspace of k_pre [s, dim].

    eigh: top eigenvectors of the Gram matrix G = k_preᵀk_pre (one GEMM and a dim × dim eigh).
    subspace: the same subspace by block power iteration on G (GEMMs only, for large dims).
    svd: the paper's truncated SVD of the tall matrix. auto: see `resolve_lowrank_method`.
    With `energy`, r is the smallest rank whose squared singular values keep that fraction of the
    total (trace of G), capped at max_rank.
    """
    basis, rank = padded_low_rank_basis(k_pre, max_rank, energy, method)
    return basis[:int(rank)].contiguous()


def padded_low_rank_basis(k_pre: torch.Tensor, max_rank: int, energy: float | None = None,
                          method: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """`low_rank_basis` as [max_rank, dim] rows, zero past the rank, and the rank as a tensor on
    k_pre's device: no host sync for the rank, so a compression's layers queue up without the
    host waiting for each one (the pool is as wide as max_rank whatever the rank)."""
    x = k_pre.float()
    dim = x.shape[1]
    rank_cap = min(max_rank, dim)
    method = resolve_lowrank_method(method, dim)
    if method in ("eigh", "subspace"):
        with tf32_matmuls():
            gram = x.T @ x
        if method == "eigh" or rank_cap + OVERSAMPLE >= dim:
            evals, evecs = symmetric_eigh(gram)
            sq, vecs = evals.flip(0), evecs.flip(1).T
        else:
            sq, vecs = top_subspace(gram, rank_cap, with_values=energy is not None)
        total = gram.diagonal().sum()
    elif method == "svd":
        _, s, vecs = torch.linalg.svd(x, full_matrices=False)
        sq = s**2
        total = sq.sum()
    else:
        raise ValueError(f"method must be one of {LOWRANK_METHODS}, got {method!r}")
    rank = torch.tensor(rank_cap, device=x.device)
    if energy is not None:
        kept = torch.cumsum(sq.clamp(min=0).double(), 0) / total.double().clamp(min=1e-30)
        rank = torch.clamp((kept < energy).sum() + 1, max=rank_cap)
    basis = torch.zeros(max_rank, dim, device=x.device)
    basis[:rank_cap] = vecs[:rank_cap] * (torch.arange(rank_cap, device=x.device) < rank)[:, None]
    return basis, rank


def chunk_landmarks_and_outliers(k_post: torch.Tensor, chunk_size: int, num_outliers: int):
    """Landmarks [n, H, D] (chunk means, float32) and per KV head the outlier chunk ids [H, o].

    Outliers are the chunks whose least cosine similarity between a key and its chunk mean is
    lowest: a mean that represents its keys badly. Chunk 0 (the attention sink) always is one.
    """
    stats_fn = chunk_stats if k_post.is_cuda else chunk_stats_reference
    landmarks, min_cos = stats_fn(k_post, chunk_size)
    min_cos[0] = float("-inf")
    outliers = min_cos.T.topk(num_outliers, dim=1, largest=False).indices  # [H, o]
    return landmarks, outliers


def compress_layer(pool: ShadowKVPool, seg: Segment, layer: int, k_post: torch.Tensor,
                   v: torch.Tensor, rotary: RotaryTables, cfg: ShadowKVConfig) -> torch.Tensor:
    """Compress the segment's keys/values [num_tokens, H, D] of one layer into the pool.

    Returns the rank used for the layer (a 0-dim tensor on the pool's device, also in seg.ranks).
    """
    c, h, d = pool.chunk_size, pool.num_kv_heads, pool.head_dim
    n = seg.num_chunks
    positions = torch.arange(seg.start, seg.start + seg.num_tokens, device=k_post.device)
    k_pre = apply_rotary(rotary, k_post, positions, inverse=True, out_dtype=torch.float32).reshape(seg.num_tokens, h * d)
    padded_basis, rank = padded_low_rank_basis(k_pre, pool.max_rank, cfg.energy, cfg.lowrank_method)
    pool.write_basis(layer, seg, padded_basis)
    pool.basis_rank[layer][seg.seg_id] = rank
    with tf32_matmuls():
        pool.write_lowrank(layer, seg, k_pre @ padded_basis.T)

    landmarks, outlier_ids = chunk_landmarks_and_outliers(k_post, c, seg.num_outliers)
    pool.write_landmarks(layer, seg, landmarks)
    head_major_k = k_post.view(n, c, h, d).permute(2, 0, 1, 3)  # [H, n, c, D]
    head_major_v = v.view(n, c, h, d).permute(2, 0, 1, 3)
    pick = outlier_ids[:, :, None, None].expand(-1, -1, c, d)
    blocks = seg.outlier_blocks.flatten().long()
    pool.outlier_pos[layer][blocks] = (seg.start + outlier_ids.flatten() * c).int()
    pool.blocks_k[layer][blocks] = torch.gather(head_major_k, 1, pick).reshape(-1, c, d).to(pool.dtype)
    pool.blocks_v[layer][blocks] = torch.gather(head_major_v, 1, pick).reshape(-1, c, d).to(pool.dtype)
    selectable = torch.ones(h, n, dtype=torch.int8, device=k_post.device)
    selectable.scatter_(1, outlier_ids, 0)
    pool.selectable[layer][seg.chunk_slots] = selectable.T.contiguous()

    values = head_major_v.permute(1, 0, 2, 3).to(pool.dtype).contiguous()  # [n, H, c, D]
    pool.write_host_values(layer, seg, values)
    seg.ranks[layer] = rank
    return rank

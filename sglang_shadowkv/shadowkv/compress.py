"""Prefill compression of one layer of one segment (DESIGN.md §2, prefill steps 1-4).

Runs after the dense prefill attention of the layer, reading the segment's post-RoPE keys and its
values back from the dense pool; afterwards those dense pages can be freed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_shadowkv.layers.rotary import RotaryEmbedding
from sglang_shadowkv.mem_cache.shadow_pool import Segment, ShadowKVPool

from .config import ShadowKVConfig


def low_rank_basis(k_pre: torch.Tensor, max_rank: int, energy: float | None = None,
                   method: str = "eigh") -> torch.Tensor:
    """Orthonormal rows B [r, dim] spanning the top-r right singular subspace of k_pre [s, dim].

    eigh: top eigenvectors of the Gram matrix k_preᵀk_pre (one GEMM and a dim × dim eigh; float64
    for the small matrix so the ill-conditioned tail does not leak into the kept directions).
    svd: the paper's truncated SVD of the tall matrix. With `energy`, r is the smallest rank whose
    squared singular values keep that fraction of the total, capped at max_rank.
    """
    x = k_pre.float()
    if method == "eigh":
        evals, evecs = torch.linalg.eigh((x.T @ x).double())
        sq, vecs = evals.flip(0).clamp(min=0), evecs.flip(1).T.float()
    elif method == "svd":
        _, s, vh = torch.linalg.svd(x, full_matrices=False)
        sq, vecs = s.double() ** 2, vh
    else:
        raise ValueError(f"method must be 'eigh' or 'svd', got {method!r}")
    rank = min(max_rank, x.shape[1])
    if energy is not None:
        kept = torch.cumsum(sq, 0) / sq.sum().clamp(min=1e-30)
        rank = min(rank, int((kept < energy).sum()) + 1)
    return vecs[:rank].contiguous()


def chunk_landmarks_and_outliers(k_post: torch.Tensor, chunk_size: int, num_outliers: int):
    """Landmarks [n, H, D] (chunk means) and per KV head the outlier chunk ids [H, o].

    Outliers are the chunks whose least cosine similarity between a key and its chunk mean is
    lowest: a mean that represents its keys badly. Chunk 0 (the attention sink) always is one.
    """
    s, h, d = k_post.shape
    chunks = k_post.float().view(s // chunk_size, chunk_size, h, d)
    landmarks = chunks.mean(1)
    min_cos = F.cosine_similarity(chunks, landmarks[:, None], dim=-1).amin(1)  # [n, H]
    min_cos[0] = float("-inf")
    outliers = min_cos.T.topk(num_outliers, dim=1, largest=False).indices  # [H, o]
    return landmarks, outliers


def compress_layer(pool: ShadowKVPool, seg: Segment, layer: int, k_post: torch.Tensor,
                   v: torch.Tensor, rotary: RotaryEmbedding, cfg: ShadowKVConfig) -> int:
    """Compress the segment's keys/values [num_tokens, H, D] of one layer into the pool.

    Returns the rank used for the layer.
    """
    c, h, d = pool.chunk_size, pool.num_kv_heads, pool.head_dim
    n = seg.num_chunks
    positions = torch.arange(seg.start, seg.start + seg.num_tokens, device=k_post.device)
    k_pre = rotary.apply(k_post.float(), positions, inverse=True).reshape(seg.num_tokens, h * d)
    basis = low_rank_basis(k_pre, pool.max_rank, cfg.rank_energy, cfg.lowrank_method)
    rank = basis.shape[0]
    padded_basis = torch.zeros(pool.max_rank, h * d, device=basis.device)
    padded_basis[:rank] = basis
    pool.basis[layer][seg.seg_id] = padded_basis.to(pool.dtype)
    pool.a_rows[layer][pool.token_rows(seg)] = (k_pre @ padded_basis.T).to(pool.dtype)

    landmarks, outlier_ids = chunk_landmarks_and_outliers(k_post, c, seg.num_outliers)
    pool.landmarks[layer][seg.chunk_slots] = landmarks.to(pool.dtype)
    head_major_k = k_post.view(n, c, h, d).permute(2, 0, 1, 3)  # [H, n, c, D]
    head_major_v = v.view(n, c, h, d).permute(2, 0, 1, 3)
    pick = outlier_ids[:, :, None, None].expand(-1, -1, c, d)
    blocks = seg.outlier_blocks.flatten().long()
    pool.outlier_k[layer][blocks] = torch.gather(head_major_k, 1, pick).reshape(-1, c, d).to(pool.dtype)
    pool.outlier_v[layer][blocks] = torch.gather(head_major_v, 1, pick).reshape(-1, c, d).to(pool.dtype)
    selectable = torch.ones(h, n, dtype=torch.int8, device=k_post.device)
    selectable.scatter_(1, outlier_ids, 0)
    pool.selectable[layer][seg.chunk_slots] = selectable.T.contiguous()

    values = head_major_v.permute(1, 0, 2, 3).to(pool.dtype)  # [n, H, c, D], chunk-contiguous
    pool.host_v[layer].index_copy_(0, seg.chunk_slots.cpu(), values.cpu())
    seg.ranks[layer] = rank
    return rank

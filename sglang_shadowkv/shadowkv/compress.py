"""Prefill compression of one segment (DESIGN.md §2, prefill steps 1-4).

Runs after the dense prefill attention of each layer, reading the segment's post-RoPE keys and
its values back from the dense pool; afterwards those dense pages can be freed. Landmarks and
host values are written layer by layer; the low-rank bases of all layers are solved together once
the last layer is in (`SegmentCompression.finish`, which then writes each layer's low-rank keys and
outlier chunks, half of those chosen by how the basis fits them): the block power iteration is a
chain of small float64 factorizations whose cost is launch latency, so one batched launch for all
layers replaces one per layer (on the H100, 32 layers' Cholesky-QR and Rayleigh-Ritz eigh took
~85 ms of a 16K document's 0.18 s compression).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable

import torch

from sglang_shadowkv.kernels.chunk_stats import chunk_stats, chunk_stats_reference
from sglang_shadowkv.kernels.rotary import RotaryTables, apply_rotary
from sglang_shadowkv.mem_cache.compressed_pool import Segment, ShadowKVPool

from .config import LOWRANK_METHODS, ShadowKVConfig

AUTO_EIGH_MAX_DIM = 256
POWER_ITERATIONS = 4
FIT_NOISE = 1e-2  # a key's relative rebuild error below this is rounding (bf16, tf32), not a misfit


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
    """Orthonormalise the columns of tall float64 matrices [..., n, k] by Cholesky-QR, twice
    (CholeskyQR2): small batched GEMMs, a Cholesky and a triangular solve each, where a Householder
    QR on the GPU is a long chain of tiny kernels. Column j stays in the span of the first j+1
    input columns (the factor is triangular). The shift keeps the Cholesky defined when y is
    nearly rank-deficient."""
    for _ in range(2):
        gram = y.mT @ y
        diag = gram.diagonal(dim1=-2, dim2=-1)
        diag.add_(diag.mean(-1, keepdim=True) * 1e-13 + 1e-300)
        factor, _ = torch.linalg.cholesky_ex(gram)
        y = torch.linalg.solve_triangular(factor, y.mT, upper=False).mT
    return y


def top_subspace(grams: torch.Tensor, k: int, iters: int = POWER_ITERATIONS) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows spanning the top-k eigenspaces of symmetric PSD matrices [..., n, n], by block power
    iteration in float64 (GEMMs on an n × k block instead of an n × n eigh), batched.

    The first r rows span the power iteration of the first r start vectors on their own (the
    orthonormalisation is triangular), so every prefix of the rows is a near-top-r subspace (its
    reconstruction error within 1% of the SVD's after 4 iterations) and its energy is the sum of
    the rows' Rayleigh quotients: the energy rule reads the rank from them, no eigh needed.
    Returns (Rayleigh quotients [..., k] in row order, float64; rows [..., k, n], float32).
    """
    g = grams.double()
    n = g.shape[-1]
    gen = torch.Generator(device=g.device).manual_seed(0)
    q = torch.randn(n, k, device=g.device, dtype=torch.float64, generator=gen).expand(*g.shape[:-2], n, k)
    for _ in range(iters):
        q = _orthonormal_columns(g @ q)
    quotients = (q * (g @ q)).sum(-2)
    return quotients, q.mT.float()


def resolve_lowrank_method(method: str, dim: int) -> str:
    """`auto`: a full eigh of the Gram matrix when it is small (exact, cheap), else subspace
    iteration (a 1024 × 1024 eigh alone costs ~11 ms on an H100, 3% of a 128K-token dense layer)."""
    if method != "auto":
        return method
    return "eigh" if dim <= AUTO_EIGH_MAX_DIM else "subspace"


def gram(k_pre: torch.Tensor) -> torch.Tensor:
    """k_preᵀk_pre [dim, dim] in float32 (TF32 on the GPU)."""
    x = k_pre.float()
    with tf32_matmuls():
        return x.T @ x


def svd_spectrum(k_pre: torch.Tensor, rank_cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(squared singular values [rank_cap], float64; right singular vectors [rank_cap, dim]; their
    total, all squared singular values) of k_pre [s, dim]: the paper's truncated SVD."""
    _, s, vecs = torch.linalg.svd(k_pre.float(), full_matrices=False)
    return s[:rank_cap].double() ** 2, vecs[:rank_cap], (s.double() ** 2).sum()


def spectrum_of_grams(grams: torch.Tensor, rank_cap: int, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(energies [..., w] in row order, orthonormal rows [..., w, dim]) of Gram matrices, w = rank_cap:
    eigh (exact, sorted) or subspace iteration (see `top_subspace`)."""
    dim = grams.shape[-1]
    if resolve_lowrank_method(method, dim) == "eigh" or rank_cap >= dim:
        evals, evecs = symmetric_eigh(grams)
        return evals.flip(-1)[..., :rank_cap].double(), evecs.flip(-1).mT[..., :rank_cap, :]
    return top_subspace(grams, rank_cap)


def padded_bases(energies: torch.Tensor, rows: torch.Tensor, totals: torch.Tensor, max_rank: int,
                 energy: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bases [..., max_rank, dim], zero past each rank, and the ranks [...] (int64, on the rows'
    device: no host sync, so a compression queues without the host waiting on it). With `energy`,
    a rank is the fewest leading rows whose energies keep that share of the total (the Gram
    matrix's trace), at most the rows' count; without it, every row."""
    width = rows.shape[-2]
    ranks = torch.full(rows.shape[:-2], width, device=rows.device, dtype=torch.int64)
    if energy is not None:
        kept = torch.cumsum(energies.clamp(min=0).double(), -1) / totals.double().clamp(min=1e-30)[..., None]
        ranks = torch.clamp((kept < energy).sum(-1) + 1, max=width)
    bases = torch.zeros(*rows.shape[:-2], max_rank, rows.shape[-1], device=rows.device)
    bases[..., :width, :] = rows * (torch.arange(width, device=rows.device) < ranks[..., None])[..., None]
    return bases, ranks


def low_rank_basis(k_pre: torch.Tensor, max_rank: int, energy: float | None = None,
                   method: str = "auto") -> torch.Tensor:
    """Orthonormal rows B [r, dim] spanning the top-r right singular subspace of k_pre [s, dim].

    eigh: top eigenvectors of the Gram matrix G = k_preᵀk_pre (one GEMM and a dim × dim eigh).
    subspace: the same subspace by block power iteration on G (GEMMs only, for large dims).
    svd: the paper's truncated SVD of the tall matrix. auto: see `resolve_lowrank_method`.
    With `energy`, r is the smallest rank whose squared singular values keep that fraction of the
    total (trace of G), capped at max_rank.
    """
    rank_cap = min(max_rank, k_pre.shape[1])
    if method == "svd":
        energies, rows, total = svd_spectrum(k_pre, rank_cap)
    elif method in LOWRANK_METHODS:
        g = gram(k_pre)
        (energies, rows), total = spectrum_of_grams(g, rank_cap, method), g.diagonal().sum()
    else:
        raise ValueError(f"method must be one of {LOWRANK_METHODS}, got {method!r}")
    basis, rank = padded_bases(energies, rows, total, max_rank, energy)
    return basis[:int(rank)].contiguous()


def chunk_landmarks(k_post: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Landmarks [n, H, D] (chunk means, float32) and each chunk's least cosine similarity between
    a key and its mean [n, H]: how badly the landmark represents the chunk's keys."""
    stats_fn = chunk_stats if k_post.is_cuda else chunk_stats_reference
    return stats_fn(k_post, chunk_size)


def outlier_chunks(min_cos: torch.Tensor, fit_error: torch.Tensor, count: int) -> torch.Tensor:
    """Per KV head the `count` chunks kept exact [H, count]: chunks the compressed form misrepresents.
    Chunk 0 (the attention sink) and, up to half of them, those whose landmark represents their keys
    worst (least min_cos [n, H]: the selection misjudges them); the rest, those whose keys the
    low-rank basis fits worst (largest fit_error [n, H], relative: their rebuilt keys are wrong),
    then, when fewer chunks than that are fitted worse than FIT_NOISE, by the landmark rule again.
    The energy rule fits the basis to a document's bulk, so rare tokens (a needle, a fact's digits
    among filler) are rebuilt with several times the error of the rest: on a memo of 12 look-alike
    facts in 4K tokens every fact chunk is among the 48 worst fitted, while the landmark rule keeps
    from none to all of them depending on the layer and head, and answers over it changed. Errors
    under FIT_NOISE are rounding (a basis of full rank), which must not pick chunks: it differs
    between a basis of all KV heads and one of a tensor-parallel rank's heads."""
    by_landmark = min_cos.T.clone()
    by_landmark[:, 0] = float("-inf")
    first = by_landmark.topk((count + 1) // 2, dim=1, largest=False).indices
    error = fit_error.T.float()
    badness = torch.where(error > FIT_NOISE, 2 + error, -by_landmark)  # fitted worse first, then min_cos
    rest = badness.scatter(1, first, float("-inf")).topk(count - first.shape[1], dim=1).indices
    return torch.cat([first, rest], 1)


class SegmentCompression:
    """The compression of one segment into the pool, fed one layer at a time (`add_layer`, as
    each layer's keys and values become available) and completed by `finish`, which solves every
    layer's low-rank basis at once and writes the low-rank keys and the outlier chunks (chosen
    partly by how the basis fits them), re-reading each layer's keys and values."""

    def __init__(self, pool: ShadowKVPool, seg: Segment, rotary: RotaryTables, cfg: ShadowKVConfig,
                 layers: Iterable[int] | None = None):
        self.pool, self.seg, self.rotary, self.cfg = pool, seg, rotary, cfg
        self.layers = list(range(pool.num_layers) if layers is None else layers)
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        dim = pool.num_kv_heads * pool.head_dim
        self.rank_cap = min(pool.max_rank, dim)
        self.svd = cfg.lowrank_method == "svd"
        if self.svd:  # the paper's SVD needs the keys themselves: solved per layer as it comes
            self.energies = torch.zeros(len(self.layers), self.rank_cap, dtype=torch.float64, device=pool.device)
            self.rows = torch.zeros(len(self.layers), self.rank_cap, dim, device=pool.device)
            self.totals = torch.zeros(len(self.layers), dtype=torch.float64, device=pool.device)
        else:
            self.grams = torch.empty(len(self.layers), dim, dim, device=pool.device)
        self.min_cos = torch.empty(len(self.layers), seg.num_chunks, pool.num_kv_heads, device=pool.device)
        self.added = 0

    def _pre_rope_keys(self, k_post: torch.Tensor) -> torch.Tensor:
        seg = self.seg
        positions = torch.arange(seg.start, seg.start + seg.num_tokens, device=k_post.device)
        k_pre = apply_rotary(self.rotary, k_post, positions, inverse=True, out_dtype=torch.float32)
        return k_pre.reshape(seg.num_tokens, -1)

    def add_layer(self, layer: int, k_post: torch.Tensor, v: torch.Tensor) -> None:
        """Compress the segment's keys/values [num_tokens, H, D] of one layer, all but its low-rank
        keys and outliers: landmarks, host values and the exact copy now, the keys' Gram matrix
        and the landmarks' fit for `finish`."""
        pool, seg, i = self.pool, self.seg, self.index[layer]
        k_pre = self._pre_rope_keys(k_post)
        if self.svd:
            self.energies[i], self.rows[i], self.totals[i] = svd_spectrum(k_pre, self.rank_cap)
        else:
            self.grams[i] = gram(k_pre)
        landmarks, self.min_cos[i] = chunk_landmarks(k_post, pool.chunk_size)
        pool.write_landmarks(layer, seg, landmarks)
        pool.write_host_values(layer, seg, v.to(pool.dtype))
        pool.write_exact_copy(layer, seg, k_post, v)
        self.added += 1

    def finish(self, kv_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Solve every layer's basis together, then write each layer's basis, rank, low-rank keys
        and outlier chunks (kv_of(layer): the layer's post-RoPE keys and values again, as given to
        add_layer). On a GPU the ranks stay 0-dim device tensors in seg.ranks, their copy to the
        host started (Segment.stage_ranks; settle_ranks reads them)."""
        if self.added != len(self.layers):
            raise RuntimeError(f"finish after {self.added} of {len(self.layers)} layers")
        pool, seg = self.pool, self.seg
        if self.svd:
            energies, rows, totals = self.energies, self.rows, self.totals
        else:
            energies, rows = spectrum_of_grams(self.grams, self.rank_cap, self.cfg.lowrank_method)
            totals = self.grams.diagonal(dim1=-2, dim2=-1).sum(-1)
            self.grams = None
        bases, ranks = padded_bases(energies, rows, totals, pool.max_rank, self.cfg.energy)
        c, h, d = pool.chunk_size, pool.num_kv_heads, pool.head_dim
        for i, layer in enumerate(self.layers):
            pool.write_basis(layer, seg, bases[i])
            pool.basis_rank[layer][seg.seg_id] = ranks[i]
            seg.ranks[layer] = ranks[i]
            k_post, v = kv_of(layer)
            k_pre = self._pre_rope_keys(k_post)
            with tf32_matmuls():
                low_rank = k_pre @ bases[i].T
                rebuilt = low_rank @ bases[i]
            pool.write_lowrank(layer, seg, low_rank)
            per_head = (seg.num_chunks, c, h, d)  # a key's error relative to its norm, the worst of its chunk
            error = (k_pre - rebuilt).view(per_head).norm(dim=-1) / k_pre.view(per_head).norm(dim=-1).clamp_min(1e-30)
            fit_error = error.amax(1)  # [n, H]
            self._write_outliers(layer, k_post, v, outlier_chunks(self.min_cos[i], fit_error, seg.num_outliers))
        seg.stage_ranks()

    def _write_outliers(self, layer: int, k_post: torch.Tensor, v: torch.Tensor, outlier_ids: torch.Tensor) -> None:
        """Outlier chunks [H, o] of one layer: their exact keys and values into the segment's
        outlier blocks, their positions, and not selectable."""
        pool, seg = self.pool, self.seg
        c, h, d, n = pool.chunk_size, pool.num_kv_heads, pool.head_dim, seg.num_chunks
        heads = torch.arange(h, device=k_post.device)[:, None]
        blocks = seg.outlier_blocks.flatten().long()
        pool.outlier_pos[layer][blocks] = (seg.start + outlier_ids.flatten() * c).int()
        for memory, x in ((pool.blocks_k, k_post), (pool.blocks_v, v)):  # chunk o of head h: [H, o, c, D]
            memory[layer][blocks] = x.view(n, c, h, d)[outlier_ids, :, heads].reshape(-1, c, d).to(pool.dtype)
        selectable = torch.ones(h, n, dtype=torch.int8, device=k_post.device)
        selectable.scatter_(1, outlier_ids, 0)
        pool.selectable[layer][seg.chunk_slots] = selectable.T.contiguous()


def compress_layer(pool: ShadowKVPool, seg: Segment, layer: int, k_post: torch.Tensor,
                   v: torch.Tensor, rotary: RotaryTables, cfg: ShadowKVConfig) -> None:
    """Compress one layer of a segment on its own (benchmarks and probes; the engine compresses
    a segment's layers together). Its rank goes to seg.ranks (settle_ranks reads it)."""
    job = SegmentCompression(pool, seg, rotary, cfg, layers=[layer])
    job.add_layer(layer, k_post, v)
    job.finish(lambda _: (k_post, v))

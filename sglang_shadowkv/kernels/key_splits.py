"""Splitting an attention program's keys among several programs, and merging what they found.

A decode program (one request's KV head) walks all of its keys alone; when there are fewer such
programs than SMs, most of the GPU idles while each walks a long range in sequence. Splitting the
keys S ways gives S programs a share each; every split stores its partial output and the
log-sum-exp of its scores, and `merge_splits` weights the partial outputs by their share of the
softmax. Used by the dense decode kernel (ragged_paged_attention.py) and the sparse one
(sparse_decode_attention.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sglang_shadowkv.kernels.head_dims import dim_pad, head_dims

MIN_BLOCKS_PER_SPLIT = 4  # a split's least work: its fixed cost (q, output, merge) is a few blocks'
MAX_SPLITS = 16


def key_splits(programs: int, key_blocks: int, device: torch.device, least: int = 1) -> int:
    """How many ways to split each program's key blocks: `least` (the launch's) once the programs
    fill half the SMs (on the H100, 3 splits of 128 programs lost 18% for 4 suffix tiles, where 2
    of a decode batch's gained 18%: DECODE_LAUNCH); else enough for two programs per SM; each
    split at least MIN_BLOCKS_PER_SPLIT blocks, at most MAX_SPLITS, rounded down to a power of two;
    1 on a CPU. Measured there (benchmarks/bench_kernels.py key_splits, 9 splits): a decode batch
    of 1 took 25 µs a layer instead of 103, one 64-query tile 68 instead of 214."""
    if device.type != "cuda":
        return 1
    wanted = least if 2 * programs > sm_count(device) else triton.cdiv(2 * sm_count(device), programs)
    return power_of_two_at_most(min(MAX_SPLITS, wanted, key_blocks // MIN_BLOCKS_PER_SPLIT))


DECODE_PROGRAMS_PER_SM = 4


def decode_key_splits(requests: int, kv_heads: int, device: torch.device) -> int:
    """A dense decode batch's key splits (ragged_paged_attention.py): about DECODE_PROGRAMS_PER_SM
    programs per SM, at most MAX_SPLITS, a power of two; 1 on a CPU. One count per batch size,
    whatever its rows' lengths, so that a CUDA graph captured for a batch size serves every step
    of it; a split past a short row's end stores nothing but -inf."""
    if device.type != "cuda":
        return 1
    return power_of_two_at_most(min(MAX_SPLITS, triton.cdiv(DECODE_PROGRAMS_PER_SM * sm_count(device),
                                                             requests * kv_heads)))


def power_of_two_at_most(wanted: int) -> int:
    """The largest power of two not above wanted (1 for wanted below 1)."""
    return 1 << (max(1, wanted).bit_length() - 1)


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor | None = None) -> torch.Tensor:
    """out [rows, heads, D] from the splits' partial outputs [S, rows, heads, D] (float32) and
    log-sum-exps [S, rows, heads]; lse [rows, heads] (optional) gets the merged log-sum-exp."""
    splits, rows, heads, head_dim = part_out.shape
    _merge_splits_kernel[(rows * heads,)](part_out, part_lse, out, part_lse if lse is None else lse, rows * heads,
                                          heads, out.stride(0), out.stride(1), splits, lse is not None,
                                          SPLITS_PAD=MAX_SPLITS, HEAD_DIM=head_dim, DIM_PAD=dim_pad(head_dim))
    return out


@triton.jit(do_not_specialize=["SPLITS", "STORE_LSE"])
def _merge_splits_kernel(PART_OUT, PART_LSE, O_OUT, LSE, ROWS, HEADS, stride_ob, stride_oh, SPLITS, STORE_LSE,
                         SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """One (query row, head): the splits' partial outputs [S, rows·heads, D] weighted by their
    share exp(lse_s - lse) of the softmax; a row no split attended stays 0 with lse -inf."""
    r = tl.program_id(0)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d, d_ok = head_dims(HEAD_DIM, DIM_PAD)
    part_lse = tl.load(PART_LSE + offs_s * ROWS + r, mask=offs_s < SPLITS, other=float("-inf"))
    m = tl.max(part_lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(part_lse - m_safe)
    total = tl.sum(w, 0)
    part = tl.load(PART_OUT + (offs_s * ROWS + r).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=(offs_s < SPLITS)[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    row, head = r // HEADS, r % HEADS
    tl.store(O_OUT + row.to(tl.int64) * stride_ob + head * stride_oh + offs_d, out.to(O_OUT.dtype.element_ty),
             mask=d_ok)
    if STORE_LSE:
        tl.store(LSE + r, tl.where(total == 0.0, float("-inf"), m_safe + tl.log(tl.where(total == 0.0, 1.0, total))))

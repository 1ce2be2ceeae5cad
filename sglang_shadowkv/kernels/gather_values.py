"""Copy selected value chunks from the host pool into the GPU scratch.

The host pool is [host slots, Hkv, c, D], so one chunk of one KV head is one contiguous read of
c·D elements; chunk slot s's values are at host slot host_slot[s] (the GPU state of a chunk lives
in the dense pool's pages, its values in a host pool of its own). On the GPU the pool is pinned
host memory that the kernel reads directly over PCIe (UVA zero-copy): no staging copy, no CPU
work. Jobs and where they land (blocks_v: the pool's V memory as [c, D] blocks, found through
scratch_pages) are as in `rebuild_keys` (-1 = cache hit). An int8 host pool comes with a scale per
chunk slot and KV head (on the GPU); the copy multiplies by it on the way into the scratch, so
PCIe carries one byte per value.

`resident`: some compressed chunks also have a copy of their (host-format) values in the dense
pool's pages (ShadowKVPool's GPU values): resident = (home, k_blocks, v_blocks), where home[slot]
>= 0 names block home >> 1 of k_blocks (home even) or v_blocks (odd), [blocks, Hkv, c, D] views of
a layer's K and V memory. Those chunks are read there, at HBM speed, instead of over PCIe; the
copy equals the host's bit for bit, so the result does not depend on where a chunk was read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_shadowkv.kernels.padding_rows import live_rows
from sglang_shadowkv.kernels.scratch_blocks import scratch_block, scratch_jobs

# the persistent grid's size and each program's chunks per step. On the H100 (maintainers/
# experiments/tune_decode_kernels.py, 16 requests x 256 chunks per KV head) from the GPU copy 4 chunks a step
# took 55 µs a layer on 4 programs per SM, against 143 for 1 on 2 (48 requests: 143 against 412);
# beside the key rebuild on the other stream, 200 µs with 4 programs per SM, 213 with 2, 202 with 8.
# From pinned host memory every grid alone runs at PCIe speed (49 GB/s), but beside the rebuild 4
# per SM took 754 µs, 2 took 689 and 8 took 779: 4 is best where the values sit on the GPU (as
# they do while memory allows) and gives up 9% where they do not
PROGRAMS_PER_SM = 4
JOBS_PER_STEP = 4


def gather_values_reference(host_v, host_slot, jobs, blocks_v, scratch_pages, scratch_rows, scale=None,
                            resident=None, live=None):
    """Writes the scratch entry (b, h, e) in blocks_v = host_v[host_slot[jobs[b, h, e]], h] (or its
    resident copy; times scale[that chunk slot, h] when given) for every job >= 0 of rows before
    live (padding_rows); returns blocks_v."""
    n = live_rows(live, jobs.shape[0])
    slots, h_idx, blocks = scratch_jobs(jobs[:n], scratch_pages, scratch_rows[:n])
    if slots.numel() == 0:
        return blocks_v
    host = host_slot[slots].long()
    chunks = host_v[host.to(host_v.device), h_idx.to(host_v.device)].to(blocks_v.device)
    if resident is not None:
        home, k_blocks, v_blocks = resident
        at = home[slots].long()
        for side, memory in enumerate((k_blocks, v_blocks)):
            mine = (at >= 0) & (at % 2 == side)
            chunks[mine] = memory[at[mine] // 2, h_idx[mine]]
    if scale is not None:
        chunks = chunks.float() * scale[slots, h_idx][:, None, None]
    blocks_v[blocks] = chunks.to(blocks_v.dtype)
    return blocks_v


@triton.jit
def _gather_values_kernel(HOST, HOST_SLOT, JOBS, OUT, SCRATCH_PAGES, ROWS, SCALE, HOME, RES_K, RES_V, LIVE,
                          NUM_JOBS, stride_hs, stride_hh, stride_jb, stride_jh, stride_ob, stride_sp, stride_ss,
                          HEADS: tl.constexpr, ENTRIES: tl.constexpr, NUMEL: tl.constexpr, BLOCK: tl.constexpr,
                          JOBS_PER_STEP: tl.constexpr, SCALED: tl.constexpr, RESIDENT: tl.constexpr,
                          GATED: tl.constexpr):
    """A persistent grid: each program walks the jobs JOBS_PER_STEP at a time (jobs pid·J.., then
    P·J further on), so the copy keeps enough reads in flight while leaving most SMs free for the
    key rebuild on the other stream. Resident blocks have the host pool's strides. Jobs are
    row-major: the live rows' are the first live·HEADS·ENTRIES."""
    offs = tl.arange(0, BLOCK)
    valid = offs < NUMEL
    offs_j = tl.arange(0, JOBS_PER_STEP)
    if GATED:
        NUM_JOBS = tl.minimum(NUM_JOBS, tl.load(LIVE) * HEADS * ENTRIES)
    for first in range(tl.program_id(0) * JOBS_PER_STEP, NUM_JOBS, tl.num_programs(0) * JOBS_PER_STEP):
        i = tl.minimum(first + offs_j, NUM_JOBS - 1)
        b = i // (HEADS * ENTRIES)
        h = (i // ENTRIES) % HEADS
        e = i % ENTRIES
        slot = tl.load(JOBS + b * stride_jb + h * stride_jh + e).to(tl.int64)  # (int32 or int64 jobs)
        todo = (slot >= 0) & (first + offs_j < NUM_JOBS)
        if tl.max(todo.to(tl.int32), 0) > 0:  # (a step of cache hits only moves nothing)
            slot = tl.where(todo, slot, 0)
            at = tl.load(HOST_SLOT + slot, mask=todo, other=0).to(tl.int64) * stride_hs + h * stride_hh
            src = HOST + at[:, None] + offs[None, :]
            if RESIDENT:
                home = tl.load(HOME + slot, mask=todo, other=-1).to(tl.int64)
                at = ((home >> 1) * stride_hs + h * stride_hh)[:, None] + offs[None, :]
                res = tl.where(((home & 1) == 0)[:, None], RES_K + at, RES_V + at)
                src = tl.where((home >= 0)[:, None], res, src)
            row = tl.load(ROWS + b).to(tl.int64)
            dst = OUT + scratch_block(SCRATCH_PAGES, stride_sp, row, e, h, HEADS)[:, None] * stride_ob + offs[None, :]
            mask = todo[:, None] & valid[None, :]
            chunk = tl.load(src, mask=mask)
            if SCALED:
                chunk = chunk.to(tl.float32) * tl.load(SCALE + slot * stride_ss + h, mask=todo, other=0.0)[:, None]
            tl.store(dst, chunk.to(OUT.dtype.element_ty), mask=mask)


def gather_values(host_v, host_slot, jobs, blocks_v, scratch_pages, scratch_rows, scale=None, resident=None,
                  live=None, programs: int | None = None, jobs_per_step: int | None = None):
    """Triton version of `gather_values_reference`; host_v may be pinned CPU memory (read via UVA).

    programs: size of the persistent grid (default: PROGRAMS_PER_SM per SM on a GPU); jobs_per_step:
    chunks a program moves at once (default JOBS_PER_STEP, a power of two).
    """
    b, hkv, e = jobs.shape
    if jobs.numel() == 0:
        return blocks_v
    numel = host_v.shape[2] * host_v.shape[3]
    if host_v.stride(2) != host_v.shape[3] or host_v.stride(3) != 1 or blocks_v.stride(1) != blocks_v.shape[2] \
            or blocks_v.stride(2) != 1:
        raise ValueError("host_v and blocks_v chunks must be contiguous [c, D] blocks")
    if jobs.stride(2) != 1 or scratch_pages.stride(1) != 1:
        raise ValueError("jobs and scratch_pages must be contiguous in their last dimension")
    if programs is None:
        programs = PROGRAMS_PER_SM * torch.cuda.get_device_properties(jobs.device).multi_processor_count \
            if jobs.is_cuda else 4
    jobs_per_step = jobs_per_step or JOBS_PER_STEP
    if jobs_per_step & (jobs_per_step - 1) or programs < 1:
        raise ValueError(f"jobs_per_step must be a power of two and programs positive, got {jobs_per_step}, {programs}")
    if scale is not None and scale.stride(1) != 1:
        raise ValueError("scale must be contiguous over KV heads")
    home, res_k, res_v = resident if resident is not None else (jobs, host_v, host_v)  # (unread if None)
    if resident is not None and any(r.stride()[:2] != host_v.stride()[:2] or r.dtype != host_v.dtype
                                    for r in (res_k, res_v)):
        raise ValueError("resident value blocks must have the host pool's dtype and [Hkv, c, D] strides")
    _gather_values_kernel[(min(programs, triton.cdiv(jobs.numel(), jobs_per_step)),)](
        host_v, host_slot, jobs, blocks_v, scratch_pages, scratch_rows,
        jobs if scale is None else scale, home, res_k, res_v,  # (SCALE unread if unscaled, LIVE without a gate)
        scratch_rows if live is None else live, jobs.numel(),
        host_v.stride(0), host_v.stride(1), jobs.stride(0), jobs.stride(1),
        blocks_v.stride(0), scratch_pages.stride(0), 0 if scale is None else scale.stride(0),
        HEADS=hkv, ENTRIES=e, NUMEL=numel, BLOCK=triton.next_power_of_2(numel), JOBS_PER_STEP=jobs_per_step,
        SCALED=scale is not None, RESIDENT=resident is not None, GATED=live is not None)
    return blocks_v

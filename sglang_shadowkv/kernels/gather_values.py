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

from sglang_shadowkv.kernels.scratch_blocks import scratch_block, scratch_jobs


def gather_values_reference(host_v, host_slot, jobs, blocks_v, scratch_pages, scratch_rows, scale=None,
                            resident=None):
    """Writes the scratch entry (b, h, e) in blocks_v = host_v[host_slot[jobs[b, h, e]], h] (or its
    resident copy; times scale[that chunk slot, h] when given) for every job >= 0; returns blocks_v."""
    slots, h_idx, blocks = scratch_jobs(jobs, scratch_pages, scratch_rows)
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
def _gather_values_kernel(HOST, HOST_SLOT, JOBS, OUT, SCRATCH_PAGES, ROWS, SCALE, HOME, RES_K, RES_V, NUM_JOBS,
                          stride_hs, stride_hh, stride_jb, stride_jh, stride_ob, stride_sp, stride_ss,
                          HEADS: tl.constexpr, ENTRIES: tl.constexpr, NUMEL: tl.constexpr,
                          BLOCK: tl.constexpr, SCALED: tl.constexpr, RESIDENT: tl.constexpr):
    """A persistent grid: each program walks jobs pid, pid + P, ... so the copy keeps enough reads
    in flight to fill PCIe while leaving most SMs free for the key rebuild on the other stream.
    Resident blocks have the host pool's strides."""
    offs = tl.arange(0, BLOCK)
    valid = offs < NUMEL
    for i in range(tl.program_id(0), NUM_JOBS, tl.num_programs(0)):
        b = i // (HEADS * ENTRIES)
        h = (i // ENTRIES) % HEADS
        e = i % ENTRIES
        slot = tl.load(JOBS + b * stride_jb + h * stride_jh + e)
        if slot >= 0:
            src = HOST + tl.load(HOST_SLOT + slot).to(tl.int64) * stride_hs + h * stride_hh + offs
            if RESIDENT:
                home = tl.load(HOME + slot).to(tl.int64)
                if home >= 0:
                    at = (home >> 1) * stride_hs + h * stride_hh + offs
                    src = tl.where((home & 1) == 0, RES_K + at, RES_V + at)
            row = tl.load(ROWS + b).to(tl.int64)
            dst = OUT + scratch_block(SCRATCH_PAGES, stride_sp, row, e, h, HEADS) * stride_ob + offs
            chunk = tl.load(src, mask=valid)
            if SCALED:
                chunk = chunk.to(tl.float32) * tl.load(SCALE + slot.to(tl.int64) * stride_ss + h)
            tl.store(dst, chunk.to(OUT.dtype.element_ty), mask=valid)


def gather_values(host_v, host_slot, jobs, blocks_v, scratch_pages, scratch_rows, scale=None, resident=None,
                  programs: int | None = None):
    """Triton version of `gather_values_reference`; host_v may be pinned CPU memory (read via UVA).

    programs: size of the persistent grid (default: two per SM on a GPU).
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
        programs = 2 * torch.cuda.get_device_properties(jobs.device).multi_processor_count \
            if jobs.is_cuda else 4
    if scale is not None and scale.stride(1) != 1:
        raise ValueError("scale must be contiguous over KV heads")
    home, res_k, res_v = resident if resident is not None else (jobs, host_v, host_v)  # (unread if None)
    if resident is not None and any(r.stride()[:2] != host_v.stride()[:2] or r.dtype != host_v.dtype
                                    for r in (res_k, res_v)):
        raise ValueError("resident value blocks must have the host pool's dtype and [Hkv, c, D] strides")
    _gather_values_kernel[(min(programs, jobs.numel()),)](
        host_v, host_slot, jobs, blocks_v, scratch_pages, scratch_rows,
        jobs if scale is None else scale, home, res_k, res_v, jobs.numel(),  # (SCALE unread if unscaled)
        host_v.stride(0), host_v.stride(1), jobs.stride(0), jobs.stride(1),
        blocks_v.stride(0), scratch_pages.stride(0), 0 if scale is None else scale.stride(0),
        HEADS=hkv, ENTRIES=e, NUMEL=numel, BLOCK=triton.next_power_of_2(numel), SCALED=scale is not None,
        RESIDENT=resident is not None)
    return blocks_v

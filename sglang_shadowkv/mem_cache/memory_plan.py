"""How a GPU's memory (and, for ShadowKV, the host's) is given to the KV pools.

Both attention modes give the dense page pool `mem_fraction_static` of the free GPU memory. With
ShadowKV that one pool holds both forms of a document (dense pages, or compressed state in pages:
mem_cache/compressed_pool.py), so the split between them follows what is cached, and the sparse
decoder's chunk-cache scratch takes its pages while compressed requests run; only the small
per-page metadata of compressed state is set aside beside the pool. Compressed values live in
page-locked host memory, `shadowkv_host_mem_fraction` of what the machine has available, and
exact copies of compressed documents' keys and values (for questions' prefills) in
`shadowkv_exact_copy_fraction` more.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Callable

import torch

DOCUMENT_SIZES = (16384, 32768, 131072)  # the sizes capacity reports count
# host memory the host tier leaves to the processes themselves, as SGLang's HiCache does (10 GB): on
# the lent 128 GiB H100 machine ShadowKV's values (half of what was available) and a tier taking 90%
# of the rest left ~6 GB for the server's processes and anything beside them
HOST_RESERVE_BYTES = 10 << 30


@dataclass
class MemoryPlan:
    pool_tokens: int  # the dense page pool (both forms with ShadowKV)
    host_chunks: int  # compressed chunks whose values the host pool holds (0: full attention)
    gpu_budget_bytes: int = 0
    host_budget_bytes: int = 0
    set_aside_bytes: int = 0  # ShadowKV's per-page metadata, beside the pool
    copy_chunks: int = 0  # compressed chunks whose exact copies host memory holds (mem_cache/exact_copies.py)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (free plus reclaimable caches), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_tier_bytes(ranks: int) -> int:
    """Page-locked host memory one rank's host tier may take: what is available less
    HOST_RESERVE_BYTES, shared by the ranks of the host (they size their pools at once)."""
    return max(0, available_host_bytes() - HOST_RESERVE_BYTES) // ranks


def free_gpu_bytes(device: torch.device) -> int:
    """Free device memory, counting what torch's allocator caches but no tensor uses (loading
    leaves gigabytes of such blocks; without this the pools would be sized without them)."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def plan_gpu_memory(gpu_budget: int, bytes_per_token: int, metadata_per_token: int,
                    host_budget: int = 0, host_bytes_per_chunk: int = 0) -> MemoryPlan:
    """The pool's tokens from the GPU budget (bytes), each token costing its dense bytes plus
    `metadata_per_token`; the host pool's chunks from the host budget."""
    tokens = gpu_budget // (bytes_per_token + metadata_per_token)
    if tokens <= 0:
        raise MemoryError("the GPU has no room for a KV pool; raise mem_fraction_static or free GPU memory")
    host_chunks = host_budget // host_bytes_per_chunk if host_bytes_per_chunk else 0
    return MemoryPlan(tokens, host_chunks, gpu_budget, host_budget, tokens * metadata_per_token)


def documents_that_fit(pool_tokens: int, compressed_pages_for: Callable[[int], int] | None = None,
                       page_size: int = 8, host_chunks: int = 0) -> dict:
    """How many documents of each size the pool holds at once: dense, and (with ShadowKV)
    compressed (pages per compressed document from compressed_pages_for(tokens), values within
    the host pool)."""
    out = {}
    for size in DOCUMENT_SIZES:
        row = {"dense": pool_tokens // size}
        if compressed_pages_for is not None:
            row["compressed"] = min(pool_tokens // page_size // compressed_pages_for(size),
                                    host_chunks // (size // page_size))
        out[str(size)] = row
    return out

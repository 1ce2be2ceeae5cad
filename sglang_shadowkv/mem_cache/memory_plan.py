"""How a GPU's memory (and, for ShadowKV, the host's) is split between the KV pools.

Full attention gives the dense pool `mem_fraction_static` of the free GPU memory. With ShadowKV the
dense pool only has to hold what is dense at any time: long prompts while they prefill (compressed
when they complete), every running request's dense tail and short prompts. So it gets
DENSE_CONTEXTS full contexts plus DENSE_TAIL_TOKENS per running request, and the rest of the
static share goes to compressed segments (low-rank keys, landmarks, outliers) after the decoder's
chunk-cache scratch. Their values live in page-locked host memory, `shadowkv_host_mem_fraction` of
what the machine has available; the chunk slots are what both sides can hold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DENSE_CONTEXTS = 2  # long prompts prefilling at once (dense until compressed)
DENSE_TAIL_TOKENS = 1024  # per running request: its dense window and generated tokens
OUTLIER_BYTES_SHARE = 0.05  # of the compressed GPU budget, for segment bases and outliers
DOCUMENT_SIZES = (16384, 32768, 131072)  # the sizes capacity reports count


@dataclass
class ShadowKVMemory:
    dense_tokens: int
    chunk_slots: int
    limited_by: str  # "gpu" or "host"


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


def plan_shadowkv_memory(gpu_budget: int, host_budget: int, dense_bytes_per_token: int,
                         gpu_bytes_per_slot: int, host_bytes_per_slot: int, scratch_bytes: int,
                         context_length: int, max_running_requests: int) -> ShadowKVMemory:
    """Dense tokens and compressed chunk slots from the GPU and host budgets (bytes)."""
    dense_tokens = DENSE_CONTEXTS * context_length + DENSE_TAIL_TOKENS * max_running_requests
    dense_tokens = min(dense_tokens, gpu_budget // 2 // dense_bytes_per_token)
    left = gpu_budget - dense_tokens * dense_bytes_per_token - scratch_bytes
    if left <= 0:
        raise MemoryError(f"the GPU has no room for compressed state after {dense_tokens} dense tokens and "
                          f"{scratch_bytes / 2**30:.1f} GiB of chunk-cache scratch; lower "
                          "max_running_requests or shadowkv_max_requests")
    gpu_slots = int(left * (1 - OUTLIER_BYTES_SHARE)) // gpu_bytes_per_slot
    host_slots = host_budget // host_bytes_per_slot
    return ShadowKVMemory(dense_tokens, max(1, min(gpu_slots, host_slots)),
                          "gpu" if gpu_slots <= host_slots else "host")


def documents_that_fit(dense_tokens: int, compressed_tokens: int | None) -> dict:
    """How many documents of each size the pools hold at once: dense, and compressed."""
    out = {}
    for size in DOCUMENT_SIZES:
        row = {"dense": dense_tokens // size}
        if compressed_tokens is not None:
            row["compressed"] = compressed_tokens // size
        out[str(size)] = row
    return out

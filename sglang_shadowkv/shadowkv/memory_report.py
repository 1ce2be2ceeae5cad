"""Memory and chunk-cache numbers of one request with a compressed prefix, against a full KV cache."""

from __future__ import annotations

from sglang_shadowkv.mem_cache.compressed_pool import ShadowKVPool

from .decode import SparseDecoder
from .request_state import CompressedLayout


def request_report(store: ShadowKVPool, decoder: SparseDecoder, layout: CompressedLayout, row: int,
                   dense_tokens: int, kv_bytes_per_token: int, seq_len: int) -> dict:
    """dense_tokens: tokens the request holds in dense pages (window, outputs, dense prefix)."""
    hits, lookups, budget = decoder.row_stats(row)
    segment_ranks = [list(seg.settle_ranks()) for seg in layout.segments]
    sizes: dict[str, int] = {}
    for seg, n in zip(layout.segments, layout.segment_chunks):
        for key, value in store.segment_bytes(seg, n).items():
            sizes[key] = sizes.get(key, 0) + value
    dense = dense_tokens * kv_bytes_per_token
    full = seq_len * kv_bytes_per_token
    gpu = dense + sizes["gpu_compressed_bytes"] + decoder.scratch_bytes_per_request
    return {
        "compressed_tokens": layout.num_chunks * store.chunk_size,
        "segments": len(layout.segments),
        "ranks": segment_ranks[0],  # per layer, of its first segment
        "segment_ranks": segment_ranks,
        "budget": budget,  # chunks selected per KV head and step, per layer
        "outliers_per_head": layout.num_outliers,
        "dense_kv_bytes": dense,
        **sizes,
        "gpu_scratch_bytes": decoder.scratch_bytes_per_request,
        "gpu_total_bytes": gpu,
        "full_kv_bytes": full,
        "gpu_saving_vs_full": full / gpu,
        "chunk_cache_hits": hits,
        "chunk_cache_lookups": lookups,
        "chunk_cache_hit_rate": hits / lookups if lookups else 0.0,
    }

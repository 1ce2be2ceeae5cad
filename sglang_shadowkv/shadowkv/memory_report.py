"""Memory and chunk-cache numbers of one compressed request, against a full KV cache."""

from __future__ import annotations

from sglang_shadowkv.mem_cache.shadow_pool import Segment, ShadowKVPool

from .decode import SparseDecoder


def request_report(store: ShadowKVPool, decoder: SparseDecoder, seg: Segment, row: int,
                   dense_tokens: int, kv_bytes_per_token: int, seq_len: int) -> dict:
    """dense_tokens: tokens the request still holds in dense pages (window, outputs, matched prefix)."""
    hits, lookups = decoder.hit_counts(row)
    sizes = store.segment_bytes(seg)
    dense = dense_tokens * kv_bytes_per_token
    full = seq_len * kv_bytes_per_token
    gpu = dense + sizes["gpu_compressed_bytes"] + decoder.scratch_bytes_per_request
    return {
        "compressed_tokens": seg.num_tokens,
        "ranks": list(seg.ranks),
        "outliers_per_head": seg.num_outliers,
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

"""What server_info reports of the compressed tier: its counters (the tier rule's reasons among
them), the rates that rule reads, the ranks and budgets chosen, the pools, who holds compressed
state (so a leak shows), and totals over the running requests."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from sglang_shadowkv.mem_cache.compressed_pool import ChunkRef

from .request import Req

if TYPE_CHECKING:
    from .compressed_tier import CompressedTier

RUNNING_TOTALS = ("dense_kv_bytes", "gpu_compressed_bytes", "gpu_scratch_bytes", "gpu_total_bytes", "host_bytes",
                  "full_kv_bytes", "chunk_cache_hits", "chunk_cache_lookups")


def holders(tier: "CompressedTier") -> dict:
    """Who holds the compressed state: once idle, every segment, host slot and chunk reference is
    free or the radix tree's (or a demotion's), and every scratch row is free."""
    store, tree = tier.store, tier.tree
    refs = [e for e in tree.entries() if isinstance(e, ChunkRef)]  # on the GPU or parked in the host tier
    in_tree = {id(e.segment): e.segment for e in refs}
    demoting = [] if tier.demoter is None else tier.demoter.segments()
    return {"segments": store.max_segments, "free_segments": store.free_segments,
            "tree_segments": len(in_tree), "demoting_segments": len(demoting),
            "chunk_slots": store.chunk_capacity, "free_chunk_slots": store.free_chunks,
            "tree_chunk_slots": sum(seg.num_chunks for seg in in_tree.values()),
            "demoting_chunk_slots": sum(seg.num_chunks for seg in demoting),
            "chunk_refs": sum(seg.refs for seg in store.live.values()),
            "tree_chunk_refs": len(refs),
            "parked_segments": sum(seg.parked for seg in in_tree.values()),
            "scratch_rows": tier.decoder.max_rows, "free_scratch_rows": tier.decoder.free_rows}


def tier_stats(tier: "CompressedTier", running: list[Req]) -> dict:
    """Totals over running requests with a compressed prefix (and per request), the cache's
    compressed state and bytes per tier, pool capacity, and the cumulative counters."""
    tier.settle_ranks(wait=True)
    live = [r for r in running if r.over_compressed_prefix]
    reports = [tier.report(r) for r in live]
    total = {key: sum(r[key] for r in reports) for key in RUNNING_TOTALS}
    total["gpu_saving_vs_full"] = total["full_kv_bytes"] / total["gpu_total_bytes"] if reports else 0.0
    total["chunk_cache_hit_rate"] = (total["chunk_cache_hits"] / total["chunk_cache_lookups"]
                                     if total["chunk_cache_lookups"] else 0.0)
    done = max(1, tier.counters.compressions)
    pools = tier.store.capacity_bytes()
    page_bytes = tier.pool.bytes_per_token * tier.page_size
    counters = tier.counters.as_dict()
    if tier.demoter is not None:
        counters.update(tier.demoter.counters.as_dict())
    return {"config": dataclasses.asdict(tier.cfg), "running_compressed_requests": len(reports),
            "ranks": {"last_per_layer": tier.last_ranks,
                      "mean_per_layer": [round(t / done, 2) for t in tier.rank_totals]},
            "budget": tier.decoder.budget_stats(), "chunk_cache": tier.decoder.chunk_cache_stats(),
            "running_total": total, "per_request": {r.rid: rep for r, rep in zip(live, reports)},
            "pools": pools, "holders": holders(tier),
            "tiers": {"dense_tree_bytes": tier.tree.total_pages * page_bytes,
                      "compressed_gpu_bytes": pools["segment_pages"] * page_bytes,
                      "compressed_host_bytes": pools["segment_host_bytes"],
                      "compressed_gpu_value_bytes": pools["gpu_value_pages"] * page_bytes,  # lent pages
                      "droppable_compressed_pages": tier.droppable_pages},
            "tier_rates": tier.rates.as_dict(),  # what the tier rule reads (tier_choice.py)
            "radix_cache": {"compressed_tokens": tier.tree.total_chunks * tier.cfg.chunk_size,
                            "evictable_compressed_tokens": tier.tree.evictable_chunks * tier.cfg.chunk_size},
            **counters}

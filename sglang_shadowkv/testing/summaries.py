"""One-line summaries of benchmark results, shared by a benchmark and the tables read from its JSON
later, so both print the same words."""

from __future__ import annotations


def chosen_settings(bd: dict) -> str:
    """What ShadowKV's data-driven defaults chose on a workload (a breakdown's ranks and budget)."""
    ranks, budget = bd["ranks"], bd["budget"]
    return (f"ranks {min(ranks)}..{max(ranks)} (mean {sum(ranks) / len(ranks):.0f}), chunks per KV head and step "
            f"{budget['mean_chunks']:.1f} (p99 up to {max(budget['p99_chunks_per_layer'])}, cap {budget['max_chunks']}), "
            f"hit rate {bd['chunk_cache_hit_rate']:.2f}")


__all__ = ["chosen_settings"]

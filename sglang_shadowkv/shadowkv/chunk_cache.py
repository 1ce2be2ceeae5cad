"""The per-request chunk cache: which scratch entry holds which chunk, and what a step must fetch.

Adjacent decode steps select mostly the same chunks, so each (request, KV head) keeps a scratch of
K entries with the chunks it rebuilt and fetched before. A step's selection is matched against
it: hits are used in place, misses go to entries no selected chunk needs (stale entries stay until
reused, so a chunk dropped for a step and picked again later can still hit).
"""

from __future__ import annotations

import torch


def plan_chunk_cache(held: torch.Tensor, selected: torch.Tensor):
    """held [N, K]: chunk slot in each scratch entry (-1 empty); selected [N, K]: this step's chunk
    slots (-1 padding; no duplicates in a row).

    Returns (jobs, entries, new_held), each [N, K]: jobs[i, e] is the chunk slot to rebuild and
    fetch into entry e (-1: nothing), entries[i, j] the entry that holds selected[i, j] after the
    step (-1 for padding), new_held the scratch after the step.
    """
    n, k = held.shape
    valid = selected >= 0
    sorted_held, order = held.sort(dim=1)
    pos = torch.searchsorted(sorted_held, selected.contiguous()).clamp(max=k - 1)
    hit = valid & (sorted_held.gather(1, pos) == selected)
    hit_entry = order.gather(1, pos)
    kept = torch.zeros(n, k + 1, dtype=torch.int32, device=held.device)
    kept.scatter_add_(1, torch.where(hit, hit_entry, k), torch.ones_like(hit_entry, dtype=torch.int32))
    # the entries no hit needs, in order (free_entries[:, j]: the j-th), by a cumsum and a scatter:
    # a stable argsort did the same with a radix sort per layer and step
    free = kept[:, :k] == 0
    free_rank = torch.where(free, free.int().cumsum(1) - 1, k)
    free_entries = torch.zeros(n, k + 1, dtype=torch.int64, device=held.device)
    free_entries.scatter_(1, free_rank.long(), torch.arange(k, device=held.device).expand(n, k).contiguous())
    miss = valid & ~hit
    miss_rank = (miss.int().cumsum(1) - 1).clamp(min=0)
    target = free_entries.gather(1, miss_rank)
    entries = torch.where(hit, hit_entry, torch.where(miss, target, -1))
    scatter_at = torch.where(miss, target, k)  # column k is a dump for non-misses
    jobs = torch.full((n, k + 1), -1, dtype=held.dtype, device=held.device)
    jobs.scatter_(1, scatter_at, selected)
    jobs = jobs[:, :k]
    new_held = torch.where(jobs >= 0, jobs, held)
    return jobs, entries, new_held

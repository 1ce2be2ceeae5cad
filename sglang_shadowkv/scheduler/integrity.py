"""Pool accounting, checked (mini-sglang's check_integrity): every dense page, compressed chunk
slot, segment, scratch row and request row is free or held, and held by exactly one owner.

Owners: the radix tree (its entries), each running request (its own entries past the borrowed
prefix, the copies it made of entries another request cached first, its segment being
compressed, its scratch row with that row's pages, and its table row), each live compressed
segment (its pages: compressed state lives in the dense pool's pages; and the pages lent for its
GPU values, which the pool counts as lent), a demotion under way (its
segment) and the compressed pool itself (its null page). A compressed segment's reference count
must equal the chunk references that the tree and the requests hold. Run by the scheduler
whenever it goes idle with `--check-integrity` (tests turn it on), and by tests after random
sequences of requests.

Under tensor parallelism every rank must hold the same tree over the same page ids, with the same
free lists: `accounting_digest` sums that up, and the scheduler compares the ranks' digests.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import TYPE_CHECKING, Any, Protocol

from sglang_shadowkv.mem_cache.compressed_pool import ChunkRef, ParkedChunkRef
from sglang_shadowkv.mem_cache.host_kv_pool import HostPage, on_host

if TYPE_CHECKING:
    from .request import Req


class Pools(Protocol):
    """What the check reads of the cache manager (scheduler/cache.py): its radix tree, dense page
    pool, request table, the pages it promised to running requests, its compressed tier and its
    host tier."""
    tree: Any
    pool: Any
    table: Any
    compressed: Any
    host: Any
    reserved_pages: int


def check_pools(cache: Pools, running: list["Req"]) -> None:
    """Raise RuntimeError listing every accounting error found (none: return)."""
    errors: list[str] = []
    tree_entries = list(cache.tree.entries())
    owned = [e for r in running for e in r.pages[r.num_borrowed:] + r.duplicate_entries]
    pages = [e for e in tree_entries + owned if isinstance(e, int)]
    if cache.compressed is not None:  # compressed state, and the scratch rows' pages
        decoder = cache.compressed.decoder
        store = cache.compressed.store
        pages += store.held_pages() + store.copy_loads.held_pages() + [
            p for r in running if r.shadowkv is not None for p in decoder.pages_of_row(r.shadowkv.scratch_row)]
    _check_once(errors, "page", range(1, cache.pool.capacity + 1), cache.pool.free_ids(), pages)
    _check_tree_counts(errors, cache, tree_entries)
    reserved = sum(r.reserved_pages for r in running)
    if reserved != cache.reserved_pages:
        errors.append(f"reserved pages: the requests hold {reserved}, the cache counts {cache.reserved_pages}")
    rows = [r.pool_row for r in running if r.pool_row is not None]
    _check_once(errors, "request row", range(cache.table.padding_row), cache.table.free_ids(), rows)
    if cache.compressed is not None:
        _check_compressed(errors, cache, tree_entries, owned, running)
    if cache.host is not None:
        parked = [] if cache.compressed is None else cache.compressed.store.parked_segments()
        _check_host(errors, cache.host, tree_entries, [p for seg in parked for p in seg.host_pages])
    if errors:
        raise RuntimeError("pool accounting is broken: " + "; ".join(errors))


def _check_once(errors: list[str], what: str, universe, free: list, held: list) -> None:
    """Every id of the universe is free or held, once."""
    counts = Counter(free) + Counter(held)
    missing = [i for i in universe if counts[i] == 0]
    twice = sorted(i for i, n in counts.items() if n > 1)
    strangers = sorted(set(counts) - set(universe))
    if missing:
        errors.append(f"{len(missing)} {what}(s) neither free nor held (leaked), e.g. {missing[:5]}")
    if twice:
        errors.append(f"{len(twice)} {what}(s) free or held twice, e.g. {twice[:5]}")
    if strangers:
        errors.append(f"{what} ids outside the pool: {strangers[:5]}")


def _check_tree_counts(errors: list[str], cache: Pools, entries: list) -> None:
    dense = sum(type(e) is int for e in entries)
    host = sum(on_host(e) for e in entries)
    tree = cache.tree
    if (dense, len(entries) - dense - host, host) != (tree.total_pages, tree.total_chunks, tree.total_host):
        errors.append(f"radix tree counts {tree.total_pages} pages, {tree.total_chunks} chunks and "
                      f"{tree.total_host} host pages but holds {dense}, {len(entries) - dense - host} and {host}")


def _check_host(errors: list[str], host, tree_entries: list, parked_pages: list[int]) -> None:
    """Every host page is free, a tree entry, the copy of a dense page the tree holds, or a page
    of a parked compressed segment."""
    held = [e.id for e in tree_entries if type(e) is HostPage] + list(host.backups.values()) + parked_pages
    _check_once(errors, "host page", range(host.num_pages), host.free_ids(), held)
    strays = set(host.backups) - {e for e in tree_entries if type(e) is int}
    if strays:
        errors.append(f"{len(strays)} host copies of pages the radix tree does not hold, e.g. {sorted(strays)[:5]}")


def _check_compressed(errors: list[str], cache: Pools, tree_entries: list, owned: list,
                      running: list["Req"]) -> None:
    tier = cache.compressed
    store, decoder = tier.store, tier.decoder
    refs = Counter(id(e.segment) for e in tree_entries + owned if isinstance(e, ChunkRef))
    unreferenced = {id(r.shadowkv.segment) for r in running if r.shadowkv is not None and r.shadowkv.segment}
    unreferenced |= {id(seg) for seg in ([] if tier.demoter is None else tier.demoter.segments())}
    for seg in store.live.values():
        if seg.refs != refs[id(seg)] or (seg.refs == 0 and id(seg) not in unreferenced):
            errors.append(f"segment {seg.seg_id} counts {seg.refs} references, {refs[id(seg)]} are held")
    # a parked segment holds no GPU page and only the tree refers to it, by ParkedChunkRefs; no
    # segment on the GPU is referred to by one
    for e in tree_entries + owned:
        if isinstance(e, ChunkRef) and (type(e) is ParkedChunkRef) != e.segment.parked:
            errors.append(f"segment {e.segment.seg_id} ({'parked' if e.segment.parked else 'on the GPU'}) "
                          f"is referred to by a {type(e).__name__}")
            break
    if any(type(e) is ParkedChunkRef for e in owned):
        errors.append("a running request holds a parked segment's chunk")
    for seg in store.live.values():
        if seg.parked and (seg.pages or seg.value_pages):
            errors.append(f"parked segment {seg.seg_id} still holds {len(seg.pages) + len(seg.value_pages)} GPU pages")
    droppable = sum(len(seg.pages) for seg in store.live.values() if seg.droppable)
    if droppable != tier.droppable_pages:
        errors.append(f"droppable compressed pages: {tier.droppable_pages} counted, {droppable} marked")
    segments = list(store.live.values())
    lent = sum(len(seg.value_pages) for seg in segments)
    if lent != cache.pool.lent:
        errors.append(f"GPU values: segments hold {lent} lent pages, the pool lent {cache.pool.lent}")
    homes, chunks = int((store.value_home >= 0).sum()), sum(seg.num_chunks for seg in segments if seg.value_pages)
    if homes != chunks:
        errors.append(f"GPU values: {homes} chunk slots have a GPU home, their segments hold {chunks} chunks")
    free = store.free_ids()
    _check_once(errors, "segment", range(store.max_segments), free["segments"], [s.seg_id for s in segments])
    _check_once(errors, "host slot", range(1, store.chunk_capacity + 1), free["host_slots"],
                [slot for s in segments for slot in s.host_slots])
    if store.copies is not None:
        _check_once(errors, "exact copy slot", range(1, store.copies.capacity + 1), free["copy_slots"],
                    [slot for s in segments for slot in s.copy_slots])
        if {id(s) for s in store.copies.holders()} != {id(s) for s in segments if s.copy_slots}:
            errors.append("exact copies: the holders are not the live segments with copy slots")
    scratch = [r.shadowkv.scratch_row for r in running if r.shadowkv is not None]
    _check_once(errors, "scratch row", range(decoder.max_rows), decoder.free_row_ids(), scratch)


def accounting_digest(cache: Pools, running: list["Req"]) -> str:
    """A hash of what must be equal on every tensor-parallel rank: the radix tree (each node's
    tokens, entries and lock count, dense page ids and compressed chunk references alike), the free
    pages, rows and compressed slots, and the requests' pages and rows."""
    h = hashlib.sha256()

    def entry(e) -> tuple:
        if isinstance(e, ChunkRef):
            return ("hc" if type(e) is ParkedChunkRef else "c", e.segment.seg_id, e.index)
        return ("h", e.id) if type(e) is HostPage else ("p", e)

    for node in sorted(cache.tree.nodes(), key=lambda n: (cache.tree.node_start(n), n.key)):
        h.update(repr((node.key, [entry(e) for e in node.pages], node.lock_ref)).encode())
    h.update(repr((sorted(cache.pool.free_ids()), sorted(cache.table.free_ids()), cache.reserved_pages)).encode())
    for r in running:
        h.update(repr((r.rid, r.pool_row, [entry(e) for e in r.pages])).encode())
    if cache.compressed is not None:
        h.update(repr(sorted(cache.compressed.store.free_ids().items())).encode())
    if cache.host is not None:
        h.update(repr((cache.host.free_ids(), sorted(cache.host.backups.items()))).encode())
    return h.hexdigest()

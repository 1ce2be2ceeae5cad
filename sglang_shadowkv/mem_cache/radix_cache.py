"""Page-aligned radix tree from token prefixes to the KV that holds them.

Every node's span is a whole number of pages and it keeps one *entry* per page: a dense KV page
id (an int), an entry held in host memory (a HostEntry: a HostPage of the host tier, or a chunk
of a compressed segment parked there), or a reference to the compressed chunk that holds those
tokens on the GPU (any other object: a ShadowKV ChunkRef, when page size = chunk size). A
matched prefix is an entry list a new request can use once its host pages are loaded back, and a
split always falls on a page boundary, so a compressed span split in two is two views of one
segment. Nodes on a running request's path are locked. Eviction frees GPU memory from the
unlocked nodes that hold it with no such node below them, dense ones first, each kind in
least-recently-used order (compressed state is dropped last: DESIGN.md §3): with a host tier
(`offload`) a dense node's pages move to host memory and the node stays, and (`park`) so does a
compressed node's segments' GPU state; otherwise, or when the host tier has no room, the node is
dropped with what hangs below it. The host tier makes its own
room by dropping its least recently used leaves (`evict_host`). A node's entries can be replaced
(`replace_entries`: a demotion to compressed chunks, a load back from the host). The tree knows
nothing of models: it hands released entries to `release`, which says how many GPU pages that
freed, and tells `on_evictable` (if given) whenever entries start or stop being evictable.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from .host_kv_pool import on_host

DROPPED_SPANS_KEPT = 4096


class TreeNode:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...] = (), pages: list[int] | None = None,
                 parent: "TreeNode | None" = None):
        self.key = key
        self.pages = pages or []
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0


@dataclass
class PrefixMatch:
    pages: list  # one entry per matched page: a page id or a compressed chunk reference
    node: TreeNode  # deepest node of the match: lock it while the pages are in use

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class RadixCache:
    def __init__(self, page_size: int, release: Callable[[list], int | None],
                 on_evictable: Callable[[list, int], None] | None = None,
                 offload: Callable[[list], list | None] | None = None,
                 park: Callable[["TreeNode"], int | None] | None = None):
        """release(entries): frees them, returns the GPU pages freed (None: one per dense entry).
        on_evictable(entries, +1 / -1): entries became evictable (unlocked, in the tree) or stopped.
        offload(dense entries): the host tier's entries for them, their GPU pages freed (None: no
        room; the node is then dropped).
        park(compressed node): moves its segments' GPU state to host memory, giving every node
        that holds them host entries; returns the GPU pages freed (None: it cannot, the node is
        then dropped)."""
        self.page_size = page_size
        self._release = release
        self._on_evictable = on_evictable
        self._offload = offload
        self._park = park
        self._clock = itertools.count(1)
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self.total_pages = 0  # dense page entries
        self.evictable_pages = 0
        self.total_chunks = 0  # compressed chunk entries
        self.evictable_chunks = 0
        self.total_host = 0  # host tier entries
        self.evictable_host = 0
        # spans evicted lately, by (position, first page's tokens): their length (re-prefill counting)
        self._dropped: OrderedDict[tuple, int] = OrderedDict()

    def _count(self, entries: list, sign: int, evictable: bool = True, total: bool = True) -> None:
        pages = sum(type(e) is int for e in entries)
        host = sum(on_host(e) for e in entries)
        chunks = len(entries) - pages - host
        if total:
            self.total_pages += sign * pages
            self.total_chunks += sign * chunks
            self.total_host += sign * host
        if evictable:
            self.evictable_pages += sign * pages
            self.evictable_chunks += sign * chunks
            self.evictable_host += sign * host
            if self._on_evictable is not None and chunks:
                self._on_evictable(entries, sign)

    # ---- lookup -------------------------------------------------------------------------------
    def match_prefix(self, tokens: list[int]) -> PrefixMatch:
        """Longest cached whole-page prefix of tokens."""
        ps, node, pos, pages = self.page_size, self.root, 0, []
        now = next(self._clock)
        node.last_access = now
        while pos + ps <= len(tokens):
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos) * ps
            partial = n < len(child.key)
            if partial:
                child = self._split(child, n)
            child.last_access = now
            pages.extend(child.pages)
            pos += n
            node = child
            if partial:
                break
        return PrefixMatch(pages, node)

    def cached_len(self, tokens: list[int]) -> int:
        """Tokens of the longest cached whole-page prefix, without touching the tree: no split, no
        recency update (a scheduler's estimate of a waiting request's work)."""
        ps, node, pos = self.page_size, self.root, 0
        while pos + ps <= len(tokens):
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos) * ps
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def _common_pages(self, key: tuple[int, ...], tokens: list[int], pos: int) -> int:
        """Whole pages that key and tokens[pos:] share. Slices are compared whole (C speed) and a
        mismatch is found by bisection: a 32K-token document's match costs a few comparisons, not
        one Python step per page."""
        ps = self.page_size
        limit = min(len(key), len(tokens) - pos) // ps
        if tuple(tokens[pos:pos + limit * ps]) == key[:limit * ps]:
            return limit
        lo, hi = 0, limit  # pages before lo are equal; the first unequal one is in [lo, hi)
        while lo < hi:
            mid = (lo + hi) // 2
            if tuple(tokens[pos + lo * ps:pos + (mid + 1) * ps]) == key[lo * ps:(mid + 1) * ps]:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child after n tokens; the new upper node takes child's place under its parent."""
        upper = TreeNode(child.key[:n], child.pages[:n // self.page_size], child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.parent.children[child.key[:self.page_size]] = upper
        child.key, child.pages, child.parent = child.key[n:], child.pages[n // self.page_size:], upper
        upper.children[child.key[:self.page_size]] = child
        return upper

    # ---- insert -------------------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list) -> int:
        """Cache entries for the whole-page prefix of tokens; the tree owns the new ones.

        Returns how many leading pages were already in the tree: the caller's own copies of those
        entries (where they differ from the tree's) are duplicates it must release.
        """
        ps = self.page_size
        n_pages = min(len(tokens) // ps, len(pages))
        match = self.match_prefix(tokens[:n_pages * ps])
        present = match.num_pages
        if present < n_pages:
            node = TreeNode(tuple(tokens[present * ps:n_pages * ps]), list(pages[present:n_pages]),
                            match.node)
            node.last_access = next(self._clock)
            match.node.children[node.key[:ps]] = node
            self._count(node.pages, +1)
        return present

    # ---- locking ------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._count(node.pages, -1, total=False)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache: unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._count(node.pages, +1, total=False)
            node = node.parent

    # ---- eviction -----------------------------------------------------------------------------
    def evict(self, num_pages: int, num_chunks: int = 0) -> int:
        """Free GPU memory until num_pages pages are freed and num_chunks compressed chunk entries
        released (or nothing is left): from the unlocked nodes holding GPU entries with none
        below them, dense ones first, oldest first, then those holding compressed entries. A
        dense node's pages go to the host tier if it takes them, and a compressed node's segments
        are parked there once no more chunk entries must be released (parking keeps them); else
        the node is dropped with its host-only descendants. Returns the GPU pages freed."""
        heap = [self._evict_key(n) for n in self._gpu_frontier()]
        heapq.heapify(heap)
        freed = chunks = 0
        while (freed < num_pages or chunks < num_chunks) and heap:
            *_, node = heapq.heappop(heap)
            if node.parent is None or node.lock_ref:  # dropped or locked meanwhile (the host tier's room)
                continue
            if not _holds_gpu(node):  # parked meanwhile, with a segment of a node evicted before it
                continue
            dense = sum(type(e) is int for e in node.pages)
            host = self._offload(node.pages) if self._offload is not None and dense == len(node.pages) else None
            parked = (self._park(node) if self._park is not None and dense == 0 and chunks >= num_chunks
                      else None)
            parent = node.parent
            if host is not None:
                self.replace_entries(node, host)
                freed += dense
            elif parked is not None:
                freed += parked
            else:
                released, dropped_chunks = self._drop_subtree(node)
                freed += released
                chunks += dropped_chunks
            if parent is not self.root and self._on_frontier(parent):
                heapq.heappush(heap, self._evict_key(parent))
        return freed

    def evict_host(self, num_pages: int, only: Callable[[object], bool] = on_host) -> int:
        """Drop the host tier's least recently used unlocked leaves (those whose every entry is
        `only`'s: any host entry by default) until num_pages host entries are released (or none
        is left); returns how many were."""
        heap = [(n.last_access, id(n), n) for n in self._leaves()
                if n.lock_ref == 0 and n.pages and all(only(e) for e in n.pages)]
        heapq.heapify(heap)
        dropped = 0
        while dropped < num_pages and heap:
            *_, node = heapq.heappop(heap)
            parent = node.parent
            dropped += len(node.pages)
            self._drop_subtree(node)
            if (parent is not self.root and not parent.children and parent.lock_ref == 0 and parent.pages
                    and all(only(e) for e in parent.pages)):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return dropped

    def _drop_subtree(self, node: TreeNode) -> tuple[int, int]:
        """Remove node and everything below it (host-only nodes, when node is on the GPU frontier);
        returns (GPU pages freed, compressed entries released)."""
        freed = chunks = 0
        for below in [node, *self._descendants(node)]:
            self._remember_dropped(below)
            dense = sum(type(e) is int for e in below.pages)
            compressed = sum(type(e) is not int and not on_host(e) for e in below.pages)
            self._count(below.pages, -1, evictable=below.lock_ref == 0)
            released = self._release(below.pages)
            freed += dense if released is None else released
            chunks += compressed
        del node.parent.children[node.key[:self.page_size]]
        node.parent = None
        return freed, chunks

    def _descendants(self, node: TreeNode) -> list[TreeNode]:
        out, stack = [], list(node.children.values())
        while stack:
            below = stack.pop()
            out.append(below)
            stack.extend(below.children.values())
        return out

    def _gpu_frontier(self) -> list[TreeNode]:
        """Unlocked nodes holding GPU entries (dense or compressed) with no such node below them."""
        frontier = []

        def walk(node: TreeNode) -> bool:  # whether node's subtree holds GPU entries
            below = False
            for child in list(node.children.values()):
                below |= walk(child)
            mine = _holds_gpu(node)
            if mine and not below and node.lock_ref == 0 and node is not self.root:
                frontier.append(node)
            return mine or below

        walk(self.root)
        return frontier

    def _on_frontier(self, node: TreeNode) -> bool:
        return (node.lock_ref == 0 and _holds_gpu(node)
                and not any(_holds_gpu(n) for n in self._descendants(node)))

    def _remember_dropped(self, node: TreeNode) -> None:
        self._dropped[(self.node_start(node), node.key[:self.page_size])] = len(node.key)
        if len(self._dropped) > DROPPED_SPANS_KEPT:
            self._dropped.popitem(last=False)

    def dropped_tokens_at(self, tokens: list[int], start: int) -> int:
        """How many of tokens[start:] were cached before and evicted lately (0: none known)."""
        length = self._dropped.get((start, tuple(tokens[start:start + self.page_size])), 0)
        return min(length, len(tokens) - start)

    @staticmethod
    def _evict_key(node: TreeNode) -> tuple:
        compressed = any(type(e) is not int for e in node.pages)
        return compressed, node.last_access, id(node), node

    # ---- demotion -----------------------------------------------------------------------------
    def replace_entries(self, node: TreeNode, entries: list) -> list:
        """Give node new entries for the same tokens (its dense pages demoted to compressed
        chunks); returns the old entries, which the caller releases."""
        if len(entries) != len(node.pages):
            raise ValueError(f"replace_entries: {len(entries)} entries for a node of {len(node.pages)} pages")
        unlocked = node.lock_ref == 0
        self._count(node.pages, -1, evictable=unlocked)
        old, node.pages = node.pages, list(entries)
        self._count(node.pages, +1, evictable=unlocked)
        return old

    def release(self, entries: list) -> None:
        """Give back entries that left the tree by replace_entries, as an eviction would (the host
        tier's copies of dense pages included)."""
        self._release(entries)

    def split(self, node: TreeNode, tokens: int) -> TreeNode:
        """Cut node after `tokens` (a whole number of pages, inside it); returns the upper part
        (node itself stays the lower part, so a lock held through it still covers both)."""
        if tokens % self.page_size or not 0 < tokens < len(node.key):
            raise ValueError(f"split at {tokens} tokens of a {len(node.key)}-token node")
        return self._split(node, tokens)

    def node_start(self, node: TreeNode) -> int:
        """Position of the node's first token."""
        start, node = 0, node.parent
        while node is not None:
            start += len(node.key)
            node = node.parent
        return start

    def nodes(self):
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def flush(self) -> bool:
        """Drop every cached page, host tier included; refused (False) while any request holds a
        lock. The root stays: a request that matched nothing holds it, and unlocks it when it ends."""
        if (self.evictable_pages, self.evictable_chunks, self.evictable_host) != (
                self.total_pages, self.total_chunks, self.total_host):
            return False
        for child in list(self.root.children.values()):
            self._drop_subtree(child)
        self._dropped.clear()  # flushed, not lost to memory pressure
        return True

    def _leaves(self):
        return (node for node in self.nodes() if not node.children)

    def entries(self):
        """Every entry the tree holds: dense page ids, host pages and compressed chunk references."""
        for node in self.nodes():
            yield from node.pages

    def num_nodes(self) -> int:
        return sum(1 for _ in self.nodes())


def _holds_gpu(node: TreeNode) -> bool:
    """Whether a node holds GPU memory: dense pages or compressed chunks (not host pages only)."""
    return any(not on_host(e) for e in node.pages)

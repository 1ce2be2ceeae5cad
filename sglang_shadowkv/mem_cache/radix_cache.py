"""Page-aligned radix tree from token prefixes to the KV that holds them.

Every node's span is a whole number of pages and it keeps one *entry* per page: a dense KV page
id (an int), or a reference to the compressed chunk that holds those tokens (any other object:
a ShadowKV ChunkRef, when page size = chunk size). A matched prefix is an entry list a new
request can use as is, and a split always falls on a page boundary, so a compressed span split in
two is two views of one segment. Nodes on a running request's path are locked; eviction releases
unlocked leaves in least-recently-used order. The tree knows nothing of models: it hands released
entries to `release`.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable


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
    def __init__(self, page_size: int, release: Callable[[list], None]):
        self.page_size = page_size
        self._release = release
        self._clock = itertools.count(1)
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self.total_pages = 0  # dense page entries
        self.evictable_pages = 0
        self.total_chunks = 0  # compressed chunk entries
        self.evictable_chunks = 0

    def _count(self, entries: list, sign: int, evictable: bool = True, total: bool = True) -> None:
        pages = sum(isinstance(e, int) for e in entries)
        if total:
            self.total_pages += sign * pages
            self.total_chunks += sign * (len(entries) - pages)
        if evictable:
            self.evictable_pages += sign * pages
            self.evictable_chunks += sign * (len(entries) - pages)

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

    def _common_pages(self, key: tuple[int, ...], tokens: list[int], pos: int) -> int:
        ps, n = self.page_size, 0
        limit = min(len(key), len(tokens) - pos) // ps
        while n < limit and tuple(tokens[pos + n * ps:pos + (n + 1) * ps]) == key[n * ps:(n + 1) * ps]:
            n += 1
        return n

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
        """Release unlocked leaves, oldest first, until num_pages dense pages and num_chunks
        compressed chunk entries are released (or nothing is left); returns dense pages freed."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = chunks = 0
        while (freed < num_pages or chunks < num_chunks) and heap:
            _, _, node = heapq.heappop(heap)
            self._release(node.pages)
            dense = sum(isinstance(e, int) for e in node.pages)
            freed, chunks = freed + dense, chunks + len(node.pages) - dense
            self._count(node.pages, -1)
            parent = node.parent
            del parent.children[node.key[:self.page_size]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def flush(self) -> bool:
        """Drop every cached page; refused (False) while any request holds a lock. The root
        stays: a request that matched nothing holds it, and unlocks it when it ends."""
        if self.evictable_pages != self.total_pages or self.evictable_chunks != self.total_chunks:
            return False
        self.evict(self.total_pages, self.total_chunks)
        return True

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                yield node

    def entries(self):
        """Every entry the tree holds: dense page ids and compressed chunk references."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield from node.pages
            stack.extend(node.children.values())

    def num_nodes(self) -> int:
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count - 1

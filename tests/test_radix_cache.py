"""Property tests of the paged pool and the radix cache under random request traffic."""

from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool
from sglang_shadowkv.mem_cache.radix_cache import RadixCache

PAGE = 4


def make(num_pages=40):
    pool = PagedKVPool(num_pages, PAGE, 1, 1, 2, dtype=__import__("torch").float32, device="cpu")
    return pool, RadixCache(PAGE, pool.free)


def check(pool, tree, running):
    held = sum(len(r["own"]) for r in running)
    assert tree.total_pages + pool.num_free + held == pool.capacity
    assert 0 <= tree.evictable_pages <= tree.total_pages
    all_pages = [p for r in running for p in r["own"]] + pool._free + _tree_pages(tree)
    assert len(all_pages) == len(set(all_pages)) == pool.capacity  # no page in two places


def _tree_pages(tree):
    out, stack = [], [tree.root]
    while stack:
        n = stack.pop()
        out.extend(n.pages)
        stack.extend(n.children.values())
    return out


seqs = st.lists(st.integers(0, 2), min_size=1, max_size=30)  # small alphabet: many shared prefixes
ops = st.lists(st.tuples(st.sampled_from(["start", "finish", "evict"]), seqs, st.integers(0, 8)),
               max_size=40)


@settings(max_examples=150, deadline=None)
def admit(pool, tree, tokens):
    """Admit a request as the scheduler does: match and lock its prefix, evict for and allocate the
    pages of the rest. (match, own pages), or None (nothing held) when the pool cannot hold it."""
    m = tree.match_prefix(tokens)
    tree.lock(m.node)
    need = -(-len(tokens) // PAGE) - m.num_pages
    if pool.num_free < need:
        tree.evict(need - pool.num_free)
    own = pool.alloc(need)
    if own is None:
        tree.unlock(m.node)
        return None
    return m, own


@given(ops)
def test_pages_are_always_in_tree_running_or_free(operations):
    pool, tree = make()
    running = []
    for op, tokens, n in operations:
        if op == "start":
            admitted = admit(pool, tree, tokens)
            if admitted is None:
                continue
            m, own = admitted
            assert m.num_pages * PAGE <= len(tokens)
            running.append({"tokens": tokens, "matched": list(m.pages), "own": own, "node": m.node})
        elif op == "finish" and running:
            r = running.pop(n % len(running))
            pages = r["matched"] + r["own"]
            whole = len(r["tokens"]) // PAGE
            present = tree.insert(r["tokens"], pages[:whole])
            k = len(r["matched"])
            pool.free(pages[k:present] + pages[whole:])
            tree.unlock(r["node"])
            r["own"] = []
            # what was inserted is now found again
            assert tree.match_prefix(r["tokens"]).num_pages == whole
        elif op == "evict":
            before = tree.evictable_pages
            freed = tree.evict(n)
            assert freed >= min(n, before) or tree.evictable_pages == 0
        check(pool, tree, running)
    for r in running:
        tree.unlock(r["node"])
        pool.free(r["own"])
        r["own"] = []
    running.clear()
    assert tree.flush()
    assert pool.num_free == pool.capacity


def test_split_keeps_pages_and_matches_both_halves():
    pool, tree = make()
    toks = list(range(12))
    pages = pool.alloc(3)
    assert tree.insert(toks, pages) == 0
    m = tree.match_prefix(toks[:8] + [99, 99, 99, 99])
    assert m.pages == pages[:2]
    assert tree.num_nodes() == 2  # split at the page boundary
    assert tree.match_prefix(toks).pages == pages


def test_locked_nodes_are_not_evicted():
    pool, tree = make()
    a, b = pool.alloc(2), pool.alloc(2)
    tree.insert([1] * 8, a)
    tree.insert([2] * 8, b)
    m = tree.match_prefix([1] * 8)
    tree.lock(m.node)
    assert tree.evict(100) == 2
    assert tree.match_prefix([1] * 8).pages == a
    assert not tree.flush()  # a request still holds a lock
    tree.unlock(m.node)
    assert tree.flush() and pool.num_free == pool.capacity


def test_flush_keeps_the_root_that_a_request_without_a_match_holds():
    pool, tree = make()
    tree.insert([1] * 8, pool.alloc(2))
    m = tree.match_prefix([9] * 8)  # matched nothing: the request holds the root
    tree.lock(m.node)
    assert tree.flush() and tree.total_pages == 0
    tree.unlock(m.node)  # when it ends
    tree.insert([9] * 8, pool.alloc(2))
    assert tree.match_prefix([9] * 8).num_pages == 2


def test_lru_evicts_oldest_first():
    pool, tree = make()
    old, new = pool.alloc(1), pool.alloc(1)
    tree.insert([5] * 4, old)
    tree.insert([6] * 4, new)
    tree.match_prefix([6] * 4)  # touch the newer one again
    tree.evict(1)
    assert tree.match_prefix([5] * 4).num_pages == 0
    assert tree.match_prefix([6] * 4).pages == new


# ---- compressed entries: ChunkRefs of ShadowKV segments beside dense pages ------------------------
def make_mixed(num_pages=60, host_chunks=40):
    """Dense pages and compressed segments share one pool: a segment's state lives in pages."""
    import torch

    from sglang_shadowkv.mem_cache.compressed_pool import ShadowKVPool

    pool = PagedKVPool(num_pages, PAGE, 1, 2, 8, dtype=torch.float32, device="cpu")
    store = ShadowKVPool(pool, 2, host_chunks, 16)

    def release(entries):
        dense = [e for e in entries if isinstance(e, int)]
        pool.free(dense)
        return len(dense) + store.release_chunks([e for e in entries if not isinstance(e, int)])

    return pool, store, RadixCache(PAGE, release), release


@settings(max_examples=150, deadline=None)
@given(ops, st.lists(st.booleans(), min_size=40, max_size=40))
def test_every_page_and_chunk_is_owned_once(operations, compress_choices):
    """Requests randomly compress their own span into a segment (ChunkRefs) before finishing;
    matches split compressed nodes; evictions release segments. Every dense page is in the tree,
    a running request or free; every live segment's refs are exactly the references the tree and
    the running requests hold, and a segment with none is freed."""
    from sglang_shadowkv.mem_cache.compressed_pool import ChunkRef

    pool, store, tree, release = make_mixed()
    running = []
    for step, (op, tokens, n) in enumerate(operations):
        if op == "start":
            admitted = admit(pool, tree, tokens)
            if admitted is None:
                continue
            m, own = admitted
            entries = list(m.pages) + own
            borrowed = m.num_pages
            whole = len(tokens) // PAGE
            if compress_choices[step] and whole > borrowed:  # compress the own whole pages
                seg = store.alloc_segment(borrowed * PAGE, (whole - borrowed) * PAGE, 1)
                if seg is None:
                    tree.evict(store.pages_for(whole - borrowed, 1))
                    seg = store.alloc_segment(borrowed * PAGE, (whole - borrowed) * PAGE, 1)
                if seg is not None:
                    refs = store.chunk_refs(seg)
                    pool.free(entries[borrowed:whole])
                    entries[borrowed:whole] = refs
            running.append({"tokens": tokens, "entries": entries, "borrowed": borrowed, "node": m.node})
        elif op == "finish" and running:
            r = running.pop(n % len(running))
            whole = len(r["tokens"]) // PAGE
            present = tree.insert(r["tokens"], r["entries"][:whole])
            release(r["entries"][r["borrowed"]:present] + r["entries"][whole:])
            tree.unlock(r["node"])
            assert tree.match_prefix(r["tokens"]).num_pages == whole
        elif op == "evict":
            tree.evict(n, n % 3)
        # invariants
        tree_entries = _tree_pages(tree)
        held = [e for r in running for e in r["entries"][r["borrowed"]:]]
        segment_pages = [p for seg in store.live.values() for p in seg.pages]
        pages = [e for e in tree_entries + held if isinstance(e, int)] + pool._free + segment_pages + [store.null_page]
        assert sorted(pages) == sorted(set(pages)) and len(pages) == pool.capacity
        counts: dict[int, int] = {}
        for e in tree_entries + held:
            if isinstance(e, ChunkRef):
                counts[id(e.segment)] = counts.get(id(e.segment), 0) + 1
        assert {id(s): s.refs for s in store.live.values()} == counts
        assert store.free_chunks + sum(s.num_chunks for s in store.live.values()) == store.chunk_capacity
        assert tree.total_chunks == sum(isinstance(e, ChunkRef) for e in tree_entries)
    for r in running:
        tree.unlock(r["node"])
        release(r["entries"][r["borrowed"]:])
    assert tree.flush()
    assert pool.num_free == pool.capacity - 1 and store.free_chunks == store.chunk_capacity and not store.live


def test_lent_pages_count_as_free_and_an_allocation_takes_them_back():
    """Pages lent to a cache (ShadowKV's GPU values) are free to every caller: an allocation beyond
    the unused pages asks the reclaim hook for the difference; without a hook nothing is lent."""
    pool = PagedKVPool(11, 2, 1, 1, 2, dtype=__import__("torch").float32, device="cpu")  # 10 pages
    assert pool.lend(3) is None  # nobody could take them back
    loans: list[list[int]] = []

    def reclaim(n: int) -> None:
        while n > 0:
            pages = loans.pop(0)
            pool.give_back(pages)
            n -= len(pages)

    pool.reclaim = reclaim
    loans += [pool.lend(3), pool.lend(2)]
    assert pool.num_free == 10 and pool.num_unused == 5 and pool.lent == 5
    assert pool.lend(6) is None  # only unused pages are lent
    taken = pool.alloc(6)  # one more than the unused: the oldest loan (3 pages) comes back
    assert len(set(taken)) == 6 and pool.lent == 2 and pool.num_unused == 2 and pool.num_free == 4
    assert not set(taken) & set(loans[0]) and pool.alloc(5) is None and pool.lent == 2
    pool.free(taken)
    assert pool.num_free == 10

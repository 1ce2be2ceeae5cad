"""Pages of running requests and of the radix cache: admission, growth, release. The only owner of
the radix tree and (through CompressedTier) of ShadowKV's compressed state.

A request is admitted only when the pool, counting what the radix cache could evict, can hold its
prompt plus its full max_new_tokens: once running it never waits for memory and is never
preempted. Those pages are reserved at admission and taken as the request grows. A completed
prompt's whole pages go to the radix cache at once (SGLang's cache_unfinished_req), so requests
that wait for the same prefix reuse them while this one decodes; a finished or aborted request
leaves the rest of its whole pages there too.

With overlap scheduling a request may be released while a step that still writes its last token's
K/V is queued on the device; that is safe because every later use of a released page is queued on
the same stream, after that write.

With --enable-hierarchical-cache the radix cache has a host tier (mem_cache/host_kv_pool.py):
pages it evicts move to host memory instead of being dropped, and a request that matches them
has them loaded back at admission, into pages of its reservation, layer by layer beside its
first step. In ShadowKV mode compressed state, which eviction lets go last, is parked there too
(its segments' pages copied whole; `_park`), and a request that matches a parked segment has it
copied back before its first step reads it.
"""

from __future__ import annotations

import math

from sglang_shadowkv.mem_cache.compressed_pool import ChunkRef, ParkedChunkRef, Segment
from sglang_shadowkv.mem_cache.host_kv_pool import HostPage
from sglang_shadowkv.mem_cache.kv_pool import PoolExhaustedError
from sglang_shadowkv.mem_cache.radix_cache import PrefixMatch, RadixCache, TreeNode
from sglang_shadowkv.model_executor.forward_batch import StepItem
from sglang_shadowkv.model_executor.model_runner import ModelRunner

from .compressed_stats import tier_stats
from .compressed_tier import CompressedTier
from .counters import CacheCounters
from .integrity import accounting_digest, check_pools
from .logprobs import prefix_match_limit
from .request import Req
from .tier_choice import Rates


class CacheManager:
    def __init__(self, runner: ModelRunner, page_size: int):
        self.runner, self.pool, self.page_size = runner, runner.pool, page_size
        self.table = runner.req_to_token
        shadowkv = runner.shadowkv_config is not None
        self.host = runner.host_pool  # the host tier (None without --enable-hierarchical-cache)
        self.tree = RadixCache(page_size, self._release_entries,
                               on_evictable=(lambda entries, sign: self.compressed.on_evictable(entries, sign))
                               if shadowkv else None,
                               offload=self._offload if self.host is not None else None,
                               park=self._park if self.host is not None and shadowkv else None)
        self.reserved_pages = 0
        # pages the request admission last turned away needs, ShadowKV's segment and scratch row
        # included: what a demotion must free for it
        self.turned_away_need = 0
        self.counters = CacheCounters()
        # what the scheduler measures, for ShadowKV's choice of a document's tier (tier_choice.py)
        self.rates = Rates.priors(self.pool.bytes_per_token, runner.weight_bytes) if shadowkv else None
        self.compressed = CompressedTier(runner, self.tree, page_size, self.headroom, self.rates,
                                         self.move_to_host if self.host is not None else None) if shadowkv else None

    def _release_entries(self, entries: list) -> int:
        if self.host is not None:
            entries = self.host.release_entries(entries)
        if self.compressed is not None:
            parked = _segments(entries, ParkedChunkRef)
            freed = self.compressed.release_entries(entries)
            for seg in parked:  # a parked segment whose last reference went: its host pages
                if seg.refs == 0:
                    self.host.free(seg.host_pages)
                    self.host.counters.host_evicted_tokens += seg.num_tokens
                    seg.host_pages = None
            return freed
        self.pool.free(entries)
        return len(entries)

    def _host_room(self, pages: list[int]) -> bool:
        """Make room in the host tier for these GPU pages: backups of other pages go first (no
        loss), then its least recently used documents. False, with nothing dropped, when even that
        cannot make enough."""
        if self.host.shortfall(pages) > self.tree.evictable_host:
            return False
        missing = self.host.drop_backups_for(pages)
        if missing > 0:
            self.tree.evict_host(missing)
        return True

    def _offload(self, pages: list[int]) -> list[HostPage] | None:
        """The tree's offload hook: move a node's dense pages to the host tier (`_host_room`);
        None when it cannot hold them."""
        entries = self.host.store(pages) if self._host_room(pages) else None
        if entries is not None:
            self._release_entries(pages)  # (their backups, if any, became the host entries)
        return entries

    def move_to_host(self, node: TreeNode) -> bool:
        """The demoter's move of an unlocked dense node to the host tier (False, nothing moved,
        when the host tier cannot take it even by dropping its least recently used documents)."""
        entries = self._offload(node.pages)
        if entries is None:
            return False
        self.tree.replace_entries(node, entries)
        return True

    def _park(self, node: TreeNode) -> int | None:
        """The tree's park hook, for a compressed node it would otherwise drop: its segments' pages
        move whole to the host tier (`_host_room`),
        and every node holding their chunks holds ParkedChunkRefs instead. Returns the GPU pages
        freed; None (nothing moved) when some request reads a segment or the host tier cannot
        take them."""
        if not node.pages or any(type(e) is not ChunkRef for e in node.pages):
            return None
        segments = _segments(node.pages, ChunkRef)
        if not all(seg.droppable for seg in segments):
            return None
        pages = [p for seg in segments for p in seg.pages]  # (no dense tree page: none has a backup)
        if not self._host_room(pages) or len(pages) > self.host.num_free:
            return None
        copies = {id(seg): self.host.store(seg.pages) for seg in segments}
        self._swap_chunk_refs(segments, lambda e: ParkedChunkRef(e.segment, e.index), ChunkRef)
        freed = 0
        for seg in segments:
            freed += self.compressed.store.detach(seg, [e.id for e in copies[id(seg)]])
            self.compressed.counters.parked_tokens += seg.num_tokens
        return freed

    def _unpark(self, segments: list[Segment]) -> dict[int, ChunkRef]:
        """Copy parked segments back into new GPU pages (the caller made room) and give their
        tree nodes ChunkRefs again; returns each replaced entry's successor, by id."""
        for seg in segments:
            pages = self.pool.alloc(len(seg.host_pages))
            self.host.load([HostPage(i) for i in seg.host_pages], pages, keep_copies=False)
            self.compressed.store.attach(seg, pages)
            self.compressed.counters.unparked_tokens += seg.num_tokens
        self.host.wait_loads()  # a suffix step's CUDA graph may read them: no layer-by-layer wait there
        return self._swap_chunk_refs(segments, lambda e: ChunkRef(e.segment, e.index), ParkedChunkRef)

    def _swap_chunk_refs(self, segments: list[Segment], make, kind: type) -> dict[int, ChunkRef]:
        """Replace, in every tree node, the `kind` references to these segments by make(ref): the
        tree re-counts each node's entries (a parked chunk is a host entry)."""
        ids, successors = {id(seg) for seg in segments}, {}
        for node in list(self.tree.nodes()):
            if any(type(e) is kind and id(e.segment) in ids for e in node.pages):
                entries = [make(e) if type(e) is kind and id(e.segment) in ids else e for e in node.pages]
                successors.update({id(old): new for old, new in zip(node.pages, entries) if old is not new})
                self.tree.replace_entries(node, entries)
        return successors

    def _back_up(self, entries: list) -> None:
        """write_through: the dense pages the tree just took get their host copy now."""
        if self.host is not None and self.host.write_policy == "write_through":
            self.host.backup([e for e in entries if type(e) is int])

    def _load_from_host(self, match: PrefixMatch, need: int) -> bool:
        """Bring the matched prefix's host pages back into GPU pages (False: the pool cannot
        take them and the request's own need, nothing done). The path's nodes then hold them
        dense, and the request reads them as it reads any cached page. A match with no host
        page loads nothing (an empty load still launched a copy per layer and side)."""
        host = [i for i, e in enumerate(match.pages) if type(e) is HostPage]
        parked = _segments(match.pages, ParkedChunkRef)
        if not host and not parked:
            return True
        to_load = _host_pages(match.pages)
        if to_load + need > self.available_pages():
            return False
        self.make_room(to_load)
        if parked:
            successors = self._unpark(parked)
            match.pages = [successors.get(id(e), e) for e in match.pages]
        if not host:
            return True
        pages = self.pool.alloc(len(host))
        self.host.load([match.pages[i] for i in host], pages)
        if self.rates is not None:
            self.rates.observe_host_loads(self.host.counters.host_loaded_bytes, self.host.counters.host_load_ms)
        loaded = dict(zip(host, pages))
        at = 0
        for node in _path(match.node):
            if any(type(e) is HostPage for e in node.pages):
                self.tree.replace_entries(node, [loaded[at + j] for j in range(len(node.pages))])
            at += len(node.pages)
        match.pages = [loaded.get(i, e) for i, e in enumerate(match.pages)]
        self.host.counters.host_hit_tokens += len(host) * self.page_size
        return True

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def headroom(self) -> int:
        """Unused pages that no running request is promised (pages lent for GPU values do not count)."""
        return self.pool.num_unused - self.reserved_pages

    def available_pages(self) -> int:
        """Pages a new reservation may count on: free, or freed by evicting what no request holds."""
        droppable = 0 if self.compressed is None else self.compressed.droppable_pages
        return self.pool.num_free + self.tree.evictable_pages + droppable - self.reserved_pages

    # ---- admission ----------------------------------------------------------------------------
    def check_request(self, prompt_len: int, max_total_len: int) -> None:
        """Raises ValueError naming the problem when the pools could never hold this request."""
        if self.pages_for(max_total_len) > self.pool.capacity:
            raise ValueError(
                f"prompt plus max_new_tokens needs {max_total_len} KV tokens but the pool holds "
                f"{self.pool.capacity * self.page_size}; lower max_new_tokens or raise max_total_tokens")
        if self.compressed is not None:
            self.compressed.check_capacity(prompt_len)

    def try_admit(self, req: Req, long_demand: int = 0) -> bool:
        """Give the request its cached prefix, a table row and its reservation (False: it must
        wait, for memory or for a demotion that makes room without dropping a document).
        long_demand: tokens of the long documents asked for at once (the compressed tier's rule)."""
        match = self.tree.match_prefix(req.input_ids[:prefix_match_limit(req)])
        if self.compressed is not None:
            match = self.compressed.trim_match(match)
        self.tree.lock(match.node)
        need = self.pages_for(req.max_total_len) - len(match.pages)
        if self.host is not None and not self._load_from_host(match, need):
            self.tree.unlock(match.node)
            self.turned_away_need = need + _host_pages(match.pages)
            return False
        plan = None if self.compressed is None else self.compressed.plan(req, match.pages, long_demand)
        extra = 0 if plan is None else plan.extra_pages
        if need + extra > self.available_pages() or self.table.num_free == 0 or self._wait_for_demotion(need + extra):
            self.tree.unlock(match.node)
            self.turned_away_need = need + extra
            return False
        if plan is not None:
            self.make_room(extra)
            state = self.compressed.admit(req, plan, match.pages)
            if state is None:
                self.tree.unlock(match.node)
                return False
            req.shadowkv = state
        req.pool_row = self.table.alloc()
        req.last_node = match.node
        req.pages = list(match.pages)
        req.num_borrowed = match.num_pages
        req.cached_tokens = req.num_computed = match.num_pages * self.page_size
        req.reserved_pages = need
        self.reserved_pages += need
        layout = None if req.shadowkv is None else req.shadowkv.layout  # of the matched compressed chunks
        if layout is not None:
            self.compressed.use_matched(layout)  # their GPU values first: every decode step reads them
            self.compressed.load_prefix_copy(req)  # then, room left, their exact copy for the prefill
        load = None if req.shadowkv is None else req.shadowkv.copy_load
        dense_matched = len(req.pages) > (0 if layout is None else layout.num_chunks)  # dense pages among them
        if dense_matched or load is not None:
            # compressed entries have no dense slots but a loaded copy's (their table entries are read by no other path)
            dense = load.table_pages(req.pages) if load is not None else [e if type(e) is int else 0 for e in req.pages]
            self.table.write(req.pool_row, 0, self.pool.slots_of_pages(dense, req.num_computed))
        self._count_admission(req, dense_hit=dense_matched)
        return True

    def _wait_for_demotion(self, need: int) -> bool:
        """Policy tier: when making room would drop cached documents, wait while a demotion can
        make it by compressing them instead (the demoter works each step meanwhile)."""
        return need > self.pool.num_free - self.reserved_pages and self.demotion_can_help()

    @property
    def demoter(self):
        """The compressed tier's Demoter (None: full attention, or the eager policy)."""
        return None if self.compressed is None else self.compressed.demoter

    def demotion_can_help(self) -> bool:
        """Whether a demotion runs or can start (then waiting for memory is not hopeless)."""
        return self.demoter is not None and self.demoter.can_help(self.available_pages())

    def _count_admission(self, req: Req, dense_hit: bool) -> None:
        self.counters.cached_tokens += req.cached_tokens
        self.counters.dense_prefix_hits += dense_hit
        self.counters.reprefilled_tokens += self.tree.dropped_tokens_at(req.input_ids, req.cached_tokens)

    def maintain(self, running: list[Req], idle: bool) -> None:
        """Between steps: the demotion's share of work (all of it when nothing decodes, or when the
        request admission turned away this step needs its pages). That request counts with its
        full need (its ShadowKV segment and scratch row included): a wait for a demotion that a
        smaller need would not start never ends. running: the admitted requests (who reads what)."""
        need, self.turned_away_need = self.turned_away_need, 0
        if self.compressed is not None:
            self.compressed.settle_ranks(wait=False)
        if self.demoter is not None:
            self.demoter.step(self.available_pages(), need, idle, running)

    def prepare(self, req: Req, item: StepItem) -> None:
        """Before a step computes the item: its pages, and whether this prefill chunk completes a
        prompt whose own span is compressed in the same step."""
        self.ensure_pages(req, item.seq_len)
        state = req.shadowkv
        if state is not None and not req.prompt_done:
            state.compress_now = item.seq_len >= len(req.input_ids) and state.segment is not None

    def ensure_pages(self, req: Req, num_tokens: int) -> None:
        need = self.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return
        if self.pool.num_free < need:
            self.tree.evict(need - self.pool.num_free)
        pages = self.pool.alloc(need)
        if pages is None:  # admission reserved these pages, so this is a bookkeeping bug
            raise PoolExhaustedError(f"pool exhausted while extending request {req.rid}")
        start = len(req.pages) * self.page_size
        self.table.write(req.pool_row, start, self.pool.slots_of_pages(pages, need * self.page_size))
        req.pages.extend(pages)
        take = min(need, req.reserved_pages)
        req.reserved_pages -= take
        self.reserved_pages -= take

    def prompt_done(self, req: Req) -> None:
        """After the step that completed the prompt: its compressed span (if any) takes the place
        of its dense pages, and its whole pages go to the radix cache."""
        if req.shadowkv is not None:
            self.compressed.on_prompt_done(req)
        self._cache_prompt(req)

    def _cache_prompt(self, req: Req) -> None:
        """The completed prompt's whole pages (dense or compressed) go to the radix cache now; the
        request holds them there through a lock, like a matched prefix. With a compressed prefix,
        the pages up to its last compressed chunk."""
        whole = len(req.input_ids) // self.page_size
        if req.over_compressed_prefix:
            # up to its last compressed chunk: the dense tail stays the request's, to be compressed
            # with what it generates when that grows long (CompressedTier._compress_tail)
            whole = min(whole, req.shadowkv.layout.compressed_end // self.page_size)
        if whole <= req.num_borrowed:
            return
        tokens = req.input_ids[:whole * self.page_size]
        present = self.tree.insert(tokens, req.pages[:whole])
        req.duplicate_entries += req.pages[req.num_borrowed:present]  # cached meanwhile by another request
        self._back_up(req.pages[max(present, req.num_borrowed):whole])
        node = self.tree.match_prefix(tokens).node
        self.tree.lock(node)
        self.tree.unlock(req.last_node)
        req.last_node, req.num_borrowed = node, whole

    # ---- release ------------------------------------------------------------------------------
    def release(self, req: Req) -> None:
        """Hand the request's computed whole pages (dense or compressed) to the radix cache and
        release the rest."""
        if req.shadowkv is not None:
            self.compressed.before_release(req)
        if self.rates is not None and req.output_ids and req.finish_reason.get("type") != "abort":
            self.rates.observe_answer(len(req.output_ids))  # an answer's length
        whole = req.num_computed // self.page_size
        tokens = req.all_ids[:whole * self.page_size]
        present = self.tree.insert(tokens, req.pages[:whole])
        self._back_up(req.pages[max(present, req.num_borrowed):whole])
        duplicates = req.duplicate_entries + req.pages[req.num_borrowed:present]  # cached meanwhile by another request
        req.duplicate_entries = []
        self._release_entries(duplicates + req.pages[whole:])
        self.tree.unlock(req.last_node)
        self.table.free(req.pool_row)
        self.reserved_pages -= req.reserved_pages
        req.reserved_pages = 0
        req.pages = []
        req.pool_row = None

    def make_room(self, pages: int) -> None:
        """Evict cached prefixes until `pages` pages are free (as far as the cache can)."""
        if self.pool.num_free < pages:
            self.tree.evict(pages - self.pool.num_free)

    def flush(self) -> bool:
        """Drop every cached prefix (a running demotion is given up); False (nothing dropped) while
        a request holds part of it."""
        if self.demoter is not None:
            self.demoter.cancel()
        return self.tree.flush()

    # ---- numbers ------------------------------------------------------------------------------
    def check_integrity(self, running: list[Req]) -> None:
        """Raise RuntimeError naming what is wrong unless every page, compressed slot and row is
        free or owned exactly once (mem_cache accounting; scheduler/integrity.py), and, under
        tensor parallelism, every rank holds the same tree and pools (every rank raises)."""
        try:
            check_pools(self, running)
            problem = None
        except RuntimeError as err:
            problem = str(err)
        ranks = self.runner.tp.gather_objects((problem, accounting_digest(self, running)))
        problems = [f"rank {r}: {p}" for r, (p, _) in enumerate(ranks) if p is not None]
        parted = [r for r, (_, digest) in enumerate(ranks) if digest != ranks[0][1]]
        if parted:
            problems.append(f"ranks {parted} hold a different radix tree or pool accounting from rank 0's")
        if problems:
            raise RuntimeError("; ".join(problems) if len(ranks) > 1 else problem)

    def memory_stats(self, running: list[Req]) -> dict:
        running_pages = sum(sum(isinstance(e, int) for e in r.pages[r.num_borrowed:]) for r in running)
        compressed = scratch = in_use = loaded = 0
        if self.compressed is not None:
            compressed = len(self.compressed.store.held_pages())
            loaded = self.compressed.store.copy_loads.num_pages
            scratch = self.compressed.decoder.taken_row_pages
            in_use = self.compressed.in_use_pages()
        return {
            "page_size": self.page_size,
            "total_pages": self.pool.capacity,
            "free_pages": self.pool.num_unused,
            "tree_pages": self.tree.total_pages,
            # compressed state in the pool's pages (segments, their GPU values, the null page)
            "compressed_pages": compressed,
            "lent_pages": self.pool.lent,  # of those, GPU values: taken back at once when pages are needed
            "scratch_pages": scratch,  # running requests' chunk-cache scratch rows, in the pool's pages
            # exact copies of compressed prefixes loaded dense for the prompts prefilling over them
            "copy_load_pages": loaded,
            # segments requests read (with their GPU values) and scratch rows: what the tier rule
            # keeps out of the room for dense documents (CompressedTier.in_use_pages)
            "compressed_in_use_pages": in_use,
            "evictable_pages": self.tree.evictable_pages,
            "running_request_pages": running_pages,
            "reserved_pages": self.reserved_pages,
            "kv_bytes_per_token": self.pool.bytes_per_token,
            "radix_nodes": self.tree.num_nodes(),
            **({} if self.host is None else {
                "host_total_pages": self.host.num_pages, "host_free_pages": self.host.num_free,
                "host_tree_pages": self.tree.total_host,  # documents (parts) held only on the host
                "host_backup_pages": len(self.host.backups)}),  # host copies of dense tree pages (write_through)
        }

    def shadowkv_stats(self, running: list[Req]) -> dict | None:
        return None if self.compressed is None else tier_stats(self.compressed, running)


def _path(node) -> list:
    """The nodes from the root's child down to node."""
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    return path[::-1]


def _segments(entries: list, kind: type) -> list[Segment]:
    """The distinct segments that the `kind` references among entries refer to, in order."""
    return list({id(e.segment): e.segment for e in entries if type(e) is kind}.values())


def _host_pages(entries: list) -> int:
    """GPU pages that bringing entries back from the host takes: each dense host page, and every
    page of each parked segment."""
    return sum(type(e) is HostPage for e in entries) + sum(len(seg.host_pages)
                                                          for seg in _segments(entries, ParkedChunkRef))

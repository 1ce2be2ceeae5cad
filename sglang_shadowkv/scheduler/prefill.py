"""Prefill: the waiting queue, admission (memory, shared-prefix deferral) and each step's chunks of
the admitted prompts within the chunk budget, in the order the schedule policy gives.

Policies (SGLang's names): `fcfs` serves requests in arrival order. `hrrn` (the default), highest
response ratio next with token-based aging as SGLang computes it: a request's ratio is the prefill
tokens the server has computed since it arrived over the prompt tokens it still needs (its
uncached part); the highest goes first, the shorter on a tie. A later request of u uncached
tokens goes ahead of one of U that has waited W once it has waited W·u/U itself: a question on a
cached document (a few uncached tokens) overtakes a cold document almost at once, while the cold
document's ratio grows with every token computed for others, so nobody waits forever. Why: with
48 chat sessions over their own 16K documents (SGLang's client on the H100), in arrival order a
turn over a cached document waited behind every cold first turn queued before it.
"""

from __future__ import annotations

from collections import deque

from sglang_shadowkv.model_executor.forward_batch import StepItem
from sglang_shadowkv.shadowkv.suffix_prefill import GRAPH_TOKENS

from .cache import CacheManager
from .request import Req

SHARED_PREFILL_TOKENS = 256  # a shared prefix at least this long (and most of a prompt) is worth waiting for
RANKED_WAITING = 128  # hrrn ranks this many waiting requests (in arrival order) a step; the rest wait their turn
# admission stops while the admitted prompts still need this many steps' chunk budgets: see PrefillManager.admit
ADMITTED_STEPS_AHEAD = 2
# a step's chunk of a suffix over a compressed document (a question, a chat's next turn) is at most
# the longest suffix a CUDA graph holds, so that it replays one: a longer chunk ran eagerly, its
# rounds of tiles launching ~200 kernels a layer each, host-bound. On the H200 a 320-token turn
# (a 256-token answer and the next question) over a 32K document beside 8 decodes took 404 ms in one
# eager step, and a chat of such turns on the H100 spent 666 ms a step in them. Its tiles start at
# the same tokens either way (the cap is whole tiles), so its answer is the same.
SUFFIX_CHUNK_TOKENS = GRAPH_TOKENS[-1]


def shares_prefill(req: Req, prefilling: Req) -> bool:
    """Whether most of req's prompt is what `prefilling` computes now (past its cached prefix),
    and at least SHARED_PREFILL_TOKENS of it: then req waits for that prefill and reuses it."""
    shared = common_prefix_len(req.input_ids, prefilling.input_ids) - prefilling.cached_tokens
    return shared >= SHARED_PREFILL_TOKENS and 2 * shared >= len(req.input_ids) - prefilling.cached_tokens


def common_prefix_len(a: list[int], b: list[int], block: int = 1024) -> int:
    n = min(len(a), len(b))
    pos = 0
    while pos < n and a[pos:pos + block] == b[pos:pos + block]:
        pos += block
    end = min(pos + block, n)
    while pos < end and a[pos] == b[pos]:
        pos += 1
    return min(pos, n)


def long_document_demand(reqs: list[Req], min_context: int) -> int:
    """Tokens of the distinct long documents these requests hold dense or ask for (a document:
    the first min_context tokens of a prompt at least that long)."""
    seen, total = set(), 0
    for req in reqs:
        if len(req.input_ids) < min_context or req.over_compressed_prefix:
            continue
        if req.document_key is None:
            req.document_key = hash(tuple(req.input_ids[:min_context]))
        if req.document_key not in seen:
            seen.add(req.document_key)
            total += len(req.input_ids)
    return total


class PrefillManager:
    def __init__(self, cache: CacheManager, chunk_budget: int, policy: str = "hrrn"):
        self.cache, self.chunk_budget, self.policy = cache, chunk_budget, policy
        compressed = cache.compressed
        self.min_context = None if compressed is None else compressed.cfg.min_context
        self.waiting: deque[Req] = deque()  # not admitted yet, in arrival order
        self.prefilling: list[Req] = []  # admitted, prompt not fully computed, in admission order
        self.rejected: list[Req] = []  # dropped at admission (finish_reason says why); reported by the next step
        self.computed_tokens = 0  # prompt tokens scheduled since start: hrrn's clock

    def add(self, req: Req) -> None:
        """Queue a request (stamped with the token clock: hrrn ages it from now)."""
        req.arrival_tokens = self.computed_tokens
        self.waiting.append(req)

    def _priority(self, req: Req, uncached: int) -> tuple[float, int]:
        """hrrn's sort key: the highest response ratio (prefill tokens computed since the request
        arrived, per prompt token it still needs) first; on a tie (both just arrived) the shorter."""
        ratio = (self.computed_tokens - req.arrival_tokens) / uncached if uncached > 0 else float("inf")
        return -ratio, uncached

    def _admission_order(self) -> tuple[list[Req], dict[int, int]]:
        """The waiting requests in the order admission tries them, and the uncached prompt tokens
        (by id) of those the order was computed from (hrrn's ranked ones; none for fcfs)."""
        if self.policy == "fcfs" or len(self.waiting) < 2:
            return list(self.waiting), {}
        ranked = list(self.waiting)[:RANKED_WAITING]
        tree = self.cache.tree
        need = {id(r): len(r.input_ids) - tree.cached_len(r.input_ids) for r in ranked}
        ranked.sort(key=lambda r: self._priority(r, need[id(r)]))
        return ranked + list(self.waiting)[RANKED_WAITING:], need

    def admit(self, free_places: int, nothing_in_flight: bool, running: list[Req]) -> None:
        """Admit waiting requests in order while memory and free_places allow. One that shares a
        long prefix with a prompt still being prefilled waits for it (SGLang's in-batch prefix
        caching): that prompt goes to the radix cache when it completes, so a shared document is
        prefilled (and compressed) once however many of its requests arrive together.
        nothing_in_flight: no request runs and no step is pending, so nothing will free memory.
        A prompt longer than a step's chunk budget (past its cached prefix) waits while the
        admitted prompts' uncomputed tokens fill ADMITTED_STEPS_AHEAD budgets (SGLang likewise
        admits a prompt when a step's budget takes it); shorter ones (questions over cached
        documents) are admitted as before. Why: an admitted prompt reserves its pages at once, so
        48 cold chat documents arriving together had 13-21 admitted while two were computed
        (SGLang's client on the H100), their reservations ~75% of the pool, idle. With the limit
        that chat's first turns prefilled at full attention's rate (105-123K cold tokens per 5 s,
        against 98-106K)."""
        order, uncached = self._admission_order()
        taken: set[int] = set()
        demand = None
        ahead = sum(len(r.input_ids) - r.num_computed for r in self.prefilling)
        for req in order:
            if free_places <= 0:
                break
            if ahead >= ADMITTED_STEPS_AHEAD * self.chunk_budget:
                if id(req) not in uncached:
                    uncached[id(req)] = len(req.input_ids) - self.cache.tree.cached_len(req.input_ids)
                if uncached[id(req)] > self.chunk_budget:
                    continue
            if any(shares_prefill(req, other) for other in self.prefilling):
                continue
            if demand is None and self.min_context is not None:
                demand = long_document_demand([*running, *self.prefilling, req, *self.waiting], self.min_context)
            if not self.cache.try_admit(req, demand or 0):
                if nothing_in_flight and not self.prefilling and self.cache.compressed is not None \
                        and not self.cache.demotion_can_help():
                    # nothing running will free the compressed pools: this request can never start
                    req.finish_reason = {"type": "abort", "message": "the ShadowKV pools are full"}
                    self.rejected.append(req)
                    taken.add(id(req))
                    continue
                break  # the first in order waits for memory; nobody overtakes it (it would starve)
            self.prefilling.append(req)
            taken.add(id(req))
            free_places -= 1
            ahead += len(req.input_ids) - req.num_computed
        if taken:
            self.waiting = deque(r for r in self.waiting if id(r) not in taken)

    def schedule(self) -> tuple[list[StepItem], list[Req]]:
        """The next chunk of each admitted prompt within the chunk budget: in admission order
        (fcfs), or by response ratio over the prompt tokens each still needs (hrrn). A sparse
        suffix over a compressed document takes at most SUFFIX_CHUNK_TOKENS a step."""
        items, reqs, budget = [], [], self.chunk_budget
        order = self.prefilling
        if self.policy == "hrrn":
            order = sorted(order, key=lambda r: self._priority(r, len(r.input_ids) - r.num_computed))
        for req in order:
            if budget <= 0:
                break
            take = budget
            if req.over_compressed_prefix and not req.shadowkv.exact_prefill:
                take = min(budget, SUFFIX_CHUNK_TOKENS)
            tokens = req.input_ids[req.num_computed:req.num_computed + take]
            budget -= len(tokens)
            self.computed_tokens += len(tokens)
            item = StepItem(req.pool_row, tokens, req.num_computed, req.shadowkv, len(req.input_ids),
                            req.cached_tokens)
            self.cache.prepare(req, item)
            items.append(item)
            reqs.append(req)
        return items, reqs

    def take_done(self) -> list[Req]:
        """The admitted requests whose prompt is now fully computed (they leave prefill)."""
        done = [r for r in self.prefilling if r.prompt_done]
        self.prefilling = [r for r in self.prefilling if not r.prompt_done]
        return done

    def abort(self, rid: str) -> Req | None:
        """Remove a waiting or prefilling request by rid (None: not here). A prefilling one still
        holds its cache state: the caller releases it."""
        for queue in (self.waiting, self.prefilling):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    req.finish_reason = {"type": "abort", "message": "aborted"}
                    return req
        return None

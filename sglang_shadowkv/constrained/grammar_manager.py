"""The scheduler's side of constrained decoding: compile off the step, mask before sampling,
advance after.

A request with a grammar waits here, not in the scheduler's queue, while its grammar compiles in a
thread pool; each step takes the ready ones (never waiting on a compilation while other requests
have work). Compiled grammars are cached by spec, so the n samples of a request, or a frontend
program's many calls with one regex, compile once. A grammar that fails to compile fails the
requests waiting for it; the next request with it compiles it again.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from .base import GrammarBackend, GrammarSpec

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.01  # with nothing else to do, wait this long for a compilation before returning


class GrammarManager:
    def __init__(self, make_backend):
        """make_backend(): the GrammarBackend, built on first use (it reads the whole vocabulary)."""
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._compiled: dict[GrammarSpec, Future] = {}
        self.pending: list = []  # requests whose grammar is compiling

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = self._make_backend()
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        return self._backend

    def submit(self, req) -> bool:
        """Start the request's grammar (req.sampling.grammar). True: it waits here until compiled;
        False: it has no grammar, or the grammar was cached and req.grammar is set."""
        spec = req.sampling.grammar
        if spec is None:
            return False
        future = self._compiled.get(spec)
        if future is None or (future.done() and future.exception() is not None):  # new, or retry
            backend = self.backend
            future = self._compiled[spec] = self._executor.submit(backend.compile, spec)
        if future.done() and future.exception() is None:
            req.grammar = self.backend.matcher(future.result())
            return False
        self.pending.append(req)
        return True

    def ready(self, idle: bool) -> list[str]:
        """The rids of the pending requests whose grammar has compiled or failed. idle: nothing
        else to do, so wait a moment for a compilation."""
        if not self.pending:
            return []
        if idle:
            wait({self._compiled[r.sampling.grammar] for r in self.pending}, IDLE_WAIT_S,
                 return_when=FIRST_COMPLETED)
        return [r.rid for r in self.pending if self._compiled[r.sampling.grammar].done()]

    def take(self, rids: list[str]) -> tuple[list, list]:
        """(the requests of these rids whose grammar is ready, matcher set; those whose grammar
        failed, finished with the reason), in queue order. A compilation they name that is still
        running is waited for: a tensor-parallel rank takes what rank 0 found ready."""
        chosen = set(rids)
        ready, failed, still = [], [], []
        for req in self.pending:
            if req.rid not in chosen:
                still.append(req)
                continue
            future = self._compiled[req.sampling.grammar]
            if future.exception() is not None:
                err = future.exception()
                logger.warning("grammar of request %s failed to compile: %s", req.rid, err)
                req.finish_reason = {"type": "abort", "status_code": 400,
                                     "message": f"sampling_params.{req.sampling.grammar.kind} "
                                                f"failed to compile: {err}"}
                failed.append(req)
            else:
                req.grammar = self.backend.matcher(future.result())
                ready.append(req)
        self.pending = still
        return ready, failed

    def abort(self, rid: str):
        """The pending request with this rid, removed and marked aborted; None if there is none."""
        for req in self.pending:
            if req.rid == rid:
                self.pending.remove(req)
                req.finish_reason = {"type": "abort", "message": "aborted"}
                return req
        return None

    def vocab_mask(self, reqs: list) -> "VocabMask | None":
        """The allowed-token mask of a step's sampled requests (None if none has a grammar)."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.finished]
        if not rows:
            return None
        backend = self.backend
        bitmask = backend.allocate_bitmask(len(reqs))  # all ones: rows without a grammar stay open
        for i in rows:
            reqs[i].grammar.fill_bitmask(bitmask, i)
        return VocabMask(backend, bitmask)

    @staticmethod
    def advance(req, token: int) -> None:
        """Feed the sampled token to the request's matcher. The request finishes when the grammar
        has accepted its end, or if the grammar refuses the token (only possible when the mask
        left nothing allowed)."""
        if req.grammar is None:
            return
        if not req.grammar.accept(token):
            req.finish_reason = {"type": "abort", "message": f"token {token} does not continue the "
                                                             f"request's {req.sampling.grammar.kind}"}
        elif req.grammar.is_terminated():
            req.finish_reason = {"type": "stop", "matched": token}


class VocabMask:
    """A step's bitmask with the backend that applies it (what the sampler needs, and no more)."""

    def __init__(self, backend: GrammarBackend, bitmask: torch.Tensor):
        self.backend, self.bitmask = backend, bitmask

    def apply(self, logits: torch.Tensor) -> None:
        self.backend.apply_bitmask(logits, self.bitmask)

"""The server's warmup (SGLang's warmup request): each kind of step runs once before serving, so
that kernels compile (Triton, FlashInfer's JIT) now and not in a user's time to first token."""

from __future__ import annotations

import copy
import logging
import time
from typing import TYPE_CHECKING

from sglang_shadowkv.sampling_params import SamplingParams
from sglang_shadowkv.shadowkv.suffix_prefill import GRAPH_TOKENS

if TYPE_CHECKING:
    from .scheduler import Scheduler

logger = logging.getLogger(__name__)


def warm_up(scheduler: "Scheduler") -> None:
    """A short prompt; with ShadowKV also a document long enough to be compressed (compressed at its
    prefill whatever the policy), then a question of two 64-query tiles over it (the sparse suffix
    prefill, from a CUDA graph: what a question reads when its document's copy is not loaded dense)
    and its sparse decode, a turn longer than any suffix graph (an eager suffix step: on the H200 a
    chat's first such turn at 16K took 300 ms, most of it compiling, against 100 ms once compiled),
    and a question over the document's copy loaded dense (the default). The cache, the counters and
    ShadowKV's measured rates (its steps compile kernels: they measure nothing of serving) are left
    as they were. Every tensor-parallel rank runs the same steps."""
    saved = [(counters, counters.as_dict()) for counters in [*scheduler.counter_sets, scheduler.step_clock]]
    rates, saved_rates = scheduler.cache.rates, copy.deepcopy(scheduler.cache.rates)
    vocab, context = scheduler.vocab_size, scheduler.context_length
    low = min(1000, vocab // 4)
    ids = [low + (i * 7919) % (vocab - 2 * low) for i in range(context)]
    prompts = [ids[:16]]
    compressed = scheduler.cache.compressed
    if compressed is not None and compressed.cfg.min_context + 200 < context:
        doc = ids[:compressed.cfg.min_context + 64]
        prompts = [doc, doc + ids[-100:], doc + ids[-(GRAPH_TOKENS[-1] + 44):], doc + ids[-60:]]
    start = time.perf_counter()
    policy = None if compressed is None else compressed.policy
    if compressed is not None:
        compressed.policy = "eager"
    try:
        for i, prompt in enumerate(prompts):
            if compressed is not None:  # the suffix prefill's questions read no copy loaded dense
                compressed.copies_loaded_dense = i not in (1, 2)
            scheduler.add_request(f"warmup-{i}", prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
            while scheduler.has_work:
                scheduler.step()
    finally:
        if compressed is not None:
            compressed.policy, compressed.copies_loaded_dense = policy, True
    scheduler.flush_cache()
    scheduler.device_timer.forget()
    for counters, snapshot in saved:
        counters.restore(snapshot)
    if rates is not None:
        vars(rates).update(vars(saved_rates))
    logger.info("warmup: %d requests in %.1f s", len(prompts), time.perf_counter() - start)


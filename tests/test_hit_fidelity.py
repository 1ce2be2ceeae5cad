"""Fidelity on a cache hit (CPU): a question over a cached compressed document answers as the same
question sent cold does. Cold, its prefill attends the document's exact keys; on a hit, its exact
copy's (mem_cache/exact_copies.py), or without copies keys rebuilt from their low-rank factors:
too low a rank (issue 29: the energy rule at 0.999) drifts."""

import os

import pytest
from test_shadowkv import SHADOW_ENGINE

from benchmarks.hit_fidelity import agreement, cache_document, generate_checked
from sglang_shadowkv.testing.prompts import memo_prompts

GREEDY = {"max_new_tokens": 6, "temperature": 0}
# the ShadowKV test engine at the default selection budget (the suffix's selection is part of the hit path)
ENGINE = {k: v for k, v in SHADOW_ENGINE.items() if k != "shadowkv_max_budget"}


def cold_and_hit_answers(engine, prompts: list[list[int]],
                         copies: bool = True) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt alone on an empty cache (cold: compressed at its prefill), then each over the
    memo cached compressed by an earlier request (hit, reading its exact copy or not, as `copies`
    says); each request's path checked by the counters."""
    cold = []
    for ids in prompts:
        engine.flush_cache()
        cold.append(generate_checked(engine, ids, GREEDY, "cold")["output_ids"])
    engine.flush_cache()
    cache_document(engine, os.path.commonprefix(prompts))
    hits = [generate_checked(engine, ids, GREEDY, "hit") for ids in prompts]
    for counter in ("exact_copy_hits", "dense_copy_prefills"):  # the copy, loaded into dense pages
        assert [out["counters"][counter] for out in hits] == [int(copies)] * len(prompts)
    engine.flush_cache()
    return cold, [out["output_ids"] for out in hits]


# keys of rank 2 and one outlier chunk, each span ending on its last chunk (span grid 8), so the memo
# cached alone and each prompt compressed cold are two forms: with the default grid both are one
# form, and even such keys answer alike on a hit and cold
BAD_KEYS = {"shadowkv_rank": 2, "shadowkv_outliers": 1, "shadowkv_span_grid": 8}
NO_COPIES = {"shadowkv_exact_copy_fraction": 0.0}


@pytest.mark.parametrize("settings,faithful", [({}, True), (BAD_KEYS, True), ({**BAD_KEYS, **NO_COPIES}, False)],
                         ids=["defaults", "rank-2-keys", "rank-2-keys-no-copies"])
def test_a_question_on_a_cached_compressed_memo_answers_as_it_does_cold(settings, faithful):
    """With exact copies the question's prefill is cold's, whatever the keys' rank: its first token
    is cold's, and the few decode steps after it agree. Without them the check can fail: keys of
    rank 2 make the hit path answer otherwise."""
    from sglang_shadowkv import Engine

    engine = Engine(**ENGINE, **settings)
    try:
        prompts, _ = memo_prompts(engine, 1200, 3, seed=0)
        cold, hit = cold_and_hit_answers(engine, prompts, copies=settings.get("shadowkv_exact_copy_fraction", 1) > 0)
    finally:
        engine.shutdown()
    same = agreement(hit, cold)
    if faithful:  # every first token, and all but at most one whole answer, as cold
        assert same["first_token"] == len(prompts) and same["same_answers"] >= len(prompts) - 1, same
    else:
        assert same["token_agreement"] < 0.5, same

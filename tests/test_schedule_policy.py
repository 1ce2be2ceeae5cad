"""The schedule policy (CPU, a tiny model): which waiting prompt gets the prefill budget first.

hrrn (the default) lets a question over a cached document overtake a cold document queued before
it, and ages the cold one so that a stream of short requests never holds it back for long; fcfs
serves arrival order.
"""

import pytest

from conftest import assert_pool_clean

from sglang_shadowkv.sampling_params import SamplingParams

CHUNK = 64
GREEDY = dict(max_new_tokens=2, temperature=0, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    return [2 + (seed * 7919 + i * 104729) % 500 for i in range(n)]


@pytest.fixture(scope="module", params=["hrrn", "fcfs"])
def engine(request, tiny_model_path):
    from sglang_shadowkv import Engine

    eng = Engine(model_path=tiny_model_path, chunked_prefill_size=CHUNK, max_total_tokens=8192,
                 schedule_policy=request.param, check_integrity=True)
    yield eng
    eng.shutdown()


def prompt_done_step(sched, reqs) -> dict:
    """Run until idle; the step at which each request's prompt was fully computed."""
    done, step = {}, 0
    while sched.has_work:
        sched.step()
        step += 1
        for r in reqs:
            if r.prompt_done and r.rid not in done:
                done[r.rid] = step
    return done


def test_a_question_on_a_cached_document_overtakes_a_cold_document(engine):
    sched = engine.scheduler
    engine.flush_cache()
    doc = tokens(640, 1)
    engine.generate(input_ids=doc, sampling_params=GREEDY)  # cached now
    cold = sched.add_request("cold", tokens(640, 2), SamplingParams(**GREEDY))
    question = sched.add_request("question", doc + tokens(24, 3), SamplingParams(**GREEDY))
    done = prompt_done_step(sched, [cold, question])
    if engine.server_args.schedule_policy == "hrrn":
        assert done["question"] < done["cold"] and done["question"] <= 2
    else:  # arrival order: the question waits for the cold document's ten chunks
        assert done["question"] >= done["cold"]
    assert_pool_clean(engine)


def test_short_requests_do_not_starve_a_long_one(engine):
    """Every step a new question over a cached document arrives with a step's worth of prompt (an
    overloaded server): the cold document still finishes its prefill within a bounded number of
    steps, its ratio growing with every token computed for others (hrrn takes ~5.5x its steps
    alone here; shortest-first would never finish it, fcfs serves it first)."""
    sched = engine.scheduler
    engine.flush_cache()
    doc = tokens(640, 4)
    engine.generate(input_ids=doc, sampling_params=GREEDY)
    cold = sched.add_request("cold", tokens(1280, 5), SamplingParams(**GREEDY))
    alone = 1280 // CHUNK
    step, shorts = 0, []
    while not cold.prompt_done:
        shorts.append(sched.add_request(f"q{step}", doc + tokens(CHUNK, 100 + step), SamplingParams(**GREEDY)))
        sched.step()
        step += 1
        assert step <= 8 * alone, "the cold document starved"
    while sched.has_work:
        sched.step()
    assert all(r.finished for r in shorts)
    assert_pool_clean(engine)


def test_an_unknown_policy_is_refused(tiny_model_path):
    from sglang_shadowkv import Engine

    with pytest.raises(ValueError, match="schedule_policy"):
        Engine(model_path=tiny_model_path, schedule_policy="lpm")


def test_cold_prompts_are_admitted_as_the_chunk_budget_reaches_them_questions_at_once(engine):
    """Admission reserves a prompt's pages: long cold prompts wait (unreserved) while the admitted
    ones still need two steps' chunk budgets; a short question over a cached document does not."""
    from sglang_shadowkv.scheduler.prefill import ADMITTED_STEPS_AHEAD

    sched = engine.scheduler
    engine.flush_cache()
    doc = tokens(320, 9)
    engine.generate(input_ids=doc, sampling_params=GREEDY)  # cached now
    colds = [sched.add_request(f"cold{i}", tokens(300, 10 + i), SamplingParams(**GREEDY)) for i in range(6)]
    sched.step()
    admitted = [r for r in colds if r.pool_row is not None]
    assert len(admitted) == 1 and len(sched.prefill.waiting) == 5  # 300 tokens fill two 64-token steps and more
    question = sched.add_request("question", doc + tokens(24, 3), SamplingParams(**GREEDY))
    sched.step()
    assert question.pool_row is not None  # admitted beside them: 24 uncached tokens
    most_ahead = 0
    while sched.has_work:
        ahead = sum(len(r.input_ids) - r.num_computed for r in sched.prefill.prefilling)
        most_ahead = max(most_ahead, ahead)
        sched.step()
    assert most_ahead < (ADMITTED_STEPS_AHEAD + 1) * CHUNK + 300
    assert all(r.finished for r in [*colds, question])
    assert_pool_clean(engine)

"""End to end on the embedded SmolLM2-135M (CPU): equal to transformers, prefix reuse, batching,
chunked prefill, stop conditions, and clear errors that leak nothing."""

import pytest
import torch

from conftest import assert_pool_clean

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Water boils at a temperature of",
]
GREEDY = {"max_new_tokens": 16, "temperature": 0}
REFERENCE_TOKENS = 32  # compared with transformers: long enough for small numeric differences to show


def test_greedy_matches_transformers(engine, hf_model):
    outs = engine.generate(PROMPTS, {**GREEDY, "max_new_tokens": REFERENCE_TOKENS})
    eos = engine.scheduler.runner.config.eos_token_ids
    for prompt, out in zip(PROMPTS, outs):
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=REFERENCE_TOKENS, do_sample=False,
                                    eos_token_id=eos, pad_token_id=eos[0])[0, len(ids):].tolist()
        assert out["output_ids"] == ref, prompt
    assert_pool_clean(engine)


def test_shared_prefix_is_reused_and_output_unchanged(engine):
    doc = " ".join(f"Fact {i}: the item number {i} is colored {['red', 'blue', 'green'][i % 3]}."
                   for i in range(40))
    q1, q2 = doc + " Question: what color is item 7?", doc + " Question: what color is item 12?"
    engine.flush_cache()
    alone = engine.generate(q2, GREEDY)
    engine.flush_cache()
    engine.generate(q1, GREEDY)
    shared = engine.generate(q2, GREEDY)
    ids1 = engine.tokenizer.encode(q1, add_special_tokens=False)
    ids2 = engine.tokenizer.encode(q2, add_special_tokens=False)
    common = next(i for i, (a, b) in enumerate(zip(ids1, ids2)) if a != b)
    page = engine.server_args.page_size
    assert shared["meta_info"]["cached_tokens"] == common // page * page
    assert shared["meta_info"]["cached_tokens"] > 300
    assert alone["meta_info"]["cached_tokens"] == 0
    assert shared["output_ids"] == alone["output_ids"]
    assert_pool_clean(engine)


def test_requests_arriving_together_prefill_a_shared_document_once(engine):
    """In-batch prefix caching: the first request prefills the document, the others wait for it
    and reuse it from the radix cache; their answers are those of requests sent one by one."""
    doc = " ".join(f"Fact {i}: the item number {i} is colored {['red', 'blue', 'green'][i % 3]}."
                   for i in range(60))
    prompts = [doc + f" Question: what color is item {i}?" for i in (3, 17, 29)]
    engine.flush_cache()
    singles = [engine.generate(p, GREEDY)["output_ids"] for p in prompts]
    engine.flush_cache()
    before = engine.get_server_info()["stats"]["prefill_tokens"]
    outs = engine.generate(prompts, GREEDY)
    prefilled = engine.get_server_info()["stats"]["prefill_tokens"] - before
    doc_tokens = len(engine.tokenizer.encode(doc, add_special_tokens=False))
    assert [o["meta_info"]["cached_tokens"] for o in outs][1:] >= [doc_tokens // 16 * 16 - 16] * 2
    assert prefilled < doc_tokens + 3 * 40  # the document once, and each question
    assert [o["output_ids"] for o in outs] == singles
    assert_pool_clean(engine)


def test_flush_is_refused_while_a_request_runs(engine):
    """Even one that matched no cached prefix (it holds the tree's root, not a node)."""
    from sglang_shadowkv.sampling_params import SamplingParams

    sched = engine.scheduler
    engine.generate(PROMPTS[0], GREEDY)
    sched.add_request("flush-while-running", engine.tokenizer.encode("Zebras and"), SamplingParams(max_new_tokens=4))
    sched.step()
    assert not engine.flush_cache()
    while sched.has_work:
        sched.step()
    assert engine.flush_cache()
    assert engine.get_server_info()["memory"]["tree_pages"] == 0
    assert_pool_clean(engine)


def test_batch_equals_one_by_one(engine):
    prompts = [PROMPTS[0], PROMPTS[1] * 6, PROMPTS[2], PROMPTS[4] * 3]
    engine.flush_cache()
    batched = engine.generate(prompts, GREEDY)
    singles = []
    for p in prompts:
        engine.flush_cache()
        singles.append(engine.generate(p, GREEDY))
    assert [o["output_ids"] for o in batched] == [o["output_ids"] for o in singles]
    assert_pool_clean(engine)


def test_chunked_prefill_equals_one_pass():
    from sglang_shadowkv import Engine

    long_prompt = PROMPTS[4] * 20  # ~300 tokens
    small = Engine(max_total_tokens=2048, chunked_prefill_size=37, page_size=4)
    try:
        chunked = small.generate(long_prompt, GREEDY)["output_ids"]
    finally:
        small.shutdown()
    big = Engine(max_total_tokens=2048, chunked_prefill_size=4096)
    try:
        assert big.generate(long_prompt, GREEDY)["output_ids"] == chunked
    finally:
        big.shutdown()


def test_the_step_log_has_a_line_per_step_with_its_chunks_decodes_and_queues(tmp_path):
    import json

    from sglang_shadowkv import Engine

    log = tmp_path / "steps.jsonl"
    eng = Engine(max_total_tokens=2048, chunked_prefill_size=37, step_log=str(log))
    try:
        out = eng.generate(input_ids=[9] * 100, sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    finally:
        eng.shutdown()
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    chunks = [c for s in steps for c in s["chunks"]]
    assert [c[0] for c in chunks] == [0, 37, 74] and sum(c[1] for c in chunks) == 100  # chunks of at most 37
    assert not any(c[2] for c in chunks)  # nothing compressed (full attention)
    assert [s["label"] for s in steps].count("decode_only") == 3  # 4 tokens: the last chunk samples the first
    assert all(s["decoding"] == 1 and s["decode_rows"] == 1 for s in steps if s["label"] == "decode_only")
    assert steps[0]["prefilling"] == 1 and steps[0]["waiting"] == 0
    assert all(a["t"] <= b["t"] and a["ms"] >= 0 for a, b in zip(steps, steps[1:]))
    assert steps[0]["pages"]["reserved"] > 0 and all(s["pages"]["lent"] == 0 for s in steps)  # full attention lends none
    assert "gpu_values" not in steps[0]
    assert len(out["output_ids"]) == 4


def test_stop_conditions(engine):
    base = engine.generate(PROMPTS[1], GREEDY)
    word = base["text"].split()[3]
    out = engine.generate(PROMPTS[1], {**GREEDY, "stop": [word]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert word not in out["text"] and base["text"].startswith(out["text"])
    tok = base["output_ids"][5]
    out = engine.generate(PROMPTS[1], {**GREEDY, "stop_token_ids": [tok]})
    assert out["output_ids"] == base["output_ids"][:6]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    out = engine.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": 3})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert out["output_ids"] == base["output_ids"][:3]
    out = engine.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
    assert_pool_clean(engine)


def test_sampling_is_seeded(engine):
    params = {"max_new_tokens": 12, "temperature": 0.9, "top_p": 0.9, "sampling_seed": 11}
    a = engine.generate(PROMPTS[0], params)["output_ids"]
    b = engine.generate(PROMPTS[0], params)["output_ids"]
    assert a == b


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": ""}, "empty"),
    ({"prompt": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"prompt": "hi", "sampling_params": {"temprature": 0.5}}, "temprature"),
    ({"prompt": "word " * 9000}, "context length"),
    ({"input_ids": [1, 2, 10**9]}, "input_ids"),
    ({"input_ids": [1, -2, 3]}, "input_ids"),
    ({"input_ids": [1, True, 3]}, "input_ids"),
    ({"input_ids": [1, 2.0, 3]}, "input_ids"),
    ({"prompt": ["fine", ""]}, "empty"),
    ({"prompt": ["fine", "word " * 9000]}, "context length"),
])
def test_bad_input_raises_and_leaks_nothing(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)
    assert not engine.scheduler.has_work
    assert_pool_clean(engine)


def test_huge_max_new_tokens_is_capped_by_context(engine):
    first = engine.generate("hi", GREEDY)["output_ids"][0]
    out = engine.generate("hi", {"max_new_tokens": 10**6, "temperature": 0, "stop_token_ids": [first]})
    assert out["output_ids"] == [first]
    assert_pool_clean(engine)


def test_pool_too_small_is_a_clear_error():
    from sglang_shadowkv import Engine

    tiny = Engine(max_total_tokens=64)
    try:
        with pytest.raises(ValueError, match="max_total_tokens"):
            tiny.generate("hello there", {"max_new_tokens": 100})
        assert tiny.generate("hello", {"max_new_tokens": 4, "temperature": 0})["output_ids"]
        assert_pool_clean(tiny)
    finally:
        tiny.shutdown()


def test_engine_arguments_are_checked():
    from sglang_shadowkv import Engine

    with pytest.raises(TypeError, match="bogus_flag"):
        Engine(bogus_flag=1)
    with pytest.raises(ValueError, match="attention"):
        Engine(attention="sparse")
    with pytest.raises(ValueError, match="page_size"):
        Engine(page_size=0)
    with pytest.raises(ValueError, match="step_log"):
        Engine(step_log="/no/such/folder/steps.jsonl")


def test_step_time_is_booked_to_decode_only_steps_and_steps_with_prompt_chunks(engine):
    """server_info's step clock: every step's time from its launch to the next step (or to going
    idle), by kind; it adds up to no more than the calls took, and an idle wait is no step's."""
    import time

    info = engine.get_server_info()
    before, clock_before = info["stats"], info["steps"]["clock"]
    wall = 0.0
    for ids, new in (([[5] * 8, [7] * 6], 3), ([6] * 5, 1)):
        start = time.perf_counter()
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": new, "ignore_eos": True})
        wall += time.perf_counter() - start
        time.sleep(0.5)  # idle: booked to nothing
    info = engine.get_server_info()
    after, clock = info["stats"], info["steps"]["clock"]
    delta = {k: after[k] - before[k] for k in ("decode_steps", "prefill_steps", "suffix_steps", "decode_only_step_ms",
                                                "suffix_step_ms", "prefill_step_ms")}
    assert delta["prefill_steps"] >= 2 and delta["decode_steps"] >= 2
    assert delta["decode_only_step_ms"] > 0 and delta["prefill_step_ms"] > 0
    assert delta["suffix_steps"] == delta["suffix_step_ms"] == 0  # full attention: nothing compressed
    assert delta["decode_only_step_ms"] + delta["prefill_step_ms"] <= 1000 * wall + 5
    # the clock by label adds up to the kinds: here prompt steps alone (the two prompts of the
    # first call share a step) and decode-only steps, 8 + 6 + 5 prompt tokens
    grew = {label: {f: n - clock_before.get(label, {}).get(f, 0) for f, n in shape.items()}
            for label, shape in clock.items()}
    assert {label for label, shape in grew.items() if shape["steps"]} == {"prefill", "decode_only"}
    assert grew["prefill"]["steps"] == delta["prefill_steps"] and grew["prefill"]["prompt_tokens"] == 19
    assert grew["prefill"]["ms"] == delta["prefill_step_ms"] and grew["decode_only"]["ms"] == delta["decode_only_step_ms"]
    assert grew["prefill"]["decode_rows"] == 0 and grew["decode_only"]["decode_rows"] >= 3
    assert all(shape["device_ms"] == 0 for shape in clock.values())  # CUDA events time steps on a GPU only


class _FakeEvent:
    def __init__(self, done: bool, at_ms: float = 0.0):
        self.done, self.at_ms = done, at_ms

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "_FakeEvent") -> float:
        return end.at_ms - self.at_ms


def test_device_step_times_are_booked_in_launch_order_once_the_device_ran_them():
    from sglang_shadowkv.scheduler.counters import DeviceStepTimer, StepClock

    clock = StepClock()
    timer = DeviceStepTimer(clock, torch.device("cpu"))
    assert timer.start() is None  # off a GPU: nothing timed
    timer.stop("prefill", None)
    assert not timer.pending and clock.as_dict() == {}
    timer.pending.extend([("prefill", _FakeEvent(True, 1.0), _FakeEvent(True, 41.4)),
                          ("decode_only", _FakeEvent(True, 50.0), _FakeEvent(False, 70.0)),
                          ("prefill", _FakeEvent(True, 80.0), _FakeEvent(True, 90.0))])
    timer.collect()  # the second step is still running: it and the one after it wait
    assert clock.as_dict() == {"prefill": {"steps": 0, "ms": 0, "prompt_tokens": 0, "decode_rows": 0, "device_ms": 40}}
    timer.pending[0][2].done = True
    timer.collect()
    assert clock.as_dict()["prefill"]["device_ms"] == 50 and clock.as_dict()["decode_only"]["device_ms"] == 20
    assert not timer.pending

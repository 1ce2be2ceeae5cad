"""Logprobs in SGLang's shape on the embedded model (CPU): prompt logprobs equal transformers' over
chunked prefill, a cached prefix and the ShadowKV path; output, top-k and asked-id logprobs agree
with the sampled tokens; bad fields are errors naming them."""

import pytest
import torch

from conftest import assert_pool_clean
from sglang_shadowkv.managers.request_output import output_dict
from sglang_shadowkv.scheduler.logprobs import LogprobOptions
from sglang_shadowkv.model_executor.model_runner import ModelRunner
from sglang_shadowkv.scheduler.scheduler import Scheduler
from sglang_shadowkv.sampling_params import SamplingParams
from sglang_shadowkv.server_args import ServerArgs

TOL = 2e-3  # float32 engine against float32 transformers


def facts(n: int) -> str:
    return " ".join(f"Fact {i}: the crate numbered {i} holds {['apples', 'tin', 'rope'][i % 3]}." for i in range(n))


def reference(hf_model, ids: list[int]) -> torch.Tensor:
    """logprobs [len, vocab]: row p is the distribution of token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)


def assert_input_logprobs_match(meta, ids, start, ref):
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == ids[start:] and entries[0][0] is None
    want = [ref[p - 1, ids[p]].item() for p in range(start + 1, len(ids))]
    assert torch.allclose(torch.tensor([e[0] for e in entries[1:]]), torch.tensor(want), atol=TOL)


def test_prompt_logprobs_equal_transformers_across_prefill_chunks(engine, hf_model):
    prompt = facts(60)  # ~900 tokens: two chunks of 512
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    assert len(ids) > 512
    engine.flush_cache()
    out = engine.generate(prompt, {"max_new_tokens": 3, "temperature": 0}, return_logprob=True,
                          logprob_start_len=0, top_logprobs_num=3, token_ids_logprob=[5, 42],
                          return_text_in_logprobs=True)
    meta, ref = out["meta_info"], reference(hf_model, ids)
    assert_input_logprobs_match(meta, ids, 0, ref)
    assert meta["input_top_logprobs"][0] is None and meta["input_token_ids_logprobs"][0] is None
    for p in (1, 400, 511, 512, 513, len(ids) - 1):  # around the chunk boundary too
        top = meta["input_top_logprobs"][p]
        assert [t for _, t, _ in top] == ref[p - 1].topk(3).indices.tolist()
        asked = meta["input_token_ids_logprobs"][p]
        assert [t for _, t, _ in asked] == [5, 42]
        assert torch.allclose(torch.tensor([v for v, _, _ in asked]), ref[p - 1, [5, 42]], atol=TOL)
    assert meta["input_token_logprobs"][1][2] == engine.tokenizer.decode([ids[1]])  # text of the token alone
    assert_pool_clean(engine)


def test_output_logprobs_are_those_of_the_sampled_tokens(engine, hf_model):
    out = engine.generate("The capital of France is", {"max_new_tokens": 6, "temperature": 0},
                          return_logprob=True, top_logprobs_num=2)
    meta = out["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 6
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(e[2] is None for e in meta["output_token_logprobs"])  # no text unless asked
    for (value, token, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert top[0][1] == token and top[0][0] == pytest.approx(value) and top[1][0] <= value  # greedy
    ids = engine.tokenizer.encode("The capital of France is", add_special_tokens=False)
    ref = reference(hf_model, ids + out["output_ids"])
    want = [ref[len(ids) - 1 + k, t].item() for k, t in enumerate(out["output_ids"])]
    assert torch.allclose(torch.tensor([e[0] for e in meta["output_token_logprobs"]]), torch.tensor(want), atol=TOL)


def test_prompt_only_request_scores_the_next_token(engine):
    """max_new_tokens 0 with return_logprob (what sgl.select sends): no output token, but SGLang
    reports the logprob of the token that would come next."""
    out = engine.generate("Hello there, how are", {"max_new_tokens": 0, "temperature": 0}, return_logprob=True,
                          logprob_start_len=2)
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["completion_tokens"] == 0
    assert len(meta["output_token_logprobs"]) == 1 and len(meta["input_token_logprobs"]) == meta["prompt_tokens"] - 2


def test_cached_prefix_is_matched_only_up_to_logprob_start_len(engine, hf_model):
    prompt = facts(25)
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    engine.flush_cache()
    engine.generate(prompt, {"max_new_tokens": 0})  # the whole prompt is now cached
    ref = reference(hf_model, ids)
    for start in (100, len(ids) - 2):
        out = engine.generate(prompt, {"max_new_tokens": 1, "temperature": 0}, return_logprob=True,
                              logprob_start_len=start)
        assert out["meta_info"]["cached_tokens"] == start // 8 * 8  # page-aligned, never past start
        assert_input_logprobs_match(out["meta_info"], ids, start, ref)
    assert_pool_clean(engine)


@pytest.mark.parametrize("kwargs, field", [
    ({"logprob_start_len": 10_000}, "logprob_start_len"),
    ({"logprob_start_len": -2}, "logprob_start_len"),
    ({"top_logprobs_num": -1}, "top_logprobs_num"),
    ({"top_logprobs_num": 10**6}, "top_logprobs_num"),
    ({"token_ids_logprob": [10**7]}, "token_ids_logprob"),
    ({"token_ids_logprob": "5"}, "token_ids_logprob"),
])
def test_bad_logprob_fields_name_the_field(engine, kwargs, field):
    with pytest.raises(ValueError, match=field):
        engine.generate("Hello", {"max_new_tokens": 1}, return_logprob=True, **kwargs)
    assert_pool_clean(engine)


def test_prompt_logprobs_through_shadowkv(engine, hf_model):
    """A prompt compressed in its own prefill, and a suffix over that compressed prefix (rank =
    key dims: the restored keys are exact), give transformers' prompt logprobs."""
    args = ServerArgs(attention="shadowkv", shadowkv_min_context=512, shadowkv_rank=192, shadowkv_span_grid=8,
                      shadowkv_host_tokens=4096, max_total_tokens=8192, chunked_prefill_size=512,
                      shadowkv_compress_policy="eager", check_integrity=True)
    sched = Scheduler(args, ModelRunner(args, loaded=engine.scheduler.runner.loaded))
    doc = engine.tokenizer.encode(facts(38), add_special_tokens=False)
    question = engine.tokenizer.encode(" Question: what does crate 7 hold? Answer:", add_special_tokens=False)

    def run(rid, ids, start, new_tokens):
        req = sched.add_request(rid, ids, SamplingParams(max_new_tokens=new_tokens, temperature=0),
                                LogprobOptions(start_len=start))
        while not req.finished:
            sched.step()
        return output_dict(engine.tokenizer, req)["meta_info"]

    first = run("doc", doc, 0, 1)
    assert first["shadowkv"]["compressed_tokens"] > 0
    assert_input_logprobs_match(first, doc, 0, reference(hf_model, doc))
    ids = doc + question
    second = run("question", ids, len(doc), 2)
    assert second["cached_tokens"] >= len(doc) - 8 and sched.stats["compressed_prefix_hits"] == 1
    assert_input_logprobs_match(second, ids, len(doc), reference(hf_model, ids))
    decoded = second["output_token_logprobs"]  # decoded sparsely over the compressed prefix
    assert len(decoded) == 2 and all(value <= 0 for value, _, _ in decoded)

"""--enable-metrics: Prometheus text at /metrics with SGLang's names, request timing counted exactly
once per token and request, scheduler and ShadowKV state read from server_info at scrape time."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sglang_shadowkv import Engine
from sglang_shadowkv.entrypoints.http_server import build_app
from sglang_shadowkv.diagnostics.metrics import ServerMetrics
from sglang_shadowkv.managers.tokenizer_manager import ModelInfo, TokenizerManager
from sglang_shadowkv.server_args import ServerArgs

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
PROMPT = "Metrics test: count the apples, pears and plums in the basket on the kitchen table."  # ~20 tokens


def samples(text: str) -> dict[str, float]:
    """sample name (histograms: name_count, name_sum, ...; le buckets left out) -> value."""
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if "le" not in s.labels}


def scrape(url: str) -> dict[str, float]:
    resp = httpx.get(url + "/metrics", timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return samples(resp.text)


def test_request_metrics_count_every_token_and_request(small_server):
    url = small_server.url
    before = scrape(url)
    plain = httpx.post(url + "/generate", json={"text": PROMPT, "sampling_params": GREEDY}, timeout=60).json()
    body = {"text": PROMPT, "sampling_params": GREEDY, "stream": True}
    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and list(resp.iter_lines())[-2] == "data: [DONE]"
    after = scrape(url)

    def grew(name):
        return after[name] - before.get(name, 0.0)

    meta = plain["meta_info"]
    assert grew("sglang:num_requests_total") == 2
    assert grew("sglang:prompt_tokens_total") == 2 * meta["prompt_tokens"]
    assert grew("sglang:generation_tokens_total") == 2 * GREEDY["max_new_tokens"]
    assert grew("sglang:cached_tokens_total") == (meta["prompt_tokens"] - 1) // 8 * 8 > 0  # the second's pages
    assert grew("sglang:time_to_first_token_seconds_count") == 2
    assert grew("sglang:e2e_request_latency_seconds_count") == 2
    assert grew("sglang:inter_token_latency_seconds_count") == 2 * (GREEDY["max_new_tokens"] - 1)
    assert grew("sglang:e2e_request_latency_seconds_sum") >= grew("sglang:time_to_first_token_seconds_sum") > 0
    assert after["sglang:num_running_reqs"] == 0 and after["sglang:num_queue_reqs"] == 0
    assert after["sglang:max_total_num_tokens"] == 4096
    assert 0 <= after["sglang:token_usage"] <= 1 and 0 < after["sglang:cache_hit_rate"] < 1
    assert not any(name.startswith("shadowkv:") for name in after)  # full attention


def test_shadowkv_metrics_follow_server_info(tiny_model_path):
    with Engine(model_path=tiny_model_path, attention="shadowkv", max_total_tokens=4096,
                shadowkv_min_context=64, shadowkv_local_window=16, shadowkv_span_grid=8,
                shadowkv_compress_policy="eager") as engine:
        doc = " ".join(f"t{i % 500 + 2}" for i in range(100))
        engine.generate(doc, {"max_new_tokens": 4})
        engine.generate(doc + " t3", {"max_new_tokens": 4})
        info = engine.get_server_info()
    got = samples(ServerMetrics("tiny").render(info).decode())
    skv, pools = info["shadowkv"], info["shadowkv"]["pools"]
    assert got["shadowkv:compressed_tokens_total"] == skv["compressed_tokens"] == 96
    assert got["shadowkv:compressions_total"] == skv["compressions"] >= 1
    assert got["shadowkv:compressed_prefix_hits_total"] == 1
    assert got["shadowkv:compressed_tokens_reused_total"] == 96
    assert got["shadowkv:segments"] == pools["segments"] >= 1
    assert got["shadowkv:gpu_compressed_bytes"] == pools["segment_gpu_bytes"] > 0
    assert got["shadowkv:host_compressed_bytes"] == pools["segment_host_bytes"] > 0
    assert got["shadowkv:chunk_slot_usage"] == pytest.approx(1 - pools["free_chunk_slots"] / pools["chunk_slots"])
    assert got["shadowkv:chunk_cache_hit_rate"] == 0.0  # nothing running
    assert got["shadowkv:gpu_value_loads_total"] == skv["gpu_value_loads"] >= 1  # the pool had pages to spare
    assert got["shadowkv:gpu_value_bytes"] == skv["tiers"]["compressed_gpu_value_bytes"] > 0
    budget = skv["budget"]  # the selected-set histogram over every decode step so far
    assert got["shadowkv:selected_chunks_count"] == budget["head_steps"] > 0
    assert got["shadowkv:selected_chunks_sum"] == pytest.approx(budget["mean_chunks"] * budget["head_steps"])
    assert got["shadowkv:chunk_cache_lookups_total"] == skv["chunk_cache"]["lookups"] > 0


def test_metrics_route_exists_only_when_enabled(tmp_path):
    from starlette.testclient import TestClient

    info = ModelInfo(tokenizer=None, model_path="m", context_length=32, vocab_size=8, max_total_tokens=64)
    tm = TokenizerManager(info, f"ipc://{tmp_path}/scheduler", f"ipc://{tmp_path}/tm")
    try:
        assert TestClient(build_app(tm, ServerArgs())).get("/metrics").status_code == 404
    finally:
        tm.close()


def test_profile_routes_profile_scheduler_steps(small_server, tmp_path):
    """/start_profile (SGLang's route) profiles the next num_steps scheduler steps; /stop_profile
    returns the per-step times and top ops, and the trace and table are on disk."""
    url = small_server.url
    bad = httpx.post(url + "/start_profile", json={"num_steps": 0}, timeout=30)
    assert bad.status_code == 400 and "num_steps" in bad.json()["error"]["message"]
    assert httpx.post(url + "/start_profile", json={"num_steps": 3, "output_dir": str(tmp_path)},
                      timeout=30).status_code == 200
    assert httpx.post(url + "/start_profile", json={}, timeout=30).status_code == 400  # one at a time
    httpx.post(url + "/generate", json={"text": PROMPT, "sampling_params": GREEDY}, timeout=60).raise_for_status()
    summary = httpx.post(url + "/stop_profile", timeout=120).json()
    assert summary["steps"] == 3 and summary["ms_per_step"] > 0 and summary["top_ops"]
    assert all(op["calls"] >= 1 for op in summary["top_ops"])
    names = sorted(p.suffix for p in tmp_path.iterdir())
    assert names == [".json", ".txt"]

"""A short run of benchmarks/soak.py's core (ShadowKV mode, CPU): the traffic mix against a live
server, a checkpoint while it runs and one at the end, then no 5xx, no unexpected answer and
nothing leaked."""

from benchmarks.soak import parse_args, run_soak

NOTHING = {"pages": 0, "segments": 0, "host_slots": 0, "chunk_refs": 0, "scratch_rows": 0}


def test_short_soak_serves_the_mix_and_leaks_nothing():
    # seed 2: the first client's first request is a question on the document, so it is compressed
    args = parse_args(["--minutes", "0.35", "--attention", "shadowkv", "--clients", "3", "--documents", "1",
                       "--doc-tokens", "640", "--shadowkv-min-context", "512", "--sample-s", "5",
                       "--checkpoint-s", "10", "--seed", "2"])
    run = run_soak("shadowkv", args, progress=lambda line: None)
    assert run["http_5xx"] == 0 and run["unexpected"] == {}, run["outcomes"]
    assert run["leaks"] == NOTHING and run["healthy_after"]
    assert len(run["checkpoints"]) >= 2  # one while it ran, one at the end
    assert all(c["leaks"] == NOTHING and c["all_free_after_flush"] for c in run["checkpoints"])
    assert run["requests"] >= 5 and "document" in run["outcomes"] and run["shadowkv"]["compressed_tokens"] > 0
    assert len(run["series"]) >= 3 and run["latency"]["all"]["p99_s"] >= run["latency"]["all"]["p50_s"] > 0
    assert run["ok"]

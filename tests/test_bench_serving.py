"""benchmarks/bench_serving.py on its seconds-long preset: both attention modes answer every request,
the report has SGLang's metric names (TTFT p50/p90/p99) and the ratios, and the server's counters show
the default cold documents prefilled inside the timed phase (kept dense by ShadowKV's tier policy while
they fit, never compressed) and a closed-loop chat's second turn reusing its first turn dense."""

import json

from benchmarks import bench_serving

DOC = 640  # the test preset's decode documents
CHAT = "multi_session/1x256x2/c1/closed"  # one short chat (one prefill chunk), two turns


def test_serving_benchmark_runs_both_modes(tmp_path):
    out = tmp_path / "serving.json"
    report = bench_serving.main(["--preset", "test", "--scenarios", "decode", "multi_session",
                                 "--multi-session", "1x256x2x1x0", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert (report["documents"], report["request_rate"]) == ("cold", bench_serving.PRESETS["test"].request_rate)
    for mode in ("full", "shadowkv"):
        cases = report["modes"][mode]["cases"]
        assert list(cases) == [f"decode/{DOC}x2", CHAT]
        for name, case in cases.items():
            assert case["num_errors"] == 0 and case["requests"] > 0, (mode, name, case["errors"])
            assert case["documents"] == "cold"
            assert 0 < case["ttft_ms"]["p50"] <= case["ttft_ms"]["p90"] <= case["ttft_ms"]["p99"]
            assert case["itl_ms"]["p99"] >= case["itl_ms"]["p50"] > 0
            assert case["output_tok_s"] > 0 and case["decode_tok_s"] > 0
        # cold: the timed requests prefilled their whole documents, none found cached
        decode = cases[f"decode/{DOC}x2"]["server"]["counters"]
        assert decode["prefill_tokens"] == 2 * (DOC + bench_serving.QUESTION_TOKENS)
        assert decode["dense_prefix_hits"] == 0
        # closed loop: the second turn, sent on the first's answer, found its history dense in the cache
        chat = cases[CHAT]["server"]["counters"]
        assert cases[CHAT]["requests"] == 2 and chat["dense_prefix_hits"] == 1 and chat["reprefilled_tokens"] == 0
    skv = report["modes"]["shadowkv"]["cases"]
    decode = skv[f"decode/{DOC}x2"]
    assert set(decode["shadowkv_vs_full"]) == {"decode", "throughput", "ttft_p50"}
    # tier policy: the documents fit the pool dense, so nothing was compressed or demoted
    for case in skv.values():
        assert case["server"]["counters"]["compressions"] == case["server"]["counters"]["demotions"] == 0
    # one device call per mode, merged afterwards: the same comparison
    parts = []
    for mode in ("full", "shadowkv"):
        part = {**report, "modes": {mode: report["modes"][mode]}}
        parts.append(tmp_path / f"{mode}.json")
        parts[-1].write_text(json.dumps(part))
    merged = bench_serving.main(["--merge", *map(str, parts), "--out", str(tmp_path / "merged.json")])
    again = merged["modes"]["shadowkv"]["cases"][f"decode/{DOC}x2"]
    assert again["shadowkv_vs_full"] == decode["shadowkv_vs_full"] and again["startup"]["capacity"]

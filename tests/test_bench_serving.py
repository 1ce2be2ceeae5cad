"""benchmarks/bench_serving.py on its seconds-long preset: both attention modes answer every request,
the report has SGLang's metric names and the ratios, and the server's counters show the documents
compressed by the load phase and then only the questions prefilled."""

import json

from benchmarks import bench_serving


def test_serving_benchmark_runs_both_modes(tmp_path):
    out = tmp_path / "serving.json"
    report = bench_serving.main(["--preset", "test", "--scenarios", "decode", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    for mode in ("full", "shadowkv"):
        for name, case in report["modes"][mode]["cases"].items():
            assert case["num_errors"] == 0 and case["requests"] > 0, (mode, name, case["errors"])
            assert case["ttft_ms"]["p50"] > 0 and case["itl_ms"]["p99"] >= case["itl_ms"]["p50"] > 0
            assert case["output_tok_s"] > 0 and case["decode_tok_s"] > 0
    skv = report["modes"]["shadowkv"]["cases"]
    decode = skv["decode/640x2"]
    assert set(decode["shadowkv_vs_full"]) == {"decode", "throughput", "ttft_p50"}
    # the load phase compressed both documents; the timed requests only prefilled their questions
    assert decode["server"]["counters"]["compressions"] == 0
    assert decode["server"]["counters"]["compressed_prefix_hits"] == 2
    assert decode["server"]["counters"]["prefill_tokens"] == 2 * bench_serving.QUESTION_TOKENS

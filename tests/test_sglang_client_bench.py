"""benchmarks/sglang_client_bench.py's report: parts run in separate device calls merge into one
comparison, a mode's workloads gathered from every part that ran it."""

import os

from benchmarks.sglang_client_bench import compiled_kernels, counter_delta, merge_reports, ratios


def _workload(tok_s: float, ttft_ms: float) -> dict:
    keys = ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
    return {"completed": 8, "output_throughput": tok_s, **{k: ttft_ms for k in keys}}


def test_parts_of_one_mode_merge_and_the_ratios_cover_every_workload():
    parts = [{"client": "c", "modes": {"full": {"startup_s": 1.0, "workloads": {"a": _workload(100, 10)}}}},
             {"client": "c", "modes": {"full": {"startup_s": 2.0, "workloads": {"b": _workload(50, 20)}}}},
             {"client": "c", "modes": {"shadowkv": {"startup_s": 3.0, "workloads": {"a": _workload(90, 11),
                                                                                    "b": _workload(100, 10)}}}}]
    report = merge_reports(parts)
    assert set(report["modes"]["full"]["workloads"]) == {"a", "b"}
    assert report["modes"]["full"]["startup_s"] == 1.0 and report["client"] == "c"
    r = ratios(report)
    assert r["a"]["output_throughput"] == 0.9 and r["b"]["output_throughput"] == 2.0
    assert r["b"]["median_ttft_ms"] == 0.5 and r["a"]["p99_ttft_ms"] == 1.1


def test_a_workloads_counters_are_what_it_added_the_step_clock_per_label_and_the_captures_after_it():
    before = {"decode_steps": 5, "step_clock": {"prefill": {"steps": 2, "ms": 30}, "decode_only": {"steps": 4, "ms": 8}},
              "graph_captures": [["(1, 512)", 0.3]], "chunk_cache": {"hits": 1},
              "graph_replays_by_variant": {"512": 4, "('dense', None)": 2}}
    after = {"decode_steps": 9, "step_clock": {"prefill": {"steps": 5, "ms": 90}, "decode_only": {"steps": 4, "ms": 8},
                                               "suffix": {"steps": 1, "ms": 7}},
             "graph_captures": [["(1, 512)", 0.3], ["(8, 512)", 0.2]], "chunk_cache": {"hits": 3},
             "graph_replays_by_variant": {"512": 9, "('dense', None)": 2, "2560": 1}}
    delta = counter_delta(before, after)
    assert delta["decode_steps"] == 4
    assert delta["step_clock"] == {"prefill": {"steps": 3, "ms": 60}, "suffix": {"steps": 1, "ms": 7}}
    assert delta["graph_captures"] == [["(8, 512)", 0.2]] and delta["chunk_cache"] == {"hits": 3}
    assert delta["graph_replays_by_variant"] == {"512": 5, "2560": 1}


def test_request_details_keep_each_requests_ttft_and_prompt_length():
    from benchmarks.sglang_client_bench import request_details

    client = {"ttfts": [0.51234, 12.0], "input_lens": [16448, 16544], "median_ttft_ms": 1.0}
    assert request_details(client) == {"ttfts_s": [0.512, 12.0], "prompt_lens": [16448, 16544]}
    assert request_details({"median_ttft_ms": 1.0}) == {}  # a client without --output-details


def test_the_kernels_compiled_while_a_workload_ran_are_the_new_variants_per_kernel(tmp_path):
    """The server's Triton cache before and after a workload: a kernel with more variants (or a new
    kernel) was compiled while requests waited."""
    from benchmarks.sglang_client_bench import new_variants, triton_variants

    assert triton_variants(tmp_path / "missing") == {}
    entry = tmp_path / "abc"
    entry.mkdir()
    (entry / "_chunk_stats_kernel.cubin").write_bytes(b"x")
    (entry / "_chunk_stats_kernel.json").write_text("{}")
    (tmp_path / "launcher").mkdir()  # no binary: not a kernel variant
    (tmp_path / "launcher" / "stub.so").write_bytes(b"x")
    assert triton_variants(tmp_path) == {"_chunk_stats_kernel": 1}
    assert new_variants({"_chunk_stats_kernel": 1, "_rotate_kernel": 1},
                        {"_chunk_stats_kernel": 2, "_rotate_kernel": 1, "_plan_kernel": 1}) == \
        {"_chunk_stats_kernel": 1, "_plan_kernel": 1}


def test_compiled_kernels_counts_variants_and_their_stage_seconds(tmp_path):
    def variant(name: str, folder: str, start: float, seconds: float, divisible: bool):
        d = tmp_path / folder
        d.mkdir()
        attr = " {tt.divisibility = 16 : i32}" if divisible else ""
        (d / f"{name}.ttir").write_text(f'module {{\n  tt.func public @{name}(%T: i32{attr} loc("T"(#loc))) {{\n')
        (d / f"{name}.cubin").write_bytes(b"\0")
        (d / f"__grp__{name}.json").write_text("{}")
        os.utime(d / f"{name}.ttir", (start, start))
        os.utime(d / f"{name}.cubin", (start + seconds, start + seconds))
        os.utime(d / f"__grp__{name}.json", (start + 100, start + 100))  # not a stage: not counted

    variant("_decode", "a", 1000.0, 2.5, True)
    variant("_decode", "b", 2000.0, 1.5, False)
    variant("_rotate", "c", 3000.0, 0.25, True)
    (tmp_path / "launcher").mkdir()  # a cached helper without a binary
    (tmp_path / "launcher" / "stub.so").write_bytes(b"\0")
    kernels = compiled_kernels(tmp_path)
    assert list(kernels) == ["_decode", "_rotate"]  # the costliest first
    assert kernels["_decode"]["variants"] == 2 and kernels["_decode"]["seconds"] == 4.0
    assert set(kernels["_decode"]["signatures"]) == {"tt.func public @_decode(%T: i32) {",
                                                     "tt.func public @_decode(%T: i32 {tt.divisibility = 16 : i32}) {"}
    assert kernels["_rotate"] == {"variants": 1, "seconds": 0.25}
    assert compiled_kernels(tmp_path / "missing") == {}

"""benchmarks/step_timeline.py: a --step-log file summarised per run and per time bucket."""

import json

from benchmarks.step_timeline import main, split_runs, summarise_run


def _step(t, ms, chunks=(), rows=0, prefilling=0, values=None, label="prefill", sparse=(0, 0), lent=0):
    step = {"t": t, "label": label, "ms": ms, "chunks": [list(c) for c in chunks], "decode_rows": rows,
            "waiting": 0, "prefilling": prefilling, "decoding": rows, "pages": {"lent": lent}}
    return step if values is None else {**step, "gpu_values": values, "sparse_rows": list(sparse)}


def test_runs_split_at_idle_gaps_and_buckets_add_up(tmp_path, capsys):
    steps = [_step(0.0, 400, [(0, 8192, False)], prefilling=3, values=[0, 0]),
             _step(0.4, 2200, [(8192, 8192, False)], rows=2, prefilling=2, values=[1, 0], label="prefill+decode"),
             _step(5.0, 50, [(16384, 100, True)], rows=4, values=[2, 1], label="suffix+decode", sparse=(3, 1), lent=512),
             _step(5.05, 20, rows=4, values=[2, 1], label="decode_only", sparse=(3, 2), lent=256),
             _step(20.0, 10, [(0, 64, False)])]  # 14 s idle: another run
    runs = split_runs(steps, gap_s=3)
    assert [len(r) for r in runs] == [4, 1]
    first = summarise_run(runs[0], bucket_s=5, slow_ms=700)
    assert first["span_s"] == 5.07 and first["steps"] == 4
    b0, b1 = first["buckets"]
    assert (b0["from_s"], b0["steps"], b0["cold_tokens"], b0["decode_rows"], b0["most_prefilling"]) == (0, 2, 16384, 2, 3)
    assert (b1["from_s"], b1["suffix_tokens"], b1["decode_rows"], b1["value_loads"], b1["value_drops"]) == (5, 100, 8, 1, 1)
    assert (b1["sparse_rows"], b1["hbm_rows"], b1["most_lent"]) == (6, 3, 512)
    assert b0["value_loads"] == 1 and first["slow_steps"] == [{"at_s": 0.4, "label": "prefill+decode", "ms": 2200}]
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(s) + "\n" for s in steps))
    assert main([str(log), "--json"]) == [first, summarise_run(runs[1], 5, 700)]
    main([str(log)])
    assert "slow: 0.4 s prefill+decode 2200 ms" in capsys.readouterr().out

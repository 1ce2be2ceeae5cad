"""benchmarks/plot_serving.py on the committed reports: it writes the PNG and reads, per attention
mode, the workloads SGLang's client ran (4 and 8 documents, 40 documents, 48 chat sessions on the
H100), each from the newest reports that ran it at default flags."""

import json
import shutil
import subprocess
from pathlib import Path

from benchmarks.plot_serving import main, points, variant_flags

ROOT = Path(__file__).resolve().parents[1]


def test_the_plot_of_the_committed_reports_has_every_workload_in_both_modes(tmp_path):
    out = tmp_path / "serving.png"
    pts = main(["--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    got = {(p["device"], p["workload"], p["holds"]) for p in pts}
    assert got == {("H100", "shared_32k", 4), ("H100", "shared_16k", 8), ("H100", "many_16k", 40),
                   ("H100", "chat_16k", 48)}
    assert {(p["workload"], p["mode"]) for p in pts} == {(w, m) for _, w, _ in got for m in ("full", "shadowkv")}
    for p in pts:
        low, high = p["output_throughput_range"]
        assert 0 < low <= p["output_throughput"] <= high and p["ttft_p50_s"] <= p["ttft_p99_s"]
    git = shutil.which("git") and subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode == 0
    if git:  # dates from the commits: the chat's points are the latest runs (run 1's chat read 1.33x)
        chat = {p["mode"]: p for p in pts if p["workload"] == "chat_16k"}
        assert chat["shadowkv"]["output_throughput"] > 2 * chat["full"]["output_throughput"]


def test_the_newest_date_wins_repeats_make_a_median_and_variants_are_left_out(tmp_path):
    def report(date: str, tok_s: float, flags: list[str] = ()) -> dict:
        workload = {"completed": 10, "output_throughput": tok_s, "median_ttft_ms": 1000.0, "p99_ttft_ms": 3000.0,
                    "client_args": ["--gsp-num-groups", "40", "--gsp-system-prompt-len", "16384"]}
        server = ["--attention", "full", "--tokenizer-path", "T", "--model-path", "random:x", "--step-log=/s", *flags]
        return {"date": date, "modes": {"full": {"device": "NVIDIA H200", "server_flags": server,
                                                 "workloads": {"many_16k": workload}}}}

    files = []
    for i, r in enumerate([report("2026-11-01", 50.0), report("2026-12-01", 80.0), report("2026-12-01", 90.0),
                           report("2026-12-01", 90.0), report("2026-12-02", 10.0, ["--disable-cuda-graph"])]):
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text(json.dumps(r))
    (p,) = points(files)
    assert (p["device"], p["holds"], p["date"], p["runs"]) == ("H200", 40, "2026-12-01", 2)  # the copy counted once
    assert p["output_throughput"] == 85.0 and p["output_throughput_range"] == (80.0, 90.0)
    assert p["files"] == ["r1.json", "r2.json", "r3.json"]
    assert variant_flags(["--attention", "full", "--step-log", "/s", "--disable-mixed-step-overlap"]) == \
        ["--disable-mixed-step-overlap"]

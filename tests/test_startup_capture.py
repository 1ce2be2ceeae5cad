"""benchmarks/startup_capture.py's readers: the server log's timeline and the Triton cache's kernels."""

import os
from datetime import datetime

from benchmarks.startup_capture import compiled_kernels, log_timeline


def test_log_timeline_gives_seconds_since_launch_of_timestamped_lines():
    launched = datetime(2026, 11, 25, 18, 0, 0).timestamp()
    log = ("2026-11-25 18:00:09,500 scheduler INFO model ready in 9.1 s\nINFO: an uvicorn line\n"
           "2026-11-25 18:00:31,250 scheduler INFO captured 12 CUDA graph(s)\n")
    assert log_timeline(log, launched) == [(9.5, "scheduler INFO model ready in 9.1 s"),
                                           (31.25, "scheduler INFO captured 12 CUDA graph(s)")]


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

"""maintainers/experiments/startup_capture.py's reader of the server log's timeline (its reader of
the Triton cache is benchmarks/sglang_client_bench.py's, tested there)."""

from datetime import datetime

from maintainers.experiments.startup_capture import log_timeline


def test_log_timeline_gives_seconds_since_launch_of_timestamped_lines():
    launched = datetime(2026, 11, 25, 18, 0, 0).timestamp()
    log = ("2026-11-25 18:00:09,500 scheduler INFO model ready in 9.1 s\nINFO: an uvicorn line\n"
           "2026-11-25 18:00:31,250 scheduler INFO captured 12 CUDA graph(s)\n")
    assert log_timeline(log, launched) == [(9.5, "scheduler INFO model ready in 9.1 s"),
                                           (31.25, "scheduler INFO captured 12 CUDA graph(s)")]

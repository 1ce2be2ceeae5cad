"""benchmarks/mixed_step_overlap.py's round: decodes over a compressed document, then a cold
document and a question beside them, stepped to the end. With the decode and suffix graphs (run
eagerly over their buffers on a CPU) the steps that mix them with the cold prompt run in parts,
and a second round on the emptied cache gives the same tokens (what the GPU run compares with and
without the side stream)."""

from benchmarks.mixed_step_overlap import first_difference, one_round
from sglang_shadowkv import Engine

from test_cold_and_hit import TINY


def test_a_round_runs_mixed_steps_in_parts_and_repeats_its_tokens(tiny_model_path):
    doc = [2 + (j * 7) % 500 for j in range(600)]
    cold = [3 + (j * 11) % 500 for j in range(600)]
    questions = [[5 + i] * 8 for i in range(5)]
    with Engine(model_path=tiny_model_path, max_total_tokens=6000, **TINY) as engine:
        engine.scheduler.runner.init_graphs(8, capture=False)
        first = one_round(engine, doc, cold, questions, decode_tokens=6)
        again = one_round(engine, doc, cold, questions, decode_tokens=6)
        assert first["parts_steps"] >= 1  # the cold prompt's chunks beside the decodes' graph
        assert set(first["outputs"]) == {"q0", "q1", "q2", "cold", "hit"}
        assert all(len(ids) == 6 for ids in first["outputs"].values())
        assert first_difference(first["outputs"], again["outputs"]) == {}
        assert "prefill+decode+compress" in first["clock"]  # the cold document compressed beside them
        assert first["cold_ttft_s"] > 0
        engine.scheduler.cache.check_integrity([])


def test_first_difference_names_each_request_and_where_it_parts():
    a = {"x": [1, 2, 3], "y": [4, 5], "z": [7]}
    b = {"x": [1, 9, 3], "y": [4, 5], "z": [7, 8]}
    assert first_difference(a, b) == {"x": 1, "z": 1}
    assert first_difference(b, a) == {"x": 1, "z": 1}  # a longer output parts where the shorter ends
    assert first_difference(a, a) == {}

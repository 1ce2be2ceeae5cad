"""The graph-ready decode step and overlap scheduling (CPU).

On a GPU decode steps replay CUDA graphs over fixed buffers; here the same path runs eagerly over
the same buffers (capture=False), and must give the tokens of the plain eager step: full
attention, ShadowKV, and batches mixing compressed and dense requests, with requests joining and
leaving between steps, batches padded to a captured size, and the plan written in place.
Overlap scheduling (the next step launched before the last one's tokens are processed) must not
change any output either.
"""

import pytest
import torch

from conftest import assert_pool_clean
from test_shadowkv import (SHADOW_ENGINE, assert_shadow_pools_clean, document_and_questions, greedy_answers,
                           long_prompt)

from sglang_shadowkv.layers.attention.shadowkv_backend import graph_widths
from sglang_shadowkv.model_executor.cuda_graph_runner import graph_batch_sizes, pool_bytes
from sglang_shadowkv.sampling_params import SamplingParams

SHORT = ["The capital of France is", "Once upon a time, in a small village by the sea,",
         "def fibonacci(n):\n    ", "Water boils at a temperature of", "Name three primary colors:"]


def run_staggered(engine, prompts: list[list[int]], max_new: list[int], join_every: int = 3) -> dict:
    """Greedy outputs by rid, requests joining one at a time every few steps (so batches grow and
    shrink between steps)."""
    sched, reqs, pending = engine.scheduler, [], list(enumerate(zip(prompts, max_new)))
    steps = 0
    while pending or sched.has_work:
        if pending and steps % join_every == 0:
            i, (ids, n) = pending.pop(0)
            reqs.append(sched.add_request(f"r{i}", ids, SamplingParams(max_new_tokens=n, temperature=0)))
        sched.step()
        steps += 1
    assert all(r.finished for r in reqs)
    return {r.rid: r.output_ids for r in reqs}


def with_static_decode(engine, max_bs: int):
    engine.scheduler.runner.init_graphs(max_bs, capture=False)
    return engine.scheduler.runner.graphs


def plain_and_graphed(engine_args: dict):
    """A fixture's two engines: one stepping plainly (no overlap), one over the graph buffers."""
    from sglang_shadowkv import Engine

    plain = Engine(**engine_args, disable_overlap_schedule=True)
    graphed = Engine(**engine_args)
    with_static_decode(graphed, 4)
    yield plain, graphed
    plain.shutdown()
    graphed.shutdown()


def test_graph_batch_sizes_cover_every_batch():
    sizes = graph_batch_sizes(40)
    assert sizes == [1, 2, 4, 8, 12, 16, 24, 32, 40]
    assert graph_batch_sizes(3) == [1, 2, 3] and graph_batch_sizes(1) == [1]


def test_sparse_graph_widths_waste_at_most_a_quarter_past_2048_chunks():
    widths = graph_widths(16384)
    assert widths[:4] == [256, 512, 1024, 2048] and widths[-1] == 16384 and widths == sorted(set(widths))
    for need in (2049, 2600, 3000, 4097, 9000, 16384):
        width = next(w for w in widths if w >= need)
        assert width <= 1.25 * need  # a power-of-two ladder gave 4096 columns to a 2049-chunk document
    assert graph_widths(300) == [256, 300]  # the largest is the decoder's own


def test_graph_memory_counts_only_the_graph_pool_segments():
    pool = (0, 7)
    snapshot = [{"total_size": 4 << 20, "segment_pool_id": (0, 7)}, {"total_size": 2 << 20, "segment_pool_id": (0, 0)},
                {"total_size": 1 << 20, "segment_pool_id": [0, 7]}, {"total_size": 8 << 20}]
    assert pool_bytes(snapshot, pool) == 5 << 20
    assert pool_bytes([], pool) == 0


def test_only_a_shapes_first_capture_warms_up_and_a_failed_one_is_redone_warm(dense_pair, monkeypatch):
    """The batch sizes of one shape launch the same kernels: only the first capture runs the step
    eagerly first; a capture without one that fails is redone after a warmup."""
    runner = dense_pair[1].scheduler.runner
    monkeypatch.setattr(runner, "graphs", runner.graphs)  # the fixture's graphs come back afterwards
    graphs = with_static_decode(dense_pair[1], 8)
    calls = []

    def record(batch, key, warm_up):
        calls.append((key[0], warm_up))
        if key[0] == 2 and not warm_up:
            raise RuntimeError("operation not permitted when stream is capturing")
        return object()

    monkeypatch.setattr(graphs, "_record", record)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [])
    variant = graphs.backend.startup_graph_variants()[0]
    graphs._capture([(bs, variant) for bs in (8, 4, 2, 1)])
    assert calls == [(8, True), (4, False), (2, False), (2, True), (1, False)]
    assert all((bs, variant) in graphs.graphs for bs in (8, 4, 2, 1))
    # batch sizes share a shape, so do token counts past one query block (dense backend: one variant)
    shape = graphs.warmup_shape
    assert shape((("suffix", 4, 64), variant)) == shape((("suffix", 16, 128), variant)) != \
        shape((("suffix", 4, 16), variant))


def test_widths_of_one_compile_class_share_their_warmup(shadow_pair):
    """A sparse width whose compile class startup compiled (at the class's widest) is captured
    without a warmup: the chat's first question over a 17K document waited 0.48 s for its graph."""
    from sglang_shadowkv.kernels.chunk_selection import compile_class

    graphs = shadow_pair[1].scheduler.runner.graphs
    widths = graph_widths(graphs.backend.decoder.max_chunks)
    compiled = {graphs.warmup_shape((1, v)) for v in graphs.backend.compile_graph_variants()}
    compiled |= {graphs.warmup_shape((("suffix", 1, 256), v)) for v in graphs.backend.compile_suffix_variants()}
    for w in widths:  # every width and kind falls on a shape startup compiled
        assert graphs.warmup_shape((8, w)) in compiled and graphs.warmup_shape((8, ("long_window", w))) in compiled
        assert graphs.warmup_shape((("suffix", 2, 128), ("suffix", w))) in compiled
    a, b = widths[0], widths[-1]
    assert (graphs.warmup_shape((1, a)) == graphs.warmup_shape((1, b))) == (compile_class(a) == compile_class(b))
    assert graphs.warmup_shape((1, a)) != graphs.warmup_shape((1, ("long_window", a)))


def test_the_torch_backend_is_never_captured(dense_pair):
    """The torch reference reads the batch's metadata on the host, which a CUDA graph capture
    refuses: on a GPU its decode steps run eagerly (no graphs) instead of failing at startup."""
    runner = dense_pair[0].scheduler.runner
    assert runner.backend_name == "torch" and not runner.backend.capturable
    before = runner.graphs
    runner.init_graphs(4, capture=True)
    assert runner.graphs is before


@pytest.fixture(scope="module")
def dense_pair():
    yield from plain_and_graphed(dict(max_total_tokens=8192, chunked_prefill_size=256, max_running_requests=8))


def test_full_attention_graph_steps_give_the_eager_tokens(dense_pair):
    plain, graphed = dense_pair
    prompts = [plain.tokenizer.encode(p, add_special_tokens=False) for p in SHORT]
    max_new = [9, 4, 12, 7, 10]
    want = run_staggered(plain, prompts, max_new)
    graphs = graphed.scheduler.runner.graphs
    replays, eager = graphs.replays, graphed.scheduler.runner.eager_steps
    got = run_staggered(graphed, prompts, max_new)
    assert got == want
    assert graphs.replays - replays > 10  # the decode steps went through the fixed buffers
    # batches of 3 are padded to 4; 5 running requests exceed the largest size and run eagerly
    assert graphed.scheduler.runner.eager_steps > eager
    assert_pool_clean(graphed)


def test_shadowkv_batches_without_a_compressed_prefix_replay_the_dense_graphs(dense_pair):
    """With the tier policy short prompts stay dense: their decode steps replay the dense
    backend's own graphs (full attention's step) and give full attention's tokens."""
    from sglang_shadowkv import Engine

    plain, _ = dense_pair
    prompts = [plain.tokenizer.encode(p, add_special_tokens=False) for p in SHORT]
    max_new = [9, 4, 12, 7, 10]
    want = run_staggered(plain, prompts, max_new)
    with Engine(attention="shadowkv", max_total_tokens=8192, chunked_prefill_size=256, max_running_requests=8,
                check_integrity=True) as tier:
        graphs = with_static_decode(tier, 4)
        assert run_staggered(tier, prompts, max_new) == want
        assert graphs.replays > 10 and set(graphs.replays_by_variant) == {"('dense', None)"}
        assert_pool_clean(tier)


def test_padding_entries_touch_only_the_reserved_page(dense_pair):
    plain, graphed = dense_pair
    graphs, table = graphed.scheduler.runner.graphs, graphed.scheduler.runner.req_to_token
    prompts = [graphed.tokenizer.encode(p, add_special_tokens=False) for p in SHORT[:3]]
    params = {"max_new_tokens": 4, "temperature": 0}
    want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    replays = graphs.replays
    got = [o["output_ids"] for o in graphed.generate(input_ids=prompts, sampling_params=params)]
    assert got == want and graphs.replays > replays
    # the batch of 3 ran as 4: the padding entry read the padding row and wrote only slot 0
    assert int(graphs.out_cache_loc[3]) == 0 and int(graphs.positions[3]) == 0
    assert not table.table[table.padding_row].any()
    assert_pool_clean(graphed)


@pytest.fixture(scope="module")
def shadow_pair():
    yield from plain_and_graphed(dict(SHADOW_ENGINE, shadowkv_sparse_prefill_max=2048))  # suffixes select


def test_startup_runs_each_selection_compile_class_once_plain_with_a_long_window_and_as_suffixes(shadow_pair,
                                                                                                 monkeypatch):
    """On a GPU the runner runs these variants eagerly at startup so no request waits for a Triton
    compile; here each stand-in step is built and planned over the same buffers, and the first
    decode and the first suffix step run (every one of them took ~3 minutes on a CPU)."""
    from sglang_shadowkv.kernels.chunk_selection import compile_class

    graphs = shadow_pair[1].scheduler.runner.graphs
    variants = graphs.backend.compile_graph_variants()
    widths = [v for v in variants if not isinstance(v, tuple)]
    all_widths = graph_widths(graphs.backend.decoder.max_chunks)
    assert {compile_class(w) for w in widths} == {compile_class(w) for w in all_widths}
    assert len(widths) == len({compile_class(w) for w in widths}) and max(widths) == max(all_widths)
    assert [v for v in variants if isinstance(v, tuple)] == [("long_window", w) for w in widths]
    suffix_variants = graphs.backend.compile_suffix_variants()
    # suffixes select per KV head: compiled apart; an exact step's kernels are one set at every width,
    # gathering exact copies or rebuilding
    assert suffix_variants == [("suffix", w) for w in widths] + [("exact_suffix", all_widths[0], 1, from_copies)
                                                                 for from_copies in (True, False)]
    ran, forward = [], graphs._forward
    def record(batch, key):
        first_of_its_kind = not any(isinstance(k[0], tuple) == isinstance(key[0], tuple) for k in ran)
        ran.append(key)
        if first_of_its_kind:
            forward(batch, key)

    monkeypatch.setattr(graphs, "_forward", record)
    monkeypatch.setattr(graphs, "_warmed", set())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    graphs._compile(graphs._compile_keys())
    graphs._compile(graphs._compile_keys())  # already compiled: nothing runs again
    assert ran == ([(bs, v) for v in variants for bs in (1, 4)]  # the smallest and the largest batch
                   + [(("suffix", n, t), v) for v in suffix_variants for t in (16, 256) for n in (1, 16)])


def test_shadowkv_mixed_batches_give_the_eager_tokens(shadow_pair):
    plain, graphed = shadow_pair
    tok = plain.tokenizer
    prompts = [long_prompt(tok, 900, 21), tok.encode(SHORT[0], add_special_tokens=False),
               long_prompt(tok, 700, 22), tok.encode(SHORT[2], add_special_tokens=False)]
    max_new = [10, 6, 8, 12]
    want = run_staggered(plain, prompts, max_new, join_every=2)
    decoder = graphed.scheduler.runner.decoder
    replays = graphed.scheduler.runner.graphs.replays
    got = run_staggered(graphed, prompts, max_new, join_every=2)
    assert got == want
    assert graphed.scheduler.runner.graphs.replays - replays > 5
    plan = decoder.graph_plan  # written in place: the last graph step's padded rows use the dummy scratch
    assert decoder.dummy_row in plan.rows.tolist()
    for eng in (plain, graphed):
        assert_pool_clean(eng)
        assert_shadow_pools_clean(eng)


def test_a_sparse_variant_is_captured_at_the_largest_batch_then_per_bucket_once_padding_cost_a_capture(
        shadow_pair, monkeypatch):
    """Sparse graph variants are captured on first use at the largest batch size, which smaller
    batches replay padded (the padding rows cost the sparse kernels little: kernels/padding_rows.py,
    and must not change a token); a bucket gets its own graph once its batches have run
    PAD_ROWS_BEFORE_CAPTURE padding rows more than it would have."""
    from sglang_shadowkv.model_executor import cuda_graph_runner

    plain, graphed = shadow_pair
    tok = plain.tokenizer
    prompts = [long_prompt(tok, 800, 31), long_prompt(tok, 750, 32), long_prompt(tok, 820, 33)]
    max_new = [9, 5, 7]
    want = run_staggered(plain, prompts, max_new, join_every=2)
    graphs = graphed.scheduler.runner.graphs

    def sparse_sizes():
        return {size for size, variant in graphs.graphs if not isinstance(variant, tuple) or variant[0] != "dense"}

    replays = graphs.replays
    assert run_staggered(graphed, prompts, max_new, join_every=2) == want
    assert graphs.replays - replays > 5 and sparse_sizes() == {graphs.max_bs}  # 4: batches of 1-3 padded to it
    assert sum(graphs._extra_padding.values()) > 4
    monkeypatch.setattr(cuda_graph_runner, "PAD_ROWS_BEFORE_CAPTURE", 4)
    assert run_staggered(graphed, prompts, max_new, join_every=2) == want
    assert sparse_sizes() > {graphs.max_bs}  # a bucket that ran more than 4 padding rows got its own graph
    for eng in (plain, graphed):
        assert_pool_clean(eng)
        assert_shadow_pools_clean(eng)


def test_a_long_dense_window_beside_compressed_requests_replays_its_split_graph(shadow_pair, monkeypatch):
    """A dense request with a long window (a dense document) decoding beside compressed ones makes
    the step split every program's keys (decode.window_splits): its own graph variant, the same
    tokens as the eager step."""
    from sglang_shadowkv.shadowkv import decode

    monkeypatch.setattr(decode, "LONG_WINDOW_TOKENS", 40)  # the short prompts' windows count as long here
    plain, graphed = shadow_pair
    tok = plain.tokenizer
    prompts = [long_prompt(tok, 900, 23), long_prompt(tok, 60, 24)]
    want = run_staggered(plain, prompts, [8, 8], join_every=1)
    graphs = graphed.scheduler.runner.graphs
    before = graphs.replays_by_variant.copy()
    assert run_staggered(graphed, prompts, [8, 8], join_every=1) == want
    long_steps = sum(n - before[v] for v, n in graphs.replays_by_variant.items() if v.startswith("('long_window'"))
    assert long_steps >= 3
    for eng in (plain, graphed):
        assert_pool_clean(eng)


def test_suffixes_over_a_compressed_prefix_replay_a_graph_and_give_the_eager_tokens(shadow_pair, monkeypatch):
    """Questions on a cached compressed document with nothing else running are a step of prompt
    chunks only, padded to a captured shape (one tile, three tiles padded to 192 queries, three
    questions at once padded to four): the fixed buffers' step must answer as the eager suffix
    prefill does, and the padding must touch only the reserved page. Three at once first replay
    the one-question graph once each (no capture for a new request count) until those extra
    replays pass EXTRA_SUFFIX_REPLAYS_BEFORE_CAPTURE; then the four-request graph, once."""
    from sglang_shadowkv.model_executor import cuda_graph_runner

    plain, graphed = shadow_pair
    doc, questions = document_and_questions(plain.tokenizer, 1200, 41)
    questions = questions[:2] + [long_prompt(plain.tokenizer, 150, 42)]
    for eng in (plain, graphed):
        eng.flush_cache()
    want = greedy_answers(plain.scheduler, doc, questions, 6)
    graphs = graphed.scheduler.runner.graphs
    before = graphs.replays_by_variant.copy()
    got = greedy_answers(graphed.scheduler, doc, questions, 6)
    assert got == want
    suffix_steps = {v: n - before[v] for v, n in graphs.replays_by_variant.items() if v.startswith("('suffix'")}
    assert sum(suffix_steps.values()) == len(questions)  # each question's prompt step, none eager
    table = graphed.scheduler.runner.req_to_token
    assert not table.table[table.padding_row].any() and int(graphs.out_cache_loc[191]) == 0
    # the three at once: one step of three suffixes of up to 192 rows (in the second round, the cached
    # prompts' last tokens: one 16-query block), as if no step had run four at once before
    sched = graphed.scheduler
    for key in [key for key in graphs.graphs if isinstance(key[0], tuple) and key[0][:2] == ("suffix", 4)]:
        del graphs.graphs[key]
    graphs._extra_suffix_replays.clear()
    assert any(key[0] == ("suffix", 1, 192) for key in graphs.graphs)  # the long question alone ran it
    for threshold, replays in ((cuda_graph_runner.EXTRA_SUFFIX_REPLAYS_BEFORE_CAPTURE, 3), (0, 1)):
        monkeypatch.setattr(cuda_graph_runner, "EXTRA_SUFFIX_REPLAYS_BEFORE_CAPTURE", threshold)
        reqs = [sched.add_request(f"t{i}", doc + q, SamplingParams(max_new_tokens=6, temperature=0))
                for i, q in enumerate(questions)]
        before = graphs.replays_by_variant.copy()
        sched.step()
        assert all(r.prompt_done for r in reqs)
        assert sum(graphs.replays_by_variant.values()) == sum(before.values()) + replays
        assert any(key[0][:2] == ("suffix", 4) for key in graphs.graphs if isinstance(key[0], tuple)) == (replays == 1)
        while sched.has_work:
            sched.step()
        assert [r.output_ids for r in reqs] == want
    for eng in (plain, graphed):
        assert_pool_clean(eng)
        assert_shadow_pools_clean(eng)


def test_a_turn_longer_than_a_suffix_graph_replays_it_in_whole_tile_chunks_with_the_same_answer(shadow_pair,
                                                                                               monkeypatch):
    """A chat's next turn over a compressed document (300 new tokens: more than the longest suffix
    graph) is prefilled in chunks of at most SUFFIX_CHUNK_TOKENS, each replaying a suffix graph,
    and answers as one eager step over the whole turn does (the chunks are whole tiles, so every
    tile selects its chunks from the same queries)."""
    from sglang_shadowkv.scheduler import prefill

    plain, graphed = shadow_pair
    doc, questions = document_and_questions(plain.tokenizer, 1200, 44)
    turn = long_prompt(plain.tokenizer, 300, 45)
    assert len(turn) > prefill.SUFFIX_CHUNK_TOKENS

    def answers(eng):
        eng.flush_cache()
        return greedy_answers(eng.scheduler, doc, [questions[0], turn], 6)

    want = answers(plain)
    graphs = graphed.scheduler.runner.graphs
    before = graphs.replays_by_variant.copy()
    got = answers(graphed)
    suffix_steps = sum(n - before.get(v, 0) for v, n in graphs.replays_by_variant.items() if v.startswith("('suffix'"))
    assert got == want
    assert suffix_steps == 3  # the question's, then the turn's 256 + 44 tokens: every one from a graph
    monkeypatch.setattr(prefill, "SUFFIX_CHUNK_TOKENS", 1 << 20)  # the whole turn in one eager step
    assert answers(plain) == want
    for eng in (plain, graphed):
        assert_pool_clean(eng)
        assert_shadow_pools_clean(eng)


@pytest.fixture(scope="module")
def exact_pair():
    """Engines at the default shadowkv_sparse_prefill_max 0: every suffix attends every chunk."""
    yield from plain_and_graphed(SHADOW_ENGINE)


def test_exact_suffixes_replay_a_graph_per_documents_and_give_the_eager_tokens(exact_pair, monkeypatch):
    """Questions that attend every compressed chunk (shadowkv_sparse_prefill_max 0, the default) over a
    workspace (their documents' copies not loaded dense) replay an exact suffix graph: one question,
    three on one document at once (its chunks rebuilt once: one document in the workspace), and
    questions on two documents at once (two); each answers as the eager step does, and the padding
    touches only the reserved page. Documents that do not fit the workspace in one piece run
    eagerly, with the same answers."""
    from sglang_shadowkv.model_executor import cuda_graph_runner
    from sglang_shadowkv.shadowkv import suffix_prefill

    plain, graphed = exact_pair
    for eng in exact_pair:  # questions on documents whose copies are not loaded dense (the pool short of pages)
        monkeypatch.setattr(eng.scheduler.cache.compressed, "copies_loaded_dense", False)
    graphs = graphed.scheduler.runner.graphs
    narrowest = graph_widths(graphs.backend.decoder.max_chunks)[0]
    assert graphs.backend.compile_suffix_variants() == [("exact_suffix", narrowest, 1, from_copies)  # no selection
                                                        for from_copies in (True, False)]
    doc, questions = document_and_questions(plain.tokenizer, 1200, 47)
    other, _ = document_and_questions(plain.tokenizer, 900, 48)
    want = greedy_answers(plain.scheduler, doc, questions[:2], 6)

    def exact_steps(before):
        return {v: n - before.get(v, 0) for v, n in graphs.replays_by_variant.items()
                if v.startswith("('exact_suffix'") and n > before.get(v, 0)}

    before = graphs.replays_by_variant.copy()
    assert greedy_answers(graphed.scheduler, doc, questions[:2], 6) == want
    assert sum(exact_steps(before).values()) == 2 and all(v.endswith(", 1, True)") for v in exact_steps(before))
    table = graphed.scheduler.runner.req_to_token
    assert not table.table[table.padding_row].any()

    def together(eng, prompts):
        sched = eng.scheduler
        reqs = [sched.add_request(f"t{i}", p, SamplingParams(max_new_tokens=6, temperature=0))
                for i, p in enumerate(prompts)]
        sched.step()
        assert all(r.prompt_done for r in reqs)  # one step of suffixes
        while sched.has_work:
            sched.step()
        return [r.output_ids for r in reqs]

    for eng in (plain, graphed):  # the second document compressed too
        greedy_answers(eng.scheduler, other, questions[:1], 1)
    monkeypatch.setattr(cuda_graph_runner, "EXTRA_SUFFIX_REPLAYS_BEFORE_CAPTURE", 0)  # one replay of 3 (padded to 4)
    same_doc = [doc + q for q in questions[:3]]
    two_docs = [doc + questions[0], other + questions[1], doc + questions[2]]
    for prompts, documents in ((same_doc, 1), (two_docs, 2)):
        want = together(plain, prompts)
        before = graphs.replays_by_variant.copy()
        assert together(graphed, prompts) == want
        steps = exact_steps(before)
        assert sum(steps.values()) == 1 and next(iter(steps)).endswith(f", {documents}, True)")
    monkeypatch.setattr(suffix_prefill, "WORKSPACE_BYTES", 1 << 10)  # no document fits in one piece
    before = graphs.replays_by_variant.copy()
    eager = graphed.scheduler.runner.eager_steps
    assert together(graphed, two_docs) == want
    assert not exact_steps(before) and graphed.scheduler.runner.eager_steps > eager
    for eng in (plain, graphed):
        assert_pool_clean(eng)
        assert_shadow_pools_clean(eng)


def test_a_step_mixing_prompts_with_compressed_decodes_runs_in_parts(shadow_pair):
    """Decodes over a compressed document, a question over it and a dense prompt in one step: the
    decodes and the question replay their graphs and only the dense prompt runs eagerly (three
    launches), with the eager step's tokens."""
    plain, graphed = shadow_pair
    tok = plain.tokenizer
    doc, questions = document_and_questions(tok, 1200, 43)
    dense = tok.encode(SHORT[1], add_special_tokens=False)

    def run(eng):
        sched = eng.scheduler
        eng.flush_cache()
        greedy_answers(sched, doc, questions[:1], 2)  # the document, compressed and cached
        first = sched.add_request("a", doc + questions[1], SamplingParams(max_new_tokens=8, temperature=0))
        while not first.prompt_done:
            sched.step()
        rest = [sched.add_request("b", doc + questions[2], SamplingParams(max_new_tokens=6, temperature=0)),
                sched.add_request("c", dense, SamplingParams(max_new_tokens=6, temperature=0))]
        parts_steps = 0
        while sched.has_work:
            graphs, eager = sched.runner.graphs, sched.runner.eager_steps
            replays = None if graphs is None else graphs.replays
            sched.step()
            if graphs is not None and graphs.replays - replays >= 2 and sched.runner.eager_steps > eager:
                parts_steps += 1
        return [r.output_ids for r in [first, *rest]], parts_steps

    want, _ = run(plain)
    got, parts_steps = run(graphed)
    assert got == want
    assert parts_steps >= 1  # the step that took b's question and c's prompt beside a's decode
    for eng in (plain, graphed):
        assert_pool_clean(eng)
        assert_shadow_pools_clean(eng)


def test_overlap_finds_stops_one_step_late_and_drops_the_extra_token(engine):
    """A stop string ends the request; the step launched before it was seen must not add a token."""
    ids = engine.tokenizer.encode("Count: 1, 2, 3, 4, 5,", add_special_tokens=False)
    sched = engine.scheduler
    assert sched.overlap
    free = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 12, "temperature": 0})
    text = free["text"]
    stop = text.strip().split()[2]  # a word a few tokens in
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                          "stop": [stop]})
    assert out["meta_info"]["finish_reason"]["matched"] == stop
    assert out["output_ids"] == free["output_ids"][:len(out["output_ids"])]
    assert out["meta_info"]["completion_tokens"] < 12
    assert not sched.has_work
    assert_pool_clean(engine)


def test_penalties_make_the_scheduler_wait_for_the_last_token(engine):
    """A penalised request's sampling reads its output so far, so each step waits for the last."""
    ids = engine.tokenizer.encode("Repeat after me: apple apple apple", add_special_tokens=False)
    params = {"max_new_tokens": 10, "temperature": 0, "frequency_penalty": 1.5}
    sched = engine.scheduler
    sched.overlap = False
    try:
        want = engine.generate(input_ids=ids, sampling_params=params)["output_ids"]
    finally:
        sched.overlap = True
    assert engine.generate(input_ids=ids, sampling_params=params)["output_ids"] == want

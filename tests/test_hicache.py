"""The host tier of dense KV (--enable-hierarchical-cache): pages evicted from the GPU pool move to
host memory and come back on a hit, exactly, without a prefill; its accounting holds under any
sequence of requests, aborts, evictions and flushes."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from sglang_shadowkv import Engine
from sglang_shadowkv.diagnostics.metrics import ServerMetrics
from sglang_shadowkv.kernels.copy_pages import copy_pages, copy_pages_reference
from sglang_shadowkv.mem_cache.host_kv_pool import CopyFences
from cache_ops import OPS, run_ops
from test_metrics import samples

GREEDY = {"max_new_tokens": 4, "temperature": 0}
QUESTION = [5, 6, 7, 8]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the same tests run on the lent GPU
SMALL = dict(max_total_tokens=1024, chunked_prefill_size=512, check_integrity=True, enable_hierarchical_cache=True)


def document(i: int, tokens: int = 300) -> list[int]:
    return [(7 * t + 13 * i) % 500 + 2 for t in range(tokens)]


@pytest.mark.parametrize("pages,src_n,dst_n,numel", [(5, 9, 7, 24), (40, 50, 60, 1100)])
def test_copy_pages_matches_its_reference(pages, src_n, dst_n, numel):
    g = torch.Generator().manual_seed(pages)
    src = torch.randn(src_n, numel, generator=g).to(DEVICE)
    src_pages = torch.randperm(src_n, generator=g)[:pages].to(DEVICE)
    dst_pages = torch.randperm(dst_n, generator=g)[:pages].to(DEVICE)
    want = copy_pages_reference(src, src_pages, torch.zeros(dst_n, numel, device=DEVICE), dst_pages)
    got = copy_pages(src, src_pages, torch.zeros(dst_n, numel, device=DEVICE), dst_pages)
    assert torch.equal(got, want) and torch.equal(got[dst_pages], src[src_pages])
    with pytest.raises(ValueError, match="source pages"):
        copy_pages(src, src_pages, torch.zeros(dst_n, numel, device=DEVICE), dst_pages[:-1])


class _Copy:
    """An event of a queued copy (CopyFences only asks whether it is done)."""
    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


def test_copy_fences_name_the_unfinished_copies_of_a_page_once_each():
    """A copy waits only for what touched its pages last and is still running: a store's read of
    pages a load wrote, a load's read of a host page a store still writes."""
    fences, store, load, later = CopyFences(), _Copy(), _Copy(), _Copy()
    fences.mark([1, 2, 3], store)
    fences.mark([3, 4], load)  # page 3's last copy is now the load
    assert fences.pending([1, 2]) == [store]  # one entry for the copy, not one per page
    assert set(map(id, fences.pending([2, 3, 9]))) == {id(store), id(load)}
    store.done = True
    assert fences.pending([1, 2, 3]) == [load] and fences.pending([1, 2, 9]) == []
    fences.mark([4], later)
    load.done = True
    assert fences.pending([3, 4]) == [later]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_documents_evicted_to_the_host_come_back_exact_without_a_prefill(tiny_model_path, policy):
    """Six documents where the GPU pool holds about three: the second round finds each in the
    host tier (loaded, not prefilled: only the questions are) and answers as the first did."""
    with Engine(model_path=tiny_model_path, hicache_write_policy=policy, **SMALL) as engine:
        cold = [engine.generate(input_ids=document(d) + QUESTION, sampling_params=GREEDY)["output_ids"]
                for d in range(6)]
        before = engine.get_server_info()["stats"]
        hits = engine.generate(input_ids=[document(d) + QUESTION for d in range(6)][::-1], sampling_params=GREEDY)
        info = engine.get_server_info()
        stats = info["stats"]
        assert [h["output_ids"] for h in hits][::-1] == cold
        assert all(h["meta_info"]["cached_tokens"] == 296 for h in hits)  # whole pages
        assert stats["prefill_tokens"] - before["prefill_tokens"] == 6 * (300 - 296 + len(QUESTION))
        assert stats["host_hit_tokens"] - before["host_hit_tokens"] >= 3 * 296  # the ones the GPU had let go
        assert stats["reprefilled_tokens"] == 0 and stats["host_loaded_bytes"] > 0
        mem = info["memory"]
        assert mem["host_total_pages"] == 2 * mem["total_pages"]  # --hicache-ratio 2
        if policy == "write_through":  # every page the tree holds has its copy: evictions move nothing
            assert mem["host_backup_pages"] == mem["tree_pages"]
        got = samples(ServerMetrics("tiny").render(info).decode())
        assert got["sglang_shadowkv:host_hit_tokens_total"] == stats["host_hit_tokens"]
        assert got["sglang_shadowkv:host_used_pages"] == mem["host_total_pages"] - mem["host_free_pages"] > 0
        assert engine.flush_cache()
        mem = engine.get_server_info()["memory"]
        assert mem["host_free_pages"] == mem["host_total_pages"] and mem["tree_pages"] == 0


def test_a_request_with_nothing_on_the_host_loads_nothing(tiny_model_path, monkeypatch):
    """Admissions whose match holds no host page issue no load: an empty one still launched a copy
    per layer and side, and counted its milliseconds as the link's."""
    with Engine(model_path=tiny_model_path, **SMALL) as engine:
        host = engine.scheduler.cache.host
        loads = []
        monkeypatch.setattr(host, "load", lambda entries, pages: loads.append(len(entries)))
        for _ in range(2):  # cold, then a dense hit on the GPU
            engine.generate(input_ids=document(0) + QUESTION, sampling_params=GREEDY)
        assert loads == [] and engine.get_server_info()["stats"]["host_load_ms"] == 0


def test_a_full_host_tier_drops_its_least_recently_used_documents(tiny_model_path):
    with Engine(model_path=tiny_model_path, hicache_size=0, hicache_ratio=0.4, **SMALL) as engine:
        for d in range(6):
            engine.generate(input_ids=document(d) + QUESTION, sampling_params=GREEDY)
        stats = engine.get_server_info()["stats"]
        assert stats["host_evicted_tokens"] > 0
        first = engine.generate(input_ids=document(0) + QUESTION, sampling_params=GREEDY)  # dropped long ago
        assert first["meta_info"]["cached_tokens"] == 0
        assert engine.get_server_info()["stats"]["reprefilled_tokens"] >= 296


def test_backups_of_documents_still_on_the_gpu_give_way_before_documents_held_only_on_the_host(
        tiny_model_path):
    """Five documents where the GPU pool and the host tier each hold about three: write_through
    backs up each document the tree takes, and making room for a document leaving the GPU drops
    backups (their pages are still on the GPU) before any document held only on the host. So all
    five stay cached and the second round prefills nothing again; with the backups kept first,
    616 tokens were pushed out and prefilled again."""
    with Engine(model_path=tiny_model_path, hicache_ratio=1.0, **SMALL) as engine:
        docs = [document(d) + QUESTION for d in range(5)]
        cold = [engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] for ids in docs]
        hits = [engine.generate(input_ids=ids, sampling_params=GREEDY) for ids in docs]
        info = engine.get_server_info()
        assert [h["output_ids"] for h in hits] == cold
        assert all(h["meta_info"]["cached_tokens"] == 296 for h in hits)
        assert info["stats"]["host_evicted_tokens"] == 0 and info["stats"]["reprefilled_tokens"] == 0
        mem = info["memory"]
        assert 0 < mem["host_backup_pages"] < mem["tree_pages"]  # some backups did give way


def test_shadowkv_mode_takes_the_host_tier_too(tiny_model_path):
    with Engine(model_path=tiny_model_path, attention="shadowkv", shadowkv_min_context=512,
                shadowkv_host_tokens=8192, **{**SMALL, "max_total_tokens": 2048}) as engine:
        docs = [document(d, 700) + QUESTION for d in range(5)]
        cold = [engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] for ids in docs]
        hits = [engine.generate(input_ids=ids, sampling_params=GREEDY) for ids in docs]
        assert [h["output_ids"] for h in hits] == cold
        assert engine.get_server_info()["stats"]["host_hit_tokens"] > 0


# ShadowKV with every document compressed at its prefill and the host tier on (test_tiering's small
# compressed form, spans to their last whole chunk)
PARKING = dict(attention="shadowkv", shadowkv_min_context=256, shadowkv_local_window=16, shadowkv_span_grid=8,
               shadowkv_rank_cap=8, shadowkv_outliers=2, shadowkv_max_budget=32, shadowkv_min_budget_chunks=8,
               chunked_prefill_size=256, shadowkv_host_tokens=8192, shadowkv_compress_policy="eager",
               check_integrity=True, enable_hierarchical_cache=True)


def test_compressed_documents_parked_in_the_host_tier_come_back_as_they_were(tiny_model_path):
    """Six compressed documents where the GPU holds about two: the others' compressed state is
    parked in the host tier, not dropped, and a question on each later finds its document whole
    (only the question is prefilled) and answers as it does where nothing was parked."""
    docs = [document(d, 700) for d in range(6)]
    answers, stats = {}, {}
    for total in (8192, 1536):  # room for all six; room for about two
        with Engine(model_path=tiny_model_path, max_total_tokens=total, **PARKING) as engine:
            for doc in docs:
                engine.generate(input_ids=doc + QUESTION, sampling_params=GREEDY)
            if total == 1536:
                integrity_check_sees_parked_state(engine.scheduler)
            before = engine.get_server_info()
            hits = [engine.generate(input_ids=doc + [9, 10, 11], sampling_params=GREEDY) for doc in docs]
            after = engine.get_server_info()
            answers[total] = [h["output_ids"] for h in hits]
            stats[total] = dict(parked_before=before["shadowkv"]["parked_tokens"],
                                parked_pages=before["shadowkv"]["pools"]["parked_segment_pages"],
                                unparked=after["shadowkv"]["unparked_tokens"] - before["shadowkv"]["unparked_tokens"],
                                prefilled=after["stats"]["prefill_tokens"] - before["stats"]["prefill_tokens"],
                                cached=[h["meta_info"]["cached_tokens"] for h in hits])
    assert stats[8192]["parked_before"] == stats[8192]["parked_pages"] == 0 < stats[1536]["parked_pages"]
    assert stats[1536]["parked_before"] >= 3 * 688 and stats[1536]["unparked"] >= 3 * 688
    assert stats[1536]["prefilled"] == stats[8192]["prefilled"] == 6 * 7  # whole pages cached, then the question
    assert stats[1536]["cached"] == stats[8192]["cached"]
    assert answers[1536] == answers[8192]


@pytest.mark.parametrize("host_tier,value_tokens", [(False, 2048), (True, 3072)])
def test_a_full_compressed_value_pool_drops_cached_documents_rather_than_turning_requests_away(
        tiny_model_path, host_tier, value_tokens):
    """Host values for about two (three) compressed documents: each new one frees slots by dropping
    the least recently used cached ones (parked ones first) instead of aborting with "the ShadowKV
    pools are full"."""
    cfg = {**PARKING, "shadowkv_host_tokens": value_tokens, "enable_hierarchical_cache": host_tier}
    with Engine(model_path=tiny_model_path, max_total_tokens=1536, **cfg) as engine:
        outs = [engine.generate(input_ids=document(d, 700) + QUESTION, sampling_params=GREEDY) for d in range(6)]
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * 6
        assert engine.get_server_info()["shadowkv"]["compressions"] == 6


def integrity_check_sees_parked_state(sched) -> None:
    """The idle-time check is not vacuous about parked segments: a host page of one handed back
    to the free list, or a tree entry that calls it on the GPU, both raise."""
    from sglang_shadowkv.mem_cache.compressed_pool import ChunkRef, ParkedChunkRef

    cache = sched.cache
    seg = next(s for s in cache.compressed.store.live.values() if s.parked)
    sched.run_when_idle()  # whole: passes
    cache.host.free(seg.host_pages[:1])
    with pytest.raises(RuntimeError, match="host page"):
        sched.run_when_idle()
    assert cache.host.alloc(1) == seg.host_pages[:1]  # taken back (a LIFO free list)
    node = next(n for n in cache.tree.nodes() if any(type(e) is ParkedChunkRef for e in n.pages))
    parked = node.pages
    node.pages = [ChunkRef(e.segment, e.index) if type(e) is ParkedChunkRef else e for e in parked]
    with pytest.raises(RuntimeError, match="referred to by a ChunkRef"):
        sched.run_when_idle()
    node.pages = parked
    sched.run_when_idle()


@pytest.fixture(scope="module")
def tight_shadowkv(tiny_model_path):
    """About two compressed documents on the GPU and a host tier too small for the rest: parking
    drops the host tier's least recently used ones."""
    with Engine(model_path=tiny_model_path, max_total_tokens=1536, hicache_ratio=0.4, **PARKING) as engine:
        yield engine


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(OPS)
def test_accounting_holds_while_compressed_documents_are_parked_and_come_back(tight_shadowkv, ops):
    """The property test below with compressed documents: parked when the GPU runs short, brought
    back by requests, dropped from the host tier, aborted mid-prefill or mid-decode, flushed."""
    run_ops(tight_shadowkv.scheduler, ops, lambda op, doc, count: document(doc, 700) + QUESTION[:count % 4 + 1]
            if op == "doc" else QUESTION * count)


@pytest.fixture(scope="module")
def tight(tiny_model_path):
    """About two documents on the GPU and three more on the host."""
    with Engine(model_path=tiny_model_path, hicache_ratio=1.0, **{**SMALL, "max_total_tokens": 700}) as engine:
        yield engine


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(OPS)
def test_host_accounting_holds_after_any_sequence(tight, ops):
    """Requests on six documents (offloaded, loaded back, dropped from the host), partial steps,
    aborts mid-prefill or mid-decode, flushes and evictions: after each, every GPU page, host page
    and row is free or owned exactly once."""
    run_ops(tight.scheduler, ops, lambda op, doc, count: document(doc) + QUESTION[:count % 4 + 1] if op == "doc"
            else QUESTION * count)


@pytest.mark.parametrize("flags,message", [
    (dict(hicache_ratio=0), "hicache_ratio must be positive"),
    (dict(hicache_size=-1), "hicache_size must be a whole number of GB"),
    (dict(hicache_write_policy="sometimes"), "hicache_write_policy must be one of"),
])
def test_bad_host_tier_flags_are_refused_naming_them(flags, message):
    from sglang_shadowkv.server_args import ServerArgs

    with pytest.raises(ValueError, match=message):
        ServerArgs(enable_hierarchical_cache=True, **flags)


def test_help_lists_every_flag_with_its_default(capsys):
    """--help formats each flag's help with argparse's %-formatting: a '%' in a help text (the host
    tier's "90% of", since reworded) once made it a TypeError instead of help."""
    from sglang_shadowkv.entrypoints.launcher import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "--enable-hierarchical-cache" in text and "available less 10 GiB" in text.replace("\n", " ").replace("  ", " ")
    assert "--shadowkv-compress-policy" in text and "(default: tier)" in text


def test_host_tier_leaves_a_reserve_and_shares_the_host_between_ranks(monkeypatch):
    """The host tier takes what is available less 10 GiB, split among the ranks of the host (each
    rank sizes its tier at the same moment, from the same MemAvailable); nothing when less is left."""
    from sglang_shadowkv.mem_cache import memory_plan

    monkeypatch.setattr(memory_plan, "available_host_bytes", lambda: 50 << 30)
    assert memory_plan.host_tier_bytes(1) == 40 << 30
    assert memory_plan.host_tier_bytes(2) == 20 << 30
    monkeypatch.setattr(memory_plan, "available_host_bytes", lambda: 6 << 30)
    assert memory_plan.host_tier_bytes(1) == 0


def test_a_host_without_memory_for_the_tier_is_a_clear_error(monkeypatch):
    """With less host memory available than the reserve, the tier's sizing names the flag and the
    memory instead of failing inside the host pool."""
    from types import SimpleNamespace

    from sglang_shadowkv.model_executor import model_runner
    from sglang_shadowkv.server_args import ServerArgs

    monkeypatch.setattr(model_runner, "available_host_bytes", lambda: 4 << 30)
    monkeypatch.setattr(model_runner, "host_tier_bytes", lambda ranks: 0)
    runner = SimpleNamespace(pool=SimpleNamespace(bytes_per_token=1024, page_size=8, capacity=4096),
                             tp=SimpleNamespace(size=1, min_over_ranks=lambda *n: list(n)))
    with pytest.raises(ValueError, match=r"--enable-hierarchical-cache: the host has no memory.*4\.0 GiB available"):
        model_runner.ModelRunner._build_host_tier(runner, ServerArgs(enable_hierarchical_cache=True))

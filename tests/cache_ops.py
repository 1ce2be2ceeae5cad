"""A random sequence of scheduler operations for the cache's property tests (test_tiering.py,
test_hicache.py): requests on a few documents, partial steps, aborts, flushes and evictions, the
pool accounting checked after each and at the end."""

from hypothesis import strategies as st

from sglang_shadowkv.sampling_params import SamplingParams

OPS = st.lists(st.tuples(st.sampled_from(["doc", "doc", "doc", "short", "step", "step", "abort", "flush", "evict"]),
                         st.integers(0, 5), st.integers(1, 8)), min_size=4, max_size=30)


def run_ops(sched, ops, prompt) -> None:
    """prompt(op, doc, count): the token ids of a "doc" or "short" request."""
    for n, (op, doc, count) in enumerate(ops):
        if op in ("doc", "short"):
            sched.add_request(f"p{n}", prompt(op, doc, count), SamplingParams(max_new_tokens=count, ignore_eos=True))
        elif op == "step":
            for _ in range(count):
                sched.step()
        elif op == "abort" and sched.running:
            sched.abort(sched.running[count % len(sched.running)].rid)
        elif op == "flush":
            sched.flush_cache()
        elif op == "evict" and not sched.running:
            sched.cache.make_room(sched.pool.capacity)
        sched.cache.check_integrity(sched.running)
    while sched.has_work:
        sched.step()
        sched.cache.check_integrity(sched.running)
    sched.run_when_idle()
    sched.cache.check_integrity(sched.running)
    assert sched.flush_cache()
    sched.cache.check_integrity([])

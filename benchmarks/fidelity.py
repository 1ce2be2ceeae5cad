"""ShadowKV against full attention on the same model and prompts (CPU by default).

1. Greedy continuations of long prompts (chat-formatted stdlib documentation + a question) through
   two engines, attention="full" and attention="shadowkv": token agreement per prompt, free-running
   (each engine follows its own tokens) and teacher-forced (ShadowKV predicts each next token after
   full attention's continuation so far).
2. Attention output error per layer: the last prompt token's query of every layer attends once
   over the full KV and once through ShadowKV (compressed segment, top-k selection, outliers and the
   dense window), on the KV the full model computed (so errors do not compound across layers).

    python benchmarks/fidelity.py                      # 10 prompts of 6K tokens, 32 new tokens
    python benchmarks/fidelity.py --shadowkv-rank 64   # any Engine shadowkv_* keyword as a flag

Prints a table; writes JSON to --out (default benchmarks/results/fidelity.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))
from corpus import document  # noqa: E402

from kernels.ragged_paged_attention import ragged_paged_attention_reference  # noqa: E402
from sglang_shadowkv import Engine  # noqa: E402
from sglang_shadowkv.mem_cache.shadow_pool import ShadowKVPool  # noqa: E402
from sglang_shadowkv.sampling_params import SamplingParams  # noqa: E402
from sglang_shadowkv.managers.model_runner import StepItem  # noqa: E402
from sglang_shadowkv.shadowkv.compress import compress_layer  # noqa: E402
from sglang_shadowkv.shadowkv.config import ShadowKVConfig  # noqa: E402
from sglang_shadowkv.shadowkv.decode import SparseDecoder, SparseRequest  # noqa: E402
from sglang_shadowkv.shadowkv.request_state import segment_layout  # noqa: E402

QUESTION = "\n\nIn two sentences, what is the text above about?"


def chat_prompt(engine: Engine, tokens: int, seed: int) -> list[int]:
    doc = engine.tokenizer.decode(document(engine.tokenizer, tokens, seed))
    text = engine.apply_chat_template([{"role": "user", "content": doc + QUESTION}])
    return engine.tokenizer.encode(text, add_special_tokens=False)


def forced_predictions(engine: Engine, ids: list[int], forced: list[int], sampling: dict) -> list[int]:
    """Greedy token at every position when the continuation so far is `forced` (teacher forcing):
    after each step the sampled token is recorded and replaced by the forced one, so one early
    near-tie flip does not make the rest of the continuation disagree."""
    sched = engine.scheduler
    req = sched.add_request("forced", ids, SamplingParams.from_dict(sampling))
    preds: list[int] = []
    overlap, sched.overlap = sched.overlap, False  # each step's input must be the forced token
    try:
        while not req.finished:
            for update in sched.step():
                if update.req is req and update.new_ids:
                    preds.append(update.new_ids[0])
                    req.output_ids[-1] = forced[len(preds) - 1]
                    if not req.finished:  # the next step's input, on the device
                        sched.runner.next_input[req.pool_row] = req.output_ids[-1]
    finally:
        sched.overlap = overlap
    return preds


class QueryRecorder:
    """Wraps a dense backend; keeps each layer's query of the step's last token."""

    def __init__(self, inner):
        self.inner, self.queries = inner, {}

    def begin_step(self, batch):
        self.inner.begin_step(batch)

    def forward(self, q, k, v, layer, batch):
        self.queries[layer] = q[-1:].clone()
        return self.inner.forward(q, k, v, layer, batch)


def layer_errors(engine: Engine, ids: list[int], configs: list[ShadowKVConfig]) -> list[list[float]]:
    """Per config, the relative L2 error of ShadowKV's attention output per layer for the prompt's
    last query (one dense prefill, shared by all configs)."""
    runner = engine.scheduler.runner
    pool, table, model, c = runner.pool, runner.req_to_token, runner.model, runner.config
    row = table.alloc()
    pages = pool.alloc(-(-len(ids) // pool.page_size))
    try:
        table.write(row, 0, pool.slots_of_pages(pages, len(ids)))
        recorder = QueryRecorder(runner.backend)
        batch = runner.build_batch([StepItem(row, ids, 0)])
        recorder.begin_step(batch)
        model(batch, recorder)
        slots = table.table[row, :len(ids)]
        dense = [ragged_paged_attention_reference(
            recorder.queries[layer], pool.k_buffers[layer], pool.v_buffers[layer],
            torch.tensor([0, 1], device=slots.device), torch.tensor([0, len(ids)], device=slots.device),
            slots, c.head_dim ** -0.5).float() for layer in range(c.num_layers)]
        results = []
        for cfg in configs:
            span = cfg.compressed_len(len(ids), pool.page_size)
            n = span // cfg.chunk_size
            store = ShadowKVPool(n, 1, cfg.outliers, cfg.chunk_size, c.num_layers, c.num_kv_heads,
                                 c.head_dim, cfg.max_rank(c.kv_dim), runner.dtype, runner.device,
                                 cfg.host_value_torch_dtype, cfg.landmark_torch_dtype)
            decoder = SparseDecoder(store, cfg, model.rotary, 1, n, runner.device.type == "cuda")
            seg = store.alloc_segment(0, span, cfg.num_outliers(n))
            plan = decoder.plan_step(table, [SparseRequest(row, decoder.alloc_row(),
                                                                  segment_layout(seg, cfg.chunk_size), len(ids))])
            errors = []
            for layer in range(c.num_layers):
                compress_layer(store, seg, layer, pool.k_buffers[layer][slots[:span].long()],
                               pool.v_buffers[layer][slots[:span].long()], model.rotary, cfg)
                got = decoder.attend(recorder.queries[layer], layer, plan, pool).float()
                errors.append(((got - dense[layer]).norm() / dense[layer].norm()).item())
            results.append(errors)
        return results
    finally:
        pool.free(pages)
        table.free(row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=6000, help="document tokens per prompt")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--attention-backend", default=None, help="torch | triton | flashinfer (default: best)")
    ap.add_argument("--dtype", default="float32",
                    help="float32 (default; bf16 rounding alone flips near-tie greedy tokens) or bfloat16")
    ap.add_argument("--out", default="benchmarks/results/fidelity.json")
    for name, field in ShadowKVConfig.__dataclass_fields__.items():
        if name not in ("host_tokens", "max_requests"):
            ap.add_argument("--shadowkv-" + name.replace("_", "-"), default=None,
                            type={"str": str}.get(field.type, float if "float" in field.type else int))
    args = ap.parse_args()
    overrides = {k: v for k, v in vars(args).items() if k.startswith("shadowkv_") and v is not None}
    overrides.setdefault("shadowkv_min_context", 2048)  # 6K prompts are compressed on this 8K model
    common = dict(model_path=args.model_path, chunked_prefill_size=2048, max_running_requests=4,
                  max_total_tokens=16384, attention_backend=args.attention_backend, dtype=args.dtype)
    full = Engine(attention="full", **common)
    shadow = Engine(attention="shadowkv", shadowkv_max_requests=2, **common, **overrides)
    cfg = shadow.scheduler.runner.shadow_cfg
    sampling = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    rows = []
    for seed in tqdm(range(args.num_prompts), desc="prompts"):
        ids = chat_prompt(full, args.prompt_tokens, seed)
        t0 = time.perf_counter()
        want = full.generate(input_ids=ids, sampling_params=sampling)
        t1 = time.perf_counter()
        got = shadow.generate(input_ids=ids, sampling_params=sampling)
        t2 = time.perf_counter()
        shadow.flush_cache()
        forced = forced_predictions(shadow, ids, want["output_ids"], sampling)
        full.flush_cache()
        shadow.flush_cache()
        a, b = got["output_ids"], want["output_ids"]
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        info = got["meta_info"]["shadowkv"]
        rows.append({"seed": seed, "prompt_tokens": len(ids), "agreement": sum(x == y for x, y in zip(a, b)) / len(b),
                     "forced_agreement": sum(x == y for x, y in zip(forced, b)) / len(b),
                     "first_divergence": first_diff, "compressed_tokens": info["compressed_tokens"],
                     "mean_rank": sum(info["ranks"]) / len(info["ranks"]),
                     "chunk_cache_hit_rate": info["chunk_cache_hit_rate"],
                     "gpu_saving_vs_full": info["gpu_saving_vs_full"], "seconds_full": t1 - t0,
                     "seconds_shadowkv": t2 - t1, "full_text": want["text"], "shadowkv_text": got["text"]})
    errors = layer_errors(full, chat_prompt(full, args.prompt_tokens, 0), [cfg])[0]
    agreement = sum(r["agreement"] for r in rows) / len(rows)
    forced_agreement = sum(r["forced_agreement"] for r in rows) / len(rows)
    result = {"model": full.get_server_info()["model_path"], "device": str(full.scheduler.runner.device),
              "config": {k: v for k, v in vars(cfg).items()}, "new_tokens": args.new_tokens,
              "token_agreement": agreement, "forced_token_agreement": forced_agreement, "prompts": rows, "attention_rel_error_per_layer": errors}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{'seed':>4} {'tokens':>6} {'compressed':>10} {'rank':>5} {'agree':>6} {'forced':>6} {'1st diff':>8} {'hit':>5} {'GPU save':>8}")
    for r in rows:
        print(f"{r['seed']:4d} {r['prompt_tokens']:6d} {r['compressed_tokens']:10d} {r['mean_rank']:5.0f} "
              f"{r['agreement']:6.2f} {r['forced_agreement']:6.2f} {r['first_divergence']:8d} {r['chunk_cache_hit_rate']:5.2f} "
              f"{r['gpu_saving_vs_full']:8.2f}")
    print("attention rel. error per layer: " + " ".join(f"{e:.3f}" for e in errors))
    print(f"token agreement over {len(rows)} prompts x {args.new_tokens} tokens: free-running {agreement:.3f}, "
          f"teacher-forced {forced_agreement:.3f}")


if __name__ == "__main__":
    main()

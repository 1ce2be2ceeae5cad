"""GPU check of the attention backends on the embedded model (run on the lent H100).

Steps of a mixed workload (two prompts; a decode step; a decode step mixed with a prompt that
reuses another's prefix pages) run through the torch, triton and flashinfer backends over the
same KV pool; logits are compared against the torch backend (relative L2 error, bf16). Then greedy
generation through the Engine with each backend. Prints a table, writes backends_gpu.json under
$OUT (else the current folder).

    python maintainers/experiments/check_backends_gpu.py --model-path PATH.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from sglang_shadowkv import Engine
from sglang_shadowkv.layers.attention import create_attention_backend
from sglang_shadowkv.model_executor.forward_batch import StepItem
from sglang_shadowkv.model_executor.model_runner import ModelRunner
from sglang_shadowkv.server_args import ServerArgs

BACKENDS = ["torch", "triton", "flashinfer"]
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at a temperature of",
]


def available_backends() -> list[str]:
    names = ["torch", "triton"]
    try:
        import flashinfer  # noqa: F401
        names.append("flashinfer")
    except ImportError as err:
        print(f"flashinfer unavailable: {err}")
    return names


def logits_check(model_path: str, names: list[str]) -> list[dict]:
    runner = ModelRunner(ServerArgs(model_path=model_path, attention_backend="torch",
                                    max_total_tokens=8192))
    cfg, pool, table = runner.config, runner.pool, runner.req_to_token
    backends = {n: create_attention_backend(n, pool, cfg.num_heads, cfg.head_dim) for n in names}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 30000, (n,), generator=gen).tolist() for n in (300, 123, 200)]
    rows = [table.alloc() for _ in prompts]
    pages = [pool.alloc(64) for _ in prompts]
    for row, p in zip(rows, pages):
        table.write(row, 0, pool.slots_of_pages(p, 64 * pool.page_size))
    # request 2 reuses request 0's first 160 tokens (20 pages), as a radix-cache hit would
    table.write(rows[2], 0, pool.slots_of_pages(pages[0][:20], 160))
    steps = {
        "prefill x2": [StepItem(rows[0], prompts[0], 0), StepItem(rows[1], prompts[1], 0)],
        "decode x2": [StepItem(rows[0], [11], 300), StepItem(rows[1], [12], 123)],
        "decode x2 + prefix-hit prefill": [StepItem(rows[0], [13], 301), StepItem(rows[1], [14], 124),
                                           StepItem(rows[2], prompts[2][160:], 160)],
    }
    results = []
    for step, items in steps.items():
        batch = runner.build_batch(items)
        out = {}
        for name, backend in backends.items():  # the last one's K/V stay as the next step's prefix
            backend.begin_step(batch)
            out[name] = runner.model(batch, backend).float()
        ref = out["torch"]
        for name in names:
            rel = ((out[name] - ref).norm() / ref.norm()).item()
            agree = (out[name].argmax(-1) == ref.argmax(-1)).float().mean().item()
            results.append({"step": step, "backend": name, "rel_err_vs_torch": rel, "argmax_agree": agree})
    return results


def generation_check(model_path: str, names: list[str]) -> list[dict]:
    outs, rows = {}, []
    for name in names:
        eng = Engine(model_path=model_path, attention_backend=name, max_total_tokens=16384)
        eng.generate(PROMPTS[0], {"max_new_tokens": 4, "temperature": 0})  # warm-up (JIT)
        t = time.perf_counter()
        res = eng.generate(PROMPTS, {"max_new_tokens": 32, "temperature": 0})
        elapsed = time.perf_counter() - t
        outs[name] = [r["output_ids"] for r in res]
        eng.shutdown()
        ref = outs["torch"]
        same = sum(a == b for a, b in zip(outs[name], ref))
        tok_agree = sum(x == y for a, b in zip(outs[name], ref) for x, y in zip(a, b)) / sum(len(b) for b in ref)
        rows.append({"backend": name, "identical_outputs": f"{same}/{len(ref)}",
                     "token_agreement": tok_agree, "seconds_5x32": elapsed})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="model (default: the embedded GGUF)")
    args = ap.parse_args()
    names = available_backends()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    logits = logits_check(args.model_path, names)
    generation = generation_check(args.model_path, names)
    result = {"device": device, "torch": torch.__version__, "logits": logits, "generation": generation}
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "backends_gpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\ndevice: {device}")
    print(f"{'step':34} {'backend':11} {'rel err':>9} {'argmax':>7}")
    for r in logits:
        print(f"{r['step']:34} {r['backend']:11} {r['rel_err_vs_torch']:9.2e} {r['argmax_agree']:7.2f}")
    print(f"\n{'backend':11} {'identical':>9} {'tok agree':>9} {'s (5x32)':>9}")
    for r in generation:
        print(f"{r['backend']:11} {r['identical_outputs']:>9} {r['token_agreement']:9.3f} {r['seconds_5x32']:9.2f}")


if __name__ == "__main__":
    main()

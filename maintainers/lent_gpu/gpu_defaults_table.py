"""A short table of one step of gpu_defaults.sh, read from its JSON under the output folder.

    python maintainers/lent_gpu/gpu_defaults_table.py STEP OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

from sglang_shadowkv.shadowkv.selection_report import format_report
from sglang_shadowkv.testing.summaries import chosen_settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMITTED = os.path.join(ROOT, "benchmarks", "results", "bench_throughput.json")


def committed_full_rate(context: int) -> float:
    """Full attention's best tok/s at `context` in the committed H100 run (FlashInfer): it does not
    depend on ShadowKV's settings, so a run without FlashInfer is compared with it too."""
    with open(COMMITTED) as f:
        rows = json.load(f)["rows"]
    return max(r["tok_per_s"] for r in rows if r["method"] == "full" and r["context"] == context)


def niah(d: dict) -> None:
    print("accuracy:", {m: round(a, 3) for m, a in d["accuracy"].items()})
    for method, forms in d["by_form"].items():
        print(f"  {method:>9}: " + ", ".join(f"{f} {a:.2f}" for f, a in forms.items()))


def multiturn(d: dict) -> None:
    for method, acc in d["accuracy"].items():
        print(f"  {method:>9}: {acc:.3f} per turn " + " ".join(f"{a:.2f}" for a in d["per_turn"][method]))


def memo(d: dict) -> None:
    print(f"  {d['prompt_tokens']}-token prompts: full {d['full_correct']}/{d['questions']}, ShadowKV "
          f"{d['shadowkv_correct']}/{d['questions']}, same answer {d['same_answers']}/{d['questions']}")


def fidelity(d: dict) -> None:
    print(format_report(d["selection_report"]))
    print(f"  agreement free-running {d['token_agreement']:.3f}, teacher-forced {d['forced_token_agreement']:.3f}, "
          f"mean chunks {d['mean_chunks']:.1f}, GPU saving {d['gpu_saving_vs_full']:.2f}x")


def hit(d: dict) -> None:
    for task, s in [*d["tasks"].items(), ("memo+niah", d["memo_and_niah"])]:
        if s:
            c = s["correct"]
            print(f"  {task:>10}: right full/cold/hit {c['full']}/{c['cold']}/{c['hit']} of {s['prompts']}, hit=cold "
                  f"tokens {s['hit_vs_cold']['token_agreement']:.3f}, hit=full {s['hit_vs_full']['token_agreement']:.3f}")


def sweep(d: dict) -> None:
    for name, settings in d["sweeps"].items():
        for setting, per_prompt in settings.items():
            for prompt, row in per_prompt.items():
                rules = " ".join(f"{r} {v['recall']:.3f}/{v['chunks_mean']:.0f}" for r, v in row["rules"].items())
                print(f"  {setting:<32} {prompt:>8} rank {row['rank']:5.1f} lr-err {row['lowrank_output_error']:.4f} "
                      f"save {row['gpu_saving_vs_full']:.2f}x recall/chunks {rules}")


def throughput(d: dict) -> None:
    for context in d["gain"]:
        best = max(r["tok_per_s"] for r in d["rows"] if r["method"] == "shadowkv" and r["context"] == int(context)
                   and r.get("workload") == "calibrated")
        print(f"  {context}: gain {d['gain'][context]:.2f}x, worst case {d['gain_worst_case'].get(context, 0):.2f}x "
              f"(full: {d['full_backend']}); calibrated ShadowKV {best:.1f} tok/s = "
              f"{best / committed_full_rate(int(context)):.2f}x the committed FlashInfer full rate")
    for key, bd in d["breakdown"].items():
        if "ranks" in bd:
            print(f"  {key}: {chosen_settings(bd)}")


FILES = {"niah": ("niah.json", niah), "multiturn": ("multi_turn_niah.json", multiturn),
         "memo": ("memo_retrieval.json", memo), "fidelity": ("fidelity_defaults_gpu_fp32.json", fidelity),
         "hit": ("hit_fidelity_gpu_fp32.json", hit), "hit_bf16": ("hit_fidelity_gpu_bf16.json", hit),
         "sweep": ("selection_sweep.json", sweep), "throughput": ("bench_throughput_defaults.json", throughput)}

if __name__ == "__main__":
    step, out = sys.argv[1:3]
    name, show = FILES[step]
    with open(os.path.join(out, name)) as f:
        show(json.load(f))

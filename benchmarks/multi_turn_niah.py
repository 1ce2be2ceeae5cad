"""Multi-turn NIAH: one long document with several needles, a chat that asks for a different
needle each turn, every turn's prompt holding the previous turns, so the document is shared
through the radix cache. Full attention, ShadowKV and two KV-eviction baselines (StreamingLLM,
SnapKV; attention modes of the engine) on the same chats.

    python benchmarks/multi_turn_niah.py          # CPU, embedded SmolLM2: 6K-token document, 5 turns
    python benchmarks/multi_turn_niah.py --chats 10 --eviction-budget 512

Writes JSON (top-level "accuracy": method -> accuracy over all turns; "per_turn"; the cache
counters; every answer) and a line plot of accuracy per turn; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os

from tqdm import tqdm

from sglang_shadowkv import Engine
from sglang_shadowkv.testing.engine_flags import add_engine_flags, engine_kwargs, engine_overrides
from sglang_shadowkv.testing.haystack import INTRO, WORDS, chat_turn
from sglang_shadowkv.testing.prompts import make_chat

METHODS = ("full", "shadowkv", "streamingllm", "snapkv")


def counters(engine: Engine) -> dict:
    info = engine.get_server_info()
    out = {k: info["stats"][k] for k in ("prefill_tokens", "cached_tokens")}
    if info["shadowkv"]:
        out.update({k: info["shadowkv"][k] for k in ("compressions", "tail_compressions",
                                                    "compressed_prefix_hits", "compressed_tokens_reused")})
    return out


def run_chat(engine: Engine, chat: dict, max_new_tokens: int) -> list[dict]:
    before = counters(engine)
    messages, rows = [], []
    for turn, (depth, needle) in enumerate(chat["asked"], 1):
        content = f"{INTRO}\n\n{chat['doc']}\n\n{needle.question}" if turn == 1 else needle.question
        messages.append({"role": "user", "content": content})
        ids = chat_turn(engine, messages, needle.answer_prefix)
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0})
        messages.append({"role": "assistant", "content": needle.answer_prefix + out["text"]})
        rows.append({"seed": chat["seed"], "turn": turn, "depth": depth, "needle": needle.value,
                     "answer": out["text"], "correct": needle.found_in(out["text"]),
                     "prompt_tokens": len(ids), "cached_tokens": out["meta_info"]["cached_tokens"]})
    after = counters(engine)
    rows[-1]["chat_counters"] = {k: after[k] - before[k] for k in after}
    engine.flush_cache()
    return rows


def plot(per_turn: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for method, accs in per_turn.items():
        ax.plot(range(1, len(accs) + 1), accs, marker="o", label=method)
    ax.set_xlabel("turn")
    ax.set_ylabel("retrieval accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xticks(range(1, len(next(iter(per_turn.values()))) + 1))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(ap)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--doc-tokens", type=int, default=6000)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--chats", type=int, default=6, help="documents (each its own chat)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="benchmarks/results/multi_turn_niah.json")
    ap.add_argument("--plot", default=None, help="line plot PNG (default: --out with .png)")
    args = ap.parse_args()
    if args.turns > len(WORDS):
        ap.error(f"--turns must be at most {len(WORDS)} (distinct needle words)")
    overrides = engine_overrides(args)
    common = {**engine_kwargs(args, 4 * args.doc_tokens), **overrides}
    rows, info, chats = [], None, None
    with tqdm(total=len(args.methods) * args.chats, desc="chats") as progress:
        for method in args.methods:
            engine = Engine(attention=method, **common)
            info = info or engine.get_server_info()
            chats = chats or [make_chat(engine.tokenizer, args.doc_tokens, args.turns, s) for s in range(args.chats)]
            try:
                for chat in chats:
                    rows += [dict(r, method=method) for r in run_chat(engine, chat, args.max_new_tokens)]
                    progress.update(1)
            finally:
                engine.shutdown()
    per_turn = {m: [sum(r["correct"] for r in rows if r["method"] == m and r["turn"] == t) / args.chats
                    for t in range(1, args.turns + 1)] for m in args.methods}
    accuracy = {m: sum(accs) / len(accs) for m, accs in per_turn.items()}
    chat_counters = {m: [r["chat_counters"] for r in rows if r["method"] == m and "chat_counters" in r]
                     for m in args.methods}
    result = {"model": info["model_path"], "device": info["device"], "dtype": info["dtype"],
              "accuracy": accuracy, "per_turn": per_turn, "doc_tokens": args.doc_tokens,
              "turns": args.turns, "chats": args.chats, "engine_overrides": overrides,
              "chat_counters": chat_counters, "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(per_turn, args.plot or os.path.splitext(args.out)[0] + ".png")
    print(f"\nmulti-turn NIAH ({info['model_path']}, {info['device']}): {args.chats} chats x {args.turns} turns, "
          f"{args.doc_tokens}-token document")
    print(f"{'method':>12} " + " ".join(f"turn {t:>2}" for t in range(1, args.turns + 1)) + "   overall")
    for m in args.methods:
        print(f"{m:>12} " + " ".join(f"{a:7.2f}" for a in per_turn[m]) + f"   {accuracy[m]:.3f}")
    for m in args.methods:
        c = chat_counters[m][0]
        print(f"{m:>12} first chat's counters: " + ", ".join(f"{k} {v}" for k, v in c.items()))


if __name__ == "__main__":
    main()

"""Console entry: `sglang-shadowkv generate "prompt"` prints the completion."""

from __future__ import annotations

import argparse
import logging
import sys

from sglang_shadowkv.server_args import ServerArgs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-shadowkv",
        description="Long-context LLM serving with a ShadowKV compressed KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt with the offline engine and print it")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    gen.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest; -1 = all")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message in the model's chat template")
    ServerArgs.add_cli_args(gen)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    from sglang_shadowkv.engine import Engine

    try:
        engine = Engine(**vars(ServerArgs.from_cli_args(args)))
        prompt = args.prompt
        if args.chat:
            prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
        out = engine.generate(prompt, {"max_new_tokens": args.max_new_tokens,
                                       "temperature": args.temperature, "top_p": args.top_p,
                                       "top_k": args.top_k})
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out["text"])
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command-line flags shared by the accuracy benchmarks: the model, and every ShadowKV and
eviction-baseline setting of ServerArgs as an optional --flag (unset: the engine's default)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from sglang_shadowkv.server_args import ServerArgs

TUNABLE_PREFIXES = ("shadowkv_", "eviction_", "streamingllm_", "snapkv_")
NOT_TUNABLE = ("shadowkv_host_tokens", "shadowkv_max_requests")


def add_engine_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model-path", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--tokenizer-path", default=None)
    ap.add_argument("--attention-backend", default=None, help="torch | triton | flashinfer (default: best)")
    for field in dataclasses.fields(ServerArgs):
        if field.name.startswith(TUNABLE_PREFIXES) and field.name not in NOT_TUNABLE:
            kind = str if "str" in field.type else float if "float" in field.type else int
            ap.add_argument("--" + field.name.replace("_", "-"), type=kind, default=None)


def engine_overrides(args: argparse.Namespace) -> dict:
    """The tunables the user set, as Engine keyword arguments."""
    return {k: v for k, v in vars(args).items() if k.startswith(TUNABLE_PREFIXES) and v is not None}


def engine_kwargs(args: argparse.Namespace, max_total_tokens: int, max_running_requests: int = 2) -> dict:
    """Engine keyword arguments the accuracy benchmarks share: the model, dtype and attention
    backend from the flags, a pool of max_total_tokens, 2048-token prefill chunks."""
    return dict(model_path=args.model_path, tokenizer_path=args.tokenizer_path, dtype=args.dtype,
                attention_backend=args.attention_backend, max_running_requests=max_running_requests,
                max_total_tokens=max_total_tokens, chunked_prefill_size=2048)


def save_result(path: str, info: dict, overrides: dict, **fields) -> dict:
    """Write an accuracy result as JSON under its provenance (model, device, dtype, the flags set,
    the ShadowKV config the engine ran: from its get_server_info()); returns it."""
    result = {"model": info["model_path"], "device": info["device"], "dtype": info["dtype"],
              "engine_overrides": overrides, "shadowkv_config": info["shadowkv"]["config"], **fields}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return result


__all__ = ["add_engine_flags", "engine_kwargs", "engine_overrides", "save_result"]

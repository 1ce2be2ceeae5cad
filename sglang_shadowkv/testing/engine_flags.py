"""Command-line flags shared by the accuracy benchmarks: the model, and every ShadowKV setting
(ShadowKVConfig, as --shadowkv-<name>) and eviction-baseline setting of ServerArgs as an optional
--flag (unset: the engine's default, except the compress policy: eager), so a run can try any
setting without editing code."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from sglang_shadowkv.server_args import ServerArgs
from sglang_shadowkv.shadowkv.config import ShadowKVConfig

TUNABLE_PREFIXES = ("shadowkv_", "eviction_", "streamingllm_", "snapkv_")
NOT_TUNABLE = ("shadowkv_host_tokens", "shadowkv_max_requests")


def add_engine_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model-path", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--tokenizer-path", default=None)
    ap.add_argument("--attention-backend", default=None, help="torch | triton | flashinfer (default: best)")
    for name, field in tunable_fields():
        kind = str if "str" in field.type else float if "float" in field.type else int
        ap.add_argument("--" + name.replace("_", "-"), type=kind, default=None)


def tunable_fields() -> list[tuple[str, dataclasses.Field]]:
    """(Engine keyword, field) of each tunable: ShadowKVConfig's, flat as shadowkv_<name> (as Engine
    takes them), then the eviction baselines' fields of ServerArgs."""
    fields = [("shadowkv_" + f.name, f) for f in dataclasses.fields(ShadowKVConfig)]
    fields += [(f.name, f) for f in dataclasses.fields(ServerArgs) if f.name.startswith(TUNABLE_PREFIXES)]
    return [(name, f) for name, f in fields if name not in NOT_TUNABLE]


def engine_overrides(args: argparse.Namespace) -> dict:
    """The tunables the user set, as Engine keyword arguments. The compress policy defaults to eager:
    an accuracy benchmark measures ShadowKV's compressed form, which the default tier policy would
    not use for documents that fit the pool dense."""
    given = {k: v for k, v in vars(args).items() if k.startswith(TUNABLE_PREFIXES) and v is not None}
    return {"shadowkv_compress_policy": "eager", **given}


def engine_kwargs(args: argparse.Namespace, max_total_tokens: int, max_running_requests: int = 2) -> dict:
    """Engine keyword arguments the accuracy benchmarks share: the model, dtype and attention
    backend from the flags, a pool of max_total_tokens, 2048-token prefill chunks."""
    return dict(model_path=args.model_path, tokenizer_path=args.tokenizer_path, dtype=args.dtype,
                attention_backend=args.attention_backend, max_running_requests=max_running_requests,
                max_total_tokens=max_total_tokens, chunked_prefill_size=2048)


def save_result(path: str, info: dict, overrides: dict, indent: int | None = 1, **fields) -> dict:
    """Write an accuracy result as JSON under its provenance (model, device, dtype, attention
    backend, the flags set, the ShadowKV config the engine ran: from its get_server_info());
    returns it. indent=None: one line, for results of many token lists."""
    result = {"model": info["model_path"], "device": info["device"], "dtype": info["dtype"],
              "attention_backend": info["attention_backend"], "engine_overrides": overrides,
              "shadowkv_config": info["shadowkv"]["config"], **fields}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=indent, separators=None if indent else (",", ":"))
    return result


__all__ = ["add_engine_flags", "engine_kwargs", "engine_overrides", "save_result"]

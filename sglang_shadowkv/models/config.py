"""Model shape and rotary settings, read from a Hugging Face config.json or GGUF metadata.

One flat dataclass serves the Llama and Qwen2 families: they differ only in the QKV bias and
the default rope settings, so the model code stays one implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass
class ModelConfig:
    architecture: str  # "llama" or "qwen2"
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
    attention_bias: bool = False
    context_length: int = 4096
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

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
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        eos = cfg.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rope_theta=float(theta),
            rope_scaling=_normalize_rope_scaling(rope),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            context_length=cfg.get("max_position_embeddings", 4096),
            eos_token_ids=eos_ids,
            name=name,
        )


def _normalize_rope_scaling(rope: dict[str, Any] | None) -> dict[str, Any] | None:
    """Keep only scalings that change the frequencies; 'default' means none."""
    if not rope:
        return None
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("llama3", "linear"):
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: llama3, linear)")
    return {**rope, "rope_type": kind}

"""Attention backends behind one interface; `create_attention_backend` picks one by name."""

from __future__ import annotations

from .base import AttentionBackend, ForwardBatch

BACKENDS = ("torch", "triton", "flashinfer")


def create_attention_backend(name: str, pool, num_heads: int, head_dim: int) -> AttentionBackend:
    if name == "torch":
        from .torch_backend import TorchAttentionBackend as cls
    elif name == "triton":
        from .triton_backend import TritonAttentionBackend as cls
    elif name == "flashinfer":
        from .flashinfer_backend import FlashInferAttentionBackend as cls
    else:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    return cls(pool, num_heads, head_dim)


__all__ = ["AttentionBackend", "ForwardBatch", "BACKENDS", "create_attention_backend"]

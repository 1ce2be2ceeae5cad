"""Llama-family decoder (Llama 2/3/3.1, SmolLM, Mistral) and Qwen2 (same graph plus QKV bias).

Our own module rather than transformers' so that attention runs through the engine's backend over
the paged pool, one flattened step of many requests at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_shadowkv.layers.attention import AttentionBackend, ForwardBatch
from sglang_shadowkv.layers.norm import RMSNorm
from sglang_shadowkv.layers.rotary import RotaryEmbedding

from .config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, positions, rotary: RotaryEmbedding, backend: AttentionBackend,
                batch: ForwardBatch):
        t = x.shape[0]
        q = rotary.apply(self.q_proj(x).view(t, self.num_heads, self.head_dim), positions)
        k = rotary.apply(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), positions)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        o = backend.forward(q, k, v, self.layer_id, batch)
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rotary, backend, batch):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, backend, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # weights come from the checkpoint: no random init (nn.Embedding's normal_ on the meta device
        # imports torch._dynamo, 2-3 s of every start)
        self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # the rotary tables are no parameters: the loader builds them on the model's device
        # (computed on the meta device, where the model is made, they would cost seconds)
        self.rotary: RotaryEmbedding | None = None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend: AttentionBackend,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the rows `logit_rows` of the step (default: each request's last token)."""
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(x, batch.positions, self.rotary, backend, batch)
        rows = batch.last_token_index if logit_rows is None else logit_rows
        return self.lm_head(self.norm(x[rows])).float()

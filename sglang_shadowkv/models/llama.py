"""The decoder of every supported family: Llama's graph, with each family's differences as the
flags of models/config.py (QKV and output biases, Qwen3's q/k norms, Glm4's post-sublayer norms;
partial and interleaved rotary and LongRoPE/YaRN live in the rotary tables, layers/rotary.py).

Our own module rather than transformers' so that attention runs through the engine's backend over
the paged pool, one flattened step of many requests at a time. Under tensor parallelism each rank
builds its own share (layers/linear.py): its heads of q, k and v, its columns of the MLP and its
rows of the vocabulary; the attention backend sees only this rank's heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_shadowkv.distributed.parallel_state import get_tp
from sglang_shadowkv.layers.attention import AttentionBackend, ForwardBatch
from sglang_shadowkv.layers.linear import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                           VocabParallelEmbedding)
from sglang_shadowkv.layers.norm import RMSNorm
from sglang_shadowkv.layers.rotary import RotaryEmbedding

from .config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        local = cfg.for_ranks(get_tp().size)
        self.num_heads, self.num_kv_heads, self.head_dim = local.num_heads, local.num_kv_heads, cfg.head_dim
        replicas = cfg.kv_replicas(get_tp().size)
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = ColumnParallelLinear(cfg.hidden_size, cfg.kv_dim, cfg.attention_bias, replicas)
        self.v_proj = ColumnParallelLinear(cfg.hidden_size, cfg.kv_dim, cfg.attention_bias, replicas)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.output_bias)
        # Qwen3: each head of q and k normed before RoPE (one weight for all heads: replicated)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x, positions, rotary: RotaryEmbedding, backend: AttentionBackend,
                batch: ForwardBatch):
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        q = rotary.rotate_queries(q, positions)
        k = rotary.apply(k, positions)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        o = backend.forward(q, k, v, self.layer_id, batch)
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Glm4: each sublayer's output normed again before its residual add
        extra = cfg.post_sublayer_norms
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if extra else nn.Identity()
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if extra else nn.Identity()

    def forward(self, x, positions, rotary, backend, batch):
        x = x + self.post_self_attn_layernorm(
            self.self_attn(self.input_layernorm(x), positions, rotary, backend, batch))
        return x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x)))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
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

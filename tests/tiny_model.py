"""Tiny random Hugging Face model folders, written by transformers itself: real weights files and a
real tokenizer that load in a second, for tests of the loader, of each model family against
transformers' own modeling code, and of the engine's plumbing (process lifecycle)."""

from pathlib import Path

# ShadowKV on a tiny model: compression forced at the first prefill of a prompt of 512 tokens or more,
# its span to its last whole chunk before the window (span grid 8: these prompts are shorter than
# the default grid's 512 tokens plus the window)
SHADOWKV = dict(attention="shadowkv", max_total_tokens=16384, chunked_prefill_size=512, shadowkv_min_context=512,
                shadowkv_span_grid=8, shadowkv_host_tokens=4096, shadowkv_max_budget=64,
                shadowkv_compress_policy="eager")

# every family the engine loads: 2 layers, 4 heads of 16 dims over 2 KV heads
FAMILIES = ("llama", "yi", "qwen2", "qwen2.5-yarn", "qwen3", "glm", "glm4", "phi3")
ORIGINAL_POSITIONS = 64  # the rope switch point of llama3, yarn and longrope scaling


def tiny_config(kind: str, max_position_embeddings: int = 256):
    """A transformers config of the family `kind` (FAMILIES) with its rope settings; scalings switch
    at ORIGINAL_POSITIONS tokens."""
    import transformers

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                  bos_token_id=None, eos_token_id=1, pad_token_id=0, initializer_range=0.1)
    original = ORIGINAL_POSITIONS
    if kind == "llama":
        return transformers.LlamaConfig(**common, rope_theta=50000.0, tie_word_embeddings=False,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": original})
    if kind == "yi":  # Yi-9B-200K: the Llama graph, a large theta, no scaling
        return transformers.LlamaConfig(**common, rope_theta=10000000.0, rms_norm_eps=1e-6)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=10000.0, tie_word_embeddings=True)
    if kind == "qwen2.5-yarn":
        return transformers.Qwen2Config(**common, rope_theta=10000.0, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": original})
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=16, rope_theta=10000.0)
    if kind in ("glm", "glm4"):
        cls = transformers.GlmConfig if kind == "glm" else transformers.Glm4Config
        return cls(**common, head_dim=16, partial_rotary_factor=0.5, attention_bias=True)
    if kind == "phi3":  # LongRoPE on 3/4 of each head (as Phi-4-mini; Phi-3-mini rotates all of it)
        return transformers.Phi3Config(**common, original_max_position_embeddings=original, partial_rotary_factor=0.75,
                                       rope_scaling={"rope_type": "longrope",
                                                     "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                                     "long_factor": [1.5 + 2.0 * i for i in range(6)]})
    raise ValueError(f"kind must be one of {FAMILIES}, got {kind!r}")


def tiny_model(kind: str, max_position_embeddings: int = 256):
    """A random transformers model of the family (float32, eval), its biases and norm weights
    random too (transformers makes them 0 and 1), so that every weight shows in its output."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind, max_position_embeddings))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif p.dim() == 1:  # a norm's weight
                p.uniform_(0.5, 1.5)
    return model.eval()


def save_tokenizer(folder) -> None:
    """Words t0..t511 are tokens 0..511 (t0 unknown, t1 end of sequence)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1").save_pretrained(folder)


def save_tiny(model, folder: Path, max_shard_size: str | None = None) -> str:
    """The model as a Hugging Face folder (safetensors, in shards of max_shard_size if given) with
    the tokenizer."""
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    save_tokenizer(folder)
    return str(folder)


def save_tiny_llama(folder: Path, max_position_embeddings: int = 4096) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    return save_tiny(transformers.LlamaForCausalLM(tiny_config("llama", max_position_embeddings)), folder)

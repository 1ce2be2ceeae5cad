"""Tiny random Hugging Face model folders: real weights files and a real tokenizer that load in a
second, for tests about the engine's plumbing rather than its text (loader, process lifecycle)."""

from pathlib import Path


def tiny_config(kind: str, max_position_embeddings: int = 256):
    import transformers

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings)
    if kind == "llama":
        return transformers.LlamaConfig(**common, rope_theta=50000.0, tie_word_embeddings=False,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})
    return transformers.Qwen2Config(**common, rope_theta=10000.0, tie_word_embeddings=True)


def save_tokenizer(folder) -> None:
    """Words t0..t511 are tokens 0..511 (t0 unknown, t1 end of sequence)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1").save_pretrained(folder)


def save_tiny_llama(folder: Path, max_position_embeddings: int = 4096) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_config("llama", max_position_embeddings)).save_pretrained(folder)
    save_tokenizer(folder)
    return str(folder)

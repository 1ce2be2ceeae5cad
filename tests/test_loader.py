"""Hugging Face folders of every family (tests/tiny_model.py) load into our model and give the same
logits as transformers' own modeling code, past every rope switch point; sharded checkpoints load;
a GGUF file's conversion is cached."""

import pytest
import torch

from sglang_shadowkv.layers.attention import ForwardBatch, create_attention_backend
from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool
from sglang_shadowkv.models.loader import load_model
from tiny_model import FAMILIES, ORIGINAL_POSITIONS, save_tiny, tiny_model

ARCHITECTURES = {"llama": "llama", "yi": "llama", "qwen2": "qwen2", "qwen2.5-yarn": "qwen2", "qwen3": "qwen3",
                 "glm": "glm", "glm4": "glm4", "phi3": "phi3"}


def _logits(loaded, ids: torch.Tensor) -> torch.Tensor:
    """Our model's logits of every position of one prompt, attended by the torch backend."""
    c, n = loaded.config, len(ids)
    pool = PagedKVPool(n // 8 + 2, 8, c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    slots = pool.slots_of_pages(pool.alloc(n // 8 + 1), n)
    indptr = torch.tensor([0, n], dtype=torch.int32)
    batch = ForwardBatch(ids, torch.arange(n), slots, indptr, indptr, slots.int(), [n], [n])
    backend = create_attention_backend("torch", pool, c.num_heads, c.head_dim)
    return loaded.model(batch, backend, logit_rows=torch.arange(n))


@pytest.mark.parametrize("kind", FAMILIES)
def test_hf_folder_logits_match_transformers(kind, tmp_path):
    ref = tiny_model(kind, max_position_embeddings=1024)
    loaded = load_model(save_tiny(ref, tmp_path), torch.float32, "cpu")
    assert loaded.config.architecture == ARCHITECTURES[kind]
    assert loaded.tokenizer.eos_token == "t1"
    ids = torch.randint(0, 512, (2 * ORIGINAL_POSITIONS + 22,))  # past every rope switch point
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    torch.testing.assert_close(_logits(loaded, ids), want, rtol=1e-4, atol=1e-4)


def test_a_sharded_checkpoint_loads_only_the_files_its_index_names(tmp_path):
    """model.safetensors.index.json over several files; a stray .safetensors beside them (as
    Mistral's consolidated.safetensors) is not read."""
    from safetensors.torch import save_file

    ref = tiny_model("phi3")
    save_tiny(ref, tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2 and (tmp_path / "model.safetensors.index.json").exists()
    save_file({"layers.0.attention.wq.weight": torch.zeros(2)}, str(tmp_path / "consolidated.safetensors"))
    ids = torch.randint(0, 512, (2 * ORIGINAL_POSITIONS,))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    torch.testing.assert_close(_logits(load_model(str(tmp_path), torch.float32, "cpu"), ids), want,
                               rtol=1e-4, atol=1e-4)
    (tmp_path / "model.safetensors.index.json").unlink()  # without the index every file is read: refused by name
    with pytest.raises(ValueError, match="does not use: .*layers.0.attention.wq.weight"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_unknown_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="model_path"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_gguf_conversion_is_cached_and_loads_the_same_model(tmp_path, monkeypatch):
    """The first load of a GGUF file converts it and caches the result; a later load reads the
    cache: the same config, the same weights bit for bit, a tokenizer that encodes and applies the
    chat template the same. A changed file gets a new entry; SGLANG_SHADOWKV_CACHE=off caches nothing."""
    import os
    import shutil
    from pathlib import Path

    from sglang_shadowkv.models import gguf_cache
    from sglang_shadowkv.models.loader import _read_gguf, embedded_model_path

    gguf = Path(tmp_path / "model.gguf")
    shutil.copy(embedded_model_path(), gguf)
    monkeypatch.setenv("SGLANG_SHADOWKV_CACHE", str(tmp_path / "cache"))
    assert gguf_cache.load(gguf) is None
    config, weights, tokenizer = _read_gguf(gguf)  # converted, then stored
    cached = gguf_cache.load(gguf)
    assert cached is not None and cached[0] == config
    assert cached[1].keys() == weights.keys() and all(torch.equal(cached[1][k], w) for k, w in weights.items())
    text = "Hello <|im_start|>world\n  tabs\tand ünïcode 1234 <|endoftext|>"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    for tok in (tokenizer, cached[2]):
        assert tok.eos_token_id == tokenizer.eos_token_id and len(tok) == len(tokenizer)
    assert cached[2].encode(text) == tokenizer.encode(text)
    assert gguf_cache.load_tokenizer(gguf).encode(text) == tokenizer.encode(text)  # without the weights
    assert (cached[2].apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    entry = gguf_cache.entry_dir(gguf)
    os.utime(gguf, ns=(0, 0))
    assert gguf_cache.entry_dir(gguf) != entry and gguf_cache.load(gguf) is None
    assert gguf_cache.load_tokenizer(gguf) is None
    monkeypatch.setenv("SGLANG_SHADOWKV_CACHE", "off")
    assert gguf_cache.entry_dir(gguf) is None and gguf_cache.load(gguf) is None

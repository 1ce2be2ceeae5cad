"""Hugging Face folders (Llama with llama3 rope scaling, Qwen2 with QKV bias) load into our model
and give the same logits as transformers' own modeling code."""

import pytest
import torch

from sglang_shadowkv.layers.attention import ForwardBatch, create_attention_backend
from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool
from sglang_shadowkv.models.loader import load_model
from tiny_model import save_tokenizer, tiny_config


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_folder_logits_match_transformers(kind, tmp_path):
    import transformers

    torch.manual_seed(0)
    cfg = tiny_config(kind)
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen2ForCausalLM
    ref = cls(cfg).eval()
    if kind == "qwen2":  # make the QKV biases matter
        for layer in ref.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    ref.save_pretrained(tmp_path)
    save_tokenizer(tmp_path)

    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    assert loaded.config.architecture == kind
    assert loaded.config.attention_bias == (kind == "qwen2")
    assert loaded.tokenizer.eos_token == "t1"
    c = loaded.config
    n = 150  # past original_max_position_embeddings, where llama3 scaling matters
    ids = torch.randint(0, 512, (n,))
    pool = PagedKVPool(n // 8 + 2, 8, c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    slots = pool.slots_of_pages(pool.alloc(n // 8 + 1), n)
    indptr = torch.tensor([0, n], dtype=torch.int32)
    batch = ForwardBatch(ids, torch.arange(n), slots, indptr, indptr, slots.int(), [n], [n])
    backend = create_attention_backend("torch", pool, c.num_heads, c.head_dim)
    ours = loaded.model(batch, backend, logit_rows=torch.arange(n))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)


def test_unknown_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="model_path"):
        load_model(str(tmp_path), torch.float32, "cpu")

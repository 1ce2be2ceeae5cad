"""Every model family of ShadowKV's paper (and Qwen2.5 with YaRN, Qwen3), each on a tiny random
checkpoint that transformers writes itself (tests/tiny_model.py): through the Engine, transformers'
own greedy tokens (generate, do_sample=False) on prompts past every rope switch point, dense and
with ShadowKV compressing the document (cold, then a hit on it); under tensor parallelism too. The
rope settings are read as transformers reads them and give its frequencies; what is not supported
is refused by name."""

import pytest
import torch

from sglang_shadowkv.layers.rotary import rope_frequencies
from sglang_shadowkv.models.config import ModelConfig
from tiny_model import ORIGINAL_POSITIONS, SHADOWKV, save_tiny, tiny_model

ENGINE_FAMILIES = ("llama", "qwen2.5-yarn", "qwen3", "glm", "glm4", "phi3")
# ShadowKV at full rank attending every chunk: exact attention over the compressed document, so
# its tokens are transformers' too (a key rotated back or rebuilt wrongly would change them)
SHADOWKV_EXACT = {**SHADOWKV, "shadowkv_min_context": 256, "shadowkv_rank": 32, "shadowkv_min_budget_chunks": 64}
NEW_TOKENS = 5


def _prompts() -> list[list[int]]:
    """A short prompt (stays dense), then a document (compressed at its prefill) with a question,
    then the same document with another question (a hit on the compressed document)."""
    doc = [(7 * i) % 500 + 2 for i in range(330)]
    return [[(13 * i) % 500 + 2 for i in range(2 * ORIGINAL_POSITIONS)], doc + [5, 6, 7], doc + [8, 9]]


def _transformers_tokens(model, prompts) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


def _engine_tokens(path: str, prompts, tp_size: int = 1) -> tuple[list[list[int]], dict]:
    from sglang_shadowkv import Engine

    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0}
    with Engine(model_path=path, tp_size=tp_size, **SHADOWKV_EXACT) as engine:
        outs = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
        return outs, engine.get_server_info()


@pytest.mark.parametrize("kind", ENGINE_FAMILIES)
def test_engine_gives_transformers_greedy_tokens_dense_and_compressed(kind, tmp_path):
    ref = tiny_model(kind, max_position_embeddings=1024)
    prompts = _prompts()
    outs, info = _engine_tokens(save_tiny(ref, tmp_path), prompts)
    assert outs == _transformers_tokens(ref, prompts)
    assert info["stats"]["compressions"] == 1 and info["stats"]["compressed_prefix_hits"] == 1
    assert info["shadowkv"]["ranks"]["last_per_layer"] == [32, 32]


def test_two_ranks_of_a_fused_partial_rotary_model_give_transformers_tokens(tmp_path):
    """Phi-3 under tensor parallelism: its fused qkv and gate_up split into parts, each sharded
    like q/k/v and gate/up; its q/k rows reordered per head for partial rotary; each rank
    compressing its own KV head."""
    ref = tiny_model("phi3", max_position_embeddings=1024)
    prompts = _prompts()
    outs, info = _engine_tokens(save_tiny(ref, tmp_path), prompts, tp_size=2)
    assert info["tp_size"] == 2 and outs == _transformers_tokens(ref, prompts)
    assert info["stats"]["compressions"] == 1 and info["stats"]["compressed_prefix_hits"] == 1


def _hf_dict(kind: str, **overrides) -> dict:
    """config.json of a tiny model of the family, as transformers writes it, with overrides."""
    model = tiny_model(kind)
    return {**model.config.to_dict(), "architectures": [type(model).__name__], **overrides}


@pytest.mark.parametrize("config_class,rope,partial", [
    ("LlamaConfig", {"rope_type": "linear", "factor": 4.0}, 1.0),
    ("LlamaConfig", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}, 1.0),
    ("Qwen2Config", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 1.0),
    ("GlmConfig", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "mscale": 0.9,
                   "mscale_all_dim": 0.7, "beta_fast": 16, "truncate": False}, 0.5),
    ("Qwen2Config", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32768,
                     "attention_factor": 1.5, "beta_slow": 2}, 1.0),
])
def test_rope_frequencies_and_attention_factor_are_transformers(config_class, rope, partial):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = getattr(transformers, config_class)(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                             max_position_embeddings=65536, rope_theta=1000000.0,
                                             partial_rotary_factor=partial, rope_scaling=dict(rope))
    ours = ModelConfig.from_hf_dict({**hf.to_dict(), "architectures": [config_class.replace("Config", "ForCausalLM")]})
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, None)
    got_freq, got_factor = rope_frequencies(ours.rotary_dim, ours.rope_theta, ours.rope_scaling, 65536)
    assert ours.rotary_dim == int(128 * partial)
    torch.testing.assert_close(got_freq.float(), inv_freq, rtol=1e-6, atol=0)
    assert got_factor == pytest.approx(factor, rel=1e-12)


def test_longrope_takes_its_long_factors_when_the_context_exceeds_the_original_length():
    """Phi-3-mini-128k's config.json (transformers 4 style: type "su", top-level original length)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from sglang_shadowkv.models.loader import RANDOM_PRESETS

    preset = RANDOM_PRESETS["phi-3-mini"]["rope_scaling"]
    factors = {"short_factor": preset["short_factor"], "long_factor": preset["long_factor"]}
    cfg = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "num_attention_heads": 32,
           "intermediate_size": 8192, "num_hidden_layers": 32, "vocab_size": 32064, "rope_theta": 10000.0,
           "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
           "rope_scaling": {"type": "su", **factors}}
    ours = ModelConfig.from_hf_dict(cfg)
    assert ours.rope_scaling["rope_type"] == "longrope" and ours.rope_scaling["factor"] == 32.0
    hf = transformers.Phi3Config(**{**cfg, "rope_scaling": {"rope_type": "longrope", **factors}})
    for context, seq_len in ((131072, 4097), (4096, None)):
        inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](hf, None, seq_len=seq_len)
        got_freq, got_factor = rope_frequencies(96, 10000.0, ours.rope_scaling, context)
        torch.testing.assert_close(got_freq.float(), inv_freq, rtol=1e-6, atol=0)
        assert got_factor == pytest.approx(factor)


def test_what_is_not_supported_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'; supported: .*'Glm4ForCausalLM'"
                                         r".*'Phi3ForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM'"):
        ModelConfig.from_hf_dict(_hf_dict("llama", architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match=r"unsupported rope scaling type 'dynamic' \(supported: default, linear, "
                                         r"llama3, yarn, longrope\)"):
        ModelConfig.from_hf_dict(_hf_dict("qwen2", rope_parameters={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(ValueError, match="longrope long_factor must list 6 factors .*got 5"):
        phi = _hf_dict("phi3")
        ModelConfig.from_hf_dict({**phi, "rope_parameters": {**phi["rope_parameters"], "long_factor": [1.0] * 5}})
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        ModelConfig.from_hf_dict(_hf_dict("llama", hidden_act="gelu"))


def test_each_family_reads_its_flags_and_a_sliding_window_caps_the_context():
    glm4 = ModelConfig.from_hf_dict(_hf_dict("glm4"))
    assert (glm4.rotary_dim, glm4.rope_interleaved, glm4.attention_bias, glm4.output_bias,
            glm4.post_sublayer_norms) == (8, True, True, False, True)
    qwen3 = ModelConfig.from_hf_dict(_hf_dict("qwen3", attention_bias=True))
    assert qwen3.qk_norm and qwen3.output_bias and not qwen3.post_sublayer_norms
    assert ModelConfig.from_hf_dict(_hf_dict("qwen2", attention_bias=False)).attention_bias  # Qwen2: always
    # Phi-3-mini-4k attends over a 2047-token window: within it, attending to every token is the same
    assert ModelConfig.from_hf_dict(_hf_dict("phi3", max_position_embeddings=4096,
                                             sliding_window=2047)).context_length == 2047
    assert ModelConfig.from_hf_dict(_hf_dict("qwen2", sliding_window=64, use_sliding_window=False,
                                             max_position_embeddings=4096)).context_length == 4096


def test_random_presets_build_on_the_meta_device_with_their_published_parameter_counts():
    """With each family's own vocabulary: the totals of the published checkpoints' safetensors."""
    from sglang_shadowkv.models.llama import LlamaForCausalLM
    from sglang_shadowkv.models.loader import RANDOM_PRESETS, preset_config

    published = {"llama-3.1-8b": (128256, 8_030_261_248), "llama-3.2-1b": (128256, 1_235_814_400),
                 "llama-3.1-70b": (128256, 70_553_706_496), "smollm2-135m": (49152, 134_515_008),
                 "qwen2.5-7b": (152064, 7_615_616_512), "qwen3-8b": (151936, 8_190_735_360),
                 "glm-4-9b": (151552, 9_399_951_360), "phi-3-mini": (32064, 3_821_079_552)}
    assert set(published) == set(RANDOM_PRESETS)
    for name, (vocab, total) in published.items():
        with torch.device("meta"):
            model = LlamaForCausalLM(preset_config(name, vocab, [0]))
        assert sum(p.numel() for p in model.parameters()) == total, name


def test_a_head_dim_flashinfer_lacks_is_served_by_triton_and_refused_by_name(monkeypatch):
    """Phi-3's head dim (96) and the tiny test models' (16) are outside FlashInfer's dispatch: on a
    GPU the default backend is then Triton, and asking for FlashInfer is an error naming the
    argument at startup (it failed inside the first step: "Unsupported head_dim: 16")."""
    import sys
    import types

    from sglang_shadowkv.layers.attention import create_attention_backend
    from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool
    from sglang_shadowkv.model_executor.model_runner import default_backend

    gpu = types.SimpleNamespace(type="cuda")
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    assert [default_backend(gpu, d) for d in (64, 128, 96, 16)] == ["flashinfer", "flashinfer", "triton", "triton"]
    assert default_backend(torch.device("cpu"), 128) == "torch"
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed
    assert default_backend(gpu, 128) == "triton"
    pool = PagedKVPool(4, 8, num_layers=1, num_kv_heads=1, head_dim=96, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="attention_backend flashinfer.*this model's is 96"):
        create_attention_backend("flashinfer", pool, 4, 96)

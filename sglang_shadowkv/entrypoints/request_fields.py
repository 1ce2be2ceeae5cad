"""Every request field of SGLang's /generate (GenerateReqInput), /v1/completions (CompletionRequest)
and /v1/chat/completions (ChatCompletionRequest), as of sglang 0.5.23, and what this server does
with it: one table per route.

sglang-router and SGLang's own clients send the full objects, most fields at their defaults, so
a field is never refused for being present: USE fields are read by the route, IGNORE fields are
bookkeeping with no effect on a single data-parallel rank (any value passes), and a Refused field
passes at the values that mean "off" and is a 400 naming it, with the reason, at any other. A
field in no table is a 400 too (a typo should not pass silently).
"""

from __future__ import annotations

from dataclasses import dataclass

USE = "use"
IGNORE = "ignore"


@dataclass(frozen=True)
class Refused:
    """A feature this engine lacks: `off` are the values that do not ask for it."""
    reason: str
    off: tuple = (None,)


def _refused(reason: str, *fields: str, off: tuple = (None,)) -> dict[str, Refused]:
    return {f: Refused(reason, off) for f in fields}


# ---- groups shared by the routes ---------------------------------------------------------------
_BOOKKEEPING = dict.fromkeys(
    ("log_metrics", "no_logs", "custom_labels", "received_time", "external_trace_header",
     "http_worker_ipc", "conversation_id", "routing_key", "session_id", "user", "kv_hints",
     "priority"),  # SGLang ignores priority unless priority scheduling is on
    IGNORE)
# one server is one data-parallel rank: rank 0 (or none) is this server
_ROUTING = {**_refused("data-parallel ranks are separate servers here (put sglang-router in front)",
                       "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank", off=(None, 0)),
            **_refused("prefill-decode disaggregation is not supported", "bootstrap_host",
                       "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size")}
_MULTIMODAL = _refused(
    "multimodal inputs are not supported (text models only)", "image_data", "video_data",
    "audio_data", "input_embeds", "mm_hashes", "mm_content_hashes", "video_config", "modalities",
    "images_config", "mm_processor_kwargs", "max_dynamic_patch", "min_dynamic_patch",
    "image_max_dynamic_patch", "video_max_dynamic_patch", "need_wait_for_mm_inputs",
    "num_items_assigned", "encoder_urls", "positional_embed_overrides")
_MISSING = {
    **_refused("multimodal inputs are not supported (text models only)", "use_audio_in_video",
               off=(None, False)),
    **_refused("LoRA adapters are not supported", "lora_path", "lora_id"),
    **_refused("custom logit processors are not supported", "custom_logit_processor"),
    **_refused("sessions (session_params) are not supported", "session_params"),
    **_refused("cache namespaces are not supported: every request shares one prefix cache",
               "extra_key", "cache_salt"),
    **_refused("watermarking is not supported", "watermark"),
    **_refused("hidden states are not returned", "return_hidden_states", off=(None, False)),
    **_refused("this engine serves dense models (no routed experts)", "return_routed_experts",
               "return_indexer_topk", off=(None, False)),
    "routed_experts_start_len": Refused("this engine serves dense models (no routed experts)", (None, 0)),
    **_refused("speculative decoding is not supported", "return_spec_tokens_details",
               off=(None, False)),
    **_refused("sampling masks are not returned", "return_sampling_mask", off=(None, False)),
    "sampling_logprobs_mode": Refused("sampling masks are not returned"),
    **_refused("flat top-logprob arrays are not supported (nested lists are returned)",
               "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs",
               off=(None, False)),
    **_refused("prompt token ids are not returned separately (they are the request's input_ids)",
               "return_prompt_token_ids", "return_token_ids", off=(None, False)),
    **_refused("reasoning models are not supported (no reasoning parser)", "require_reasoning",
               off=(None, False)),
    **_refused("reasoning models are not supported (no reasoning parser)", "max_thinking_tokens",
               "reasoning_effort", "thinking"),
}

GENERATE_FIELDS: dict[str, object] = {
    **dict.fromkeys(("text", "input_ids", "sampling_params", "rid", "stream", "return_logprob",
                     "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
                     "return_text_in_logprobs"), USE),
    "model": IGNORE,  # sglang-router adds it (null); the server has one model
    **_BOOKKEEPING, **_ROUTING, **_MULTIMODAL, **_MISSING,
    "background": Refused("background requests (the Responses API) are not supported", (None, False)),
    "return_bytes": Refused("only text is generated", (None, False)),
    "return_entropy": Refused("entropy is not returned", (None, False)),
    "return_flat_raw_top_logprobs_b64": Refused(
        "flat top-logprob arrays are not supported (nested lists are returned)", (None, False)),
    "multi_item_delimiter_indices": Refused("multi-item scoring is not supported"),
    "token_indices_to_pool": Refused("pooled scoring is not supported"),
}

# OpenAI field -> SGLang sampling parameter (same meaning), shared by both OpenAI routes
OPENAI_SAMPLING = {
    "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "stop": "stop", "stop_token_ids": "stop_token_ids", "stop_regex": "stop_regex",
    "seed": "sampling_seed", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos", "logit_bias": "logit_bias", "n": "n", "min_tokens": "min_new_tokens",
    "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "no_stop_trim",
    "regex": "regex", "ebnf": "ebnf", "custom_params": "custom_params",
}
_OPENAI_COMMON = {
    **dict.fromkeys(OPENAI_SAMPLING, USE),
    **dict.fromkeys(("model", "metadata", "store"), IGNORE),  # any model name is served, as SGLang does
    **dict.fromkeys(("stream", "stream_options", "response_format", "logprobs", "rid"), USE),
    **_BOOKKEEPING, **_ROUTING, **_MULTIMODAL, **_MISSING,
    "return_cached_tokens_details": Refused("cached tokens are reported in "
                                            "usage.prompt_tokens_details", (None, False)),
}

COMPLETION_FIELDS: dict[str, object] = {
    **_OPENAI_COMMON,
    **dict.fromkeys(("prompt", "echo", "json_schema"), USE),
    "best_of": Refused("best_of is not supported (use n)", (None, 1)),
    "suffix": Refused("suffix (insertion) is not supported", (None, "")),
}

CHAT_FIELDS: dict[str, object] = {
    **_OPENAI_COMMON,
    **dict.fromkeys(("messages", "top_logprobs", "continue_final_message", "chat_template_kwargs",
                     "input_ids"), USE),
    # reasoning output is split only by a reasoning parser, which this server does not have
    **dict.fromkeys(("separate_reasoning", "stream_reasoning", "parallel_tool_calls",
                     "return_flat_raw_top_logprobs_b64"), IGNORE),
    "tools": Refused("tool calling is not supported", (None, [])),
    "tool_choice": Refused("tool calling is not supported", (None, "none", "auto")),
    "task": Refused("quick-instruction tasks are not supported"),
    **_refused("meta_info and ids in sglext are not returned", "return_meta_info",
               "return_input_ids_in_sglext", "return_output_ids_in_sglext", off=(None, False)),
}


def check_fields(body: dict, table: dict[str, object], route: str) -> None:
    """Raise ValueError for a field the route does not know or a refused field that is on."""
    unknown = sorted(set(body) - set(table))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} in {route} request")
    for name, value in body.items():
        policy = table[name]
        if isinstance(policy, Refused) and value not in policy.off:
            raise ValueError(f"{name}={value!r} is not supported: {policy.reason}")

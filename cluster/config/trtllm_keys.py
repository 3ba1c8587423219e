"""What each key of TensorRT-LLM's disagg YAML means here: translated,
ignored (with the reason listed at startup) or refused (with what to do).

`cluster.config.trtllm` walks a file with these tables; the README's key
table says the same for users.
"""

from __future__ import annotations

# router.type -> ours (one policy serves both pools here)
ROUTER_TYPES = {
    "round_robin": "round_robin",
    "load_balancing": "least_loaded",
    "kv_cache_aware": "prefix_aware",
    # A conversation's next turn starts with its whole history, so the worker
    # holding that prefix is the one prefix_aware picks (`CONVERSATION_NOTE`).
    "conversation": "prefix_aware",
}
CONVERSATION_NOTE = (
    "runs as prefix_aware: a conversation's next turn starts with its history, so it goes "
    "to the worker that can skip the most of it (for a hybrid model: up to the Mamba "
    "snapshot kept at the end of the last turn)"
)

# backend (any case) -> (our backend, our wire or None, why it differs or None).
# TensorRT-LLM's DEFAULT is NIXL unless an environment variable picks another;
# here it is our `auto` rule (the model's preference, else NIXL when it
# imports, else Python). UCX is the Python transceiver's protocol over UCX;
# PYTHON (not a TensorRT-LLM value) names our Python transceiver.
_OVER_TCP = "is not available here; the Python transceiver (TCP) moves the cache"
BACKENDS: dict[str, tuple[str, str | None, str | None]] = {
    "DEFAULT": ("auto", None, None),
    "NIXL": ("nixl", None, None),
    "UCX": ("python", "ucx", None),
    "PYTHON": ("python", None, None),
    "MPI": ("python", None, f"MPI {_OVER_TCP}"),
    "MOONCAKE": ("python", None, f"Mooncake {_OVER_TCP}"),
    "V2": (
        "auto",
        None,
        "TensorRT-LLM's V2 transceiver is its own; the auto rule picks ours (the model's "
        "preference, else NIXL when it imports)",
    ),
}

_ONE_INSTANCE = "the launcher starts one HTTP server in front of the cluster"
_TOKEN_IDS = "the server tokenizes once and hands token ids to the workers"
SERVER_IGNORED = {
    "max_retries": "the router retries a request on another worker by itself before its first token",
    "perf_metrics_max_requests": "metrics are always served at /metrics",
    "otlp_config": "no OpenTelemetry export; metrics are served at /metrics",
    "disagg_cluster": "this launcher starts its own workers; there is no cluster storage to join",
    "node_id": _ONE_INSTANCE,
    "num_workers": _ONE_INSTANCE,
    "disagg_coordinator_url": _ONE_INSTANCE,
    "schedule_style": "a disaggregated request always runs its context phase first",
    "allow_request_chat_template": "chat requests use the checkpoint's chat template",
    "gen_strip_message_history": _TOKEN_IDS,
    "gen_tokids_ctxbytes": _TOKEN_IDS,
}

_WHOLE_MODEL = "no attention or expert parallelism: each instance holds the whole model"
_GPU_KERNELS = (
    "TensorRT-LLM's MoE kernel and load-balancer choices; the engine has one MoE path per device"
)
_NO_BOUNCE = "there is no bounce buffer: blocks move straight between the caches"
_OUR_SAMPLER = "every worker samples with this project's own torch sampler (engine/sampling.py)"
_MODEL_LEN = "a request's length is bounded by max_position_embeddings or the cache size"
WORKER_IGNORED = {
    "backend": "the workers run this project's own PyTorch models; there is no engine to choose",
    "disable_overlap_scheduler": "the engine has no overlap scheduler to switch off",
    "cuda_graph_config": "TensorRT-LLM's CUDA graph settings do not apply to this engine",
    "enable_autotuner": "there is no kernel autotuner here",
    "print_iter_log": "there is no per-iteration log; /metrics reports the steps",
    "enable_chunked_prefill": "prefill is always chunked by max_num_tokens",
    "trust_remote_code": "models come from this project's registry; no checkpoint code runs",
    "max_seq_len": _MODEL_LEN,
    "max_input_len": _MODEL_LEN,
    "max_beam_width": "decoding is greedy or sampled, one sequence per request",
    "enable_attention_dp": _WHOLE_MODEL,
    "moe_expert_parallel_size": _WHOLE_MODEL,
    "moe_tensor_parallel_size": _WHOLE_MODEL,
    "scheduler_config": "the engine schedules by token budget and preempts by recompute",
    "stream_interval": "each engine step's tokens are streamed as the step ends",
    "return_perf_metrics": "metrics are always served at /metrics",
    "enable_iter_perf_stats": "there is no per-iteration log; /metrics reports the steps",
    "use_cuda_graph": "TensorRT-LLM's CUDA graph settings do not apply to this engine",
    "moe_config": _GPU_KERNELS,
    "moe_backend": _GPU_KERNELS,
    "allreduce_strategy": "tensor-parallel all-reduce runs over the instance's process group "
    "(gloo on CPU, NCCL on GPU)",
    "enable_lm_head_tp_in_adp": _WHOLE_MODEL,
    "cp_config": "context parallelism is not implemented (context_parallel_size must be 1), "
    "so its settings tune nothing",
    "build_config": "TensorRT engine build settings; the workers run this project's own models",
    "pytorch_backend_config": "TensorRT-LLM's PyTorch backend settings do not apply to this engine",
    "gather_generation_logits": "responses carry OpenAI logprobs, never raw logits, so there "
    "are no logits to gather",
    "num_postprocess_workers": "detokenization runs once per request in the HTTP server",
    "use_torch_sampler": _OUR_SAMPLER,
    "sampler_type": _OUR_SAMPLER,
    "env_overrides": "worker processes inherit the environment of `disagg serve`; set the "
    "variables there",
}
SECTION_IGNORED = {
    "urls": "this launcher starts its own workers; num_instances says how many",
    "perf_metrics_max_requests": "metrics are always served at /metrics",
}

_PARTIAL = (
    "a dense model reuses whole blocks; a hybrid one also the partial block a sequence's "
    "end snapshot lies in, always copied, whatever this key says"
)
_NO_OFFLOAD = "there is no host-memory offload tier"
_OUR_MANAGER = "the cache manager is kv_cache.manager here (auto picks by model)"
KV_IGNORED = {
    "event_buffer_max_size": "KV events always reach the router (prefix_aware polls them)",
    "enable_partial_reuse": _PARTIAL,
    "copy_on_partial_reuse": _PARTIAL,
    "dtype": "the cache holds the model's dtype",
    "mamba_ssm_cache_dtype": "Mamba SSM state is always float32 here",
    "host_cache_size": _NO_OFFLOAD,
    "onboard_blocks": _NO_OFFLOAD,
    "secondary_offload_min_priority": _NO_OFFLOAD,
    "use_uvm": "the cache is plain device (or, on CPU, host) memory",
    "attention_dp_events_gather_period_ms": _WHOLE_MODEL,
    "cross_kv_cache_fraction": "only encoder-decoder models use it",
    "use_kv_cache_manager_v2": _OUR_MANAGER,
    "max_util_for_resume": _OUR_MANAGER,
}
TRANSCEIVER_IGNORED = {
    "transceiver_runtime": "the backend alone picks the transceiver implementation here",
    "max_tokens_in_buffer": "there is no staging buffer: blocks move straight between the caches",
    "kv_cache_bounce_size_mb": _NO_BOUNCE,
    "agent_bounce_buffer_enable": _NO_BOUNCE,
    "agent_bounce_params": _NO_BOUNCE,
    "kv_transfer_sender_future_timeout_ms": "kv_transfer_timeout_ms bounds the whole transfer",
}
ROUTER_IGNORED = {
    "use_tokens": "least_loaded always balances by tokens in flight",
    "model_path": "the router hashes prompts with the served model's tokenizer",
    "tokens_per_block": "the router takes the block size from kv_cache_config.tokens_per_block",
    "max_batch_size": "routing does not depend on it",
    "max_num_tokens": "routing does not depend on it",
    "track_routed_blocks": "prefix_aware learns which blocks each worker holds from its KV events",
}

_NOT_HERE = "is not supported here; remove it"
# Structured output runs on xgrammar, always on: the one backend name accepted.
GUIDED_BACKEND = "xgrammar"
GUIDED_BACKEND_SERVED = (
    "structured output (response_format, structured_outputs, guided_*, tools) is always "
    "served, with xgrammar"
)

WORKER_REFUSED = {
    "lora_config": f"LoRA {_NOT_HERE}",
    "enable_lora": f"LoRA {_NOT_HERE}",
}
KV_REFUSED = {
    "max_attention_window": f"a sliding attention window {_NOT_HERE}",
    "sink_token_length": f"attention sink tokens {_NOT_HERE}",
    "max_gpu_total_bytes": "a cache budget in bytes is not supported here; "
    "use kv_cache_config.max_tokens or free_gpu_memory_fraction",
}
# speculative_config with decoding_type NGram -> our speculative_config (method
# ngram). TensorRT-LLM looks up n-grams from max_matching_ngram_size down to
# 1, so prompt_lookup_min is 1.
NGRAM_KEYS = {
    "max_draft_len": "num_speculative_tokens",
    "max_matching_ngram_size": "prompt_lookup_max",
}
NGRAM_MATCH_DEFAULT = 2  # TensorRT-LLM's max_matching_ngram_size when unset
_NO_POOL = "drafts follow the latest earlier match of the sequence's own last n tokens"
_PER_REQUEST = (
    "each request's draft length follows its own acceptance here, growing after a fully "
    "accepted verify and pausing after repeated misses (engine.speculation.drafts)"
)
_EXACT = (
    "a verify step keeps plain decoding's output for greedy and sampled requests alike: "
    "drafts count while they equal the tokens it samples (engine.speculation.verify)"
)
_NO_DRAFT_MODEL = "n-gram drafting uses no draft model"
NGRAM_IGNORED = {
    "is_keep_all": f"{_NO_POOL}: there is no pool of matches to keep",
    "is_use_oldest": f"{_NO_POOL} (TensorRT-LLM's default is the oldest)",
    "is_public_pool": "each request drafts from its own tokens only (TensorRT-LLM's default "
    "pool is shared by all requests)",
    "max_total_draft_tokens": "n-gram drafts are one chain of max_draft_len tokens "
    "(TensorRT-LLM sets it so for NGram too)",
    "max_concurrency": _PER_REQUEST,
    "draft_len_schedule": _PER_REQUEST,
    "acceptance_window": _PER_REQUEST,
    "acceptance_length_threshold": _PER_REQUEST,
    "use_rejection_sampling": _EXACT,
    "allow_advanced_sampling": _EXACT,
    "speculative_model": _NO_DRAFT_MODEL,
    "speculative_model_dir": _NO_DRAFT_MODEL,
    "load_format": _NO_DRAFT_MODEL,
}
# speculative_config with decoding_type MTP -> our speculative_config (method
# mtp). In TensorRT-LLM num_nextn_predict_layers is the drafts a step (its
# validator sets max_draft_len to it); a one-layer checkpoint's MTP module
# runs once per draft (its MTP-Eagle mode), as drafts chain here.
MTP_KEYS = {"num_nextn_predict_layers": "num_speculative_tokens"}
MTP_DRAFTS_DEFAULT = 1  # TensorRT-LLM's num_nextn_predict_layers when unset
_RELAXED_ONLY = "only relaxed acceptance reads it (use_relaxed_acceptance_for_thinking), off here"
_MTP_EVERY_STEP = (
    "MTP drafts every step here: its layers run after every forward anyway, and each "
    "request verifies what they drafted (engine.speculation.drafts)"
)
_MTP_NO_DRAFT_MODEL = "MTP drafts with the checkpoint's own MTP layers, no draft model"
MTP_IGNORED = {
    "relaxed_topk": _RELAXED_ONLY,
    "relaxed_delta": _RELAXED_ONLY,
    "begin_thinking_phase_token": _RELAXED_ONLY,
    "end_thinking_phase_token": _RELAXED_ONLY,
    "max_total_draft_tokens": "MTP drafts are one chain of num_nextn_predict_layers tokens "
    "(TensorRT-LLM sets it so for MTP too)",
    "max_concurrency": _MTP_EVERY_STEP,
    "draft_len_schedule": _MTP_EVERY_STEP,
    "acceptance_window": _MTP_EVERY_STEP,
    "acceptance_length_threshold": _MTP_EVERY_STEP,
    "use_rejection_sampling": _EXACT,
    "allow_advanced_sampling": _EXACT,
    "speculative_model": _MTP_NO_DRAFT_MODEL,
    "speculative_model_dir": _MTP_NO_DRAFT_MODEL,
    "load_format": _MTP_NO_DRAFT_MODEL,
}
# MTP keys whose TensorRT-LLM default is what runs here -> (that default,
# why another value is refused). At the default they are ignored.
MTP_DEFAULT_ONLY: dict[str, tuple[object, str]] = {
    "use_relaxed_acceptance_for_thinking": (
        False,
        "relaxed acceptance would keep drafts that differ from the token a step samples; "
        "here a draft counts only while it equals it, so output is the same as without "
        "speculation: remove the key or set it false",
    ),
    "use_mtp_vanilla": (
        False,
        "vanilla MTP (one MTP module per draft) is not implemented: drafts chain the "
        "checkpoint's MTP module, each fed the one before (TensorRT-LLM's MTP-Eagle): "
        "remove the key or set it false",
    ),
    "mtp_eagle_one_model": (
        True,
        "two-model MTP is not implemented: the MTP layers run inside the target model's "
        "step (TensorRT-LLM's one-model form): remove the key or set it true",
    ),
}
# Context workers sample only a request's first token; n-gram drafting runs
# where decoding does (an MTP block on context_servers is translated: context
# workers run the MTP layers too).
CONTEXT_SPECULATION = (
    "context workers sample only a request's first token; n-gram drafting runs on the "
    "generation workers (set speculative_config there or at the top level)"
)
_AVAILABLE_TYPES = (
    "use decoding_type: NGram (prompt lookup, no draft model) or MTP (the checkpoint's "
    "own MTP layers), or remove speculative_config"
)
# decoding_type (any case) -> what it is, for the refusal.
DECODING_TYPES_REFUSED = {
    "eagle": "EAGLE draft heads are not available here",
    "eagle3": "EAGLE-3 draft heads are not available here",
    "medusa": "Medusa heads are not available here",
    "lookahead": "lookahead decoding is not available here",
    "draft_target": "a separate draft model is not available here",
    "drafttarget": "a separate draft model is not available here",
    "user_provided": "a user-provided drafter is not available here",
    "userprovided": "a user-provided drafter is not available here",
    "auto": "TensorRT-LLM's automatic choice is not available here",
    "sa": "suffix automaton drafting is not available here",
    "pard": "PARD parallel drafting is not available here",
    "dflash": "DFlash drafting is not available here",
}


def refused_decoding_type(decoding_type: object) -> str:
    """What to change for a speculative_config.decoding_type other than NGram or MTP."""
    what = DECODING_TYPES_REFUSED.get(str(decoding_type).lower())
    if what is None:
        return f"{decoding_type!r} is not a decoding type; {_AVAILABLE_TYPES}"
    return f"{decoding_type}: {what}; {_AVAILABLE_TYPES}"


# Must be 1: these split one instance over devices in ways not implemented here.
ONE_ONLY = {"pipeline_parallel_size": "pipeline", "context_parallel_size": "context"}

KV_KEYS = {
    "enable_block_reuse",
    "max_tokens",
    "tokens_per_block",
    "free_gpu_memory_fraction",
    "mamba_state_config",
}
# kv_cache_config.mamba_state_config -> kv_cache.snapshots
MAMBA_STATE_KEYS = {
    "periodic_snapshot_interval": "interval",
    "additional_snapshot_offsets_from_start": "positions",
    "enable_branch_snapshot": "on_demand",
}
MAMBA_STATE_REFUSED = {
    "additional_snapshot_offsets_from_end": "snapshots at offsets from a prompt's end are not "
    "taken here; every sequence's end is (kv_cache.snapshots.at_end), and a shared prefix's "
    "end once it shows (on_demand); remove the key or leave it empty",
}
TOP_KEYS = {
    "kv_cache_config",
    "speculative_config",
    "cache_transceiver_config",
    "conditional_disagg_config",
    "free_gpu_memory_fraction",
    "tensor_parallel_size",
    *ONE_ONLY,
    *SERVER_IGNORED,
    *WORKER_IGNORED,
    *WORKER_REFUSED,
}
SECTION_KEYS = {
    "kv_cache_config",
    "speculative_config",
    "cache_transceiver_config",
    "free_gpu_memory_fraction",
    "router",
    "model",
    "dtype",
    *ONE_ONLY,
    *SECTION_IGNORED,
    *WORKER_IGNORED,
    *WORKER_REFUSED,
}
# Same name and meaning in both dialects: never a mix of dialects.
SHARED_KEYS = {
    "model",
    "hostname",
    "port",
    "dtype",
    "max_batch_size",
    "max_num_tokens",
    "num_instances",
    "tensor_parallel_size",
}

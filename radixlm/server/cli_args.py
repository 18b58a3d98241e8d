"""CLI flags generated from ServerArgs: one flag per field, SGLang's names (`--model-path`, ...)."""

from __future__ import annotations

import argparse
import dataclasses

from radixlm.runtime.config import ARG_ALIASES, ServerArgs
from radixlm.router.policy import POLICIES
from radixlm.server.reasoning import PARSER_NAMES as REASONING_PARSERS
from radixlm.server.tool_calls.parsers import PARSER_NAMES

_HELP = {
    "model_path": "HF folder (config.json + safetensors) or .gguf file; default: bundled SmolLM2",
    "load_format": "auto | safetensors | gguf | dummy (random weights from config.json)",
    "dtype": "auto (bfloat16) | float32 | bfloat16 | float16",
    "max_total_tokens": "KV pool capacity in tokens (default: from memory)",
    "chunked_prefill_size": "max prompt tokens computed per step (<= 0: no chunking; default: "
                            "2048 on the CPU, 4096-8192 on GPUs with 35-60+ GiB)",
    "schedule_policy": "lpm | dfs-weight | fcfs",
    "max_queued_requests": "requests beyond max_running_requests + this get 503",
    "api_key": "require 'Authorization: Bearer KEY' (or x-api-key) on every endpoint but /health",
    "admin_api_key": "the key the admin routes (/update_weights_from_disk, /start_profile, "
                     "/stop_profile, /flush_cache, /abort_request) require instead of --api-key; "
                     "with neither key set they answer only on a loopback --host",
    "update_weights_allowed_dirs": "comma-separated folders /update_weights_from_disk may load "
                                   "from (default: the served model's folder)",
    "profile_allowed_dirs": "comma-separated folders /start_profile may write traces to "
                            "(default: $SGLANG_TORCH_PROFILER_DIR, else the temp folder)",
    "tool_call_parser": "tool call format: hermes | llama3 | mistral (default: detected from the "
                        "chat template, hermes when it says nothing)",
    "served_model_name": "the model's name in /v1/models and responses (default: the path's "
                         "last part)",
    "chat_template": "a Jinja file or inline template (default: the model's own)",
    "stream_interval": "streams send an update every this many tokens (a request's "
                       "sampling_params.stream_interval wins)",
    "incremental_streaming_output": "/generate streams send text and output_ids as deltas "
                                    "instead of cumulative",
    "log_requests": "log every request's input and output (at INFO, whatever --log-level)",
    "enable_cache_report": "report cached prompt tokens in OpenAI usage "
                           "(prompt_tokens_details.cached_tokens)",
    "reasoning_parser": "split <think> reasoning into reasoning_content (chat API): "
                        + " | ".join(REASONING_PARSERS),
    "max_stored_responses": "responses /v1/responses keeps for GET /v1/responses/{id} and "
                            "previous_response_id (with the token ids a continuation reuses); "
                            "least recently used out first, 0 keeps none",
    "metrics_names": "/metrics names: sglang (SGLang's names and model_name label, for "
                     "SGLang's dashboards) | radixlm (the names before, radixlm:*, unlabelled)",
    "embedding_pooling": "/v1/embeddings and /encode: last (token) | mean, L2-normalized",
    "cpu_fp32_gemm": "bf16/fp16 on a CPU: run linear layers as fp32 GEMMs on fp32 copies of the "
                     "weights (same values, same fp32 accumulation; 2x weight memory). auto: on "
                     "where the CPU lacks bf16 matmul (no avx512_bf16 / amx_bf16); env "
                     "RADIXLM_CPU_FP32_GEMM overrides",
    "dp_size": "data parallelism: this many replicas (each dp-rank on its own tp_size GPUs), "
               "a cache-aware router on --host/--port (radixlm/router)",
    "load_balance_method": "how the --dp-size router picks a replica: " + " | ".join(POLICIES),
    "base_gpu_id": "the first GPU to use (replica i: base_gpu_id + i * tp_size ...)",
    "enable_two_batch_overlap": "TP extends of >= 2048 tokens: each layer's all-reduces run "
                                "beside the other half of the tokens' compute (Llama-family "
                                "models; no gain measured on 2 x H200, see docs/parallelism.md)",
    "gguf_keep_quantized": "GGUF on a CPU: keep Q4_1 / Q8_0 / Q4_K / Q6_K linear weights "
                           "quantized and multiply by their blocks (C++ kernel; fewer bytes per "
                           "decode step) "
                           "instead of dequantizing at load. auto: on where the AVX2 kernel "
                           "builds; never on CUDA; env RADIXLM_GGUF_KEEP_QUANTIZED overrides",
    "enable_hierarchical_cache": "keep KV that leaves the device pool in a host-memory pool "
                                 "(L2) and, with --hicache-storage-backend, in a store (L3); "
                                 "cached prefixes load back instead of being recomputed",
    "hicache_ratio": "host pool size / device pool size in tokens (must come out > 1)",
    "hicache_size": "host pool size in GB; > 0 overrides --hicache-ratio",
    "hicache_write_policy": "when device KV is copied to the host: write_through (at insert), "
                            "write_through_selective (on a node's second hit), write_back (at "
                            "eviction)",
    "hicache_storage_backend": "L3 store for KV pages: file (survives restarts)",
    "hicache_storage_prefetch_policy": "a waiting request's pages are read from the store into "
                                       "the host pool off the scheduler's thread; at admission "
                                       "best_effort takes what has landed, wait_complete waits "
                                       "for all, timeout (default) waits until a deadline "
                                       "(prefetch_timeout_base + prefetch_timeout_per_ki_token "
                                       "x tokens / 1024) and never while recomputing is faster",
    "hicache_storage_backend_extra_config": "JSON for the store: {\"file_storage_path\": DIR, "
                                            "\"page_tokens\": 64}; DIR defaults to "
                                            "$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, then "
                                            "/tmp/hicache",
    "fp8_linear": "FP8 (e4m3) checkpoints: scaled_mm keeps the projections' weights in FP8 and "
                  "multiplies with torch._scaled_mm (half the weight memory), dequant "
                  "dequantizes them at load. auto: scaled_mm on CUDA SM89+ without TP, else "
                  "dequant; env RADIXLM_FP8_LINEAR overrides",
    "int4_linear": "int4 weight-only checkpoints (AWQ, GPTQ, compressed-tensors W4A16): triton "
                   "keeps the projections' weights packed int4 and multiplies with Triton "
                   "kernels (torch: torch's _weight_int4pack_mm instead, bf16), dequant "
                   "dequantizes them at load. auto: triton on CUDA without TP, "
                   "else dequant; env RADIXLM_INT4_LINEAR overrides",
    "speculative_algorithm": "speculative decoding: NGRAM (drafts from the request's own text "
                             "and from finished requests' text), STANDALONE (a draft model: "
                             "--speculative-draft-model-path), EAGLE3 (an EAGLE-3 head: "
                             "--speculative-draft-model-path, chains only)",
    "speculative_draft_model_path": "STANDALONE: the draft model, a smaller model with the "
                                    "target's tokenizer and vocabulary; EAGLE3: the head "
                                    "(LlamaForCausalLMEagle3 config.json + safetensors)",
    "speculative_num_draft_tokens": "tokens one verify computes per request (the last token + "
                                    "up to this - 1 drafts; default 8, STANDALONE 4)",
    "speculative_num_steps": "draft chain depth (default: num_draft_tokens - 1)",
    "speculative_eagle_topk": "draft tree branching (EAGLE3; 1: a chain)",
    "speculative_adaptive": "choose each step's draft lengths from recent acceptance and the "
                            "batch's measured step cost (--no-speculative-adaptive: always the "
                            "longest draft found)",
    "speculative_ngram_capacity": "n-grams kept from finished requests' text for drafting",
    "disaggregation_mode": "prefill | decode | null (colocated, the default): a prefill server "
                           "computes prompts' KV and sends it to a decode server, which "
                           "generates; requests come through `radixlm router "
                           "--pd-disaggregation` (docs/parallelism.md)",
    "disaggregation_transfer_backend": "how KV moves: gloo (host memory, any device) | nccl "
                                       "(CUDA)",
    "disaggregation_bootstrap_port": "prefill: the port of its handshake store (--host)",
    "disaggregation_timeout": "seconds a request's KV hand-off may take (handshake, queueing "
                              "on the prefill server, transfer); past it the request fails",
}


_CHOICES = {"tool_call_parser": PARSER_NAMES, "reasoning_parser": REASONING_PARSERS,
            "fp8_linear": ("auto", "scaled_mm", "dequant"),
            "int4_linear": ("auto", "triton", "torch", "dequant"),
            "embedding_pooling": ("last", "mean"), "metrics_names": ("sglang", "radixlm"),
            "cpu_fp32_gemm": ("auto", "on", "off"),
            "gguf_keep_quantized": ("auto", "on", "off"), "load_balance_method": POLICIES,
            "hicache_write_policy": ("write_through", "write_through_selective", "write_back"),
            "hicache_storage_backend": ("file",),
            "hicache_storage_prefetch_policy": ("best_effort", "wait_complete", "timeout"),
            "speculative_algorithm": ("NGRAM", "STANDALONE", "EAGLE3", "EAGLE")}


def _kind(field: dataclasses.Field):
    ann = str(field.type)
    for name, typ in (("bool", bool), ("int", int), ("float", float)):
        if name in ann:
            return typ
    return str


def add_server_args(parser: argparse.ArgumentParser) -> None:
    aliases = {name: alias for alias, name in ARG_ALIASES.items()}
    for f in dataclasses.fields(ServerArgs):
        flags = ["--" + f.name.replace("_", "-")]
        if f.name in aliases:
            flags.append("--" + aliases[f.name].replace("_", "-"))
        kind = _kind(f)
        if kind is bool and f.default is True:  # on by default: --no-<flag> turns it off
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=True,
                                help=_HELP.get(f.name))
        elif kind is bool:
            parser.add_argument(*flags, action="store_true", default=f.default, help=_HELP.get(f.name))
        else:
            parser.add_argument(*flags, type=kind, default=f.default, choices=_CHOICES.get(f.name),
                                help=_HELP.get(f.name, f"default: {f.default}"))


def parse_server_args(argv=None) -> ServerArgs:
    parser = argparse.ArgumentParser(prog="radixlm serve", description="Serve a model over HTTP.")
    add_server_args(parser)
    ns = parser.parse_args(argv)
    return ServerArgs(**vars(ns))

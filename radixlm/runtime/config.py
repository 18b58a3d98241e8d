"""Frozen configuration objects: the model's architecture and the runtime's arguments.

`ModelConfig` is the only view of a model's architecture the runtime uses; it is built from a HF
`config.json` dict (`from_hf`) or from GGUF metadata (the loader converts that to the same dict).
`ServerArgs` holds every runtime knob, one field per CLI flag (SGLang's flag names).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    rope_scaling: Optional[dict] = None  # llama3-style scaling dict, as in HF configs
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    # the whole HF config dict: architecture files read their own fields from it (q/k norms,
    # sliding windows, soft-capping, experts) instead of this class growing one field per model
    hf: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a HF config dict (config.json contents or `PretrainedConfig.to_dict()`)."""
        archs = cfg.get("architectures") or [cfg.get("model_type", "llama")]
        text = cfg.get("text_config")
        if isinstance(text, dict) and "num_attention_heads" not in cfg:
            # vision-language (LLaVA): the language model's shape; `hf` keeps the whole dict
            inner = ModelConfig.from_hf({**text, "architectures": archs})
            return dataclasses.replace(inner, hf=dict(cfg))
        arch = archs[0]
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # transformers 5 keeps rope theta only inside `rope_parameters`
        rope_params = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope_params.get("rope_type", "default") not in ("default", None):
            scaling = dict(rope_params)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("default", None):
            scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        model_type = cfg.get("model_type", "")
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2" or "Qwen2" in arch)),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hf=dict(cfg),
        )


@dataclass(frozen=True)
class ServerArgs:
    """Runtime arguments. Field names are SGLang's flag names with '-' -> '_'."""

    model_path: Optional[str] = None  # None: the bundled SmolLM2-135M-Instruct GGUF
    tokenizer_path: Optional[str] = None
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    context_length: Optional[int] = None
    max_total_tokens: Optional[int] = None  # KV pool capacity in tokens; None: from mem fraction
    mem_fraction_static: float = 0.85  # of GPU memory for weights + KV (CPU: a fixed budget)
    max_running_requests: int = 256
    # <= 0 disables chunking; None: by device (see resolve_chunked_prefill_size)
    chunked_prefill_size: Optional[int] = None
    max_prefill_tokens: int = 8192
    schedule_policy: str = "lpm"  # lpm | dfs-weight | fcfs
    schedule_conservativeness: float = 1.0
    disable_radix_cache: bool = False
    # --- hierarchical cache (mem_cache/hicache_config.py): device KV <- host pool <- storage ---
    enable_hierarchical_cache: bool = False  # alias --enable-hicache
    hicache_ratio: float = 2.0  # host pool tokens / device pool tokens (must come out > 1)
    hicache_size: float = 0.0  # host pool in GB; > 0 overrides hicache_ratio
    hicache_write_policy: str = "write_through"  # write_through | write_through_selective | write_back
    hicache_storage_backend: Optional[str] = None  # file
    # when a request waits for its pages from the store: timeout | best_effort | wait_complete
    hicache_storage_prefetch_policy: str = "timeout"
    hicache_storage_backend_extra_config: Optional[str] = None  # JSON: {"file_storage_path": DIR}
    disable_jump_forward: bool = False  # constrained decoding: decode forced text token by token
    # by default a step that admits new requests also decodes the running ones in the same forward
    disable_mixed_batch: bool = False
    # CUDA: the CPU completes step N while the GPU runs step N+1 (scheduler/overlap.py)
    disable_overlap_schedule: bool = False
    disable_cuda_graph: bool = False  # CUDA: decode launched op by op instead of graph replay
    cuda_graph_max_bs: int = 160  # largest decode batch captured in a graph; larger ones run eagerly
    # CUDA: extends replay the layer stack's pieces between attentions as graphs captured per
    # padded token count (executor/piecewise_graph.py); larger extends run eagerly
    disable_piecewise_cuda_graph: bool = False
    piecewise_cuda_graph_max_tokens: int = 2048
    # decode reads a prefix shared by running requests once per group (attention/shared_prefix.py)
    # where the attention backend supports it (triton, cpu)
    disable_shared_prefix_attention: bool = False
    attention_backend: str = "auto"  # auto | torch_native | triton (CUDA) | cpu (C++ kernels)
    # CPU, bf16/fp16 model: linear layers as fp32 GEMMs on fp32 copies of the weights (auto: on when
    # the CPU lacks avx512_bf16/amx_bf16; env RADIXLM_CPU_FP32_GEMM wins; layers/cpu_linear.py)
    cpu_fp32_gemm: str = "auto"  # auto | on | off
    # GGUF on a CPU: linear layers multiply by the file's Q4_1 / Q8_0 / Q4_K / Q6_K blocks instead
    # of weights dequantized at load (auto: on with the AVX2 kernel; env
    # RADIXLM_GGUF_KEEP_QUANTIZED wins; layers/quantized_linear.py)
    gguf_keep_quantized: str = "auto"  # auto | on | off
    # FP8 checkpoints (quantization_config fp8 / compressed-tensors): scaled_mm keeps the decoder
    # projections e4m3 and multiplies them with torch._scaled_mm, dequant dequantizes them at load
    # (auto: scaled_mm on CUDA SM89+ with tp_size 1, else dequant; env RADIXLM_FP8_LINEAR wins;
    # models/fp8_checkpoint.py, layers/fp8_linear.py)
    fp8_linear: str = "auto"  # auto | scaled_mm | dequant
    # int4 weight-only checkpoints (quantization_config awq / gptq / compressed-tensors
    # pack-quantized): triton keeps the decoder projections packed int4 and multiplies them with
    # Triton kernels (torch: with torch's _weight_int4pack_mm, bf16), dequant dequantizes them at
    # load (auto: triton on CUDA with tp_size 1, else dequant; env RADIXLM_INT4_LINEAR wins;
    # models/int4_checkpoint.py, layers/int4_linear.py)
    int4_linear: str = "auto"  # auto | triton | torch | dequant
    # --- tensor parallelism (runtime/distributed): one process per rank, rank 0 schedules ---
    tp_size: int = 1
    # CUDA, one node: small TP all-reduces through symmetric memory instead of NCCL
    # (distributed/custom_all_reduce.py). Off by default: 2x faster per call in isolation on
    # 2 x H200 (8.4-8.6 vs 17.8 us at 8 KB) yet batch-1 decode ran 0.93-0.965x of NCCL's end to
    # end; --no-disable-custom-all-reduce turns it on
    disable_custom_all_reduce: bool = True
    # TP extends of >= 2048 tokens: each layer's all-reduces overlap the other half of the
    # tokens' compute (models/two_batch_overlap.py; Llama-family models)
    enable_two_batch_overlap: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: Optional[str] = None  # host:port of rank 0's TCP store; None: a free local port
    # --- data parallelism (radixlm/router): dp_size replicas behind a router on --host/--port ---
    dp_size: int = 1  # > 1: replicas on internal ports, each on its own tp_size GPUs
    load_balance_method: str = "cache_aware"  # cache_aware | round_robin | shortest_queue | ...
    base_gpu_id: int = 0  # the first GPU used; replica i uses base_gpu_id + i * tp_size ...
    # --- prefill/decode disaggregation (runtime/distributed/pd_transfer.py, scheduler/pd.py):
    # None: colocated. A prefill server computes prompts' KV and sends it to the decode server
    # the router names (`radixlm router --pd-disaggregation`); the decode server generates
    disaggregation_mode: Optional[str] = None  # None | prefill | decode
    disaggregation_transfer_backend: str = "gloo"  # gloo (any device, host staging) | nccl
    disaggregation_bootstrap_port: int = 8998  # prefill: the handshake store's port
    # a room (one request's KV hand-off) not complete in this many seconds fails its request
    disaggregation_timeout: float = 300.0
    chat_template: Optional[str] = None
    tool_call_parser: Optional[str] = None  # hermes | llama3 | mistral; None: from the template
    served_model_name: Optional[str] = None
    skip_tokenizer_init: bool = False
    log_level: str = "warning"
    # --- HTTP server ---
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: Optional[str] = None  # never reported by /get_server_info
    # the admin routes (server/admin_api.py ADMIN_PATHS) take this key when set, else --api-key;
    # with neither they answer only on a loopback --host. Never reported by /get_server_info
    admin_api_key: Optional[str] = None
    # comma-separated folders /update_weights_from_disk may load from (symlinks resolved);
    # None: the folder of the model served at start-up (a .gguf file's folder)
    update_weights_allowed_dirs: Optional[str] = None
    # comma-separated folders /start_profile may write traces to (output_dir); None: the default
    # trace folder ($SGLANG_TORCH_PROFILER_DIR, else the system's temp folder)
    profile_allowed_dirs: Optional[str] = None
    max_queued_requests: Optional[int] = None  # beyond max_running_requests + this: 503
    max_payload_size: int = 32 * 1024 * 1024  # bytes of request body; larger: 413
    # --- bounds on one request (runtime/request_limits.py): over one -> 400 naming the field ---
    max_n: int = 128  # sampling_params.n
    max_stop_strings: int = 32  # entries of stop, and of stop_regex
    max_stop_str_len: int = 1024  # bytes of one stop string
    max_stop_regex_len: int = 256  # bytes of one stop_regex pattern
    # seconds one stop_regex search may take (wall clock: at 0.05 a busy 2-core machine aborted
    # a plain search when the scheduler thread lost the CPU mid-search); over: abort
    stop_regex_timeout: float = 0.5
    max_top_logprobs_num: int = 64
    max_token_ids_logprob: int = 1024
    # (prompt + max_new_tokens) * n, summed over a call; None: 1 << 20 over HTTP, no bound for
    # an in-process Engine's calls (request_limits.SERVER_REQUEST_TOKENS)
    max_request_tokens: Optional[int] = None
    max_images_per_request: int = 16
    max_image_pixels: int = 4096 * 4096  # width x height of one image (from its header)
    # constrained decoding: a grammar not compiled in this many seconds aborts its request
    grammar_compile_timeout: float = 30.0
    grammar_cache_size: int = 256  # compiled grammars kept (least recently used out)
    enable_metrics: bool = False
    # the scheduler process (server/loop_stats.py): log garbage collections longer than this
    # (0: never); and gc.freeze() once start-up is done (the server's scheduler process, or an
    # Engine's process)
    gc_warning_threshold_secs: float = 0.0
    enable_gc_freeze: bool = False
    timeout_graceful_shutdown: float = 30.0  # SIGTERM: seconds to let running requests finish
    # --- SGLang drop-in (server API) ---
    stream_interval: int = 1  # a stream sends an update every this many tokens
    incremental_streaming_output: bool = False  # /generate streams text and ids as deltas
    log_requests: bool = False  # log every request's input and output
    enable_cache_report: bool = False  # OpenAI usage carries prompt_tokens_details.cached_tokens
    reasoning_parser: Optional[str] = None  # deepseek-r1 | qwen3 | ...: split <think> output
    embedding_pooling: str = "last"  # /v1/embeddings and /encode: last | mean (L2-normalized)
    # /v1/responses kept for GET and previous_response_id (least recently used out; 0: none)
    max_stored_responses: int = 1024
    # /metrics names: sglang (SGLang's names and model_name label) | radixlm (the former names)
    metrics_names: str = "sglang"
    # --- speculative decoding (runtime/speculative): SGLang's flags ---
    speculative_algorithm: Optional[str] = None  # NGRAM | STANDALONE | EAGLE3
    # chain depth (draft tokens per verify, top-k 1) or a tree's levels; None: num_draft_tokens - 1
    speculative_num_steps: Optional[int] = None
    # tokens one verify forward computes per request: the last token + the drafts (SGLang's
    # meaning: with top-k 1 it is num_steps + 1); None: 8 (STANDALONE, EAGLE3: 4)
    speculative_num_draft_tokens: Optional[int] = None
    speculative_eagle_topk: Optional[int] = None  # a draft tree's branching (EAGLE3); 1: a chain
    speculative_draft_model_path: Optional[str] = None  # STANDALONE's draft / EAGLE3's head
    # choose each step's draft lengths from acceptance and the batch's cost (0: plain decode)
    speculative_adaptive: bool = True
    speculative_ngram_min_match_window_size: int = 1  # shortest suffix n-gram looked up
    speculative_ngram_max_match_window_size: int = 6  # longest suffix n-gram looked up
    # n-grams of finished requests' text (what entered the radix tree) that drafts may come from
    speculative_ngram_capacity: int = 65536

    def replace(self, **kw) -> "ServerArgs":
        return dataclasses.replace(self, **kw)

    @staticmethod
    def from_kwargs(**kwargs) -> "ServerArgs":
        for alias, name in ARG_ALIASES.items():
            if alias in kwargs:
                if name in kwargs:
                    raise TypeError(f"{alias} and {name} are the same argument: give one")
                kwargs[name] = kwargs.pop(alias)
        names = {f.name for f in dataclasses.fields(ServerArgs)}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unknown server argument(s): {sorted(unknown)}")
        return ServerArgs(**kwargs)


# SGLang's other spellings (Engine keywords; the CLI takes them as --flag aliases)
ARG_ALIASES = {"enable_hicache": "enable_hierarchical_cache"}


def resolve_chunked_prefill_size(value: Optional[int], device) -> int:
    """The prompt tokens one step may compute when --chunked-prefill-size is not given: 2048 on
    the CPU; on CUDA larger for larger GPUs (bigger GEMMs, fewer steps), as SGLang also does.
    H100 80 GB, 128 x (512 in, 128 out), Llama-3.1-8B shape: chunks of 2048 -> 4682 output tok/s,
    4096 -> 5331, 8192 -> 5540 (benchmarks/gpu_suite.py, 2026-11-23)."""
    if value is not None:
        return int(value)
    if getattr(device, "type", device) != "cuda":
        return 2048
    import torch

    total_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    return 8192 if total_gib >= 60 else 4096 if total_gib >= 35 else 2048

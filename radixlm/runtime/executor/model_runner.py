"""ModelRunner: owns the model, its KV memory and the attention backend; runs one forward per batch.

It decides the device, dtype and KV capacity, loads weights (HF safetensors, GGUF or dummy), and
exposes `forward(fb) -> logits (N, vocab) float32` for the rows `fb.logits_indices`.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Optional

import torch

from radixlm.runtime.attention.base import AttentionSpec
from radixlm.runtime.attention.mla_backend import check_mla_args
from radixlm.runtime.attention.registry import (create_attention_backend, create_mla_backend,
                                                resolve_backend_name, resolve_mla_backend_name)
from radixlm.runtime.config import ModelConfig, ServerArgs
from radixlm.runtime.distributed import batch_sync, parallel_state, sharding
from radixlm.runtime.executor import cpu_malloc, pack_cache
from radixlm.runtime.executor.cuda_graph import CudaGraphRunner
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.executor.piecewise_graph import PiecewiseGraphRunner
from radixlm.runtime.layers import cpu_linear, cpu_packed, fp8_linear, quantized_linear
from radixlm.runtime.mem_cache import kv_mover
from radixlm.runtime.mem_cache.allocator import TokenSlotAllocator
from radixlm.runtime.mem_cache.kv_pool import KVPool, MLAKVPool
from radixlm.runtime.mem_cache.req_to_token import ReqToTokenPool
from radixlm.runtime.models import (fp8_checkpoint, int4_checkpoint, llama_pieces, loader,
                                     registry, two_batch_overlap)
from radixlm.runtime.speculative import spec_config

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16}
CPU_KV_BUDGET_BYTES = 4 << 30  # default KV pool size on the CPU when no --max-total-tokens
# The last loaded model, reused by the next runner with the same (path, format, dtype, device, seed):
# weights are read-only at inference, so engines made one after another in a process (tests,
# benchmarks comparing settings) share them instead of loading again.
_MODEL_CACHE: dict = {}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)} (got {name!r})")
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, args: ServerArgs, tp: Optional[parallel_state.TPGroup] = None,
                 spare_rows: Optional[int] = None):
        """`tp`: the group this runner's model is sharded over (default: the process's, which
        init_distributed set up); a draft model on rank 0 alone passes parallel_state.SINGLE.
        `spare_rows`: req_to_token scratch rows for draft trees (default: what the args'
        speculative flags need; a draft model's runner is told its beams' share)."""
        self.args = args
        self.device = resolve_device(args.device)
        if self.device.type == "cpu":  # reuse freed activation blocks (see cpu_malloc)
            cpu_malloc.tune()
        self.dtype = resolve_dtype(args.dtype)
        self.model_path = args.model_path or loader.default_model_path()
        self.load_format = loader.resolve_load_format(self.model_path, args.load_format)
        self.hf_config = loader.load_hf_config(self.model_path, self.load_format)
        self.model_config = cfg = ModelConfig.from_hf(self.hf_config)
        self.context_len = args.context_length or cfg.max_position_embeddings
        if self.context_len > cfg.max_position_embeddings:
            # the rotary tables end there: a request reaching that position crashed the
            # scheduler mid-generation (IndexError in rotary), killing every request in flight.
            # Refused at start-up instead, as SGLang does.
            raise ValueError(f"context_length {self.context_len} is longer than the model's "
                             f"max_position_embeddings ({cfg.max_position_embeddings})")
        self.model_cls = registry.model_class(cfg, self.context_len)  # refuses what it cannot run
        # tensor parallelism: the caller (a rank's process) joined the group first
        self.tp = parallel_state.get_tp_group() if tp is None else tp
        if args.tp_size != self.tp.size:
            raise ValueError(f"tp_size={args.tp_size} but this process is rank {self.tp.rank} of "
                             f"a TP group of {self.tp.size}: call parallel_state.init_distributed "
                             "in each rank's process before building its ModelRunner")
        sharding.check_tp_supported(cfg, self.tp.size, self.model_cls.__name__)
        # KV heads this rank stores (its GQA groups' KV heads; 1, replicated, when hkv < tp)
        self.num_kv_heads = sharding.local_kv_heads(cfg, self.tp.size, self.tp.rank)
        torch.manual_seed(args.seed)

        # bf16 on a CPU without bf16 matmul: fp32 GEMMs on fp32 weight copies (layers/cpu_linear)
        self.fp32_gemm = cpu_linear.use_fp32_gemm(args.cpu_fp32_gemm, self.device, self.dtype)
        # bf16 on a CPU with bf16 matmul: oneDNN on prepacked weights (layers/cpu_packed); not
        # under TP (its sharded layers and vocab-parallel head are not packed: untested there)
        self.cpu_packed = (not self.fp32_gemm and self.tp.size == 1
                           and cpu_packed.use_packed(self.device, self.dtype))
        # GGUF on a CPU: projections and head multiply by the file's blocks (layers/quantized_linear)
        self.keep_quantized = quantized_linear.keep_quantized(
            args.gguf_keep_quantized, self.device, self.load_format, self.tp.size)
        # ... and dense weights too for many-row inputs where bf16 matmul is native (auto only)
        self.gguf_dense_rows = self.keep_quantized and quantized_linear.keep_dense_rows(
            args.gguf_keep_quantized, self.device, self.dtype)
        # the most rows a forward may take for each row's arithmetic to be what it is at one
        # row (None: any): past DIRECT_MAX_M the blocks' projections run another kernel (dense
        # rows or dequantized tiles), so a speculative verify keeps within it (worker.step)
        self.row_invariant_max = quantized_linear.DIRECT_MAX_M if self.keep_quantized else None
        # FP8 checkpoint (quantization_config): e4m3 projections through torch._scaled_mm on the
        # GPU, dequantized at load elsewhere (models/fp8_checkpoint, layers/fp8_linear)
        self.fp8 = fp8_checkpoint.plan(self.hf_config, args.fp8_linear, self.device,
                                       self.tp.size, self.load_format)
        # int4 checkpoint (AWQ / GPTQ / compressed-tensors W4A16): packed weights with Triton
        # kernels on the GPU, dequantized at load elsewhere (models/int4_checkpoint)
        self.int4 = int4_checkpoint.plan(self.hf_config, args.int4_linear, self.device,
                                         self.tp.size, self.load_format)
        # MLA (DeepSeek): the pool keeps one latent per token and layer, not K/V heads
        self.mla_dims = getattr(self.model_cls, "mla_kv_dims", lambda c: None)(cfg)
        if self.mla_dims is not None:  # refuse what needs K/V heads
            check_mla_args(args, self.fp8 is not None, self.int4 is not None)
        key = (self.model_path, self.load_format, self.dtype, str(self.device), args.seed,
               self.fp32_gemm, self.keep_quantized, self.gguf_dense_rows, self.fp8,
               self.int4, self.cpu_packed)
        # the whole (vocab, hidden) embedding where the model holds a vocabulary shard of it and
        # an EAGLE-3 head on this rank needs all of it (_load_model); None elsewhere
        self.whole_embedding: Optional[torch.Tensor] = None
        if self.tp.size > 1:  # never shared: a shard's layers hold this engine's TP group
            self.model = self._load_model(cfg, args.seed)
        else:
            self.model = _MODEL_CACHE.get(key) or self._load_model(cfg, args.seed)
            _MODEL_CACHE.clear()
            _MODEL_CACHE[key] = self.model
        if args.enable_two_batch_overlap:  # raises where it cannot run (a cached model too)
            two_batch_overlap.check_supported(self.model, self.tp.size)
            self.model.two_batch_overlap = self.tp

        self.capacity = self._kv_capacity()
        if self.mla_dims is not None:
            self.kv_pool = MLAKVPool(self.capacity, cfg.num_layers, *self.mla_dims, self.dtype,
                                     self.device)
        else:
            self.kv_pool = KVPool(self.capacity, cfg.num_layers, self.num_kv_heads, cfg.head_dim,
                                  self.dtype, self.device)
        self.allocator = TokenSlotAllocator(self.capacity, self.device)
        self.attention_backend_name = (
            resolve_backend_name(args.attention_backend, self.device) if self.mla_dims is None
            else "mla_" + resolve_mla_backend_name(args.attention_backend, self.device))
        # the model says what its attention computes (scale, per-layer windows, soft-cap)
        spec_of = getattr(self.model_cls, "attention_spec", None)
        self.attention_spec = (spec_of(cfg) if spec_of is not None
                               else AttentionSpec(scale=cfg.head_dim ** -0.5))
        # rows a decode forward may have: a speculative verify runs as a decode batch of
        # (draft tokens + 1) rows per request (speculative/verify.py); +1 as for the pool rows
        spec = spec_config.resolve(args)
        # EAGLE-3: every forward keeps these target layers' outputs (fb.aux_hidden); set before
        # the CUDA graphs are captured, which then write them into a static buffer too
        self.capture_layers: tuple = ()
        if spec is not None and spec.algorithm == "EAGLE3":
            from radixlm.runtime.speculative import eagle3_config  # (only with EAGLE3)

            self.capture_layers = eagle3_config.capture_layers(args, cfg)
        if spare_rows is None:
            spare_rows = spec.spare_rows(args.max_running_requests) if spec else 0
        # (a draft tree's beams run as decode rows, a scratch row each)
        decode_rows = max(args.max_running_requests * (spec.max_draft + 1 if spec else 1),
                          spare_rows) + 1
        # +1 row of slack so a request being re-admitted never waits on its own row; a draft
        # tree's scratch rows after them
        self.req_to_token_pool = ReqToTokenPool(
            args.max_running_requests + 1, self.context_len + 1, self.device,
            spare_rows=spare_rows)
        if self.mla_dims is not None:
            self.attn_backend = create_mla_backend(
                self.attention_backend_name.removeprefix("mla_"), self.kv_pool,
                self.req_to_token_pool.req_to_token, self.attention_spec,
                max_batch_size=decode_rows, max_context_len=self.context_len + 1)
        else:
            self.attn_backend = create_attention_backend(
                self.attention_backend_name, self.kv_pool, self.req_to_token_pool.req_to_token,
                self.attention_spec, device=self.device,
                max_batch_size=decode_rows, max_context_len=self.context_len + 1)
        self.graph_runner = None
        # TP: every rank captures the same buckets in the same order, so the NCCL all-reduces
        # inside the graphs pair up on replay (rank 0 and the workers replay the same bucket for
        # the same broadcast batch); the communicator exists before capture (_kv_capacity's
        # min_int ran a collective)
        if (self.device.type == "cuda" and not args.disable_cuda_graph
                and getattr(self.attn_backend, "supports_cuda_graph", False)):
            max_bs = min(args.cuda_graph_max_bs, decode_rows)
            self.graph_runner = CudaGraphRunner(self, max_bs)
        self.piecewise = None  # PiecewiseGraphRunner: extends replay graphs between attentions
        if (self.device.type == "cuda" and not args.disable_piecewise_cuda_graph
                and args.piecewise_cuda_graph_max_tokens > 0):
            self.piecewise = self._piecewise_graphs(args.piecewise_cuda_graph_max_tokens)

    def _load_model(self, cfg: ModelConfig, seed: int) -> torch.nn.Module:
        t0 = time.perf_counter()
        with torch.device("meta"):  # no init kernels: every parameter is overwritten below
            model = self.model_cls(cfg)
        # dtype first, while on meta (free): casting after to_empty would read and write every
        # byte of uninitialized fp32 weights (seconds here, where fresh pages are slow)
        model = model.to(self.dtype).to_empty(device=self.device)
        model.rope.reset(self.device)  # buffers are computed, not loaded
        # Weight copies on one thread: they are memory-bound, and torch's parallel copy_ stalls at
        # every one of its ~400 calls when another process holds a core (2-core box, load ~3:
        # 1.7 s for SmolLM2's 270 MB with 2 threads, 0.17 s with 1)
        threads = torch.get_num_threads()
        if self.device.type == "cpu" and self.load_format != "dummy":  # random init: compute
            torch.set_num_threads(1)
        try:
            if self.load_format == "dummy":
                model.init_dummy_weights(seed)
                if self.fp8 is not None and self.fp8.keep:  # random e4m3 weights (benchmarks)
                    fp8_linear.quantize_model(model)
                if self.int4 is not None:  # random int4 weights (benchmarks)
                    int4_checkpoint.init_dummy(model, self.int4)
            elif self.int4 is not None:
                int4_checkpoint.load_weights(model, self.model_path, self.dtype, self.int4,
                                             self.device)
            elif self.fp8 is not None:
                fp8_checkpoint.load_weights(model, self.model_path, self.dtype, self.fp8,
                                            self.device)
            else:
                weights = loader.iter_weights(self.model_path, self.load_format, self.dtype)
                if self.keep_quantized:  # blocks replace dense weights: skip those tensors
                    held = quantized_linear.convert_model(
                        model, quantized_linear.gguf_file(self.model_path),
                        dense_rows=self.gguf_dense_rows)
                    weights = ((name, t) for name, t in weights if name not in held)
                model.load_weights(weights)
            model.eval().requires_grad_(False)
            if self.fp32_gemm:
                cpu_linear.convert_model(model)
            # an EAGLE-3 head (on rank 0, the scheduler's) embeds its inputs with the target's
            # table, which sharding splits by vocabulary: rank 0 keeps the whole one too
            if (self.tp.size > 1 and self.tp.rank == 0
                    and str(self.args.speculative_algorithm).upper() == "EAGLE3"):
                self.whole_embedding = model.embed_tokens.weight
            # after loading the whole checkpoint, keep this rank's piece (distributed/sharding)
            sharding.shard_model(model, self.tp)
            if self.cpu_packed:  # packs of an earlier start where the cache keeps them
                pack_cache.convert_model(model, self.model_path, self.load_format)
        finally:
            torch.set_num_threads(threads)
        logger.info("loaded %s (%s) in %.1fs", self.model_path, self.load_format,
                    time.perf_counter() - t0)
        return model

    def _kv_capacity(self) -> int:
        cfg = self.model_config
        bpt = (KVPool.bytes_per_token(cfg.num_layers, self.num_kv_heads, cfg.head_dim, self.dtype)
               if self.mla_dims is None
               else MLAKVPool.bytes_per_token(cfg.num_layers, *self.mla_dims, self.dtype))
        if self.args.max_total_tokens is not None:
            return int(self.args.max_total_tokens)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1 - self.args.mem_fraction_static)
            budget, bpt = self._draft_share(budget, bpt)
            if self.args.enable_hierarchical_cache:  # the loads' staging ring (kv_mover.py)
                budget -= kv_mover.staging_bytes(self.device)
        else:
            budget = CPU_KV_BUDGET_BYTES
        # ranks' pools must hold the same slots: the smallest budget of the TP group
        capacity = self.tp.min_int(int(budget // bpt), self.device)
        if capacity < 16:
            raise RuntimeError(f"not enough memory for the KV cache ({budget / 2**30:.2f} GiB "
                               f"for {bpt} bytes per token); lower the model size or raise "
                               "--mem-fraction-static / set --max-total-tokens")
        return capacity

    def _draft_share(self, budget: float, bpt: int) -> tuple[float, int]:
        """With a draft model (--speculative-algorithm STANDALONE), its weights and its pool (as
        many tokens as this one's, plus a chain per request: speculative/draft_budget.py) come
        out of the same budget: every token of this pool then costs the draft's bytes too."""
        algo = str(self.args.speculative_algorithm).upper()
        if algo == "EAGLE3":  # a one-layer head with a KV slot per target slot (eagle3.py)
            from radixlm.runtime.speculative import eagle3_config  # (only here)

            head_bpt, head_weights = eagle3_config.draft_memory(self.args, self.model_config,
                                                                self.dtype)
            return budget - head_weights, bpt + head_bpt
        if algo != "STANDALONE":
            return budget, bpt
        from radixlm.runtime.speculative import draft_budget, spec_config  # (only here)

        draft_bpt, draft_weights = draft_budget.draft_memory(self.args, self.dtype)
        per_request = spec_config.resolve(self.args).draft_inputs()
        slack = draft_budget.pool_tokens(0, self.args, per_request) * draft_bpt
        return budget - draft_weights - slack, bpt + draft_bpt

    def _piecewise_graphs(self, max_tokens: int):
        """A PiecewiseGraphRunner where its pieces compute this model's forward, else None
        (the reason logged: such extends run eagerly, as with the flag off)."""
        why = ("tensor parallelism" if self.tp.size > 1
               else "EAGLE-3 keeps every layer's output" if self.capture_layers
               else llama_pieces.why_not(self.model, self.attn_backend))
        if why:
            logger.info("piecewise CUDA graphs off: %s", why)
            return None
        return PiecewiseGraphRunner(self, min(max_tokens, self.context_len))

    def replays_decode_graph(self, batch_size: int) -> bool:
        """Whether a decode batch of this size (without shared-prefix groups) replays a graph."""
        return self.graph_runner is not None and batch_size <= self.graph_runner.max_bs

    def release_cuda_graphs(self) -> None:
        """Drop the captured decode and piecewise graphs. Under TP this must come before leaving
        the process group: while a graph holding captured NCCL work lives,
        destroy_process_group hangs (pytorch/pytorch#115388; seen on 2 x H100 with every rank
        in it)."""
        if self.graph_runner is None and self.piecewise is None:
            return
        # they and the runner reference each other: collect the cycle
        self.graph_runner = self.piecewise = None
        gc.collect()
        if self.device.type == "cuda":  # (a CPU test's emulated pieces)
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        if self.tp.size > 1:
            # every rank runs the same batch: rank 0 (the scheduler's) sends it to the others
            # (distributed/batch_sync), which call this with rank != 0. Shared-prefix groups are
            # not sent: TP decodes run plain (same attention up to the merge's rounding)
            fb.prefix_groups = None
            if self.tp.rank == 0:
                batch_sync.send_batch(self.tp, fb, self.req_to_token_pool.req_to_token)
        fb.capture_layers = self.capture_layers
        if (self.graph_runner is not None and fb.prefix_groups is None
                and self.graph_runner.can_run(fb)):
            return self.graph_runner.replay(fb)
        if (self.piecewise is not None and fb.prefix_groups is None
                and self.piecewise.can_run(fb)):
            hidden = self.piecewise.run(fb)
        else:
            fb.attn_backend = self.attn_backend
            self.attn_backend.init_forward_metadata(fb)
            hidden = self.model(fb)
        fb.hidden_states = hidden  # (N, H) final hidden states of the logits rows (embeddings)
        return self.model.compute_logits(hidden)

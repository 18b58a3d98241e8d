"""DeepSeek-V2-Lite (MLA + MoE) on one GPU: radixlm against HF transformers and the roofline.

    python benchmarks/mla_gpu.py --result-file benchmarks/results/mla_gpu.jsonl
    python benchmarks/mla_gpu.py --tiny --device cpu      # a CPU dry run of the whole logic

DeepSeek-V2-Lite's public config (V2_LITE below), dummy (random) bf16 weights, greedy,
`ignore_eos`, token ids in. One JSON line (benchmarks/README.md conventions, emit_result):
  kv_bytes_per_token / kv_bytes_per_token_expanded / kv_ratio
        the latent pool's bytes per token (measured on the engine's pool) against the expanded
        K/V of the same model (H heads x (qk_nope + qk_rope + v_head_dim)); target <= 1/6
  hf_batch128_out_tok_s   HF `generate`, the N requests as one left-padded batch (random
        weights from the same config, bf16; built, run and freed before radixlm starts)
  batch128_out_tok_s / batch128_vs_hf   radixlm, N x (in, out) offline; target ratio >= 4
  bs1_decode_tok_s        radixlm, one request, 128 in / 256 out, decode steps only
  roofline_bs1_tok_s / bs1_fraction_of_roofline
        bandwidth / the bytes one decode token reads: every attention weight, the latent KV of
        its context (mean over the decode), the dense layer's MLP, per MoE layer the router
        (fp32), the shared experts and top-k routed experts, the final norm, one embedding row
        and the whole lm_head; --bandwidth (default by GPU name: H200 4.8e12, else H100
        3.35e12 B/s); the measured copy bandwidth is reported beside it (copy_TBps)
`--parts` runs a subset (kv, hf_batch128, batch128, bs1).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.gpu_suite_parts import copy_bandwidth_tbps, rand_ids, sync  # noqa: E402
from benchmarks.offline_throughput import emit_result, git_commit  # noqa: E402

# deepseek-ai/DeepSeek-V2-Lite config.json (the fields a model build reads)
V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
    "num_experts_per_tok": 6, "routed_scaling_factor": 1.0, "topk_method": "greedy",
    "n_group": 1, "topk_group": 1, "moe_layer_freq": 1, "first_k_dense_replace": 1,
    "norm_topk_prob": False, "scoring_func": "softmax", "aux_loss_alpha": 0.001,
    "seq_aux": True, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 163840, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
    "use_cache": True, "bos_token_id": 100000, "eos_token_id": 100001,
    "tie_word_embeddings": False, "rope_theta": 10000, "attention_bias": False,
    "attention_dropout": 0.0, "torch_dtype": "bfloat16",
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096},
}
# the same structure, small enough for a CPU dry run (--tiny)
TINY = {**V2_LITE, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2}


def kv_bytes(cfg: dict, elem: int = 2) -> tuple[int, int]:
    """(latent, expanded) KV bytes per token over all layers."""
    n, h = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    latent = n * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * elem
    expanded = n * h * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
                        + cfg["v_head_dim"]) * elem
    return latent, expanded


def decode_bytes(cfg: dict, context: float, elem: int = 2) -> dict:
    """Bytes one batch-1 decode token reads, by part (see the module docstring)."""
    hid, h, n = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    r, dn, dr, dv = (cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                     cfg["v_head_dim"])
    qd = h * (dn + dr)
    ql = cfg.get("q_lora_rank")
    q = hid * qd if not ql else hid * ql + ql + ql * qd
    attn = q + hid * (r + dr) + r + h * (dn + dv) * r + h * dv * hid + 2 * hid  # + 2 norms
    n_dense = min(n, cfg.get("first_k_dense_replace") or 0)
    n_moe = n - n_dense
    mi, e = cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    parts = {
        "attention_weights": n * attn * elem,
        "latent_kv": int(n * (r + dr) * elem * context),
        "dense_mlp": n_dense * 3 * hid * cfg["intermediate_size"] * elem,
        "router_fp32": n_moe * e * hid * 4,
        "shared_experts": n_moe * 3 * hid * mi * (cfg.get("n_shared_experts") or 0) * elem,
        "routed_experts": n_moe * 3 * hid * mi * cfg["num_experts_per_tok"] * elem,
        "embed_row_norm_lm_head": (hid + hid + cfg["vocab_size"] * hid) * elem,
    }
    parts["total"] = sum(parts.values())
    return parts


def make_engine(args, path: str, **kw):
    import radixlm

    base = dict(model_path=path, load_format="dummy", dtype=args.dtype, skip_tokenizer_init=True,
                device=args.device, attention_backend=args.attention_backend,
                disable_cuda_graph=args.disable_cuda_graph, context_length=args.context_length,
                cuda_graph_max_bs=max(args.num_requests, 1))
    base.update(kw)
    return radixlm.Engine(**base)


def hf_batch(args, cfg: dict, prompts, res: dict) -> None:
    """HF generate on the same prompts as one left-padded batch (benchmarks/hf_baseline)."""
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    from benchmarks.hf_baseline import run_hf_generate

    class Req:  # what run_hf_generate reads
        def __init__(self, ids, n):
            self.prompt_ids, self.output_len = ids, n

    hf_cfg = DeepseekV2Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    t0 = time.perf_counter()
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    res["hf_build_s"] = round(time.perf_counter() - t0, 1)
    reqs = [Req(p, args.output_len) for p in prompts]
    run_hf_generate(model, None, [Req(p[:16], 4) for p in prompts[:2]], batch_size=2,
                    dtype=dtype)  # warm-up (lazy CUDA init, kernels)
    out = run_hf_generate(model, None, reqs, batch_size=len(reqs), dtype=dtype)
    res["hf_batch128_out_tok_s"] = round(out["output_tokens"] / out["elapsed_s"], 1)
    res["hf_batch128_s"] = round(out["elapsed_s"], 2)
    del model, out
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed(eng, prompts, n_out: int) -> tuple[float, int]:
    params = {"max_new_tokens": n_out, "temperature": 0, "ignore_eos": True}
    sync()
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    sync()
    return time.perf_counter() - t0, sum(len(o["output_ids"]) for o in outs)


def run_radixlm(args, path: str, cfg: dict, prompts, res: dict) -> None:
    t0 = time.perf_counter()
    try:
        eng = make_engine(args, path)
    except Exception as e:  # noqa: BLE001 - a broken capture must not lose every other figure
        if args.disable_cuda_graph:
            raise
        import traceback

        traceback.print_exc()
        res.setdefault("errors", {})["engine"] = f"{type(e).__name__}: {e}"[:400]
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        args.disable_cuda_graph = res["cuda_graph"] = False  # go on without graphs
        eng = make_engine(args, path)
    res["engine_ready_s"] = round(time.perf_counter() - t0, 1)
    try:
        runner = eng.runner
        res["attention_backend_resolved"] = runner.attention_backend_name
        res["cuda_graph_buckets"] = (runner.graph_runner.buckets[-1]
                                     if runner.graph_runner is not None else 0)
        pool = runner.kv_pool
        held = sum(b.numel() * b.element_size() for b in pool.latent_buffers)
        res["kv_bytes_per_token"] = held // (runner.capacity + 1)
        res["kv_capacity_tokens"] = runner.capacity
        rng = random.Random(args.seed + 7)
        vocab = cfg["vocab_size"]
        timed(eng, [rand_ids(rng, 32, vocab) for _ in range(4)], 8)  # warm-up
        if "batch128" in args.parts:
            timed(eng, prompts[:8], 4)  # the prefill/decode shapes once
            eng.flush_cache()
            dt, n = timed(eng, prompts, args.output_len)
            res["batch128_out_tok_s"] = round(n / dt, 1)
            res["batch128_s"] = round(dt, 2)
        if "bs1" in args.parts:
            prompt = rand_ids(rng, args.bs1_input_len, vocab)
            timed(eng, [prompt], 16)
            eng.flush_cache()
            ttft, _ = timed(eng, [prompt], 1)
            eng.flush_cache()
            dt, n = timed(eng, [prompt], args.bs1_output_len)
            res["bs1_tok_s"] = round(n / dt, 1)
            res["bs1_decode_tok_s"] = round((n - 1) / max(dt - ttft, 1e-9), 1)
            if args.profile_bs1:
                res["bs1_profile"] = profile_bs1(eng, prompt, args.profile_bs1)
        res["engine_stats"] = eng.get_stats()
        if torch.cuda.is_available():
            res["peak_gpu_mem_GB"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
    finally:
        eng.shutdown()
        del eng
        gc.collect()


def profile_bs1(eng, prompt, folder: str, steps: int = 64) -> dict:
    """The GPU's kernels over one batch-1 request of `steps` output tokens (torch.profiler,
    kernels only: CUPTI sees every thread's launches): trace_summary's view of the trace, with
    the kernels a decode step launches."""
    from benchmarks import trace_summary

    os.makedirs(folder, exist_ok=True)
    eng.flush_cache()
    acts = [torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available()
            else torch.profiler.ProfilerActivity.CPU]  # (CPU: no kernels, the window only)
    with torch.profiler.profile(activities=acts) as prof:
        timed(eng, [prompt], steps)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    path = os.path.join(folder, "mla_bs1_trace.json")
    prof.export_chrome_trace(path)
    out = trace_summary.summarize(path, gap_ms=0.05, top=25)
    out["kernels_per_token"] = round(out.get("kernels", 0) / steps, 1)
    return out


def default_bandwidth(device_name: str) -> float:
    return 4.8e12 if "H200" in device_name else 3.35e12


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny config of the same structure")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--parts", default="kv,hf_batch128,batch128,bs1")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--bs1-input-len", type=int, default=128)
    p.add_argument("--bs1-output-len", type=int, default=256)
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--bandwidth", type=float, default=None,
                   help="HBM bytes/s for the roofline (default: H200 4.8e12, else 3.35e12)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--result-file", default=None)
    p.add_argument("--note", default=None)
    p.add_argument("--profile-bs1", default=None, metavar="DIR",
                   help="also profile one batch-1 request's kernels, trace written to DIR")
    args = p.parse_args(argv)
    args.parts = set(args.parts.split(","))
    if args.tiny and "--num-requests" not in " ".join(argv or sys.argv):
        args.num_requests, args.input_len, args.output_len = 4, 24, 6
        args.bs1_input_len, args.bs1_output_len, args.context_length = 16, 8, 256
    cfg = TINY if args.tiny else V2_LITE
    cuda = args.device.startswith("cuda")
    name = torch.cuda.get_device_name(0) if cuda else "cpu (dry run)"
    res: dict = {"device": name, "model": "tiny-v2-lite" if args.tiny else "DeepSeek-V2-Lite",
                 "dtype": args.dtype, "load_format": "dummy",
                 "cuda_graph": not args.disable_cuda_graph,
                 "attention_backend": args.attention_backend,
                 "git_commit": git_commit()}
    latent, expanded = kv_bytes(cfg)
    res.update(kv_bytes_per_token_formula=latent, kv_bytes_per_token_expanded=expanded,
               kv_ratio=round(latent / expanded, 4), kv_ratio_ok=latent * 6 <= expanded)
    rng = random.Random(args.seed)
    prompts = [rand_ids(rng, args.input_len, cfg["vocab_size"]) for _ in range(args.num_requests)]
    with tempfile.TemporaryDirectory() as path:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
        if cuda:
            res["copy_TBps"] = round(copy_bandwidth_tbps(), 3)
        if "hf_batch128" in args.parts:
            hf_batch(args, cfg, prompts, res)  # first, and freed: one model on the GPU at a time
        if args.parts & {"kv", "batch128", "bs1"}:
            run_radixlm(args, path, cfg, prompts, res)
    if "kv_bytes_per_token" in res:
        res["kv_ratio_measured"] = round(res["kv_bytes_per_token"] / expanded, 4)
    if "batch128_out_tok_s" in res and "hf_batch128_out_tok_s" in res:
        res["batch128_vs_hf"] = round(res["batch128_out_tok_s"] / res["hf_batch128_out_tok_s"], 2)
    bw = args.bandwidth or default_bandwidth(name)
    parts = decode_bytes(cfg, args.bs1_input_len + args.bs1_output_len / 2)
    res.update(bandwidth_Bps=bw, decode_bytes=parts,
               roofline_bs1_tok_s=round(bw / parts["total"], 1))
    if "bs1_decode_tok_s" in res:
        res["bs1_fraction_of_roofline"] = round(res["bs1_decode_tok_s"]
                                                / res["roofline_bs1_tok_s"], 3)
    if args.note:
        res["note"] = args.note
    return emit_result(res, args.result_file, __file__)


if __name__ == "__main__":
    main()

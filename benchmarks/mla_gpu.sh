#!/usr/bin/env bash
# DeepSeek / MLA on ONE GPU in one device call: the GPU tests (graphs on == off == HF, the compiled
# MLA decode and grouped-expert kernels, the DeepSeek parity test) and benchmarks/mla_gpu.py with
# CUDA graphs on, then its radixlm parts with graphs off. Each step has its own time limit and logs
# to $OUT, so a hang in one leaves the others' results.
#
#   # here: ../shared/tools/gpu-wheels fastapi uvicorn pyzmq xgrammar gguf orjson pydantic jsonschema
#   # device (one H100 or H200, carry [".whl"]); the step limits add up to 960 s, more than one
#   # 600 s device call, so run them in separate calls on the same warm machine:
#   bash benchmarks/mla_gpu.sh tests           # <= 300 s
#   bash benchmarks/mla_gpu.sh bench           # <= 420 s
#   bash benchmarks/mla_gpu.sh bench_nograph   # <= 240 s
#
# Expected (not yet measured): tests 2-4 min (Triton compiles dominate), bench 3-5 min (HF builds
# 15.7 B random parameters and decodes 128 x 128 tokens through its per-expert loop; radixlm
# captures 20 graphs), bench_nograph 1-2 min.
set -u
OUT=${OUT:-/tmp/mla_gpu}
STEPS=" ${*:-tests bench bench_nograph} "
step_tail() { tail -n 15 "$1"; }
source "$(dirname "$0")/gpu_steps.sh"
step tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/gpu/test_gpu_mla.py tests/gpu/test_gpu_deepseek_parity.py
step bench 420 python3 benchmarks/mla_gpu.py --result-file "$OUT/mla_gpu.jsonl"
step bench_nograph 240 python3 benchmarks/mla_gpu.py --disable-cuda-graph --parts kv,batch128,bs1 \
  --result-file "$OUT/mla_gpu.jsonl"

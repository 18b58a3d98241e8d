#!/usr/bin/env bash
# The int4 GPU measurements in ONE device call on one Hopper GPU (device time is scarce): the
# int4 GPU tests, the TMA GEMV's full config sweep (probes/int4_gemv_bound.py, which writes its
# tuned table as $OUT/tuned.json), the mma GEMV's tests and sweep (mmatests, mma: the Hopper
# default's table as $OUT/mma_tuned.json; mmapdl: without PDL), the e2e bf16 / AWQ / GPTQ decode
# (int4_decode.py, E2E_ARMS) with those tables, and the batch-1 step's timeline
# (probes/gpu_probe_bs1.py). Each step has its own time limit and logs to $OUT, so a hang in one
# leaves the others' results.
#
#   # here: ../shared/tools/gpu-wheels fastapi uvicorn pyzmq xgrammar gguf orjson pydantic jsonschema
#   #       .venv/bin/python benchmarks/gpu_prep.py --out .carry
#   # device (kind nvidia-h200 or nvidia-h100, carry [".whl", ".carry"]):
#   bash benchmarks/int4_gpu.sh                   # the default steps, ~560 s at most
#   bash benchmarks/int4_gpu.sh sweep e2e         # some of them (also: mmatests mma mmapdl
#                                                   wgtests wgmma wgbig)
#   E2E_ARMS="bf16 awq-g128 gptq-g128 bf16-nopdl" bash benchmarks/int4_gpu.sh mmatests e2e
#
# Budget (one H200, 2026-11-29): tests ~220 s (test_int4.py 17 tests ~240 s alone: not run
# here), sweep ~45 s, mmatests ~240 s, mma ~60 s, e2e 3-4 arms ~60-100 s, timeline ~25 s. A GPU
# the tuned tables (layers/int4_tma_tuned.py, layers/int4_mma_layout.py) lack gets its own from
# the sweeps: copy tuned.json's / mma_tuned.json's entry there.
set -u
OUT=${OUT:-/tmp/int4_gpu}
STEPS=" ${*:-tests sweep e2e timeline} "
source "$(dirname "$0")/gpu_steps.sh"
export RADIXLM_TEST_TOKENIZER=$PWD/.carry/smollm2-tokenizer
step tests 240 python -m pytest -q -p no:cacheprovider tests/gpu/test_int4_tma_gpu.py \
  tests/gpu/test_int4.py -k "tma or kernels or linear or split or silu"
# every int4 GPU test of the Engine and the layer (test_int4.py whole: ~240 s alone)
step int4all 540 python -m pytest -q -x -p no:cacheprovider tests/gpu/test_int4_tma_gpu.py \
  tests/gpu/test_int4.py
# the tensor-core GEMV for 1-8 rows (layers/triton_int4_mma.py): its tests, its config sweep
# (with the kernels PDL launches by default: RMSNorm, rotary, decode attention)
step mmatests 300 python -m pytest -q -x -p no:cacheprovider tests/gpu/test_int4_mma_gpu.py \
  tests/gpu/test_fused_ops_gpu.py tests/gpu/test_triton_attention_gpu.py
# (the GEMV's tests alone, ~230 s)
step mmaonly 250 python -m pytest -q -x -p no:cacheprovider tests/gpu/test_int4_mma_gpu.py
step mma 200 python benchmarks/probes/int4_mma_bound.py --result-file "$OUT/mma.jsonl" \
  --configs-out "$OUT/mma_tuned.json"
[ -s "$OUT/mma_tuned.json" ] && export RADIXLM_INT4_MMA_CONFIGS=$OUT/mma_tuned.json
# batch 1 without programmatic dependent launch (the probe's other runs have it: the default)
RADIXLM_PDL=0 step mmapdl 120 python benchmarks/probes/int4_mma_bound.py --m 1 \
  --result-file "$OUT/mma_nopdl.jsonl"
# the wgmma GEMM for 9-64 rows (layers/gluon_int4_gemm.py): its tests and config sweep
step wgtests 240 python -m pytest -q -p no:cacheprovider tests/gpu/test_int4_wgmma_gemm_gpu.py
step wgmma 300 python benchmarks/probes/int4_wgmma_bound.py --result-file "$OUT/wgmma.jsonl" \
  --configs-out "$OUT/wgmma_tuned.json"
[ -s "$OUT/wgmma_tuned.json" ] && export RADIXLM_INT4_WGMMA_CONFIGS=$OUT/wgmma_tuned.json
# past 64 rows (the Triton GEMM's range): the wgmma GEMM's default in 64-row tiles against it
step wgbig 120 python benchmarks/probes/int4_wgmma_bound.py --quick --m 96 128 256 \
  --result-file "$OUT/wgmma_big.jsonl"
step sweep 240 python benchmarks/probes/int4_gemv_bound.py --result-file "$OUT/probe.jsonl" \
  --configs-out "$OUT/tuned.json"
[ -s "$OUT/tuned.json" ] && export RADIXLM_INT4_TMA_CONFIGS=$OUT/tuned.json
step e2e 300 python benchmarks/int4_decode.py --arms ${E2E_ARMS:-bf16 awq-g128 gptq-g128} \
  --result-file "$OUT/e2e.jsonl"
mkdir -p "$OUT/awq" && python - "$OUT/awq/config.json" <<'PY'
import json, sys
c = json.load(open("benchmarks/configs/llama-3.1-8b/config.json"))
c["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128,
                            "zero_point": True, "version": "gemm"}
json.dump(c, open(sys.argv[1], "w"))
PY
RADIXLM_INT4_TMA=${TIMELINE_INT4:-mma} step timeline 150 python benchmarks/probes/gpu_probe_bs1.py timeline --model-path "$OUT/awq"

#!/usr/bin/env bash
# The multi-GPU measurements in ONE device call on a 2-GPU machine (device time is scarce, a
# machine start costs minutes): the TP GPU tests, TP=1 vs TP=2 (tp_gpu.py) and the DP router
# comparison (dp_router.py), which write tp_gpu.jsonl and dp_router*.jsonl under results/.
# Each step has its own time limit and logs to $OUT, so a hang in one leaves the others' results.
#
#   # here: ../shared/tools/gpu-wheels fastapi uvicorn pyzmq xgrammar gguf orjson pydantic jsonschema
#   #       .venv/bin/python benchmarks/gpu_prep.py --out .carry
#   # device (kind nvidia-h200-x2 or nvidia-h100-x2, carry [".whl", ".carry"]):
#   bash benchmarks/multi_gpu.sh                    # all four steps, ~550 s at most
#   bash benchmarks/multi_gpu.sh tp_bench dp_bench  # some of them
#   bash benchmarks/multi_gpu.sh tp_tests tp_profile tp_proxy  # TP's overhead, ~420 s
#
# Budget: 2 x H100 (2026-11-25) TP=1 took 36 s to start and ~60 s in all; 2 x H200 (2026-11-26)
# tp_tests 78 s, tp_bench 37 s, each dp step 35-40 s (1024 requests).
set -u
OUT=${OUT:-/tmp/multi_gpu}
STEPS=" ${*:-tp_tests tp_bench dp_bench dp_bench_long} "
SIZES=${SIZES:-1,2}
DP_ARGS=${DP_ARGS:-}  # extra dp_router flags for the dp steps, e.g. "--per-group 32"
step_tail() { grep -v '^PARTIAL' "$1" | tail -c 2500; }
source "$(dirname "$0")/gpu_steps.sh"
# TP=2 greedy-identical to TP=1 in fp32 over NCCL (runner with/without CUDA graphs, Engine)
# (-s and RADIXLM_TP_HARNESS_DUMP_S: a hung rank prints its stack; pytest's own after 130 s)
export RADIXLM_TP_HARNESS_DUMP_S=100
step tp_tests 150 python -m pytest -v -s -x -p no:cacheprovider \
  -o faulthandler_timeout=130 -m gpu tests/gpu/test_tensor_parallel_gpu.py
step tp_bench 200 python benchmarks/tp_gpu.py --timeout-s 95 --log-dir "$OUT" --sizes "$SIZES" \
  --result-file "$OUT/tp_gpu.jsonl"
step dp_bench 150 python benchmarks/dp_router.py --start-timeout 60 --result-file "$OUT/dp_router.jsonl" \
  --keep-logs "$OUT/dp_logs" $DP_ARGS
# the same tenants with a longer shared prompt and shorter answers: a prefill-heavier mix, where
# the prefixes a router keeps together matter more (reported beside the default workload)
step dp_bench_long 150 python benchmarks/dp_router.py --start-timeout 60 --prefix-len 3072 \
  --output-len 16 --result-file "$OUT/dp_router.jsonl" --note "prefill-heavier variant" \
  --keep-logs "$OUT/dp_logs_long" $DP_ARGS
# where the time goes: the prefill-heavier variant with py-spy over the router and replica A (or
# the single server) in each configuration (summaries under spy/, in spy.tgz)
step dp_spy 150 python benchmarks/dp_router.py --start-timeout 60 --prefix-len 3072 \
  --output-len 16 --result-file "$OUT/dp_router.jsonl" --note "py-spy on (--spy-dir)" \
  --spy-dir "$OUT/spy" --keep-logs "$OUT/dp_logs_spy" $DP_ARGS
[[ -d $OUT/spy ]] && for f in "$OUT"/spy/*.txt; do echo "## $f"; head -8 "$f" | cut -c1-150; done
# where TP=2's time goes beyond one rank's work (only when named: tp_profile tp_proxy): TP=2 and
# TP=1 under torch.profiler (rank 0's kernels and idle, batch 1 and the 128-request batch), and
# on GPU 0 one rank's share of the model at TP=1 (probes/tp_rank_proxy.sh): the difference is
# communication and the batch sync (docs/parallelism.md)
step tp_profile 240 python benchmarks/tp_gpu.py --timeout-s 110 --log-dir "$OUT" --sizes 2,1 \
  --profile --profile-batch --result-file "$OUT/tp_gpu.jsonl"
CUDA_VISIBLE_DEVICES=0 step tp_proxy 90 env VARIANTS=half OUT="$OUT/proxy" \
  bash benchmarks/probes/tp_rank_proxy.sh
# a probe, run here to share a machine start: f1b62ac's A/B (decode graphs vs shared-prefix
# groups) on gpu_suite's shared-prefix workload, one GPU (only when named: prefix_ab)
CUDA_VISIBLE_DEVICES=0 step prefix_ab 200 python benchmarks/probes/shared_prefix_ab.py
# the device hands back at most 8 files: the servers' and routers' logs travel as one archive
for d in dp_logs dp_logs_long dp_logs_spy spy; do
  [[ -d $OUT/$d ]] && tar -czf "$OUT/$d.tgz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"
done

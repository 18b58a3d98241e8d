#!/usr/bin/env bash
# What bounds a TP=2 batch-1 decode step, seen on ONE GPU: benchmarks/tp_gpu.py at TP=1 (with
# --profile: kernel time, GPU idle, rank 0's wait for each step's samples) on three dummy-weight
# Llama-3.1-8B variants:
#   full   the model itself (the TP=1 baseline)
#   half   one TP=2 rank's share of the work: 16 q / 4 kv heads, intermediate 7168, vocab 64128
#          (everything a rank computes at TP=2 except the all-reduces and the logits' gather)
#   l2     2 layers: a GPU step of ~0.3 ms, so the step's wall is the host's floor
#
#   OUT=/tmp/proxy bash benchmarks/probes/tp_rank_proxy.sh     # one GPU, ~2 min
#   VARIANTS="full half" OUT=... bash benchmarks/probes/tp_rank_proxy.sh   # some of them
set -u
OUT=${OUT:-/tmp/tp_rank_proxy}
mkdir -p "$OUT"
BASE=benchmarks/configs/llama-3.1-8b
mk() {  # mk NAME JSON-OVERRIDES -> a model dir under $OUT
  mkdir -p "$OUT/$1"
  python3 -c "import json,sys; c=json.load(open('$BASE/config.json')); c.update(json.loads(sys.argv[1])); json.dump(c, open('$OUT/$1/config.json','w'), indent=1)" "$2"
}
mk half '{"num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 7168, "vocab_size": 64128}'
mk l2 '{"num_hidden_layers": 2}'
for v in ${VARIANTS:-full half l2}; do
  dir=$OUT/$v; [ "$v" = full ] && dir=$BASE
  timeout 200 python3 benchmarks/tp_gpu.py --sizes 1 --profile --model-path "$dir" \
    --log-dir "$OUT" --timeout-s 180 > "$OUT/proxy.$v.out" 2>&1
  echo "== $v: exit $?"
  tail -n 1 "$OUT/proxy.$v.out" | python3 -c "
import json, sys
d = json.loads(sys.stdin.read()); r = d.get('tp1') or {}; p = r.get('bs1_profile') or {}
print(json.dumps({'variant': '$v', 'env': {k: v for k, v in __import__('os').environ.items() if k.startswith('RADIXLM_')}, 'commit': d.get('commit'), 'device': d.get('device'),
  **{k: r.get(k) for k in ('bs1_decode_tok_s', 'bs1_host_wait_ms_per_step', 'bs1_waited_steps',
                           'batch128_out_tok_s')},
  'profile': {k: p.get(k) for k in ('wall_s', 'kernel_s', 'span_s', 'idle_s', 'kernels', 'top_kernels_ms')} if isinstance(p, dict) else p,
  'errors': d.get('errors')}))" | tee -a "$OUT/tp_rank_proxy.jsonl"
done
rm -f "$OUT"/*.trace.json  # (tens of MB each; the tables stay)

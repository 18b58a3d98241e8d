# Sourced by the one-device-call scripts (multi_gpu.sh, mla_gpu.sh, int4_gpu.sh): the wheels the
# GPU image lacks installed from .whl (../shared/tools/gpu-wheels fills it here), PYTHONPATH, the
# clock, and `step`, which runs one named part with its own time limit so that a hang in one
# leaves the others' results. Before sourcing: OUT (the log folder) and STEPS (" name name ").
# A script may define step_tail LOG to print a finished step's log its own way.
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH  # (py-spy)
nvidia-smi -L
t0=$(date +%s)
declare -F step_tail > /dev/null || step_tail() { tail -n 15 "$1" | cut -c1-600; }
step() {  # step NAME LIMIT_S CMD...: run with a limit, keep the log, print its tail and the clock
  local name=$1 limit=$2
  shift 2
  [[ $STEPS == *" $name "* ]] || return 0
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? at $(( $(date +%s) - t0 )) s"
  step_tail "$OUT/$name.log"
}

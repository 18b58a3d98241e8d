"""On a CUDA GPU, fp32: Qwen3, Phi-3 (LongRoPE; partial rotary), Mixtral and Qwen3-MoE, also with
8-token sliding windows, Mistral / Qwen2 with windows and Gemma 2 / 3 (windows interleaved with
global layers, soft-caps) give HF transformers' greedy tokens and prompt logprobs on the CUDA-only
paths: the Triton norm / rotary / SiLU kernels, the Triton attention backend, decode in CUDA
graphs (the MoE experts' dense graph path) and eager (the grouped path). Same tiny checkpoints as
tests/unit/test_model_parity_*.py, written on the GPU machine. Run with `pytest -m gpu tests/gpu`."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
import arch_parity as ap  # noqa: E402
import test_model_parity_gemma as gemma_cases  # noqa: E402
import test_model_parity_moe as moe_cases  # noqa: E402
import test_model_parity_qwen3_phi3 as dense_cases  # noqa: E402
import test_model_parity_window as mistral_cases  # noqa: E402
import test_model_parity_window_archs as window_cases  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = {**dense_cases.CASES, **{k: v for k, v in moe_cases.CASES.items() if k != "qwen3moe-step2"},
         # 8-token sliding windows (Triton's windowed extend / decode kernels)
         **{f"{k}-window8": (cls, lambda cfg=cfg: cfg(window_cases.WINDOW))
            for k, (cls, cfg, _) in window_cases.CASES.items()},
         **{k: (cls, cfg) for k, (cls, cfg, _) in mistral_cases.CASES.items()},
         **gemma_cases.CASES}
VARIANTS = {
    "triton+graph": dict(attention_backend="triton", cuda_graph_max_bs=16),
    "triton eager": dict(attention_backend="triton", disable_cuda_graph=True),
    "torch_native": dict(attention_backend="torch_native"),  # no CUDA graphs with this backend
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    cls, config = CASES[request.param]  # HF reference on the CPU, fp32
    return ap.make_case(request.param, cls, config(), tmp_path_factory, dense_cases.VOCAB)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cuda_paths_match_hf(case, variant):
    name, path, model, prompts, ref = case
    eng = ap.make_engine(path, device="cuda", **VARIANTS[variant])
    try:
        assert (eng.runner.graph_runner is not None) == ("graph" in variant)
        ap.check_greedy(eng, prompts, ref)
        ap.check_prompt_logprobs(eng, model, prompts)
    finally:
        eng.shutdown()

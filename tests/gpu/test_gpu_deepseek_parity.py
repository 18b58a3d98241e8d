"""On a CUDA GPU, fp32: the DeepSeek-V2-Lite / V2 / V3-shaped tiny checkpoints of
tests/unit/test_model_parity_deepseek.py give HF transformers' greedy tokens and prompt logprobs
with the MLA backend's Triton decode kernel (attention/triton_mla_decode.py) and its torch decode
on CUDA (the Triton norm kernels; the triton decode replays CUDA graphs, the torch decode runs
eagerly: tests/gpu/test_gpu_mla.py compares graphs on and off).
Run with `pytest -m gpu tests/gpu/test_gpu_deepseek_parity.py`."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
import arch_parity as ap  # noqa: E402
from test_model_parity_deepseek import case, check_greedy  # noqa: E402,F401 (case: a fixture)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
def test_cuda_mla_matches_hf(case, backend):  # noqa: F811
    name, path, model, prompts, ref = case
    eng = ap.make_engine(path, device="cuda", attention_backend=backend)
    try:
        assert eng.runner.attention_backend_name == ("mla_triton" if backend == "triton"
                                                     else "mla_torch")
        assert (eng.runner.graph_runner is not None) == (backend == "triton")
        check_greedy(eng, prompts, ref)
        ap.check_prompt_logprobs(eng, model, prompts)
    finally:
        eng.shutdown()

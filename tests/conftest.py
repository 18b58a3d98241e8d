"""Shared fixtures: the bundled SmolLM2 model, engines built on it, and the HF reference."""

from __future__ import annotations

import os

# Set before torch loads OpenMP. `make test` runs pytest-xdist workers side by side on the
# machine's cores: one torch thread per worker (and per server it starts), and OpenMP threads that
# sleep instead of spinning while they wait. A spinning team starves whatever runs on the other
# core, itself included: a 2-thread GEMM test took 50 s instead of 5 s beside one busy process.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from radixlm.runtime.models.loader import default_model_path  # noqa: E402


def _import_triton_interpreted() -> None:
    """CPU-only machines: import triton now, with TRITON_INTERPRET=1, before any test module is
    collected. Test modules that name transformers' model classes at import time pull in
    torch._dynamo, which imports triton; imported without the variable, triton's own @jit helpers
    (tl.cdiv, reductions) would not be interpreted and the interpreter tests
    (tests/unit/triton_interpreter.py) could not run after them. The variable is restored."""
    if torch.cuda.is_available():
        return
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except ImportError:
        pass  # the interpreter tests skip themselves
    finally:
        if prev is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = prev


_import_triton_interpreted()


# The modules that take a session server (main_server, tiny_server). `make test` (--dist loadfile,
# with the scheduler at the end of this file) hands them to one worker as one unit of work, so
# that each server starts once per run, not once per worker (a start costs ~9 CPU-s). Collection
# fails when this list and the modules' fixtures disagree.
SHARED_SERVERS = ("main_server", "tiny_server")
SHARED_SERVER_MODULES = frozenset({
    "tests/e2e/test_acceptance.py", "tests/e2e/test_acceptance_ops.py",
    "tests/e2e/test_frontend_api_backends.py", "tests/e2e/test_streaming.py",
    "tests/e2e/test_tool_calling.py", "tests/e2e/test_validation.py",
    "tests/sglang_compat/test_sglang_compat.py",
})


def _check_shared_server_modules(items) -> None:
    using, seen = set(), set()
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        seen.add(module)
        if any(name in item.fixturenames for name in SHARED_SERVERS):
            using.add(module)
    missing, stale = using - SHARED_SERVER_MODULES, (SHARED_SERVER_MODULES & seen) - using
    if missing or stale:
        raise pytest.UsageError(
            f"tests/conftest.py SHARED_SERVER_MODULES is out of date: add {sorted(missing)}, "
            f"remove {sorted(stale)} (the modules that take {' or '.join(SHARED_SERVERS)})")


# The slowest modules' seconds on one `make test` worker (fresh clone, 2-core VM, 2026-11-27), to
# hand out the longest units of work first (xdist gives each worker the next unit in collection
# order as it frees up: longest first leaves the shortest for the end, so both workers finish
# together). Order only: a stale or missing figure changes the balance, never what runs.
MODULE_SECONDS = {
    "shared servers": 115, "tests/unit/test_hf_parity.py": 40,
    "tests/e2e/test_data_parallel.py": 29, "tests/unit/test_pd_disaggregation.py": 29,
    "tests/unit/test_constrained.py": 25, "tests/unit/test_light_tokenizer.py": 22,
    "tests/e2e/test_frontend_programs.py": 20, "tests/unit/test_speculative.py": 18,
    "tests/e2e/test_llava_server.py": 17, "tests/unit/test_tensor_parallel.py": 17,
    "tests/e2e/test_faults.py": 17, "tests/e2e/test_lifecycle.py": 15,
    "tests/unit/test_tensor_parallel_engine.py": 14, "tests/unit/test_router_proxy.py": 14,
    "tests/e2e/test_responses_api.py": 13, "tests/e2e/test_sglang_server.py": 13,
    "tests/e2e/test_fuzz_api.py": 12, "tests/unit/test_triton_int4.py": 11,
    "tests/e2e/test_limits.py": 11, "tests/unit/test_engine_api.py": 10,
    "tests/unit/test_triton_sliding_window.py": 9, "tests/e2e/test_tensor_parallel_server.py": 9,
    "tests/unit/test_cpu_fp32_gemm.py": 9, "tests/unit/test_fp8_checkpoint.py": 8,
    "tests/unit/test_mla_graph_path.py": 8, "tests/unit/test_gguf_keep_quantized.py": 8,
}


def _work_unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return "shared servers" if module in SHARED_SERVER_MODULES else module


def _longest_first(items) -> None:
    """Items reordered by their unit of work's MODULE_SECONDS, longest first (stable: the
    collection order within and among the rest); every worker computes the same order."""
    units = {}
    for item in items:
        units.setdefault(_work_unit(item.nodeid), len(units))
    items.sort(key=lambda it: (-MODULE_SECONDS.get(_work_unit(it.nodeid), 0),
                               units[_work_unit(it.nodeid)]))


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest without xdist skips it
def pytest_configure_node(node):
    """(xdist controller) Tells each worker to order its collection longest first: a worker's
    own options say dist "no", and the scheduler reads the workers' order."""
    if node.config.getvalue("dist") == "loadfile":
        node.workerinput["radixlm_longest_first"] = True


def pytest_collection_modifyitems(config, items):
    _check_shared_server_modules(items)
    if getattr(config, "workerinput", {}).get("radixlm_longest_first"):
        _longest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the lent H100/H200: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smol_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def hf_smol(smol_path):
    """HF transformers' own model from the same GGUF file, fp32: the correctness reference."""
    from hf_gguf import hf_model

    return hf_model(smol_path, torch.float32)


@pytest.fixture(scope="session")
def tiny_chat_path(tmp_path_factory) -> str:
    """A random tiny Llama on SmolLM2's tokenizer (tests/tiny_models.py), for checks that hold
    for any model: routing, TP plumbing, life cycle."""
    from tiny_models import write_tiny_chat_model

    return write_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-chat")))


@pytest.fixture(scope="session")
def main_server():
    """The shared server (tests/e2e/server_harness.py MAIN_ARGS: SmolLM2 fp32, cache report and
    metrics on), one per pytest worker, for every module that takes it (e2e and the SGLang
    compatibility check): a server start costs ~9 CPU-s."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "e2e"))
    from server_harness import MAIN_ARGS, start_server, stop_and_check

    srv = start_server(MAIN_ARGS, name="main")
    yield srv
    stop_and_check(srv)


@pytest.fixture(scope="session")
def tiny_server(tiny_chat_path):
    """A server on the tiny random chat model (server_harness.py TINY_ARGS), shared like
    `main_server`, for server and frontend checks that hold for any model: tool calling and the
    SGLang compatibility programs whose checks do not read the model's text."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "e2e"))
    from server_harness import TINY_ARGS, start_server, stop_and_check

    srv = start_server(["--model-path", tiny_chat_path, *TINY_ARGS], name="tiny")
    yield srv
    stop_and_check(srv)


@pytest.fixture(scope="session")
def make_engine(smol_path):
    """Factory for fp32 engines on SmolLM2 (or `model_path=`); every engine made is shut down (and
    checked) at the end."""
    import radixlm

    made = []

    def factory(**kwargs):
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("max_total_tokens", 20000)
        kwargs.setdefault("context_length", 2048)
        kwargs.setdefault("model_path", smol_path)
        eng = radixlm.Engine(**kwargs)
        made.append(eng)
        return eng

    yield factory
    for eng in made:
        eng.shutdown()


@pytest.fixture(scope="session")
def engine(make_engine):
    """The default fp32 engine, shared by tests that do not change server arguments."""
    return make_engine()


@pytest.fixture
def integrity():
    """`integrity(engine)` ends every engine test: wait until idle, then the KV integrity check
    (free + cached + in use == capacity, no slot in two places, no lock or row left behind)."""

    def check(eng) -> None:
        eng.wait_idle()
        eng.check_integrity()

    return check


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, except that the modules of SHARED_SERVER_MODULES are one unit of work
    together (one worker runs them all, on one main_server and one tiny_server), and units go
    out longest first."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedServersTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    # units in collection order (longest first, pytest_collection_modifyitems), not xdist's
    # default order by number of tests
    config.option.loadscopereorder = False
    return SharedServersTogether(config, log)

"""The clients venv (`.venv-sglang`, gitignored): third-party frontends and client SDKs that the
compatibility tests drive, kept out of radixlm's own venv because their pins fight ours.

- the real SGLang frontend: PyPI `sglang` (pinned, `--no-deps`: its declared dependencies are
  the whole GPU server) plus the few small packages its client side imports;
- `litellm` (its pins want openai 2.x and huggingface-hub 1.x; radixlm's venv has 3.x and 2.x)
  and `google-genai`, for radixlm's LiteLLM and VertexAI backends.

The venv is layered on radixlm's: a `.pth` file puts radixlm's site-packages after its own, so
torch, transformers, numpy, requests, ... are reused, not installed again, and what it installs
shadows radixlm's versions only inside it. Creation is idempotent and cached: a stamp records
what was installed; a matching stamp means nothing to do. A file lock serializes concurrent
creators. Run `python tests/sglang_compat/clients_venv.py` to create it ahead of `make test`.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV = os.path.join(ROOT, ".venv-sglang")
SGLANG = "sglang==0.5.23"
# what sglang's frontend imports that radixlm's venv lacks (the rest, e.g. torch, requests,
# numpy, transformers, orjson, pyzmq, pydantic, starlette, psutil, comes from radixlm's venv)
SGLANG_CLIENT_DEPS = ["aiohttp", "pybase64", "pillow", "msgspec", "IPython", "requests_toolbelt",
                      "partial_json_parser"]  # the last for sgl.separate_reasoning
CLIENT_SDKS = ["litellm", "google-genai"]  # for radixlm's LiteLLM and VertexAI backends
STAMP_NAME = ".compat-ready.json"


def venv_python(venv: str = VENV) -> str:
    return os.path.join(venv, "bin", "python")


def _spec(base_python: str) -> dict:
    return {"sglang": SGLANG, "client_deps": SGLANG_CLIENT_DEPS, "sdks": CLIENT_SDKS,
            "base": os.path.realpath(base_python)}


def _pip(base_python: str, target: str, args: list[str], constraints: str) -> None:
    # --no-compile: byte-compiling every installed file (litellm's thousands) cost 26 of the
    # install's 37 CPU-seconds; the two processes that import them compile what they use, ~2 s
    cmd = [base_python, "-m", "pip", "--python", target, "install", "-q", "--no-compile",
           "--disable-pip-version-check", "-c", constraints, *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def ensure(venv: str = VENV, base_python: str = sys.executable, log=print) -> str:
    """Create the clients venv unless a matching one exists; returns its python."""
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    stamp = os.path.join(venv, STAMP_NAME)
    spec = _spec(base_python)
    with open(venv + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(stamp) as f:
                if json.load(f) == spec and os.path.exists(venv_python(venv)):
                    return venv_python(venv)
        except (OSError, ValueError):
            pass
        t0 = time.perf_counter()
        log(f"creating {venv} ({SGLANG} + client SDKs; once, then cached)")
        if os.path.isdir(venv):
            shutil.rmtree(venv)
        subprocess.run([base_python, "-m", "venv", "--without-pip", venv], check=True)
        target = venv_python(venv)
        base_paths = subprocess.run(
            [base_python, "-c", "import sysconfig; p = sysconfig.get_paths(); "
             "print(p['purelib']); print(p['platlib'])"],
            capture_output=True, text=True, check=True).stdout.split()
        site = subprocess.run([target, "-c", "import sysconfig; print(sysconfig.get_paths()"
                               "['purelib'])"], capture_output=True, text=True,
                              check=True).stdout.strip()
        with open(os.path.join(site, "_radixlm_base_venv.pth"), "w") as f:
            f.write("\n".join(dict.fromkeys(base_paths)) + "\n")
        # never let a dependency replace torch (an open range pulls a multi-GB CUDA build)
        torch_version = subprocess.run([base_python, "-c", "import torch; print(torch.__version__)"],
                                       capture_output=True, text=True, check=True).stdout.strip()
        constraints = os.path.join(venv, "constraints.txt")
        with open(constraints, "w") as f:
            f.write(f"torch=={torch_version}\n")
        _pip(base_python, target, ["--no-deps", SGLANG], constraints)
        _pip(base_python, target, SGLANG_CLIENT_DEPS + CLIENT_SDKS, constraints)
        with open(stamp, "w") as f:
            json.dump(spec, f)
        log(f"created {venv} in {time.perf_counter() - t0:.0f} s")
        return target


if __name__ == "__main__":
    print(ensure())

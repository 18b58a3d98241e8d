"""Run the compatibility programs with one frontend against a server; write the results as JSON.

    python compat_runner.py --frontend sglang --url http://127.0.0.1:PORT \
        --real-model-url http://127.0.0.1:PORT2 --out results.json

`--frontend radixlm` imports `radixlm as sgl`; `--frontend sglang` imports the real SGLang
frontend (run it with the `.venv-sglang` interpreter). The programs in compat_programs.REAL_MODEL
run against `--real-model-url` (a server on a real model), the others against `--url`. Each
program's entry is its result, or `{"error": traceback}`; one program failing does not stop the
others.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def load_frontend(name: str):
    sgl = importlib.import_module({"radixlm": "radixlm", "sglang": "sglang"}[name])
    if name == "sglang":
        assert "radixlm" not in sys.modules, "the SGLang run must not load radixlm"
    return sgl


def run_all(sgl, url: str, real_model_url: str, only=None) -> dict:
    sys.path.insert(0, HERE)
    try:
        import compat_programs as programs
    finally:
        sys.path.remove(HERE)
    backend, real = (sgl.RuntimeEndpoint(u, chat_template_name=programs.CHAT_TEMPLATE)
                     for u in (url, real_model_url))
    previous = sgl.global_config.default_backend
    results = {"_frontend": {"module": sgl.__name__,
                             "version": getattr(sgl, "__version__", None),
                             "model_name": backend.get_model_name(),
                             "real_model_name": real.get_model_name()}}
    try:
        for name, fn in programs.PROGRAMS.items():
            if only and name not in only:
                continue
            sgl.set_default_backend(real if name in programs.REAL_MODEL else backend)
            t0 = time.perf_counter()
            try:
                results[name] = json.loads(json.dumps(fn(sgl)))  # tuples -> lists, as on disk
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            results[name]["seconds"] = round(time.perf_counter() - t0, 2)
    finally:
        sgl.global_config.default_backend = previous
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frontend", choices=["radixlm", "sglang"], required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--real-model-url", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    t0 = time.perf_counter()
    sgl = load_frontend(args.frontend)
    import_s = time.perf_counter() - t0
    results = run_all(sgl, args.url, args.real_model_url, args.only)
    results["_frontend"]["import_seconds"] = round(import_s, 2)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

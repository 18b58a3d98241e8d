"""SGLang's informational and control routes: /get_model_info (/model_info), /get_server_info
(/server_info), /start_profile + /stop_profile, /update_weights_from_disk.

The admin routes (ADMIN_PATHS, with /flush_cache and /abort_request of http_server.py) take
--admin-api-key when it is set, else --api-key (http_server._Guard); with neither key they answer
only when the server is bound to a loopback host. The paths they accept are confined to the
folders of --update-weights-allowed-dirs and --profile-allowed-dirs (symlinks resolved).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import tempfile

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixlm.server.generate_fields import DEFAULT_ONLY, HONOURED, check_fields
from radixlm.server.native_api import error, json_body

# SGLang's ProfileReq fields (io_struct.py)
PROFILE_FIELDS = {
    "output_dir": (HONOURED, None, "the trace's folder (default $SGLANG_TORCH_PROFILER_DIR "
                                   "or /tmp)"),
    "start_step": (HONOURED, None, "start after this many more scheduler steps"),
    "num_steps": (HONOURED, None, "stop by itself after this many steps"),
    "activities": (HONOURED, None, "CPU and/or GPU"),
    "with_stack": (HONOURED, None, "record Python stacks"),
    "record_shapes": (HONOURED, None, "record tensor shapes"),
    "profile_id": (HONOURED, None, "part of the trace's file name"),
    "profile_prefix": (HONOURED, None, "prefix of the trace's file name"),
    "profile_by_stage": (DEFAULT_ONLY, False, "per-stage profiles are not supported"),
    "merge_profiles": (DEFAULT_ONLY, False, "there is one rank: nothing to merge"),
    "profile_stages": (DEFAULT_ONLY, None, "per-stage profiles are not supported"),
    "detailed_annotations": (DEFAULT_ONLY, False, "detailed annotations are not supported"),
    "rid": (HONOURED, None, "ignored"), "http_worker_ipc": (HONOURED, None, "ignored"),
}
# SGLang's UpdateWeightFromDiskReqInput fields
UPDATE_FIELDS = {
    "model_path": (HONOURED, None, "folder or .gguf file of the new weights"),
    "load_format": (HONOURED, None, "auto | safetensors | gguf"),
    "abort_all_requests": (HONOURED, False, "abort running requests instead of draining them"),
    "weight_version": (HONOURED, None, "reported in /get_model_info and meta_info"),
    "flush_cache": (HONOURED, True, "flush the radix cache (its KV is from the old weights)"),
    "is_async": (DEFAULT_ONLY, False, "updates are synchronous"),
    "torch_empty_cache": (HONOURED, False, "no effect: nothing is reallocated"),
    "keep_pause": (DEFAULT_ONLY, False, "pausing is not exposed"),
    "recapture_cuda_graph": (HONOURED, False, "no effect: weights are updated in place"),
    "token_step": (HONOURED, 0, "ignored"),
    "manifest": (DEFAULT_ONLY, None, "weight manifests are not supported"),
    "rid": (HONOURED, None, "ignored"), "http_worker_ipc": (HONOURED, None, "ignored"),
}


ADMIN_PATHS = frozenset({"/update_weights_from_disk", "/start_profile", "/stop_profile",
                         "/flush_cache", "/abort_request"})
ADMIN_DISABLED = ("admin routes are disabled: the server listens on a non-loopback host "
                  "without a key; start it with --admin-api-key (or --api-key) to enable them")


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def admin_key(args):
    """The key admin routes require (None: no key; then only a loopback bind serves them)."""
    return getattr(args, "admin_api_key", None) or args.api_key


def _dirs(flag, default) -> list[str]:
    raw = [d.strip() for d in flag.split(",")] if flag else [default] if default else []
    return [os.path.realpath(d) for d in raw if d]


def allowed_dirs(tm, args) -> dict[str, list[str]]:
    """field -> the resolved folders its path must lie in, fixed at start-up."""
    model = getattr(tm, "model_path", None)
    if model and not os.path.isdir(model):
        model = os.path.dirname(os.path.abspath(model))  # a .gguf file: its folder
    trace = os.environ.get("SGLANG_TORCH_PROFILER_DIR") or tempfile.gettempdir()
    return {"model_path": _dirs(getattr(args, "update_weights_allowed_dirs", None), model),
            "output_dir": _dirs(getattr(args, "profile_allowed_dirs", None), trace)}


def check_path(field: str, value, dirs: list[str], flag: str) -> None:
    """ValueError naming `field` unless `value` (symlinks resolved) lies in one of `dirs`."""
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field}: must be a non-empty string (got {value!r})")
    real = os.path.realpath(value)
    if not any(real == d or real.startswith(d.rstrip(os.sep) + os.sep) for d in dirs):
        raise ValueError(f"{field}: {value!r} is outside the allowed folders {dirs} "
                         f"(set {flag} at start-up)")


async def _optional_body(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        return {}
    body = await json_body(request)
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    return body


def register_admin_routes(app: FastAPI, tm, args) -> None:
    dirs = allowed_dirs(tm, args)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        hf = tm.info.get("hf_config") or {}
        return {"model_path": tm.model_path, "served_model_name": tm.model_name,
                "tokenizer_path": args.tokenizer_path or tm.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": tm.weight_version,
                "load_format": tm.info.get("load_format"),
                "reasoning_parser": getattr(args, "reasoning_parser", None),
                "tool_call_parser": args.tool_call_parser, "disaggregation_mode": "null",
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": hf.get("model_type"), "architectures": hf.get("architectures"),
                "context_length": tm.context_len, "eos_token_ids": tm.info["eos_token_ids"]}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        info = dataclasses.asdict(args)
        for secret in ("api_key", "admin_api_key"):  # secrets never leave the server
            info.pop(secret, None)
        info["internal_states"] = [await tm.control("get_stats")]
        info["open_requests"] = len(getattr(tm, "states", ()))  # the HTTP side's open requests
        info["max_total_num_tokens"] = tm.info["max_total_tokens"]
        info["device"], info["dtype"] = tm.info["device"], tm.info["dtype"]  # resolved, not "auto"
        info["version"] = __import__("radixlm").__version__
        return info

    @app.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(request: Request):
        try:
            body = check_fields(await _optional_body(request), PROFILE_FIELDS)
            for k in ("start_step", "num_steps"):
                v = body.get(k)
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                    raise ValueError(f"{k}: must be a positive integer (got {v!r})")
            check_path("output_dir", body.get("output_dir"), dirs["output_dir"],
                       "--profile-allowed-dirs")
            for k in ("profile_id", "profile_prefix"):  # parts of the file name, not a path
                v = body.get(k)
                if v is not None and ("/" in str(v) or "\\" in str(v)):
                    raise ValueError(f"{k}: must not contain a path separator (got {v!r})")
            path = await tm.control("start_profile", body)
        except ValueError as e:
            return error(400, str(e))
        return Response(f"Start profiling. The trace will be written to {path}\n",
                        status_code=200)

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile():
        try:
            path = await tm.control("stop_profile", timeout=300.0)
        except ValueError as e:
            return error(400, str(e))
        return Response(f"Stop profiling. Trace written to {path}\n", status_code=200)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        try:
            body = check_fields(await _optional_body(request), UPDATE_FIELDS)
            check_path("model_path", body.get("model_path"), dirs["model_path"],
                       "--update-weights-allowed-dirs")
            result = await tm.update_weights_from_disk(body)
            if body.get("weight_version"):
                tm.weight_version = str(body["weight_version"])
            return JSONResponse(result)
        except ValueError as e:
            return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0},
                                status_code=400)
        except Exception as e:  # the scheduler failed (and restored the old weights)
            return JSONResponse({"success": False, "message": f"{type(e).__name__}: {e}",
                                 "num_paused_requests": 0}, status_code=500)

"""Control requests the scheduler process runs besides generation: the torch profiler
(/start_profile, /stop_profile) and reloading weights in place (/update_weights_from_disk).

Both run on the scheduler's own thread, between steps, so they never race a forward.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

import torch

from radixlm.runtime.config import ModelConfig
from radixlm.runtime.mem_cache.hicache_config import rekey_storage
from radixlm.runtime.models import loader

logger = logging.getLogger(__name__)

PROFILE_ACTIVITIES = ("CPU", "GPU")


class Profiler:
    """torch.profiler around the scheduler's steps; the trace goes to `output_dir` as
    `<prefix><profile_id>-TP-0.trace.json.gz` (SGLang's file name), readable by Perfetto or
    chrome://tracing. With num_steps it stops by itself after that many steps."""

    def __init__(self):
        self.prof: Optional[torch.profiler.profile] = None
        self.path: Optional[str] = None
        self.steps_left: Optional[int] = None
        self.wait_steps = 0
        self.pending: Optional[dict] = None
        self.last_trace: Optional[str] = None

    @property
    def active(self) -> bool:
        return self.prof is not None or self.pending is not None

    def start(self, req: dict) -> str:
        if self.active:
            raise ValueError("a profile is already running; POST /stop_profile first")
        out_dir = req.get("output_dir") or os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp")
        os.makedirs(out_dir, exist_ok=True)
        acts = req.get("activities") or list(PROFILE_ACTIVITIES)
        bad = [a for a in acts if a not in PROFILE_ACTIVITIES]
        if bad:
            raise ValueError(f"activities: {bad} are not supported (use {list(PROFILE_ACTIVITIES)})")
        name = f"{req.get('profile_prefix') or ''}{req.get('profile_id') or int(time.time())}"
        cfg = {"path": os.path.join(out_dir, f"{name}-TP-0.trace.json.gz"), "acts": acts,
               "with_stack": bool(req.get("with_stack")),
               "record_shapes": bool(req.get("record_shapes")),
               "num_steps": req.get("num_steps")}
        self.wait_steps = int(req.get("start_step") or 0)
        if self.wait_steps > 0:
            self.pending = cfg
        else:
            self._begin(cfg)
        return cfg["path"]

    def _begin(self, cfg: dict) -> None:
        kinds = {"CPU": torch.profiler.ProfilerActivity.CPU}
        if torch.cuda.is_available():
            kinds["GPU"] = torch.profiler.ProfilerActivity.CUDA
        activities = [kinds[a] for a in cfg["acts"] if a in kinds]
        self.prof = torch.profiler.profile(activities=activities, with_stack=cfg["with_stack"],
                                           record_shapes=cfg["record_shapes"])
        self.prof.start()
        self.path, self.steps_left, self.pending = cfg["path"], cfg["num_steps"], None

    def stop(self) -> str:
        if self.pending is not None:  # never started: nothing recorded
            self.pending = None
            raise ValueError("the profile had not started yet (start_step not reached)")
        if self.prof is None:
            raise ValueError("no profile is running; POST /start_profile first")
        prof, path = self.prof, self.path
        self.prof = self.path = self.steps_left = None
        prof.stop()
        prof.export_chrome_trace(path)
        self.last_trace = path
        logger.info("profile written to %s", path)
        return path

    def on_step(self) -> None:
        """Called after each scheduler step: counts start_step down and num_steps down."""
        if self.pending is not None:
            self.wait_steps -= 1
            if self.wait_steps <= 0:
                self._begin(self.pending)
            return
        if self.prof is not None and self.steps_left is not None:
            self.steps_left -= 1
            if self.steps_left <= 0:
                self.stop()


def update_weights_from_disk(runner, scheduler, req: dict) -> dict:
    """Load new weights of the same architecture in place (no restart). Requires an idle
    scheduler (the TokenizerManager holds new requests back and drains running ones first).
    The radix cache is flushed: its KV was computed with the old weights. If loading fails
    half-way the old weights are loaded back."""
    if runner.tp.size > 1:  # the shards would need reloading and re-splitting on every rank
        raise ValueError("update_weights_from_disk is not supported with tp_size > 1 yet")
    path = req.get("model_path")
    if not isinstance(path, str) or not path:
        raise ValueError("model_path: required (a folder or .gguf file)")
    if not os.path.exists(path):
        raise ValueError(f"model_path: {path!r} does not exist")
    if not scheduler.is_idle():
        raise ValueError("requests are running; retry, or pass abort_all_requests")
    try:
        fmt = loader.resolve_load_format(path, req.get("load_format") or "auto")
        new_cfg = ModelConfig.from_hf(loader.load_hf_config(path, fmt))
    except (OSError, KeyError, ValueError) as e:  # not a model folder / file we can read
        raise ValueError(f"model_path: cannot read a model config from {path!r}: {e}") from None
    if fmt == "dummy":
        raise ValueError("load_format: dummy has no weights to load")
    old = runner.model_config
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "tie_word_embeddings", "attention_bias"):
        if getattr(new_cfg, f) != getattr(old, f):
            raise ValueError(f"model_path: {f} is {getattr(new_cfg, f)} there but "
                             f"{getattr(old, f)} in the served model; weights of another "
                             f"architecture need a restart")
    old_path, old_fmt = runner.model_path, runner.load_format

    def load(p: str, f: str) -> None:
        if getattr(runner, "keep_quantized", False):  # GGUF blocks (layers/quantized_linear)
            from radixlm.runtime.layers import quantized_linear

            quantized_linear.reload_weights(runner.model, p, f, runner.dtype)
        elif getattr(runner, "int4", None) is not None:  # int4 (models/int4_checkpoint)
            from radixlm.runtime.models import int4_checkpoint

            int4_checkpoint.reload_weights(runner.model, p, f, loader.load_hf_config(p, f),
                                           runner.dtype, runner.int4)
        elif getattr(runner, "fp8", None) is not None:  # FP8 checkpoint (models/fp8_checkpoint)
            from radixlm.runtime.models import fp8_checkpoint

            fp8_checkpoint.reload_weights(runner.model, p, f, loader.load_hf_config(p, f),
                                          runner.dtype, runner.fp8)
        else:
            runner.model.load_weights(loader.iter_weights(p, f, runner.dtype))
        if getattr(runner, "cpu_packed", False):  # the packed copies follow the new weights
            from radixlm.runtime.layers import cpu_packed

            cpu_packed.repack_model(runner.model)

    t0 = time.perf_counter()
    try:
        load(path, fmt)
    except Exception as e:
        logger.error("weight update from %s failed (%s); restoring %s", path, e, old_path)
        load(old_path, old_fmt)
        raise ValueError(f"loading the weights failed, the old ones are back: {e}") from None
    runner.model_path, runner.load_format = path, fmt
    rekey_storage(scheduler.tree_cache, runner)  # stored pages are the old weights' KV
    if req.get("flush_cache", True):
        scheduler.flush_cache()
    return {"success": True, "num_paused_requests": 0,
            "message": f"Succeeded to update model weights from {path} "
                       f"in {time.perf_counter() - t0:.1f}s."}

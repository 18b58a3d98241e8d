"""Attention backends by name (`--attention-backend`), imported lazily so that e.g. the CPU path
never imports triton and a missing optional dependency only matters to the backend that needs it.

`auto` picks the fast backend of the device: `triton` on CUDA, `cpu` (C++ kernels) on the CPU.
On the CPU, when the kernels cannot be built or loaded (no compiler, RADIXLM_DISABLE_CPU_KERNELS=1)
`auto` falls back to `torch_native` with ONE logged warning naming the reason, never silently;
`cpu` asked for by name raises instead.

Models whose pool is the MLA latent (DeepSeek-V2/V3) get attention/mla_backend.MLAAttention
(`create_mla_backend`): `auto` and `torch_native` mean its torch decode, `triton` its Triton
decode kernel; `cpu` is refused (mla_backend.check_mla_args).
"""

from __future__ import annotations

import importlib

import torch

from radixlm.runtime.attention.base import AttentionBackend, AttentionSpec

BACKENDS = {
    "torch_native": "radixlm.runtime.attention.torch_native:TorchNativeAttention",
    "triton": "radixlm.runtime.attention.triton_backend:TritonAttention",
    "cpu": "radixlm.runtime.attention.cpu_backend:CpuAttention",
}
# which backend `auto` means on each device type; flipped to the fast backends as they land
AUTO = {"cuda": "triton", "cpu": "cpu"}


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name == "auto":
        name = AUTO.get(device.type, "torch_native")
        if name == "cpu" and (err := _cpu_kernels_error()) is not None:
            from radixlm.runtime.attention.cpu_kernels import warn_fallback
            warn_fallback(err)  # once per process
            return "torch_native"
        return name
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of auto, {', '.join(BACKENDS)} "
                         f"(got {name!r})")
    if name == "triton" and device.type != "cuda" and not _triton_interpreted():
        raise ValueError("attention_backend 'triton' needs a CUDA device "
                         "(or TRITON_INTERPRET=1 for tests)")
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("attention_backend 'cpu' needs the CPU device")
        if (err := _cpu_kernels_error()) is not None:
            raise ValueError(f"attention_backend 'cpu': the kernels are unavailable: {err}")
    return name


def _cpu_kernels_error():
    """None when the CPU kernels load (built once, cached on disk), else the reason."""
    try:
        from radixlm.runtime.attention import cpu_kernels
        cpu_kernels.load()  # raises CpuKernelsUnavailable with the reason
        return None
    except Exception as e:  # noqa: BLE001 - whatever the cause, the kernels are unavailable
        return str(e) or type(e).__name__


def _triton_interpreted() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET") == "1"


def create_attention_backend(name: str, kv_pool, req_to_token: torch.Tensor,
                             spec: AttentionSpec, device: torch.device, max_batch_size: int,
                             max_context_len: int) -> AttentionBackend:
    """Build the backend `name` (already resolved, see resolve_backend_name) for a model whose
    attention is `spec` (scale, per-layer sliding windows, logit soft-cap: every backend runs
    them all)."""
    module, cls = BACKENDS[name].split(":")
    backend_cls = getattr(importlib.import_module(module), cls)
    return backend_cls(kv_pool, req_to_token, spec.scale, max_batch_size=max_batch_size,
                       max_context_len=max_context_len, windows=spec.windows or None,
                       logit_softcap=spec.logit_softcap)


def resolve_mla_backend_name(name: str, device: torch.device) -> str:
    """The MLA decode kernel `name` means: "torch" or "triton" (auto: triton on CUDA)."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "torch_native":
        return "torch"
    if name == "triton":
        resolve_backend_name(name, device)  # the same device check as the MHA kernels
        return "triton"
    raise ValueError(f"attention_backend {name!r} has no MLA implementation "
                     "(MLA models run auto, torch_native or triton)")


def create_mla_backend(kernel: str, kv_pool, req_to_token: torch.Tensor, spec: AttentionSpec,
                       max_batch_size: int, max_context_len: int) -> AttentionBackend:
    from radixlm.runtime.attention.mla_backend import MLAAttention

    return MLAAttention(kv_pool, req_to_token, spec.scale, max_batch_size=max_batch_size,
                        max_context_len=max_context_len, windows=spec.windows or None,
                        logit_softcap=spec.logit_softcap, decode_kernel=kernel)

"""GGUF weights kept quantized on the CPU: linear layers that multiply by Q4_1 / Q8_0 / Q4_K /
Q6_K blocks in their on-disk layout (the C++ kernel of layers/quant_kernels.py) instead of by dense
weights dequantized at load.

Why: decode is memory-bound. The dense CPU path streams fp32 weights (layers/cpu_linear.py):
SmolLM2-135M's Q4_1 layers are ~6.4x fewer bytes than their fp32 copies, and the Q8_0 head
~3.8x fewer. The kernel dequantizes each block in registers and FMAs in fp32, so it computes the
dequantized model's matmul up to summation order. Prefill (many rows) dequantizes tiles or
chunks of the blocks into fp32 scratch feeding a BLAS GEMM (see DIRECT_MAX_M / TILED_MAX_M).
Measurements: benchmarks/quantized_cpu.py, results in benchmarks/results/quantized_cpu-cpu.jsonl.

The switch is ServerArgs.gguf_keep_quantized ("auto" | "on" | "off"), overridden by the
environment variable RADIXLM_GGUF_KEEP_QUANTIZED (same values). It applies to GGUF files on the
CPU only; `on` on CUDA or under tensor parallelism is an error (no GPU kernel; sharding splits
dense weights). `auto` turns it on where the benchmark shows it faster: on a CPU whose kernel
build has the AVX2+FMA path, or AVX-512 (isa "avx512": Q4_1 / Q8_0 with the block scales
factored out; "avx512bf16": also Q4_1 times bf16 activations by VDPBF16PS) (the generic scalar
build is correct but was never measured faster, so auto leaves it off). If the kernel cannot be built, `auto` logs ONE warning and dequantizes as
before; `on` raises. Memory: SmolLM2's engine RSS drops from ~940 MB to ~470 MB (no fp32 copies).

Dense rows (`auto`, bf16, a CPU with native bf16 matmul: avx512_bf16 / AMX): there oneDNN's bf16
GEMM beats the kernel's dequantize-then-GEMM paths for many rows (an AVX512-BF16 EPYC, SmolLM2:
512-token prefill 0.56 s dense vs 1.03 s from blocks; 32 x 200-token prefill 7.3 vs 14.9 s;
batch-32 decode 130 vs 210 ms a step) while the direct kernel still wins for few rows (batch-1
decode 1.9x, batch-8 1.3x). So each layer also keeps the dense bf16 weight, loaded as without
blocks, and takes it for x with more than DIRECT_MAX_M rows (the LM head: the embedding when tied,
else lm_head). The blocks add ~30% to the dense model's memory there (and layers/cpu_packed's
prepacked copies of the dense weights another 100%). `on` keeps blocks only (the memory-saving
choice).

What changes in the model (llama.py's module tree): every decoder projection whose GGUF tensors
are all in a supported format becomes a QuantizedLinear; q/k/v and gate/up keep their fusion by
concatenating block rows (rows are independent, blocks run along K). The LM head (the GGUF's
`output.weight`, or the Q8_0 embedding when tied) becomes `model.lm_head_quant`; the embedding
lookup keeps its dense table. Other tensors (norms, F32 / F16 / other quant types) load dense.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.layers import cpu_linear, cpu_packed, quant_kernels

logger = logging.getLogger(__name__)

ENV_VAR = "RADIXLM_GGUF_KEEP_QUANTIZED"
SETTINGS = ("auto", "on", "off")
# The kernel's three paths by rows of x (M), from benchmarks/quantized_cpu.py on the AVX2 EPYC:
#   M <= 16    gemm: the direct FMA loop (2.5-6x the fp32 GEMM: it reads 4-8x fewer bytes)
#   M <= 256   gemm_tiled: per-thread L2-sized dequantized tiles + single-threaded BLAS GEMMs
#   larger     gemm_chunked: 16 MiB dequantized chunks + one multithreaded BLAS GEMM each
DIRECT_MAX_M = 16
TILED_MAX_M = 256
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_SINGLE = {"o_proj": "o_proj", "down_proj": "down_proj"}
_BLOCKS_FILE = "blocks-v2.safetensors"  # v2: Q6_K too


def _setting(setting: str) -> str:
    """ServerArgs.gguf_keep_quantized, unless the env var says otherwise; checked."""
    setting = os.environ.get(ENV_VAR, "").strip().lower() or setting
    if setting not in SETTINGS:
        raise ValueError(f"gguf_keep_quantized / {ENV_VAR} must be one of {', '.join(SETTINGS)} "
                         f"(got {setting!r})")
    return setting


def keep_quantized(setting: str, device: torch.device, load_format: str, tp_size: int = 1) -> bool:
    """Resolve the switch. `setting` is ServerArgs.gguf_keep_quantized; the env var wins."""
    setting = _setting(setting)
    if setting == "off" or load_format != "gguf":
        return False
    if tp_size > 1:  # distributed/sharding splits dense weights only
        if setting == "on":
            raise ValueError("gguf_keep_quantized=on does not support tensor parallelism "
                             f"(tp_size={tp_size}); use auto or off")
        return False
    if device.type != "cpu":
        if setting == "on":
            raise ValueError(f"gguf_keep_quantized=on is CPU-only (device {device}): there is no "
                             "GPU kernel for GGUF blocks; use auto or off")
        return False
    try:
        isa = quant_kernels.load().isa()
    except quant_kernels.QuantKernelsUnavailable as e:
        if setting == "on":
            raise RuntimeError(f"gguf_keep_quantized=on but the quantized CPU GEMM is "
                               f"unavailable: {e}") from None
        quant_kernels.warn_fallback(str(e))
        return False
    return setting == "on" or isa in ("avx2", "avx512", "avx512bf16")


def keep_dense_rows(setting: str, device: torch.device, dtype: torch.dtype) -> bool:
    """With keep_quantized on: also keep dense weights for inputs of many rows (see the module
    docstring). Only for `auto` (the env var wins, as in keep_quantized), bf16, and a CPU with
    native bf16 matmul."""
    return (_setting(setting) == "auto" and device.type == "cpu" and dtype == torch.bfloat16
            and cpu_linear.cpu_has_native_bf16_matmul())


def gguf_file(model_path: str) -> str:
    """The .gguf file of a model path (the file itself, or the one in a folder)."""
    from radixlm.runtime.models.gguf_loader import gguf_file_in

    return model_path if os.path.isfile(model_path) else gguf_file_in(model_path)


class QuantizedLinear(nn.Module):
    """y (T, out) = x (T, in) @ dequant(blocks)^T + bias, in x's dtype (fp32 accumulation, one
    rounding at the end, like cpu_linear.Fp32GemmLinear). `blocks` (out, row_bytes) uint8 is a
    buffer: `.to(dtype)` leaves it alone. `bias` (out,) is a parameter filled by load_weights."""

    def __init__(self, blocks: torch.Tensor, fmt: int, in_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, dense_rows: bool = False):
        super().__init__()
        name, bk, nbytes = quant_kernels.FORMATS[fmt]
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or in_features % bk \
                or blocks.shape[1] != in_features // bk * nbytes:
            raise ValueError(f"{name} blocks {tuple(blocks.shape)} {blocks.dtype} do not hold "
                             f"rows of {in_features} values")
        self.fmt, self.fmt_name = fmt, name
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype),
                                 requires_grad=False) if bias else None
        # dense_rows: (out, in) `dtype` weight too, loaded by the model's load_weights like an
        # nn.Linear's, used for inputs of more than DIRECT_MAX_M rows
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=dtype),
                                   requires_grad=False) if dense_rows else None
        self.packed: Optional[torch.Tensor] = None  # `weight` prepacked (layers/cpu_packed)

    sources: tuple[str, ...] = ()  # the HF names whose block rows it holds, in row order
    gate_up: bool = False  # an MLP's [gate; up] rows: the dense pack pairs them

    def repack(self) -> None:
        """Refresh `packed` from the dense `weight` (cpu_packed.repack_model calls it after a
        load or a weight update)."""
        if self.weight is not None:
            self.packed = cpu_packed.pack(self.weight, gate_up=self.gate_up and self.bias is None)

    def dense_pack(self, x: torch.Tensor):
        """The pack that forward multiplies x by (its dense rows, for more than DIRECT_MAX_M
        rows), else None (the block kernels run)."""
        if self.weight is not None and x.numel() > DIRECT_MAX_M * self.in_features:
            return self.packed
        return None

    def forward_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) any float dtype -> (..., out) float32."""
        x2 = x.reshape(-1, self.in_features)
        op = quant_kernels.load()
        m = x2.shape[0]
        fn = op.gemm if m <= DIRECT_MAX_M else op.gemm_tiled if m <= TILED_MAX_M else op.gemm_chunked
        y = fn(x2, self.blocks, self.fmt, self.in_features)
        if self.bias is not None:
            y += self.bias.float()
        return y.view(*x.shape[:-1], self.out_features)

    def forward_rounded(self, x: torch.Tensor) -> torch.Tensor:
        """forward_fp32(x).to(x.dtype).float(): (..., in) -> (..., out) float32 holding values of
        x's dtype (a model's logits). Few rows round in the kernel's call (no two casts of the
        vocabulary-wide rows, each an OpenMP region)."""
        x2 = x.reshape(-1, self.in_features)
        if self.bias is None and x2.shape[0] <= DIRECT_MAX_M and x.dtype != torch.float32:
            y = quant_kernels.load().gemm_rounded(x2, self.blocks, self.fmt, self.in_features)
            return y.view(*x.shape[:-1], self.out_features)
        out = self.forward_fp32(x)
        return out if x.dtype == torch.float32 else out.to(x.dtype).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and x.numel() > DIRECT_MAX_M * self.in_features:
            if self.packed is not None:
                return cpu_packed.linear(x, self.packed, self.bias)
            return F.linear(x, self.weight, self.bias)
        return self.forward_fp32(x).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, {self.fmt_name}, "
                f"bias={self.bias is not None}, dense_rows={self.weight is not None}")


def load_blocks(gguf_file: str) -> dict[str, tuple[int, torch.Tensor]]:
    """HF name -> (ggml type id, (rows, row_bytes) uint8) of every tensor in a supported format.
    From the start-up cache (models/cache.py's entry for the file) when it can: parsing the GGUF
    header again costs 1.7-6 s on SmolLM2; the cached file reads in ~0.1 s."""
    from radixlm.runtime.models import cache

    c = cache.try_cache(gguf_file)
    if c is None:
        return _blocks_from_gguf(gguf_file)
    path = os.path.join(c.entry, _BLOCKS_FILE)

    def load():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(path, framework="pt") as f:
                types = json.loads(f.metadata()["types"])
                return {n: (int(types[n]), f.get_tensor(n)) for n in f.keys()}
        except FileNotFoundError:
            return None
        except (SafetensorError, OSError, ValueError, KeyError) as e:
            logger.warning("cache file %s is damaged (%s); rebuilding it", path, e)
            return None

    def save(blocks):
        from safetensors.torch import save

        from radixlm.runtime.models.safetensors_stream import atomic_file

        meta = {"types": json.dumps({n: t for n, (t, _) in blocks.items()})}
        with atomic_file(path) as f:
            f.write(save({n: b for n, (_, b) in blocks.items()}, metadata=meta))

    return c._get(load, lambda: _blocks_from_gguf(gguf_file), save)


def _blocks_from_gguf(gguf_file: str) -> dict[str, tuple[int, torch.Tensor]]:
    import numpy as np

    from radixlm.runtime.models.gguf_loader import iter_gguf_blocks

    return {name: (t, torch.from_numpy(np.array(arr, dtype=np.uint8, copy=True)))
            for name, t, arr in iter_gguf_blocks(gguf_file, set(quant_kernels.FORMATS))}


def convert_model(model: nn.Module, gguf_file: str, dense_rows: bool = False) -> set[str]:
    """Swap llama.py's projections (and the LM head) for QuantizedLinear where the GGUF holds
    them in a supported format, in place, before the dense weights load. Returns the HF names
    now held as blocks only: the caller skips them when loading dense weights. `dense_rows`
    (keep_dense_rows): every layer keeps a dense weight too, so nothing is skipped, and the
    model's compute_logits takes the dense head for more than DIRECT_MAX_M rows."""
    blocks = load_blocks(gguf_file)
    covered: set[str] = set()
    dtype = next(model.parameters()).dtype
    for i, layer in enumerate(getattr(model, "layers", ())):
        pre = f"model.layers.{i}."
        groups: dict[tuple[str, str], list] = {}  # (parent attr, module attr) -> pieces in order
        for parent in ("self_attn", "mlp"):
            for hf, (target, pos) in _FUSED.items():
                name = f"{pre}{parent}.{hf}.weight"
                if name in blocks:
                    groups.setdefault((parent, target), [None] * (3 if target == "qkv_proj" else 2))
                    groups[(parent, target)][pos] = name
            for hf, target in _SINGLE.items():
                name = f"{pre}{parent}.{hf}.weight"
                if name in blocks:
                    groups[(parent, target)] = [name]
        for (parent, target), names in groups.items():
            owner = getattr(layer, parent, None)
            old = getattr(owner, target, None)
            types = {blocks[n][0] for n in names if n is not None}
            if not isinstance(old, nn.Linear) or None in names or len(types) != 1:
                continue  # a piece is dense or in another format: this layer stays dense
            w = torch.cat([blocks[n][1] for n in names]) if len(names) > 1 else blocks[names[0]][1]
            if w.shape[0] != old.out_features:
                raise ValueError(f"{pre}{parent}.{target}: GGUF rows {w.shape[0]} != "
                                 f"{old.out_features}")
            new = QuantizedLinear(w, types.pop(), old.in_features, bias=old.bias is not None,
                                  dtype=dtype, dense_rows=dense_rows)
            new.sources = tuple(names)
            new.gate_up = target == "gate_up_proj"
            setattr(owner, target, new)
            if not dense_rows:
                covered.update(names)
    head = "lm_head.weight" if getattr(model, "lm_head", None) is not None else "model.embed_tokens.weight"
    if head in blocks and hasattr(model, "lm_head_quant"):
        t, w = blocks[head]
        model.lm_head_quant = QuantizedLinear(w, t, w.shape[1] // quant_kernels.FORMATS[t][2]
                                              * quant_kernels.FORMATS[t][1])
        model.lm_head_quant.sources = (head,)
        model.lm_head_dense_above = DIRECT_MAX_M if dense_rows else None
        if head == "lm_head.weight" and not dense_rows:  # untied: the dense head is not needed
            model.lm_head = None
            covered.add(head)
    return covered


def reload_weights(model: nn.Module, model_path: str, load_format: str, dtype) -> None:
    """update_weights_from_disk for a model built by convert_model: every QuantizedLinear takes
    the new file's blocks for its source tensors (same formats and shapes, checked for all of
    them before any is written), the rest loads dense as usual."""
    from radixlm.runtime.models import loader

    if load_format != "gguf":
        raise ValueError("the served weights are kept quantized (gguf_keep_quantized): new "
                         "weights must be a GGUF file in the same formats")
    blocks = load_blocks(gguf_file(model_path))
    mods = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.sources]
    new = []
    for m in mods:
        got = [blocks.get(n) for n in m.sources]
        if any(g is None or g[0] != m.fmt for g in got):
            raise ValueError(f"{model_path}: {', '.join(m.sources)} not all in {m.fmt_name} "
                             "(the served model keeps them quantized in that format)")
        w = torch.cat([g[1] for g in got])
        if w.shape != m.blocks.shape:
            raise ValueError(f"{model_path}: {m.sources[0]} blocks {tuple(w.shape)} != "
                             f"{tuple(m.blocks.shape)}")
        new.append(w)
    # what loads dense anyway: the embedding, layers with dense rows, a head kept dense too
    held = {n for m in mods if m.weight is None for n in m.sources} - {"model.embed_tokens.weight"}
    if getattr(model, "lm_head", None) is not None:
        held.discard("lm_head.weight")
    weights = loader.iter_weights(model_path, load_format, dtype)
    model.load_weights((name, t) for name, t in weights if name not in held)
    for m, w in zip(mods, new):
        m.blocks.copy_(w)

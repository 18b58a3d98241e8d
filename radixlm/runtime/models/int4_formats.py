"""Unpacking the int4 tensors of AWQ, GPTQ and compressed-tensors checkpoints into one common
form (Int4Weight), and its exact dequantization.

The layouts (K = in_features, N = out_features, G = groups per row = ceil(K / group_size); a
"nibble i" of an int32 is bits [4i, 4i + 4), read unsigned whatever the int32's sign):
  AWQ ("gemm")   qweight [K, N/8] int32: nibble i of qweight[k, c] is column n = 8c + ORDER[i]
                 with AWQ's interleave ORDER = (0, 2, 4, 6, 1, 3, 5, 7); qzeros [G, N/8] int32
                 packed the same way; scales [G, N]. W[n, k] = (q - z) * s.
  GPTQ           qweight [K/8, N] int32: nibble i of qweight[r, n] is row k = 8r + i (packed
                 along K); qzeros [G, N/8] int32: nibble i of qzeros[g, c] is column 8c + i;
                 scales [G, N]; g_idx [K] int32 (the group of each input column; act-order
                 checkpoints permute it). checkpoint_format "gptq" (v1) stores zero - 1: the
                 zero is nibble + 1 (AutoGPTQ / vLLM's reading, so a stored 15 means 16);
                 "gptq_v2" stores the zero itself.
  compressed-tensors pack-quantized
                 weight_packed [N, ceil(K/8)] int32: nibble i of weight_packed[n, c] is column
                 k = 8c + i, holding q + 8 for the signed q in [-8, 7]; weight_scale [N, G];
                 weight_zero_point (asymmetric) [ceil(N/8), G] int32 packed along N (nibble i
                 of row r is output row 8r + i, holding zp + 8), or [N, G] int8 unpacked (older
                 writers); weight_g_idx [K] (actorder "group"); weight_shape [2] = (N, K).
                 W = (q - zp) * s, i.e. (nibble - zp nibble) * s.
Common form: q (N, K) uint8 in [0, 15] and z (N, G) int16 (0..16) with W = (q - z) * s, so
symmetric schemes have z = 8 everywhere (checked at load: a checkpoint claiming `sym` with other
zeros is refused)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from radixlm.runtime.models.int4_config import Int4Scheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column ORDER[i]
AWQ_UNORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of an AWQ word sits in nibble UNORDER[j]
SUFFIXES = {  # the tensors of one quantized layer `<prefix>.<suffix>`, per method
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx",
                           "weight_shape"),
}
PACKED_SUFFIX = {"awq": "qweight", "gptq": "qweight", "compressed-tensors": "weight_packed"}


@dataclass
class Int4Weight:
    """One linear layer's int4 weight in the common form: W (N, K) = (q - z[:, grp]) * s[:, grp]
    with grp = g_idx, or k // group_size when g_idx is None."""
    q: torch.Tensor  # (N, K) uint8 in [0, 15]
    z: torch.Tensor  # (N, G) int16 in [0, 16]
    s: torch.Tensor  # (N, G) the checkpoint's float dtype
    g_idx: Optional[torch.Tensor]  # (K,) int64 or None
    group_size: int  # columns per group (K: one group per row)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def groups(self) -> torch.Tensor:
        """(K,) int64: the group of each input column."""
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.q.shape[1]) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) `dtype`: (q - z) * s in fp32 (exact integers times the scale: one rounding),
        rounded once to `dtype`."""
        g = self.groups()
        zq = self.q.to(torch.int16) - self.z[:, g]
        return (zq.float() * self.s.float()[:, g]).to(dtype)


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(..., P) int32 -> (..., P, 8) uint8: nibble i of each word at [..., i]."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed int4 tensors are int32, got {packed.dtype}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def _groups_of(k: int, group_size: int) -> int:
    return -(-k // group_size)


def _check(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")


def _check_sym(name: str, z: torch.Tensor, scheme: Int4Scheme) -> None:
    if scheme.sym and bool((z != 8).any()):
        bad = int(z[z != 8][0])
        raise ValueError(f"{name}: quantization_config.sym / symmetric is true but a zero point "
                         f"is {bad}, not 8: the checkpoint contradicts its config")


def _g_idx(name: str, g: Optional[torch.Tensor], k: int, n_groups: int, group: int,
           required: bool) -> Optional[torch.Tensor]:
    """The stored group index as (K,) int64, None when absent or the trivial k // group."""
    if g is None:
        if required:
            raise ValueError(f"{name}: act-order (desc_act / actorder group) needs a g_idx tensor")
        return None
    g = g.reshape(-1).long()
    _check(name, g, (k,))
    if bool(((g < 0) | (g >= n_groups)).any()):
        raise ValueError(f"{name}: g_idx values outside [0, {n_groups})")
    if torch.equal(g, torch.arange(k) // group):
        return None
    return g


def read_awq(get: Callable[[str], Optional[torch.Tensor]], prefix: str,
             scheme: Int4Scheme) -> Int4Weight:
    qw, qz, s = get("qweight"), get("qzeros"), get("scales")
    if qw is None or qz is None or s is None:
        raise ValueError(f"{prefix}: AWQ layers need qweight, qzeros and scales")
    k, n = qw.shape[0], qw.shape[1] * 8
    group = scheme.group_size or k
    g = _groups_of(k, group)
    _check(f"{prefix}.qzeros", qz, (g, n // 8))
    _check(f"{prefix}.scales", s, (g, n))
    unorder = list(AWQ_UNORDER)
    q = nibbles(qw)[..., unorder].reshape(k, n).t().contiguous()  # (N, K)
    z = nibbles(qz)[..., unorder].reshape(g, n).t().to(torch.int16).contiguous()  # (N, G)
    return Int4Weight(q, z, s.t().contiguous(), None, group)


def read_gptq(get: Callable[[str], Optional[torch.Tensor]], prefix: str,
              scheme: Int4Scheme) -> Int4Weight:
    qw, qz, s = get("qweight"), get("qzeros"), get("scales")
    if qw is None or qz is None or s is None:
        raise ValueError(f"{prefix}: GPTQ layers need qweight, qzeros and scales")
    k, n = qw.shape[0] * 8, qw.shape[1]
    group = scheme.group_size or k
    g = _groups_of(k, group)
    _check(f"{prefix}.qzeros", qz, (g, n // 8))
    _check(f"{prefix}.scales", s, (g, n))
    q = nibbles(qw).permute(0, 2, 1).reshape(k, n).t().contiguous()  # (N, K)
    z = (nibbles(qz).reshape(g, n).to(torch.int16) + scheme.zero_offset).t().contiguous()
    _check_sym(f"{prefix}.qzeros", z, scheme)
    g_idx = _g_idx(f"{prefix}.g_idx", get("g_idx"), k, g, group, scheme.g_idx)
    return Int4Weight(q, z, s.t().contiguous(), g_idx, group)


def read_compressed(get: Callable[[str], Optional[torch.Tensor]], prefix: str,
                    scheme: Int4Scheme) -> Int4Weight:
    wp, s, shape = get("weight_packed"), get("weight_scale"), get("weight_shape")
    if wp is None or s is None or shape is None:
        raise ValueError(f"{prefix}: pack-quantized layers need weight_packed, weight_scale and "
                         "weight_shape")
    n, k = (int(v) for v in shape.reshape(-1).tolist())
    _check(f"{prefix}.weight_packed", wp, (n, -(-k // 8)))
    group = scheme.group_size or k
    g = _groups_of(k, group)
    _check(f"{prefix}.weight_scale", s, (n, g))
    q = nibbles(wp).reshape(n, -1)[:, :k].contiguous()  # (N, K): the stored q + 8
    zp = get("weight_zero_point")
    if zp is None:
        if not scheme.sym:
            raise ValueError(f"{prefix}: asymmetric weights need weight_zero_point")
        z = torch.full((n, g), 8, dtype=torch.int16)
    elif zp.dtype == torch.int32:  # packed along N: [ceil(N/8), G]
        _check(f"{prefix}.weight_zero_point", zp, (-(-n // 8), g))
        z = nibbles(zp).permute(0, 2, 1).reshape(-1, g)[:n].to(torch.int16).contiguous()
    elif zp.dtype == torch.int8:  # unpacked signed [N, G]
        _check(f"{prefix}.weight_zero_point", zp, (n, g))
        if bool(((zp < -8) | (zp > 7)).any()):
            raise ValueError(f"{prefix}.weight_zero_point: values outside [-8, 7]")
        z = zp.to(torch.int16) + 8
    else:
        raise ValueError(f"{prefix}.weight_zero_point: dtype {zp.dtype}, expected int32 "
                         "(packed) or int8")
    _check_sym(f"{prefix}.weight_zero_point", z, scheme)
    g_idx = _g_idx(f"{prefix}.weight_g_idx", get("weight_g_idx"), k, g, group, scheme.g_idx)
    return Int4Weight(q, z, s.contiguous(), g_idx, group)


READERS = {"awq": read_awq, "gptq": read_gptq, "compressed-tensors": read_compressed}


def read(scheme: Int4Scheme, prefix: str,
         get: Callable[[str], Optional[torch.Tensor]]) -> Int4Weight:
    """The layer `prefix`'s Int4Weight; `get(suffix)` returns its tensor or None."""
    w = READERS[scheme.method](get, prefix, scheme)
    if not w.s.is_floating_point() or not bool(torch.isfinite(w.s).all()):
        raise ValueError(f"{prefix}: scales must be finite floats")
    return w

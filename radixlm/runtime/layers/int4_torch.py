"""torch's own int4 kernels for Int4Linear (layers/int4_linear.py), the alternative to the
Triton kernels (ServerArgs.int4_linear=torch): `torch.ops.aten._weight_int4pack_mm`, the
"tinygemm" kernel of gpt-fast / torchao (CUDA SM80+, bf16 activations), after a repack at load.

The repack (facts of torch >= 2.5's ops, K = in, N = out, G = K / group):
  CUDA  `_convert_weight_to_int4pack(w (N, K/2) uint8, inner_k_tiles)` with
        w[n, j] = q[n, 2j] << 4 | q[n, 2j + 1] (the even column in the HIGH nibble), then
        `_weight_int4pack_mm(x (M, K) bf16, packed, group, scales_and_zeros)`
  CPU   `_convert_weight_to_int4pack_for_cpu(q (N, K) int32, inner_k_tiles)` and
        `_weight_int4pack_mm_for_cpu` (what the CPU tests check the mapping with)
  scales_and_zeros (G, N, 2) bf16, [..., 0] the scale, [..., 1] the "zero", with the math
        W[n, k] = (q - 8) * scale + zero      (torchao's groupwise affine, float zero domain)
  so our W = (q - z) * s maps to scale = s and zero = (8 - z) * s, both rounded to bf16: NOT
  the exact dequantized weight (a bf16 scale where the checkpoint has fp16, a rounded zero
  term), so this path is within a tolerance of the reference, never bit-equal to it.
Constraints: K % (16 * inner_k_tiles) == 0 (inner_k_tiles 8, 4 or 2), group in 32 / 64 / 128 /
256, N % 16 == 0 (the CPU op's; CUDA's needs 8); a layer that breaks them (one group per row)
keeps the Triton kernels.
"""

from __future__ import annotations

from typing import Optional

import torch

GROUPS = (32, 64, 128, 256)


def inner_k_tiles(k: int) -> Optional[int]:
    for t in (8, 4, 2):
        if k % (16 * t) == 0:
            return t
    return None


def supported(k: int, n: int, group: int) -> bool:
    return group in GROUPS and n % 16 == 0 and inner_k_tiles(k) is not None


def pack(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """q (N, K) in [0, 15] (the stored column order), zeros / scales (N, G) ->
    (packed weight for the op, scales_and_zeros (G, N, 2) bf16)."""
    n, k = q.shape
    tiles = inner_k_tiles(k)
    if q.is_cuda:
        q8 = q.to(torch.int32)
        w = (q8[:, ::2] << 4 | q8[:, 1::2]).to(torch.uint8)  # (N, K/2)
        packed = torch.ops.aten._convert_weight_to_int4pack(w.contiguous(), tiles)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).contiguous(), tiles)
    s = scales.float()
    sz = torch.stack([s, (8 - zeros.float()) * s], dim=2)  # (N, G, 2)
    return packed, sz.transpose(0, 1).to(torch.bfloat16).contiguous()


def matmul(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """x (M, K) any float dtype -> (M, N) bf16 (the op takes and gives bf16)."""
    x = x.to(torch.bfloat16).contiguous()
    if x.is_cuda:
        return torch.ops.aten._weight_int4pack_mm(x, packed, group, sz)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)

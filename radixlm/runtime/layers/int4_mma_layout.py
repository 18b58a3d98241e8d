"""The `mma` int4 layout of the tensor-core GEMV (layers/triton_int4_mma.py: 1-8 rows), its shape
rules and configs; torch only, no Triton.

The `mma` layout (pack(): built at load from int4_linear's pack_rows layout, the same bytes)
  words (N/16, K/64, 32, 4) int32: row tile rt (16 rows), chunk ch (64 k), lane l = 4g + c
  (g = l // 4, c = l % 4: PTX's groupID and threadID_in_group), k step j (16 k): a lane reads
  its 4 steps' words as one 16-byte load, a warp 512 contiguous bytes.
  Word (rt, ch, l, j) holds rows r0 = 16 rt + g, r1 = r0 + 8 at k = 64 ch + 16 j + 4 c + e:
      bits  0- 3: (r0, e=0)   16-19: (r0, e=1)      -> A register 0 (row g,   k slots 2c, 2c+1)
      bits  4- 7: (r1, e=0)   20-23: (r1, e=1)      -> A register 1 (row g+8, k slots 2c, 2c+1)
      bits  8-11: (r0, e=2)   24-27: (r0, e=3)      -> A register 2 (row g,   k slots 2c+8, +9)
      bits 12-15: (r1, e=2)   28-31: (r1, e=3)      -> A register 3 (row g+8, k slots 2c+8, +9)
  so register i = ((word >> 4i) & 0x000F000F) | magic, two 16-bit floats 128 + q (bf16) or
  1024 + q (fp16) exactly, minus the packed (magic + z): (q - z) exactly. B's k slots 2c, 2c+1
  / 2c+8, 2c+9 are the same k (4c + 0, 1 / 4c + 2, 3 of the step), so lane c's B registers are
  x's bf16 pairs at k = 16 j + 4 c: one 8-byte load a step.
  (PTX ISA, "Matrix fragments for mma.m16n8k16 with floating point type": A a0..a7 at row g
  (a0, a1, a4, a5) or g + 8 (a2, a3, a6, a7), column 2c + (i & 1) (+ 8 for a4..a7); B b0..b3
  at row 2c + (i & 1) (+ 8 for b2, b3), column g; C / D c0, c1 at (g, 2c + i), c2, c3 at
  (g + 8, 2c + i - 2).)
"""

from __future__ import annotations

import json
import os
from functools import lru_cache

import torch

# (R row tiles a program, WARPS, AHEAD units of words in flight a warp (1 or 2; optional, 1)):
# the default, and the measured best per GPU and layer shape (benchmarks/probes/
# int4_mma_bound.py): {device name: {"rows,K,group": config}}; under SILU R is 2 (the gate tile
# and its up tile) whatever the table says
DEFAULT = (1, 8, 1)
# the sweep of 2026-11-29 on an H200 under PDL (benchmarks/results/int4_mma_bound-gpu.jsonl):
# batch 1 at Llama-3.1-8B's qkv 7.76 us, o 5.38, [gate | up] 21.31, down 12.1 (without PDL
# 7.15, 6.09 at (1, 8, 1), 22.47, 12.85; the TMA GEMV 8.12, 6.19, 26.02, 14.07)
TUNED: dict = {
    "NVIDIA H200": {
        "6144,4096,128": (1, 8, 1), "4096,4096,128": (1, 8, 2),
        "28672,4096,128": (2, 4, 1), "4096,14336,128": (1, 16, 1),
    },
}
MAX_M = 8  # B's 8 columns
GROUPS = (32, 64, 128)
ENV_VAR = "RADIXLM_INT4_MMA_CONFIGS"  # a sweep's table (--configs-out) instead of TUNED


def config_for(rows: int, k: int, group: int, device_name: str = "") -> tuple:
    """(R, WARPS, AHEAD) for a layer of `rows` x K at `group` on `device_name`."""
    path = os.environ.get(ENV_VAR)
    table = _file_table(path) if path else TUNED
    cfg = table.get(device_name, {}).get(f"{rows},{k},{group}")
    return tuple(cfg) if cfg is not None else DEFAULT


@lru_cache(maxsize=None)
def _file_table(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def available(device: torch.device) -> bool:
    """mma.sync m16n8k16 bf16 and sub.bf16x2: compute capability 9.0 or newer (sub.bf16x2
    needs sm_90)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def supported(n: int, k: int, group: int, x_dtype: torch.dtype, silu: bool = False,
              r: int = DEFAULT[0]) -> bool:
    """Whole 16-row tiles (R of them a program; SILU: gate and up halves of 16-row tiles), whole
    64-value chunks, a group of 32, 64 or 128 (a unit's words stay in registers), bf16 or fp16
    activations (the MMA's operand types)."""
    n_out = n // 2 if silu else n
    tiles = n_out // 16
    return (n % 16 == 0 and n_out % 16 == 0 and k % 64 == 0 and group in GROUPS
            and k % group == 0 and x_dtype in (torch.bfloat16, torch.float16)
            and (silu or tiles % r == 0))


def dequant_ptx(kind: str, magic: int, tail: str) -> str:
    """The PTX of one lane's word -> its 4 A registers a0..a3 of exact (q - z) pairs (3 shifts,
    4 LOP3 into `magic` floats, 4 packed subtractions: the bits above), then `tail` (what the
    kernel does with a0..a3). Operands: $8 the word, $9 / $10 the packed (magic + z) of rows
    g / g + 8. kind: bf16 (magic 0x43004300) or f16 (0x64006400); lop3 0xEA = (a & b) | c."""
    return f"""{{
    .reg .b32 t0, t1, t2, a0, a1, a2, a3;
    shr.u32 t0, $8, 4;
    shr.u32 t1, $8, 8;
    shr.u32 t2, $8, 12;
    lop3.b32 a0, $8, 983055, {magic}, 234;
    lop3.b32 a1, t0, 983055, {magic}, 234;
    lop3.b32 a2, t1, 983055, {magic}, 234;
    lop3.b32 a3, t2, 983055, {magic}, 234;
    sub.rn.{kind}x2 a0, a0, $9;
    sub.rn.{kind}x2 a1, a1, $10;
    sub.rn.{kind}x2 a2, a2, $9;
    sub.rn.{kind}x2 a3, a3, $10;
{tail}
    }}"""


def pack(q: torch.Tensor) -> torch.Tensor:
    """q (N, K) values 0..15 -> words (N/16, K/64, 32, 4) int32 in the `mma` layout."""
    n, k = q.shape
    # q[16 rt + 8 h + g, 64 ch + 16 j + 4 c + e] -> [rt, ch, g, c, j, h, e]
    v = q.to(torch.int64).reshape(n // 16, 2, 8, k // 64, 4, 4, 4).permute(0, 3, 2, 5, 4, 1, 6)
    h = torch.arange(2, device=q.device)[:, None]
    e = torch.arange(4, device=q.device)[None, :]
    shift = 16 * (e % 2) + 4 * h + 8 * (e // 2)  # (h, e)
    words = (v << shift).sum(dim=(-2, -1))  # disjoint bits: sum == or
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32).reshape(n // 16, k // 64, 32, 4).contiguous()


def unpack(words: torch.Tensor) -> torch.Tensor:
    """pack undone: (N/16, K/64, 32, 4) int32 -> (N, K) uint8."""
    nt, kc = words.shape[:2]
    w = words.to(torch.int64).reshape(nt, kc, 8, 4, 4, 1, 1) & 0xFFFFFFFF
    h = torch.arange(2, device=words.device)[:, None]
    e = torch.arange(4, device=words.device)[None, :]
    q = (w >> (16 * (e % 2) + 4 * h + 8 * (e // 2))) & 0xF  # [rt, ch, g, c, j, h, e]
    return q.permute(0, 5, 2, 1, 4, 3, 6).reshape(nt * 16, kc * 64).to(torch.uint8)

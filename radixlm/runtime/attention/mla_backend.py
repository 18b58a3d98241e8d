"""Attention over DeepSeek's latent KV pool (multi-head latent attention, MLA).

The pool (mem_cache/kv_pool.MLAKVPool) keeps per token and layer only the latent
c = [c_kv (r) | k_pe (dr)], r = kv_lora_rank, dr = qk_rope_head_dim. Head h's key and value are
  k_h = [W_UK[h] c_kv | k_pe]  (dn + dr),   v_h = W_UV[h] c_kv  (dv)
with W_UK[h] (dn, r) and W_UV[h] (dv, r) the two halves of kv_b_proj's rows for head h. So
  q_h . k_h = (W_UK[h]^T q_nope_h) . c_kv + q_pe_h . k_pe
and sum_j p_j v_h,j = W_UV[h] (sum_j p_j c_kv,j): attention can run in either of two forms:
- absorbed: project the query into the latent space (q_lat = [W_UK^T q_nope | q_pe], r + dr per
  head), attend over the latent itself as one shared KV "head" (multi-query attention with
  value = c_kv), then bring the (r,) result out through W_UV. Reads each cached token once for
  all heads and expands nothing: the form for decode (memory-bound, one query per request).
- expanded: build k_h, v_h for every key of the request (prefix included) and run ordinary
  attention with head dims dn + dr and dv. Per query-key pair it costs H (dn + dr + dv)
  multiply-adds instead of H (2r + dr) (DeepSeek-V3: 320 vs 1088, 3.4x fewer), but the
  expansion costs S r (dn + dv) per head for S keys: the form for a long prefill.
An extend segment of E new tokens over S keys takes whichever costs fewer multiply-adds
(`_absorb_extend`): a fresh prompt (E = S) runs expanded, a few tokens appended to a long
cached prefix (a radix-cache hit, a later chunk of a chunked prefill) absorbed. Both forms give
the same numbers up to rounding.

Decode runs absorbed in torch here (any device) or, with `decode_kernel="triton"`, in the Triton
kernel attention/triton_mla_decode.py over the paged latent in place.

CUDA graphs (executor/cuda_graph.py) need the triton decode: its DECODE metadata is views of
fb.req_pool_indices / fb.seq_lens (device tensors the graph runner refills in place) and a split
count from the batch size, its split-K scratch one persistent buffer sized for max_batch_size
(allocated at the first decode, the eager warm-up before capture), so nothing inside the captured
forward syncs, reads a host list or allocates by data. The torch decode pads every row to
max(seq_lens_cpu), a host value the capture cannot see: that kernel runs eagerly only
(`supports_cuda_graph` False), as torch_native does for K/V heads.
Refused: sliding windows, logit soft-capping, shared-prefix groups (no DeepSeek model uses
them), and the K/V `forward` of the base contract (`forward_mla` is this backend's call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from radixlm.runtime.attention.torch_native import TorchNativeAttention
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.mem_cache.kv_pool import MLAKVPool


def check_mla_args(args: ServerArgs, fp8_checkpoint: bool = False,
                   int4_checkpoint: bool = False) -> None:
    """Refuse, naming the flag, what cannot run on a latent KV pool (it stores no K/V heads) or
    has not been checked with MLA models."""
    if fp8_checkpoint:
        raise ValueError("FP8 checkpoints are not supported with MLA models yet (DeepSeek's own "
                         "are block-wise FP8, refused; per-tensor FP8 MLA is untested)")
    if int4_checkpoint:
        raise ValueError("int4 checkpoints (AWQ, GPTQ, compressed-tensors) are not supported with "
                         "MLA models yet (their loader covers the Llama-family projections)")
    if args.attention_backend == "cpu":
        raise ValueError("attention_backend 'cpu' has no MLA kernels (its C++ kernels read K/V "
                         "heads; DeepSeek's pool stores the latent): use auto or torch_native")
    if args.enable_hierarchical_cache:
        raise ValueError("--enable-hierarchical-cache is not supported with MLA models (the "
                         "host pool and its storage pages are laid out as K/V heads)")
    if args.disaggregation_mode:
        raise ValueError(f"--disaggregation-mode {args.disaggregation_mode} is not supported with "
                         "MLA models (its KV transfer sends K/V heads, not the latent)")
    if args.speculative_algorithm:
        raise ValueError(f"--speculative-algorithm {args.speculative_algorithm} is not supported "
                         "with MLA models (not implemented for the latent KV pool)")


@dataclass
class _TritonDecodeMeta:
    req_pool_indices: torch.Tensor  # (B,) device, a view of the ForwardBatch's tensor
    seq_lens: torch.Tensor  # (B,) device
    # (the key split count is picked per layer call from (B, H): shapes only, so one graph per
    # batch size replays with the count it was captured with; H is first known there)


class MLAAttention(TorchNativeAttention):
    """init_forward_metadata is torch_native's (decode slots and masks, extend segments), except
    the triton decode's (views, see the module docstring); the attention itself is
    `forward_mla`."""

    supports_shared_prefix = False

    def __init__(self, kv_pool: MLAKVPool, req_to_token: torch.Tensor, scale: float, *,
                 max_batch_size: int = 256, max_context_len: int = 8192, windows=None,
                 logit_softcap=None, decode_kernel: str = "torch"):
        if not isinstance(kv_pool, MLAKVPool):
            raise TypeError(f"MLAAttention needs an MLAKVPool (got {type(kv_pool).__name__})")
        if (windows and any(w is not None for w in windows)) or logit_softcap:
            raise ValueError("MLA attention runs neither sliding windows nor logit soft-capping")
        super().__init__(kv_pool, req_to_token, scale, max_batch_size=max_batch_size,
                         max_context_len=max_context_len)
        self.r = kv_pool.kv_lora_rank
        self.decode_kernel = decode_kernel
        if decode_kernel not in ("torch", "triton"):
            raise ValueError(f"decode_kernel must be torch or triton (got {decode_kernel!r})")
        # DECODE metadata + forward capture-safe: with the triton decode only (module docstring)
        self.supports_cuda_graph = decode_kernel == "triton"
        self.device = kv_pool.latent_buffers[0].device
        self._scratch: Optional[torch.Tensor] = None  # flat fp32 split-K partials, see _scratch_for
        self._split_count: dict[tuple[int, int], int] = {}  # (B, H) -> splits, host-side cache

    def _splits(self, batch: int, num_heads: int) -> int:
        key = (batch, num_heads)
        if key not in self._split_count:
            from radixlm.runtime.attention import triton_mla_decode as k

            self._split_count[key] = k.num_splits(batch, num_heads, self.device,
                                                  self.max_context_len)
        return self._split_count[key]

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if self.decode_kernel != "triton":
            return super().init_forward_metadata(fb)
        if fb.mode == ForwardMode.DECODE:  # capture-safe: views only, no host list read
            fb.attn_metadata = (_TritonDecodeMeta(fb.req_pool_indices, fb.seq_lens), [])
            return
        super().init_forward_metadata(fb)  # extend segments (eager: host lists are fine)
        decode, segs = fb.attn_metadata
        if decode is not None:  # the decode tail runs the kernel too
            n = fb.num_decode_tail
            fb.attn_metadata = (_TritonDecodeMeta(fb.req_pool_indices[-n:],
                                                   fb.seq_lens[-n:]), segs)

    def _scratch_for(self, num_heads: int) -> torch.Tensor:
        """The persistent split-K scratch, sized for the largest batch * splits product any
        batch up to max_batch_size asks for; allocated (and, on CUDA, every split variant
        compiled) at the first decode, which is eager: the warm-up before graph capture."""
        from radixlm.runtime.attention import triton_mla_decode as k

        if self._scratch is None:
            need = max(k.scratch_numel(b, num_heads, self.r, self._splits(b, num_heads))
                       for b in range(1, self.max_batch_size + 1))
            self._scratch = torch.empty(max(need, 1), dtype=torch.float32, device=self.device)
            self._compile_variants(num_heads)
        return self._scratch

    def _compile_variants(self, num_heads: int) -> None:
        """Launch every split count serving can use once on a one-key row (scratch slot 0), so
        none compiles mid-serving (each is a Triton compile of both stages, ~0.5 s)."""
        from radixlm.runtime.attention import triton_mla_decode as k

        if self.device.type != "cuda":
            return  # the interpreter compiles nothing
        buf = self.kv_pool.latent_buffers[0][:, 0]
        i64 = dict(dtype=torch.int64, device=self.device)
        zero, one = torch.zeros(1, **i64), torch.ones(1, **i64)
        q = torch.zeros((1, num_heads, buf.shape[-1]), dtype=buf.dtype, device=self.device)
        splits = sorted({self._splits(b, num_heads) for b in range(1, self.max_batch_size + 1)})
        for s in splits:
            k.decode(q, buf, self.req_to_token, zero, one, self.r, self.scale,
                     scratch=self._scratch, splits=s)

    def forward(self, q, k, v, layer, fb):
        raise TypeError("MLAAttention stores a latent, not K/V heads: call forward_mla")

    def forward_mla(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                    layer: int, fb: ForwardBatch, w_uk: torch.Tensor,
                    w_uv: torch.Tensor) -> torch.Tensor:
        """Store the new tokens' latent at fb.out_cache_loc, then attend. q_nope (T, H, dn),
        q_pe (T, H, dr) rotated, latent (T, r + dr) (normalized c_kv | rotated k_pe), or None
        when the caller wrote it to the pool already (triton_ops.mla_latent_store), w_uk
        (H, dn, r), w_uv (H, dv, r) -> (T, H, dv)."""
        if fb.prefix_groups is not None:
            raise ValueError("shared-prefix attention groups are not supported with MLA")
        if latent is not None:
            self.kv_pool.write(layer, fb.out_cache_loc, latent)
        buf = self.kv_pool.latent_buffers[layer][:, 0]  # (capacity + 1, r + dr), a view
        decode, segs = fb.attn_metadata
        if fb.mode == ForwardMode.DECODE:
            return self._decode(q_nope, q_pe, buf, decode, w_uk, w_uv)
        t, h, dv = q_nope.shape[0], q_nope.shape[1], w_uv.shape[1]
        out = q_nope.new_empty(t, h, dv)
        if decode is not None:  # the mixed-in decode requests' rows come last
            n = fb.num_decode_tail
            out[-n:] = self._decode(q_nope[-n:], q_pe[-n:], buf, decode, w_uk, w_uv)
        for seg in segs:
            rows = slice(seg.start, seg.end)
            lat = buf.index_select(0, seg.slots).to(q_nope.dtype)  # (S, r + dr)
            if self._absorb_extend(seg.end - seg.start, lat.shape[0], q_nope.shape[-1], dv):
                q_lat = self._absorb_query(q_nope[rows], q_pe[rows], w_uk)  # (E, H, r + dr)
                o = F.scaled_dot_product_attention(
                    q_lat.transpose(0, 1).unsqueeze(0), lat[None, None], lat[None, None, :, : self.r],
                    attn_mask=seg.mask, is_causal=seg.mask is None, scale=self.scale,
                    enable_gqa=True)[0]  # (H, E, r): H query heads share the latent
                out[rows] = torch.einsum("her,hvr->ehv", o, w_uv)
            else:
                out[rows] = self._expanded(q_nope[rows], q_pe[rows], lat, seg.mask, w_uk, w_uv)
        return out

    def _absorb_extend(self, e: int, s: int, dn: int, dv: int) -> bool:
        """Whether E new tokens over S keys cost fewer multiply-adds (per head) absorbed:
        E r (dn + dv) [query in, output out] + E S (2r + dr) [scores over r + dr, values over r]
        vs expanded: S r (dn + dv) [K and V of every key] + E S (dn + dr + dv)."""
        r, dr = self.r, self.kv_pool.rope_dim
        absorbed = e * r * (dn + dv) + e * s * (2 * r + dr)
        expanded = s * r * (dn + dv) + e * s * (dn + dr + dv)
        return absorbed < expanded

    def _absorb_query(self, q_nope, q_pe, w_uk) -> torch.Tensor:
        """(T, H, dn), (T, H, dr) -> q_lat (T, H, r + dr) = [W_UK[h]^T q_nope_h | q_pe_h]."""
        return torch.cat((torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe), dim=-1)

    def _expanded(self, q_nope, q_pe, lat, mask, w_uk, w_uv) -> torch.Tensor:
        """Ordinary attention on K/V expanded from the latent: lat (S, r + dr) -> (E, H, dv)."""
        c_kv, k_pe = lat[:, : self.r], lat[:, self.r :]
        h = q_nope.shape[1]
        k_nope = torch.einsum("sr,hdr->hsd", c_kv, w_uk)  # (H, S, dn)
        k = torch.cat((k_nope, k_pe.unsqueeze(0).expand(h, -1, -1)), dim=-1)  # (H, S, dn + dr)
        v = torch.einsum("sr,hvr->hsv", c_kv, w_uv)  # (H, S, dv)
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # (H, E, dn + dr)
        o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           attn_mask=mask, is_causal=mask is None,
                                           scale=self.scale)  # (1, H, E, dv)
        return o[0].transpose(0, 1)

    def _decode(self, q_nope, q_pe, buf, meta, w_uk, w_uv):
        """Absorbed decode, one query per row: (B, H, dn), (B, H, dr) -> (B, H, dv); meta is the
        triton kernel's _TritonDecodeMeta (device views) or torch_native's _DecodeMeta."""
        q_lat = self._absorb_query(q_nope, q_pe, w_uk)  # (B, H, r + dr)
        if self.decode_kernel == "triton":
            from radixlm.runtime.attention import triton_mla_decode

            bsz, h = q_lat.shape[:2]
            o = triton_mla_decode.decode(q_lat, buf, self.req_to_token, meta.req_pool_indices,
                                         meta.seq_lens, self.r, self.scale,
                                         scratch=self._scratch_for(h),
                                         splits=self._splits(bsz, h))  # (B, H, r)
        else:
            bsz = q_lat.shape[0]
            lat = buf.index_select(0, meta.slots.view(-1)).view(bsz, 1, -1, buf.shape[-1])
            lat = lat.to(q_lat.dtype)  # (B, 1, L, r + dr): one KV head shared by all H
            o = self._sdpa_decode(q_lat, lat, meta.mask)
        return torch.einsum("bhr,hvr->bhv", o, w_uv)

    def _sdpa_decode(self, q_lat, lat, mask) -> torch.Tensor:
        """q_lat (B, H, r + dr) over lat (B, 1, L, r + dr), mask (B, 1, 1, L) -> (B, H, r): the
        H heads are H query rows of one KV head (MQA), so the latent is read once per request."""
        o = F.scaled_dot_product_attention(q_lat.unsqueeze(1), lat, lat[..., : self.r],
                                           attn_mask=mask, scale=self.scale)  # (B, 1, H, r)
        return o[:, 0]

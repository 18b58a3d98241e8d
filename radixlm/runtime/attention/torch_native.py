"""Reference attention backend in plain torch (CPU and CUDA): gathers K/V through req_to_token.

Decode: one batched SDPA call per layer over the batch padded to the longest sequence; the
query heads of one KV group are laid out as G query rows of that group, so GQA needs no repeat.
Extend: one SDPA call per request (each has its own prefix length and causal offset); the
per-request gather indices and masks are built once per forward, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from radixlm.runtime.attention import shared_prefix
from radixlm.runtime.attention.base import AttentionBackend
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _DecodeMeta:
    slots: torch.Tensor  # (B, L) slot of each key position, L = max seq len in the batch
    mask: torch.Tensor  # (B, 1, 1, L) bool, True where the key position is real


@dataclass
class _ExtendSeg:
    start: int  # first row of this request's new tokens in the (T, ...) batch
    end: int
    slots: torch.Tensor  # (S,) slots of prefix + new tokens
    mask: Optional[torch.Tensor]  # (E, S) bool causal-with-offset mask; None when no prefix


class TorchNativeAttention(AttentionBackend):
    # the ranged ops below are the reference for shared-prefix attention, not a fast path: the
    # scheduler only plans prefix groups for backends whose kernels read the prefix once
    supports_shared_prefix = False

    def ranged_decode(self, q, k_buf, v_buf, req_pool_indices, kv_start, seq_lens):
        return shared_prefix.torch_ranged_decode(q, k_buf, v_buf, self.req_to_token,
                                                 req_pool_indices, kv_start, seq_lens, self.scale)

    def prefix_attention(self, q, k_buf, v_buf, groups):
        return shared_prefix.torch_prefix_attention(q, k_buf, v_buf, self.req_to_token, groups,
                                                    self.scale)

    def _decode_meta(self, req_pool_indices, seq_lens, seq_lens_cpu) -> _DecodeMeta:
        max_len = max(seq_lens_cpu)
        slots = self.req_to_token[req_pool_indices, :max_len]
        ar = torch.arange(max_len, device=slots.device)
        mask = (ar[None, :] < seq_lens[:, None]).view(-1, 1, 1, max_len)
        return _DecodeMeta(slots, mask)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.mode == ForwardMode.DECODE:
            fb.attn_metadata = (self._decode_meta(fb.req_pool_indices, fb.seq_lens,
                                                  fb.seq_lens_cpu), [])
            return
        n_ext = fb.batch_size - fb.num_decode_tail
        decode = None
        if fb.num_decode_tail:
            decode = self._decode_meta(fb.req_pool_indices[n_ext:], fb.seq_lens[n_ext:],
                                       fb.seq_lens_cpu[n_ext:])
        segs = []
        start = 0
        rows = fb.req_pool_indices[:n_ext].tolist()
        for row, prefix, ext in zip(rows, fb.extend_prefix_lens_cpu, fb.extend_lens_cpu):
            total = prefix + ext
            mask = None
            if prefix:
                dev = fb.input_ids.device
                q_pos = torch.arange(prefix, total, device=dev)
                mask = torch.arange(total, device=dev)[None, :] <= q_pos[:, None]
            segs.append(_ExtendSeg(start, start + ext, self.req_to_token[row, :total], mask))
            start += ext
        fb.attn_metadata = (decode, segs)

    def forward(self, q, k, v, layer, fb):
        self.kv_pool.write(layer, fb.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.k_buffers[layer], self.kv_pool.v_buffers[layer]
        decode, segs = fb.attn_metadata
        if fb.mode == ForwardMode.DECODE:
            if fb.prefix_groups is not None:
                return shared_prefix.decode_with_groups(self, q, k_buf, v_buf, fb)
            return self._decode(q, k_buf, v_buf, decode)
        out = torch.empty_like(q)
        if decode is not None:  # the mixed-in decode requests' rows come last
            n_dec = fb.num_decode_tail
            out[-n_dec:] = self._decode(q[-n_dec:], k_buf, v_buf, decode)
        for seg in segs:
            qs = q[seg.start : seg.end].transpose(0, 1)  # (Hq, E, D)
            ks = k_buf.index_select(0, seg.slots).transpose(0, 1).to(q.dtype)  # (Hkv, S, D)
            vs = v_buf.index_select(0, seg.slots).transpose(0, 1).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0),
                attn_mask=seg.mask, is_causal=seg.mask is None,
                scale=self.scale, enable_gqa=True,
            )  # (1, Hq, E, D)
            out[seg.start : seg.end] = o[0].transpose(0, 1)
        return out

    def _decode(self, q, k_buf, v_buf, meta: _DecodeMeta):
        bsz, hq, d = q.shape
        hkv = k_buf.shape[1]
        # index_select on the flat (B*L,) slot list is several times faster than 2-D fancy indexing
        flat = meta.slots.view(-1)
        ks = k_buf.index_select(0, flat).view(bsz, -1, hkv, d).permute(0, 2, 1, 3).to(q.dtype)
        vs = v_buf.index_select(0, flat).view(bsz, -1, hkv, d).permute(0, 2, 1, 3).to(q.dtype)
        # ks, vs: (B, Hkv, L, D)
        qg = q.view(bsz, hkv, hq // hkv, d)  # (B, Hkv, G, D): G query heads share one KV head
        o = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=meta.mask, scale=self.scale)
        return o.reshape(bsz, hq, d)

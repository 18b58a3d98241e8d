"""Reference attention backend in plain torch (CPU and CUDA): gathers K/V through req_to_token.

Decode: one batched SDPA call per layer over the batch padded to the longest sequence; the
query heads of one KV group are laid out as G query rows of that group, so GQA needs no repeat.
Extend: one SDPA call per request (each has its own prefix length and causal offset); the
per-request gather indices and masks are built once per forward, not once per layer.
Sliding windows: one extra mask per distinct window, built once per forward (none for models
without windowed layers). Logit soft-capping: SDPA has no soft-cap, so those models take the
explicit fp32 path (`_softcap_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    win_masks: dict = field(default_factory=dict)  # window -> (B, 1, 1, L) mask cut to it


@dataclass
class _ExtendSeg:
    start: int  # first row of this request's new tokens in the (T, ...) batch
    end: int
    slots: torch.Tensor  # (S,) slots of prefix + new tokens
    mask: Optional[torch.Tensor]  # (E, S) bool causal-with-offset mask; None: plain causal (E == S)
    win_masks: dict = field(default_factory=dict)  # window -> (E, S) mask cut to it


def _softcap_attention(q, k, v, mask, scale: float, cap: float) -> torch.Tensor:
    """q (..., H, E, D), k/v (..., H, S, D) (same heads), mask bool broadcastable to
    (..., H, E, S), True = visible. Scores cap * tanh(scale q.k / cap) in fp32, as HF's eager
    attention orders it (soft-cap, then mask, then softmax); rows that see no key give 0."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = torch.tanh(s / cap) * cap
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p, v.float()).to(q.dtype)


class TorchNativeAttention(AttentionBackend):
    # the ranged ops below are the reference for shared-prefix attention, not a fast path: the
    # scheduler only plans prefix groups for backends whose kernels read the prefix once
    supports_shared_prefix = False

    def ranged_decode(self, q, k_buf, v_buf, req_pool_indices, kv_start, seq_lens):
        return shared_prefix.torch_ranged_decode(q, k_buf, v_buf, self.req_to_token,
                                                 req_pool_indices, kv_start, seq_lens, self.scale,
                                                 softcap=self.logit_softcap)

    def prefix_attention(self, q, k_buf, v_buf, groups):
        return shared_prefix.torch_prefix_attention(q, k_buf, v_buf, self.req_to_token, groups,
                                                    self.scale, softcap=self.logit_softcap)

    def _decode_meta(self, req_pool_indices, seq_lens, seq_lens_cpu) -> _DecodeMeta:
        max_len = max(seq_lens_cpu)
        slots = self.req_to_token[req_pool_indices, :max_len]
        ar = torch.arange(max_len, device=slots.device)
        mask = (ar[None, :] < seq_lens[:, None]).view(-1, 1, 1, max_len)
        meta = _DecodeMeta(slots, mask)
        for w in set(self.windows) - {0}:  # the query is at seq_len - 1: keys >= seq_len - w
            cut = (ar[None, :] >= seq_lens[:, None] - w).view(-1, 1, 1, max_len)
            meta.win_masks[w] = mask & cut
        return meta

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
        explicit = self.has_window or self.logit_softcap  # no is_causal shortcut for these
        for row, prefix, ext in zip(rows, fb.extend_prefix_lens_cpu, fb.extend_lens_cpu):
            total = prefix + ext
            seg = _ExtendSeg(start, start + ext, self.req_to_token[row, :total], None)
            if prefix or explicit:
                dev = fb.input_ids.device
                q_pos = torch.arange(prefix, total, device=dev)[:, None]  # (E, 1)
                k_pos = torch.arange(total, device=dev)[None, :]  # (1, S)
                seg.mask = k_pos <= q_pos
                for w in set(self.windows) - {0}:
                    seg.win_masks[w] = seg.mask & (k_pos > q_pos - w)
            segs.append(seg)
            start += ext
        fb.attn_metadata = (decode, segs)

    def forward(self, q, k, v, layer, fb):
        self.kv_pool.write(layer, fb.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.k_buffers[layer], self.kv_pool.v_buffers[layer]
        window = self.windows[layer]
        decode, segs = fb.attn_metadata
        if fb.mode == ForwardMode.DECODE:
            if fb.prefix_groups is not None and not window:
                return shared_prefix.decode_with_groups(self, q, k_buf, v_buf, fb)
            return self._decode(q, k_buf, v_buf, decode, window)
        out = torch.empty_like(q)
        if decode is not None:  # the mixed-in decode requests' rows come last
            n_dec = fb.num_decode_tail
            out[-n_dec:] = self._decode(q[-n_dec:], k_buf, v_buf, decode, window)
        for seg in segs:
            qs = q[seg.start : seg.end].transpose(0, 1)  # (Hq, E, D)
            ks = k_buf.index_select(0, seg.slots).transpose(0, 1).to(q.dtype)  # (Hkv, S, D)
            vs = v_buf.index_select(0, seg.slots).transpose(0, 1).to(q.dtype)
            mask = seg.win_masks[window] if window else seg.mask
            if self.logit_softcap:
                g = qs.shape[0] // ks.shape[0]
                o = _softcap_attention(qs, ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0),
                                       mask, self.scale, self.logit_softcap)  # (Hq, E, D)
                out[seg.start : seg.end] = o.transpose(0, 1)
                continue
            o = F.scaled_dot_product_attention(
                qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0),
                attn_mask=mask, is_causal=mask is None,
                scale=self.scale, enable_gqa=True,
            )  # (1, Hq, E, D)
            out[seg.start : seg.end] = o[0].transpose(0, 1)
        return out

    def _decode(self, q, k_buf, v_buf, meta: _DecodeMeta, window: int = 0):
        bsz, hq, d = q.shape
        hkv = k_buf.shape[1]
        # index_select on the flat (B*L,) slot list is several times faster than 2-D fancy indexing
        flat = meta.slots.view(-1)
        ks = k_buf.index_select(0, flat).view(bsz, -1, hkv, d).permute(0, 2, 1, 3).to(q.dtype)
        vs = v_buf.index_select(0, flat).view(bsz, -1, hkv, d).permute(0, 2, 1, 3).to(q.dtype)
        # ks, vs: (B, Hkv, L, D)
        qg = q.view(bsz, hkv, hq // hkv, d)  # (B, Hkv, G, D): G query heads share one KV head
        mask = meta.win_masks[window] if window else meta.mask
        if self.logit_softcap:
            o = _softcap_attention(qg, ks, vs, mask, self.scale, self.logit_softcap)
        else:
            o = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=mask, scale=self.scale)
        return o.reshape(bsz, hq, d)

"""CPU attention backend: C++ kernels (csrc/cpu_attention.cpp) that read the KV pool in place.

Same contract and numbers as `TorchNativeAttention` (up to fp32 summation order), without copying
any request's history out of the pool: the kernels follow `req_to_token` slot by slot.

- DECODE: one `decode` call per layer over the whole batch. With `fb.prefix_groups` (rows that
  share a cached prefix, planned by the scheduler): each row's own suffix by a ranged `decode`,
  each group's prefix once for all its members by a non-causal `extend`, merged by lse.
- EXTEND (prefill, with or without a cached prefix, with `num_decode_tail` decode rows at the
  end): one `extend` call per layer; a decode row is just a sequence with one query token.
The index tensors (qo_indptr, lengths) are built once per forward in `init_forward_metadata`.
Sliding windows and the logit soft-cap are kernel arguments (the layer's window, the model's cap).

Fallback: `CpuAttention(...)` raises `CpuKernelsUnavailable` (with the reason) when the kernels
cannot be built or loaded. The registry's `auto` checks the kernels before choosing this backend
and falls back to torch_native with ONE warning (registry.resolve_backend_name);
`CpuAttention.create(...)` (same arguments) does the same for callers that construct it directly.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from radixlm.runtime.attention import cpu_kernels, shared_prefix
from radixlm.runtime.attention.base import AttentionBackend
from radixlm.runtime.attention.cpu_kernels import CpuKernelsUnavailable
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode

__all__ = ["CpuAttention", "CpuKernelsUnavailable"]

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class _Meta:
    decode: bool
    rows: torch.Tensor  # (B,) int64 req_to_token rows
    lens: torch.Tensor  # (B,) int64 keys per request (prefix + new)
    qo_indptr: torch.Tensor  # (B+1,) EXTEND: request b's queries are q[indptr[b]:indptr[b+1]]


class CpuAttention(AttentionBackend):
    # decode batches whose rows share a cached prefix read it once per group (shared_prefix.py)
    supports_shared_prefix = True

    def __init__(self, kv_pool, req_to_token, scale, *, max_batch_size: int = 256,
                 max_context_len: int = 8192, windows=None, logit_softcap=None):
        super().__init__(kv_pool, req_to_token, scale, max_batch_size=max_batch_size,
                         max_context_len=max_context_len, windows=windows,
                         logit_softcap=logit_softcap)
        if req_to_token.device.type != "cpu" or kv_pool.k_buffers[0].device.type != "cpu":
            raise CpuKernelsUnavailable("the CPU attention kernels need CPU tensors")
        if kv_pool.dtype not in _SUPPORTED:
            raise CpuKernelsUnavailable(f"KV dtype {kv_pool.dtype} is not supported "
                                        "(float32, bfloat16, float16)")
        self.ops = cpu_kernels.load()  # raises CpuKernelsUnavailable with the reason
        self._empty = torch.empty(0)
        self._empty_i64 = torch.empty(0, dtype=torch.int64)

    @classmethod
    def create(cls, kv_pool, req_to_token, scale, **kwargs) -> AttentionBackend:
        """This backend, or the torch_native reference (with one warning) when it cannot run."""
        try:
            return cls(kv_pool, req_to_token, scale, **kwargs)
        except CpuKernelsUnavailable as e:
            cpu_kernels.warn_fallback(str(e))  # once per process
            from radixlm.runtime.attention.torch_native import TorchNativeAttention
            return TorchNativeAttention(kv_pool, req_to_token, scale, **kwargs)

    # --- shared-prefix (cascade) decode, see shared_prefix.py ------------------------------------
    def ranged_decode(self, q, k_buf, v_buf, req_pool_indices, kv_start, seq_lens):
        """(out, lse): row b over its keys [kv_start[b], seq_lens[b])."""
        return cpu_kernels.decode(q, k_buf, v_buf, self.req_to_token, req_pool_indices, seq_lens,
                                  self.scale, kv_start=kv_start, softcap=self.logit_softcap,
                                  return_lse=True)

    def prefix_attention(self, q, k_buf, v_buf, groups):
        """(out, lse): group g's member rows, packed, over its prefix, non-causal. In the kernel a
        group is one sequence whose "query tokens" are its members: each prefix K/V block is
        loaded once for (members x G) query rows of a KV head."""
        return cpu_kernels.extend(q, k_buf, v_buf, self.req_to_token, groups.rep_pool_indices,
                                  groups.qo_indptr, groups.shared_lens, self.scale,
                                  kv_start=groups.zeros, causal=False,
                                  softcap=self.logit_softcap, return_lse=True)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        rows = fb.req_pool_indices.to(torch.int64).contiguous()
        lens = fb.seq_lens.to(torch.int64).contiguous()
        if fb.mode == ForwardMode.DECODE:
            fb.attn_metadata = _Meta(True, rows, lens, self._empty_i64)
            return
        # extend_lens_cpu covers every request, the decode tail too (1 each), in batch order
        indptr = torch.tensor([0, *itertools.accumulate(fb.extend_lens_cpu)], dtype=torch.int64)
        fb.attn_metadata = _Meta(False, rows, lens, indptr)

    def forward(self, q, k, v, layer, fb):
        k_buf, v_buf = self.kv_pool.k_buffers[layer], self.kv_pool.v_buffers[layer]
        self.ops.store_kv(k, v, k_buf, v_buf, fb.out_cache_loc)
        meta: _Meta = fb.attn_metadata
        window = self.windows[layer]
        if meta.decode and fb.prefix_groups is not None and not window:
            return shared_prefix.decode_with_groups(self, q, k_buf, v_buf, fb)
        out = torch.empty(q.shape, dtype=q.dtype)
        if meta.decode:
            self.ops.decode(q, k_buf, v_buf, self.req_to_token, meta.rows, self._empty_i64,
                            meta.lens, self.scale, window, self.logit_softcap, out, self._empty)
        else:
            self.ops.extend(q, k_buf, v_buf, self.req_to_token, meta.rows, meta.qo_indptr,
                            self._empty_i64, meta.lens, True, self.scale, window,
                            self.logit_softcap, out, self._empty)
        return out

    def forward_rows(self, q_rows, k, v, layer, fb, rows: torch.Tensor) -> torch.Tensor:
        """An EXTEND batch's attention for the query rows `rows` (R,) of its T tokens only,
        q_rows (R, Hq, D) = q[rows]; k, v (T, Hkv, D) are stored for every token. Row t of
        request b at extend offset o sees keys [0, prefix_b + o], which is a decode query over
        that many keys: the decode kernel runs them (models/llama.py's last layer, where only
        the logits rows go on)."""
        k_buf, v_buf = self.kv_pool.k_buffers[layer], self.kv_pool.v_buffers[layer]
        self.ops.store_kv(k, v, k_buf, v_buf, fb.out_cache_loc)
        meta: _Meta = fb.attn_metadata
        out = torch.empty(q_rows.shape, dtype=q_rows.dtype)
        if rows.numel() == 0:
            return out
        req = torch.searchsorted(meta.qo_indptr[1:], rows, right=True)  # (R,) request of each row
        start = meta.qo_indptr[req]  # first row of that request's new tokens
        lens = meta.lens[req] - (meta.qo_indptr[req + 1] - start) + (rows - start) + 1
        self.ops.decode(q_rows, k_buf, v_buf, self.req_to_token, meta.rows[req].contiguous(),
                        self._empty_i64, lens.contiguous(), self.scale, self.windows[layer],
                        self.logit_softcap, out, self._empty)
        return out

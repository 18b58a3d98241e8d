"""Triton attention backend (CUDA; CPU under TRITON_INTERPRET=1 for tests): K/V read in place
from the paged pool through req_to_token, metadata built once per forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from radixlm.runtime.attention import shared_prefix
from radixlm.runtime.attention.base import AttentionBackend
from radixlm.runtime.attention.triton_decode import (MAX_SPLITS, decode_attention,
                                                     default_num_splits, scratch_numel)
from radixlm.runtime.attention.triton_extend import extend_attention
from radixlm.runtime.attention.triton_merge import merge_prefix_into
from radixlm.runtime.executor.host_staging import staged
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _DecodeMeta:
    req_pool_indices: torch.Tensor  # (B,) device, views of the ForwardBatch's tensors
    seq_lens: torch.Tensor  # (B,)
    num_splits: int  # from shapes only (B, Hkv): stable across replays of one graph


@dataclass
class _ExtendMeta:
    req_pool_indices: torch.Tensor  # (S,) the extend requests (decode tail excluded)
    qo_indptr: torch.Tensor  # (S+1,) int64 device: query rows of sequence s
    kv_start: torch.Tensor  # (S,) zeros: keys start at position 0 of each request's row
    kv_len: torch.Tensor  # (S,) prefix + new tokens
    max_q_len: int
    decode_tail: Optional[_DecodeMeta]  # the num_decode_tail plain decodes at the batch's end


class TritonAttention(AttentionBackend):
    """Attention through the Triton kernels of triton_decode.py / triton_extend.py.

    DECODE: one flash-decoding call per layer (stage 1 split over the key length, stage 2 merge;
    one stage when a batch is large enough to fill the GPU without splits).
    EXTEND: one launch for all extend requests (causal, keys = cached prefix + new tokens), plus
    one decode call for the `num_decode_tail` decode rows at the batch's end.
    A layer's sliding window and the model's logit soft-cap are plain kernel arguments (Python
    numbers fixed per layer), so a captured graph replays them as they were.

    CUDA graphs: `init_forward_metadata` is capture-safe for DECODE batches: it only keeps views
    of `fb.req_pool_indices` / `fb.seq_lens` (device tensors the graph runner refills in place)
    and picks the split count from the batch size, so it neither syncs nor allocates.
    `init_forward_metadata_for_graph(fb)` is the same call. The stage-1 scratch buffer is
    persistent, sized for `max_batch_size` rows; it is allocated on the first decode forward
    (its size needs Hq, known only then) -- run one eager decode (the usual warm-up) before
    capturing so that allocation does not land inside a graph.
    """

    # forward(q, None, None, ...) means the new tokens' K/V are already in the pool at
    # fb.out_cache_loc (layers/triton_ops.rotary_store_kv, fused into the rotary launch)
    accepts_stored_kv = True
    supports_cuda_graph = True  # DECODE metadata + forward are capture-safe (see above)
    supports_shared_prefix = True  # prefix groups run eagerly (the graph runner skips them)

    def __init__(self, kv_pool, req_to_token: torch.Tensor, scale: float, *,
                 max_batch_size: int = 256, max_context_len: int = 8192, windows=None,
                 logit_softcap=None):
        super().__init__(kv_pool, req_to_token, scale, max_batch_size=max_batch_size,
                         max_context_len=max_context_len, windows=windows,
                         logit_softcap=logit_softcap)
        k0 = kv_pool.k_buffers[0]
        self.device = k0.device
        self.num_kv_heads, self.head_dim = int(k0.shape[1]), int(k0.shape[2])
        self._scratch: Optional[torch.Tensor] = None  # flat fp32, see _get_scratch

    def _num_splits(self, batch: int) -> int:
        return default_num_splits(batch, self.num_kv_heads, self.device, self.max_context_len)

    def _get_scratch(self, num_q_heads: int) -> torch.Tensor:
        if self._scratch is None:
            self._compile_variants(num_q_heads)
            # the largest batch * splits product any batch size up to max_batch_size asks for
            need = max(scratch_numel(b, num_q_heads, self.head_dim, self._num_splits(b))
                       for b in range(1, self.max_batch_size + 1))
            self._scratch = torch.empty(max(need, 1), dtype=torch.float32, device=self.device)
        return self._scratch

    def _compile_variants(self, num_q_heads: int) -> None:
        """Compile, on tiny inputs, every kernel variant serving can launch, so none compiles in
        the middle of serving (~0.3-0.5 s each on an H100, measured: 13 compiles cost ~3 s of a
        10 s shared-prefix run). Variants are the compile-time constants: the split counts
        (powers of two up to MAX_SPLITS), plain decode vs the ranged decode with LSE of the
        shared-prefix path, causal extend vs the non-causal prefix attention with LSE, each with
        and without the model's sliding window (the soft-cap is fixed per model). Runs at the
        first decode forward (the eager warm-up before CUDA-graph capture); Triton's disk cache
        makes it cheap on later launches."""
        if self.device.type != "cuda":
            return  # the interpreter compiles nothing
        k_buf, v_buf = self.kv_pool.k_buffers[0], self.kv_pool.v_buffers[0]
        # Triton specializes on argument dtypes and on strides divisible by 16, so the dummy
        # call uses the real table (row 0, one key: at start-up, scratch slot 0) and int64 as
        # the scheduler's tensors do
        i64 = dict(dtype=torch.int64, device=self.device)
        r2t = self.req_to_token
        zero, one = torch.zeros(1, **i64), torch.ones(1, **i64)
        q = torch.zeros((1, num_q_heads, self.head_dim), dtype=k_buf.dtype, device=self.device)
        out = torch.empty_like(q)
        lse = torch.empty((1, num_q_heads), dtype=torch.float32, device=self.device)
        splits, s = set(), 1
        while s <= MAX_SPLITS:
            splits.add(s)
            s *= 2
        cap = self.logit_softcap
        windows = sorted(set(self.windows))  # 0 (full) and the model's window(s): 1 or 2 values
        for n in sorted(splits):
            for w in windows:
                decode_attention(q, k_buf, v_buf, r2t, zero, None, one, self.scale, out,
                                 num_splits=n, window=w, softcap=cap)
            if self.supports_shared_prefix:
                decode_attention(q, k_buf, v_buf, r2t, zero, zero, one, self.scale, out,
                                 lse_out=lse, num_splits=n, softcap=cap)
        indptr = torch.tensor([0, 1], **i64)
        for w in windows:
            extend_attention(q, k_buf, v_buf, r2t, zero, indptr, zero, one, True, self.scale,
                             out, max_q_len=1, window=w, softcap=cap)
        if self.supports_shared_prefix:
            extend_attention(q, k_buf, v_buf, r2t, zero, indptr, zero, one, False, self.scale,
                             out, lse_out=lse, max_q_len=1, softcap=cap)
            merge_prefix_into(out, lse, zero, out.clone(), lse.clone())

    def _decode_meta(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> _DecodeMeta:
        return _DecodeMeta(req_pool_indices, seq_lens, self._num_splits(req_pool_indices.shape[0]))

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.mode == ForwardMode.DECODE:
            fb.attn_metadata = self._decode_meta(fb.req_pool_indices, fb.seq_lens)
            return
        n_ext = fb.batch_size - fb.num_decode_tail
        tail = None
        if fb.num_decode_tail:
            tail = self._decode_meta(fb.req_pool_indices[n_ext:], fb.seq_lens[n_ext:])
        ext = fb.extend_lens_cpu[:n_ext]
        kv_len = [p + e for p, e in zip(fb.extend_prefix_lens_cpu[:n_ext], ext)]
        indptr = [0]
        for e in ext:
            indptr.append(indptr[-1] + e)
        # one host->device copy: [qo_indptr (S+1) | kv_len (S) | kv_start zeros (S)], through
        # pinned memory (host_staging.py)
        packed = staged(indptr + kv_len + [0] * n_ext, self.device)
        fb.attn_metadata = _ExtendMeta(
            req_pool_indices=fb.req_pool_indices[:n_ext], qo_indptr=packed[: n_ext + 1],
            kv_len=packed[n_ext + 1 : 2 * n_ext + 1], kv_start=packed[2 * n_ext + 1 :],
            max_q_len=max(ext, default=0), decode_tail=tail)

    def init_forward_metadata_for_graph(self, fb: ForwardBatch) -> None:
        """For CUDA-graph capture and replay of DECODE batches (see the class docstring)."""
        assert fb.mode == ForwardMode.DECODE, "only decode batches are captured"
        self.init_forward_metadata(fb)

    def _decode(self, q, k_buf, v_buf, meta: _DecodeMeta, out, window: int):
        decode_attention(q, k_buf, v_buf, self.req_to_token, meta.req_pool_indices, None,
                         meta.seq_lens, self.scale, out, scratch=self._get_scratch(q.shape[1]),
                         num_splits=meta.num_splits, window=window, softcap=self.logit_softcap)

    def ranged_decode(self, q, k_buf, v_buf, req_pool_indices, kv_start, seq_lens):
        """(out, lse) of row b over its keys [kv_start[b], seq_lens[b]) (shared_prefix.py)."""
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        decode_attention(q, k_buf, v_buf, self.req_to_token, req_pool_indices, kv_start,
                         seq_lens, self.scale, out, lse_out=lse,
                         scratch=self._get_scratch(q.shape[1]),
                         num_splits=self._num_splits(q.shape[0]), softcap=self.logit_softcap)
        return out, lse

    def prefix_attention(self, q, k_buf, v_buf, groups):
        """(out, lse) of each group's packed member queries over the group's shared prefix."""
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        extend_attention(q, k_buf, v_buf, self.req_to_token, groups.rep_pool_indices,
                         groups.qo_indptr, groups.zeros, groups.shared_lens, False, self.scale,
                         out, lse_out=lse, max_q_len=groups.max_group,
                         softcap=self.logit_softcap)
        return out, lse

    def merge_prefix_into(self, out, lse, rows, o_sh, lse_sh):
        """shared_prefix.decode_with_groups' merge, one launch (triton_merge.py)."""
        return merge_prefix_into(out, lse, rows, o_sh, lse_sh)

    def forward(self, q, k, v, layer, fb, out=None):
        """`out` (T, Hq, D): where to write the result (the piecewise graphs' static buffer,
        executor/piecewise_graph.py); by default a new tensor."""
        if k is not None:  # None: the model's fused rotary kernel stored them (accepts_stored_kv)
            self.kv_pool.write(layer, fb.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.k_buffers[layer], self.kv_pool.v_buffers[layer]
        meta = fb.attn_metadata
        window = self.windows[layer]
        if fb.mode == ForwardMode.DECODE and fb.prefix_groups is not None and not window:
            return shared_prefix.decode_with_groups(self, q, k_buf, v_buf, fb)
        if out is None:
            out = torch.empty_like(q)  # (T, Hq, D)
        if fb.mode == ForwardMode.DECODE:
            self._decode(q, k_buf, v_buf, meta, out, window)
            return out
        n_dec = fb.num_decode_tail
        n_ext_tok = q.shape[0] - n_dec  # the decode tail's rows come last, one token each
        if meta.max_q_len:
            extend_attention(q[:n_ext_tok], k_buf, v_buf, self.req_to_token,
                             meta.req_pool_indices, meta.qo_indptr, meta.kv_start, meta.kv_len,
                             True, self.scale, out[:n_ext_tok], max_q_len=meta.max_q_len,
                             window=window, softcap=self.logit_softcap)
        if meta.decode_tail is not None:
            self._decode(q[n_ext_tok:], k_buf, v_buf, meta.decode_tail, out[n_ext_tok:], window)
        return out

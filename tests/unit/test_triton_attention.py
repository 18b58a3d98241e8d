"""Triton attention kernels and backend on the CPU, through Triton's interpreter
(TRITON_INTERPRET=1): the kernels' logic (splits, masks, GQA grouping, in-place slot reads, lse)
against a dense reference and against TorchNativeAttention; an engine on a tiny model gives the
same greedy tokens with either backend. Small shapes: the interpreter runs each program in numpy,
one by one."""

from __future__ import annotations

import json

import pytest
import torch

from triton_interpreter import import_interpreted  # tests/unit is on sys.path

import_interpreted("radixlm.runtime.attention.triton_backend",
                   gpu_tests="tests/gpu/test_triton_attention_gpu.py")
from radixlm.runtime.attention.torch_native import TorchNativeAttention  # noqa: E402
from radixlm.runtime.attention.triton_backend import TritonAttention  # noqa: E402
from radixlm.runtime.attention.triton_decode import decode_attention  # noqa: E402
from radixlm.runtime.attention.triton_extend import extend_attention  # noqa: E402
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixlm.runtime.mem_cache.kv_pool import KVPool  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# (Hq, Hkv, D, dtype): SmolLM2's group of 3 at head_dim 64; a group of 4 in bf16
GQA_CASES = [(9, 3, 64, torch.float32), (8, 2, 32, torch.bfloat16)]
SCALE = 0.125


def make_rows(lens, shared, ctx, gen):
    """req_to_token rows for requests of `lens` tokens; rows 0 and 1 have their first `shared`
    slots in common (a radix-cache prefix; never a row's last token, which a decode writes).
    Request i is pool row 2*i+1 (not i, so a kernel that ignores req_pool_indices fails).
    Returns (req_to_token, rows, n_slots)."""
    r2t = torch.zeros(2 * len(lens) + 2, ctx, dtype=torch.int64)
    perm = torch.randperm(sum(lens), generator=gen) + 1  # unique slots, scattered, never slot 0
    rows, at = [], 0
    for i, n in enumerate(lens):
        r = 2 * i + 1
        r2t[r, :n] = perm[at:at + n]
        at += n
        rows.append(r)
    shared = min(shared, lens[0] - 1, lens[1] - 1)
    r2t[rows[1], :shared] = r2t[rows[0], :shared]
    return r2t, torch.tensor(rows), sum(lens)


def make_kv(n_slots, hkv, d, dtype, gen):
    k = torch.randn(n_slots + 1, hkv, d, generator=gen).to(dtype)
    v = torch.randn(n_slots + 1, hkv, d, generator=gen).to(dtype)
    return k, v


def dense(q, k_buf, v_buf, slots, causal_offset=None):
    """q (n, Hq, D) over keys k_buf[slots] (L, Hkv, D), fp32. causal_offset c: query i sees
    keys j <= c + i. Returns out (n, Hq, D) (0 where a row sees nothing), lse (n, Hq)."""
    g = q.shape[1] // k_buf.shape[1]
    k = k_buf[slots].float().repeat_interleave(g, 1)
    v = v_buf[slots].float().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->qhk", q.float(), k) * SCALE
    if causal_offset is not None:
        ok = torch.arange(len(slots))[None, :] <= causal_offset + torch.arange(q.shape[0])[:, None]
        s = s.masked_fill(~ok[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("qhk,khd->qhd", p, v), lse


def check_lse(lse, ref, tol):
    assert torch.equal(torch.isinf(lse), torch.isinf(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(lse[fin], ref[fin], atol=tol, rtol=0)


@pytest.mark.parametrize("hq, hkv, d, dtype", GQA_CASES, ids=["gqa3-fp32", "gqa4-bf16"])
def test_decode_kernel(hq, hkv, d, dtype):
    gen = torch.Generator().manual_seed(0)
    lens = [7, 33, 1, 130, 5]
    r2t, rows, n = make_rows(lens, shared=5, ctx=160, gen=gen)
    k_buf, v_buf = make_kv(n, hkv, d, dtype, gen)
    b = len(lens)
    q = torch.randn(b, hq, d, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens)
    starts = torch.tensor([3, 32, 0, 64, 5])  # the last row's range is empty
    for kv_start, splits in [(None, 1), (starts, 3)]:
        out = torch.full_like(q, float("nan"))
        lse = torch.full((b, hq), float("nan"))
        decode_attention(q, k_buf, v_buf, r2t, rows, kv_start, seq_lens, SCALE, out, lse,
                         num_splits=splits)
        for i in range(b):
            lo = 0 if kv_start is None else int(kv_start[i])
            ro, rl = dense(q[i:i + 1], k_buf, v_buf, r2t[rows[i], lo:lens[i]])
            torch.testing.assert_close(out[i].float(), ro[0], atol=TOL[dtype], rtol=TOL[dtype])
            check_lse(lse[i], rl[0], 1e-4)
    assert torch.equal(out[4], torch.zeros_like(out[4])) and torch.isneginf(lse[4]).all()


@pytest.mark.parametrize("hq, hkv, d, dtype", GQA_CASES, ids=["gqa3-fp32", "gqa4-bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_extend_kernel(hq, hkv, d, dtype, causal):
    gen = torch.Generator().manual_seed(1)
    lens = [40, 46, 13, 130]  # rows 0 and 1 share their first 33 slots
    r2t, rows, n = make_rows(lens, shared=33, ctx=160, gen=gen)
    k_buf, v_buf = make_kv(n, hkv, d, dtype, gen)
    n_q = [7, 1, 13, 33]
    if causal:  # queries are the last n_q keys of [kv_start, kv_start + kv_len)
        kv_start, kv_len = [0, 0, 0, 2], [40, 46, 13, 128]
    else:  # queries against a slice of the row, as shared-prefix attention uses it
        kv_start, kv_len = [0, 3, 0, 60], [33, 0, 13, 70]
    indptr = torch.tensor([0] + n_q).cumsum(0)
    q = torch.randn(int(indptr[-1]), hq, d, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"))
    extend_attention(q, k_buf, v_buf, r2t, rows, indptr, torch.tensor(kv_start),
                     torch.tensor(kv_len), causal, SCALE, out, lse, max_q_len=max(n_q))
    for s in range(len(lens)):
        a, e = int(indptr[s]), int(indptr[s + 1])
        slots = r2t[rows[s], kv_start[s]:kv_start[s] + kv_len[s]]
        ro, rl = dense(q[a:e], k_buf, v_buf, slots, kv_len[s] - n_q[s] if causal else None)
        torch.testing.assert_close(out[a:e].float(), ro, atol=TOL[dtype], rtol=TOL[dtype])
        check_lse(lse[a:e], rl, 1e-4)


def run_both(fb_factory, pool, r2t, qkv):
    """The same batch through TorchNativeAttention and TritonAttention (both write the same new
    K/V into the same pool first). Returns (reference out, triton out)."""
    outs = []
    for cls in (TorchNativeAttention, TritonAttention):
        backend = cls(pool, r2t, SCALE, max_batch_size=8, max_context_len=r2t.shape[1])
        fb = fb_factory()
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(*qkv, 0, fb))
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_mixed_extend_with_prefix_and_decode_tail(dtype):
    """EXTEND: three requests with cached prefixes (two share theirs) + two decode-tail rows."""
    gen = torch.Generator().manual_seed(2)
    hq, hkv, d = 9, 3, 64
    prefix, ext = [33, 33, 0], [7, 1, 13]
    dec_lens = [130, 2]
    lens = [p + e for p, e in zip(prefix, ext)] + dec_lens
    r2t, rows, n = make_rows(lens, shared=33, ctx=160, gen=gen)
    pool = KVPool(n, 1, hkv, d, dtype, "cpu")
    pool.k_buffers[0], pool.v_buffers[0] = make_kv(n, hkv, d, dtype, gen)
    # new tokens: the extend rows' last `ext` positions, then each decode row's last position
    loc = torch.cat([r2t[rows[i], prefix[i]:lens[i]] for i in range(3)]
                    + [r2t[rows[3 + j], dec_lens[j] - 1:dec_lens[j]] for j in range(2)])
    t = loc.shape[0]
    qkv = [torch.randn(t, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv)]

    def fb():
        return ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=torch.zeros(t, dtype=torch.int64),
            positions=torch.zeros(t, dtype=torch.int64), out_cache_loc=loc,
            req_pool_indices=rows.clone(), seq_lens=torch.tensor(lens),
            logits_indices=torch.zeros(5, dtype=torch.int64), seq_lens_cpu=list(lens),
            extend_prefix_lens_cpu=prefix + [x - 1 for x in dec_lens],
            extend_lens_cpu=ext + [1, 1], num_decode_tail=2)

    ref, out = run_both(fb, pool, r2t, qkv)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_backend_decode_needs_no_host_lists():
    """DECODE metadata comes from device tensors only (CUDA-graph capture): the host-side lists
    are left empty here and the result still equals the reference."""
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d = 8, 2, 64  # GQA group of 4
    lens = [33, 7, 1, 130]
    r2t, rows, n = make_rows(lens, shared=5, ctx=160, gen=gen)
    pool = KVPool(n, 1, hkv, d, torch.float32, "cpu")
    pool.k_buffers[0], pool.v_buffers[0] = make_kv(n, hkv, d, torch.float32, gen)
    loc = torch.stack([r2t[rows[i], lens[i] - 1] for i in range(4)])
    qkv = [torch.randn(4, h, d, generator=gen) for h in (hq, hkv, hkv)]
    backend = TritonAttention(pool, r2t, SCALE, max_batch_size=8, max_context_len=160)

    def fb(cpu_lens):
        return ForwardBatch(mode=ForwardMode.DECODE, input_ids=torch.zeros(4, dtype=torch.int64),
                            positions=torch.zeros(4, dtype=torch.int64), out_cache_loc=loc,
                            req_pool_indices=rows.clone(), seq_lens=torch.tensor(lens),
                            logits_indices=torch.arange(4), seq_lens_cpu=cpu_lens)

    graph_fb = fb([])
    backend.init_forward_metadata_for_graph(graph_fb)
    out = backend.forward(*qkv, 0, graph_fb)
    ref_backend = TorchNativeAttention(pool, r2t, SCALE)
    ref_fb = fb(list(lens))
    ref_backend.init_forward_metadata(ref_fb)
    ref = ref_backend.forward(*qkv, 0, ref_fb)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A 2-layer Llama with GQA 6/2 (group of 3, like SmolLM2), head_dim 32, written as HF
    safetensors. Weights ~N(0, 0.08): peaked next-token distributions, so greedy argmax is decided
    by real margins, not by rounding between two kernels."""
    from safetensors.torch import save_file

    hidden, inter, hq, hkv, d, vocab, layers = 192, 384, 6, 2, 32, 512, 2
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": hq, "num_key_value_heads": hkv, "head_dim": d,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "float32"}
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,)}
    for i in range(layers):
        pre = f"model.layers.{i}."
        shapes.update({pre + "self_attn.q_proj.weight": (hq * d, hidden),
                       pre + "self_attn.k_proj.weight": (hkv * d, hidden),
                       pre + "self_attn.v_proj.weight": (hkv * d, hidden),
                       pre + "self_attn.o_proj.weight": (hidden, hq * d),
                       pre + "mlp.gate_proj.weight": (inter, hidden),
                       pre + "mlp.up_proj.weight": (inter, hidden),
                       pre + "mlp.down_proj.weight": (hidden, inter),
                       pre + "input_layernorm.weight": (hidden,),
                       pre + "post_attention_layernorm.weight": (hidden,)})
    tensors = {name: torch.ones(shape) if len(shape) == 1
               else torch.randn(shape, generator=gen) * 0.08 for name, shape in shapes.items()}
    path = tmp_path_factory.mktemp("tiny-llama-triton")
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_engine_greedy_matches_torch_native(tiny_checkpoint, monkeypatch):
    """Greedy tokens with attention_backend='triton' (interpreted) equal torch_native's: batched
    prompts sharing a prefix (prefill, decode), a cache-hit re-run, and a prompt that extends a
    cached one by a few tokens (extend with a prefix)."""
    import radixlm

    seen = []  # (mode, any cached prefix) of every batch the triton backend ran
    orig = TritonAttention.init_forward_metadata

    def record(self, fb):
        seen.append((fb.mode, any(fb.extend_prefix_lens_cpu)))
        orig(self, fb)

    monkeypatch.setattr(TritonAttention, "init_forward_metadata", record)
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(3, 512, (20,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 512, (n,), generator=gen).tolist() for n in (3, 11)]
    prompts.append(torch.randint(3, 512, (9,), generator=gen).tolist())
    longer = prompts[1] + [7, 8, 9]  # extends 3 tokens past the cached prompts[1]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    results = {}
    for backend in ("torch_native", "triton"):
        eng = radixlm.Engine(model_path=tiny_checkpoint, attention_backend=backend,
                             dtype="float32", skip_tokenizer_init=True, max_total_tokens=2048,
                             context_length=256)
        try:
            assert type(eng.runner.attn_backend).__name__ == {
                "torch_native": "TorchNativeAttention", "triton": "TritonAttention"}[backend]
            first = [o["output_ids"] for o in eng.generate(input_ids=prompts,
                                                           sampling_params=params)]
            # all but its last token cached: runs as a decode (batch_builder.as_decode)
            again = eng.generate(input_ids=prompts[1], sampling_params=params)["output_ids"]
            more = eng.generate(input_ids=longer, sampling_params=params)["output_ids"]
            eng.wait_idle()
            eng.check_integrity()
        finally:
            eng.shutdown()
        results[backend] = (first, again, more)
    assert results["triton"] == results["torch_native"]
    assert results["triton"][1] == results["triton"][0][1]  # the cache hit changes nothing
    assert (ForwardMode.DECODE, False) in seen and (ForwardMode.EXTEND, True) in seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_shared_prefix_decode_equals_plain(dtype):
    """Prefix groups (shared_prefix.py): the Triton ranged decode + non-causal prefix extend,
    merged by lse, equal plain decode attention over every key."""
    from test_shared_prefix import cascade_vs_plain  # tests/unit is on sys.path (no __init__)

    out, ref = cascade_vs_plain(TritonAttention, dtype)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])

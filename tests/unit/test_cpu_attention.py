"""The C++ CPU attention kernels (csrc/cpu_attention*.cpp) against a dense fp32 reference:
decode and extend (GQA, odd lengths and head dims, kv_start, causal and not, lse, key splits,
rows that see no key), bf16 / fp16 / fp32 pools, strided views, bad input, store_kv. The `cpu`
backend, its fallback and the engine are in test_cpu_attention_backend.py.

The kernels are built once per machine (~30 s, cached under ~/.cache/radixlm/kernels; `make
install` prebuilds them). Its tests skip only when the build tools are missing (no C++
compiler, or no ninja); any other build failure fails the tests (cpu_attention_ref.py).
"""

from __future__ import annotations

import re

import pytest
import torch

from cpu_attention_ref import DTYPES, OPS, TOL, close, close_lse, dense, make_pool
from radixlm.runtime.attention import cpu_kernels
from radixlm.runtime.mem_cache.kv_pool import KVPool


@pytest.fixture
def threads(request):
    """`threads(n)` sets torch's (and the kernels') thread count for the test, then restores it."""
    prev = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(prev)


# (Hq, Hkv, D): SmolLM2 (group of 3, D 64); a group of 4 at D 32; MHA with an odd D (vector tail)
SHAPES = [(9, 3, 64), (8, 2, 32), (3, 3, 20)]
SHAPE_IDS = ["gqa3-d64", "gqa4-d32", "mha-d20"]


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("hq, hkv, d", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("with_start", [False, True], ids=["from0", "kv_start"])
def test_decode_kernel(hq, hkv, d, dtype, with_start):
    gen = torch.Generator().manual_seed(hq * 100 + d)
    lens = [1, 7, 64, 65, 333, 1029, 2]  # odd lengths, block edges, long enough to split
    k, v, r2t, rows = make_pool(lens, hkv, d, dtype, gen, shared=40)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    start = torch.tensor([0, 3, 64, 10, 200, 1, 2]) if with_start else None  # the last sees none
    scale = d ** -0.5
    out, lse = cpu_kernels.decode(q, k, v, r2t, rows, torch.tensor(lens), scale, kv_start=start,
                                  return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    for b, ln in enumerate(lens):
        s0 = int(start[b]) if with_start else 0
        ro, rl = dense(q[b:b + 1], k, v, r2t[rows[b], s0:ln], scale)
        close(out[b:b + 1], ro, dtype)
        close_lse(lse[b:b + 1], rl)
    # return_lse=False gives the same output
    close(cpu_kernels.decode(q, k, v, r2t, rows, torch.tensor(lens), scale, kv_start=start), out,
          torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("hq, hkv, d", SHAPES[:2], ids=SHAPE_IDS[:2])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("with_start", [False, True], ids=["from0", "kv_start"])
def test_extend_kernel(hq, hkv, d, dtype, causal, with_start):
    gen = torch.Generator().manual_seed(7 * hq + d + causal)
    # (new query tokens, keys): prefill (n_q == keys), a cached prefix, one query (a decode row),
    # a query block longer than a task's rows, more queries than keys (causal: the first see none)
    spec = [(13, 13), (20, 300), (1, 71), (150, 190), (5, 3), (33, 1100)]
    total = [kv + 8 for _, kv in spec]  # kv_start needs room before the range
    k, v, r2t, rows = make_pool(total, hkv, d, dtype, gen, shared=60)
    n_q = [a for a, _ in spec]
    kv_len = torch.tensor([b for _, b in spec])
    start = torch.tensor([0, 8, 3, 1, 5, 2]) if with_start else None
    indptr = torch.tensor([0] + torch.tensor(n_q).cumsum(0).tolist())
    q = torch.randn(int(indptr[-1]), hq, d, generator=gen).to(dtype)
    scale = d ** -0.5
    out, lse = cpu_kernels.extend(q, k, v, r2t, rows, indptr, kv_len, scale, kv_start=start,
                                  causal=causal, return_lse=True)
    for s, (nq, kl) in enumerate(spec):
        s0 = int(start[s]) if with_start else 0
        qs = q[indptr[s]:indptr[s + 1]]
        ro, rl = dense(qs, k, v, r2t[rows[s], s0:s0 + kl], scale, kl - nq if causal else None)
        close(out[indptr[s]:indptr[s + 1]], ro, dtype)
        close_lse(lse[indptr[s]:indptr[s + 1]], rl)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("decode_len,n_rows,n_threads", [(1029, 20, 2), (1029, 20, 3), (4000, 6, 2)],
                         ids=["openmp-2", "openmp-3", "claim-pool"])
def test_key_splits_merge(dtype, decode_len, n_rows, n_threads, threads):
    """Few (sequence, head) tasks for the threads (batch-1 decode, one short query block over a
    long prefix): the kernel splits each key range and merges the splits by log-sum-exp. The
    same numbers as unsplit (1 thread) and as the dense reference, lse included. 20 query rows
    over 1,100 keys (198k key x query-row pairs) split on OpenMP; between kMinPoolWork and
    kMinParallelWork with at most 16 rows the splits run on the GEMMs' claim pool: a batch-1
    decode over 4,000 keys (36k) and a speculative verify's 6 rows over 1,100 keys (59k)."""
    gen = torch.Generator().manual_seed(31 + n_threads + decode_len)
    hq, hkv, d = 9, 3, 64
    k, v, r2t, rows = make_pool([decode_len, 1100], hkv, d, dtype, gen, shared=900)
    scale = d ** -0.5
    q1 = torch.randn(1, hq, d, generator=gen).to(dtype)
    q2 = torch.randn(n_rows, hq, d, generator=gen).to(dtype)
    indptr = torch.tensor([0, n_rows])
    res = {}
    for n in (1, n_threads):
        threads(n)
        res[n] = (cpu_kernels.decode(q1, k, v, r2t, rows[:1], torch.tensor([decode_len]), scale,
                                     return_lse=True),
                  cpu_kernels.extend(q2, k, v, r2t, rows[1:], indptr, torch.tensor([1100]), scale,
                                     return_lse=True))
    (o1, l1), (o2, l2) = res[n_threads]
    ro, rl = dense(q1, k, v, r2t[rows[0], :decode_len], scale)
    close(o1, ro, dtype)
    close_lse(l1, rl)
    ro, rl = dense(q2, k, v, r2t[rows[1], :1100], scale, 1100 - n_rows)
    close(o2, ro, dtype)
    close_lse(l2, rl)
    for split, unsplit in zip(res[n_threads], res[1]):
        torch.testing.assert_close(split[0].float(), unsplit[0].float(), atol=TOL[dtype] / 2,
                                   rtol=TOL[dtype] / 2)
        torch.testing.assert_close(split[1], unsplit[1], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_threads", [1, 2], ids=["1-thread", "2-threads"])
def test_decode_rows_do_not_depend_on_the_batch(dtype, n_threads, threads):
    """Each decode row equals, bit for bit, the same row decoded alone (batch 1): its key
    splits are planned as a batch of one would plan them, whatever the rows beside it, so a
    speculative verify run as decode rows gives what plain decode steps give, in bf16 too.
    Lengths below and above a lone row's split threshold (kMinPoolWork pairs: 3,641 keys at 9
    query heads), one request's history at several lengths as a verify's rows are."""
    threads(n_threads)
    gen = torch.Generator().manual_seed(5 + n_threads)
    hq, hkv, d = 9, 3, 64
    lens = [300, 1500, 3700, 5000]
    k, v, r2t, rows = make_pool(lens, hkv, d, dtype, gen)
    # a verify's shape too: request 3's history at 8 consecutive lengths
    rows_b = torch.cat([rows, rows[3:].repeat(8)])
    lens_b = torch.tensor(lens + [4993 + j for j in range(8)])
    q = torch.randn(len(lens_b), hq, d, generator=gen).to(dtype)
    out, lse = cpu_kernels.decode(q, k, v, r2t, rows_b, lens_b, d ** -0.5, return_lse=True)
    for i in range(len(lens_b)):
        o1, l1 = cpu_kernels.decode(q[i : i + 1], k, v, r2t, rows_b[i : i + 1],
                                    lens_b[i : i + 1], d ** -0.5, return_lse=True)
        assert torch.equal(out[i : i + 1], o1), f"row {i} ({int(lens_b[i])} keys)"
        assert torch.equal(lse[i : i + 1], l1), f"row {i} ({int(lens_b[i])} keys)"


def test_extend_writes_only_its_rows_and_any_strides():
    """q and out may be strided views (heads of a fused qkv); rows outside qo_indptr stay as
    they were; an empty sequence (n_q = 0) is skipped."""
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d = 9, 3, 64
    k, v, r2t, rows = make_pool([40, 50, 9], hkv, d, torch.float32, gen)
    qkv = torch.randn(30, hq + 2 * hkv, d, generator=gen)
    q = qkv[:, :hq]  # (30, 9, 64) with row stride 15 * 64
    out_full = torch.full((30, hq + 2, d), 7.0)
    out = out_full[:, 1:hq + 1]
    indptr = torch.tensor([2, 12, 12, 27])  # rows 0-1 and 27-29 belong to no sequence
    kv_len = torch.tensor([40, 50, 9])
    cpu_kernels.extend(q, k, v, r2t, rows, indptr, kv_len, 0.125, out=out)
    assert torch.all(out_full[:2] == 7.0) and torch.all(out_full[27:] == 7.0)
    assert torch.all(out_full[:, 0] == 7.0) and torch.all(out_full[:, -1] == 7.0)
    ro, _ = dense(q[2:12], k, v, r2t[rows[0], :40], 0.125, 30)
    close(out[2:12], ro, torch.float32)
    ro, _ = dense(q[12:27], k, v, r2t[rows[2], :9], 0.125, -6)
    close(out[12:27], ro, torch.float32)


def test_kernels_reject_bad_slots_and_shapes():
    gen = torch.Generator().manual_seed(12)
    k, v, r2t, rows = make_pool([10], 2, 32, torch.float32, gen)
    q = torch.randn(1, 4, 32)
    bad = r2t.clone()
    bad[rows[0], 3] = k.shape[0] + 5  # a slot outside the pool
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        cpu_kernels.decode(q, k, v, bad, rows, torch.tensor([10]), 0.1)
    with pytest.raises(RuntimeError, match="exceeds req_to_token"):
        cpu_kernels.decode(q, k, v, r2t, rows, torch.tensor([r2t.shape[1] + 1]), 0.1)
    with pytest.raises(RuntimeError, match="Hq % Hkv"):
        cpu_kernels.decode(torch.randn(1, 3, 32), k, v, r2t, rows, torch.tensor([10]), 0.1)
    with pytest.raises(RuntimeError, match="req_pool_index 9 out of range"):
        cpu_kernels.decode(q, k, v, r2t, torch.tensor([9]), torch.tensor([10]), 0.1)
    with pytest.raises(RuntimeError, match="seq_lens: contiguous int64 CPU tensor of 1 elements"):
        OPS.decode(q, k, v, r2t, rows, torch.empty(0, dtype=torch.int64),
                   torch.tensor([10], dtype=torch.int32), 0.1, 0, 0.0, torch.empty_like(q),
                   torch.empty(0))


def test_store_kv_matches_pool_write():
    gen = torch.Generator().manual_seed(13)
    for dtype in (torch.float32, torch.bfloat16):
        a = KVPool(50, 1, 3, 64, dtype, "cpu")
        b = KVPool(50, 1, 3, 64, dtype, "cpu")
        loc = torch.randperm(50, generator=gen)[:17] + 1
        kv = torch.randn(17, 2 * 3, 64, generator=gen).to(dtype)
        k, v = kv[:, :3], kv[:, 3:]  # strided views, as the model's fused projection gives
        a.write(0, loc, k, v)
        OPS.store_kv(k, v, b.k_buffers[0], b.v_buffers[0], loc)
        assert torch.equal(a.k_buffers[0], b.k_buffers[0])
        assert torch.equal(a.v_buffers[0], b.v_buffers[0])
    # a dtype mismatch (fp32 K into a bf16 pool) converts like KVPool.write
    c = KVPool(50, 1, 3, 64, torch.bfloat16, "cpu")
    k32 = torch.randn(4, 3, 64, generator=gen)
    OPS.store_kv(k32, k32, c.k_buffers[0], c.v_buffers[0], torch.tensor([1, 2, 3, 4]))
    assert torch.equal(c.k_buffers[0][1:5], k32.to(torch.bfloat16))


def test_build_key_covers_every_source_and_header():
    """Every csrc/cpu_attention*.cpp (and the fused elementwise ops', the GEMM's and the layer
    stack's sources) is compiled, and every file a source or header includes with quotes is
    hashed into the build's name, so that a change to any of them rebuilds."""
    csrc = cpu_kernels._CSRC
    expected = ({p.name for p in csrc.glob("cpu_attention*.cpp")}
                | {"cpu_elementwise.cpp", "cpu_gemm.cpp", "cpu_layers.cpp"})
    assert expected == set(cpu_kernels._SOURCES)
    # the one translation unit compiled includes exactly the sources, and is hashed too
    unity = (csrc / cpu_kernels._UNITY).read_text()
    assert re.findall(r'^\s*#\s*include\s+"([^"]+)"', unity, re.M) == list(cpu_kernels._SOURCES)
    for name in cpu_kernels._SOURCES + cpu_kernels._HEADERS:
        for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', (csrc / name).read_text(), re.M):
            assert inc in cpu_kernels._HEADERS, (name, inc)


def test_build_name_changes_with_the_unity_file(tmp_path, monkeypatch):
    """An edit of the translation unit that is compiled (not only of the files it includes)
    names a new build."""
    import shutil

    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_kernels._CSRC, csrc)
    monkeypatch.setattr(cpu_kernels, "_CSRC", csrc)
    before = cpu_kernels.module_name()
    unity = csrc / cpu_kernels._UNITY
    unity.write_text(unity.read_text() + "// edited\n")
    assert cpu_kernels.module_name() != before

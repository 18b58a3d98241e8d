"""Two-batch overlap (`--enable-two-batch-overlap`): a tensor-parallel EXTEND's all-reduces run
beside compute instead of between it.

A TP layer all-reduces twice (after o_proj and after down_proj), and in a large extend each is
tens of MB (8192 tokens x 4096 x bf16 = 64 MB) during which the rank's GPU computes nothing.
Measured on 2 x H200 (Llama-3.1-8B shape, 128 x (512, 128), docs/parallelism.md) it does not
pay: 0.977-0.993x of plain TP=2, the all-reduces and GEMMs slowing each other down when they
share the SMs; so it is off by default. Here each layer's tokens are cut in two
halves A and B after attention (attention itself runs once over the whole batch: its metadata
is per request, and the halves are rows): o_proj(A), its all-reduce started; o_proj(B) runs
while A's reduces; B's started; A's norm and MLP run while B's reduces, A's MLP all-reduce
started; B's norm and MLP run while it reduces; the layer ends waiting for the last one. Three
of the four all-reduces overlap compute. Every op is row-wise, so each row's arithmetic is the
plain path's (a GEMM may pick another kernel for half the rows: TP's other rounding).

Only the Llama layer classes (llama.py's DecoderLayer, Attention and MLP: Llama, Mistral,
Qwen2, ...) and only batches of at least MIN_TOKENS; decode steps run as before (CUDA graphs)."""

from __future__ import annotations

import torch

from radixlm.runtime.layers.parallel_linear import RowParallelLinear, reduce_deferred

# an extend of fewer tokens runs plain: halves below ~1k rows lose GEMM efficiency, and their
# all-reduces (a few MB) are short anyway
MIN_TOKENS = 2048


def check_supported(model, tp_size: int) -> None:
    """Raise (naming the flag) where two-batch overlap cannot run: without TP, or a model whose
    layers are not llama.py's classes (the model says: `supports_two_batch_overlap`)."""
    if tp_size < 2:
        raise ValueError("--enable-two-batch-overlap overlaps tensor-parallel all-reduces: it "
                         "needs --tp-size 2 or more")
    says = getattr(model, "supports_two_batch_overlap", None)
    if says is None or not says():
        raise ValueError(f"--enable-two-batch-overlap: {type(model).__name__} is not supported "
                         f"(Llama-family layers without row-parallel biases are)")


def row_parallel(linear) -> bool:
    """A row-parallel projection whose all-reduce can wait (no bias to add after it)."""
    return isinstance(linear, RowParallelLinear) and linear.bias is None


def applies(fb, tokens: int) -> bool:
    return tokens >= MIN_TOKENS and not fb.capture_layers


def run_layers(layers, x: torch.Tensor, cos_sin, fb, tp) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer loop with each layer's all-reduces overlapped: (x, residual), (T, hidden)
    each, as the plain loop returns them."""
    residual = None
    split = x.shape[0] // 2
    for layer in layers:
        x, residual = _layer(layer, x, cos_sin, fb, residual, split, tp)
    return x, residual


def _layer(layer, x, cos_sin, fb, residual, split: int, tp):
    if residual is None:
        h = layer.input_layernorm(x)
        residual = x
    else:
        h, residual = layer.input_layernorm(x, residual)
    o = layer.self_attn(h, cos_sin, fb, project=False)  # (T, q_size / tp)
    halves = (slice(0, split), slice(split, o.shape[0]))
    started = []
    with reduce_deferred():
        for rows in halves:  # o_proj(B) runs while A's all-reduce does
            started.append((rows, *tp.all_reduce_async(layer.self_attn.o_proj(o[rows]))))
        mlp_started = []
        for rows, y, wait in started:  # A's norm and MLP run while B's all-reduce does
            wait()
            h_half, r_half = layer.post_attention_layernorm(y, residual[rows])
            m, m_wait = tp.all_reduce_async(layer.mlp(h_half))
            mlp_started.append((m, m_wait, r_half))
    for _, m_wait, _ in mlp_started:
        m_wait()
    return (torch.cat([m for m, _, _ in mlp_started]),
            torch.cat([r for _, _, r in mlp_started]))

"""On a CUDA GPU: SGLang's request fields that read the step's logits or hidden states survive the
fast paths (CUDA graphs, overlap): token_ids_logprob, logit_bias, embeddings. A random-weight
Llama, fp32; the reference is the same engine with graphs and overlap off."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

FAST = {}  # the defaults on CUDA: triton, CUDA graphs, overlap
SLOW = dict(attention_backend="torch_native", disable_cuda_graph=True,
            disable_overlap_schedule=True)


@pytest.fixture(scope="module")
def tiny_llama_path(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=704,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, rms_norm_eps=1e-5, initializer_range=0.08,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama-fields")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _run(path, **kw):
    import radixlm

    eng = radixlm.Engine(model_path=path, device="cuda", dtype="float32", skip_tokenizer_init=True,
                         max_total_tokens=16384, context_length=1024, **kw)
    try:
        gen = torch.Generator().manual_seed(5)
        prompts = [torch.randint(3, 2048, (20 + 7 * i,), generator=gen).tolist() for i in range(6)]
        sp = [{"temperature": 0, "max_new_tokens": 10 + 3 * i, "ignore_eos": True}
              for i in range(6)]
        plain = eng.generate(input_ids=prompts, sampling_params=sp)
        lp = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True,
                          top_logprobs_num=2, token_ids_logprob=[7, 8, 9])
        biased = eng.generate(input_ids=prompts[0], sampling_params={
            "temperature": 0, "max_new_tokens": 6, "ignore_eos": True, "logit_bias": {"11": 1e4}})
        emb = eng.encode(input_ids=prompts[:2], pooling="last")
        eng.wait_idle()
        eng.check_integrity()
        return plain, lp, biased, emb
    finally:
        eng.shutdown()


def test_fields_on_the_fast_path_match_the_reference(tiny_llama_path):
    ref_plain, ref_lp, _, ref_emb = _run(tiny_llama_path, **SLOW)
    plain, lp, biased, emb = _run(tiny_llama_path, **FAST)
    assert [o["output_ids"] for o in plain] == [o["output_ids"] for o in ref_plain]
    for o, r in zip(lp, ref_lp):
        m, rm = o["meta_info"], r["meta_info"]
        assert o["output_ids"] == r["output_ids"]
        ids_lp = m["output_token_ids_logprobs"]
        assert len(ids_lp) == len(o["output_ids"]) == len(rm["output_token_ids_logprobs"])
        for got, want in zip(ids_lp, rm["output_token_ids_logprobs"]):
            assert [e[1] for e in got] == [7, 8, 9]
            assert all(abs(a[0] - b[0]) < 1e-3 for a, b in zip(got, want))
    assert biased["output_ids"] == [11] * 6
    for e, r in zip(emb, ref_emb):
        assert torch.allclose(torch.tensor(e["embedding"]), torch.tensor(r["embedding"]),
                              atol=1e-3)

"""The EAGLE-3 head's drafts, step by step, against an independent reference: the target's
layer outputs from HF transformers (output_hidden_states: entry i + 1 is layer i's output) and
the head written out in plain torch over the whole sequence (full causal attention, no KV
cache): row p = (token x_{p+1}, fc(layers 1, 1, 0 at p)) at position p; the chain appends
(d_j, the row before's pre-norm output). The engine computes the same rows piecewise (prefill
chunks of 16, verifies, its chain's own slots), so every draft of every step must agree."""

from __future__ import annotations

import os

import pytest
import torch

V, DV = 256, 100


def _rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta=10000.0):
    """x (T, h, d), HF's rotate-half convention."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = pos.double()[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos().float()[:, None], emb.sin().float()[:, None]
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


class RefHead:
    def __init__(self, w: dict, embed: torch.Tensor, heads=4, kv_heads=2):
        self.w, self.embed, self.h, self.kv = w, embed, heads, kv_heads
        self.hot = torch.arange(DV) + w["d2t"]

    def rows(self, toks, g, pos):
        """All rows at once, causal in row order -> (normed, pre-norm) (T, H)."""
        w, m = self.w, "midlayer."
        x = torch.cat([_rms(self.embed[toks], w[m + "input_layernorm.weight"]),
                       _rms(g, w[m + "hidden_norm.weight"])], -1)  # (T, 2H)
        T, d = x.shape[0], 64 // self.h
        q = (x @ w[m + "self_attn.q_proj.weight"].T).view(T, self.h, d)
        k = (x @ w[m + "self_attn.k_proj.weight"].T).view(T, self.kv, d)
        v = (x @ w[m + "self_attn.v_proj.weight"].T).view(T, self.kv, d)
        q, k = _rope(q, pos), _rope(k, pos)
        rep = self.h // self.kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("thd,shd->hts", q, k) / d ** 0.5
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, -1)
        h = o @ w[m + "self_attn.o_proj.weight"].T + g
        y = _rms(h, w[m + "post_attention_layernorm.weight"])
        y = (torch.nn.functional.silu(y @ w[m + "mlp.gate_proj.weight"].T)
             * (y @ w[m + "mlp.up_proj.weight"].T)) @ w[m + "mlp.down_proj.weight"].T
        out = y + h
        return _rms(out, w["norm.weight"]), out

    def chain(self, seq: list[int], aux: torch.Tensor, k: int) -> list[int]:
        """Drafts after `seq` (its last token not yet computed by the target), aux (>= N, 3H)."""
        n = len(seq) - 1
        toks = torch.tensor(seq[1:])
        g = aux[:n] @ self.w["fc.weight"].T
        pos = torch.arange(n)
        out = []
        for _ in range(k):
            normed, pre = self.rows(toks, g, pos)
            d = int(self.hot[(normed[-1] @ self.w["lm_head.weight"].T).argmax()])
            out.append(d)
            toks = torch.cat([toks, torch.tensor([d])])
            g = torch.cat([g, pre[-1:]])
            pos = torch.cat([pos, pos[-1:] + 1])
        return out

    def tree(self, seq: list[int], aux: torch.Tensor, topk: int, depth: int, nodes: int):
        """The draft tree after `seq`: level 1 the head's top-k after it; each level below,
        every one of the top-k paths so far (by summed log-probability) runs its own rows
        (its path appended to seq's) and proposes its top-k children; then the best `nodes`."""
        from radixlm.runtime.speculative.tree import select_tree

        n = len(seq) - 1
        toks, g, pos = torch.tensor(seq[1:]), aux[:n] @ self.w["fc.weight"].T, torch.arange(n)
        cands = ([], [], [], [])  # scores, tokens, parents, depths

        def expand(path_toks, path_g, score, parent, level):
            k = len(path_toks)
            normed, pre = self.rows(torch.cat([toks, torch.tensor(path_toks, dtype=torch.long)]),
                                    torch.cat([g] + path_g), torch.arange(n + k))
            lp = torch.log_softmax(normed[-1] @ self.w["lm_head.weight"].T, -1).topk(topk)
            kids = []
            for v, i in zip(lp.values.tolist(), lp.indices.tolist()):
                c = len(cands[0])
                for lst, x in zip(cands, (score + v, int(self.hot[i]), parent, level)):
                    lst.append(x)
                kids.append((score + v, c, path_toks + [int(self.hot[i])], path_g + [pre[-1:]]))
            return kids

        beams = expand([], [], 0.0, -1, 1)
        for level in range(2, depth + 1):
            kids = [k for s, c, t, pg in beams for k in expand(t, pg, s, c, level)]
            beams = sorted(kids, key=lambda k: -k[0])[:topk]
        return select_tree(*cands, nodes, depth)


def _generate_then_reference(eng, target: str, head: str, max_new: int, integrity):
    """Greedy outputs of three prompts (rids a, b, c) from `eng` (shut down after), then HF's
    model of the target and the reference head: (prompts, rid -> prompt + output, hf, ref)."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (50, 7, 20)]
    try:
        outs = eng.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}, rid=["a", "b", "c"])
        integrity(eng)
    finally:
        eng.shutdown()
    hf = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ref = RefHead(load_file(os.path.join(head, "model.safetensors")),
                  hf.model.embed_tokens.weight.detach())
    return prompts, {rid: p + o["output_ids"] for rid, p, o in zip("abc", prompts, outs)}, hf, ref


@pytest.mark.parametrize("backend", ["auto", "torch_native"])
def test_drafts_equal_a_reference_head(backend, tmp_path, monkeypatch, integrity):
    import radixlm
    from radixlm.runtime.speculative import eagle3
    from tiny_models import write_tiny_eagle3, write_tiny_llama

    target = write_tiny_llama(str(tmp_path / "t"), vocab=V, heads=4, kv_heads=2, tied=False,
                              layers=4)
    head = write_tiny_eagle3(str(tmp_path / "h"), vocab=V, draft_vocab=DV, seed=3)
    seen = []  # (request, tokens so far, k, drafts)
    ks: dict = {}
    orig_draft, orig_dev = eagle3.Eagle3Speculator.draft, eagle3.Eagle3Speculator.device_drafts

    def draft(self, sched, reqs):
        out = orig_draft(self, sched, reqs)
        ks.update({id(r): len(d) for r, d in zip(reqs, out)})
        return out

    def device_drafts(self, reqs):
        grid = orig_dev(self, reqs)
        for b, r in enumerate(reqs):
            if ks.get(id(r)):
                seen.append((r.rid, r.vocab_input_ids() + list(r.output_ids),
                             grid[b, : ks[id(r)]].tolist()))
        return grid

    monkeypatch.setattr(eagle3.Eagle3Speculator, "draft", draft)
    monkeypatch.setattr(eagle3.Eagle3Speculator, "device_drafts", device_drafts)
    eng = radixlm.Engine(model_path=target, speculative_algorithm="EAGLE3",
                         speculative_draft_model_path=head, speculative_adaptive=False,
                         speculative_num_steps=4, chunked_prefill_size=16,
                         skip_tokenizer_init=True, max_total_tokens=2048, context_length=512,
                         dtype="float32", attention_backend=backend)
    prompts, full, hf, ref = _generate_then_reference(eng, target, head, 24, integrity)
    aux = {}
    with torch.no_grad():
        for rid, seq in full.items():
            hs = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
            aux[rid] = torch.cat([hs[1 + i][0] for i in (1, 1, 0)], -1)  # (N, 3H)
    assert len(seen) > 10
    for rid, seq, drafts in seen:
        assert full[rid][: len(seq)] == seq
        assert ref.chain(seq, aux[rid], len(drafts)) == drafts, (rid, len(seq))


def test_draft_trees_equal_a_reference_head(tmp_path, monkeypatch, integrity):
    """Top-k 3, 3 steps, 16 tokens: every tree the engine drafts (its beams' rows in scratch
    rows of req_to_token, prefill chunks of 16, verifies of earlier trees) equals the
    reference's beam search over the same head."""
    import radixlm
    from radixlm.runtime.speculative import eagle3
    from radixlm.runtime.speculative.tree import DraftTree
    from safetensors.torch import load_file, save_file
    from tiny_models import write_tiny_eagle3, write_tiny_llama

    target = write_tiny_llama(str(tmp_path / "t"), vocab=V, heads=4, kv_heads=2, tied=False,
                              layers=4)
    head = write_tiny_eagle3(str(tmp_path / "h"), vocab=V, draft_vocab=DV, seed=3)
    # sharper attention and a larger attention output, so that which path a row attends to
    # changes its top-k (with the random 0.08-scaled weights it hardly does)
    w = load_file(os.path.join(head, "model.safetensors"))
    for name, scale in (("q_proj", 6.0), ("k_proj", 6.0), ("v_proj", 4.0), ("o_proj", 4.0)):
        w[f"midlayer.self_attn.{name}.weight"] *= scale
    save_file(w, os.path.join(head, "model.safetensors"))
    seen = []  # (request, tokens so far, its tree)
    orig_draft = eagle3.Eagle3Speculator.draft

    def draft(self, sched, reqs):
        out = orig_draft(self, sched, reqs)
        seen.extend((r.rid, r.vocab_input_ids() + list(r.output_ids), d)
                    for r, d in zip(reqs, out) if isinstance(d, DraftTree))
        return out

    monkeypatch.setattr(eagle3.Eagle3Speculator, "draft", draft)
    eng = radixlm.Engine(model_path=target, speculative_algorithm="EAGLE3",
                         speculative_draft_model_path=head, speculative_adaptive=False,
                         speculative_eagle_topk=3, speculative_num_steps=3,
                         speculative_num_draft_tokens=16, chunked_prefill_size=16,
                         skip_tokenizer_init=True, max_total_tokens=2048, context_length=512,
                         dtype="float32")
    prompts, full, hf, ref = _generate_then_reference(eng, target, head, 16, integrity)
    assert len(seen) > 10 and max(t.depth for _, _, t in seen) == 3
    with torch.no_grad():
        for rid, seq, tree in seen:
            hs = hf(torch.tensor([full[rid]]), output_hidden_states=True).hidden_states
            aux = torch.cat([hs[1 + i][0] for i in (1, 1, 0)], -1)  # (N, 3H)
            assert full[rid][: len(seq)] == seq
            want = ref.tree(seq, aux, 3, min(3, 16 - (len(seq) - len(prompts["abc".index(rid)]))
                                             - 1), len(tree))
            assert want == tree, (rid, len(seq))


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q", "-n", "0"])

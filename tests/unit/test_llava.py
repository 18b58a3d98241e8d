"""LLaVA (CLIP tower + projector + Llama) on a tiny random-weight checkpoint written by
transformers, against HF 5.23 in fp32: the processor's prompt expansion, greedy tokens, prompt
logprobs; the radix cache across identical images, cache off, chunked prefill that cuts an image,
and bad image inputs (clear errors, no KV leaked)."""

from __future__ import annotations

import base64

import pytest
import torch

pytest.importorskip("PIL")
import llava_tiny as lt  # noqa: E402

import radixlm  # noqa: E402

MAX_NEW = 8
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
CASES = [  # (prompt, image seeds)
    ("USER: <image>\nWhat is in the picture? ASSISTANT:", [1]),
    ("USER: Compare these two images, please. <image>\nand <image>\nASSISTANT:", [2, 3]),
    ("<image>\nDescribe the image.", [4]),
    # a prompt that ends in its image, and one that extends it: with chunked prefill (7) the
    # second is admitted at the first's last chunk, its cache hit ends inside the image (21 of
    # 8..24) and the tower runs again for the rest of the image
    ("Describe the image. <image>", [5]),
    ("Describe the image. <image>\nWhat is in the picture?", [5]),
    ("<image>\n<image>\nCompare these two images, please.", [6, 6]),  # one image twice
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llava"))
    model, proc = lt.make_checkpoint(path)
    refs = []
    for text, seeds in CASES:
        imgs = [lt.image(s) for s in seeds]
        ids, out = lt.hf_greedy(model, proc, text, imgs, MAX_NEW)
        refs.append((text, imgs, ids, out))
    return path, model, proc, refs


def engine(path, **kw):
    return radixlm.Engine(model_path=path, dtype="float32", context_length=256,
                          max_total_tokens=2048, **kw)


def finish(eng):
    eng.wait_idle()
    eng.check_integrity()
    eng.shutdown()


def test_prompt_expansion_and_greedy_match_hf(ckpt):
    path, _, _, refs = ckpt
    eng = engine(path)
    try:
        for text, imgs, ids, _ in refs:  # the processor's expansion of <image>, image id shown
            reqs, _ = eng.builder.build(text, None, GREEDY, False, None, None, None,
                                        {"image_data": imgs})
            assert reqs[0].vocab_input_ids() == ids
            assert len(reqs[0].mm.images) == len(imgs)
        outs = eng.generate([r[0] for r in refs], GREEDY, image_data=[r[1] for r in refs])
        for (text, imgs, ids, ref), out in zip(refs, outs):  # one batch, then one by one
            assert out["output_ids"] == ref, text
            one = eng.generate(text, GREEDY, image_data=imgs)
            assert one["output_ids"] == ref, text
            assert one["meta_info"]["prompt_tokens"] == len(ids)
    finally:
        finish(eng)


def test_prompt_logprobs_match_hf(ckpt):
    path, model, proc, refs = ckpt
    eng = engine(path, disable_radix_cache=True)
    try:
        for text, imgs, ids, _ in refs:
            out = eng.generate(text, {**GREEDY, "max_new_tokens": 1}, image_data=imgs,
                               return_logprob=True, logprob_start_len=0)
            got = [t[0] for t in out["meta_info"]["input_token_logprobs"][1:]]
            assert [t[1] for t in out["meta_info"]["input_token_logprobs"]] == ids
            ref = lt.hf_prompt_logprobs(model, proc, text, imgs)
            assert torch.allclose(torch.tensor(got), torch.tensor(ref), atol=1e-3)
    finally:
        finish(eng)


def test_cache_hits_identical_images_only(ckpt):
    path, _, _, refs = ckpt
    text, imgs, ids, ref = refs[0]
    eng = engine(path)
    try:
        first = eng.generate(text, GREEDY, image_data=imgs)
        second = eng.generate(text, GREEDY, image_data=imgs)
        image_end = ids.index(imgs and lt_image_id(eng)) + lt.TOKENS_PER_IMAGE
        assert second["output_ids"] == first["output_ids"] == ref
        assert second["meta_info"]["cached_tokens"] >= image_end  # the image's KV is reused
        other = eng.generate(text, GREEDY, image_data=[lt.image(9)])  # same text, new image
        assert other["meta_info"]["cached_tokens"] <= ids.index(lt_image_id(eng))
        assert other["output_ids"] != ref
    finally:
        finish(eng)


def lt_image_id(eng) -> int:
    return eng.builder.image_processor.image_token_id


@pytest.mark.parametrize("kw", [{"disable_radix_cache": True}, {"chunked_prefill_size": 7},
                                {"chunked_prefill_size": 5, "disable_radix_cache": True}])
def test_cache_off_and_chunks_that_cut_images_are_identical(ckpt, kw):
    path, _, _, refs = ckpt
    eng = engine(path, **kw)
    try:
        for _ in range(2):  # the second round hits the cache (when on), inside images too
            outs = eng.generate([r[0] for r in refs] * 2, GREEDY,
                                image_data=[r[1] for r in refs] * 2)
            assert [o["output_ids"] for o in outs] == [r[3] for r in refs] * 2
    finally:
        finish(eng)


def test_image_input_forms(ckpt, tmp_path):
    path, _, _, refs = ckpt
    text, imgs, _, ref = refs[0]
    raw = lt.png_bytes(imgs[0])
    file = tmp_path / "img.png"
    file.write_bytes(raw)
    b64 = base64.b64encode(raw).decode()
    eng = engine(path)
    try:
        for form in (raw, str(file), f"file://{file}", b64, f"data:image/png;base64,{b64}"):
            assert eng.generate(text, GREEDY, image_data=form)["output_ids"] == ref
    finally:
        finish(eng)


def test_bad_image_inputs_are_refused_without_leaks(ckpt):
    path, _, _, refs = ckpt
    text, imgs, _, _ = refs[0]
    eng = engine(path)
    try:
        bad = [("http://example.com/cat.png", "not fetched"), ("%%%", "data: URL"),
               (base64.b64encode(b"not an image").decode(), "not a readable image"),
               ("data:image/png,abc", "base64"), (123, "expected an image"),
               ([imgs[0], imgs[0]], r"2 image\(s\) for 1 image token")]
        for data, msg in bad:
            with pytest.raises(ValueError, match=msg):
                eng.generate(text, GREEDY, image_data=data)
        with pytest.raises(ValueError, match="image"):
            eng.generate("no image token here", GREEDY, image_data=imgs)
        assert eng.generate(text, GREEDY, image_data=imgs)["output_ids"] == refs[0][3]
    finally:
        finish(eng)


def test_refused_configs(ckpt, tmp_path):
    import json
    import shutil

    path = ckpt[0]
    for change, field in ((("vision_config", "model_type"), "siglip_vision_model"),
                          (("model_type",), "llava_next"),
                          (("text_config", "model_type"), "mistral")):
        dst = tmp_path / field
        shutil.copytree(path, dst)
        cfg = json.loads((dst / "config.json").read_text())
        d = cfg
        for k in change[:-1]:
            d = d[k]
        d[change[-1]] = field
        (dst / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=change[-1] if len(change) == 1 else change[0]):
            engine(str(dst))
    dst = tmp_path / "layer"
    shutil.copytree(path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "vision_feature_layer": -9}))
    with pytest.raises(ValueError, match="vision_feature_layer -9: the tower has 3"):
        engine(str(dst))


def test_chat_template_places_the_image_token(ckpt):
    """server/chat_images.render: a template that takes content parts gets them; ChatML gets the
    image token inline where the part is; a text-only model refuses images (400)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from radixlm.server.chat_images import render
    from radixlm.server.errors import APIError
    from radixlm.server.tokenizer_manager import CHATML_FALLBACK

    tok = AutoTokenizer.from_pretrained(ckpt[0])
    image_id = tok.convert_tokens_to_ids("<image>")
    tm = SimpleNamespace(tokenizer=tok, chat_template=None, builder=SimpleNamespace(
        image_processor=SimpleNamespace(image_token_id=image_id)))
    msgs = [{"role": "user", "content": "Compare", "_parts": [
        {"type": "text", "text": "Compare"}, {"type": "image", "image": "a.png"},
        {"type": "image", "image": "b.png"}]}]
    fn = lambda ms: tok.apply_chat_template(ms, chat_template=tm.chat_template,  # noqa: E731
                                            tokenize=False, add_generation_prompt=True)
    text, images = render(tm, msgs, fn)
    assert images == ["a.png", "b.png"] and text.startswith("USER: Compare<image>\n<image>\n")
    tm.chat_template = CHATML_FALLBACK
    text, _ = render(tm, msgs, fn)
    assert "<|im_start|>user\nCompare\n<image>\n<image><|im_end|>" in text
    tm.builder.image_processor = None
    with pytest.raises(APIError, match="takes no images"):
        render(tm, msgs, fn)
    assert render(tm, [{"role": "user", "content": "hi"}], fn)[1] == []


@pytest.mark.parametrize("kw", [{"vision_feature_layer": [-3, -1]},
                                {"vision_feature_select_strategy": "full"}])
def test_feature_layers_and_full_strategy_match_hf(tmp_path, kw):
    """A list of feature layers (concatenated, a wider projector) and the 'full' strategy (the CLS
    row kept: 17 tokens per image), against HF."""
    model, proc = lt.make_checkpoint(str(tmp_path), **kw)
    text, imgs = CASES[1][0], [lt.image(s) for s in CASES[1][1]]
    ids, ref = lt.hf_greedy(model, proc, text, imgs, MAX_NEW)
    eng = engine(str(tmp_path), chunked_prefill_size=9)
    try:
        out = eng.generate(text, GREEDY, image_data=imgs, return_logprob=True,
                           logprob_start_len=0)
        assert [t[1] for t in out["meta_info"]["input_token_logprobs"]] == ids
        assert out["output_ids"] == ref
    finally:
        finish(eng)


def test_retraction_recomputes_image_features(ckpt):
    """A KV pool too small for four image requests decoding together retracts one; re-admitted,
    its image rows are computed again from the pixels (the features were dropped after its
    prefill): the same tokens as alone."""
    path, _, _, refs = ckpt
    text, imgs, _, _ = refs[0]
    images = [lt.image(20 + i) for i in range(4)]
    sp = {**GREEDY, "max_new_tokens": 40}
    eng = engine(path)
    try:
        alone = [eng.generate(text, sp, image_data=im)["output_ids"] for im in images]
    finally:
        finish(eng)
    eng = radixlm.Engine(model_path=path, dtype="float32", context_length=256,
                         max_total_tokens=200)
    try:
        outs = eng.generate([text] * 4, sp, image_data=images)
        assert [o["output_ids"] for o in outs] == alone
        assert sum(o["meta_info"]["total_retractions"] for o in outs) >= 1
    finally:
        finish(eng)


def test_failing_image_fails_only_its_request(ckpt, monkeypatch):
    """An exception while encoding one request's image (the vision tower runs per request before
    the batch's forward, runtime/scheduler/isolation.py) fails that request with an error; the
    others get the tokens of a clean run, nothing leaks, the engine serves on."""
    path, _, _, refs = ckpt
    text = refs[0][0]
    images = [lt.image(30 + i) for i in range(3)]
    eng = engine(path)
    try:
        clean = [o["output_ids"] for o in eng.generate([text] * 3, GREEDY, image_data=images)]
        eng.wait_idle()
        eng.flush_cache()  # the images are encoded again, not served from the cache
        model_cls = type(eng.scheduler.runner.model)
        real, calls = model_cls._features, []

        def features(self, item):
            if item.features is None:
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError("injected image failure")
            return real(self, item)

        monkeypatch.setattr(model_cls, "_features", features)
        outs = eng.generate([text] * 3, GREEDY, image_data=images)
        monkeypatch.undo()
        reasons = [o["meta_info"]["finish_reason"] for o in outs]
        assert reasons[1]["status_code"] == 500 and "image" in reasons[1]["message"], reasons
        assert [outs[i]["output_ids"] for i in (0, 2)] == [clean[0], clean[2]]
        assert eng.get_stats()["request_failures"] == 1
        eng.wait_idle()
        eng.check_integrity()
        assert eng.generate(text, GREEDY, image_data=images[1])["output_ids"] == clean[1]
    finally:
        finish(eng)

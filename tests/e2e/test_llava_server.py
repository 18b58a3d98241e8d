"""A served tiny random-weight LLaVA (tests/unit/llava_tiny.py) through the real clients: /generate
image_data, the OpenAI SDK's image_url parts and the Anthropic SDK's base64 image blocks. Greedy
ids equal HF 5.23's (fp32, the processor's expansion); the chat APIs give the /generate text of
the same prompt; a repeated request reports its cached tokens (the image's included)."""

from __future__ import annotations

import base64
import os
import sys

import pytest

pytest.importorskip("PIL")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "unit"))
import llava_tiny as lt  # noqa: E402
from server_harness import start_server, stop_and_check  # noqa: E402

MAX_NEW = 6
QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llava"))
    model, proc = lt.make_checkpoint(path)
    img = lt.image(7)
    png = lt.png_bytes(img)
    from PIL import Image
    import io

    img = Image.open(io.BytesIO(png)).convert("RGB")  # the pixels the server will read
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids, ref = lt.hf_greedy(model, proc, text, [img], MAX_NEW)
    srv = start_server(["--model-path", path, "--dtype", "float32", "--context-length", "256",
                       "--max-total-tokens", "2048", "--enable-cache-report"], name="llava")
    try:
        yield srv, text, png, ids, ref
    finally:
        stop_and_check(srv)


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def native(srv, text, image_data, **sp):
    r = srv.post("/generate", {"text": text, "image_data": image_data, "sampling_params": {
        "temperature": 0, "max_new_tokens": MAX_NEW, **sp}})
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_image_data_matches_hf_and_caches(served, tmp_path):
    srv, text, png, ids, ref = served
    file = tmp_path / "img.png"
    file.write_bytes(png)
    first = native(srv, text, data_url(png), ignore_eos=True)
    assert first["output_ids"] == ref
    assert first["meta_info"]["prompt_tokens"] == len(ids)
    again = native(srv, text, str(file), ignore_eos=True)  # a path to the same image
    assert again["output_ids"] == ref
    assert again["meta_info"]["cached_tokens"] >= ids.index(2) + lt.TOKENS_PER_IMAGE
    batch = srv.post("/generate", {"text": [text, text], "image_data": [
        base64.b64encode(png).decode(), [data_url(png)]], "sampling_params": {
        "temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}}).json()
    assert [b["output_ids"] for b in batch] == [ref, ref]
    bad = srv.post("/generate", {"text": text, "image_data": "http://example.com/a.png"})
    assert bad.status_code == 400 and "not fetched" in bad.text
    bad = srv.post("/generate", {"text": text, "image_data": [data_url(png)] * 2})
    assert bad.status_code == 400 and "image token" in bad.text
    srv.wait_idle()
    srv.check_integrity()


def test_openai_sdk_image_url(served):
    srv, text, png, ids, _ = served
    expected = native(srv, text, data_url(png))["text"]
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png)}},
                                         {"type": "text", "text": QUESTION}]}]
    for _ in range(2):
        r = client.chat.completions.create(model="default", messages=msgs, max_tokens=MAX_NEW,
                                           temperature=0)
        assert r.choices[0].message.content == expected
        assert r.usage.prompt_tokens == len(ids)
    assert r.usage.prompt_tokens_details.cached_tokens >= ids.index(2) + lt.TOKENS_PER_IMAGE
    with pytest.raises(openai.BadRequestError, match="not fetched"):
        client.chat.completions.create(model="default", max_tokens=2, messages=[{
            "role": "user", "content": [{"type": "image_url",
                                         "image_url": {"url": "https://example.com/a.png"}}]}])
    with pytest.raises(openai.BadRequestError, match="readable image"):
        client.chat.completions.create(model="default", max_tokens=2, messages=[{
            "role": "user", "content": [{"type": "image_url", "image_url": {
                "url": "data:image/png;base64," + base64.b64encode(b"junk").decode()}}]}])
    srv.wait_idle()
    srv.check_integrity()


def test_anthropic_sdk_base64_image(served):
    srv, text, png, ids, _ = served
    expected = native(srv, text, data_url(png))["text"]
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(png).decode()}},
               {"type": "text", "text": QUESTION}]
    for _ in range(2):
        r = client.messages.create(model="default", max_tokens=MAX_NEW,
                                   extra_body={"temperature": 0},  # SDK 2.x: only as an extra
                                   messages=[{"role": "user", "content": content}])
        assert r.content[0].text == expected
        assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(ids)
    assert r.usage.cache_read_input_tokens >= ids.index(2) + lt.TOKENS_PER_IMAGE
    count = client.messages.count_tokens(model="default",
                                         messages=[{"role": "user", "content": content}])
    assert count.input_tokens == len(ids)
    srv.wait_idle()
    srv.check_integrity()


def test_frontend_image_over_runtime_endpoint(served, tmp_path):
    """sgl.image(path) in a program on RuntimeEndpoint: the file goes as base64 image_data with
    the text holding the image token; the same as /generate on that text and image."""
    import radixlm as sgl

    srv, _, png, _, _ = served
    file = tmp_path / "img.png"
    file.write_bytes(png)

    @sgl.function
    def prog(s, path):
        s += "USER: " + sgl.image(path) + "\n" + QUESTION + "ASSISTANT:"
        s += sgl.gen("a", max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
        s += sgl.select("c", choices=[" cat", " dog"])

    backend = sgl.RuntimeEndpoint(srv.url)
    st = prog.run(str(file), backend=backend)
    head = "USER: <image>\n" + QUESTION + "ASSISTANT:"
    assert st["a"] == native(srv, head, data_url(png), ignore_eos=True)["text"]
    assert st["c"] in (" cat", " dog")
    srv.wait_idle()
    srv.check_integrity()

"""sgl.image() in frontend programs on the in-process Engine backend serving a tiny LLaVA: the
text holds the chat template's image token and the image goes with every call (gen, select, fork
commits); results equal Engine.generate on the same text and image. Backends that cannot take
images still raise a clear NotImplementedError."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL")
import llava_tiny as lt  # noqa: E402

import radixlm as sgl  # noqa: E402
from radixlm.lang.backend.engine import EngineBackend  # noqa: E402

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
QUESTION = "What is in the picture? ASSISTANT:"


@sgl.function
def describe(s, path):
    s += "USER: " + sgl.image(path) + "\n" + QUESTION
    s += sgl.gen("a", max_tokens=8, temperature=0, ignore_eos=True)


@sgl.function
def pick(s, path):
    s += "USER: " + sgl.image(path) + "\nIs it a cat or a dog? ASSISTANT:"
    forks = s.fork(2)
    for f, kind in zip(forks, ("cat", "dog")):
        f += " A " + kind + sgl.gen("g", max_tokens=4, temperature=0, ignore_eos=True)
    s += sgl.select("c", choices=["cat", "dog"])
    s["forks"] = [f["g"] for f in forks]


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    path = tmp_path_factory.mktemp("tinyvlm")  # no model family in the name: default template
    lt.make_checkpoint(str(path))
    img = path / "img.png"
    img.write_bytes(lt.png_bytes(lt.image(11)))
    eng = sgl.Engine(model_path=str(path), dtype="float32", context_length=256,
                     max_total_tokens=2048)
    be = EngineBackend(eng)
    yield be, eng, str(img)
    eng.wait_idle()
    eng.check_integrity()
    eng.shutdown()


def test_image_in_a_program_equals_engine_generate(backend):
    be, eng, img = backend
    st = describe.run(img, backend=be)
    text = "USER: <image>\n" + QUESTION
    ref = eng.generate(text, GREEDY, image_data=img)
    assert st["a"] == ref["text"]
    assert st.text() == text + ref["text"]
    again = eng.generate(text, GREEDY, image_data=img)  # the program's call left it cached
    assert again["meta_info"]["cached_tokens"] >= again["meta_info"]["prompt_tokens"] - 1
    eng.wait_idle()
    eng.check_integrity()


def test_image_with_fork_and_select(backend):
    be, eng, img = backend
    st = pick.run(img, backend=be)
    head = "USER: <image>\nIs it a cat or a dog? ASSISTANT:"
    for g, kind in zip(st["forks"], ("cat", "dog")):
        sp = {**GREEDY, "max_new_tokens": 4}
        assert g == eng.generate(head + " A " + kind, sp, image_data=img)["text"]
    assert st["c"] in ("cat", "dog")
    eng.wait_idle()
    eng.check_integrity()


def test_backends_without_images_raise():
    from radixlm.lang.backend.base import BaseBackend

    class TextOnly(BaseBackend):
        pass

    prog = sgl.function(lambda s: s.__iadd__("Look: " + sgl.image("x.png")))
    with pytest.raises(NotImplementedError, match="image.*TextOnly backend does not take images"):
        prog.run(backend=TextOnly())

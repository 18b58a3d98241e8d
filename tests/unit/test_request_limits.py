"""Hostile requests meet a bound (a flag of ServerArgs) before anything is queued, or a bounded
cost while they run: each test here fails without its limit. Server-free and model-free: the
RequestBuilder is the validation the Engine and the HTTP server share."""

from __future__ import annotations

import base64
import io
import time

import pytest

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.engine_io import RequestBuilder
from radixlm.runtime.request import FinishReason, Req
from radixlm.runtime.request_limits import SERVER_REQUEST_TOKENS, RequestLimits
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.output import StopStringState
from radixlm.server.cli_args import parse_server_args
from radixlm.server.generate_fields import expand_n, parse_generate_body


def _builder(**limits) -> RequestBuilder:
    return RequestBuilder(None, 100, 4096, 1 << 16, (0,),
                          limits=RequestLimits.from_args(ServerArgs(**limits)))


def _build(b: RequestBuilder, sp: dict, **kw):
    return b.build(None, kw.pop("input_ids", [1, 2, 3]), sp, kw.pop("return_logprob", False),
                   None, kw.pop("top_logprobs_num", None), None, kw)


def test_every_limit_is_a_flag_with_its_default():
    args = parse_server_args([])
    for name, default in vars(RequestLimits.from_args(args)).items():
        assert default == getattr(RequestLimits(), name), name
    assert parse_server_args(["--max-n", "4"]).max_n == 4


def test_request_tokens_bound_the_server_by_default_and_in_process_only_when_given():
    """Over HTTP a call is bounded at SERVER_REQUEST_TOKENS unless the flag says otherwise; an
    in-process Engine's offline batch is not (its caller owns the process), unless given."""
    args = parse_server_args([])
    assert RequestLimits.from_args(args).max_request_tokens == SERVER_REQUEST_TOKENS
    assert RequestLimits.from_args(args, in_process=True).max_request_tokens is None
    RequestLimits.from_args(args, in_process=True).check_request_tokens(SERVER_REQUEST_TOKENS * 4)
    with pytest.raises(ValueError, match="--max-request-tokens"):
        RequestLimits.from_args(args).check_request_tokens(SERVER_REQUEST_TOKENS + 1)
    given = parse_server_args(["--max-request-tokens", "100"])
    for in_process in (False, True):
        with pytest.raises(ValueError, match="over the limit of 100"):
            RequestLimits.from_args(given, in_process).check_request_tokens(101)
    assert args.grammar_compile_timeout == 30.0 and args.grammar_cache_size == 256


def test_n_over_the_flag_is_refused():
    b = _builder(max_n=4)
    assert len(_build(b, {"n": 4, "max_new_tokens": 1})[0]) == 4
    with pytest.raises(ValueError, match=r"sampling_params\.n.*--max-n"):
        _build(b, {"n": 5, "max_new_tokens": 1})
    body = parse_generate_body({"text": "x", "sampling_params": {"n": 5}})
    with pytest.raises(ValueError, match=r"sampling_params\.n"):
        expand_n(body, RequestLimits(max_n=4))


def test_stop_string_count_and_length():
    b = _builder(max_stop_strings=2, max_stop_str_len=8)
    with pytest.raises(ValueError, match=r"sampling_params\.stop: at most 2"):
        SamplingParams.from_dict({"stop": ["a", "b", "c"]}).verify(100, b.limits)
    with pytest.raises(ValueError, match=r"sampling_params\.stop: an entry is over 8 bytes"):
        SamplingParams.from_dict({"stop": ["x" * 9]}).verify(100, b.limits)
    with pytest.raises(ValueError, match=r"sampling_params\.stop_regex: at most 2"):
        SamplingParams.from_dict({"stop_regex": ["a", "b", "c"]}).verify(100, b.limits)
    with pytest.raises(ValueError, match=r"sampling_params\.stop_regex: an entry is over 256"):
        SamplingParams.from_dict({"stop_regex": ["a" * 257]}).verify(100, b.limits)


def test_logprob_counts():
    b = _builder(max_top_logprobs_num=5, max_token_ids_logprob=3)
    _build(b, {"max_new_tokens": 1}, return_logprob=True, top_logprobs_num=5)
    with pytest.raises(ValueError, match="top_logprobs_num: at most 5"):
        _build(b, {"max_new_tokens": 1}, return_logprob=True, top_logprobs_num=6)
    with pytest.raises(ValueError, match="token_ids_logprob: at most 3"):
        _build(b, {"max_new_tokens": 1}, return_logprob=True, token_ids_logprob=[1, 2, 3, 4])


def test_total_requested_tokens_count_prompt_new_tokens_and_n():
    b = _builder(max_request_tokens=100)
    _build(b, {"max_new_tokens": 22, "n": 4})  # (3 + 22) * 4 = 100
    with pytest.raises(ValueError, match="sampling_params.max_new_tokens: the call asks for 104"):
        _build(b, {"max_new_tokens": 23, "n": 4})
    with pytest.raises(ValueError, match="--max-request-tokens"):  # a batch sums its prompts
        b.build(None, [[1, 2, 3]] * 5, {"max_new_tokens": 20}, False, None, None, None, {})


class _Images:
    """The RequestBuilder's view of an image processor: counts and pixel checks happen before
    (or, for pixels, inside) process(); this one reads the image like the real one does."""
    image_token_id = 7

    def process(self, ids, images, max_pixels=None):
        from radixlm.runtime.multimodal import load_image

        for im in images:
            load_image(im, max_pixels)
        return ids, None


def _png(w: int, h: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_image_count_and_pixels():
    b = _builder(max_images_per_request=2, max_image_pixels=64 * 64)
    b.image_processor = _Images()
    with pytest.raises(ValueError, match="image_data: 3 images, at most 2"):
        b.expand_images([[1, 7, 7, 7]], ["a", "b", "c"], single=True)
    b.expand_images([[1, 7]], [_png(64, 64)], single=True)
    with pytest.raises(ValueError, match=r"image_data: a 65x64 image.*--max-image-pixels"):
        b.expand_images([[1, 7]], [_png(65, 64)], single=True)


class _CharTokenizer:
    def decode(self, ids, **kw):
        return "".join(chr(ord("a") + (i % 26)) for i in ids)


def test_a_backtracking_stop_regex_aborts_its_request_in_bounded_time():
    # (a|aa)+c against "aaa..." backtracks ~fib(n) times a search: with re, 40 characters
    # take minutes, and the search runs after every token
    sp = SamplingParams.from_dict({"stop_regex": r"(a|aa)+c", "max_new_tokens": 64})
    req = Req("r", [1, 2], sp, False, -1, 0, (99,))
    state = StopStringState(_CharTokenizer(), req, regex_timeout=0.05)
    t0 = time.perf_counter()
    finish = None
    for tok in [0] * 60:  # "a" * 60
        finish = state.feed(tok)
        if finish is not None:
            break
    assert time.perf_counter() - t0 < 5
    assert finish is not None and finish.reason == FinishReason.ABORT
    assert "stop_regex" in finish.message and "--stop-regex-timeout" in finish.message


def test_the_stop_regex_engine_keeps_re_semantics():
    sp = SamplingParams.from_dict({"stop_regex": [r"^ab", r"c\d?$"]})
    req = Req("r", [1], sp, False, -1, 0, (99,))
    state = StopStringState(_CharTokenizer(), req, regex_timeout=0.05)
    assert state.feed(1) is None  # "b": ^ab does not match mid-text
    fin = state.feed(2)  # "bc"
    assert fin is not None and fin.reason == FinishReason.STOP and fin.matched == r"c\d?$"

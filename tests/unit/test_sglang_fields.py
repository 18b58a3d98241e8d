"""SGLang's request fields, enumerated: every `SamplingParams` and `GenerateReqInput` field of
SGLang 0.5.x is either honoured or refused with a ValueError (-> 400) that names it and says why;
anything else is "unknown". Plus stop_regex matching and logit_bias in the sampler (pure logic)."""

from __future__ import annotations

import json

import pytest
import torch

from radixlm.runtime.constrained.grammar import validate_constraint
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.sampling.sampling_batch_info import SamplingBatchInfo
from radixlm.runtime.sampling_params import FIELDS as SP_FIELDS
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.output import StopStringState, check_finish, max_match_len
from radixlm.server import generate_fields as G

# python/sglang/srt/sampling/sampling_params.py, SamplingParams' API fields (sglang 0.5.23)
SGLANG_SAMPLING_FIELDS = [
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "beam_width", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval",
    "logit_bias", "sampling_seed", "custom_params", "watermark"]
# python/sglang/srt/managers/io_struct.py, GenerateReqInput (sglang 0.5.23, plus kv_router_hint
# from its main branch; fields main has since dropped stay here: older clients still send them)
SGLANG_GENERATE_FIELDS = [
    "rid", "session_id", "text", "input_ids", "input_embeds", "image_data", "video_data",
    "audio_data", "mm_hashes", "mm_content_hashes", "use_audio_in_video", "video_config",
    "sampling_params", "watermark", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "token_ids_logprob", "return_sampling_mask", "sampling_logprobs_mode",
    "return_text_in_logprobs", "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64", "stream",
    "log_metrics", "return_hidden_states", "return_routed_experts", "routed_experts_start_len",
    "return_indexer_topk", "modalities", "session_params", "lora_path", "lora_id",
    "custom_logit_processor", "positional_embed_overrides", "bootstrap_host", "bootstrap_port",
    "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank",
    "data_parallel_rank", "disagg_prefill_dp_rank", "routing_key", "conversation_id",
    "http_worker_ipc", "background", "require_reasoning", "max_thinking_tokens", "priority",
    "extra_key", "no_logs", "custom_labels", "return_bytes", "return_entropy",
    "return_prompt_token_ids", "external_trace_header", "received_time",
    "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls", "max_dynamic_patch",
    "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool", "cache_salt",
    "kv_hints", "kv_router_hint"]
# what SGLang's frontend (sglang.lang) sends for a plain gen(): every field, unset ones too
FRONTEND_SP = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
               "max_new_tokens": 16, "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [],
               "stop_regex": [], "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
               "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False,
               "regex": None, "json_schema": None}
V = 64


def verified(d: dict) -> SamplingParams:
    sp = SamplingParams.from_dict(d)
    sp.verify(V)
    return sp


# --- the field tables ------------------------------------------------------------------------
def test_every_sglang_sampling_field_is_known():
    assert set(SGLANG_SAMPLING_FIELDS) == set(SP_FIELDS)
    verified({k: None for k in SGLANG_SAMPLING_FIELDS})  # null means "default", for every field
    verified(FRONTEND_SP)


@pytest.mark.parametrize("field, value, why", [
    ("beam_width", 4, "beam search"), ("watermark", {"key": 1}, "watermark"),
    ("stop_regex", "(", "invalid pattern"), ("stop_regex", ["x"] * 33, "at most 32"),
    ("stop_regex", "a" * 300, "over 256 bytes"), ("stop_regex", [""], "non-empty"),
    ("stop_regex", 5, "pattern"), ("stop", ["s"] * 33, "at most 32"),
    ("logit_bias", {"64": 1.0}, "token ids"), ("logit_bias", {"x": 1.0}, "token ids"),
    ("logit_bias", {"1": "a"}, "finite number"), ("logit_bias", [1], "object"),
    ("stream_interval", 0, ">= 1"), ("custom_params", [1], "object"),
    ("sampling_seed", "7", "64-bit"), ("structural_tag", 5, "JSON"),
    ("temperature", float("inf"), "finite"), ("ignore_eos", "yes", "true or false"),
])
def test_sampling_field_refused_with_its_name(field, value, why):
    with pytest.raises(ValueError, match=f"{field}.*{why}|{why}.*{field}"):
        verified({field: value})


def test_sampling_aliases_and_normalization():
    assert verified({"sampling_seed": 5}).seed == 5 == verified({"seed": 5}).seed
    with pytest.raises(ValueError, match="disagree"):
        verified({"seed": 1, "sampling_seed": 2})
    sp = verified({"logit_bias": {"3": 2.5, 4: -1}, "stop_regex": r"\d", "beam_width": 1,
                   "custom_params": {"k": [1, 2]}, "max_new_tokens": None})
    assert sp.logit_bias == {3: 2.5, 4: -1.0} and sp.stop_regex_strs == [r"\d"]
    assert sp.max_new_tokens is None  # the request builder resolves it against the context
    with pytest.raises(ValueError, match="unknown field.*bogus"):
        SamplingParams.from_dict({"bogus": 1})


def test_every_sglang_generate_field_is_known():
    assert set(SGLANG_GENERATE_FIELDS) == set(G.FIELDS)
    for name, (policy, default, why) in G.FIELDS.items():
        assert policy in (G.HONOURED, G.IGNORED, G.DEFAULT_ONLY) and why


@pytest.mark.parametrize("name", [n for n, (p, _, _) in G.FIELDS.items() if p == G.DEFAULT_ONLY])
def test_unsupported_generate_field_is_400_naming_it(name):
    default = G.FIELDS[name][1]
    body = {"text": "hi", name: default}
    G.parse_generate_body(body)  # its default is accepted (SGLang clients send it)
    G.parse_generate_body({"text": "hi", name: None})
    other = {None: "x", False: True, 0: 3}.get(default, "x")
    with pytest.raises(ValueError, match=f"^{name}: not supported: "):
        G.parse_generate_body({"text": "hi", name: other})


def test_generate_body_forms():
    with pytest.raises(ValueError, match=r"unknown field\(s\): \['nope'\]"):
        G.parse_generate_body({"text": "hi", "nope": 1})
    for name in (n for n, (p, _, _) in G.FIELDS.items() if p == G.IGNORED):
        G.parse_generate_body({"text": "hi", name: "anything"})
    one = G.parse_generate_body({"text": "hi", "sampling_params": FRONTEND_SP, "stream": True,
                                 "return_logprob": True, "token_ids_logprob": [1, 2],
                                 "log_metrics": True, "lora_path": None,
                                 "return_hidden_states": False})
    assert one.stream and one.token_ids_logprob == [1, 2]
    batch = G.parse_generate_body({"text": ["a", "b"], "rid": ["r1", "r2"],
                                   "token_ids_logprob": [[1], [2]], "lora_path": [None, None],
                                   "sampling_params": [{"n": 2}, {"n": 2}]})
    assert [b.rid for b in batch] == ["r1", "r2"] and batch[1].token_ids_logprob == [2]
    expanded = G.expand_n(batch)
    assert [e.rid for e in expanded] == ["r1-0", "r1-1", "r2-0", "r2-1"]  # prompt-major
    assert all(e.sampling_params["n"] == 1 for e in expanded)
    with pytest.raises(ValueError, match="rid: 1 entries for a batch of 2"):
        G.parse_generate_body({"text": ["a", "b"], "rid": ["r1"]})
    with pytest.raises(ValueError, match="same for every prompt"):
        G.expand_n(G.parse_generate_body({"text": ["a", "b"],
                                          "sampling_params": [{"n": 2}, {"n": 3}]}))
    with pytest.raises(ValueError, match="not both"):
        G.parse_generate_body({"text": "a", "input_ids": [1]})
    with pytest.raises(ValueError, match="stream: must be true or false"):
        G.parse_generate_body({"text": "a", "stream": "yes"})


# --- stop_regex --------------------------------------------------------------------------------
class CharTok:
    """One token per character: token i is chr(i)."""

    def decode(self, ids, **kw):
        return "".join(chr(i) for i in ids)


def run_regex(text: str, **sp):
    req = Req("r", [1], verified({"max_new_tokens": 100, **sp}))
    for k, c in enumerate(text):
        req.output_ids.append(ord(c))
        fin = check_finish(req, ord(c), 1000, CharTok())
        if fin is not None:
            return text[: k + 1], fin
    return text, None


def test_stop_regex_stops_at_the_first_matching_token():
    out, fin = run_regex("abc 123 def", stop_regex=r"\d+")
    assert out == "abc 1" and fin.to_dict() == {"type": "stop", "matched": r"\d+"}
    assert fin.regex  # the output keeps the matched text (no trimming, as in SGLang)
    assert run_regex("xx ab ab", stop_regex=[r"q", r"ab ab"])[0] == "xx ab ab"
    assert run_regex("no digits", stop_regex=r"\d")[1] is None
    # a bounded pattern searches only the tail, yet anchors still see the real start
    assert run_regex("ab ab", stop_regex=r"^ab ")[0] == "ab "
    assert run_regex("xab ab", stop_regex=r"^ab")[1] is None
    assert run_regex("say yes", stop_regex=r"(?<=say )yes")[0] == "say yes"
    # a stop string and a regex together: whichever matches first
    out, fin = run_regex("hello world", stop=["wor"], stop_regex=r"l{2}")
    assert out == "hell" and fin.matched == "l{2}"


def test_stop_regex_survives_retraction_catch_up():
    req = Req("r", [1], verified({"max_new_tokens": 100, "stop_regex": r"a\d"}))
    for c in "xa":
        req.output_ids.append(ord(c))
        assert check_finish(req, ord(c), 1000, CharTok()) is None
    req.stop_str_checker = None  # what a retraction does: rebuilt from output_ids
    req.output_ids.append(ord("7"))
    assert check_finish(req, ord("7"), 1000, CharTok()).matched == r"a\d"


def test_max_match_len():
    assert max_match_len("abc") == 3 and max_match_len(r"[0-9]{3}") == 3
    assert max_match_len(r"\d+") is None and max_match_len(".*") is None
    assert StopStringState(CharTok(), Req("r", [1], verified({"stop_regex": "a|bcd"}))
                           ).regexes[0][2] == 3


# --- logit_bias in the sampler -----------------------------------------------------------------
def make_req(i, **sp):
    return Req(f"r{i}", [1, 2], verified(sp))


def test_logit_bias_forces_and_bans_tokens_in_a_mixed_batch():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    reqs = [make_req(0, temperature=0, logit_bias={"5": 100}),
            make_req(1, temperature=0),
            make_req(2, temperature=1.0, logit_bias={"9": 100}),
            make_req(3, temperature=0, logit_bias={str(int(logits[3].argmax())): -100})]
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    out = Sampler()(logits.clone(), info, reqs)
    ids = out.next_token_ids.tolist()
    assert ids[0] == 5 and ids[1] == int(logits[1].argmax()) and ids[2] == 9
    assert ids[3] != int(logits[3].argmax())


def test_logit_bias_rows_follow_filter_and_merge():
    a = [make_req(0, temperature=0, logit_bias={"3": 100}), make_req(1, temperature=0)]
    b = [make_req(2, temperature=0), make_req(3, temperature=0, logit_bias={"7": 100})]
    info = SamplingBatchInfo.from_reqs(a, V, "cpu")
    info.merge(SamplingBatchInfo.from_reqs(b, V, "cpu"))
    ref = SamplingBatchInfo.from_reqs(a + b, V, "cpu")
    assert torch.equal(info.logit_bias, ref.logit_bias)
    info.filter([1, 2])
    assert info.logit_bias is None  # no remaining row has a bias: the (B, V) tensor is dropped
    info.filter([0])
    zeros = torch.zeros(1, V)
    logits = zeros.clone()
    info.apply_penalties_and_masks(logits)
    assert torch.equal(logits, zeros)


# --- structural_tag ----------------------------------------------------------------------------
TAG = {"type": "structural_tag", "format": {
    "type": "tag", "begin": "<f>", "end": "</f>",
    "content": {"type": "json_schema", "json_schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}}
LEGACY_TAG = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
              "triggers": ["<f"]}


@pytest.mark.parametrize("tag", [TAG, LEGACY_TAG, json.dumps(TAG)])
def test_structural_tag_forms_are_accepted(tag):
    validate_constraint(verified({"structural_tag": tag}))


@pytest.mark.parametrize("tag", ['{"format": 3}', "[1]", "not json",
                                 {"structures": [{"begin": "a"}], "triggers": ["a"]},
                                 {"structures": [], "triggers": "a"}])
def test_bad_structural_tag_is_a_400_naming_it(tag):
    with pytest.raises(ValueError, match="structural_tag"):
        validate_constraint(verified({"structural_tag": tag}))


def test_structural_tag_excludes_other_constraints():
    with pytest.raises(ValueError, match="structural_tag"):
        verified({"structural_tag": TAG, "regex": "a+"})

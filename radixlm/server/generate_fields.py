"""The native /generate body: every field of SGLang's `GenerateReqInput`, and what we do with it.

SGLang's field list (python/sglang/srt/managers/io_struct.py, 0.5.x) is mirrored in `FIELDS`. Each
field is one of:
- HONOURED: implemented here;
- IGNORED: accepted with any value and without effect, for the reason given (hints meant for
  machinery this single-engine server does not have: HTTP worker routing, tracing, DP routing);
- DEFAULT_ONLY: accepted at its default value (SGLang's clients send fields at their defaults),
  otherwise a 400 that names the field and says why it is not supported.
Anything else is a 400 "unknown field(s)". A unit test walks SGLang's list against this table.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from radixlm.runtime.request_limits import DEFAULT_LIMITS, RequestLimits
from radixlm.server.io_struct import GenerateReqInput

HONOURED, IGNORED, DEFAULT_ONLY = "honoured", "ignored", "default_only"

_MM = "multimodal input other than images is not supported"
_PD = "only the PD router's bootstrap_host / bootstrap_port / bootstrap_room are used"
_DP = "this server runs one data-parallel rank"
FIELDS: dict[str, tuple[str, Any, str]] = {
    # name: (policy, default, why / what)
    "rid": (HONOURED, None, "request id (a list for a batch)"),
    "text": (HONOURED, None, "prompt text (a list for a batch)"),
    "input_ids": (HONOURED, None, "prompt token ids (a list of lists for a batch)"),
    "sampling_params": (HONOURED, None, "see radixlm/runtime/sampling_params.py FIELDS"),
    "return_logprob": (HONOURED, None, "meta_info input/output_token_logprobs"),
    "logprob_start_len": (HONOURED, None, "first prompt position whose logprob is returned"),
    "top_logprobs_num": (HONOURED, None, "input/output_top_logprobs"),
    "token_ids_logprob": (HONOURED, None, "input/output_token_ids_logprobs of these ids"),
    "return_text_in_logprobs": (HONOURED, False, "token text in each logprob entry"),
    "stream": (HONOURED, False, "SSE chunks; a batch streams chunks with an `index`"),
    "log_metrics": (HONOURED, True, "false: the request is left out of /metrics"),
    "no_logs": (HONOURED, False, "true: --log-requests skips this request"),
    "return_prompt_token_ids": (HONOURED, False, "the result carries prompt_token_ids"),
    "http_worker_ipc": (IGNORED, None, "internal routing between SGLang's HTTP workers"),
    "received_time": (IGNORED, None, "a timing hint of SGLang's router"),
    "external_trace_header": (IGNORED, None, "tracing is not implemented; the header is dropped"),
    "routing_key": (IGNORED, None, "a data-parallel routing hint; " + _DP),
    "conversation_id": (IGNORED, None, "a data-parallel routing hint; " + _DP),
    "kv_router_hint": (IGNORED, None, "a KV-routing hint for a hierarchical cache this server "
                                      "does not have"),
    "custom_labels": (IGNORED, None, "metrics carry no per-request labels here"),
    "routed_dp_rank": (DEFAULT_ONLY, 0, _DP),
    "data_parallel_rank": (DEFAULT_ONLY, 0, _DP),
    "disagg_prefill_dp_rank": (DEFAULT_ONLY, 0, _DP),
    "session_id": (DEFAULT_ONLY, None, "sessions are not supported"),
    "session_params": (DEFAULT_ONLY, None, "sessions are not supported"),
    "input_embeds": (DEFAULT_ONLY, None, "input embeddings are not supported; send text or ids"),
    "image_data": (HONOURED, None, "vision models: one image per image token (data: URL, path, "
                                   "base64; a list for several, per prompt in a batch)"),
    "video_data": (DEFAULT_ONLY, None, _MM),
    "audio_data": (DEFAULT_ONLY, None, _MM), "mm_hashes": (DEFAULT_ONLY, None, _MM),
    "mm_content_hashes": (DEFAULT_ONLY, None, _MM),
    "use_audio_in_video": (DEFAULT_ONLY, False, _MM), "video_config": (DEFAULT_ONLY, None, _MM),
    "modalities": (DEFAULT_ONLY, None, _MM), "max_dynamic_patch": (DEFAULT_ONLY, None, _MM),
    "min_dynamic_patch": (DEFAULT_ONLY, None, _MM),
    "image_max_dynamic_patch": (DEFAULT_ONLY, None, _MM),
    "video_max_dynamic_patch": (DEFAULT_ONLY, None, _MM),
    "images_config": (DEFAULT_ONLY, None, _MM), "mm_processor_kwargs": (DEFAULT_ONLY, None, _MM),
    "need_wait_for_mm_inputs": (DEFAULT_ONLY, None, _MM),
    "num_items_assigned": (DEFAULT_ONLY, None, _MM), "encoder_urls": (DEFAULT_ONLY, None, _MM),
    "positional_embed_overrides": (DEFAULT_ONLY, None, "embedding overrides are not supported"),
    "watermark": (DEFAULT_ONLY, None, "watermarking is not supported"),
    "return_sampling_mask": (DEFAULT_ONLY, False, "sampling masks are not returned"),
    "sampling_logprobs_mode": (DEFAULT_ONLY, None, "sampling masks are not returned"),
    "return_flat_raw_top_logprobs": (DEFAULT_ONLY, False,
                                     "top logprobs come nested (the flat form is not supported)"),
    "return_flat_raw_output_top_logprobs": (DEFAULT_ONLY, False,
                                            "top logprobs come nested (the flat form is not "
                                            "supported)"),
    "return_flat_raw_top_logprobs_b64": (DEFAULT_ONLY, False,
                                         "top logprobs come nested (the flat form is not "
                                         "supported)"),
    "return_hidden_states": (DEFAULT_ONLY, False, "hidden states are not returned by /generate; "
                                                  "use /encode or /v1/embeddings"),
    "return_routed_experts": (DEFAULT_ONLY, False, "the model has no experts"),
    "routed_experts_start_len": (DEFAULT_ONLY, 0, "the model has no experts"),
    "return_indexer_topk": (DEFAULT_ONLY, False, "the model has no sparse-attention indexer"),
    "lora_path": (DEFAULT_ONLY, None, "LoRA adapters are not supported yet"),
    "lora_id": (DEFAULT_ONLY, None, "LoRA adapters are not supported yet"),
    "custom_logit_processor": (DEFAULT_ONLY, None, "custom logit processors are not supported "
                                                   "(running client code is not allowed)"),
    "bootstrap_host": (HONOURED, None, "disaggregation: the prefill server's handshake host "
                                       "(set by the PD router; needs --disaggregation-mode)"),
    "bootstrap_port": (HONOURED, None, "disaggregation: its --disaggregation-bootstrap-port"),
    "bootstrap_room": (HONOURED, None, "disaggregation: the request's room, the same on the "
                                       "prefill and the decode server"),
    "bootstrap_pair_key": (DEFAULT_ONLY, None, _PD),
    "decode_tp_size": (DEFAULT_ONLY, None, _PD),
    "background": (DEFAULT_ONLY, False, "background requests are not supported"),
    "require_reasoning": (DEFAULT_ONLY, False, "reasoning control is not supported on /generate"),
    "max_thinking_tokens": (DEFAULT_ONLY, None, "reasoning budgets are not supported"),
    "priority": (DEFAULT_ONLY, None, "priority scheduling is not implemented"),
    "extra_key": (DEFAULT_ONLY, None, "cache namespaces are not implemented (the prefix cache "
                                      "is shared by all requests)"),
    "cache_salt": (DEFAULT_ONLY, None, "cache namespaces are not implemented (the prefix cache "
                                       "is shared by all requests)"),
    "kv_hints": (DEFAULT_ONLY, None, "KV hints are not supported"),
    "return_bytes": (DEFAULT_ONLY, False, "token bytes are not returned"),
    "return_entropy": (DEFAULT_ONLY, False, "entropy is not returned"),
    "multi_item_delimiter_indices": (DEFAULT_ONLY, None, "multi-item scoring is not supported"),
    "token_indices_to_pool": (DEFAULT_ONLY, None, "pooling applies to /encode only"),
}
# per-item fields of a batch (a list gives one value per prompt)
_PER_ITEM = ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num")
_KEEP = {f.name for f in dataclasses.fields(GenerateReqInput)}


def _is_default(value, default) -> bool:
    if value is None or value == default:
        return True
    if isinstance(value, list):  # batch form: one value per prompt
        return all(_is_default(v, default) for v in value)
    return False


def check_fields(body: dict, table: dict = FIELDS, where: str = "") -> dict:
    """The honoured fields of `body`, with nulls dropped; ValueError for unknown fields and for
    unsupported ones at a value other than their default."""
    unknown = sorted(set(body) - set(table))
    if unknown:
        raise ValueError(f"unknown field(s): {unknown}")
    kept = {}
    for name, value in body.items():
        policy, default, why = table[name]
        if policy == DEFAULT_ONLY and not _is_default(value, default):
            raise ValueError(f"{where}{name}: not supported: {why} (got {value!r})")
        if policy == HONOURED and value is not None:
            kept[name] = value
    return kept


def parse_generate_body(body: Any) -> list[GenerateReqInput] | GenerateReqInput:
    """A native /generate body -> one GenerateReqInput, or a list for a batch (ValueError if bad)."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    fields = check_fields(body)
    fields = {k: v for k, v in fields.items() if k in _KEEP}
    text, ids = fields.get("text"), fields.get("input_ids")
    if text is None and ids is None:
        raise ValueError("text or input_ids is required")
    if text is not None and ids is not None:
        raise ValueError("text and input_ids: give one of them, not both")
    if not isinstance(fields.get("sampling_params", {}), (dict, list)):
        raise ValueError("sampling_params must be an object (or a list of them for a batch)")
    for name in ("return_text_in_logprobs", "stream", "log_metrics", "no_logs",
                 "return_prompt_token_ids"):
        if not isinstance(fields.get(name, False), bool):
            raise ValueError(f"{name}: must be true or false")
    rid = fields.get("rid")  # a dict rid became a dict key (unhashable: a 500)
    if not (rid is None or isinstance(rid, str)
            or (isinstance(rid, list) and all(isinstance(r, str) for r in rid))):
        raise ValueError("rid: a string, or a list of strings for a batch")
    batch = isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list))
    tids = fields.get("token_ids_logprob")
    if not batch:
        if isinstance(fields.get("sampling_params"), list):
            raise ValueError("sampling_params: a list needs a batch of prompts")
        if isinstance(fields.get("rid"), list):  # fuzzing: a list rid became a dict key (500)
            raise ValueError("rid: a list needs a batch of prompts")
        return GenerateReqInput(**fields)
    if fields.get("bootstrap_room") is not None:
        raise ValueError("bootstrap_room: a disaggregated request has one prompt, not a batch")
    items = text if text is not None else ids
    if not items:
        raise ValueError("text/input_ids: the batch is empty")
    n = len(items)
    per_item = {k for k in _PER_ITEM if isinstance(fields.get(k), list)}
    if isinstance(tids, list) and tids and isinstance(tids[0], list):
        per_item.add("token_ids_logprob")
    if isinstance(fields.get("image_data"), list):  # one entry (image, list or null) per prompt
        per_item.add("image_data")
    out = []
    for i in range(n):
        one = {}
        for k, v in fields.items():
            if k in ("text", "input_ids") or k in per_item:
                if len(v) != n:
                    raise ValueError(f"{k}: {len(v)} entries for a batch of {n}")
                one[k] = v[i]
            else:
                one[k] = v
        out.append(GenerateReqInput(**one))
    return out


def expand_n(parsed, limits: RequestLimits = DEFAULT_LIMITS):
    """`sampling_params.n` > 1: n requests per prompt, prompt-major, as a batch (SGLang's shape)."""
    items = parsed if isinstance(parsed, list) else [parsed]
    ns = []
    for p in items:
        n = p.sampling_params.get("n", 1) if isinstance(p.sampling_params, dict) else 1
        n = 1 if n is None else n
        limits.check_n(n)
        ns.append(n)
    if len(set(ns)) > 1:
        raise ValueError("sampling_params.n: must be the same for every prompt of a batch")
    if all(n == 1 for n in ns):
        return parsed
    out = []
    for p, n in zip(items, ns):
        for k in range(n):
            sp = {**p.sampling_params, "n": 1}
            rid = f"{p.rid}-{k}" if p.rid else None
            out.append(dataclasses.replace(p, sampling_params=sp, rid=rid))
    return out

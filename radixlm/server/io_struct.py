"""Typed requests and messages of the server: HTTP-level inputs and the ZMQ messages between the
TokenizerManager (main process), the scheduler process and the detokenizer process.

Flow:  TokenizerManager --TokenizedGenerateReq/AbortReq/ControlReq--> scheduler
       scheduler --BatchTokenOut--> detokenizer --BatchTextOut--> TokenizerManager
       scheduler --ControlReply--> TokenizerManager
Messages are pickled dataclasses (small; the hot path sends one message per step, not per token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from radixlm.runtime.sampling_params import SamplingParams


@dataclass
class GenerateReqInput:
    """One native /generate request (SGLang's field names; the fields this server honours, see
    generate_fields.py for all of SGLang's). A batch is a list of these."""

    text: Optional[str] = None
    input_ids: Optional[list[int]] = None
    sampling_params: dict = field(default_factory=dict)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[list[int]] = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: Optional[str] = None
    log_metrics: bool = True
    no_logs: bool = False
    return_prompt_token_ids: bool = False
    # vision models: the prompt's images (one per image token): data: URLs, paths, base64
    image_data: Optional[Any] = None
    # disaggregation (the PD router sets them): the prefill server's handshake address and
    # the request's room number, the same on both servers
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None
    # internal (not an HTTP field): "last" | "mean" makes this an embedding request
    embed_pooling: Optional[str] = None


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    stream: bool
    token_ids_logprob: Optional[list[int]] = None
    embed_pooling: Optional[str] = None
    mm: Any = None  # runtime.multimodal.MultimodalInputs: the preprocessed images
    # disaggregation: (bootstrap_host, bootstrap_port, bootstrap_room) from the PD router
    bootstrap: Optional[tuple] = None


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    """flush_cache | get_stats | check_integrity | start_profile | stop_profile |
    update_weights_from_disk | shutdown; answered by a ControlReply with the same id."""

    kind: str
    req_id: int
    payload: Any = None


@dataclass
class ControlReply:
    req_id: int
    result: Any = None
    error: Optional[str] = None
    bad_request: bool = False  # the error is the caller's (a ValueError): answered 400


@dataclass
class ReqUpdate:
    """What one request produced since its last update."""

    rid: str
    new_ids: list[int]  # output tokens since the last update
    n_output: int  # total output tokens so far
    finish: Optional[dict]  # SGLang finish_reason dict when finished, else None
    prompt_tokens: int
    cached_tokens: int
    # detokenization settings (the detokenizer keeps per-rid state, created on first sight)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop_strs: tuple = ()
    no_stop_trim: bool = False
    # logprob deltas (only when requested): lists aligned with new_ids / the prompt
    output_token_logprobs: Optional[list] = None  # [(logprob, token_id)]
    output_top_logprobs: Optional[list] = None  # [[(logprob, token_id), ...]]
    input_token_logprobs: Optional[list] = None  # full list, sent once with the first update
    input_top_logprobs: Optional[list] = None
    output_token_ids_logprobs: Optional[list] = None  # [[(logprob, id) per asked id]]
    input_token_ids_logprobs: Optional[list] = None  # full list, with input_token_logprobs
    embedding: Optional[list] = None  # embedding requests: the pooled, normalized vector
    retractions: int = 0
    # hierarchical cache: {"device": n, "host": n, "storage": n} (meta_info.cached_tokens_details)
    cached_tokens_details: Optional[dict] = None
    spec_verify_steps: Optional[int] = None  # speculative decoding (None: off), see engine_io
    spec_verify_tokens: int = 0
    # jump-forward re-tokenized earlier output: ids (and logprobs) from this index on are replaced
    # by new_ids (the text they decode to is unchanged, so streamed text stays valid)
    rollback_to: Optional[int] = None


@dataclass
class BatchTokenOut:
    updates: list[ReqUpdate]


@dataclass
class TextUpdate:
    rid: str
    text_delta: str  # never ends in half a UTF-8 character or inside a possible stop string
    update: ReqUpdate
    failed: bool = False  # the detokenizer failed this request: abort it in the scheduler


@dataclass
class BatchTextOut:
    updates: list[TextUpdate]


SchedulerInput = Union[TokenizedGenerateReq, AbortReq, ControlReq]

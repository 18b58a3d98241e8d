"""Bounds on what one request may ask for, so a hostile request costs a 400, not a stuck server.

Each bound is a server flag (ServerArgs field of the same name; docs/server.md lists them).
They are checked in the caller's thread (the HTTP handler or `Engine.generate`), before anything
is queued, with a ValueError that names the field. The bounds that apply while a request runs
(the stop_regex search time, the grammar compile time) are enforced by the scheduler: see
scheduler/output.py and the scheduler's grammar wait.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

# --max-request-tokens' bound over HTTP when the flag is not given. An in-process Engine has
# none by default: its caller owns the process, and an offline batch of a million tokens or more
# (SGLang's and vLLM's offline engines take one) is work it asked for, not a hostile request.
SERVER_REQUEST_TOKENS = 1 << 20


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 128  # sampling_params.n: samples per prompt (each a full request)
    max_stop_strings: int = 32  # entries of sampling_params.stop, and of stop_regex
    max_stop_str_len: int = 1024  # bytes of one stop string
    max_stop_regex_len: int = 256  # bytes of one stop_regex pattern
    # seconds one stop_regex search may take (wall clock: at 0.05 a busy 2-core machine aborted
    # a plain search when the scheduler thread lost the CPU mid-search); over: abort
    stop_regex_timeout: float = 0.5
    max_top_logprobs_num: int = 64  # top_logprobs_num (OpenAI's routes: 20 by their spec)
    max_token_ids_logprob: int = 1024  # entries of token_ids_logprob
    # prompt tokens + max_new_tokens, summed over a call's prompts and their n samples (None:
    # no bound; ServerArgs' None means SERVER_REQUEST_TOKENS over HTTP and no bound in-process)
    max_request_tokens: Optional[int] = SERVER_REQUEST_TOKENS
    max_images_per_request: int = 16  # images of one call (all its prompts)
    max_image_pixels: int = 4096 * 4096  # width x height of one image, read from its header

    @staticmethod
    def from_args(args, in_process: bool = False) -> "RequestLimits":
        """The limits of a ServerArgs (any object with these attributes; missing: default). A
        max_request_tokens of None is SERVER_REQUEST_TOKENS for the server's callers and no
        bound for `in_process` ones (Engine.generate)."""
        d = RequestLimits()
        kw = {f.name: getattr(args, f.name, getattr(d, f.name)) for f in fields(RequestLimits)}
        if kw["max_request_tokens"] is None and not in_process:
            kw["max_request_tokens"] = SERVER_REQUEST_TOKENS
        return RequestLimits(**kw)

    # --- checks (ValueError naming the field) ---------------------------------------------------
    def check_n(self, n) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.max_n:
            raise ValueError(f"sampling_params.n: must be an integer in [1, {self.max_n}] "
                             f"(got {n!r}; see --max-n)")

    def check_stops(self, stop_strs: list, stop_regex_strs: list) -> None:
        """Counts and lengths (the types are checked by SamplingParams.verify)."""
        for name, items, longest in (("stop", stop_strs, self.max_stop_str_len),
                                     ("stop_regex", stop_regex_strs, self.max_stop_regex_len)):
            if not isinstance(items, list):
                continue
            if len(items) > self.max_stop_strings:
                raise ValueError(f"sampling_params.{name}: at most {self.max_stop_strings} "
                                 f"entries (got {len(items)}; see --max-stop-strings)")
            for s in items:
                if isinstance(s, str) and len(s.encode("utf-8")) > longest:
                    flag = "--max-stop-str-len" if name == "stop" else "--max-stop-regex-len"
                    raise ValueError(f"sampling_params.{name}: an entry is over {longest} bytes "
                                     f"(see {flag})")

    def check_logprobs(self, top_logprobs_num, token_ids_logprob) -> None:
        if isinstance(top_logprobs_num, int) and top_logprobs_num > self.max_top_logprobs_num:
            raise ValueError(f"top_logprobs_num: at most {self.max_top_logprobs_num} (got "
                             f"{top_logprobs_num}; see --max-top-logprobs-num)")
        if isinstance(token_ids_logprob, list) and len(token_ids_logprob) > self.max_token_ids_logprob:
            raise ValueError(f"token_ids_logprob: at most {self.max_token_ids_logprob} ids (got "
                             f"{len(token_ids_logprob)}; see --max-token-ids-logprob)")

    def check_request_tokens(self, total: int, field: str = "sampling_params.max_new_tokens"
                             ) -> None:
        if self.max_request_tokens is not None and total > self.max_request_tokens:
            raise ValueError(f"{field}: the call asks for {total} tokens (prompt + "
                             f"max_new_tokens, times n, over all its prompts), over the limit of "
                             f"{self.max_request_tokens} (see --max-request-tokens)")

    def check_image_count(self, count: int) -> None:
        if count > self.max_images_per_request:
            raise ValueError(f"image_data: {count} images, at most {self.max_images_per_request} "
                             f"per request (see --max-images-per-request)")

    def check_image_size(self, width: int, height: int) -> None:
        if width * height > self.max_image_pixels:
            raise ValueError(f"image_data: a {width}x{height} image has more than "
                             f"{self.max_image_pixels} pixels (see --max-image-pixels)")


DEFAULT_LIMITS = RequestLimits()

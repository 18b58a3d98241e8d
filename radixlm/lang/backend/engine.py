"""The frontend on an in-process radixlm.Engine: RuntimeEndpoint's logic, no HTTP in between."""

from __future__ import annotations

from typing import Iterator, Optional

from radixlm.lang.backend.runtime_endpoint import RuntimeEndpoint
from radixlm.lang.chat_template import chat_template_for_model, get_chat_template

_BODY_KEYS = ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
              "image_data")


class EngineBackend(RuntimeEndpoint):
    def __init__(self, engine=None, chat_template: Optional[str] = None, **engine_kwargs):
        if engine is None:
            from radixlm.runtime.engine import Engine

            engine = Engine(**engine_kwargs)
        self.engine = engine
        runner = engine.runner
        self.model_info = {"model_path": runner.model_path, "served_model_name": runner.model_path,
                           "eos_token_ids": list(engine.builder.eos_token_ids)}
        self.chat_template = (get_chat_template(chat_template) if chat_template
                              else chat_template_for_model(runner.model_path))

    def _kwargs(self, body: dict) -> dict:
        kw = {k: body[k] for k in _BODY_KEYS if k in body}
        if "text" in body:
            kw["prompt"] = body["text"]
        else:
            kw["input_ids"] = body["input_ids"]
        return kw

    def _generate_call(self, body: dict):
        return self.engine.generate(**self._kwargs(body))

    def _generate_stream_call(self, body: dict) -> Iterator[dict]:
        return self.engine.generate(stream=True, **self._kwargs(body))

    def image_payload(self, image):
        """In process: the path, bytes or PIL image goes to the Engine as it is."""
        return image

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def get_server_info(self) -> dict:
        return {"internal_states": [self.engine.get_stats()]}

    def shutdown(self) -> None:
        self.engine.shutdown()

"""Images in chat messages (OpenAI `image_url` parts, Anthropic base64 `image` blocks) for
vision-language models: the content part models, and the chat template rendering that puts the
model's image token where each image part is.

A message with images reaches the renderer as a template dict whose `_parts` key lists its content
in order: {"type": "text", "text": ...} or {"type": "image", "image": <data URL | path>}. The
image token goes where the part is: a template that takes content parts (LLaVA's own: it renders
{"type": "image"} parts as its image token) is given them, as transformers' processors do; any
other template (or one whose output does not hold one image token per image) gets string content
with the image token inline, parts joined by newlines (`<image>\nWhat is this?`).
"""

from __future__ import annotations

from typing import Callable, Literal, Optional

from pydantic import BaseModel, field_validator

from radixlm.server import tool_calls as T
from radixlm.server.errors import APIError


def check_local_url(url: str) -> str:
    """Image URLs this server reads: data: URLs, file:// URLs and local paths (no network)."""
    if url.startswith(("http://", "https://")):
        raise ValueError("http(s) image URLs are not fetched (this server has no network "
                         "access); send a data: URL (base64) or a local file path")
    return url


class ImageURL(BaseModel):
    url: str
    detail: Optional[str] = None  # accepted; LLaVA has one resolution

    @field_validator("url")
    @classmethod
    def _local(cls, v: str) -> str:
        return check_local_url(v)


class ImageURLPart(BaseModel):
    """OpenAI's `{"type": "image_url", "image_url": {"url": ...}}` content part."""

    type: Literal["image_url"]
    image_url: ImageURL


class Base64Source(BaseModel):
    type: Literal["base64"]
    media_type: str
    data: str


class ImageBlock(BaseModel):
    """Anthropic's `{"type": "image", "source": {"type": "base64", ...}}` block (URL sources
    would need the network: refused)."""

    type: Literal["image"]
    source: Base64Source

    def data_url(self) -> str:
        return f"data:{self.source.media_type};base64,{self.source.data}"


def render(tm, messages: list[dict], render_fn: Callable[[list[dict]], str]
           ) -> tuple[str, list[str]]:
    """The prompt text and its images in order. `render_fn(messages)` applies the template."""
    images = [p["image"] for m in messages for p in m.get("_parts") or ()
              if p["type"] == "image"]
    clean = [{k: v for k, v in m.items() if k != "_parts"} for m in messages]
    if not images:
        return render_fn(clean), []
    processor = getattr(getattr(tm, "builder", None), "image_processor", None)
    if processor is None:
        raise APIError(400, "messages: this model takes no images (it is text-only)", "messages")
    token = tm.tokenizer.convert_ids_to_tokens(processor.image_token_id)
    if "image" in str(T.model_template(tm) or ""):
        as_parts = [dict(c, content=_parts(m)) for c, m in zip(clean, messages)]
        try:
            text = render_fn(as_parts)
            if text.count(token) == len(images):
                return text, images
        except Exception:  # the template wants string content: inline below
            pass
    inline = [dict(c, content="\n".join(token if p["type"] == "image" else p["text"]
                                        for p in m["_parts"])) if m.get("_parts") else c
              for c, m in zip(clean, messages)]
    text = render_fn(inline)
    if text.count(token) != len(images):
        raise APIError(400, f"messages: the chat template kept {text.count(token)} of "
                       f"{len(images)} image(s)", "messages")
    return text, images


def _parts(m: dict) -> list[dict]:
    if m.get("_parts"):
        return [{"type": "image"} if p["type"] == "image" else {"type": "text", "text": p["text"]}
                for p in m["_parts"]]
    content = m.get("content")
    return [{"type": "text", "text": content}] if content else []


def prompt_len(tm, ids: list[int], images: list) -> int:
    """The prompt's length once each image token is expanded to the image's positions."""
    if not images:
        return len(ids)
    return len(ids) + len(images) * (tm.builder.image_processor.tokens_per_image - 1)

"""Image inputs of vision-language models (LLaVA): loading, preprocessing, prompt expansion.

This runs on the request-building side (Engine caller thread, server TokenizerManager), never in
the forward. Each image becomes pixel values (transformers' image processor of the checkpoint)
and a run of `length` prompt positions, one per feature row the model will put there. Those
positions carry a pseudo token id `vocab_size + hash(pixels) % 2**40` (SGLang's pad values, moved
out of the vocabulary): identical images give identical ids, so the radix cache reuses their KV;
different images give different ids. The model masks these ids before the embedding lookup and
writes the projected image features at their positions instead.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

PAD_ID_RANGE = 1 << 40  # pseudo ids lie in [vocab_size, vocab_size + 2**40)


@dataclass
class ImageItem:
    pixel_values: torch.Tensor  # (3, H, W) float32, as the image processor returns it
    pad_id: int  # the pseudo token id at this image's positions
    offset: int = 0  # first prompt position of the image's tokens
    length: int = 0  # number of its tokens (= feature rows)
    # (length, hidden) projected features while the prompt is being computed; dropped once the
    # image's positions are all in the KV cache (recomputed from the pixels after a retraction)
    features: Optional[torch.Tensor] = field(default=None, repr=False)

    def __getstate__(self):  # features never travel between processes
        return {**self.__dict__, "features": None}


@dataclass
class MultimodalInputs:
    """A request's images, in prompt order (their spans do not overlap)."""

    images: list[ImageItem]
    image_token_id: int  # the real id the pseudo ids stand for (prompt logprobs, reports)
    vocab_size: int

    def vocab_ids(self, ids: list[int]) -> list[int]:
        """`ids` with pseudo ids replaced by the image token id (what HF's input_ids hold)."""
        v, tok = self.vocab_size, self.image_token_id
        return [tok if t >= v else t for t in ids]


def load_image(data: Any, max_pixels: Optional[int] = None):
    """A PIL image from a PIL image, bytes, a file path, a file:// URL, a data: URL or a base64
    string. No network: http(s) URLs are refused."""
    from PIL import Image

    if isinstance(data, Image.Image):
        return data
    if isinstance(data, (bytes, bytearray)):
        raw = bytes(data)
    elif isinstance(data, str):
        if data.startswith(("http://", "https://")):
            raise ValueError("image_data: http(s) image URLs are not fetched (this server has no "
                             "network access); send a data: URL, base64 or a local file path")
        if data.startswith("data:"):
            head, _, payload = data.partition(",")
            if ";base64" not in head:
                raise ValueError("image_data: a data: URL must be base64-encoded")
            raw = _b64(payload)
        elif data.startswith("file://"):
            raw = _read(data[len("file://"):])
        elif os.path.isfile(data):
            raw = _read(data)
        else:
            raw = _b64(data)
    else:
        raise ValueError(f"image_data: expected an image, bytes or a string, got "
                         f"{type(data).__name__}")
    try:
        img = Image.open(io.BytesIO(raw))  # reads the header only
    except Exception as e:
        raise ValueError(f"image_data: not a readable image ({e})") from None
    if max_pixels is not None and img.width * img.height > max_pixels:  # before decoding it
        raise ValueError(f"image_data: a {img.width}x{img.height} image has more than "
                         f"{max_pixels} pixels (see --max-image-pixels)")
    try:
        img.load()
    except Exception as e:
        raise ValueError(f"image_data: not a readable image ({e})") from None
    return img


def _read(path: str) -> bytes:
    if not os.path.isfile(path):
        raise ValueError(f"image_data: no such image file {path!r}")
    with open(path, "rb") as f:
        return f.read()


def _b64(s: str) -> bytes:
    try:
        return base64.b64decode(s, validate=True)
    except Exception:
        raise ValueError("image_data: a string must be a data: URL, a local file path or base64 "
                         f"image bytes (got {s[:40]!r}{'...' if len(s) > 40 else ''})") from None


class ImageProcessor:
    """The checkpoint's transformers image processor plus the LLaVA prompt expansion: each image
    token of the prompt becomes `tokens_per_image` positions (what LlavaProcessor does to the
    text: (crop // patch)**2 + 1 CLS - 1 if the 'default' strategy drops the CLS row)."""

    def __init__(self, model_path: str, hf_config: dict, vocab_size: int):
        from transformers import AutoImageProcessor  # vision-language models only

        self.processor = AutoImageProcessor.from_pretrained(model_path)
        self.image_token_id = int(hf_config.get("image_token_index",
                                                hf_config.get("image_token_id", 32000)))
        vc = hf_config["vision_config"]
        patches = (vc["image_size"] // vc["patch_size"]) ** 2
        strategy = hf_config.get("vision_feature_select_strategy", "default")
        self.tokens_per_image = patches + (0 if strategy == "default" else 1)
        self.image_size = vc["image_size"]
        self.vocab_size = vocab_size

    def _pixels(self, image, max_pixels: Optional[int] = None) -> torch.Tensor:
        img = load_image(image, max_pixels)
        if img.mode != "RGB":
            img = img.convert("RGB")
        out = self.processor(images=[img], return_tensors="pt")["pixel_values"]
        if tuple(out.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(f"image_data: the image processor gives {tuple(out.shape[-2:])} "
                             f"pixels, the vision tower takes {self.image_size}x{self.image_size} "
                             "(processor and model configs disagree)")
        return out[0].float()  # (3, H, W)

    def process(self, ids: list[int], images: list, max_pixels: Optional[int] = None
                ) -> tuple[list[int], MultimodalInputs]:
        """Expand the prompt's image tokens: each run of image tokens (one token, or an already
        expanded run of tokens_per_image) is one image, in order. Returns (ids, inputs)."""
        tok, n = self.image_token_id, self.tokens_per_image
        runs, i = [], 0
        while i < len(ids):
            if ids[i] == tok:
                j = i
                while j < len(ids) and ids[j] == tok:
                    j += 1
                if j - i not in (1, n):
                    raise ValueError(f"image_data: a run of {j - i} image tokens; each image "
                                     f"takes one image token (or an expanded run of {n})")
                runs.append((i, j))
                i = j
            else:
                i += 1
        if len(runs) != len(images):
            raise ValueError(f"image_data: {len(images)} image(s) for {len(runs)} image "
                             f"token(s) in the prompt (token id {tok})")
        out, items, prev = [], [], 0
        for (a, b), image in zip(runs, images):
            pixels = self._pixels(image, max_pixels)
            digest = hashlib.sha256(pixels.numpy().tobytes()).digest()
            pad = self.vocab_size + int.from_bytes(digest[:8], "little") % PAD_ID_RANGE
            out.extend(ids[prev:a])
            items.append(ImageItem(pixels, pad, offset=len(out), length=n))
            out.extend([pad] * n)
            prev = b
        out.extend(ids[prev:])
        return out, MultimodalInputs(items, tok, self.vocab_size)


def image_processor_for(model_path: str, hf_config: dict, vocab_size: int
                        ) -> Optional[ImageProcessor]:
    """The ImageProcessor of a vision-language checkpoint (one with a vision_config), else None."""
    if "vision_config" not in hf_config:
        return None
    return ImageProcessor(model_path, hf_config, vocab_size)

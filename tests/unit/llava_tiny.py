"""A tiny random-weight LLaVA checkpoint written by transformers (fp32): CLIP tower (32x32 images,
8x8 patches -> 16 features after the CLS row is dropped), a 2-layer Llama, a byte-level BPE
tokenizer with an `<image>` special token, transformers' CLIPImageProcessor and a LlavaProcessor
(the reference's expansion of `<image>`), plus a LLaVA-style chat template."""

from __future__ import annotations

import io

import torch

TOKENS_PER_IMAGE = 16
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' or part['type'] == 'image_url' "
    "%}<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<image>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["USER: What is in the picture? ASSISTANT: A cat on a mat.",
              "Describe the image. Compare these two images, please."] * 20
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   extra_special_tokens={"image_token": "<image>"},
                                   chat_template=CHAT_TEMPLATE)


def make_checkpoint(path: str, seed: int = 0, **llava_kw):
    """Writes the checkpoint to `path`; returns the HF model (eval, fp32) and its processor.
    `llava_kw`: LlavaConfig fields (vision_feature_layer, vision_feature_select_strategy)."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tok = _tokenizer()
    image_id = tok.convert_tokens_to_ids("<image>")
    vocab = len(tok)
    vc = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32)
    tc = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     bos_token_id=0, eos_token_id=1)
    strategy = llava_kw.get("vision_feature_select_strategy", "default")
    n_tokens = TOKENS_PER_IMAGE + (strategy == "full")  # 'full' keeps the CLS row
    cfg = LlavaConfig(vision_config=vc, text_config=tc, image_token_index=image_id,
                      image_seq_length=n_tokens, **llava_kw)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():  # wider than the default init, so greedy choices are far from ties
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.8, 1.2)
            elif "norm" in name:
                p.normal_(0.0, 0.05)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    ip = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    proc = LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=8,
                          vision_feature_select_strategy=strategy,
                          num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    proc.save_pretrained(path)
    return model, proc


def image(seed: int, size=(40, 48)):
    """A synthetic RGB PIL image (random pixels; not square, so resize and crop both act)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(arr.numpy(), "RGB")


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def hf_greedy(model, proc, text: str, images: list, max_new: int) -> tuple[list[int], list[int]]:
    """HF's prompt ids (the processor's expansion) and greedy new tokens."""
    inputs = proc(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False,
                             min_new_tokens=0, eos_token_id=None, pad_token_id=0)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()


def hf_prompt_logprobs(model, proc, text: str, images: list) -> list[float]:
    """log p(token q+1 | ..q) for every prompt position q >= 0 (HF's full forward)."""
    inputs = proc(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    ids = inputs["input_ids"][0]
    return lp[:-1].gather(1, ids[1:, None])[:, 0].tolist()

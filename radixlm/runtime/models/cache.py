"""On-disk cache of what start-up derives from a GGUF file: HF config, tokenizer, dense weights.

Why: without it every process that starts (the Engine; the server's parent, scheduler and
detokenizer) parses the GGUF header (~100k metadata strings read field by field, ~2 s), lets
transformers rebuild the tokenizer from it (parsing the file again, ~5 s) and dequantizes Q4_1 in
numpy (~3 s). With it a warm start reads a small JSON, a `tokenizer.json` (into the light
tokenizer: no transformers import) and one mmap-able safetensors file.

Layout under `$RADIXLM_CACHE_DIR` (default `~/.cache/radixlm`):

    hashes/<sha256 of (realpath, size, mtime_ns)>.json   {"sha256": <content hash>, ...}
    gguf/<content sha256>-v<FORMAT_VERSION>/
        config.json                      the HF config dict
        tokenizer/                       save_pretrained output + MANIFEST.json (file sizes, and
                                         whether tokenizer_light.py may stand in for HF's class)
        weights-<dtype>.safetensors      HF-named tensors in the runtime dtype
    tokenizer-verdicts/<key>.json        whether the light tokenizer stands in for HF's on a
                                         model folder's tokenizer files (folder_tokenizer.py)

Keying: hashing the whole file (98 MB: ~0.1 s, more for big models) on every launch is wasted
work, so the content hash is computed once and memoized by (path, size, mtime). An edited file
changes size or mtime, is hashed again and gets its own entry; a copy with the same bytes reuses
the entry.

Integrity: each artifact is written under a temporary name in its final directory, fsynced, and
renamed into place, so readers see all of it or none of it. One that is present but damaged
(truncated, edited) fails its check on load -- JSON that does not parse, a safetensors file whose
size differs from what its header declares, a tokenizer file whose size differs from its
MANIFEST -- and is rebuilt from the GGUF, never used. A builder holds the entry's lock (flock),
so the server's processes starting together on a cold cache build each artifact once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from typing import Any, Callable, Iterator, Optional

from radixlm.runtime.models.safetensors_stream import (ST_DTYPES, StreamWriter, atomic_file,
                                                      map_safetensors)

logger = logging.getLogger(__name__)

# Bump when what is stored changes meaning (a new config key, another tokenizer save format):
# old entries are then simply not found.
FORMAT_VERSION = 1
_MANIFEST = "MANIFEST.json"


def cache_root() -> Optional[str]:
    """The cache directory, or None when caching is off (`RADIXLM_DISABLE_CACHE=1`)."""
    if os.environ.get("RADIXLM_DISABLE_CACHE", "") not in ("", "0"):
        return None
    root = os.environ.get("RADIXLM_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "radixlm")
    return os.path.abspath(root)


def _write_json(path: str, obj: Any) -> None:
    with atomic_file(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)


def _read_json(path: str) -> Optional[Any]:
    """The parsed file, or None when it is missing or does not parse (truncated, garbage)."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("cache file %s is unreadable (%s); rebuilding it", path, e)
        return None


@contextlib.contextmanager
def _locked(entry: str):
    """Exclusive lock on a cache entry while building into it (released if the process dies)."""
    os.makedirs(entry, exist_ok=True)
    with open(os.path.join(entry, ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --- keys ----------------------------------------------------------------------------------------
def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def content_hash(path: str, root: str) -> str:
    """sha256 of the file's bytes, memoized by (realpath, size, mtime_ns)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    ident = {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    memo_name = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]
    memo_path = os.path.join(root, "hashes", memo_name + ".json")
    memo = _read_json(memo_path)
    if isinstance(memo, dict) and all(memo.get(k) == v for k, v in ident.items()) \
            and isinstance(memo.get("sha256"), str) and len(memo["sha256"]) == 64:
        return memo["sha256"]
    digest = file_sha256(real)
    _write_json(memo_path, dict(ident, sha256=digest))
    return digest


class GGUFCache:
    """The cache entry of one GGUF file. `get_*` return the cached artifact, building it first
    (under the entry lock) when it is missing or damaged."""

    def __init__(self, gguf_path: str, root: Optional[str] = None):
        self.gguf_path = gguf_path
        self.root = root or cache_root()
        if self.root is None:
            raise ValueError("the radixlm cache is disabled (RADIXLM_DISABLE_CACHE)")
        self.sha256 = content_hash(gguf_path, self.root)
        self.entry = os.path.join(self.root, "gguf", f"{self.sha256}-v{FORMAT_VERSION}")

    def _get(self, load: Callable[[], Any], build: Callable[[], Any],
             save: Callable[[Any], None]) -> Any:
        """The cached artifact (`load()`), else `build()` it and `save` it for next time. When the
        cache cannot be written (disk full, read-only) the built object is still returned."""
        got = load()
        if got is not None:
            return got
        with _locked(self.entry):
            got = load()  # another process may have built it while we waited for the lock
            if got is not None:
                return got
            obj = build()
            try:
                save(obj)
            except OSError as e:
                logger.warning("could not write to the radixlm cache %s: %s", self.entry, e)
            return obj

    # --- config ----------------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        from radixlm.runtime.models.gguf_loader import gguf_to_hf_config

        path = os.path.join(self.entry, "config.json")

        def load():
            cfg = _read_json(path)
            return cfg if isinstance(cfg, dict) and "architectures" in cfg else None

        return self._get(load, lambda: gguf_to_hf_config(self.gguf_path),
                         lambda cfg: _write_json(path, cfg))

    # --- tokenizer -------------------------------------------------------------------------------
    @property
    def tokenizer_dir(self) -> str:
        return os.path.join(self.entry, "tokenizer")

    def _tokenizer_manifest(self) -> Optional[dict]:
        """The folder's MANIFEST when every file it lists has its recorded size, else None."""
        manifest = _read_json(os.path.join(self.tokenizer_dir, _MANIFEST))
        if not isinstance(manifest, dict) or not manifest.get("files"):
            return None
        for name, size in manifest["files"].items():
            try:
                if os.path.getsize(os.path.join(self.tokenizer_dir, name)) != size:
                    logger.warning("cache file %s/%s has the wrong size; rebuilding",
                                   self.tokenizer_dir, name)
                    return None
            except OSError:
                return None
        return manifest

    def get_tokenizer(self, light: bool = True):
        """The tokenizer that `AutoTokenizer.from_pretrained(dir, gguf_file=...)` builds, loaded
        from its saved `tokenizer.json` + config + chat template instead of from the GGUF.

        `light`: a LightTokenizer (no transformers import, ~1 s less start-up) when the MANIFEST
        records that it was checked against this HF tokenizer and agreed; else HF's class.
        Entries written before that check existed get it on their first HF load."""
        from radixlm.runtime.tokenizer_light import LightTokenizer, light_enabled, tokenizer_from_dir

        d = os.path.dirname(self.gguf_path)
        light = light and light_enabled()

        def load():
            manifest = self._tokenizer_manifest()
            if manifest is None:
                return None
            tok = None
            if light and manifest.get("light") is True:
                try:
                    tok = LightTokenizer.from_dir(self.tokenizer_dir)
                except Exception as e:  # noqa: BLE001 -- HF's loader below decides if it is damaged
                    logger.warning("light tokenizer %s: %s", self.tokenizer_dir, e)
            try:
                if tok is None:
                    tok = tokenizer_from_dir(self.tokenizer_dir)
                    if "light" not in manifest:
                        self._record_light_verdict(tok)
            except Exception as e:  # noqa: BLE001 -- tokenizers raises plain Exception on bad JSON
                # a file that is the right size but does not parse: rebuild it
                logger.warning("cached tokenizer %s does not load (%s); rebuilding it",
                               self.tokenizer_dir, e)
                return None
            tok.name_or_path = d  # what the uncached path reports
            return tok

        return self._get(load, lambda: tokenizer_from_gguf(self.gguf_path), self._save_tokenizer)

    def _record_light_verdict(self, hf_tok) -> None:
        """Check the light tokenizer against `hf_tok` (loaded from this folder) and record the
        verdict in the MANIFEST, for an entry written before the check existed."""
        from radixlm.runtime.tokenizer_light_check import check_dir

        path = os.path.join(self.tokenizer_dir, _MANIFEST)
        try:
            # Never wait for the lock: its holder may be this very process (load() also runs
            # under it in _get); the verdict is then recorded by a later start.
            with open(os.path.join(self.entry, ".lock"), "w") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return
                manifest = _read_json(path)
                if not isinstance(manifest, dict) or "light" in manifest:
                    return  # damaged (rebuilt elsewhere) or another process recorded it
                manifest["light"] = check_dir(self.tokenizer_dir, hf_tok)
                _write_json(path, manifest)
        except OSError as e:
            logger.warning("could not write to the radixlm cache %s: %s", self.entry, e)

    def _save_tokenizer(self, tok) -> None:
        from radixlm.runtime.tokenizer_light_check import check_dir

        # Saved into a temp folder, then renamed: a reader never sees a half-written folder.
        tmp = tempfile.mkdtemp(dir=self.entry, prefix=".tmp-tokenizer-")
        try:
            tok.save_pretrained(tmp)
            files = {f: os.path.getsize(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp))}
            for f in files:
                with open(os.path.join(tmp, f), "rb") as fh:
                    os.fsync(fh.fileno())
            _write_json(os.path.join(tmp, _MANIFEST),
                        {"files": files, "source": self.sha256, "light": check_dir(tmp, tok)})
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
            # A damaged folder may be there (we hold the lock, so nobody is building it).
            shutil.rmtree(self.tokenizer_dir, ignore_errors=True)
            os.rename(tmp, self.tokenizer_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    # --- weights ---------------------------------------------------------------------------------
    def weights_path(self, dtype_name: str) -> str:
        return os.path.join(self.entry, f"weights-{dtype_name}.safetensors")

    def iter_weights(self, dtype) -> Iterator[tuple[str, Any]]:
        """(HF name, tensor) pairs, as `gguf_loader.iter_gguf_weights` yields them. On a miss
        the tensors come from the GGUF and are written to the cache as they pass."""
        from radixlm.runtime.models.gguf_loader import iter_gguf_weights

        dtype_name = str(dtype).removeprefix("torch.")
        if dtype_name not in ST_DTYPES:  # not a runtime dtype: nothing to gain from caching
            yield from iter_gguf_weights(self.gguf_path, dtype)
            return
        path = self.weights_path(dtype_name)
        mapped = map_safetensors(path)
        if mapped is None:
            with _locked(self.entry):
                mapped = map_safetensors(path)
                if mapped is None:
                    # Stream into the file while the consumer copies: no second full copy of the
                    # weights in memory (an 8B model would need 16 GB more).
                    writer = StreamWriter.create(path, self.gguf_path, dtype, self.sha256, FORMAT_VERSION)
                    try:
                        for name, t in iter_gguf_weights(self.gguf_path, dtype):
                            if writer is not None:
                                writer = writer.write(name, t)
                            yield name, t
                        if writer is not None:
                            writer, w = None, writer
                            w.commit()
                    finally:  # the consumer stopped early (or failed): drop the partial file
                        if writer is not None:
                            writer.abort(RuntimeError("the load stopped before the last tensor"))
                    return
        yield from mapped


_GGUF_READER_SWAP = threading.Lock()


def tokenizer_from_gguf(gguf_path: str):
    """transformers' tokenizer of the file, with transformers reading the file's metadata through
    radixlm's cached reader (`gguf_loader.open_gguf`, over a plain ndarray view): the config and
    weights of a cold start parse the same header, and gguf's own reader parses it through
    np.memmap slicing, ~2.7 CPU-s for SmolLM2 against ~1 once. Every value transformers reads is
    the same; other files get a fresh reader of the same class."""
    import gguf
    from transformers import AutoTokenizer

    from radixlm.runtime.models import gguf_loader

    d, name = os.path.split(gguf_path)
    plain = gguf_loader.plain_reader_class()
    with _GGUF_READER_SWAP:
        own = gguf.GGUFReader

        def reader(path, *args, **kwargs):
            if not args and not kwargs and os.path.realpath(path) == os.path.realpath(gguf_path):
                return gguf_loader.open_gguf(gguf_path)
            return plain(path, *args, **kwargs)

        gguf.GGUFReader = reader
        try:
            return AutoTokenizer.from_pretrained(d, gguf_file=name)
        finally:
            gguf.GGUFReader = own


def try_cache(gguf_path: str) -> Optional[GGUFCache]:
    """The file's cache entry, or None when caching is off or the cache dir is unusable (e.g.
    read-only): then callers read the GGUF directly, as without a cache."""
    if cache_root() is None:
        return None
    try:
        return GGUFCache(gguf_path)
    except OSError as e:
        logger.warning("radixlm cache unavailable (%s); reading %s directly", e, gguf_path)
        return None

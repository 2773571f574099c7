"""Keys, MACs and authenticated encryption for chunks kept where others can write: the shared remote store and,
optionally, the SSD directory.

Why: an unkeyed checksum (xxh3) only catches accidents. Anyone who can write to the store can recompute it, so a
value's bytes, sizes and chain links must be authenticated under a secret the store never sees.

- A ``Sealer`` holds the keys of one *purpose* (``"remote"`` or ``"ssd"``), all derived from the replicas' shared
  secret (HMAC-SHA256 as the derivation function, one label per key), so a tag made for one purpose never
  verifies for another and the secret itself is used for nothing else.
- ``sign_header``: HMAC-SHA256 over the namespace root and the header bytes (key, parent, flags, token count,
  tokens digest, dtype, shape, per-layer tags...). The root is not stored in the value: the verifier supplies
  the root it expects, so a value made under another root fails.
- ``layer_tag``: a 16-byte AES-GMAC tag (AES-GCM over no plaintext, the layer's bytes as associated data) under
  a per-purpose MAC key, with the value's random 96-bit base nonce and the layer index folded into its last 32
  bits, so each layer can be verified when it is used (layer-wise loads) and the header MAC covers every payload
  byte through the tags it holds. The chunk key and the layer's place are bound through the nonce: the header MAC
  covers key and nonce, and a layer moved to another index or value is checked under another nonce. GMAC rather
  than HMAC-SHA256 because a layer tag runs over every payload byte: GHASH (carry-less multiply) is an order of
  magnitude cheaper per byte than SHA-256 (`benchmarks/seal_cost.py` measures both). Random nonces keep a key's
  GMAC nonces unique (a repeat would leak the hash key); 2^32 values per key keep the collision odds below 2^-32.
- With ``encrypt``: each layer is one AES-GCM message under a key derived per namespace root, nonce = the value's
  random 96-bit base nonce with the layer index folded into its last 32 bits, AAD = the header's core (everything
  the header says about the chunk) and the layer index; the GCM tag replaces the GMAC layer tag. AES-GCM comes
  from the ``cryptography`` package (extra ``crypto``, part of ``make install``), imported when a ``Sealer`` is
  made: a secret-bearing engine without it refuses to start, saying what to install.

Failures raise ``ForgedChunkError`` (a ``CorruptChunkError``: the caller drops the copy and recomputes).
"""

from __future__ import annotations

import hmac
import os
import threading
from collections import OrderedDict
from typing import Any

from pcr_rag.cache.errors import CorruptChunkError

__all__ = [
    "LAYER_TAG_BYTES",
    "MAC_BYTES",
    "NONCE_BYTES",
    "SECRET_MIN_CHARS",
    "ForgedChunkError",
    "Sealer",
    "check_secret",
    "layer_nonce",
    "run_secret",
]

SECRET_MIN_CHARS = 16
MAC_BYTES = 32
LAYER_TAG_BYTES = 16
NONCE_BYTES = 12
_LABEL = b"pcr-rag/seal/v1/"
_ROOT_KEYS = 256  # per-root AES keys kept (derivation is cheap; the cache only saves it per chunk)


class ForgedChunkError(CorruptChunkError):
    """A chunk's MAC (or AES-GCM tag) failed, or its authenticated header contradicts what the reader knows
    (root, chunk plan, KV layout): someone without the secret wrote it, or it belongs elsewhere. Recompute it."""


def check_secret(secret: object, what: str = "secret") -> str:
    """``secret`` when it is a str of at least ``SECRET_MIN_CHARS`` characters; ``ValueError`` saying so otherwise."""
    if not isinstance(secret, str):
        raise ValueError(f"{what} must be a str, got {type(secret).__name__}")
    if len(secret) < SECRET_MIN_CHARS:
        raise ValueError(f"{what} must be at least {SECRET_MIN_CHARS} characters (got {len(secret)}); use a random "
                         f"string, e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return secret


def _derive(key: bytes, label: bytes) -> bytes:
    return hmac.digest(key, _LABEL + label, "sha256")


def layer_nonce(base: bytes, layer: int) -> bytes:
    """The AES-GCM nonce of layer ``layer``: ``base`` with the layer index XORed into its last 32 bits."""
    tail = int.from_bytes(base[8:], "little") ^ layer
    return base[:8] + tail.to_bytes(4, "little")


class Sealer:
    """The keys of one purpose derived from a secret (see the module docstring). Thread-safe."""

    def __init__(self, secret: str, purpose: str, *, encrypt: bool = False) -> None:
        check_secret(secret)
        self.purpose = purpose
        self.encrypt = encrypt
        base = _derive(secret.encode("utf-8"), purpose.encode("ascii"))
        self._header_key = _derive(base, b"header-mac")
        self._aead_base = _derive(base, b"aead")
        self._aeads: OrderedDict[bytes, Any] = OrderedDict()  # per-root AES-GCM keys, least recently used first
        self._lock = threading.Lock()
        self._gmac_key = _derive(base, b"layer-gmac")
        self._gmac = _aesgcm()(self._gmac_key)  # fails now, not at the first write, without the package

    def __repr__(self) -> str:
        return f"Sealer(purpose={self.purpose!r}, encrypt={self.encrypt})"

    # ------------------------------------------------------------------ MACs
    def sign_header(self, root: bytes, signed: bytes) -> bytes:
        """The MAC of a header's ``signed`` bytes under namespace root ``root``."""
        return hmac.digest(self._header_key, len(root).to_bytes(1, "little") + root + signed, "sha256")

    def check_header(self, root: bytes, signed: bytes, mac: bytes, key: bytes) -> None:
        if not hmac.compare_digest(self.sign_header(root, signed), mac):
            raise ForgedChunkError(f"chunk {key.hex()}: header MAC mismatch (forged, or written under another "
                                   f"secret or namespace root)")

    def layer_tag(self, nonce: bytes, layer: int, data: memoryview) -> bytes:
        """The GMAC tag of layer ``layer``'s bytes under the value's base ``nonce``."""
        return self._gmac.encrypt(layer_nonce(nonce, layer), b"", data)

    # ------------------------------------------------------------------ AES-GCM
    def _aead(self, root: bytes) -> Any:
        with self._lock:
            aead = self._aeads.get(root)
            if aead is not None:
                self._aeads.move_to_end(root)
                return aead
        aead = _aesgcm()(_derive(self._aead_base, b"root:" + root))
        with self._lock:
            self._aeads[root] = aead
            while len(self._aeads) > _ROOT_KEYS:
                self._aeads.popitem(last=False)
        return aead

    @staticmethod
    def new_nonce() -> bytes:
        return os.urandom(NONCE_BYTES)

    def seal_layer(self, root: bytes, nonce: bytes, layer: int, aad: bytes, data: memoryview) -> tuple[bytes, bytes]:
        """(ciphertext, GCM tag) of one layer."""
        out = self._aead(root).encrypt(layer_nonce(nonce, layer), data, aad + layer.to_bytes(4, "little"))
        return out[:-LAYER_TAG_BYTES], out[-LAYER_TAG_BYTES:]

    def open_layer(self, root: bytes, nonce: bytes, layer: int, aad: bytes, stored: memoryview, tag: bytes,
                   key: bytes) -> bytes:
        """The plaintext of an encrypted layer; ``ForgedChunkError`` when its tag fails."""
        try:
            from cryptography.exceptions import InvalidTag
        except ImportError:  # a replica without the "crypto" extra: a miss for it, never a crash
            raise CorruptChunkError(f"chunk {key.hex()} is encrypted and the 'cryptography' package is missing: "
                                    f"pip install 'pcr-rag[crypto]'") from None
        try:
            return self._aead(root).decrypt(layer_nonce(nonce, layer), bytes(stored) + tag,
                                            aad + layer.to_bytes(4, "little"))
        except InvalidTag:
            raise ForgedChunkError(f"chunk {key.hex()} layer {layer}: AES-GCM tag mismatch (forged or "
                                   f"tampered ciphertext)") from None


    def layer_check(self, root: bytes, nonce: bytes, layer: int, aad: bytes, tag: bytes, key: bytes, *,
                    encrypted: bool) -> LayerCheck:
        """An incremental check of one layer's stored bytes: what `layer_tag` (GMAC) or `open_layer` (AES-GCM,
        the plaintext discarded) verify, fed slice by slice (`LayerCheck.update`, then `LayerCheck.finish`), so a
        layer of any size is checked in bounded memory (``pcr-rag cache verify``)."""
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        if encrypted:
            secret = _derive(self._aead_base, b"root:" + root)
            ctx = Cipher(algorithms.AES(secret), modes.GCM(layer_nonce(nonce, layer), tag)).decryptor()
            ctx.authenticate_additional_data(aad + layer.to_bytes(4, "little"))
        else:
            ctx = Cipher(algorithms.AES(self._gmac_key), modes.GCM(layer_nonce(nonce, layer))).encryptor()
        return LayerCheck(ctx, None if encrypted else tag, f"chunk {key.hex()} layer {layer}")


class LayerCheck:
    """One layer's tag check under way (see `Sealer.layer_check`): GMAC when ``tag`` is given (the bytes are
    associated data), else AES-GCM decryption whose tag the context holds."""

    def __init__(self, ctx: Any, tag: bytes | None, what: str) -> None:
        self._ctx = ctx
        self._tag = tag
        self._what = what

    def update(self, data: memoryview) -> None:
        if self._tag is not None:
            self._ctx.authenticate_additional_data(data)
        else:
            self._ctx.update(data)

    def finish(self) -> None:
        """Raise ``ForgedChunkError`` when the bytes fed do not carry the layer's tag."""
        from cryptography.exceptions import InvalidTag

        try:
            self._ctx.finalize()
        except InvalidTag:
            raise ForgedChunkError(f"{self._what}: AES-GCM tag mismatch (forged or tampered ciphertext)") from None
        if self._tag is not None and not hmac.compare_digest(self._ctx.tag, self._tag):
            raise ForgedChunkError(f"{self._what}: MAC mismatch (forged or tampered)")


def _aesgcm() -> Any:
    """The ``AESGCM`` class of the ``cryptography`` package (optional extra ``crypto``)."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as exc:
        raise RuntimeError("a remote or SSD secret needs the 'cryptography' package (AES-GMAC/GCM): "
                           "pip install 'pcr-rag[crypto]'") from exc
    return AESGCM


_RUN_SECRET: list[str] = []


def run_secret() -> str:
    """``$PCR_RAG_REMOTE_SECRET`` when set, else a random secret made once per process: for benches whose replicas
    all run in this process and share a store they started themselves."""
    env = os.environ.get("PCR_RAG_REMOTE_SECRET")
    if env:
        return env
    if not _RUN_SECRET:
        import secrets

        _RUN_SECRET.append(secrets.token_urlsafe(32))
    return _RUN_SECRET[0]

"""What a persistent cache's namespace roots stand for: identities, manifests and the chunks under each root.

A chunk key chains from a namespace root (`keys.namespace_key`) that hashes everything fixing the KV's bits: the
model fingerprint, the KV dtype, the chunk size and a salt holding the forward's plan id, the kernel identity (a
hash of the KV the engine's own forward computes on fixed probe inputs, `pcr_rag.model.kernel_probe`: it tells
apart CPU ISAs, oneDNN/torch versions, GPU models and CUDA libraries that round differently) and the tenant
namespace. A host on another kernel path therefore never finds this host's chunks, on SSD or in a shared store.
A root is a hash, so nothing can tell from a chunk file which model or plan wrote it. Two things make a cache
directory legible (``pcr-rag cache info``) and prunable:

- **Attribution.** A root-level chunk stores its root key as its parent (``parent_is_root``), every other chunk the
  key of the chunk before it. `attribute` follows the parent links of a set of chunks to the root each one hangs
  from (None for an orphan: a chunk whose chain is broken).
- **Manifests.** The engine writes one small JSON blob per root, ``roots/<root hex>.json`` (`manifest_name`),
  through the SSD tier's storage backend (a private directory: ``0600``, ``O_NOFOLLOW``, atomic), when it first
  stores a chunk under that root (`SsdTier.note_root`). It names the root's `RootIdentity` (model name and
  fingerprint, KV dtype, chunk size, plan id, weight format, kernel identity) and an 8-byte hash of the namespace salt - never the
  tenant's name in clear (the root key itself hashes the same salt, so the hash reveals nothing the file name does
  not). A root without a manifest (a cache written before manifests existed) is of unknown origin.
- **The shared store.** An engine with a remote tier also stores each root's manifest there, one small sealed value
  per root (``remote_value.manifest_value_name``), written with the root's first chunk; at start it reads the
  manifests the store holds (bounded) and counts the roots of another identity (`RootCensus`, logged by
  `foreign_roots_note`). A chunk value does not name its root, so the store is counted in roots, not chunks.

Invariant: two roots hold interchangeable KV for equal tokens exactly when their identities are `compatible`
(fingerprint, dtype, chunk size, plan and kernel identity equal); the namespace then decides whether the keys meet.
A manifest written before kernel identities existed has none, so its chunks count as another identity's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pcr_rag.cache.keys import KEY_BYTES, blend_root, namespace_key

__all__ = [
    "MANIFEST_DIR",
    "ManifestError",
    "RootCensus",
    "RootIdentity",
    "RootManifest",
    "RootUsage",
    "attribute",
    "foreign_chunks_note",
    "foreign_roots_note",
    "host_description",
    "manifest_name",
    "namespace_hash",
    "root_of_manifest_name",
    "usage_by_root",
]

log = logging.getLogger(__name__)

MANIFEST_DIR = "roots"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 1 << 16  # a manifest is a few hundred bytes; anything larger is not one
MAX_TEXT_CHARS = 1024  # longest text field of a manifest (a plan id, a host description)
_NAME_RE = re.compile(rf"^{MANIFEST_DIR}/([0-9a-f]{{{2 * KEY_BYTES}}})\.json$")
_NS_PERSON = b"pcr-nsname-v1"


class ManifestError(ValueError):
    """A root manifest blob is malformed or names another root; the root counts as of unknown origin."""


@dataclass(frozen=True)
class RootIdentity:
    """What a namespace root hashes besides the namespace: the engine's model, KV dtype, chunk size (tokens),
    forward plan id (`FastForward.plan_id`: tile sizes, weight format, split shapes), weight format and kernel
    identity (`pcr_rag.model.kernel_probe.kernel_identity`: hex digits naming the bits this host's kernels
    compute; "" for none, as before kernel identities existed, which keeps such a root's key). ``model`` is a
    display name only; equal fingerprints mean equal weights."""

    model: str
    fingerprint: str
    dtype: str
    chunk_size: int
    plan: str
    weights: str
    kernels: str = ""

    @classmethod
    def of(cls, loaded: Any, forward: Any, chunk_size: int, kernels: str = "") -> RootIdentity:
        """The identity of an engine's roots: ``loaded`` a `LoadedModel`, ``forward`` its `FastForward`,
        ``kernels`` its kernel identity."""
        return cls(model=str(loaded.name), fingerprint=str(loaded.fingerprint),
                   dtype=str(loaded.kv.dtype).removeprefix("torch."), chunk_size=int(chunk_size),
                   plan=str(forward.plan_id), weights=str(forward.weights), kernels=str(kernels))

    def root(self, namespace: str = "", request_namespace: str = "") -> bytes:
        """The chunk keys' root of this identity for ``namespace`` (``EngineConfig.namespace``) and a request's
        ``request_namespace`` ("" = none): what `PCREngine.root_for` uses."""
        plan = f"{self.plan};kernels={self.kernels}" if self.kernels else self.plan
        salt = f"{plan}|{namespace}" + (f"|{request_namespace}" if request_namespace else "")
        return namespace_key(self.fingerprint, self.dtype, self.chunk_size, salt)

    def compatible(self, other: RootIdentity) -> bool:
        """True when KV under ``other``'s roots is KV this identity would compute (the model name aside)."""
        return (self.fingerprint, self.dtype, self.chunk_size, self.plan, self.kernels) == (
            other.fingerprint, other.dtype, other.chunk_size, other.plan, other.kernels)

    def difference(self, other: RootIdentity) -> str:
        """What in ``other`` differs from this identity, e.g. "plan X" or "chunk size 32, dtype float32"."""
        parts = [f"{name} {theirs}" for name, ours, theirs in (
            ("model", self.fingerprint, other.fingerprint), ("dtype", self.dtype, other.dtype),
            ("chunk size", self.chunk_size, other.chunk_size), ("plan", self.plan, other.plan),
            ("kernels", self.kernels, other.kernels or "unknown")) if ours != theirs]
        if parts and parts[0].startswith("model "):
            parts[0] = f"model {other.model} ({other.fingerprint[:12]})"
        return ", ".join(parts) or "nothing"

    def describe(self) -> str:
        return (f"model {self.model} (fingerprint {self.fingerprint[:12]}), dtype {self.dtype}, chunk size "
                f"{self.chunk_size}, plan {self.plan}, kernels {self.kernels or 'unknown'}")

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "fingerprint": self.fingerprint, "dtype": self.dtype,
                "chunk_size": self.chunk_size, "plan": self.plan, "weights": self.weights,
                "kernels": self.kernels}


def namespace_hash(namespace: str = "", request_namespace: str = "") -> str:
    """16 hex digits naming a namespace salt without its text (a tenant's name never lands on disk in clear)."""
    raw = f"{namespace}|{request_namespace}".encode()
    return hashlib.blake2b(raw, digest_size=8, person=_NS_PERSON).hexdigest()


def manifest_name(root: bytes) -> str:
    """The blob name of ``root``'s manifest."""
    return f"{MANIFEST_DIR}/{root.hex()}.json"


def root_of_manifest_name(name: str) -> bytes | None:
    """The root a blob name is the manifest of, or None for any other name."""
    m = _NAME_RE.match(name)
    return bytes.fromhex(m.group(1)) if m else None


@functools.lru_cache(maxsize=1)
def _cpu_name() -> str:
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_description() -> str:
    """The CPU, its vector ISA as PyTorch sees it, the torch thread count and version: what, besides the plan, can
    change a GEMM's bits (so KV is shared only between replicas on the same CPU type and thread count)."""
    import torch

    isa = torch.backends.cpu.get_cpu_capability()
    return f"{_cpu_name()} ({isa}), {torch.get_num_threads()} threads, torch {torch.__version__}"


@dataclass(frozen=True)
class RootManifest:
    """The manifest of one root: its identity, the hash of its namespace salt, when it was written (unix s), and
    the host that wrote it (`host_description`; shown by ``pcr-rag cache info``, not part of the identity)."""

    root: bytes
    identity: RootIdentity
    namespace_hash: str
    written_at: float
    host: str = ""
    blend: bool = False  # the root of the namespace's position-independent chains (`pcr_rag.cache.keys.blend_root`)

    @classmethod
    def new(cls, identity: RootIdentity, namespace: str = "", request_namespace: str = "", *,
            host: str | None = None, blend: bool = False) -> RootManifest:
        """The manifest of ``identity``'s root for the namespace (``blend``: of that root's blend root, under
        which blend mode keeps documents' position-independent KV); ``host`` None: this host
        (`host_description`)."""
        root = identity.root(namespace, request_namespace)
        return cls(blend_root(root) if blend else root, identity, namespace_hash(namespace, request_namespace),
                   time.time(), host_description() if host is None else host, blend)

    def encode(self) -> bytes:
        body = {"version": MANIFEST_VERSION, "root": self.root.hex(), **self.identity.as_dict(),
                "namespace_hash": self.namespace_hash, "written_at": self.written_at, "host": self.host}
        if self.blend:
            body["blend"] = True
        return json.dumps(body, sort_keys=True).encode("utf-8") + b"\n"

    @classmethod
    def decode(cls, raw: bytes, root: bytes) -> RootManifest:
        """Parse a manifest read from ``root``'s blob; ``ManifestError`` when it is not one or names another
        root."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest of root {root.hex()} is {len(raw)} bytes, not a manifest")
        try:
            body = json.loads(raw.decode("utf-8"))
            if not isinstance(body, dict) or body.get("version") != MANIFEST_VERSION:
                raise ManifestError(f"manifest of root {root.hex()} has an unknown version")
            identity = RootIdentity(
                model=_field(body, "model", str), fingerprint=_field(body, "fingerprint", str),
                dtype=_field(body, "dtype", str), chunk_size=_field(body, "chunk_size", int),
                plan=_field(body, "plan", str), weights=_field(body, "weights", str),
                kernels=_field(body, "kernels", str) if "kernels" in body else "")
            host = body.get("host", "")
            manifest = cls(bytes.fromhex(_field(body, "root", str)), identity, _field(body, "namespace_hash", str),
                           float(_field(body, "written_at", (int, float))),
                           _printable("host", host) if isinstance(host, str) else "", body.get("blend") is True)
        except RecursionError:
            raise ManifestError(f"manifest of root {root.hex()} is nested too deeply") from None
        except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
            if isinstance(exc, ManifestError):
                raise
            raise ManifestError(f"manifest of root {root.hex()} is malformed: {exc}") from None
        if not math.isfinite(manifest.written_at):
            raise ManifestError(f"manifest of root {root.hex()} has no valid write time")
        if manifest.root != root:
            raise ManifestError(f"manifest stored for root {root.hex()} names root {manifest.root.hex()}")
        return manifest


def _printable(name: str, value: str) -> str:
    """``value`` when it is short and printable: a manifest's text reaches logs and terminals (no line breaks or
    escape sequences planted there)."""
    if len(value) > MAX_TEXT_CHARS or not value.isprintable():
        raise ManifestError(f"manifest field {name!r} is too long or holds control characters")
    return value


def _field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ManifestError(f"manifest field {name!r} is missing or not a {kind}")
    return _printable(name, value) if isinstance(value, str) else value


def attribute(links: Mapping[bytes, tuple[bytes, bool]]) -> dict[bytes, bytes | None]:
    """The root each chunk hangs from: ``links`` maps a chunk key to (parent key, parent is a root). A chunk whose
    chain reaches a missing parent (or loops) is an orphan (None). Linear in the number of chunks."""
    out: dict[bytes, bytes | None] = {}
    for start in links:
        path: list[bytes] = []
        on_path: set[bytes] = set()
        key = start
        root: bytes | None = None
        while True:
            if key in out:
                root = out[key]
                break
            link = links.get(key)
            if link is None or key in on_path:
                root = None  # missing parent, or a loop (only a forged file could make one)
                break
            path.append(key)
            on_path.add(key)
            parent, parent_is_root = link
            if parent_is_root:
                root = parent
                break
            key = parent
        for k in path:
            out[k] = root
    return out


@dataclass(frozen=True)
class RootUsage:
    """The chunks under one root: how many, their file bytes, and the oldest and newest write (unix s)."""

    chunks: int
    nbytes: int
    oldest: float
    newest: float

    def plus(self, nbytes: int, written_at: float) -> RootUsage:
        return RootUsage(self.chunks + 1, self.nbytes + nbytes, min(self.oldest, written_at),
                         max(self.newest, written_at))


_EMPTY = RootUsage(0, 0, float("inf"), float("-inf"))


def usage_by_root(chunks: Iterable[tuple[bytes, bytes, bool, int, float]]) -> dict[bytes | None, RootUsage]:
    """Per root (None: orphans), the usage of ``chunks`` given as (key, parent, parent is a root, file bytes,
    written at)."""
    rows = list(chunks)
    roots = attribute({key: (parent, is_root) for key, parent, is_root, _, _ in rows})
    out: dict[bytes | None, RootUsage] = {}
    for key, _, _, nbytes, written_at in rows:
        root = roots.get(key)
        out[root] = out.get(root, _EMPTY).plus(nbytes, written_at)
    return out


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def foreign_chunks_note(tier: Any, identity: RootIdentity, own_roots: Iterable[bytes], where: str) -> str | None:
    """One line for the engine's start-up log when the SSD ``tier`` (a recovered `SsdTier`: ``census``,
    ``manifests``, ``files.read_manifest``) holds chunks this ``identity`` cannot use - roots whose manifest names
    another model, dtype, chunk size or plan, or roots of unknown origin (no manifest, not one of ``own_roots``) -
    saying how many and how to prune them; None when there are none. Orphans are not counted (recovery drops
    them)."""
    own = set(own_roots)
    other = RootUsage(0, 0, 0.0, 0.0)
    unknown = RootUsage(0, 0, 0.0, 0.0)
    plans: set[str] = set()
    for root, usage in tier.census.items():
        if root is None or root in own:
            continue
        manifest = tier.files.read_manifest(root) if root in tier.manifests else None
        if manifest is not None and identity.compatible(manifest.identity):
            continue  # another namespace of this identity: usable
        if manifest is None:
            unknown = RootUsage(unknown.chunks + usage.chunks, unknown.nbytes + usage.nbytes, 0.0, 0.0)
        else:
            other = RootUsage(other.chunks + usage.chunks, other.nbytes + usage.nbytes, 0.0, 0.0)
            plans.add(identity.difference(manifest.identity))
    total = other.chunks + unknown.chunks
    if not total:
        return None
    parts = []
    if other.chunks:
        parts.append(f"{other.chunks} of other plans, kernels or models (their {'; '.join(sorted(plans))})")
    if unknown.chunks:
        parts.append(f"{unknown.chunks} of unknown origin (no root manifest)")
    return (f"{where} holds {total} chunks ({_mib(other.nbytes + unknown.nbytes)}) this engine cannot use: "
            f"{', '.join(parts)}; this engine's plan is {identity.plan}, kernels {identity.kernels or 'unknown'}. They count against the SSD budget until "
            f"evicted: stop the engine and run `pcr-rag cache prune --unusable --cache-dir {where}` with its "
            f"--model/--dtype/--chunk-size flags (`pcr-rag cache info` lists them)")


#: Differences `RootCensus` keeps to name in its log line (the rest are counted only).
MAX_CENSUS_DIFFERENCES = 4


@dataclass(frozen=True)
class RootCensus:
    """The root manifests a shared store holds, as one engine's identity sees them: ``roots`` manifests read,
    ``other`` of them naming an identity this engine's is not `RootIdentity.compatible` with, ``unreadable`` values
    under a manifest name that are not a manifest of their root (malformed, oversized, failing their MAC), and
    ``complete``: False when the bounded scan stopped before the whole store was seen (the counts are then lower
    bounds). ``differences``: up to `MAX_CENSUS_DIFFERENCES` of what the other identities differ in ("..." last
    when there are more)."""

    roots: int = 0
    other: int = 0
    unreadable: int = 0
    complete: bool = True
    differences: tuple[str, ...] = ()

    @classmethod
    def of(cls, identity: RootIdentity, manifests: Iterable[RootManifest | None], *,
           complete: bool = True) -> RootCensus:
        """The census of ``manifests`` (None: a value that was not a readable manifest) for ``identity``."""
        roots = other = unreadable = 0
        differences: set[str] = set()
        for manifest in manifests:
            if manifest is None:
                unreadable += 1
                continue
            roots += 1
            if not identity.compatible(manifest.identity):
                other += 1
                differences.add(identity.difference(manifest.identity))
        named = tuple(sorted(differences))
        if len(named) > MAX_CENSUS_DIFFERENCES:
            named = (*named[:MAX_CENSUS_DIFFERENCES], "...")
        return cls(roots, other, unreadable, complete, named)

    def counters(self) -> dict[str, int]:
        """The census as ``remote_io`` counters (``CacheStats``): ``roots_seen``, ``roots_of_other_identity``,
        ``roots_unreadable``, ``roots_census_complete`` (0/1)."""
        return {"roots_seen": self.roots, "roots_of_other_identity": self.other,
                "roots_unreadable": self.unreadable, "roots_census_complete": int(self.complete)}


def foreign_roots_note(census: RootCensus, identity: RootIdentity, where: str) -> str | None:
    """One line for the engine's start-up log when the shared store ``where`` holds manifests of roots of another
    identity (or unreadable ones); None when it holds none. Their chunks are never served here (their keys differ):
    the line says why a replica finds none of them."""
    if not census.other and not census.unreadable:
        return None
    parts = []
    if census.other:
        parts.append(f"the manifests of {census.other} namespace roots of other plans, kernels or models (their "
                     f"{'; '.join(census.differences)}), whose chunks this engine never shares (their keys "
                     f"differ)")
    if census.unreadable:
        parts.append(f"{census.unreadable} unreadable root manifests (malformed, oversized or failing their MAC)")
    scope = "" if census.complete else " at least (its bounded scan saw part of the store)"
    return (f"remote store {where} holds{scope} {' and '.join(parts)}; this engine's plan is {identity.plan}, "
            f"kernels {identity.kernels or 'unknown'}. Only replicas of one identity share chunks (docs/replicas.md)")

"""`pcr-rag cache`: see and manage a persistent (SSD) KV cache directory.

- ``info``: what the directory holds per root identity (model, dtype, chunk size, plan, namespace count, chunks,
  bytes) and which of them the engine described by the model flags would use.
- ``prune --unusable`` removes every chunk the engine cannot use (other models, dtypes, chunk sizes or plans, roots
  of unknown origin, orphans); ``prune --older-than DATE`` removes everything written before DATE. ``--dry-run``
  prints what would go.
- ``verify`` reads every chunk file and checks it as the engine would (header, per-layer checksums, or the MAC and
  AES-GCM tags of a sealed directory with ``--secret-env``); ``--delete`` removes the bad ones. A header's sizes
  are checked against each other and the file's size, and each layer is read in bounded slices, so no header
  claim sizes a buffer; a header field out of range (``written_at`` not a time) makes the file unreadable, which
  ``info`` reports.

The engine's identity is computed exactly as the engine does: the model is loaded and its forward's plan probed
(no KV is computed), since a root hashes the weights' fingerprint and the plan. ``info --no-engine`` skips that.
The plan comes from start-up probes of the GEMM library, whose summation order can change with the CPU type and
the torch thread count (``--threads``): KV is shared only between engines with equal roots, so a directory or a
remote store is worth sharing only between replicas on the same CPU type and thread count (``info`` lists the
host each root was written on).
Anything that deletes takes the directory's lock, so it refuses to run while an engine uses the directory.

``info --remote-url URL`` (or ``--remote-url-file``, read as ``pcr-rag serve`` reads it) also lists the root
manifests a shared Valkey/Redis store holds under ``--remote-namespace``: per root its identity, when and on which
host it was written, and whether it is this engine's (``*``) and this host's; values under a manifest name that are
no readable manifest (malformed, oversized, failing their MAC under ``--remote-secret-file`` or
``$PCR_RAG_REMOTE_SECRET``) are counted, never deleted. It reads them as the engine's start-up census does
(`RemoteTier.read_manifests`: a bounded SCAN, bounded reads). With a remote URL the SSD directory is listed only when
``--cache-dir`` names it. A store that cannot be read ends the command with status 1 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pcr_rag.cache.config import RemoteConfig, redacted_url
from pcr_rag.cache.errors import CacheDirLockedError, RemoteUnavailableError, UnsafeCacheDirError
from pcr_rag.cache.maintenance import (
    DirScan,
    PruneResult,
    RootGroup,
    prune_older,
    prune_unusable,
    scan,
    summarize,
)
from pcr_rag.cache.maintenance import verify as verify_chunks
from pcr_rag.cache.roots import RootIdentity, RootManifest, host_description
from pcr_rag.cache.storage import LocalDirBackend
from pcr_rag.config import EngineConfig, default_cache_dir
from pcr_rag.errors import ConfigError, PCRError

__all__ = ["add_arguments", "engine_identity", "parse_date", "run"]


def _engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the engine whose roots count as current (as `pcr-rag serve` would run it)")
    g.add_argument("--model", default=None, help="alias or local HF directory (default: smollm2-135m-instruct)")
    g.add_argument("--dtype", default="auto", help="model and KV dtype (default: auto)")
    g.add_argument("--chunk-size", type=int, default=EngineConfig.chunk_size, help="tokens per chunk")
    g.add_argument("--weights", default=EngineConfig.weights, help="weight format: bf16, int8, int4")
    g.add_argument("--namespace", default="", help="the engine's EngineConfig.namespace")
    g.add_argument("--max-active", type=int, default=EngineConfig.max_active, help="KV rows (decode batch)")
    g.add_argument("--compile", action="store_true", help="the engine runs with compile=True")
    g.add_argument("--device", default="auto")
    g.add_argument("--model-cache-dir", default=None)
    g.add_argument("--threads", type=int, default=None, help="torch threads the engine runs with (default: "
                                                             "torch's own)")


def _remote_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("a shared remote store (its root manifests), as `pcr-rag serve` names it")
    url = g.add_mutually_exclusive_group()
    url.add_argument("--remote-url", default=None, metavar="URL",
                     help="the Valkey/Redis store replicas share (redis://, rediss://, redis+cluster://...)")
    url.add_argument("--remote-url-file", default=None, metavar="PATH",
                     help="read the URL from a file only its owner can read, so a password never shows in ps")
    g.add_argument("--remote-secret-file", default=None, metavar="PATH",
                   help="the replicas' secret, to check each manifest's MAC (default: $PCR_RAG_REMOTE_SECRET)")
    g.add_argument("--remote-insecure", action="store_true",
                   help="list the manifests without a secret (their MACs unchecked)")
    g.add_argument("--remote-namespace", default=EngineConfig.remote_namespace,
                   help=f"the engines' remote_namespace (default: {EngineConfig.remote_namespace})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    info = sub.add_parser("info", help="what a cache directory (or, with --remote-url, a shared store) holds, "
                                       "per root")
    prune = sub.add_parser("prune", help="remove chunks this engine cannot use, or older than a date")
    check = sub.add_parser("verify", help="check every chunk file; --delete removes the bad ones")
    for p in (info, prune, check):
        p.add_argument("--cache-dir", default=None, help="the SSD tier's directory (default: $PCR_RAG_CACHE_DIR "
                                                         "or ~/.cache/pcr-rag/kv)")
        p.add_argument("--json", action="store_true", help="print one JSON object")
    for p in (info, prune):
        _engine_flags(p)
    info.add_argument("--no-engine", action="store_true", help="do not load the model: no current root")
    _remote_flags(info)
    what = prune.add_mutually_exclusive_group(required=True)
    what.add_argument("--unusable", action="store_true", help="chunks of other models, dtypes, chunk sizes or "
                                                              "plans, of unknown origin, and orphans")
    what.add_argument("--older-than", metavar="DATE", type=parse_date,
                      help="chunks written before DATE (ISO 8601, UTC unless it names a zone; or 7d, 12h)")
    prune.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    check.add_argument("--delete", action="store_true", help="remove the files that fail")
    check.add_argument("--secret-env", default="PCR_RAG_REMOTE_SECRET", metavar="VAR",
                       help="environment variable holding the engine's secret (ssd_encrypt): with it, every MAC "
                            "and AES-GCM tag is checked; without it, the stored checksums")


def parse_date(text: str) -> float:
    """Unix seconds of an ISO 8601 date or time (UTC unless it names a zone) or of an age: ``7d``, ``12h``,
    ``30m`` before now."""
    raw = text.strip()
    units = {"d": 86400.0, "h": 3600.0, "m": 60.0}
    if raw[-1:] in units and raw[:-1].isdigit():
        return time.time() - int(raw[:-1]) * units[raw[-1]]
    try:
        when = datetime.fromisoformat(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an ISO 8601 date (2026-12-01, 2026-12-01T08:00) "
                                         f"nor an age (7d, 12h, 30m)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


def engine_identity(args: argparse.Namespace) -> RootIdentity:
    """The root identity of the engine the flags describe: its model loaded, its forward built (plan probes
    included) and its kernel identity probed, as `PCREngine` does."""
    import torch

    from pcr_rag.model.forward import FastForward
    from pcr_rag.model.kernel_probe import kernel_identity
    from pcr_rag.model.model import load_model
    from pcr_rag.model.weights import resolve_weight_format

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = EngineConfig(chunk_size=args.chunk_size, dtype=args.dtype, weights=args.weights,
                          namespace=args.namespace, max_active=args.max_active, compile=args.compile,
                          device=args.device, model_cache_dir=args.model_cache_dir)
    loaded = load_model(args.model, dtype=config.dtype, device=config.device, model_cache_dir=config.model_cache_dir)
    weights = resolve_weight_format(config.weights, loaded.dtype, loaded.device)
    forward = FastForward(loaded, weights=weights, batch_rows=config.max_active, compile=config.compile)
    return RootIdentity.of(loaded, forward, config.chunk_size, kernel_identity(forward))


def _open(args: argparse.Namespace) -> LocalDirBackend:
    path = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    if not path.is_dir():
        raise ConfigError(f"no cache directory at {path}; pass --cache-dir (the engine's cache_dir)")
    return LocalDirBackend(path)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _group_dict(g: RootGroup) -> dict[str, Any]:
    return {"identity": None if g.identity is None else g.identity.as_dict(), "current": g.current,
            "namespaces": g.namespaces, "roots": [r.hex() for r in g.roots], "hosts": list(g.hosts),
            "chunks": g.usage.chunks,
            "bytes": g.usage.nbytes, "oldest": g.usage.oldest, "newest": g.usage.newest}


@dataclass(frozen=True)
class RemoteRoots:
    """The root manifests a shared store holds (``manifests``, sorted by identity then root), how many values under
    a manifest name were no readable manifest (``unreadable``), and whether the bounded scan saw the whole store
    (``complete``: else the counts are lower bounds). ``where``: the store's URL with its password redacted."""

    where: str
    namespace: str
    manifests: tuple[RootManifest, ...]
    unreadable: int
    complete: bool

    @property
    def identities(self) -> int:
        return len({m.identity for m in self.manifests})


def _remote_config(args: argparse.Namespace) -> RemoteConfig:
    """The store the flags name, configured as the engine's (`EngineConfig.remote_config`)."""
    url, secret = args.remote_url, None
    if args.remote_url_file is not None or args.remote_secret_file is not None:
        try:  # the serve extra's private-file readers (pcr_rag.server needs fastapi)
            from pcr_rag.server.flags import MAX_SECRET_BYTES, read_private_file, read_secret_file
        except ImportError as exc:
            raise ConfigError(f"--remote-url-file / --remote-secret-file need the serve extra "
                              f"(pip install 'pcr-rag[serve]'): {exc}") from None
        try:
            if args.remote_url_file is not None:
                url = read_private_file(args.remote_url_file, max_bytes=MAX_SECRET_BYTES,
                                        what="remote URL file").decode("utf-8").strip()
                if not url:
                    raise ConfigError(f"the remote URL file {args.remote_url_file} is empty")
            if args.remote_secret_file is not None:
                secret = read_secret_file(args.remote_secret_file)
        except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(str(exc)) from None
    config = EngineConfig(device="cpu", remote_url=url, remote_secret=secret, remote_insecure=args.remote_insecure,
                          remote_namespace=args.remote_namespace, remote_connect_timeout_s=2.0,
                          remote_timeout_s=5.0, remote_breaker_errors=1).remote_config
    assert config is not None  # a URL was given
    return config


class _DropFailingLine(logging.Filter):
    """Drops the remote client's "requests use the local tiers" warning: the command reports a failure itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requests use the local tiers" not in str(record.msg)


def read_remote_roots(config: RemoteConfig) -> RemoteRoots:
    """The root manifests of the store ``config`` names, read as the engine's census reads them
    (`RemoteTier.read_manifests`). Raises ``RemoteUnavailableError`` when the store cannot be read."""
    from pcr_rag.cache.tiers.remote import open_remote_tier

    tier = open_remote_tier(config)
    client_log = logging.getLogger("pcr_rag.cache.tiers.remote_client")
    quiet = _DropFailingLine()  # its "requests use the local tiers" line is the engine's; the caller says why
    client_log.addFilter(quiet)
    try:
        found, complete = tier.read_manifests()
    finally:
        client_log.removeFilter(quiet)
        tier.close()
    manifests = sorted((m for m in found if m is not None),
                       key=lambda m: (sorted(m.identity.as_dict().items()), m.root))
    return RemoteRoots(redacted_url(config.url), config.namespace, tuple(manifests),
                       sum(1 for m in found if m is None), complete)


def _remote_dict(remote: RemoteRoots, identity: RootIdentity | None, here: str) -> dict[str, Any]:
    return {"url": remote.where, "namespace": remote.namespace, "complete": remote.complete,
            "identities": remote.identities, "unreadable": remote.unreadable,
            "roots": [{"root": m.root.hex(), "identity": m.identity.as_dict(), "namespace_hash": m.namespace_hash,
                       "written_at": m.written_at, "host": m.host, "this_host": m.host == here,
                       "current": None if identity is None else identity.compatible(m.identity)}
                      for m in remote.manifests]}


def _print_remote(remote: RemoteRoots, identity: RootIdentity | None, here: str, out: Any) -> None:
    scope = "" if remote.complete else " at least (the bounded scan saw part of the store)"
    print(f"remote store {remote.where} namespace {remote.namespace!r}: holds{scope} {len(remote.manifests)} root "
          f"manifests of {remote.identities} identities", file=out)
    groups: dict[RootIdentity, list[RootManifest]] = {}
    for m in remote.manifests:
        groups.setdefault(m.identity, []).append(m)
    for who, manifests in groups.items():
        mark = "*" if identity is not None and identity.compatible(who) else " "
        print(f"{mark} {who.describe()}: {len(manifests)} root(s), written {_when(min(m.written_at for m in manifests))}"
              f" .. {_when(max(m.written_at for m in manifests))}", file=out)
        for m in manifests:
            host = f"{m.host or 'unknown host'}{' (this host)' if m.host == here else ''}"
            print(f"    root {m.root.hex()}: written {_when(m.written_at)} on {host}", file=out)
    if remote.unreadable:
        print(f"  unreadable root manifests: {remote.unreadable} (malformed, oversized or failing their MAC; left in "
              f"the store)", file=out)
    if identity is not None and any(not identity.compatible(who) for who in groups):
        print("(* = usable by this engine; chunks of the other identities are never shared with it)", file=out)


def _info(args: argparse.Namespace, out: Any) -> int:
    remote_asked = args.remote_url is not None or args.remote_url_file is not None
    backend = _open(args) if args.cache_dir is not None or not remote_asked else None
    remote = None
    if remote_asked:
        config = _remote_config(args)
        try:
            remote = read_remote_roots(config)
        except RemoteUnavailableError as exc:
            print(f"pcr-rag cache info: cannot read the remote store: {redacted_url(exc)}", file=sys.stderr)
            return 1
    identity = None if args.no_engine else engine_identity(args)
    if identity is None and args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)  # the host description names the thread count
    here = host_description() if remote is not None else ""
    own = [identity.root(args.namespace)] if identity is not None else []
    if args.json:
        body: dict[str, Any] = _ssd_dict(backend, identity, own) if backend is not None else {}
        body["current"] = None if identity is None else {**identity.as_dict(), "root": own[0].hex()}
        if remote is not None:
            body["remote"] = _remote_dict(remote, identity, here)
        print(json.dumps(body), file=out)
        return 0
    if backend is not None:
        _print_ssd(backend, identity, own, out)
    elif identity is not None:
        print(f"this engine: root {own[0].hex()} ({identity.describe()})", file=out)
    if remote is not None:
        _print_remote(remote, identity, here, out)
    return 0


def _ssd_dict(backend: LocalDirBackend, identity: RootIdentity | None, own: list[bytes]) -> dict[str, Any]:
    found = scan(backend)
    orphans = found.usage().get(None)
    return {
        "cache_dir": str(backend.root), "groups": [_group_dict(g) for g in summarize(found, identity, own)],
        "orphans": {"chunks": orphans.chunks, "bytes": orphans.nbytes} if orphans else {"chunks": 0, "bytes": 0},
        "unreadable": [{"name": n, "reason": r} for n, r in found.unreadable],
    }


def _print_ssd(backend: LocalDirBackend, identity: RootIdentity | None, own: list[bytes], out: Any) -> None:
    found = scan(backend)
    groups = summarize(found, identity, own)
    orphans = found.usage().get(None)
    total = sum(c.file_bytes for c in found.chunks)
    print(f"{backend.root}: {len(found.chunks)} chunks, {_mib(total)}, under {sum(g.namespaces for g in groups)} "
          f"roots", file=out)
    if identity is not None:
        print(f"this engine: root {own[0].hex()} ({identity.describe()})", file=out)
    for g in groups:
        mark = "*" if g.current else " "
        who = g.identity.describe() if g.identity is not None else f"unknown origin (root {g.roots[0].hex()}, " \
                                                                   f"no manifest)"
        print(f"{mark} {who}: {g.namespaces} namespace(s), {g.usage.chunks} chunks, {_mib(g.usage.nbytes)}, "
              f"written {_when(g.usage.oldest)} .. {_when(g.usage.newest)}", file=out)
        if g.hosts:
            print(f"    written on: {'; '.join(g.hosts)}", file=out)
    if orphans:
        print(f"  orphans (chain broken; dropped at the next start): {orphans.chunks} chunks, {_mib(orphans.nbytes)}",
              file=out)
    if found.unreadable:
        print(f"  unreadable chunk files: {len(found.unreadable)} (e.g. {found.unreadable[0][0]}: "
              f"{found.unreadable[0][1]}); `pcr-rag cache verify --delete` removes them", file=out)
    if identity is not None and any(not g.current for g in groups):
        print(f"(* = usable by this engine; `pcr-rag cache prune --unusable --cache-dir {backend.root}` with the "
              f"same model flags removes the rest)", file=out)


def _report_prune(result: PruneResult, backend: LocalDirBackend, args: argparse.Namespace, out: Any) -> None:
    if args.json:
        print(json.dumps({"dry_run": result.dry_run, "chunks": result.chunks, "bytes": result.nbytes,
                          "roots_emptied": [r.hex() for r in result.roots],
                          "failed": [{"name": n, "reason": r} for n, r in result.failed]}), file=out)
        return
    verb = "would remove" if result.dry_run else "removed"
    print(f"{backend.root}: {verb} {result.chunks} chunks ({_mib(result.nbytes)}), emptying {len(result.roots)} "
          f"roots", file=out)
    for name, reason in result.failed:
        print(f"  could not remove {name}: {reason}", file=out)


def _prune(args: argparse.Namespace, out: Any) -> int:
    backend = _open(args)
    identity = engine_identity(args) if args.unusable else None
    if not args.dry_run:
        backend.lock()
    try:
        found: DirScan = scan(backend)
        if identity is not None:
            result = prune_unusable(backend, found, identity, [identity.root(args.namespace)],
                                    dry_run=args.dry_run)
        else:
            result = prune_older(backend, found, args.older_than, dry_run=args.dry_run)
    finally:
        backend.unlock()
    _report_prune(result, backend, args, out)
    return 1 if result.failed else 0


def _verify(args: argparse.Namespace, out: Any) -> int:
    from pcr_rag.cache.seal import Sealer

    backend = _open(args)
    secret = os.environ.get(args.secret_env) or None
    sealer = Sealer(secret, "ssd", encrypt=True) if secret is not None else None
    if args.delete:
        backend.lock()
    try:
        result = verify_chunks(backend, sealer=sealer, delete=args.delete)
    finally:
        backend.unlock()
    if args.json:
        print(json.dumps({"checked": result.checked, "deleted": result.deleted,
                          "bad": [{"name": n, "reason": r} for n, r in result.bad]}), file=out)
    else:
        how = "MACs/AES-GCM tags" if sealer is not None else "checksums"
        print(f"{backend.root}: {result.checked} chunk files checked ({how}), {len(result.bad)} bad"
              + (" (deleted)" if result.deleted and result.bad else ""), file=out)
        for name, reason in result.bad:
            print(f"  {name}: {reason}", file=out)
    return 1 if result.bad and not result.deleted else 0


def run(args: argparse.Namespace, out: Any = None) -> int:
    out = sys.stdout if out is None else out
    try:
        return {"info": _info, "prune": _prune, "verify": _verify}[args.action](args, out)
    except (CacheDirLockedError, UnsafeCacheDirError, PCRError, ValueError) as exc:
        print(f"pcr-rag cache {args.action}: {exc}", file=sys.stderr)
        return 2

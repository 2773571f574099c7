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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pcr_rag.cache.errors import CacheDirLockedError, UnsafeCacheDirError
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
from pcr_rag.cache.roots import RootIdentity
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    info = sub.add_parser("info", help="what a cache directory holds, per root")
    prune = sub.add_parser("prune", help="remove chunks this engine cannot use, or older than a date")
    check = sub.add_parser("verify", help="check every chunk file; --delete removes the bad ones")
    for p in (info, prune, check):
        p.add_argument("--cache-dir", default=None, help="the SSD tier's directory (default: $PCR_RAG_CACHE_DIR "
                                                         "or ~/.cache/pcr-rag/kv)")
        p.add_argument("--json", action="store_true", help="print one JSON object")
    for p in (info, prune):
        _engine_flags(p)
    info.add_argument("--no-engine", action="store_true", help="do not load the model: no current root")
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

    from pcr_rag.runtime.forward import FastForward
    from pcr_rag.runtime.kernel_probe import kernel_identity
    from pcr_rag.runtime.model import load_model
    from pcr_rag.runtime.weights import resolve_weight_format

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


def _info(args: argparse.Namespace, out: Any) -> int:
    backend = _open(args)
    identity = None if args.no_engine else engine_identity(args)
    own = [identity.root(args.namespace)] if identity is not None else []
    found = scan(backend)
    groups = summarize(found, identity, own)
    orphans = found.usage().get(None)
    if args.json:
        print(json.dumps({
            "cache_dir": str(backend.root), "groups": [_group_dict(g) for g in groups],
            "current": None if identity is None else {**identity.as_dict(), "root": own[0].hex()},
            "orphans": {"chunks": orphans.chunks, "bytes": orphans.nbytes} if orphans else {"chunks": 0, "bytes": 0},
            "unreadable": [{"name": n, "reason": r} for n, r in found.unreadable],
        }), file=out)
        return 0
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
    return 0


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

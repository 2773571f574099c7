"""`pcr-rag serve`: the OpenAI-compatible server (see `pcr_rag.server`).

    pcr-rag serve --model smollm2-135m-instruct --cache-dir /var/cache/pcr --api-key "$KEY"
"""

from __future__ import annotations

import argparse
import logging
import os

from pcr_rag.config import EngineConfig
from pcr_rag.engine import PCREngine
from pcr_rag.server.lifecycle import serve
from pcr_rag.server.settings import DEFAULT_MAX_BODY_BYTES, ServerSettings
from pcr_rag.units import parse_bytes

log = logging.getLogger(__name__)

API_KEY_ENV = "PCR_RAG_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    net.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    net.add_argument("--api-key", action="append", default=None, metavar="KEY",
                     help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (repeatable; default: "
                          f"${API_KEY_ENV}, comma-separated)")
    net.add_argument("--tenant-per-key", action="store_true",
                     help="give each API key its own cache namespace (tenants never share KV)")
    net.add_argument("--served-model-name", default=None, help="model id clients send (default: the model's name)")
    net.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests get to finish on SIGTERM before they are cancelled (default 30)")
    net.add_argument("--max-body-bytes", default=str(DEFAULT_MAX_BODY_BYTES),
                     help="larger request bodies get 413 (bytes or e.g. 16MiB; default 16MiB)")
    net.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    eng = parser.add_argument_group("engine")
    eng.add_argument("--model", default=None, help="alias or local HF dir (default: smollm2-135m-instruct)")
    eng.add_argument("--cache-dir", default=None, help="SSD tier directory (default: ~/.cache/pcr-rag/kv)")
    eng.add_argument("--chunk-size", type=int, default=256)
    eng.add_argument("--dram", default="2GiB", help="DRAM tier capacity (e.g. 2GiB)")
    eng.add_argument("--ssd", default="16GiB", help="SSD tier capacity (e.g. 16GiB; 0 disables)")
    eng.add_argument("--max-new-tokens", type=int, default=128, help="default max_tokens of a request")
    eng.add_argument("--max-active", type=int, default=8, help="requests running at once (KV rows)")
    eng.add_argument("--max-model-len", type=int, default=4096, help="tokens per request (prompt + output)")
    eng.add_argument("--max-queue", type=int, default=4096, help="waiting requests beyond which 429 is returned")
    eng.add_argument("--device", default="auto")
    eng.add_argument("--dtype", default="auto")
    eng.add_argument("--weights", default="bf16", help="bf16, int8 or int4")
    eng.add_argument("--no-cache", action="store_true", help="plain prefill, no reuse")


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """Keys from ``--api-key`` (repeatable), else from ``$PCR_RAG_API_KEY`` (comma-separated)."""
    if args.api_key:
        return tuple(k.strip() for k in args.api_key if k.strip())
    return tuple(k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip())


def run(args: argparse.Namespace) -> int:
    try:
        settings = ServerSettings(
            host=args.host, port=args.port, api_keys=api_keys(args), tenant_per_key=args.tenant_per_key,
            served_model_name=args.served_model_name, shutdown_timeout_s=args.shutdown_timeout,
            max_body_bytes=parse_bytes(args.max_body_bytes),
        )
    except ValueError as exc:  # before the model loads: say what is wrong and stop
        log.error("%s", exc)
        return 2
    config = EngineConfig(
        cache_dir=args.cache_dir, chunk_size=args.chunk_size, dram_capacity=args.dram, ssd_capacity=args.ssd,
        max_new_tokens=args.max_new_tokens, max_active=args.max_active, max_model_len=args.max_model_len,
        max_queue=args.max_queue, device=args.device, dtype=args.dtype, weights=args.weights,
        enable_cache=not args.no_cache, freeze_gc=True,  # the server owns its process (see gc_pauses)
    )
    engine = PCREngine(model=args.model, config=config)
    log.info("serving %s (auth %s%s)", settings.served_model_name or engine.loaded.name,
             "on" if settings.api_keys else "off", ", tenant per key" if settings.tenant_per_key else "")
    serve(engine, settings, log_level=args.log_level)
    return 0

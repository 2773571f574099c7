"""`pcr-rag` command line: a thin dispatcher; each subcommand lives in its own module.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``; modules are imported lazily so
`pcr-rag --help` stays fast and a subcommand's heavy dependencies load only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from pcr_rag import logs

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("pcr_rag.rag.demo", "run the embedded RAG demo (LlamaIndex + Chroma + PCRLLM), cache on vs off"),
    "generate": ("pcr_rag.cli.generate", "answer one question over documents with the PCR engine"),
    "bench": ("pcr_rag.bench.cli", "RAG serving benchmark: baselines, ablations, percentiles, plots"),
    "simulate": ("pcr_rag.sim.cli", "trace-driven simulation of the GPU regime on the real cache engine"),
    "profile": ("pcr_rag.sim.measure_profile", "measure a cost-model profile on this machine"),
    "cache-bench": ("pcr_rag.bench.cache_bench", "micro-benchmarks of the cache engine (match, SSD store)"),
    "serve": ("pcr_rag.server.cli", "OpenAI-compatible HTTP server: many processes share one engine and cache"),
    "cache": ("pcr_rag.cli.cache", "see and manage an SSD cache directory: info, prune, verify"),
    "size": ("pcr_rag.cli.size", "KV bytes per token/chunk/document of a model, and the DRAM/SSD for a hit rate"),
}

# the extra that installs what a subcommand imports beyond the core dependencies (pyproject.toml)
EXTRAS: dict[str, str] = {"demo": "rag", "generate": "engine", "bench": "bench", "simulate": "engine",
                          "profile": "engine", "cache-bench": "bench", "serve": "serve", "cache": "engine",
                          "size": "engine"}

# "pcr-rag <command> <name> ...": a sub-command of a sub-command, with its own module (same interface)
NESTED: dict[tuple[str, str], tuple[str, str]] = {
    ("bench", "kernels"): ("pcr_rag.bench.kernels", "kernel benchmark: prefill, decode vs the memory roofline, "
                                                    "weight formats, perplexity, llama.cpp peer"),
    ("bench", "device"): ("pcr_rag.bench.device_check", "GPU check on a random-weight Llama-3-8B: batched decode vs "
                                                        "the roofline, layer-wise overlap, profiles"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pcr-rag", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    head, rest = parser.parse_known_args(argv)
    if not logging.getLogger().handlers:  # as logging.basicConfig: an embedding application's set-up stays
        logs.install("text", logging.DEBUG if head.verbose else logging.INFO)  # `pcr-rag serve` may switch to JSON
    if head.command is None:
        parser.print_help()
        return 2
    module_name, help_text = SUBCOMMANDS[head.command]
    prog = f"pcr-rag {head.command}"
    if rest and (head.command, rest[0]) in NESTED:
        module_name, help_text = NESTED[(head.command, rest[0])]
        prog = f"{prog} {rest[0]}"
        rest = rest[1:]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if head.command not in EXTRAS or missing in ("", "pcr_rag"):
            raise
        extra = EXTRAS[head.command]
        parser.exit(2, f"pcr-rag {head.command} needs the {missing} package, which the {extra!r} extra installs: "
                       f"pip install 'pcr-rag[{extra}]'\n")
    sub_parser = argparse.ArgumentParser(prog=prog, description=help_text)
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(rest)
    return int(module.run(args) or 0)


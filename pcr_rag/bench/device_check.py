"""The CUDA path measured on a random-weight model of a real config: batched decode and layer-wise overlap.

Run on a GPU machine (CI has none): ``python -m pcr_rag.bench.device_check --json out.json``. One process,
one model (default: Llama-3-8B's shape, random bf16 weights, the in-code tiny tokenizer, whose ids all fit the
vocabulary), figures printed as a table and written as JSON:

- **memory**: device-to-device copy GB/s ((bytes read + bytes written) / s, as the kernel bench counts it) and
  host-to-device GB/s from page-locked memory;
- **decode**: the engine's forward (`FastForward`), ms per step at each batch, context ``--context`` tokens per row;
  rows ``fixed`` run every step at the largest batch's row count (the batch-invariant shape), rows ``fast`` at the
  smallest row count proven exact; against the roofline (weight bytes / copy bandwidth) and against transformers'
  own step over a ``DynamicCache`` (batch 1). Every timed region ends with ``torch.cuda.synchronize``;
- **prefill**: one shot through transformers vs the forward's split-invariant prefill of the same tokens;
- **profile**: a cached request's suffix prefill through the forward vs transformers, a cold prefill in one call vs
  in the engine's steps, and the top ops (self CPU / self CUDA time) of one suffix prefill and one decode step of 8
  active rows;
- **engine**: a cold request through the engine vs the same prompt through its own forward alone (the time the
  engine adds around the forward), with the top ops of every thread;
- **overlap**: `measure_limit_ratio` on the device: TTFT of a request whose document prefix is cached in pinned DRAM
  (and on SSD, page cache dropped) with layer-wise overlap on and off, over a raw suffix forward on a resident
  cache.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from pcr_rag.bench.kernels import copy_bandwidth_gb_s, copy_row_prefix
from pcr_rag.bench.limit import default_documents, measure_limit_ratio
from pcr_rag.bench.model_shapes import MODELS
from pcr_rag.model.forward import FastForward
from pcr_rag.model.model import load_model
from pcr_rag.testing import tiny_config, tiny_tokenizer

log = logging.getLogger(__name__)

GiB = 1 << 30
PARTS: tuple[str, ...] = ("memory", "decode", "prefill", "profile", "engine", "overlap")  # in the order they run

def random_model(name: str, device: torch.device, dtype: torch.dtype) -> Any:
    """A random-weight causal LM built directly on ``device``: "tiny", or the shape of a model the simulator
    knows (`pcr_rag.sim.profiles.MODELS`: Llama 2 / 3 with a Llama config, Qwen2.5 with a Qwen2 config; rope
    scaling and the tokenizer aside, which change no kernel's cost)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if name == "tiny":
        config = tiny_config("llama")
    else:
        if name not in MODELS:
            raise ValueError(f"unknown config {name!r}; choose 'tiny' or one of {sorted(MODELS)}")
        shape = MODELS[name]
        make = Qwen2Config if name.startswith("qwen") else LlamaConfig
        config = make(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                      intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                      num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                      head_dim=shape.head_dim, max_position_embeddings=8192, initializer_range=0.02,
                      tie_word_embeddings=False)
        config._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.name_or_path = f"random-{name}"
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median seconds of ``reps`` calls, each ended by a device synchronize (one untimed warm-up call first)."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memory_bandwidth(device: torch.device, nbytes: int, reps: int) -> dict[str, float]:
    """Copy GB/s on the device ((read + write) / s, best of ``reps + 1``, as the kernel bench counts it) and
    host-to-device / device-to-host GB/s from page-locked memory (medians). On CUDA also what a new chunk's
    page-locked DRAM payload costs to allocate (`pinned_alloc`)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    out: dict[str, Any] = {"copy_gb_s": max(copy_bandwidth_gb_s(src, dst) for _ in range(reps + 1)),
                           "copy_bytes": nbytes}
    if device.type == "cuda":
        host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
        out["h2d_pinned_gb_s"] = nbytes / _timed(lambda: dst.copy_(host, non_blocking=True), device, reps) / 1e9
        out["d2h_pinned_gb_s"] = nbytes / _timed(lambda: host.copy_(dst, non_blocking=True), device, reps) / 1e9
        out["pinned_alloc"] = pinned_alloc_ms()
    return out


def pinned_alloc_ms(chunk_bytes: int = 32 << 20, count: int = 8) -> dict[str, float]:
    """ms to allocate one page-locked buffer of ``chunk_bytes`` (a 256-token Llama-3-8B chunk in bf16 is 32 MiB), as
    `ChunkOffload` does for every new chunk on a GPU host: ``fresh`` while ``count`` of them are held (new page-locked
    memory each time: the cost until the DRAM tier is full), ``cached`` after they are freed (PyTorch's host
    allocator hands the blocks out again). Medians."""
    held, fresh, cached = [], [], []
    for _ in range(count):
        t0 = time.perf_counter()
        held.append(torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True))
        fresh.append(time.perf_counter() - t0)
    held.clear()
    for _ in range(count):
        t0 = time.perf_counter()
        held.append(torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True))
        cached.append(time.perf_counter() - t0)
    return {"chunk_bytes": chunk_bytes, "fresh_ms": statistics.median(fresh) * 1e3,
            "cached_ms": statistics.median(cached) * 1e3}


def decode_rows(loaded: Any, batches: Sequence[int], context: int, steps: int, reps: int,
                copy_gb_s: float) -> tuple[list[dict], dict]:
    """ms per decode step of the engine's forward at each batch (fixed and fast row counts) and of transformers'
    step at batch 1; every row holds ``context`` tokens."""
    from transformers import DynamicCache

    device, model = loaded.device, loaded.model
    rows_n = max(batches)
    fw = FastForward(loaded, batch_rows=rows_n, max_positions=context + steps + 2)
    arena = fw.new_arena(rows_n, context + steps + 1)
    prompt = torch.randint(5, 300, (context,), generator=torch.Generator().manual_seed(0))
    fw.prefill(arena.row(0), prompt, 0, want_logits=False)
    copy_row_prefix(arena, context, rows_n)
    roofline_ms = fw.weight_bytes / (copy_gb_s * 1e9) * 1e3

    def step_fn(batch: int, fixed: bool) -> Callable[[], None]:
        rows = [r if r < batch else None for r in range(rows_n)]

        def run() -> None:
            tokens = torch.full((rows_n,), 7, dtype=torch.long)
            for s in range(steps):
                pos = torch.full((rows_n,), context + s, dtype=torch.long)
                tokens = fw.decode(arena, rows, tokens, pos, fixed_rows=fixed).argmax(-1).cpu()  # as the engine
        return run

    out = []
    with torch.inference_mode():
        for batch in batches:
            for fixed in ((False, True) if batch < rows_n else (True,)):
                ms = _timed(step_fn(batch, fixed), device, reps) / steps * 1e3
                out.append({"impl": "fixed" if fixed else "fast", "batch": batch,
                            "gemm_rows": rows_n if fixed else fw.decode_rows_for(batch), "context": context,
                            "ms_per_step": ms, "tokens_per_s": batch / ms * 1e3, "vs_roofline": ms / roofline_ms})
        cache = DynamicCache()
        model(input_ids=prompt[None].to(device), cache=cache, use_cache=True, logits_to_keep=1)

        def hf_run() -> None:
            tok = torch.tensor([[7]], device=device)
            for s in range(steps):
                logits = model(input_ids=tok, position_ids=torch.tensor([[context + s]], device=device), cache=cache,
                               use_cache=True, logits_to_keep=1).logits
                tok = logits[:, -1].argmax(-1, keepdim=True).cpu().to(device)  # the host sees each token
            cache.crop(-steps)
        ms = _timed(hf_run, device, reps) / steps * 1e3
        out.append({"impl": "transformers", "batch": 1, "gemm_rows": 1, "context": context, "ms_per_step": ms,
                    "tokens_per_s": 1e3 / ms, "vs_roofline": ms / roofline_ms})
    return out, {"weight_bytes": fw.weight_bytes, "roofline_ms": roofline_ms}


def prefill_rows(loaded: Any, tokens: int, reps: int) -> list[dict]:
    """Seconds to prefill ``tokens`` random tokens: transformers one shot vs the forward's prefill."""
    device, model = loaded.device, loaded.model
    ids = torch.randint(5, 300, (tokens,), generator=torch.Generator().manual_seed(1))
    fw = FastForward(loaded, batch_rows=1, max_positions=tokens + 1)
    arena = fw.new_arena(1, tokens)
    with torch.inference_mode():
        hf = _timed(lambda: model(input_ids=ids[None].to(device), logits_to_keep=1), device, reps)
        fast = _timed(lambda: fw.prefill(arena.row(0), ids, 0), device, reps)
    return [{"impl": "transformers", "tokens": tokens, "seconds": hf, "tokens_per_s": tokens / hf, "vs_one_shot": 1.0},
            {"impl": "fast", "tokens": tokens, "seconds": fast, "tokens_per_s": tokens / fast,
             "vs_one_shot": fast / hf}]


def profile_rows(loaded: Any, prefix_tokens: int, suffix_tokens: int, reps: int, step: int = 256) -> dict:
    """Where a cached request's time goes, without the engine: the forward's prefill of ``suffix_tokens`` over a
    resident ``prefix_tokens`` row vs transformers' suffix forward over a resident ``DynamicCache``; a cold
    prefill of the prefix in ``step``-token calls (the engine's steps) vs one call; and the top ops (self CPU and
    self CUDA time) of one suffix prefill and one decode step of 8 active rows."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import DynamicCache

    device, model = loaded.device, loaded.model
    n = prefix_tokens + suffix_tokens
    ids = torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(2))
    fw = FastForward(loaded, batch_rows=8, max_positions=n + 2)
    arena = fw.new_arena(8, n + 1)
    row = arena.row(0)
    out: dict[str, Any] = {"prefix_tokens": prefix_tokens, "suffix_tokens": suffix_tokens, "step": step}
    with torch.inference_mode():
        out["cold_one_call_s"] = _timed(lambda: fw.prefill(row, ids[:prefix_tokens], 0), device, reps)
        out["cold_steps_s"] = _timed(lambda: [fw.prefill(row, ids[s: min(prefix_tokens, s + step)], s)
                                              for s in range(0, prefix_tokens, step)], device, reps)
        out["suffix_fast_s"] = _timed(lambda: fw.prefill(row, ids[prefix_tokens:], prefix_tokens), device, reps)
        cache = DynamicCache()
        model(input_ids=ids[None, :prefix_tokens].to(device), cache=cache, use_cache=True, logits_to_keep=1)
        positions = torch.arange(prefix_tokens, n, device=device)[None]

        def hf_suffix() -> None:
            model(input_ids=ids[None, prefix_tokens:].to(device), position_ids=positions, cache=cache,
                  use_cache=True, logits_to_keep=1)
            cache.crop(-suffix_tokens)  # back to the prefix (transformers 5: a negative count)
        out["suffix_transformers_s"] = _timed(hf_suffix, device, reps)
        copy_row_prefix(arena, n, 8)  # every row decodes over the same n tokens of context
        rows = list(range(8))
        tokens = torch.full((8,), 7, dtype=torch.long)
        pos = torch.full((8,), n, dtype=torch.long)
        for name, fn in (("suffix_prefill", lambda: fw.prefill(row, ids[prefix_tokens:], prefix_tokens)),
                         ("decode_8_active_rows", lambda: fw.decode(arena, rows, tokens, pos))):
            fn()
            _sync(device)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=activities) as prof:
                fn()
                _sync(device)
            averages = prof.key_averages()
            out[f"profile_{name}_cpu"] = averages.table(sort_by="self_cpu_time_total", row_limit=12)
            if device.type == "cuda":
                out[f"profile_{name}_cuda"] = averages.table(sort_by="self_cuda_time_total", row_limit=12)
    return out


def _all_threads() -> Any:
    """The profiler option that records ops on every thread (torch >= 2.7), or None where it is missing."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return None


def engine_rows(loaded: Any, documents: Sequence[str], reps: int, work_dir: Path) -> dict:
    """A cold request through the engine (cache off, one token) vs the same prompt through the engine's own
    forward alone, in the engine's 256-token steps: the engine's time around the forward, and the top ops (self
    CPU time, every thread) of one cold request."""
    from torch.profiler import ProfilerActivity, profile

    from pcr_rag.config import EngineConfig
    from pcr_rag.engine import PCREngine

    device = loaded.device
    cfg = EngineConfig(cache_dir=work_dir / "engine-off", enable_cache=False, max_new_tokens=1, device=str(device))
    out: dict[str, Any] = {}
    with PCREngine(model=loaded.model, tokenizer=loaded.tokenizer, config=cfg) as eng:
        questions = iter(f"Question {i}: what do these documents say?" for i in range(10 * reps + 10))
        first = eng.generate(next(questions), list(documents))  # untimed: first-call costs
        ids = torch.tensor(first.prompt_token_ids, dtype=torch.long)
        step = cfg.prefill_chunk_tokens
        ttft = [eng.generate(next(questions), list(documents)).metrics.ttft_s for _ in range(reps)]
        row = eng.arena.row(0)
        with torch.inference_mode():
            forward_s = _timed(lambda: [eng.forward.prefill(row, ids[s: min(len(ids), s + step)], s)
                                        for s in range(0, len(ids), step)], device, reps)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities, experimental_config=_all_threads()) as prof:
            eng.generate(next(questions), list(documents))  # the engine computes on its executor thread
        out = {"prompt_tokens": len(ids), "step": step, "engine_ttft_s": statistics.median(ttft),
               "forward_steps_s": forward_s, "engine_over_forward": statistics.median(ttft) / forward_s,
               "profile_engine_cold_cpu": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)}
    return out


def run_device_check(*, config: str = "llama3-8b", device: str = "cuda", batches: Sequence[int] = (1, 8, 32),
                     context: int = 1024, steps: int = 8, reps: int = 5, prefill_tokens: int = 2048,
                     prefix_tokens: int = 2560, limit_reps: int = 2, copy_bytes: int = 2 * GiB,
                     parts: Sequence[str] = PARTS,
                     checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Every part in ``parts`` measured in this process; the JSON report (see the module docstring).
    ``checkpoint(report so far)`` runs after each part, so a run cut short keeps what it measured."""
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown parts {unknown}; choose from {list(PARTS)}")
    done = checkpoint or (lambda _report: None)
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = random_model(config, dev, dtype)
    tok = tiny_tokenizer(model_max_length=model.config.max_position_embeddings)
    loaded = load_model(model, tok, dtype=dtype, device=dev, name=f"random-{config}")
    report: dict[str, Any] = {
        "config": config, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": str(dtype), "model_build_s": time.perf_counter() - t0,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    copy_gb_s = None
    if "memory" in parts or "decode" in parts:
        report["memory"] = memory_bandwidth(dev, copy_bytes, reps)
        copy_gb_s = report["memory"]["copy_gb_s"]
        log.info("memory: %s", report["memory"])
        done(report)
    if "decode" in parts:
        report["decode"], report["decode_roofline"] = decode_rows(loaded, batches, context, steps, reps, copy_gb_s)
        log.info("decode: %s", report["decode"])
        done(report)
    if "prefill" in parts:
        report["prefill"] = prefill_rows(loaded, prefill_tokens, reps)
        log.info("prefill: %s", report["prefill"])
        done(report)
    if "profile" in parts:
        report["profile"] = profile_rows(loaded, prefix_tokens, 42, reps)
        log.info("profile: %s", {k: v for k, v in report["profile"].items() if not k.startswith("profile_")})
        done(report)
    docs = default_documents(prefix_tokens, tok) if "overlap" in parts or "engine" in parts else []
    if "engine" in parts:
        with tempfile.TemporaryDirectory(prefix="pcr-device-check-") as work:
            report["engine"] = engine_rows(loaded, docs, reps, Path(work))
        log.info("engine: %s", {k: v for k, v in report["engine"].items() if not k.startswith("profile_")})
        done(report)
    if "overlap" in parts:
        res = measure_limit_ratio(model, tok, documents=docs, reps=limit_reps, dtype=dtype, device=device)
        report["overlap"] = res.as_dict()
        log.info("overlap: %s", res.summary())
        done(report)
    return report


def format_report(report: dict) -> str:
    """The report as text tables."""
    lines = [f"{report['config']} ({report['parameters'] / 1e9:.2f} B parameters, {report['dtype']}) on "
             f"{report['device']}, torch {report['torch']}"]
    mem = report.get("memory")
    if mem:
        lines.append("memory: copy {:.0f} GB/s (read + write){}".format(
            mem["copy_gb_s"], f", host->device pinned {mem['h2d_pinned_gb_s']:.1f} GB/s, device->host "
                              f"{mem['d2h_pinned_gb_s']:.1f} GB/s" if "h2d_pinned_gb_s" in mem else ""))
        alloc = mem.get("pinned_alloc")
        if alloc:
            lines.append(f"page-locked {alloc['chunk_bytes'] >> 20} MiB buffer (a new chunk's DRAM payload): "
                         f"{alloc['fresh_ms']:.2f} ms fresh, {alloc['cached_ms']:.2f} ms from the host allocator's cache")
    if report.get("decode"):
        roof = report["decode_roofline"]["roofline_ms"]
        lines.append(f"decode (roofline {roof:.2f} ms/step):")
        lines.append(f"  {'impl':<13}{'batch':>6}{'rows':>6}{'ms/step':>10}{'tokens/s':>11}{'x roofline':>12}")
        for r in report["decode"]:
            lines.append(f"  {r['impl']:<13}{r['batch']:>6}{r['gemm_rows']:>6}{r['ms_per_step']:>10.2f}"
                         f"{r['tokens_per_s']:>11.1f}{r['vs_roofline']:>12.2f}")
    for r in report.get("prefill", []):
        lines.append(f"prefill {r['impl']:<13} {r['tokens']} tokens {r['seconds'] * 1e3:.1f} ms "
                     f"({r['tokens_per_s']:.0f} tokens/s, {r['vs_one_shot']:.2f}x one shot)")
    pr = report.get("profile")
    if pr:
        lines.append(f"profile: cold prefill of {pr['prefix_tokens']} tokens in one call "
                     f"{pr['cold_one_call_s'] * 1e3:.1f} ms vs {pr['step']}-token calls {pr['cold_steps_s'] * 1e3:.1f} "
                     f"ms; suffix of {pr['suffix_tokens']} tokens over the resident prefix: forward "
                     f"{pr['suffix_fast_s'] * 1e3:.1f} ms vs transformers {pr['suffix_transformers_s'] * 1e3:.1f} ms")
        lines += [v for k, v in pr.items() if k.startswith("profile_")]
    en = report.get("engine")
    if en:
        lines.append(f"engine: a cold {en['prompt_tokens']}-token request (cache off) TTFT "
                     f"{en['engine_ttft_s'] * 1e3:.1f} ms vs its forward alone in {en['step']}-token steps "
                     f"{en['forward_steps_s'] * 1e3:.1f} ms ({en['engine_over_forward']:.2f}x)")
        lines.append(en["profile_engine_cold_cpu"])
    ov = report.get("overlap")
    if ov:
        lines.append(
            f"overlap: prefix {ov['prefix_tokens']} + suffix {ov['suffix_tokens']} tokens; raw suffix forward "
            f"{ov['raw_forward_s'] * 1e3:.1f} ms; TTFT uncached {ov['ttft_uncached_s'] * 1e3:.1f} ms; DRAM hit "
            f"{ov['ttft_dram_s'] * 1e3:.1f} ms layer-wise vs {ov['ttft_dram_no_overlap_s'] * 1e3:.1f} ms serial "
            f"(limit ratio {ov['ratio_dram']:.2f} vs {ov['ratio_dram_no_overlap']:.2f}); SSD hit "
            f"{ov['ttft_ssd_s'] * 1e3:.1f} ms vs {ov['ttft_ssd_no_overlap_s'] * 1e3:.1f} ms "
            f"({ov['ratio_ssd']:.2f} vs {ov['ratio_ssd_no_overlap']:.2f})")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``pcr-rag bench device`` / ``python -m pcr_rag.bench.device_check``."""
    parser.add_argument("--config", default="llama3-8b", choices=[*MODELS, "tiny"],
                        help="model shape (random weights): one the simulator knows, or tiny")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,8,32", help="decode batches (the largest is the fixed row count)")
    parser.add_argument("--context", type=int, default=1024, help="tokens per decode row")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--prefix-tokens", type=int, default=2560,
                        help="cached document prefix of the overlap part (about; the prompt must fit 4,096 tokens)")
    parser.add_argument("--limit-reps", type=int, default=2)
    parser.add_argument("--copy-bytes", type=int, default=2 * GiB)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from: {', '.join(PARTS)}")
    parser.add_argument("--json", metavar="PATH", help="write the JSON report here (after every part)")


def run(args: argparse.Namespace) -> int:
    report = run_device_check(
        config=args.config, device=args.device, batches=tuple(int(b) for b in args.batches.split(",")),
        context=args.context, reps=args.reps, prefill_tokens=args.prefill_tokens, prefix_tokens=args.prefix_tokens,
        limit_reps=args.limit_reps, copy_bytes=args.copy_bytes, parts=tuple(args.parts.split(",")),
        checkpoint=lambda r: args.json and Path(args.json).write_text(json.dumps(r, indent=2, default=str)))
    print(format_report(report))  # noqa: T201 - a benchmark script's output
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())

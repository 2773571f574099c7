"""The kernel identity: a hash of the KV bits the engine's own forward computes on fixed probe inputs.

A chunk key's root must cover everything that can change the KV's bits. The model fingerprint, KV dtype, chunk
size and plan id name what the engine chooses; the kernel path does not show in any of them: the CPU ISA that
torch and oneDNN dispatch to (AMX, AVX-512 BF16, AVX2, caps such as ``ATEN_CPU_CAPABILITY`` and
``ONEDNN_MAX_CPU_ISA``), the oneDNN, MKL and torch versions, the GPU model and CUDA libraries, the thread count a
GEMM splits over. A list of versions
would both miss causes (an environment cap, a BIOS that hides an ISA) and split hosts that compute equal bits, so
the identity is empirical instead: `kernel_identity` runs the engine's own `FastForward.prefill` over fixed
synthetic token ids and hashes every layer's KV. Two engines whose probes agree computed the same bits for it, and
the root (`pcr_rag.cache.roots.RootIdentity`) folds the hash in, so a host on another kernel path never finds
(nor serves) this host's chunks.

What the probe covers, on one probe row, through every layer of the model (`probe_steps`):

- one full prefill tile (``tile_rows`` positions from 0, or as many as the context window allows): every linear,
  norm, rotary and attention kernel at the full-tile shape, every whole attention block it spans, every layer;
- then one step of the smallest short tile size the plan uses (`FastForward.short_tile_sizes`) after it: a short
  GEMM shape, and attention over a sub-block span (`FastForward.attention_sub_block`) of a block whose earlier
  positions are cached.

The other short tile sizes and spans need no probe of their own: the forward uses a short tile size or a sub-block
span only where its start-up probes showed that its rows equal the full tile's and the whole block's bit for bit
(`pcr_rag.model.tile_probe`, `pcr_rag.model.attention_probe`), so on every host the KV is the full tile's and
the whole block's, whichever tile or span computes it; two hosts whose plans keep different sizes still compute
equal KV when their full tiles and blocks agree. Decode steps are not probed: the KV they write is never stored
as a chunk.

The first step is the warm-up's own prefill (`FastForward.warm_up` runs `probe_token_ids`), so an engine that warms
up pays only the short step (`kernel_identity` with ``warmed``).

The hash is computed once per process for each (weights, plan, dtype, device, thread count) and kept in memory
only: an identity read from disk would be exactly the claim the probe replaces.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

import torch

__all__ = ["KERNEL_PROBE_VERSION", "first_step_positions", "kernel_identity", "probe_steps", "probe_token_ids"]

log = logging.getLogger(__name__)

KERNEL_PROBE_VERSION = "pcr-kprobe-v1"
IDENTITY_HEX = 16  # hex digits of the identity kept (64 bits: a label between kernel paths, not a secret)
_TOKEN_STRIDE = 7919  # a prime: consecutive probe positions get unrelated token ids

_lock = threading.Lock()
_known: dict[tuple[Any, ...], str] = {}


def probe_token_ids(vocab: int, n: int) -> torch.Tensor:
    """The probe's token ids at positions [0, n): fixed, unrelated from one position to the next."""
    return (torch.arange(n, dtype=torch.long) * _TOKEN_STRIDE + 1) % vocab


def first_step_positions(tile_rows: int, max_positions: int) -> int:
    """Positions of the probe's (and the warm-up's) full tile: a tile, or what the context window leaves."""
    return max(0, min(tile_rows, max_positions - 1))


def probe_steps(tile_rows: int, short_tiles: tuple[int, ...], max_positions: int) -> list[tuple[int, int]]:
    """The probe's prefill steps as (start, positions): a full tile from 0, then one step of the smallest short
    tile size, when it ends before ``max_positions``."""
    first = first_step_positions(tile_rows, max_positions)
    if first < 1:
        return []
    steps = [(0, first)]
    if short_tiles and first + min(short_tiles) < max_positions:
        steps.append((first, min(short_tiles)))
    return steps


def _cache_key(forward: Any) -> tuple[Any, ...]:
    return (forward.loaded.fingerprint, forward.plan_id, tuple(forward.short_tile_sizes), forward.attention_sub_block,
            int(forward.max_positions), str(forward.dtype), str(forward.device), torch.get_num_threads())


def kernel_identity(forward: Any, warmed: Any = None) -> str:
    """The kernel identity of ``forward`` (a `FastForward`): `IDENTITY_HEX` hex digits of a hash of the KV its
    probe steps compute (module docstring). ``warmed``: a row (`RowKV`) whose first step `FastForward.warm_up` has
    just computed (its probe tokens), used instead of a row of its own; its later positions are overwritten.
    Computed once per process per `_cache_key`; thread-safe."""
    key = _cache_key(forward)
    with _lock:
        hit = _known.get(key)
        if hit is None:
            started = time.perf_counter()
            hit = _known[key] = _probe(forward, warmed)
            log.info("kernel identity %s (probe: %.3f s%s)", hit, time.perf_counter() - started,
                     ", after the warm-up's tile" if warmed is not None else "")
    return hit


@torch.inference_mode()
def _probe(forward: Any, warmed: Any) -> str:
    steps = probe_steps(forward.tile_rows, tuple(forward.short_tile_sizes), int(forward.max_positions))
    digest = hashlib.blake2b(digest_size=IDENTITY_HEX // 2, person=b"pcr-kprobe")
    digest.update(f"{KERNEL_PROBE_VERSION};{steps}".encode())
    if not steps:
        return digest.hexdigest()
    end = steps[-1][0] + steps[-1][1]
    row = warmed if warmed is not None else forward.new_arena(1, end).row(0)
    vocab = int(forward.loaded.model.get_input_embeddings().weight.shape[0])
    ids = probe_token_ids(vocab, end)
    for start, n in steps[1:] if warmed is not None else steps:
        forward.prefill(row, ids[start: start + n], start, want_logits=False)
    for layer in range(len(forward.layers)):
        for part in (row.keys(layer, 0, end), row.values(layer, 0, end)):
            flat = part.detach().to("cpu").contiguous().reshape(-1)
            digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()

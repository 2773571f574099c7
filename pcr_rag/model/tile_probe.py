"""Which GEMM row counts compute a row bit for bit as a full prefill tile does.

oneDNN and MKL choose their blocking by the number of rows M, and the blocking fixes the order in which a row's
products are summed. A row computed in a 64-row call therefore equals the same row in a 256-row call only when both
calls sum in the same order - which depends on the shape, the kernel library, the CPU and the thread count. So the
fast forward asks, once per linear shape and process, instead of assuming.

Random inputs make a weak probe: with bf16 outputs, a different fp32 summation order shows in only a tiny fraction
of the outputs, so a probe of random inputs can miss it. The probe's inputs are built to expose order instead: most
input features come in pairs
``(+v, -v)`` with large ``v`` whose weight columns are equal, so their products cancel exactly in the total but
make the running partial sums large; the result is the small sum of the few unpaired products, and the rounding of
the large partial sums - which is what a different order changes - shows in a few percent of the outputs for
every M that differs, and in none for every M that matches (see
docs/measurements-history.md#figures-moved-from-code-comments).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pcr_rag.model.weights import Linear, PaddedRows

PAIRED_MAGNITUDE = 256.0  # scale of the cancelling input pairs (exact in bf16; products exact in fp32)
UNPAIRED_FEATURES = 32    # input features left unpaired: the small result the rounding shows against
_SEED = 0

LinearMaker = Callable[[torch.Tensor, "torch.Tensor | None"], Linear]
"""``make(weight [out, in], bias | None) -> Linear``, building the same kind of linear as the one probed."""

_exact_cache: dict[tuple, frozenset[int]] = {}


def probe_inputs(in_features: int, out_features: int, rows: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [out, in], x [rows, in])`` in ``dtype`` whose products cancel in pairs (see the module
    docstring): deterministic, the same for every caller."""
    g = torch.Generator().manual_seed(_SEED)
    weight = torch.randn(out_features, in_features, generator=g) * 0.05
    x = torch.randn(rows, in_features, generator=g)
    paired = torch.randperm(in_features, generator=g)[: max(0, in_features - UNPAIRED_FEATURES) // 2 * 2]
    a, b = paired[0::2], paired[1::2]
    weight[:, b] = weight[:, a]
    weight = weight.to(dtype)
    v = (torch.randn(rows, a.numel(), generator=g) * PAIRED_MAGNITUDE).to(dtype).float()
    x[:, a] = v
    x[:, b] = -v
    return weight.to(device), x.to(device=device, dtype=dtype)


def exact_row_counts(make: LinearMaker, in_features: int, out_features: int, *, bias: bool, tile: int,
                     candidates: Sequence[int], dtype: torch.dtype, device: torch.device,
                     kind: str, split: int | None = None) -> frozenset[int]:
    """The row counts among ``candidates`` (each < ``tile``) at which every row of a linear built by ``make``
    equals the same row computed in a call of ``tile`` rows - or, with ``split``, in the calls of ``split`` rows
    that a full tile is run as - bit for bit, on the probe inputs. Cached per process by shape, ``kind`` (the
    caller's name for what ``make`` builds), split, dtype, device and thread count."""
    key = (kind, in_features, out_features, bias, tile, tuple(candidates), split, dtype, str(device),
           torch.get_num_threads())
    found = _exact_cache.get(key)
    if found is None:
        weight, x = probe_inputs(in_features, out_features, tile, dtype, device)
        b = (torch.randn(out_features, generator=torch.Generator().manual_seed(_SEED)).to(device=device, dtype=dtype)
             if bias else None)
        linear = make(weight, b)
        with torch.inference_mode():
            full = linear(x) if split is None else torch.cat([linear(x[s: s + split].contiguous())
                                                              for s in range(0, tile, split)])
            found = frozenset(
                m for m in candidates
                if all(torch.equal(linear(x[s: s + m].contiguous()), full[s: s + m])
                       for s in range(0, tile - m + 1, m)))
        _exact_cache[key] = found
    return found


def fit_to_tiles(linear: Linear, make: LinearMaker, *, tile: int, candidates: Sequence[int], dtype: torch.dtype,
                 device: torch.device, kind: str) -> Linear:
    """``linear`` made exact at the short tile sizes ``candidates``: as it is where its rows there equal a full
    tile's; else a `PaddedRows` that pads the sizes that differ - or, when running full tiles as two half-tile
    calls makes more sizes exact, that splits full tiles (and pads what is still left)."""
    if not candidates:
        return linear

    def padded(split: int | None) -> frozenset[int]:
        return frozenset(candidates) - exact_row_counts(
            make, linear.in_features, linear.out_features, bias=getattr(linear, "bias", None) is not None,
            tile=tile, candidates=candidates, dtype=dtype, device=device, kind=kind, split=split)

    pads, split = padded(None), None
    half = tile // 2
    if pads and half in candidates:
        pads_split = padded(half)
        if len(pads_split) < len(pads):
            pads, split = pads_split, half
    return PaddedRows(linear, tile, pads, split) if pads or split else linear

"""Linear-layer weight formats for the fast forward: dense (the model dtype), int8 and int4 weight-only.

Every format is a callable ``linear(x) -> y`` over ``x [M, in_features]`` in the model dtype, computed by a kernel
PyTorch ships (no hand-written GEMM):

- ``"bf16"`` (dense, the model's own dtype - also float32 models): `torch.nn.functional.linear`.
- ``"int8"``: per-output-channel symmetric int8 weights, `torch._weight_int8pack_mm` (PyTorch's CPU weight-only
  int8 kernel; activations stay in the model dtype).
- ``"int4"``: group-wise (32 input features per group) asymmetric 4-bit weights, `torch._weight_int4pack_mm_for_cpu`
  (the kernel torchao's int4 weight-only CPU layout uses).

Invariant the runtime relies on: for a fixed number of rows M, a row's output depends only on that row (not on
its position in the batch nor on the other rows). Measured for every format by the forward's invariance tests.

PyTorch's weight-only kernels are built for few rows (decode) and are several times slower than a bf16 GEMM at
prefill sizes (see docs/measurements-history.md#figures-moved-from-code-comments). So the quantized formats
also keep their *dequantized* weights in the activation dtype and run calls of more than `QUANT_KERNEL_MAX_ROWS` rows
as a dense GEMM over them: the same weights (what the kernel computes with), the fast kernel for each regime. The
path is chosen by M alone, so the fixed-M invariant still holds.
"""

from __future__ import annotations

import logging
import timeit
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pcr_rag.errors import ConfigError

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("bf16", "int8", "int4")
INT4_GROUP_SIZE = 32  # input features per int4 scale/zero group
QUANT_KERNEL_MAX_ROWS = 32  # calls with more rows run a dense GEMM over the dequantized weights
QUANT_MAX_SLOWDOWN = 4.0  # a weight-only kernel this many times slower than the dense GEMM is not used


class Linear:
    """A linear layer in some weight format: ``__call__(x [M, in]) -> [M, out]`` in the activation dtype."""

    in_features: int
    out_features: int
    nbytes: int  # bytes of weight data read per call (the memory-roofline numerator)

    @property
    def prepacked(self) -> bool:
        """Whether some row counts run on oneDNN-prepacked weights (a GEMM path that fixes the numbers)."""
        return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class DenseLinear(Linear):
    """``F.linear`` in the model dtype. With ``packed`` (float32, or bf16 on a CPU with native bf16), calls whose
    row count is one of the packed ones - the prefill tile and the decode batch - use oneDNN's weights prepacked
    for that M instead: no per-call weight reorder, which is what the one-shot GEMM pays on every call (see
    `_can_prepack` and docs/measurements-history.md#figures-moved-from-code-comments). The path is chosen by M
    alone, so a given M always runs the same kernel (the fixed-M invariant holds)."""

    weight: torch.Tensor  # [out, in], model dtype
    bias: torch.Tensor | None = None
    packed: dict[int, torch.Tensor] | None = None  # rows -> weights prepacked for that M (some may share one)

    @property
    def in_features(self) -> int:  # type: ignore[override]
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:  # type: ignore[override]
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:  # type: ignore[override]
        return self.weight.nbytes + (self.bias.nbytes if self.bias is not None else 0)

    @property
    def prepacked(self) -> bool:
        return self.packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed.get(x.shape[0]) if self.packed else None
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None, pack_rows: tuple[int, ...] = (),
              shared_rows: tuple[int, ...] = (), small_rows: tuple[int, ...] = ()) -> DenseLinear:
        """``pack_rows``: row counts to prepack for; ``shared_rows``: row counts that use the packing of the
        largest of ``pack_rows`` (no extra copy: oneDNN's blocked layout is the same across the prefill tile
        sizes; were it not, a call would only reorder, never change a number);
        ``small_rows``: row counts that use the packing of the smallest (the decode batch's: fewer active rows)."""
        rows = sorted({m for m in pack_rows if m})
        if not rows or not _can_prepack(weight):
            return cls(weight, bias, None)
        if weight.dtype == torch.float32:
            # one float32 packing serves every M (the decode batch's calls on the prefill tile's packing give the
            # same numbers at no extra cost; a packing for M=1 would not), so the copy of the weights is made once
            one = torch.ops.mkldnn._reorder_linear_weight(weight, rows[-1])
            return cls(weight, bias, dict.fromkeys((*rows, *shared_rows, *small_rows), one))
        packed = {m: torch.ops.mkldnn._reorder_linear_weight(weight, m) for m in rows}
        packed.update({m: packed[rows[0]] for m in small_rows if m not in packed})
        packed.update({m: packed[rows[-1]] for m in shared_rows if m not in packed})
        return cls(weight, bias, packed)


@dataclass(frozen=True, eq=False)
class PaddedRows(Linear):
    """``inner`` with calls of ``padded_rows`` rows run as calls of ``tile`` rows (zero rows appended, dropped from
    the result), and - with ``split`` - calls of ``tile`` rows run as calls of ``split`` rows: for a linear whose
    rows at the short tile sizes are not bit-identical to its rows in one full-tile call (see
    `pcr_rag.model.tile_probe`). Other row counts (the decode batch) pass through."""

    inner: Linear
    tile: int
    padded_rows: frozenset[int]
    split: int | None = None

    @property
    def in_features(self) -> int:  # type: ignore[override]
        return self.inner.in_features

    @property
    def out_features(self) -> int:  # type: ignore[override]
        return self.inner.out_features

    @property
    def nbytes(self) -> int:  # type: ignore[override]
        return self.inner.nbytes

    @property
    def prepacked(self) -> bool:
        return self.inner.prepacked

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m in self.padded_rows:
            full = x.new_zeros(self.tile, x.shape[1])
            full[:m] = x
            return self(full)[:m]
        if m == self.tile and self.split:
            return torch.cat([self.inner(x[s: s + self.split]) for s in range(0, m, self.split)])
        return self.inner(x)


def _can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN prepacking pays for float32 weights, and for bf16 weights on a CPU that runs bf16 natively.

    For float32 the prepacked GEMM beats `F.linear` (MKL) at every row count the forward uses - the decode batch, a
    prefill tile and a single row - because it skips the per-call weight reorder (see
    docs/measurements-history.md#figures-moved-from-code-comments)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return False
        return weight.dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@dataclass(frozen=True, eq=False)
class Int8Linear(Linear):
    qweight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor   # [out], activation dtype
    bias: torch.Tensor | None = None
    dequantized: torch.Tensor | None = None  # qweight * scales in the activation dtype (calls with many rows)

    @property
    def in_features(self) -> int:  # type: ignore[override]
        return self.qweight.shape[1]

    @property
    def out_features(self) -> int:  # type: ignore[override]
        return self.qweight.shape[0]

    @property
    def nbytes(self) -> int:  # type: ignore[override]
        return self.qweight.nbytes + self.scales.nbytes + (self.bias.nbytes if self.bias is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dequantized is not None and x.shape[0] > QUANT_KERNEL_MAX_ROWS:
            return F.linear(x, self.dequantized, self.bias)
        y = torch._weight_int8pack_mm(x, self.qweight, self.scales)
        return y if self.bias is None else y + self.bias

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        scales = scales.to(weight.dtype).contiguous()
        dequantized = (q.float() * scales.float()[:, None]).to(weight.dtype).contiguous()
        return cls(q, scales, bias, dequantized)


@dataclass(frozen=True, eq=False)
class Int4Linear(Linear):
    packed: torch.Tensor            # `torch._convert_weight_to_int4pack_for_cpu` layout
    scales_and_zeros: torch.Tensor  # [in / group, out, 2], activation dtype
    in_dim: int
    out_dim: int
    bias: torch.Tensor | None = None
    group_size: int = INT4_GROUP_SIZE
    dequantized: torch.Tensor | None = None  # the int4 weights in the activation dtype (calls with many rows)

    @property
    def in_features(self) -> int:  # type: ignore[override]
        return self.in_dim

    @property
    def out_features(self) -> int:  # type: ignore[override]
        return self.out_dim

    @property
    def nbytes(self) -> int:  # type: ignore[override]
        return self.packed.nbytes + self.scales_and_zeros.nbytes + (self.bias.nbytes if self.bias is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dequantized is not None and x.shape[0] > QUANT_KERNEL_MAX_ROWS:
            return F.linear(x, self.dequantized, self.bias)
        y = torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                 group_size: int = INT4_GROUP_SIZE) -> Int4Linear:
        """Asymmetric 4-bit per group of ``group_size`` input features: w ~ (q - 8) * scale + zero, q in [0, 15]."""
        out_dim, in_dim = weight.shape
        if in_dim % group_size:
            raise ValueError(f"int4 needs in_features divisible by {group_size}, got {in_dim}")
        w = weight.detach().float().reshape(out_dim, in_dim // group_size, group_size)
        lo, hi = w.amin(dim=2), w.amax(dim=2)
        scales = ((hi - lo) / 15.0).clamp(min=1e-6)
        zeros = lo + scales * 8.0
        q = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
        packed = torch._convert_weight_to_int4pack_for_cpu(q.reshape(out_dim, in_dim).contiguous(), 1)
        sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(weight.dtype)
        s_q, z_q = sz[..., 0].float().t()[..., None], sz[..., 1].float().t()[..., None]  # [out, groups, 1]
        dequantized = ((q.float() - 8.0) * s_q + z_q).reshape(out_dim, in_dim).to(weight.dtype).contiguous()
        return cls(packed, sz, in_dim, out_dim, bias, group_size, dequantized)


def _probe(fmt: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """None when the ``fmt`` kernel runs here for ``dtype`` activations, else why not."""
    if fmt == "bf16":
        return None
    if device.type != "cpu":
        return f"weights={fmt!r} uses PyTorch's CPU weight-only kernels; the model is on {device.type}"
    try:
        w = torch.randn(64, 64, dtype=dtype)
        lin = Int8Linear.quantize(w, None) if fmt == "int8" else Int4Linear.quantize(w, None)
        ref = F.linear(torch.ones(2, 64, dtype=dtype), w).float()
        err = (lin(torch.ones(2, 64, dtype=dtype)).float() - ref).abs().max().item()
        if not err < 0.25 * ref.abs().max().item() + 1e-3:
            return f"the {fmt} kernel returned wrong values (max error {err:.3g})"
        slowdown = _quantized_slowdown(fmt, dtype)
    except (RuntimeError, NotImplementedError, AttributeError, ValueError) as exc:
        return f"the {fmt} kernel is unavailable in this torch build: {str(exc).splitlines()[0][:160]}"
    if slowdown > QUANT_MAX_SLOWDOWN:
        return (f"its kernel runs {slowdown:.0f}x slower than the dense {str(dtype).replace('torch.', '')} GEMM on "
                f"this CPU (PyTorch has no fast path for these activations here; bf16 activations on a CPU with "
                f"native bf16 have one)")
    return None


def _quantized_slowdown(fmt: str, dtype: torch.dtype, rows: int = 8, size: int = 1024) -> float:
    """Seconds of the ``fmt`` kernel over seconds of the dense GEMM, best of 3 each, at ``rows`` rows (a decode
    batch) of a ``size``-square weight. Measured at start-up because the answer depends on the CPU and the
    activation dtype: PyTorch's weight-only kernels can be far slower than dense float32 with float32 activations,
    and faster than dense with bf16 ones (see docs/measurements-history.md#figures-moved-from-code-comments)."""
    w = torch.randn(size, size, dtype=dtype)
    x = torch.randn(rows, size, dtype=dtype)
    quantized = Int8Linear.quantize(w, None) if fmt == "int8" else Int4Linear.quantize(w, None)

    def best(f: Callable[[], torch.Tensor]) -> float:
        f()  # the first call pays one-time set-up
        return min(timeit.repeat(f, number=1, repeat=3))

    return best(lambda: quantized(x)) / max(best(lambda: F.linear(x, w)), 1e-9)


def resolve_weight_format(fmt: str, dtype: torch.dtype, device: torch.device) -> str:
    """The format to run: ``fmt`` when its kernel works here, else "bf16" with one warning saying why."""
    if fmt not in WEIGHT_FORMATS:
        raise ConfigError(f"weights must be one of {list(WEIGHT_FORMATS)}, got {fmt!r}")
    why = _probe(fmt, dtype, device)
    if why is None:
        return fmt
    log.warning("weights=%r is not available (%s); running the model's own %s weights instead", fmt, why,
                str(dtype).replace("torch.", ""))
    return "bf16"


def make_linear(fmt: str, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                pack_rows: tuple[int, ...] = (), shared_rows: tuple[int, ...] = (),
                small_rows: tuple[int, ...] = ()) -> Linear:
    """A `Linear` of ``weight [out, in]`` (+ ``bias``) in format ``fmt`` (see `resolve_weight_format`);
    ``pack_rows``: the fixed row counts calls will have (prefill tile, decode batch), for formats that prepare a
    path per M; ``shared_rows``: more row counts (short prefill tiles) that reuse the largest one's path;
    ``small_rows``: row counts (a decode batch with fewer active rows) that reuse the smallest one's path."""
    if fmt == "bf16":
        return DenseLinear.build(weight, bias, pack_rows, shared_rows, small_rows)
    builders: dict[str, Callable[[torch.Tensor, torch.Tensor | None], Linear]] = {
        "int8": Int8Linear.quantize, "int4": Int4Linear.quantize,
    }
    return builders[fmt](weight, bias)

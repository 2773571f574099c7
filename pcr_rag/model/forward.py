"""The fast step: our own forward pass over a transformers decoder's weights, in fixed shapes.

Two entry points, both on the `KVArena`:
- `FastForward.prefill(row, token_ids, start)`: computes positions [start, start + n) of one request, reading the
  KV of positions < start from its row (cached or computed by an earlier step) and writing the new KV into it.
  `FastForward.prefill_layers` is the same step as a generator, one layer per ``next()``, so the engine can pause
  it between layers (the ITL budget) without changing a number.
- `FastForward.decode(rows, tokens, positions)`: one new token for each of a fixed number of rows.

Why not the transformers forward: its arithmetic depends on how a prompt is split and on who shares a batch.
This step makes a row's numbers depend on the row alone, by construction:

- **Linear layers run in fixed-M GEMMs.** On oneDNN (bf16, AMX) and MKL (fp32) a row's output changes with the
  number of rows M (e.g. a bf16 576x576 GEMM's rows differ between M=57 and M=2000), but for a fixed M it depends
  neither on the row's position in the batch nor on the other rows. So prefill rows always go through GEMMs of
  exactly `PREFILL_TILE_ROWS` rows (the last tile padded), and decode rows through one GEMM of ``batch_rows`` rows
  (padding rows when fewer are active). Norms and activations run on the same fixed tiles.
- **Fewer decode rows where proven exact.** A decode step with k active rows runs as 1, 2, 4, ... rows (the
  smallest that holds k) where a start-up probe proved every linear, the LM head and the row pieces give the same
  rows at that count as at ``batch_rows`` (`_exact_decode_sizes`; on oneDNN-prepacked float32 on AVX2 every such
  count matches, while MKL's M=1 GEMV path does not). A lone request then streams the weights once for one row,
  not for eight, so it runs closer to the memory roofline than the full-batch step, with the same tokens (see
  docs/measurements-history.md#figures-moved-from-code-comments).
- **Short tiles where they are proven exact.** A step's last rows (a cache hit's question, say) need not pay a whole
  tile: a remainder of up to 248 rows runs as one tile of 16, 24, ..., 248 rows (`SHORT_TILE_ROWS` multiples; not
  a decode step's row count - 8 for the default batch, 1, 2 or 4 with fewer rows active - whose calls must never
  be padded). Each linear layer runs such a tile as it is only if `tile_probe.exact_row_counts` proved, at
  start-up, that its rows at that M are bit-identical to its rows in a full tile; otherwise that layer pads the
  short tile to a full one (`weights.PaddedRows`) - or, where that makes more sizes exact, runs its full tiles as
  two half-tile calls instead (`tile_probe.fit_to_tiles`: for a layer whose rows at no short M equal its
  full-tile rows but agree with each other at every half-tile M). Which sizes match depends on the backend, dtype and CPU, hence the probe at start-up (see
  docs/measurements-history.md#figures-moved-from-code-comments). A size is kept only where it costs
  less than every larger size kept (`cheapest_short_tiles`: a linear padding it to a full tile can make it
  dearer), so the smallest size that holds a remainder is also the cheapest. Rows are the same whichever tile
  computes them. Split shapes change the numbers of full tiles, so they are named in `plan_id`.
- **Prefill attention runs in query blocks aligned to absolute positions.** Block b covers queries
  [b*A, (b+1)*A) (A = `ATTENTION_BLOCK`) over keys [window start, (b+1)*A) with an explicit mask; queries of the
  block that this step does not compute are zero rows. The call for a block is the same whatever was cached, so
  where a prefill step starts or ends never changes a number (split invariance: cached == uncached, bit for bit).
  A step that needs only some of a block's rows computes the span of aligned slices that holds them, with the
  finest slice among `ATTENTION_SUB_BLOCK`, twice that, ... for which `attention_probe.sub_blocks_exact` proved at
  start-up that every such span's rows equal the whole block's, bit for bit; otherwise the whole block. A short
  step (a hit's question) then computes a few query rows instead of a whole block; PyTorch's CPU flash kernel works
  through queries in blocks of its own, and the probe checks its rows come out the same at every span (see
  docs/measurements-history.md#figures-moved-from-code-comments).
- **Decode attention is per row** over that row's own KV (PyTorch's fused CPU/CUDA SDPA kernel, fp32 accumulation;
  on the CPU on float32 copies of the row's q, K and V, which the kernel runs several times faster at one query).

So reuse never changes an answer and a request's tokens do not depend on its batch company. The numbers do depend
on the tile sizes and the weight format: `FastForward.plan_id` names them and is part of the chunk keys' root.
Supported architectures: Llama, Mistral, Qwen2, Qwen3 and Gemma 3 (text; sliding-window layers honoured).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from pcr_rag.errors import PCRError
from pcr_rag.model.attention_probe import sub_blocks_exact
from pcr_rag.model.kernel_probe import probe_token_ids
from pcr_rag.model.kv_arena import KVArena, RowKV
from pcr_rag.model.model import LoadedModel
from pcr_rag.model.rope_shift import RopeShift
from pcr_rag.model.tile_probe import LinearMaker, exact_row_counts, fit_to_tiles
from pcr_rag.model.weights import Linear, PaddedRows, make_linear

log = logging.getLogger(__name__)

PREFILL_TILE_ROWS = 256  # rows per prefill GEMM (fixed M); see the module docstring
SHORT_TILE_ROWS = 8      # short prefill tiles have multiples of this many rows, below PREFILL_TILE_ROWS
ATTENTION_BLOCK = 128    # query rows per prefill attention block, aligned to absolute positions
ATTENTION_SUB_BLOCK = 8  # finest query rows per slice of a block a short step computes, where proven exact
FORWARD_VERSION = "pcr-forward-v1"
WARM_UP_ROW = 0  # the arena row `FastForward.warm_up` computes on (free while the engine starts)
_MASK_CACHE_ENTRIES = 256  # attention-block masks kept (full layers need one per block index)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


@dataclass(frozen=True)
class WarmUp:
    """What `FastForward.warm_up` took and measured, in seconds: ``seconds`` in all; one prefill step of
    ``prefill_tokens`` (``prefill_s``) and one full decode step (``decode_s``), timed after the first calls had paid
    their one-time costs (None when the arena holds no tile)."""

    seconds: float
    prefill_tokens: int
    prefill_s: float | None
    decode_s: float | None


class UnsupportedArchitectureError(PCRError, ValueError):
    """The model's architecture has no fast forward (see `SUPPORTED_MODEL_TYPES`)."""


class LayerHooks(Protocol):
    """Called on the compute thread once per layer of a prefill step, in layer order."""

    def before_attention(self, layer: int) -> None:
        """Layer ``layer``'s KV of positions < start must be in the row when this returns (layer-wise loads)."""

    def after_layer(self, layer: int, start: int, end: int) -> None:
        """Layer ``layer``'s KV of positions [start, end) was just written (layer-wise offload)."""


@dataclass(frozen=True, eq=False)
class RMSNorm:
    """The model's RMSNorm with PyTorch's fused kernel, bit-identical to the transformers modules: Llama style
    ``weight * norm(x).to(dtype)`` (``offset_weight`` None), or Gemma style ``(norm(x) * (1 + weight)).to(dtype)``
    computed in float32 (``offset_weight`` = 1 + weight, float32)."""

    weight: torch.Tensor | None
    offset_weight: torch.Tensor | None
    eps: float

    @classmethod
    def of(cls, module: Any, gemma: bool) -> RMSNorm:
        eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
        w = module.weight.detach()
        return cls(None, 1.0 + w.float(), eps) if gemma else cls(w, None, eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if self.weight is not None and x.dtype == torch.float32 == self.weight.dtype:
            # one call, the same bits: float32 in and out, the weight applied last in both; the fused call is the
            # cheaper one and runs on every norm of every step (see docs/measurements-history.md)
            return F.rms_norm(x, shape, self.weight, self.eps)
        if self.offset_weight is not None:
            return F.rms_norm(x.float(), shape, self.offset_weight, self.eps).to(x.dtype)
        return F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype) * self.weight


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One decoder layer: fused projections, norms, activation, attention window and rotary table."""

    qkv: Linear            # [q | k | v] outputs
    o: Linear
    gate_up: Linear        # [gate | up] outputs
    down: Linear
    input_norm: RMSNorm
    post_attn_norm: RMSNorm          # Llama/Qwen: before the MLP; Gemma 3: on the attention output
    pre_ff_norm: RMSNorm | None      # Gemma 3 only
    post_ff_norm: RMSNorm | None     # Gemma 3 only
    q_norm: RMSNorm | None           # Qwen3 / Gemma 3 per-head norms
    k_norm: RMSNorm | None
    act: Any
    window: int | None     # sliding window (keys q - window < k <= q), None for full attention
    rope: str              # which rotary table this layer uses


def _text_model(model: Any) -> Any:
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers"):
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} has no decoder stack at .model.layers; the fast forward supports causal LMs of "
            f"types {SUPPORTED_MODEL_TYPES}")
    return base


def _fuse(mods: Sequence[Any], fmt: str, pack_rows: tuple[int, ...], shared_rows: tuple[int, ...],
          small_rows: tuple[int, ...]) -> Linear:
    """One `Linear` over the concatenated outputs of ``mods``. Dense: the modules' weights become views of the
    fused tensor (no second copy of the weights)."""
    weight = torch.cat([m.weight.detach() for m in mods]).contiguous()
    biases = [m.bias for m in mods]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else torch.zeros(m.weight.shape[0], dtype=weight.dtype,
                                                                        device=weight.device)
                          for m, b in zip(mods, biases)]).contiguous()
    if fmt == "bf16":
        offset = 0
        for m in mods:
            rows = m.weight.shape[0]
            m.weight.data = weight[offset: offset + rows]
            offset += rows
    return make_linear(fmt, weight, bias, pack_rows=pack_rows, shared_rows=shared_rows, small_rows=small_rows)


class FastForward:
    """The model's forward in fixed shapes (see the module docstring). One instance per engine; not thread-safe
    (the engine's executor thread is its only caller)."""

    def __init__(self, loaded: LoadedModel, *, weights: str = "bf16", batch_rows: int = 8,
                 max_positions: int | None = None, tile_rows: int = PREFILL_TILE_ROWS,
                 attention_block: int = ATTENTION_BLOCK, prepack: bool = True, compile: bool = False,
                 short_tile_rows: int | None = SHORT_TILE_ROWS,
                 attention_sub_block: int | None = ATTENTION_SUB_BLOCK) -> None:
        model = loaded.model
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"model type {config.model_type!r} has no fast forward; supported: {list(SUPPORTED_MODEL_TYPES)}")
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise UnsupportedArchitectureError("attention logit soft-capping (Gemma 2) is not supported")
        self.loaded = loaded
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.weights = weights
        self.batch_rows = batch_rows
        self.tile_rows = tile_rows
        self.attention_block = attention_block
        base = _text_model(model)
        # the fixed row counts (decode batch, prefill tile), for weight formats that prepack per M (compiled row
        # pieces trace plain linears instead)
        packed_rows = (batch_rows, tile_rows) if prepack and not compile else ()
        # decode row counts below the batch (for steps with fewer active rows), used where proven exact
        decode_candidates = () if compile else tuple(m for m in _powers_of_two_below(batch_rows) if m != tile_rows)
        # short tile sizes to consider (none when compiled: inductor may pick its GEMM per M); never a decode row
        # count, whose calls must not be padded (a linear may pad a short tile size to a full prefill tile)
        short = short_tile_rows if short_tile_rows and not compile else None
        decode_counts = {batch_rows, *decode_candidates}
        candidates = tuple(m for m in range(short, tile_rows, short) if m not in decode_counts) if short else ()

        def make(w: torch.Tensor, b: torch.Tensor | None) -> Linear:
            return make_linear(weights, w, b, pack_rows=packed_rows, shared_rows=candidates,
                               small_rows=decode_candidates)

        kind = f"{weights};packed={packed_rows};small={decode_candidates}"

        def fit(linear: Linear) -> Linear:
            return fit_to_tiles(linear, make, tile=tile_rows, candidates=candidates, dtype=self.dtype,
                                device=self.device, kind=kind)

        self._embed = base.embed_tokens
        self._final_norm = RMSNorm.of(base.norm, config.model_type == "gemma3_text")
        head_rows = (batch_rows,) if packed_rows else ()

        def make_head(w: torch.Tensor, b: torch.Tensor | None) -> Linear:  # M=1: a prefill step's logits
            return make_linear(weights, w, b, pack_rows=head_rows, shared_rows=(1,) if packed_rows else (),
                               small_rows=decode_candidates)

        self._lm_head = make_head(model.lm_head.weight.detach(),
                                  None if model.lm_head.bias is None else model.lm_head.bias.detach())
        self._softcap = getattr(config, "final_logit_softcapping", None)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = loaded.kv.num_kv_heads
        self.head_dim = loaded.kv.head_dim
        gemma = config.model_type == "gemma3_text"

        def norm(module: Any) -> RMSNorm:
            return RMSNorm.of(module, gemma)

        layers = []
        for i, layer in enumerate(base.layers):
            attn, mlp = layer.self_attn, layer.mlp
            window = getattr(attn, "sliding_window", None)
            if config.model_type == "mistral":
                window = getattr(config, "sliding_window", None)
            layer_type = (getattr(config, "layer_types", None) or ["full_attention"] * len(base.layers))[i]
            layers.append(LayerWeights(
                qkv=fit(_fuse([attn.q_proj, attn.k_proj, attn.v_proj], weights, packed_rows, candidates,
                              decode_candidates)),
                o=fit(make(attn.o_proj.weight.detach(),
                           None if attn.o_proj.bias is None else attn.o_proj.bias.detach())),
                gate_up=fit(_fuse([mlp.gate_proj, mlp.up_proj], weights, packed_rows, candidates,
                                  decode_candidates)),
                down=fit(make(mlp.down_proj.weight.detach(), None)),
                input_norm=norm(layer.input_layernorm), post_attn_norm=norm(layer.post_attention_layernorm),
                pre_ff_norm=norm(layer.pre_feedforward_layernorm) if gemma else None,
                post_ff_norm=norm(layer.post_feedforward_layernorm) if gemma else None,
                q_norm=norm(attn.q_norm) if hasattr(attn, "q_norm") else None,
                k_norm=norm(attn.k_norm) if hasattr(attn, "k_norm") else None,
                act=mlp.act_fn, window=int(window) if window else None,
                rope=layer_type if gemma else "default",
            ))
        self.layers = tuple(layers)
        self.scale = float(base.layers[0].self_attn.scaling)
        self.max_positions = int(max_positions or loaded.context_window)
        # one-query attention in float32 on the CPU: PyTorch's CPU flash kernel pays a per-call set-up on bf16
        # inputs on some CPUs that float32 inputs do not, and none for long query blocks (see
        # docs/measurements-history.md#figures-moved-from-code-comments)
        self._decode_attention_fp32 = self.device.type == "cpu" and self.dtype != torch.float32
        self.compiled = compile
        if compile:
            self._compile_row_pieces()
        self._masks: dict[tuple, torch.Tensor] = {}
        self._cos, self._sin = self._rope_tables(base.rotary_emb, {lw.rope for lw in self.layers}, gemma)
        self.rope_shift = RopeShift(base.rotary_emb, per_kind=gemma, device=self.device)  # blend's placement
        self.short_tile_sizes = self._useful_short_tiles(candidates)
        self.decode_sizes = self._exact_decode_sizes(decode_candidates, make, make_head, kind)
        self.attention_sub_block = self._exact_sub_block(attention_sub_block)

    # --------------------------------------------------------------------------------------------- identity
    @property
    def plan_id(self) -> str:
        """Names everything that fixes this step's numbers besides the model: part of the chunk keys' root."""
        compiled = ";compiled" if self.compiled else ""
        shapes = sorted({f"{lin.in_features}x{lin.out_features}" for lin in self._linears()
                         if isinstance(lin, PaddedRows) and lin.split})
        split = f";split={','.join(shapes)}" if shapes else ""
        gemm = ";gemm=prepacked" if any(lin.prepacked for lin in self._linears()) else ""
        return (f"{FORWARD_VERSION};tile={self.tile_rows};block={self.attention_block};weights={self.weights}"
                f"{compiled}{gemm}{split}")

    def _linears(self) -> list[Linear]:
        return [lin for lw in self.layers for lin in (lw.qkv, lw.o, lw.gate_up, lw.down)]

    @torch.inference_mode()
    def _useful_short_tiles(self, candidates: tuple[int, ...]) -> tuple[int, ...]:
        """The short tile sizes worth using: some linear runs them unpadded, both row pieces of the first layer
        (norms, rotary, activation included) give bit-identical rows at that size and in a full tile, and the
        size's GEMMs cost less than those of every larger size kept (`cheapest_short_tiles`)."""
        tile = self.tile_rows
        linears = self._linears()
        unpadded = [m for m in candidates
                    if not all(isinstance(lin, PaddedRows) and m in lin.padded_rows for lin in linears)]
        exact = self._row_pieces_exact(tile, unpadded, logits=False)
        useful = [m for m in unpadded if m in exact]
        for m in sorted(set(unpadded) - exact):
            log.info("no %d-row prefill tiles: the row pieces differ from a full tile's", m)

        def gemm_cost(m: int) -> int:  # multiply-adds of one m-row tile through every linear (padded ones: a tile)
            return sum(lin.in_features * lin.out_features
                       * (tile if isinstance(lin, PaddedRows) and m in lin.padded_rows else m) for lin in linears)

        kept = cheapest_short_tiles(useful, gemm_cost, gemm_cost(tile))
        if len(kept) < len(useful):
            log.info("short prefill tiles %s: %s cost more than a larger size (padded linears)", kept,
                     sorted(set(useful) - set(kept)))
        return kept

    @torch.inference_mode()
    def _exact_decode_sizes(self, candidates: tuple[int, ...], make: LinearMaker, make_head: LinearMaker,
                            kind: str) -> tuple[int, ...]:
        """The row counts among ``candidates`` (< ``batch_rows``) at which a decode step computes every row bit
        for bit as a step of ``batch_rows`` rows does: every linear shape, LM head included, on `tile_probe`'s
        order-exposing inputs, and the first layer's row pieces (norms, rotary, activation) and the final norm on
        random rows. A step with k active rows runs at the smallest of these that holds k (see `decode`)."""
        if not candidates:
            return ()
        m_full = self.batch_rows
        found = set(candidates)
        inner = [lin.inner if isinstance(lin, PaddedRows) else lin for lin in self._linears()]  # bias as built
        shapes = {(lin.in_features, lin.out_features, getattr(lin, "bias", None) is not None) for lin in inner}
        for in_f, out_f, bias in sorted(shapes):
            found &= exact_row_counts(make, in_f, out_f, bias=bias, tile=m_full, candidates=candidates,
                                      dtype=self.dtype, device=self.device, kind=f"decode;{kind}")
        head = self._lm_head
        found &= exact_row_counts(make_head, head.in_features, head.out_features,
                                  bias=getattr(head, "bias", None) is not None, tile=m_full, candidates=candidates,
                                  dtype=self.dtype, device=self.device, kind=f"decode-head;{kind}")
        if found:
            found &= self._row_pieces_exact(m_full, sorted(found), logits=True)
        sizes = tuple(sorted(found))
        log.info("decode steps run %s rows when fewer than %d are active (proven exact; not: %s)",
                 list(sizes) or "no fewer", m_full, sorted(set(candidates) - found) or "none")
        return sizes

    def _row_pieces_exact(self, full_rows: int, sizes: Sequence[int], *, logits: bool) -> set[int]:
        """The ``sizes`` at which the first layer's row pieces (norms, projections, rotary, activation) - and,
        with ``logits``, the final norm and LM head - compute the first m of ``full_rows`` random rows bit for bit
        as one call over all ``full_rows`` does."""
        lw = self.layers[0]
        g = torch.Generator().manual_seed(0)
        x = torch.randn(full_rows, self._embed.weight.shape[1], generator=g).to(device=self.device,
                                                                               dtype=self.dtype)
        attn = torch.randn(full_rows, self.num_heads * self.head_dim, generator=g).to(device=self.device,
                                                                                     dtype=self.dtype)
        pos = torch.arange(full_rows, device=self.device) % self.max_positions
        cos, sin = self._cos[lw.rope][pos], self._sin[lw.rope][pos]
        full_qkv, full_mlp = self._qkv(lw, x, cos, sin), self._mlp_block(lw, x, attn)
        full_logits = self._logits(x) if logits else None
        exact = set()
        for m in sizes:
            xm = x[:m].contiguous()
            if (all(torch.equal(a[:m], b) for a, b in zip(full_qkv, self._qkv(lw, xm, cos[:m], sin[:m])))
                    and torch.equal(full_mlp[:m], self._mlp_block(lw, xm, attn[:m].contiguous()))
                    and (full_logits is None or torch.equal(full_logits[:m], self._logits(xm)))):
                exact.add(m)
        return exact

    def decode_rows_for(self, active: int) -> int:
        """Rows of the GEMMs of a decode step with ``active`` active rows: the smallest proven-exact size that
        holds them (`decode_sizes`), else ``batch_rows``."""
        return next((m for m in self.decode_sizes if m >= active), self.batch_rows)

    def _exact_sub_block(self, sub_block: int | None) -> int | None:
        """The finest of ``sub_block``, twice that, ... (below the block, dividing it) whose aligned spans give a
        block's rows bit for bit (see `attention_probe`), else None (short steps compute whole blocks)."""
        block = self.attention_block
        if not sub_block:
            return None

        def attend(q, rows, index, k, v, window):
            bs = index * block
            ks = 0 if window is None else max(0, bs - window + 1)
            return self._attend(q, rows, bs, k[:, :, ks: bs + block], v[:, :, ks: bs + block], ks, window)

        windows = tuple(sorted({lw.window for lw in self.layers}, key=lambda w: -1 if w is None else w))
        size = sub_block
        while size < block:
            if block % size == 0:
                with torch.inference_mode():
                    if sub_blocks_exact(attend, block=block, sub_block=size, heads=self.num_heads,
                                        kv_heads=self.num_kv_heads, head_dim=self.head_dim, windows=windows,
                                        dtype=self.dtype, device=self.device):
                        return size
                log.info("prefill attention: %d-row slices of a %d-query block differ here", size, block)
            size *= 2
        log.info("prefill attention computes whole %d-query blocks", block)
        return None

    def tile_sizes(self, n: int) -> tuple[int, ...]:
        """Rows per GEMM tile for a step of ``n`` positions (see `plan_tiles`)."""
        return plan_tiles(n, self.tile_rows, self.short_tile_sizes)

    def _compile_row_pieces(self) -> None:
        """`torch.compile` the per-row pieces (norms, projections, rotary, MLP) with static shapes: one graph per
        piece and row count (the prefill tile and the decode batch), shared by every layer - the weights are
        graph inputs, so no recompiles per layer or per request. Attention stays eager (its lengths vary)."""
        self._qkv = torch.compile(self._qkv, dynamic=False)
        self._mlp_block = torch.compile(self._mlp_block, dynamic=False)
        self._compile_logged: set[str] = set()

    def _log_first_call(self, what: str, started: float) -> None:
        if self.compiled and what not in self._compile_logged:
            self._compile_logged.add(what)
            log.info("torch.compile: first %s step took %.1f s (compiling the row pieces)", what,
                     time.perf_counter() - started)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (every linear layer and the LM head)."""
        return sum(lin.nbytes for lin in [self._lm_head, *self._linears()])

    def new_arena(self, rows: int, row_capacity: int) -> KVArena:
        """An arena whose rows fit this step: capacity rounded up to whole attention blocks."""
        block = self.attention_block
        capacity = -(-row_capacity // block) * block
        return KVArena(self.loaded.kv, rows, capacity, self.device)

    @torch.inference_mode()
    def warm_up(self, arena: KVArena) -> WarmUp:
        """One prefill tile and one decode step per decode row count on ``arena``'s row `WARM_UP_ROW`, so that
        one-time costs (oneDNN kernel generation and weight reorders per shape, first-touch allocations, ``compile``'s
        graphs) are paid here and not by the first request; then the tile and a full decode step once more, timed,
        so the engine knows its speed before its first request (the ITL budget, the aging rate). Changes no number
        of any later call. The tile is the kernel probe's first step (`pcr_rag.model.kernel_probe`): after the
        warm-up, positions [0, ``prefill_tokens``) of the row hold its KV (decode padding rows write the scratch row,
        never this one)."""
        started = time.perf_counter()
        scratch = arena.row(WARM_UP_ROW)
        n = min(self.tile_rows, arena.row_capacity - 1, self.max_positions - 1)
        if n < 1:
            return WarmUp(time.perf_counter() - started, 0, None, None)
        # the kernel probe's tokens: the row then holds the probe's first step (`kernel_identity`)
        tokens = probe_token_ids(int(self._embed.weight.shape[0]), n)

        def decode(m: int) -> None:
            self._decode(arena, [WARM_UP_ROW] + [None] * (m - 1), torch.zeros(m, dtype=torch.long),
                         torch.full((m,), n, dtype=torch.long))

        def now() -> float:  # on a GPU, after the queued kernels have run
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return time.perf_counter()

        self.prefill(scratch, tokens, 0)
        for m in (*self.decode_sizes, self.batch_rows):
            decode(m)
        t0 = now()
        self.prefill(scratch, tokens, 0)
        t1 = now()
        decode(self.batch_rows)
        t2 = now()
        return WarmUp(t2 - started, n, t1 - t0, t2 - t1)

    # ---------------------------------------------------------------------------------------------- prefill
    def prefill(self, row: RowKV, token_ids: torch.Tensor, start: int, *, hooks: LayerHooks | None = None,
                want_logits: bool = True, positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """Compute positions [start, start + n) of ``row`` (``token_ids``: n token ids; ``positions``: a blend
        step's scattered positions instead, see `prefill_layers`). Positions < start must be in the row (or arrive
        before each layer's attention, see `LayerHooks`). Returns the last position's logits ``[vocab]`` when
        ``want_logits``."""
        return run_layers(self.prefill_layers(row, token_ids, start, hooks=hooks, want_logits=want_logits,
                                              positions=positions))[1]

    @torch.inference_mode()
    def prefill_layers(self, row: RowKV, token_ids: torch.Tensor, start: int, *, hooks: LayerHooks | None = None,
                       want_logits: bool = True, positions: torch.Tensor | None = None
                       ) -> Generator[int, None, torch.Tensor | None]:
        """`prefill` one layer at a time: a generator that computes one more layer per ``next()`` - it yields
        the layer's index after every layer but the last, and the last ``next()`` (the one that computes the
        last layer) returns `prefill`'s result through ``StopIteration.value`` (see `run_layers`). So a step
        can pause between layers (the engine's decode steps run in between: `step_budget`) without changing a
        number: the layers, tiles and attention blocks are the ones `prefill` computes. The row's positions
        [start, end) are in flux until it ends; nothing else may write them.

        ``positions`` (blend mode, `pcr_rag.sched.blend`): token i sits at ``positions[i]`` (strictly increasing,
        ``positions[0] == start``) instead of ``start + i``: one step computes several spans with KV placed
        between them, which every query of a later span attends to as causal attention requires (each layer writes
        all the step's keys before its attention). The positions between the spans must hold their KV (placed or
        loaded) before each layer's attention; the step never zero-fills them (positions below the last written
        high-water mark are left alone, and blend zero-fills the whole prompt before placing). Its numbers are not
        those of the spans computed one by one (the tiles differ): blend mode is approximate anyway."""
        n = int(token_ids.shape[0])
        if n < 1:
            raise ValueError("prefill needs at least one token")
        if positions is not None:
            if (positions.shape[0] != n or int(positions[0]) != start
                    or bool((positions[1:] <= positions[:-1]).any())):
                raise ValueError("positions must be strictly increasing, one per token, starting at start")
            if int(positions[-1]) - start + 1 == n:
                positions = None  # contiguous after all: the plain step
        end = start + n if positions is None else int(positions[-1]) + 1
        if end > min(row.arena.row_capacity, self.max_positions):
            raise ValueError(f"positions up to {end} exceed the row capacity {row.arena.row_capacity}")
        started = time.perf_counter()
        block = self.attention_block
        row.ensure_finite(start, -(-end // block) * block)
        sizes = self.tile_sizes(n)
        spans = [(sum(sizes[:t]), sum(sizes[: t + 1])) for t in range(len(sizes))]  # rows of each tile
        padded = spans[-1][1]
        ids = torch.zeros(padded, dtype=torch.long, device=self.device)
        ids[:n] = token_ids.to(self.device)
        pos = torch.full((padded,), end - 1, dtype=torch.long, device=self.device)
        pos[:n] = torch.arange(start, end, device=self.device) if positions is None else positions.to(self.device)
        xs = list(self._embed(ids).split(sizes))  # one [rows, hidden] tensor per tile (no copies between layers)
        first = start // block
        blocks = (end - 1) // block + 1 - first
        offset = start - first * block  # row of position `start` in the block-aligned query buffer
        # scattered steps: each token's row in the block-aligned buffer, and each block's rows to compute
        rows = None if positions is None else pos[:n] - first * block
        needed = (offset, offset + n) if rows is None else _rows_per_block(rows.tolist(), block)
        heads, d = self.num_heads, self.head_dim
        # queries in block-aligned layout: rows of positions this step does not compute stay zero
        qb = torch.zeros(blocks * block, heads, d, dtype=xs[0].dtype, device=self.device)
        out = torch.empty(blocks * block, heads * d, dtype=xs[0].dtype, device=self.device)
        attn_rows = torch.zeros(padded, heads * d, dtype=xs[0].dtype, device=self.device)
        # rotary tables of each tile's positions, gathered once per rope kind (not once per layer)
        rope = {kind: ([c[pos[a:b]] for a, b in spans], [self._sin[kind][pos[a:b]] for a, b in spans])
                for kind, c in self._cos.items()}
        for li, lw in enumerate(self.layers):
            cos, sin = rope[lw.rope]
            for t, x in enumerate(xs):
                t0 = spans[t][0]
                real = min(sizes[t], n - t0)
                q, k, v = self._qkv(lw, x, cos[t], sin[t])
                if rows is None:
                    row.write(li, start + t0, k[:real], v[:real])
                    qb[offset + t0: offset + t0 + real] = q[:real]
                else:
                    row.write_at(li, pos[t0: t0 + real], k[:real], v[:real])
                    qb[rows[t0: t0 + real]] = q[:real]
            if hooks is not None:
                hooks.before_attention(li)
            self._prefill_attention(li, lw, row, qb, out, first, needed)
            if hooks is not None:
                hooks.after_layer(li, start, end)
            attn_rows[:n] = out[offset: offset + n] if rows is None else out[rows]
            xs = [self._mlp_block(lw, x, attn_rows[a:b]) for (a, b), x in zip(spans, xs)]
            if li < len(self.layers) - 1:
                yield li
        self._log_first_call("prefill", started)
        if not want_logits:
            return None
        a = spans[-1][0]  # the last position is in the last tile (tiles are filled in order)
        return self._logits(xs[-1][n - 1 - a: n - a])[0]

    def _prefill_attention(self, li: int, lw: LayerWeights, row: RowKV, qb: torch.Tensor, out: torch.Tensor,
                           first: int, needed: tuple[int, int] | dict[int, tuple[int, int]]) -> None:
        """Attention in whole blocks aligned to absolute positions (see the module docstring): ``qb`` holds the
        queries of blocks first, first + 1, ... (``[blocks * A, heads, D]``); results go to ``out``
        (``[blocks * A, heads * D]``). Of each block, the rows in ``needed`` (buffer rows the step computes; for a
        scattered step, per block index the span of its rows to compute, blocks absent computing nothing) are
        computed: in exact sub-block slices where proven, else with the whole block."""
        block, sub = self.attention_block, self.attention_sub_block
        for j in range(qb.shape[0] // block):
            if isinstance(needed, dict):
                if j not in needed:
                    continue
                span = (needed[j][0] + j * block, needed[j][1] + j * block)
            else:
                span = needed
            bs = (first + j) * block
            be = bs + block
            ks = 0 if lw.window is None else max(0, bs - lw.window + 1)
            a, b = 0, block
            if sub is not None:
                lo, hi = max(span[0] - j * block, 0), min(span[1] - j * block, block)
                a, b = lo // sub * sub, min(block, -(-hi // sub) * sub)
            out[j * block + a: j * block + b] = self._attend(
                qb[j * block: (j + 1) * block], (a, b), bs, row.keys(li, ks, be).unsqueeze(0),
                row.values(li, ks, be).unsqueeze(0), ks, lw.window)

    def _attend(self, q: torch.Tensor, rows: tuple[int, int], bs: int, keys: torch.Tensor, values: torch.Tensor,
                ks: int, window: int | None) -> torch.Tensor:
        """Rows [a, b) of the query block at absolute positions [bs, bs + A) (``q``: the block's ``[A, heads,
        D]`` buffer) over ``keys``/``values`` ``[1, kv_heads, n, D]`` of positions [ks, ks + n), masked causally
        (and by ``window``). Returns ``[b - a, heads * D]``."""
        a, b = rows
        mask = self._mask(bs - ks, keys.shape[2], window, q.dtype)[a:b]
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask,
                                           scale=self.scale, enable_gqa=True)
        return o[0].transpose(0, 1).reshape(b - a, -1)

    def _mask(self, query_offset: int, keys: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask ``[A, keys]`` for queries at key offsets query_offset + i: 0 where key j is visible
        (j <= query and, with a window, query - j < window), -inf elsewhere. Cached: it depends only on these."""
        key = (query_offset, keys, window, dtype)
        mask = self._masks.get(key)
        if mask is None:
            qpos = torch.arange(query_offset, query_offset + self.attention_block, device=self.device)[:, None]
            kpos = torch.arange(keys, device=self.device)[None, :]
            visible = kpos <= qpos
            if window is not None:
                visible &= kpos > qpos - window
            mask = torch.zeros(visible.shape, dtype=dtype, device=self.device).masked_fill_(~visible, float("-inf"))
            if len(self._masks) >= _MASK_CACHE_ENTRIES:
                self._masks.pop(next(iter(self._masks)))
            self._masks[key] = mask
        return mask

    # ----------------------------------------------------------------------------------------------- decode
    @torch.inference_mode()
    def decode(self, arena: KVArena, rows: Sequence[int | None], tokens: torch.Tensor,
               positions: torch.Tensor, *, fixed_rows: bool = False) -> torch.Tensor:
        """One token per row: ``rows[i]`` is an arena row or None (a padding row); ``tokens[i]`` sits at
        ``positions[i]`` (its KV is written there). ``len(rows) == batch_rows`` always (fixed shapes).
        Returns logits ``[batch_rows, vocab]`` (padding rows' logits are meaningless).

        With k < ``batch_rows`` active rows the step runs as ``decode_rows_for(k)`` rows (the active ones first,
        then padding): a row count proven at start-up to give every row's numbers bit for bit as ``batch_rows``
        rows do, so the tokens still do not depend on the batch company - only the padding work does.
        ``fixed_rows`` runs all ``batch_rows`` rows whatever is active (the same numbers; the kernel bench's
        reference for what fewer rows save)."""
        if len(rows) != self.batch_rows:
            raise ValueError(f"decode takes exactly {self.batch_rows} rows (padding rows are None), got {len(rows)}")
        active = [i for i, r in enumerate(rows) if r is not None]
        m = self.batch_rows if fixed_rows else self.decode_rows_for(len(active))
        if m == self.batch_rows:
            return self._decode(arena, rows, tokens, positions)
        idx = torch.tensor(active, dtype=torch.long)
        sub_tokens = torch.zeros(m, dtype=torch.long)
        sub_positions = torch.zeros(m, dtype=torch.long)
        sub_tokens[: len(active)] = tokens.cpu()[idx]
        sub_positions[: len(active)] = positions.cpu()[idx]
        sub = self._decode(arena, [rows[i] for i in active] + [None] * (m - len(active)), sub_tokens, sub_positions)
        logits = sub.new_zeros(self.batch_rows, sub.shape[1])
        logits[idx.to(sub.device)] = sub[: len(active)]
        return logits

    def _decode(self, arena: KVArena, rows: Sequence[int | None], tokens: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        """`decode` over exactly ``len(rows)`` rows (``batch_rows`` or one of ``decode_sizes``)."""
        started = time.perf_counter()
        m = len(rows)
        scratch = arena.scratch_row
        row_idx = torch.tensor([scratch if r is None else r for r in rows], dtype=torch.long, device=self.device)
        pos = positions.to(self.device).clone()
        active = [(i, r, int(p)) for i, (r, p) in enumerate(zip(rows, positions.tolist())) if r is not None]
        for i, r in enumerate(rows):
            if r is None:
                pos[i] = 0
        x = self._embed(tokens.to(self.device))
        rope = {kind: (c[pos], self._sin[kind][pos]) for kind, c in self._cos.items()}  # once per step
        # attention outputs, reused by every layer: active rows are overwritten, padding rows stay zero
        attn = torch.zeros(m, self.num_heads * self.head_dim, dtype=x.dtype, device=x.device)
        for li, lw in enumerate(self.layers):
            q, k, v = self._qkv(lw, x, *rope[lw.rope])
            arena.k[li][row_idx, :, pos] = k
            arena.v[li][row_idx, :, pos] = v
            kl, vl = arena.k[li], arena.v[li]
            for i, r, p in active:
                lo = 0 if lw.window is None else max(0, p - lw.window + 1)
                qi = q[i].view(1, self.num_heads, 1, self.head_dim)
                ki, vi = kl[r: r + 1, :, lo: p + 1], vl[r: r + 1, :, lo: p + 1]
                if self._decode_attention_fp32:
                    qi, ki, vi = qi.float(), ki.float(), vi.float()
                o = F.scaled_dot_product_attention(qi, ki, vi, scale=self.scale, enable_gqa=True)
                attn[i] = o.view(-1)  # back to the model dtype
            x = self._mlp_block(lw, x, attn)
        logits = self._logits(x)
        self._log_first_call("decode", started)
        return logits

    # ------------------------------------------------------------------------------------------ row pieces
    def _qkv(self, lw: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rows ``x [M, hidden]`` -> rotated q ``[M, heads, D]``, k and v ``[M, kv_heads, D]``."""
        m, d = x.shape[0], self.head_dim
        qkv = lw.qkv(lw.input_norm(x))
        nq, nk = self.num_heads * d, self.num_kv_heads * d
        v = qkv[:, nq + nk:].view(m, self.num_kv_heads, d)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if lw.q_norm is None:  # rotate q and k in one go: they are adjacent in the fused output
            qk = qkv[:, : nq + nk].view(m, self.num_heads + self.num_kv_heads, d)
            qk = qk * cos + _swap_halves(qk) * sin
            return qk[:, : self.num_heads], qk[:, self.num_heads:], v
        q = lw.q_norm(qkv[:, :nq].view(m, self.num_heads, d))
        k = lw.k_norm(qkv[:, nq: nq + nk].view(m, self.num_kv_heads, d))
        return q * cos + _swap_halves(q) * sin, k * cos + _swap_halves(k) * sin, v

    def _mlp_block(self, lw: LayerWeights, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Rows after attention: output projection, residual, MLP, residual."""
        o = lw.o(attn)
        if lw.pre_ff_norm is not None:  # Gemma 3 sandwich norms
            x = x + lw.post_attn_norm(o)
            h = lw.pre_ff_norm(x)
        else:
            x = x + o
            h = lw.post_attn_norm(x)
        gate, up = lw.gate_up(h).chunk(2, dim=-1)
        d = lw.down(lw.act(gate) * up)
        if lw.post_ff_norm is not None:
            d = lw.post_ff_norm(d)
        return x + d

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self._lm_head(self._final_norm(x))
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def _rope_tables(self, rotary: Any, kinds: set[str], gemma: bool):
        """cos and *signed* sin ``[max_positions, head_dim]`` per rotary kind, computed by the model's own rotary
        module; the signed sin is ``[-sin1, sin2]`` for ``sin = [sin1, sin2]`` (see `_swap_halves`)."""
        positions = torch.arange(self.max_positions, device=self.device).unsqueeze(0)
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = {}, {}
        with torch.inference_mode():
            for kind in kinds:
                c, s = rotary(probe, positions, kind) if gemma else rotary(probe, positions)
                half = s.shape[-1] // 2
                cos[kind], sin[kind] = c[0].contiguous(), torch.cat((-s[0, :, :half], s[0, :, half:]), -1)
        return cos, sin


def run_layers(layers: Generator[int, None, torch.Tensor | None], count: int | None = None
               ) -> tuple[bool, torch.Tensor | None]:
    """Advance a `FastForward.prefill_layers` generator by ``count`` layers (None: to its end). Returns (whether
    the step is complete, its result once complete)."""
    done = 0
    while count is None or done < count:
        try:
            next(layers)
        except StopIteration as stop:
            return True, stop.value
        done += 1
    return False, None


def plan_tiles(n: int, tile: int, short_sizes: Sequence[int] = ()) -> tuple[int, ...]:
    """Rows per GEMM tile for ``n`` rows: ``n // tile`` full tiles, then the remainder in the smallest of
    ``short_sizes`` that holds it, else in one more (padded) full tile. Sums to at least ``n``."""
    full, rest = divmod(n, tile)
    sizes = [tile] * full
    if rest:
        sizes.append(min((m for m in short_sizes if m >= rest), default=tile))
    return tuple(sizes)


def cheapest_short_tiles(sizes: Sequence[int], cost: Callable[[int], float], full_cost: float) -> tuple[int, ...]:
    """The ``sizes`` that cost less than every larger size kept and than a full tile (``full_cost``), ascending.
    Invariant of the result: cost rises with size, so `plan_tiles`' choice for a remainder - the smallest kept size
    that holds it - is also the cheapest. (A small size can cost more than a larger one where some linear pads it
    to a full tile and not the larger size.)"""
    kept: list[int] = []
    best = full_cost
    for m in sorted(sizes, reverse=True):
        c = cost(m)
        if c < best:
            kept.append(m)
            best = c
    return tuple(sorted(kept))


def _powers_of_two_below(n: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``n``."""
    return tuple(1 << i for i in range(max(n - 1, 0).bit_length()) if 1 << i < n)


def _rows_per_block(rows: Sequence[int], block: int) -> dict[int, tuple[int, int]]:
    """For a scattered step's buffer rows (ascending), per block index the span ``[lo, hi)`` of rows (relative to
    the block) that holds all of that block's rows."""
    spans: dict[int, tuple[int, int]] = {}
    for r in rows:
        j, within = divmod(r, block)
        lo, hi = spans.get(j, (within, within + 1))
        spans[j] = (min(lo, within), max(hi, within + 1))
    return spans


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """``[x2, x1]`` for ``x = [x1, x2]`` (last dim): transformers' ``rotate_half`` without its negation, which the
    signed sin table carries instead (``(-a) * b == a * (-b)`` exactly in IEEE arithmetic, so the numbers are the
    same, one op fewer per call)."""
    return torch.roll(x, x.shape[-1] // 2, dims=-1)

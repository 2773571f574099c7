"""Perplexity of a model under each weight format, for the kernel bench (`pcr_rag.bench.kernels`).

Method (one, stated in the report as `METHOD`): teacher-forced perplexity from a transformers forward of the model
whose linear layers (attention and MLP projections and the LM head) carry the weights **as the format's own kernel
dequantizes them**: for a `pcr_rag.model.weights.Linear` ``lin`` of that format, ``W_hat = lin(I)^T`` (the
identity through the kernel, so every row of ``W_hat`` is one output channel exactly as the kernel reconstructs
it, rounded once to the activation dtype). Embeddings and norms stay in the model dtype, as in the fast forward.
The fast forward itself returns only the last position's logits; the report therefore also gives, per format, the
largest absolute difference between the fast forward's last-position logits and this model's on the first
passage (``fast_last_logits_max_abs_diff``): it bounds what the emulation changes.

Perplexity = exp(mean negative log-likelihood of every token after the first of each passage), in float32.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pcr_rag.model.weights import Linear, make_linear

METHOD = ("transformers forward (one shot, teacher forcing) with every linear layer's weight replaced by "
          "lin(I)^T, the weight as the format's kernel dequantizes it; embeddings and norms in the model dtype")

_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class Perplexity:
    """Teacher-forced perplexity of one weight format over ``tokens`` predicted tokens."""

    weights: str
    perplexity: float
    nll_per_token: float  # nats
    tokens: int
    fast_last_logits_max_abs_diff: float | None  # vs the fast forward on the first passage (None: not checked)


def dequantized_weight(lin: Linear, dtype: torch.dtype) -> torch.Tensor:
    """``[out, in]``: the weight ``lin``'s kernel computes with, recovered as ``lin(I)^T`` (bias excluded)."""
    eye = torch.eye(lin.in_features, dtype=dtype)
    out = lin(eye)
    bias = getattr(lin, "bias", None)
    if bias is not None:
        out = out - bias
    return out.t().contiguous()


def emulated_model(model: Any, fmt: str) -> Any:
    """A copy of ``model`` whose projection and LM-head weights are ``fmt``'s dequantized weights ("bf16": the
    model itself, not copied). The copy's LM head gets its own parameter (tied embeddings stay unquantized)."""
    if fmt == "bf16":
        return model
    clone = copy.deepcopy(model)
    dtype = next(model.parameters()).dtype
    targets = [clone.lm_head] + [layer.get_submodule(name) for layer in clone.model.layers for name in _PROJECTIONS]
    with torch.inference_mode():
        for mod in targets:
            bias = None if mod.bias is None else mod.bias.detach()
            w_hat = dequantized_weight(make_linear(fmt, mod.weight.detach(), bias), dtype)
            mod.weight = torch.nn.Parameter(w_hat, requires_grad=False)
    return clone


@torch.inference_mode()
def passage_nll(model: Any, passages: Sequence[Sequence[int]]) -> tuple[float, int]:
    """(sum of token NLLs in nats, number of predicted tokens) over ``passages`` (token-id lists, >= 2 each)."""
    total, count = 0.0, 0
    for ids in passages:
        x = torch.tensor([list(ids)], dtype=torch.long)
        logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
        total += float(F.cross_entropy(logits, x[0, 1:], reduction="sum"))
        count += x.shape[1] - 1
    return total, count


def measure(model: Any, passages: Sequence[Sequence[int]], fmt: str,
            fast_last_logits: torch.Tensor | None = None) -> Perplexity:
    """`Perplexity` of ``model`` emulating weight format ``fmt`` (see the module docstring). ``fast_last_logits``:
    the fast forward's last-position logits of ``passages[0]`` in ``fmt``, compared with the emulation's."""
    if not passages or any(len(p) < 2 for p in passages):
        raise ValueError("perplexity needs at least one passage of >= 2 tokens")
    emulated = emulated_model(model, fmt)
    nll, n = passage_nll(emulated, passages)
    diff = None
    if fast_last_logits is not None:
        diff = float((fast_last_logits.float() - last_logits(emulated, passages[0])).abs().max())
    return Perplexity(fmt, math.exp(nll / n), nll / n, n, diff)


@torch.inference_mode()
def last_logits(model: Any, ids: Sequence[int]) -> torch.Tensor:
    """Last-position logits ``[vocab]`` (float32) of one transformers forward over ``ids``."""
    return model(input_ids=torch.tensor([list(ids)]), use_cache=False, logits_to_keep=1).logits[0, -1].float()

"""Weight formats: which GEMM path a dense linear takes, and when a quantized format is refused."""

import logging
import time

import pytest
import torch
import torch.nn.functional as F

from pcr_rag.model import weights as weights_mod
from pcr_rag.model.weights import DenseLinear, resolve_weight_format


def test_float32_weights_are_prepacked_once_for_every_row_count():
    if not weights_mod._can_prepack(torch.zeros(1, 1)):
        pytest.skip("no oneDNN linear in this torch build")
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    lin = DenseLinear.build(w, None, pack_rows=(8, 256), shared_rows=(64, 1))
    assert lin.packed is not None and set(lin.packed) == {1, 8, 64, 256}
    assert len({id(p) for p in lin.packed.values()}) == 1, "one float32 copy of the weights, whatever M"
    for m in (1, 8, 64, 256, 5):  # 5: not packed, plain F.linear
        x = torch.randn(m, 64)
        assert torch.allclose(lin(x), F.linear(x, w), atol=1e-4, rtol=1e-4)
    x = torch.randn(8, 64)
    y = lin(x)
    assert torch.equal(lin(x.flip(0)), y.flip(0)), "a row's output does not depend on its place at a fixed M"


@pytest.mark.parametrize(("slowdown", "expected"), [(1.0, "int8"), (40.0, "bf16")])
def test_a_quantized_kernel_much_slower_than_dense_is_refused(slowdown, expected, monkeypatch, caplog):
    monkeypatch.setattr(weights_mod, "_quantized_slowdown", lambda fmt, dtype: slowdown)
    with caplog.at_level(logging.WARNING, logger="pcr_rag.model.weights"):
        assert resolve_weight_format("int8", torch.bfloat16, torch.device("cpu")) == expected
    warned = [r.getMessage() for r in caplog.records]
    assert (len(warned) == 1 and "40x slower" in warned[0]) if expected == "bf16" else not warned


def test_quantized_slowdown_is_measured(monkeypatch):
    fast = weights_mod._quantized_slowdown("int8", torch.bfloat16, size=256)
    assert 0 < fast < float("inf")
    kernel = weights_mod.Int8Linear.__call__

    def slow(self, x):
        time.sleep(0.02)  # far longer than a 256-square GEMM of 8 rows
        return kernel(self, x)

    monkeypatch.setattr(weights_mod.Int8Linear, "__call__", slow)
    assert weights_mod._quantized_slowdown("int8", torch.bfloat16, size=256) > weights_mod.QUANT_MAX_SLOWDOWN


def test_plan_id_names_the_prepacked_gemm():
    from pcr_rag.model.forward import FastForward
    from pcr_rag.testing import tiny_loaded_model

    loaded = tiny_loaded_model("llama", dtype=torch.float32)
    packed = FastForward(loaded, batch_rows=4, tile_rows=16, attention_block=8, short_tile_rows=None)
    plain = FastForward(loaded, batch_rows=4, tile_rows=16, attention_block=8, short_tile_rows=None, prepack=False)
    assert not plain.layers[0].qkv.prepacked and "gemm=" not in plain.plan_id
    if weights_mod._can_prepack(torch.zeros(1, 1)):
        assert packed.layers[0].qkv.prepacked and packed.plan_id == plain.plan_id.replace(
            ";weights=bf16", ";weights=bf16;gemm=prepacked")

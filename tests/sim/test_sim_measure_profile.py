"""`pcr-rag profile` measurements on a tiny random model (milliseconds), and the fitted cost model."""

from __future__ import annotations

import pytest

from pcr_rag.sim.costmodel import CostModel
from pcr_rag.sim.measure_profile import StepSample, build_profile, fit_prefill, measure_disk
from pcr_rag.sim.profiles import get_profile


def test_fit_recovers_known_coefficients():
    layers = 4
    fixed, a, b, step = 1e-4, 2e-6, 3e-9, 5e-4
    samples = []
    for p in (0, 100, 400):
        for c in (16, 64, 128):
            per_layer = fixed + a * c + b * (c * p + c * (c + 1) / 2)
            samples.append(StepSample(c, p, layers * per_layer + step, (layers - 1) * per_layer))
    fit = fit_prefill(samples, layers)
    assert fit["layer_s_fixed"] == pytest.approx(fixed, rel=1e-6)
    assert fit["layer_s_per_token"] == pytest.approx(a, rel=1e-6)
    assert fit["layer_s_per_token_ctx"] == pytest.approx(b, rel=1e-6)
    assert fit["step_s_fixed"] == pytest.approx(step, rel=1e-6)


def test_disk_measurement(tmp_path):
    d = measure_disk(tmp_path, nbytes=4 << 20, block=1 << 20, small_reads=4)
    assert d["ssd_read_bytes_per_s"] > 0 and d["ssd_write_bytes_per_s"] > 0
    assert d["ssd_read_latency_s"] >= 0 and d["ssd_write_latency_s"] > 0
    assert not list(tmp_path.iterdir())  # the test file is gone


def test_profile_of_a_tiny_model_loads_in_the_simulator(tmp_path):
    from pcr_rag.testing import tiny_loaded_model

    loaded = tiny_loaded_model("llama")
    prof = build_profile(loaded, name="tiny", disk_dir=tmp_path, quick=True, with_engine=False)
    assert prof.source == "measured" and prof.device_is_host and prof.prefill_steps == "engine"
    assert prof.kv_bytes_per_token == loaded.kv.bytes_per_token and prof.num_layers == loaded.kv.num_layers
    assert prof.layer_s_per_token + prof.layer_s_fixed > 0 and prof.decode_s_per_token > 0
    assert prof.decode_s_per_row >= 0  # measured over the engine's rows, all active
    assert prof.loads_share_compute and prof.ssd_read_bytes_per_s > 0  # the SSD tier's own verified layer reads
    assert prof.derivation["raw_disk_read_bytes_per_s"] > 0
    assert prof.h2d_bytes_per_s > 0 and prof.request_overhead_s >= 0
    path = prof.save(tmp_path / "tiny.json")
    again = get_profile(path)
    assert again == prof
    cm = CostModel(again)
    assert cm.compute_only_s((256, 256)) > cm.compute_only_s((256,)) > 0


def test_request_overhead_with_a_real_engine():
    from pcr_rag.sim.measure_profile import measure_request_overhead
    from pcr_rag.testing import tiny_loaded_model

    overhead = measure_request_overhead(tiny_loaded_model("llama"), chunk_size=16, reps=2,
                                        documents=["some words here", "and a few more"])
    # the time outside its own prefill steps, timed within each request: the loop's hand-offs, milliseconds
    assert 0.0 <= overhead < 0.1

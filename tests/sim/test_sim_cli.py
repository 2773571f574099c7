"""`pcr-rag simulate` end to end: the bench's JSON keys, determinism, and the validation helpers."""

from __future__ import annotations

import json

import pytest

from pcr_rag.bench.report import RequestSample, RunRecord
from pcr_rag.cli import main
from pcr_rag.sim.validate import Comparison, compare, format_table, verdict

ARGS = ["simulate", "--profile", "rtx4090-llama2-7b", "--requests", "40", "--warmup", "4", "--passages", "32",
        "--topics", "8", "--loads", "0.5,0.9", "--windows", "2", "--quiet"]


def _strip_wall(report: dict) -> dict:
    report = json.loads(json.dumps(report))
    for k in ("created_utc", "wall_s", "environment"):
        report.pop(k, None)
    for run in report["runs"]:
        run["extra"].pop("sim_wall_s", None)
    return report


def test_simulate_cli_writes_bench_keys_and_is_deterministic(tmp_path):
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for p in paths:
        assert main([*ARGS, "--json", str(p), "--markdown", str(p.with_suffix(".md"))]) == 0
    a, b = (json.loads(p.read_text()) for p in paths)
    assert _strip_wall(a) == _strip_wall(b)  # same seed -> same report
    assert a["kind"] == "simulate" and a["schema"] == "pcr-rag-report/1"
    bench_keys = set(RunRecord("x", 1.0, [RequestSample(1, 2, 0, (0.1,), 10, 5, {"dram": 5}, 2)], 3.0).to_dict())
    systems = {r["system"] for r in a["runs"]}
    assert {"no-reuse", "device-only", "dram-only", "ssd-on-demand", "pcr", "pcr-no-overlap", "pcr-no-prefetch",
            "pcr-lru", "pcr-window-2"} <= systems
    for run in a["runs"]:
        assert set(run) == bench_keys
        assert run["num_requests"] == 40
        assert run["ttft"]["mean"] > 0 and run["ttft"]["p99"] >= run["ttft"]["p50"]
        assert abs(run["reuse_ratio"] - sum(run["hit_ratio"].values())) < 1e-9
    assert len({r["rate"] for r in a["runs"]}) == 2
    assert {t["system"] for t in a["targets"]} == {"pcr"}
    assert a["breakdown"] and a["hit_ratio_study"]["policies"][-1]["policy"] == "belady"
    assert (tmp_path / "a.md").read_text().startswith("# pcr-rag simulate")
    # a different seed gives a different trace
    assert main([*ARGS, "--seed", "1", "--json", str(tmp_path / "c.json")]) == 0
    c = json.loads((tmp_path / "c.json").read_text())
    assert _strip_wall(c)["runs"] != _strip_wall(a)["runs"]


def test_simulate_cli_rejects_unknown_names(capsys):
    assert main(["simulate", "--profile", "no-such-gpu", "--quiet"]) == 2
    assert "rtx4090-llama2-7b" in capsys.readouterr().err
    assert main(["simulate", "--systems", "pcr,warp-drive", "--quiet"]) == 2


def test_validation_verdict_needs_three_systems_at_two_rates():
    report = {"runs": [{"system": s, "rate": r, "ttft": {"mean": 1.0}} for s in ("no-reuse", "dram-only", "pcr")
                       for r in (0.5, 1.0)]}
    near = {(s, r): {"ttft": {"mean": 1.1}} for s in ("no-reuse", "dram-only", "pcr") for r in (0.5, 1.0)}
    rows = compare(report, near)
    assert len(rows) == 6 and all(abs(r.error - 0.1) < 1e-9 for r in rows)
    assert verdict(rows)[0]
    far = dict(near)
    far[("pcr", 1.0)] = {"ttft": {"mean": 1.3}}
    ok, line = verdict(compare(report, far))
    assert not ok and "1 of 2" in line
    assert Comparison("pcr", 1.0, 2.0, 1.0).error == -0.5
    # queue and ITL P99 are compared where both runs report them (the executor model decides them)
    # and so is the split of a request's prefill: its own steps, and others' steps between them
    report["runs"][0].update(queue={"mean": 0.1}, itl={"p99": 0.2}, prefill={"mean": 0.5},
                             prefill_compute={"mean": 0.3})
    near[("no-reuse", 0.5)].update(queue={"mean": 0.05}, itl={"p99": 0.25}, prefill={"mean": 0.4},
                                   prefill_compute={"mean": 0.4})
    row = compare(report, near)[0]
    assert (row.measured_queue_s, row.simulated_queue_s, row.measured_itl_p99_s, row.simulated_itl_p99_s) == (
        0.1, 0.05, 0.2, 0.25)
    assert (row.measured_own_s, row.simulated_own_s) == (0.3, 0.4)
    assert row.measured_between_s == pytest.approx(0.2) and row.simulated_between_s == 0.0
    assert compare(report, near)[1].measured_queue_s is None
    table = format_table(compare(report, near))
    assert "| 100 / 50 ms | 300 / 400 ms | 200 / 0 ms | 200 / 250 ms |" in table and "n/a / n/a ms" in table
    # with per-request TTFTs, the measured mean gets a bootstrap interval and the simulated mean is judged by it
    report["runs"][0]["requests"] = {"ttft": [0.9, 1.0, 1.1, 1.0, 0.95, 1.05]}
    report["runs"][1]["requests"] = {"ttft": [1.3, 1.2, 1.25, 1.3]}
    rows = compare(report, near)
    assert rows[0].measured_ttft_interval_s[0] < 1.0 < rows[0].measured_ttft_interval_s[1] < 1.1
    assert rows[0].within_interval is False and rows[1].within_interval is False and rows[2].within_interval is None
    near[("no-reuse", 0.5)]["ttft"] = {"mean": 1.02}
    assert compare(report, near)[0].within_interval is True and compare(report, near)[0].as_dict()["within_interval"]
    assert "inside the measured mean's 95% interval" in verdict(compare(report, near))[1]
    assert "(outside)" in format_table(compare(report, near))
    # paired over the same requests (by key), the error's interval: here every request is 10% off, so is any resample
    measured = [0.9, 1.0, 1.1, 1.0, 0.95, 1.05]
    report["runs"][0]["requests"] = {"ttft": measured, "key": [[0, i] for i in range(6)]}
    near[("no-reuse", 0.5)].update(ttft={"mean": 1.1}, requests={"ttft": [x * 1.1 for x in reversed(measured)],
                                                                 "key": [[0, i] for i in reversed(range(6))]})
    row = compare(report, near)[0]
    assert row.error_interval == pytest.approx((0.1, 0.1)) and row.as_dict()["error_interval"] == row.error_interval
    assert "+10.0% [+10, +10]" in format_table([row])
    assert "paired 95% interval reaches within 15% for 1 of 1 runs" in verdict([row])[1]
    near[("no-reuse", 0.5)]["requests"]["ttft"] = [x * 1.3 for x in reversed(measured)]
    assert "reaches within 15% for 0 of 1 runs" in verdict(compare(report, near))[1]


def test_simulate_cli_runs_a_cpu_profile_on_the_runtimes_executor(tmp_path):
    """A CPU profile defaults to the engine-steps executor with the engine's rows; a system's own max_active
    (pcr-max-active-1) is simulated with its one row, and --executor serial is the old one-at-a-time model."""
    import dataclasses

    from pcr_rag.sim.profiles import get_profile

    prof = dataclasses.replace(get_profile("rtx4090-llama2-7b"), name="cpu-like", device_is_host=True,
                               prefill_steps="per_chunk", decode_s_per_row=1e-3)
    path = prof.save(tmp_path / "cpu.json")
    base = ["simulate", "--profile", str(path), "--requests", "30", "--warmup", "4", "--passages", "24",
            "--topics", "6", "--loads", "0.9", "--windows", "", "--no-belady", "--quiet",
            "--systems", "pcr,pcr-max-active-1"]
    assert main([*base, "--json", str(tmp_path / "steps.json")]) == 0
    assert main([*base, "--executor", "serial", "--json", str(tmp_path / "serial.json")]) == 0
    steps, serial = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("steps", "serial"))
    assert steps["config"]["executor"] == "engine-steps" and steps["config"]["max_batch"] == 8
    assert serial["config"]["executor"] == "serial" and serial["config"]["max_batch"] == 1

    def ttft(report, system):
        return next(r["ttft"]["mean"] for r in report["runs"] if r["system"] == system)

    # with one row the runtime's executor is the serial one: the same rate (set by no-reuse under each executor
    # differs), so compare pcr-max-active-1 under engine-steps with itself rather than across reports
    assert ttft(steps, "pcr-max-active-1") > ttft(steps, "pcr")  # eight rows serve the queue faster
    assert main([*base, "--executor", "serial", "--max-batch", "4", "--quiet"]) == 2
    assert main([*base, "--itl-budget", "none", "--json", str(tmp_path / "whole.json")]) == 0
    assert json.loads((tmp_path / "whole.json").read_text())["config"]["itl_budget_steps"] is None


def test_validation_repeats_run_the_validated_systems_only(capsys):
    from pcr_rag.bench.targets import SIM_VALIDATION_SYSTEMS
    from pcr_rag.sim.validate import validation_config

    assert validation_config().quick and validation_config().repeats == 1
    cfg = validation_config(3)
    assert cfg.repeats == 3 and tuple(cfg.systems) == SIM_VALIDATION_SYSTEMS and cfg.loads == (0.7, 1.0)
    assert cfg.windows == () and cfg.saturation == () and not cfg.limit_ratio
    with pytest.raises(ValueError):
        validation_config(0)
    # refused before any work: not a number >= 1, or repeats for a saved report
    assert main(["simulate", "--validate", "run", "--validate-repeats", "0"]) == 2
    assert main(["simulate", "--validate", "saved.json", "--validate-repeats", "2"]) == 2
    assert "--validate-repeats" in capsys.readouterr().err

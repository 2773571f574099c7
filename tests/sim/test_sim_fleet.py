"""The simulated fleet (`pcr_rag.sim.fleet`, `pcr-rag simulate --fleet`): routing orders what it should on a
Zipf trace, the remote tier's traffic is accounted, the fleet's code path reproduces the two-replica experiment,
and bad arguments fail before any work."""

from __future__ import annotations

import math

import pytest

from pcr_rag.bench.targets import SIM_VALIDATION_TOLERANCE
from pcr_rag.client.routing import routing_key
from pcr_rag.sim import cli as sim_cli
from pcr_rag.sim import fleet_cli
from pcr_rag.sim.experiment import SimSettings, SimWorkload, build_scenario
from pcr_rag.sim.fleet import (
    Affinity,
    FleetConfigError,
    FleetSpec,
    FleetTraceBuilder,
    FleetWorkload,
    StoreModel,
    compare_two_replicas,
    fleet_two_replicas,
    make_router,
    replica_capacity_rps,
    run_fleet,
)
from pcr_rag.sim.profiles import get_profile
from pcr_rag.sim.remote_link import RemoteLink, get_link
from pcr_rag.sim.replicas import two_replica_experiment
from pcr_rag.sim.simulator import default_max_batch

PROFILE = get_profile("rtx4090-llama2-7b")
SETTINGS = SimSettings(max_batch=default_max_batch("prefill-first"), executor="prefill-first")
GB = 10**9
FAST = get_link("100gbe")


def _run(routing: str, remote: str = "off", *, zipf: float = 1.0, rpr: int = 100, load: float = 0.9):
    builder = FleetTraceBuilder(FleetWorkload(num_documents=2000, zipf=zipf), PROFILE.model)
    rate = load * replica_capacity_rps(PROFILE, builder, SETTINGS, sample=100)
    return run_fleet(PROFILE, FleetSpec(4, routing, remote, FAST), builder, SETTINGS, rate_per_replica=rate,
                     requests_per_replica=rpr, dram_bytes=16 * GB, ssd_bytes=32 * GB)


@pytest.fixture(scope="module")
def zipf_runs():
    return {r: _run(r) for r in ("round-robin", "affinity")}


def test_affinity_serves_more_from_dram_than_round_robin(zipf_runs):
    rr, aff = zipf_runs["round-robin"], zipf_runs["affinity"]
    assert aff.tier_share["dram"] > 1.1 * rr.tier_share["dram"] > 0
    assert rr.spread < 1.05  # round robin spreads evenly; affinity follows the documents
    for res in zipf_runs.values():
        assert math.isclose(sum(res.tier_share.values()), 1.0)
        assert res.requests == 200 and res.p99_ttft_s >= res.mean_ttft_s > 0


def test_remote_off_moves_no_bytes_and_a_cluster_serves_remote_hits(zipf_runs):
    off = zipf_runs["round-robin"]
    assert off.network_read_bytes == off.network_write_bytes == off.store_bytes == 0
    assert off.tier_share["remote"] == 0
    on = _run("round-robin", "cluster")
    assert on.tier_share["remote"] > 0 and on.network_read_bytes > 0
    assert on.store_bytes > 0 and on.network_write_bytes >= on.store_bytes  # every distinct chunk written once or more
    assert on.tier_share["recompute"] < off.tier_share["recompute"]


def test_a_load_bound_cuts_the_tail_of_a_skewed_hot_set():
    aff = _run("affinity", zipf=1.3)
    bounded = _run("bounded-affinity", zipf=1.3)
    assert bounded.spread < aff.spread
    assert bounded.p99_ttft_s <= aff.p99_ttft_s


def test_the_fleet_reproduces_the_two_replica_experiment():
    wl = SimWorkload(num_requests=30, warmup_requests=16, num_passages=64, num_topics=None)
    scenario = build_scenario(wl, PROFILE, 1)
    links = [RemoteLink("fast", 50e9, 20e-6), get_link("1gbe")]
    ref = two_replica_experiment(PROFILE, scenario, SimSettings(), links, rate=0.5)
    got = fleet_two_replicas(PROFILE, scenario, SimSettings(), links, rate=0.5)
    rows = compare_two_replicas(ref, got)
    assert len(rows) == 7
    assert got["links"]["fast"]["cold_with_remote"]["reused_tokens"]["remote"] > 0  # the store was used
    for name, a, b, err in rows:
        assert abs(err) <= SIM_VALIDATION_TOLERANCE, (name, a, b)


def test_trace_keys_depend_on_the_prefix_only():
    b = FleetTraceBuilder(FleetWorkload(num_documents=100, system_tokens=40, doc_tokens=300), "m")
    p1, p2, p3 = b.plan([5, 7], 1), b.plan([5, 9], 2), b.plan([6, 7], 3)
    n5 = len(b.plan([5], 0)) - 1  # system + doc 5 chunks (the question is its own)
    assert [c.key for c in p1[:n5]] == [c.key for c in p2[:n5]]  # same first document: same chunks
    assert p1[n5].key != p2[n5].key and p1[1].key != p3[1].key
    assert all(c.parent == prev.key for prev, c in zip(p1, p1[1:], strict=False))
    assert p1[-1].end == 40 + b.doc_tokens(5) + b.doc_tokens(7) + 30
    assert FleetTraceBuilder(FleetWorkload(num_documents=100), "m").plan([5, 7], 1) == p1


def test_affinity_hashes_the_routing_key_of_the_first_document():
    b = FleetTraceBuilder(FleetWorkload(num_documents=500, top_k=2), "m")
    reqs = b.requests(300, 1.0, seed=1)
    router = make_router("affinity", 8)
    picked: dict[str, set[int]] = {}
    for r in reqs:
        picked.setdefault(r.doc_ids[0], set()).add(router.pick(r, lambda: [0] * 8))
    assert all(len(s) == 1 for s in picked.values()) and len(set().union(*picked.values())) > 4
    assert router._key_cache[reqs[0].doc_ids[0]] == int(routing_key([reqs[0].doc_ids[0]]), 16)


def test_bounded_affinity_passes_an_overloaded_replica_on():
    b = FleetTraceBuilder(FleetWorkload(num_documents=50), "m")
    req = b.requests(1, 1.0, seed=0)[0]
    owner = Affinity(4).pick(req, lambda: [0] * 4)
    loads = [1, 1, 1, 1]
    loads[owner] = 10  # mean with the new request 14 / 4; bound ceil(1.25 * 3.5) = 5
    got = Affinity(4, 0.25).pick(req, lambda: loads)
    assert got != owner and loads[got] + 1 <= 5
    assert Affinity(4, 0.25).pick(req, lambda: [1] * 4) == owner  # under the bound it stays


def test_a_single_store_node_queues_reads_a_cluster_spreads():
    link = RemoteLink("l", 1e9, 0.0)
    keys = [bytes([i]) + bytes(15) for i in range(8)]  # shards 0..7 of 8
    one, eight = StoreModel(link, 1), StoreModel(link, 8)
    assert one.fetch_s(0.0, [(keys[0], 10**9)]) == pytest.approx(1.0)
    assert one.fetch_s(0.0, [(keys[1], 10**9)]) == pytest.approx(2.0)  # waits for the first read
    assert eight.fetch_s(0.0, [(keys[0], 10**9)]) == pytest.approx(1.0)
    assert eight.fetch_s(0.0, [(keys[1], 10**9)]) == pytest.approx(1.0)  # another shard: no wait
    assert one.fetch_s(5.0, []) == 0.0


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "0"], "--replicas"),
    (["--routings", "random"], "--routings"),
    (["--remote-tiers", "cloud"], "--remote-tiers"),
    (["--fleet-links", "carrier-pigeon"], "unknown remote link"),
    (["--documents", "2", "--top-k", "3"], "top_k"),
    (["--load", "0"], "--load"),
    (["--shards", "0"], "--shards"),
    (["--warmup-fraction", "1"], "--warmup-fraction"),
])
def test_cli_rejects_bad_arguments_before_any_work(monkeypatch, capsys, argv, message):
    def boom(*_a, **_k):
        raise AssertionError("work started")
    monkeypatch.setattr(fleet_cli, "replica_capacity_rps", boom)
    monkeypatch.setattr(fleet_cli, "run_fleet", boom)
    assert sim_cli._main(["--fleet", "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_fleet_validate_needs_fleet(capsys):
    assert sim_cli._main(["--fleet-validate", "--quiet"]) == 2
    assert "--fleet" in capsys.readouterr().err


def test_cli_writes_the_table_and_json(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    rc = sim_cli._main(["--fleet", "--quiet", "--replicas", "2", "--documents", "300", "--requests-per-replica", "20",
                        "--routings", "round-robin", "--remote-tiers", "off,cluster", "--fleet-links", "100gbe",
                        "--json", str(out)])
    assert rc == 0
    import json
    report = json.loads(out.read_text())
    assert report["schema"] == "pcr-rag-fleet/1" and len(report["results"]) == 2
    assert {r["spec"]["remote"] for r in report["results"]} == {"off", "cluster"}
    assert "| 2 | round-robin | cluster x8, 100gbe |" in capsys.readouterr().out


def test_spec_checks():
    with pytest.raises(FleetConfigError, match="unknown routing"):
        FleetSpec(2, "random", "off", FAST)
    with pytest.raises(FleetConfigError, match="top_k"):
        FleetWorkload(num_documents=2, top_k=3)


def test_behind_a_saturated_store_node_replicas_recompute_instead_of_queueing():
    # 32 replicas read more than one node of the link serves; a cluster of 8 such nodes keeps up
    builder = FleetTraceBuilder(FleetWorkload(num_documents=2000), PROFILE.model)
    rate = 0.9 * replica_capacity_rps(PROFILE, builder, SETTINGS, sample=100)
    res = {mode: run_fleet(PROFILE, FleetSpec(32, "round-robin", mode, FAST), builder, SETTINGS,
                           rate_per_replica=rate, requests_per_replica=30, dram_bytes=16 * GB, ssd_bytes=32 * GB)
           for mode in ("off", "single", "cluster")}
    # the node's queue slows its reads, the replicas' speed estimates drop, and they recompute more
    assert 0 < res["single"].tier_share["remote"] < 0.8 * res["cluster"].tier_share["remote"]
    assert res["single"].tier_share["recompute"] > res["cluster"].tier_share["recompute"]
    assert res["off"].tier_share["recompute"] >= res["single"].tier_share["recompute"]


def test_two_round_robin_replicas_without_a_store_are_two_lone_replicas():
    """The fleet's shared time line changes nothing for replicas that share nothing: N=2 round robin serves each
    half of the trace exactly as a lone simulator does (TTFT, completion, reuse per tier)."""
    from pcr_rag.sim.fleet import Fleet, RoundRobin, replica_config
    from pcr_rag.sim.simulator import Simulator
    from pcr_rag.sim.systems import get_system

    builder = FleetTraceBuilder(FleetWorkload(num_documents=500), PROFILE.model)
    trace = builder.requests(200, 7.0, seed=3)
    cfg = replica_config(PROFILE, get_system("pcr"), SETTINGS, dram_bytes=8 * GB, ssd_bytes=16 * GB, chunk_size=256)
    fleet = Fleet(cfg, 2)
    try:
        results, where = fleet.serve(trace, RoundRobin(2))
    finally:
        fleet.close()
    assert where == [i % 2 for i in range(200)]
    for i in range(2):
        sim = Simulator(cfg)
        try:
            alone = sim.run([r for j, r in enumerate(trace) if j % 2 == i])
        finally:
            sim.close()
        def view(res):
            return [(o.rid, o.ttft_s, o.done_s, dict(o.reused)) for o in res.outcomes]
        assert view(alone) == view(results[i])
        assert sum(o.reused["dram"] for o in alone.outcomes) > 0

"""``benchmarks/blend_quality.py``: on a tiny random model every system serves every request, blend reuses
documents seen before in other positions (counted apart from its fresh placements), the quality columns compare
each blend answer with the exact one, blend with backfill serves a prompt that comes back by exact reuse (its
backfills finished in the gap, counted and timed), and the script runs end to end (retrieval workload, JSON,
table)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pcr_rag.testing import save_tiny_model, tiny_model

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "blend_quality.py"
DOCS = [f"Passage {i} tells how the river {i} meets the sea beyond the hills of stone and sand. " * 3
        for i in range(5)]


def test_blend_quality_measures_every_system_and_compares_with_exact(tmp_path):
    from benchmarks.blend_quality import blend_name, default_fraction, markdown, measure_model, summarize

    model, tok = tiny_model("llama", num_layers=2, dtype=torch.float32)
    warmup = [("Warm-up: what meets the sea?", [DOCS[0], DOCS[1], DOCS[2]])]
    requests = [("What meets the sea?", [DOCS[2], DOCS[3], DOCS[1]]),  # seen, new, seen
                ("Which river?", [DOCS[4], DOCS[1], DOCS[3]]),
                ("What meets the sea?", [DOCS[2], DOCS[3], DOCS[1]])]  # asked again
    fractions = (0.0, 0.5)
    served = measure_model(model, tok, "tiny", warmup, requests, fractions, max_new_tokens=4, chunk_size=16,
                           work_dir=tmp_path)
    systems = ["no-reuse", "pcr", blend_name(0.0), blend_name(0.5)]
    assert sorted((r.system, r.index) for r in served) == sorted((s, k) for s in systems for k in range(3))
    by = {(r.system, r.index): r for r in served}
    assert all(len(by[("no-reuse", k)].token_ids) == 1 for k in range(3))  # only its TTFT is used
    for f in fractions:
        first = by[(blend_name(f), 0)]
        # documents 2 and 1 were placed by the warm-up (after its first document): reused in new positions;
        # document 3 is new: placed after an isolated prefill for this request, not reuse
        assert first.blended_reused > 0 and first.blended_fresh > 0
        assert first.blended == first.blended_reused  # the engine counts only placed KV an earlier request left
        again = by[(blend_name(f), 2)]
        # the same prompt again: nothing after a placed document entered the exact tree, so it is placed again,
        # now all from earlier KV
        assert again.blended_fresh == 0 and again.blended_reused > 0
    assert by[(blend_name(0.0), 0)].blended_reused > by[(blend_name(0.5), 0)].blended_reused  # half recomputed
    rows = summarize(served, fractions)
    assert [r["system"] for r in rows] == systems
    row = {r["system"]: r for r in rows}
    assert row["no-reuse"]["reused"] == 0 and row["no-reuse"]["first_token_same_as_exact"] == 3
    assert row["pcr"]["ttft_vs_pcr"] is None and row["pcr"]["ttft_vs_no_reuse"]["n"] == 3
    for f in fractions:
        b = row[blend_name(f)]
        assert b["plan_replayed"] and b["reused"] == pytest.approx(b["exact"] + b["blended_reused"])
        assert b["reused"] > row["pcr"]["reused"]  # blend reuses beyond the exact prefix
        assert b["all_requests"] == 3 and 2 <= b["blended_requests"] <= 3
        assert 0 <= b["all_identical"] <= 3 and b["all_kl_median"] >= 0 and 0 <= b["all_rouge_l_mean"] <= 1
        q = {p["index"]: p for p in b["per_request"]}
        assert all(p["rouge_l"] == 1.0 for p in q.values() if p["identical"])
        assert all(not math.isnan(p["kl"]) for p in q.values())
        assert b["ttft_vs_pcr"]["low"] <= b["ttft_vs_pcr"]["ratio"] <= b["ttft_vs_pcr"]["high"]
    table = markdown(rows)
    assert table.count("\n") == len(rows) + 1 and "| tiny | blend-0.5 |" in table
    # the default: the smallest fraction reaching the ROUGE-L bound on every model
    fake = [{"system": "blend-0", "blended_rouge_l_mean": 0.5}, {"system": "blend-0.5", "blended_rouge_l_mean": 0.95},
            {"system": "blend-0", "blended_rouge_l_mean": 0.95}, {"system": "blend-0.5", "blended_rouge_l_mean": 0.9}]
    assert default_fraction(fake, fractions) == 0.5 and default_fraction(fake[:1], (0.0,)) is None


def test_backfill_system_serves_a_prompt_that_comes_back_exactly(tmp_path):
    from benchmarks.blend_quality import backfill_lines, backfill_name, blend_name, measure_model, summarize

    model, tok = tiny_model("llama", num_layers=2, dtype=torch.float32)
    warmup = [("Warm-up: what meets the sea?", [DOCS[0], DOCS[1], DOCS[2]])]
    requests = [("What meets the sea?", [DOCS[2], DOCS[3], DOCS[1]]),
                ("Which river?", [DOCS[4], DOCS[1], DOCS[3]]),
                ("What meets the sea?", [DOCS[2], DOCS[3], DOCS[1]])]  # asked again
    stats: dict = {}
    served = measure_model(model, tok, "tiny", warmup, requests, (0.5,), max_new_tokens=4, chunk_size=16,
                           work_dir=tmp_path, backfill=True, blend_stats=stats)
    plain, fill = blend_name(0.5), backfill_name(0.5)
    systems = ["no-reuse", "pcr", plain, fill]
    assert sorted((r.system, r.index) for r in served) == sorted((s, k) for s in systems for k in range(3))
    by = {(r.system, r.index): r for r in served}
    # the gap after each blended prompt the exact tree did not hold ran its backfill to the end before the next
    # request; the prompt that came back was then in the tree: nothing to backfill after it
    assert [by[(fill, k)].backfills for k in range(3)] == [1, 1, 0]
    assert all(by[(fill, k)].backfill_wait_s >= 0 for k in range(3))
    assert all(by[(s, k)].backfills is None and by[(s, k)].backfill_wait_s is None
               for s in systems[:3] for k in range(3))
    # without backfill the prompt that comes back is placed again; with it, served by exact reuse like pcr's
    again, again_fill, again_pcr = by[(plain, 2)], by[(fill, 2)], by[("pcr", 2)]
    assert again.blended > 0 and again.exact < again_pcr.exact
    assert again_fill.blended == 0 and again_fill.blended_fresh == 0 and again_fill.exact == again_pcr.exact
    # the first request of each prompt was blended alike (backfill changes only what comes after it)
    assert (by[(fill, 0)].exact, by[(fill, 0)].blended) == (by[(plain, 0)].exact, by[(plain, 0)].blended)
    # the engines' own counts: one backfill after the warm-up request and two after measured ones; none without
    assert stats[fill]["backfills"] == 3 and stats[fill]["pending_shadows"] == 0
    assert stats[plain]["backfills"] == 0
    rows = summarize(served, (0.5,))
    assert [r["system"] for r in rows] == systems
    row = {r["system"]: r for r in rows}
    assert row[fill]["backfill"] and not row[plain]["backfill"] and row[fill]["recompute"] == 0.5
    assert row[fill]["backfills"] == 2 and row[fill]["backfill_wait_s"] >= row[fill]["backfill_wait_max_s"] >= 0
    assert "backfills" not in row[plain]
    assert row[fill]["exact"] > row[plain]["exact"]
    assert row[fill]["blended_requests"] == 2 and row[fill]["all_requests"] == 3  # the one served exactly
    lines = backfill_lines(rows).splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"backfill: tiny {fill}: 2 backfills after 3 requests")


class _GapEngine:
    """A stand-in for `PCREngine` in the gap after one blended request (unit test of `wait_for_backfill`): each
    ``stats()`` call moves to the next of ``states`` (queue depth, running, pending backfills, completed backfills,
    whether the tree holds the prompt), then stays at the last."""

    def __init__(self, states):
        self.states = list(states)
        self.calls = 0
        self.cache = self

    def plan_for(self, question, documents, *, system=None):
        return [SimpleNamespace(key=bytes([i])) for i in range(3)]

    def _state(self):
        return self.states[min(self.calls, len(self.states) - 1)]

    def match(self, keys):
        return SimpleNamespace(keys=tuple(keys) if self._state()[4] else tuple(keys[:1]))

    def stats(self):
        depth, running, pending, done, _ = self._state()
        self.calls += 1
        return SimpleNamespace(queue_depth=depth, running=running,
                               blend={"pending_shadows": pending, "backfills": done})


def test_the_gap_waits_for_the_backfill_count_when_the_tree_lacked_the_prompt():
    from benchmarks.blend_quality import wait_for_backfill

    # the prompt was not in the tree: the gap lasts past the moments the engine looks idle (the callback not yet
    # run, the job between the queue and the scheduler, the twin's chunks written but the count not yet raised)
    engine = _GapEngine([(0, 0, 0, 5, False), (0, 0, 1, 5, False), (0, 0, 0, 5, False), (1, 0, 0, 5, False),
                         (0, 1, 0, 5, False), (0, 0, 0, 5, True), (0, 0, 0, 6, True)])
    waited, done = wait_for_backfill(engine, "q", ["d"], 5)
    assert done == 1 and engine.calls == 7 and waited > 0
    # the prompt was in the tree: nothing was queued, the gap ends once the engine is idle
    engine = _GapEngine([(0, 1, 0, 5, True), (0, 0, 0, 5, True)])
    assert wait_for_backfill(engine, "q", ["d"], 5)[1] == 0 and engine.calls == 2
    # a backfill that never completes (failed, logged by the engine) ends the run instead of hanging it
    with pytest.raises(RuntimeError, match="did not finish"):
        wait_for_backfill(_GapEngine([(0, 0, 0, 5, False)]), "q", ["d"], 5, timeout_s=0.05)


def test_first_token_kl_and_rouge_l():
    from benchmarks.blend_quality import first_token_kl, rouge_l

    logits = torch.tensor([2.0, 0.5, -1.0])
    assert first_token_kl(logits, logits) == pytest.approx(0.0, abs=1e-12)
    assert first_token_kl(logits, torch.tensor([0.5, 2.0, -1.0])) > 0.1
    assert rouge_l("the river meets the sea", "the river meets the sea") == pytest.approx(1.0)
    assert 0 < rouge_l("the river meets the sea", "a river meets a lake") < 1


def test_blend_quality_runs_as_a_script(tmp_path):
    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    corpus = tmp_path / "docs.jsonl"
    words = ["cache", "prefix", "tree", "chunk", "layer", "prefetch", "queue", "window", "tier", "disk", "memory"]
    with corpus.open("w") as fh:
        for i in range(10):
            text = "\n\n".join(" ".join(words[(i + j + k) % len(words)] for k in range(25)) for j in range(3))
            fh.write(json.dumps({"id": f"d{i}", "title": f"Doc {i}", "text": text}) + "\n")
    questions = tmp_path / "q.txt"
    questions.write_text("Which words are about the cache prefix tree?\nWhat about disk memory?\nAnd the queue?\n")
    out = tmp_path / "res" / "quality.json"
    # from an unrelated directory, nothing on PYTHONPATH: `python benchmarks/blend_quality.py` as documented
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--models", str(model_dir), "--corpus",
                           str(corpus), "--questions", str(questions), "--passages", "0", "--chunk-size", "16",
                           "--fractions", "0,0.3", "--backfill", "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| blend-0.3 |" in done.stdout and "| blend-0.3+backfill |" in done.stdout and "default:" in done.stdout
    assert [line.split(":")[1] for line in done.stdout.splitlines() if line.startswith("backfill: ")] == [
        " tiny blend-0+backfill", " tiny blend-0.3+backfill"]
    report = json.loads(out.read_text())
    assert [r["system"] for r in report["rows"]] == ["no-reuse", "pcr", "blend-0", "blend-0+backfill", "blend-0.3",
                                                    "blend-0.3+backfill"]
    assert len(report["requests"]) == 6 * 4 and report["config"]["quick"] is True and report["config"]["backfill"]
    rows = {r["system"]: r for r in report["rows"]}
    (info,) = report["models"].values()
    for f in ("0", "0.3"):
        # the JSON keeps the measured backfills per row and each engine's own count (warm-up included)
        assert 0 <= rows[f"blend-{f}+backfill"]["backfills"] <= 4 and "backfills" not in rows[f"blend-{f}"]
        assert info["blend_stats"][f"blend-{f}+backfill"]["backfills"] >= rows[f"blend-{f}+backfill"]["backfills"]
        assert info["blend_stats"][f"blend-{f}"]["backfills"] == 0
    assert sum(info["blend_stats"][f"blend-{f}+backfill"]["backfills"] for f in ("0", "0.3")) > 0

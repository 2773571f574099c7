"""Cache identity covers the kernels (issue 47): engines whose kernels compute other bits share no chunk.

One host, two kernel paths: a process with torch's and oneDNN's CPU dispatch capped at AVX2 (``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA``, set before torch loads: what an AVX2-only host runs) computes other float32 KV bits than one
without the caps on an AVX-512 host, under the same plan id (so the roots of before met). Capping oneDNN alone
changes the bf16 GEMMs' bits but also the plan (no prepacked weights), which the roots already told apart; in
float32 the oneDNN cap alone changes nothing, torch's own kernels (attention, softmax) do. Engine A (no cap) fills one SSD directory and one Valkey; engine B (capped) then answers the same requests from both, one
process after the other (the directory is locked while an engine holds it). B must find none of A's chunks and
answer exactly as its own cache-off run; a third process on A's path (a control) reuses them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPLICA = Path(__file__).with_name("kernel_replica.py")
CAP = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}  # below AVX-512 and AMX: an AVX2 host's path
TOPICS = ["rivers", "glaciers", "volcanoes"]
DOCS = {t: f"The {t} of the world are studied by many scientists, who measure and map them each year. " * 3
        for t in TOPICS}


def _run(tmp_path: Path, name: str, url: str, env: dict[str, str]) -> dict:
    out = tmp_path / f"{name}.pt"
    subprocess.run([sys.executable, str(REPLICA), str(tmp_path / "requests.json"), str(out),
                    "--cache-dir", str(tmp_path / "kv"), "--url", url],
                   check=True, env={**os.environ, **env}, timeout=300)
    return torch.load(out, weights_only=False)


def _same(run: list, reference: list) -> bool:
    return all(ids == ref_ids and torch.equal(logits, ref_logits)
               for (ids, logits), (ref_ids, ref_logits) in zip(run, reference, strict=True))


def test_a_host_on_another_kernel_path_reuses_none_of_the_chunks_it_cannot_reproduce(valkey, tmp_path):
    requests = [[f"What do we know about {t}?", [DOCS[t]]] for t in TOPICS]
    (tmp_path / "requests.json").write_text(json.dumps(requests))
    plain = {k: v for k, v in os.environ.items() if k not in CAP}  # A and the control: no cap, whatever CI set
    a = _run(tmp_path, "a", valkey.url, plain)
    b = _run(tmp_path, "b", valkey.url, {**plain, **CAP})
    if a["kernels"] == b["kernels"]:
        pytest.skip(f"capping the CPU kernels at AVX2 changes no bit of the probe on this CPU (torch sees "
                    f"{torch.backends.cpu.get_cpu_capability()}): both paths may share")
    assert a["remote_io"]["writes"] > 0 and a["reused"][0] == 0
    # B starts on A's directory and store: its first request finds nothing (later ones reuse B's own head), no
    # remote read hits, and every answer equals B's own cache-off run (tokens and first-token logits)
    assert b["reused"][0] == 0, "B reused chunks computed by other kernels"
    assert b["reused"] == a["reused"], "B reuses only what it computed itself, as A did"
    assert b["remote_io"]["hits"] == 0
    assert _same(b["on"], b["off"]), "B's answers must equal its own cache-off run"
    assert _same(a["on"], a["off"])
    assert any("kernels" in line and "cannot use" in line for line in b["warnings"]), b["warnings"]
    # the store's root manifests: A finds none of another identity, B finds A's root, of other kernels, and says
    # so at start. The census runs in the background beside the first requests, so an engine may also count its
    # own root (written with its first chunk): roots_seen is 0 or 1 for A, 1 or 2 for B
    assert a["remote_io"]["roots_of_other_identity"] == 0 and a["remote_io"]["roots_seen"] in (0, 1)
    assert b["remote_io"]["roots_of_other_identity"] == 1 and b["remote_io"]["roots_seen"] in (1, 2)
    assert any(f"kernels {a['kernels']}" in line and "namespace roots" in line for line in b["warnings"])
    c = _run(tmp_path, "c", valkey.url, plain)  # the control, on A's kernel path: A's chunks are found
    assert c["kernels"] == a["kernels"] and c["reused"][0] > 0 and all(n > 0 for n in c["reused"])
    assert (c["remote_io"]["roots_seen"], c["remote_io"]["roots_of_other_identity"]) == (2, 1)  # B's root
    assert _same(c["on"], a["off"])

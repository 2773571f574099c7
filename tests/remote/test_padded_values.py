"""A store writer pads a sealed value with many MiB (its header and header MAC stay valid): against a real Valkey, a
replica reads no more than the chunk's KV layout implies, rejects the value, recomputes, and answers exactly as
with the cache off (issue 47, item 4; the audit's replica read the whole value first: peak RSS 519 -> 1,040 MiB)."""

from __future__ import annotations

from pcr_rag.cache.tiers.remote_value import value_name

from .conftest import start_valkey
from .test_replicas_share_store import DOCS, TOPICS, make_engine, question, same_answer
from .test_replicas_share_store import reference as reference  # noqa: F401 - the module's fixtures
from .test_replicas_share_store import tiny as tiny  # noqa: F401

PAD = 32 << 20


def test_a_padded_value_is_read_up_to_its_layout_and_recomputed(tmp_path, tiny, reference):
    valkey = start_valkey(tmp_path / "valkey", maxmemory="256mb")
    try:
        topic = TOPICS[0]
        with make_engine(tiny, tmp_path / "w", remote_url=valkey.url) as writer:
            writer.generate(question(topic), [DOCS[topic]])
            writer.flush(timeout=30)
            keys = [c.key for c in writer.plan_for(question(topic), [DOCS[topic]])]
        client = valkey.client()
        padded = value_name("pcr-rag", keys[1])
        size = client.strlen(padded)
        client.append(padded, bytes(PAD))
        with make_engine(tiny, tmp_path / "r", remote_url=valkey.url, prefetch=False,
                         load_planner="always-load") as replica:
            result = replica.generate(question(topic), [DOCS[topic]])
            io = replica.stats().cache.remote_io
        assert same_answer(result, reference[topic])
        assert io["corrupt"] + io["forged"] == 1 and result.metrics.recomputed_after_error >= 1
        assert io["bytes_read"] < len(keys) * (size + 1) < PAD, io["bytes_read"]
        assert not client.exists(padded) or client.strlen(padded) == size  # deleted (or written again, unpadded)
    finally:
        valkey.stop()

"""Chunk keys and chunk plans: stability, chaining, per-segment cutting."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from pcr_rag.cache import KEY_BYTES, ChunkSpec, chunk_key, namespace_key, plan_chunks
from pcr_rag.cache.keys import scope_key
from pcr_rag.units import format_bytes, parse_bytes


def test_namespace_key_covers_every_component():
    base = namespace_key("model-a", "bfloat16", 256, "")
    assert len(base) == KEY_BYTES
    assert base == namespace_key("model-a", "bfloat16", 256, "")
    variants = [
        namespace_key("model-b", "bfloat16", 256, ""),
        namespace_key("model-a", "float16", 256, ""),
        namespace_key("model-a", "bfloat16", 128, ""),
        namespace_key("model-a", "bfloat16", 256, "tenant-1"),
        # length-prefixing: moving a character between fields changes the key
        namespace_key("model-ab", "floa16", 256, ""),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_chunk_key_is_chained_blake2b_over_int64_tokens_and_count():
    root = namespace_key("m", "float32", 4)
    tokens = [1, 2, 70000, 3]
    expected = hashlib.blake2b(digest_size=16, person=b"pcr-chunk-v1")
    expected.update(root + np.asarray(tokens, dtype="<i8").tobytes() + (4).to_bytes(8, "little"))
    assert chunk_key(root, tokens) == expected.digest()
    # numpy arrays and lists give the same key; order and parent matter
    assert chunk_key(root, np.array(tokens)) == chunk_key(root, tokens)
    assert chunk_key(root, [2, 1, 70000, 3]) != chunk_key(root, tokens)
    other_root = namespace_key("m", "float32", 4, "salt")
    assert chunk_key(other_root, tokens) != chunk_key(root, tokens)


def test_partial_and_full_chunks_never_share_a_key():
    root = namespace_key("m", "float32", 4)
    assert chunk_key(root, [5, 6]) != chunk_key(root, [5, 6, 0, 0])
    with pytest.raises(ValueError):
        chunk_key(b"short", [1])


def test_plan_chunks_cuts_each_segment_on_its_own_and_chains_keys():
    root = namespace_key("m", "float32", 4)
    segments = [list(range(10)), [], list(range(100, 106)), [7]]
    plan = plan_chunks(root, segments, 4)
    spans = [(s.start, s.end, s.segment, s.partial) for s in plan]
    assert spans == [
        (0, 4, 0, False),
        (4, 8, 0, False),
        (8, 10, 0, True),
        (10, 14, 2, False),
        (14, 16, 2, True),
        (16, 17, 3, True),
    ]
    assert [s.num_tokens for s in plan] == [4, 4, 2, 4, 2, 1]
    parent = root
    flat = [t for seg in segments for t in seg]
    for spec in plan:
        assert isinstance(spec, ChunkSpec)
        assert spec.parent == parent
        assert spec.key == chunk_key(parent, flat[spec.start : spec.end])
        parent = spec.key


def test_same_document_after_different_prefix_gets_different_keys():
    root = namespace_key("m", "float32", 4)
    doc = list(range(8))
    a = plan_chunks(root, [[1, 2, 3, 4], doc], 4)
    b = plan_chunks(root, [[9, 9, 9, 9], doc], 4)
    c = plan_chunks(root, [[1, 2, 3, 4], doc, [42]], 4)
    assert {s.key for s in a[1:]}.isdisjoint({s.key for s in b[1:]})
    assert [s.key for s in c[:3]] == [s.key for s in a]  # a shared prefix gives shared keys


def test_plan_rejects_bad_arguments():
    root = namespace_key("m", "float32", 4)
    with pytest.raises(ValueError):
        plan_chunks(root, [[1, 2]], 0)
    with pytest.raises(ValueError):
        plan_chunks(root, [[[1, 2]]], 4)
    assert plan_chunks(root, [], 4) == []


SHARED = namespace_key("m", "float32", 4, "engine")
TENANT_A = namespace_key("m", "float32", 4, "engine|a")
TENANT_B = namespace_key("m", "float32", 4, "engine|b")
HEAD, PUBLIC, SECRET, QUERY = [1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15], [20, 21, 22], [30, 31]


def _scoped(tenant: bytes, segments, private_from):
    return plan_chunks(SHARED, segments, 4, private_root=tenant, private_from=private_from)


def test_plans_without_a_private_part_keep_their_keys():
    """Requests without scopes key exactly as before: no switch, or a wholly private prompt from its own root."""
    segments = [HEAD, PUBLIC, QUERY]
    assert _scoped(TENANT_A, segments, None) == plan_chunks(SHARED, segments, 4)
    assert _scoped(TENANT_A, segments, 3) == plan_chunks(SHARED, segments, 4)  # past the last segment
    assert _scoped(TENANT_A, segments, 0) == plan_chunks(TENANT_A, segments, 4)


def test_shared_prefix_is_shared_across_tenants_and_nothing_after_a_private_segment_is():
    segments = [HEAD, PUBLIC, SECRET, QUERY]
    a, b = _scoped(TENANT_A, segments, 2), _scoped(TENANT_B, segments, 2)
    shared = [s for s in a if s.segment < 2]
    assert [s.key for s in shared] == [s.key for s in b[: len(shared)]]
    assert [s.key for s in shared] == [s.key for s in plan_chunks(SHARED, segments[:2], 4)]
    private_a = {s.key for s in a if s.segment >= 2}
    private_b = {s.key for s in b if s.segment >= 2}
    assert private_a and private_a.isdisjoint(private_b)
    # nor with any key the tenant, the shared root or another tenant computes in any other way
    others = set()
    for root in (SHARED, TENANT_B):
        for cut in range(len(segments) + 1):
            others |= {s.key for s in plan_chunks(root, segments[cut:], 4)}
            others |= {s.key for s in _scoped(TENANT_B, segments, cut)}
    others |= {s.key for s in plan_chunks(TENANT_A, segments, 4)}  # the tenant's own all-private plan
    assert private_a.isdisjoint(others)


def test_first_private_chunk_hashes_the_scope_key_and_keeps_its_tree_parent():
    segments = [HEAD, PUBLIC, SECRET, QUERY]
    plan = _scoped(TENANT_A, segments, 2)
    first = next(s for s in plan if s.segment == 2)
    before = plan[plan.index(first) - 1]
    assert first.parent == before.key  # the prefix tree links it under the shared chain
    assert first.key == chunk_key(scope_key(TENANT_A, before.key), SECRET)
    assert first.key != chunk_key(before.key, SECRET)
    for prev, spec in zip(plan, plan[1:]):
        assert spec.parent == prev.key
    assert plan[0].parent == SHARED and plan[0].start == 0


def test_private_part_under_the_shared_root_itself_is_not_the_shared_chain():
    """The engine's own namespace: an explicitly private document keys apart from the shared chain even though
    its private root is the shared root (a tenant marking the same prefix shared cannot match it)."""
    segments = [HEAD, PUBLIC, SECRET]
    own = plan_chunks(SHARED, segments, 4, private_root=SHARED, private_from=1)
    plain = plan_chunks(SHARED, segments, 4)
    assert own[:2] == plain[:2]  # the head is shared
    assert {s.key for s in own[2:]}.isdisjoint({s.key for s in plain})
    first = plan_chunks(SHARED, segments, 4, private_root=SHARED, private_from=0)
    assert first[0].parent == SHARED and first[0].key == chunk_key(scope_key(SHARED, SHARED), HEAD[:4])


def test_scope_arguments_are_checked():
    with pytest.raises(ValueError):
        plan_chunks(SHARED, [HEAD], 4, private_from=0)
    with pytest.raises(ValueError):
        plan_chunks(SHARED, [HEAD], 4, private_root=TENANT_A, private_from=-1)
    with pytest.raises(ValueError):
        scope_key(b"short", SHARED)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        (1024, 1024),
        ("2GiB", 2 * 1024**3),
        ("512MB", 512 * 1000**2),
        ("64K", 64 * 1024),
        ("1.5 TB", int(1.5 * 1000**4)),
        ("0", 0),
        ("10b", 10),
    ],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["", "12 parsecs", "-1", -5, "GiB", True])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"

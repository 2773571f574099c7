"""The fast forward: equal to transformers in fp32, split-invariant prefill and batch-invariant decode, bit for bit."""

from __future__ import annotations

import pytest
import torch

from pcr_rag.model.forward import FastForward, UnsupportedArchitectureError, plan_tiles, run_layers
from pcr_rag.model.weights import PaddedRows
from pcr_rag.testing import tiny_loaded_model

ARCHS = ("llama", "qwen2", "gemma3")
DTYPES = (torch.float32, torch.bfloat16)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 300, (n,), generator=g)


def _forward(arch: str, dtype: torch.dtype, **kwargs) -> FastForward:
    kwargs.setdefault("tile_rows", 16)
    kwargs.setdefault("attention_block", 8)
    kwargs.setdefault("batch_rows", 4)
    kwargs.setdefault("short_tile_rows", 4)  # short tiles of 4, 8 and 12 rows where the probe proves them exact
    kwargs.setdefault("attention_sub_block", 4)  # half-block attention slices where the probe proves them exact
    return FastForward(tiny_loaded_model(arch, dtype=dtype), **kwargs)


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers_in_fp32(arch):
    fw = _forward(arch, torch.float32)
    model = fw.loaded.model
    ids = _ids(70)
    arena = fw.new_arena(4, 128)
    row = arena.row(2)
    logits = fw.prefill(row, ids, 0)
    with torch.inference_mode():
        ref = model(input_ids=ids[None], use_cache=False).logits[0]
    assert torch.allclose(logits, ref[-1], atol=1e-4), (logits - ref[-1]).abs().max()
    seq = ids.tolist()
    for step in range(3):  # greedy decode, compared with a full transformers forward over the sequence
        tok = int(logits.argmax())
        seq.append(tok)
        out = fw.decode(arena, [None, None, 2, None], torch.tensor([0, 0, tok, 0]),
                        torch.tensor([0, 0, len(seq) - 1, 0]))
        logits = out[2]
        with torch.inference_mode():
            ref = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
        assert torch.allclose(logits, ref, atol=1e-4), (step, (logits - ref).abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("splits", [(1,), (7, 30), (16, 17, 40), (5, 6, 7, 8, 9, 61)], ids=str)
def test_prefill_is_split_invariant(arch, dtype, splits):
    """Any split of a prompt into steps writes bit-identical KV and yields bit-identical last logits."""
    fw = _forward(arch, dtype)
    ids = _ids(62)
    arena = fw.new_arena(2, 64)
    one_shot = fw.prefill(arena.row(0), ids, 0)
    bounds = [0, *splits, len(ids)]
    for a, b in zip(bounds, bounds[1:]):
        logits = fw.prefill(arena.row(1), ids[a:b], a, want_logits=b == len(ids))
    assert torch.equal(logits, one_shot)
    for layer in range(len(arena.k)):
        assert torch.equal(arena.k[layer][0, :, :62], arena.k[layer][1, :, :62])
        assert torch.equal(arena.v[layer][0, :, :62], arena.v[layer][1, :, :62])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_with_default_tiles_is_split_invariant(arch, dtype):
    fw = _forward(arch, dtype, tile_rows=256, attention_block=128)
    ids = _ids(300, seed=3)
    arena = fw.new_arena(2, 320)
    one_shot = fw.prefill(arena.row(0), ids, 0)
    fw.prefill(arena.row(1), ids[:129], 0, want_logits=False)
    assert torch.equal(fw.prefill(arena.row(1), ids[129:], 129), one_shot)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("suffix", [1, 40, 100, 171])
def test_short_tiles_replay_full_tiles(arch, dtype, suffix):
    """A hit's short suffix runs in a short tile and 32-row attention slices (or full ones where the probes say
    so) and still equals the rows of a run without either, KV and logits, bit for bit."""
    short = _forward(arch, dtype, tile_rows=256, attention_block=128, short_tile_rows=16, attention_sub_block=32)
    full = _forward(arch, dtype, tile_rows=256, attention_block=128, short_tile_rows=None, attention_sub_block=None)
    assert full.attention_sub_block is None
    assert full.short_tile_sizes == () and full.tile_sizes(suffix) == (256,)
    assert short.plan_id == full.plan_id
    ids = _ids(300 + suffix, seed=suffix)
    arena = short.new_arena(2, 512)
    short.prefill(arena.row(0), ids[:300], 0, want_logits=False)
    got = short.prefill(arena.row(0), ids[300:], 300)
    assert sum(short.tile_sizes(suffix)) < 256 or not short.short_tile_sizes
    want = full.prefill(arena.row(1), ids, 0)
    assert torch.equal(got, want)
    for layer in range(len(arena.k)):
        assert torch.equal(arena.k[layer][0, :, : len(ids)], arena.k[layer][1, :, : len(ids)])
        assert torch.equal(arena.v[layer][0, :, : len(ids)], arena.v[layer][1, :, : len(ids)])


def test_attention_probe_rejects_slices_that_change_rows():
    """The probe accepts an attention whose rows do not depend on the slice and rejects one whose rows do."""
    from pcr_rag.model.attention_probe import _exact_cache, sub_blocks_exact

    def per_row(q, rows, index, k, v, window):
        return q[rows[0]: rows[1]].flatten(1).float() * 2

    def mixes_rows(q, rows, index, k, v, window):
        x = q[rows[0]: rows[1]].flatten(1).float()
        return x + x.mean(0, keepdim=True)

    kw = dict(block=16, sub_block=4, heads=2, kv_heads=1, head_dim=8, windows=(None,), dtype=torch.float32,
              device=torch.device("cpu"))
    def changes_with_span(q, rows, index, k, v, window):  # one slice and the whole block agree; longer spans not
        x = q[rows[0]: rows[1]].flatten(1).float() * 2
        return x if rows[1] - rows[0] in (4, 16) else x + 1e-3

    _exact_cache.clear()  # results are cached per shape: the forward's attend is always the same code
    assert sub_blocks_exact(per_row, **kw)
    _exact_cache.clear()
    assert not sub_blocks_exact(mixes_rows, **kw)
    _exact_cache.clear()
    assert not sub_blocks_exact(changes_with_span, **kw), "a step computes spans of several slices in one call"
    _exact_cache.clear()


def test_the_finest_exact_attention_slice_is_used(monkeypatch):
    """The forward takes the finest of its slice size, twice that, ... that the probe proves exact, and whole blocks
    when none is."""
    import pcr_rag.model.forward as forward

    asked: list[int] = []

    def exact_from(size):
        def probe(attend, *, sub_block, **kw):
            asked.append(sub_block)
            return sub_block >= size
        return probe

    monkeypatch.setattr(forward, "sub_blocks_exact", exact_from(16))
    assert _forward("llama", torch.float32, attention_block=64, attention_sub_block=4).attention_sub_block == 16
    assert asked == [4, 8, 16]
    monkeypatch.setattr(forward, "sub_blocks_exact", exact_from(1000))
    assert _forward("llama", torch.float32, attention_block=64, attention_sub_block=4).attention_sub_block is None


def test_padded_linears_and_decode_batch_m():
    """A linear padded at the short sizes (what the probe does for oneDNN's K=1536 GEMM) keeps split invariance;
    the decode batch's row count is never a short tile size, so decode calls are never padded."""
    import dataclasses

    fw = _forward("llama", torch.float32, batch_rows=8)
    assert 8 not in fw.short_tile_sizes and set(fw.short_tile_sizes) <= {4, 12}
    sizes = frozenset(fw.short_tile_sizes) or frozenset({4, 12})
    base = fw.layers
    for split in (None, 8):  # padded only; padded with full tiles run as two half-tile calls
        fw.layers = tuple(dataclasses.replace(lw, down=PaddedRows(lw.down, fw.tile_rows, sizes, split))
                          for lw in base)
        ids = _ids(45)
        arena = fw.new_arena(2, 64)
        one_shot = fw.prefill(arena.row(0), ids, 0)
        fw.prefill(arena.row(1), ids[:34], 0, want_logits=False)
        assert torch.equal(fw.prefill(arena.row(1), ids[34:], 34), one_shot)
    assert fw.tile_sizes(11) in ((12,), (16,))
    x = torch.randn(16, base[0].down.in_features)
    split_down = PaddedRows(base[0].down, 16, frozenset(), 8)
    assert torch.equal(split_down(x), torch.cat([base[0].down(x[:8]), base[0].down(x[8:])]))


def test_tile_plan():
    assert plan_tiles(300, 256) == (256, 256)
    assert plan_tiles(300, 256, (64, 128, 192)) == (256, 64)
    assert plan_tiles(512 + 129, 256, (64, 128, 192)) == (256, 256, 192)
    assert plan_tiles(200, 256, (64, 128)) == (256,)
    assert plan_tiles(256, 256, (64,)) == (256,)
    assert plan_tiles(1, 16, (4, 8, 12)) == (4,)


def _split_k_below(rows: int) -> type:
    """A fp32 `Linear` that, below ``rows`` rows, sums the two halves of K separately (another summation order:
    what a GEMM library's small-M path can do)."""
    from pcr_rag.model.weights import Linear

    class SplitK(Linear):
        def __init__(self, w, b):
            self.w, self.in_features, self.out_features, self.nbytes = w, w.shape[1], w.shape[0], w.nbytes

        def __call__(self, x):
            if x.shape[0] >= rows:
                return x @ self.w.T
            h = self.in_features // 2
            return x[:, :h] @ self.w[:, :h].T + x[:, h:] @ self.w[:, h:].T

    return SplitK


def test_probe_pads_a_linear_whose_rows_depend_on_m():
    """A kernel that sums in another order below the full tile (like oneDNN's K=1536 GEMM here) is caught by the
    probe's cancelling inputs and padded to full tiles; an exact one is not."""
    from pcr_rag.model.tile_probe import exact_row_counts

    SplitK = _split_k_below(16)
    kw = dict(bias=False, tile=16, candidates=(4, 8, 12), dtype=torch.float32, device=torch.device("cpu"))
    assert exact_row_counts(SplitK, 96, 40, kind="test-split-k", **kw) == frozenset()
    exact = exact_row_counts(lambda w, b: PaddedRows(SplitK(w, b), 16, frozenset({4, 8, 12})), 96, 40,
                             kind="test-padded", **kw)
    assert exact == frozenset({4, 8, 12})
    # full tiles run as two 8-row calls take the small-M path too: every short size is exact against them
    assert exact_row_counts(SplitK, 96, 40, kind="test-split-k", split=8, **kw) == frozenset({4, 8, 12})


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_step_paused_between_layers_computes_the_same_numbers(arch, dtype):
    """`prefill_layers` one layer at a time, with decode steps of other rows and another row's step in between
    (what the engine runs under the ITL budget), writes the KV and yields the logits of one `prefill` call."""
    fw = _forward(arch, dtype)
    ids = _ids(40)
    arena = fw.new_arena(4, 64)
    whole = fw.prefill(arena.row(0), ids, 0)
    fw.prefill(arena.row(2), _ids(21, seed=3), 0, want_logits=False)
    first = fw.prefill_layers(arena.row(1), ids[:24], 0, want_logits=False)
    layers = len(fw.layers)
    for li in range(layers):
        done, result = run_layers(first, 1)
        assert done == (li == layers - 1) and result is None
        fw.decode(arena, [None, None, 2, None], torch.tensor([0, 0, 7, 0]), torch.tensor([0, 0, 21 + li, 0]))
        if li == 0:  # a third row's whole step while this one is paused
            fw.prefill(arena.row(3), _ids(9, seed=5), 0)
    second, done, calls = fw.prefill_layers(arena.row(1), ids[24:], 24), False, 0
    while not done:
        done, logits = run_layers(second, 2)
        calls += 1
        fw.decode(arena, [None, None, 2, None], torch.tensor([0, 0, 8, 0]), torch.tensor([0, 0, 21 + calls, 0]))
    assert calls == -(-layers // 2) and torch.equal(logits, whole)
    for layer in range(layers):
        assert torch.equal(arena.k[layer][0, :, :40], arena.k[layer][1, :, :40])
        assert torch.equal(arena.v[layer][0, :, :40], arena.v[layer][1, :, :40])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_row_does_not_depend_on_its_batch(arch, dtype):
    """A row's logits are the same alone, with company, and in another batch position."""
    fw = _forward(arch, dtype)
    arena = fw.new_arena(4, 64)
    prompts = [_ids(n, seed=n) for n in (20, 33, 41)]
    for r, ids in enumerate(prompts):
        fw.prefill(arena.row(r), ids, 0, want_logits=False)
    alone = fw.decode(arena, [0, None, None, None], torch.tensor([9, 0, 0, 0]), torch.tensor([20, 0, 0, 0]))[0]
    crowded = fw.decode(arena, [2, 1, None, 0], torch.tensor([11, 12, 0, 9]), torch.tensor([41, 33, 0, 20]))
    assert torch.equal(crowded[3], alone)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fewer_active_rows_run_fewer_gemm_rows_with_the_same_numbers(arch, dtype):
    """With 1-3 of 4 rows active a step runs its GEMMs at the smallest proven-exact row count that holds them; every
    active row's logits equal those of the fixed 4-row step bit for bit, wherever the row sits in the batch."""
    fw = _forward(arch, dtype)
    assert all(m < fw.batch_rows for m in fw.decode_sizes)
    assert [fw.decode_rows_for(k) for k in range(1, 5)] == [
        next((m for m in fw.decode_sizes if m >= k), 4) for k in range(1, 5)]
    arena = fw.new_arena(4, 64)
    for r, n in enumerate((20, 33, 41)):
        fw.prefill(arena.row(r), _ids(n, seed=n), 0, want_logits=False)
    tokens, positions = torch.tensor([9, 11, 12, 0]), torch.tensor([20, 33, 41, 0])
    for rows in ([0, None, None, None], [None, None, 2, None], [None, 1, 2, None], [0, 1, 2, None]):
        fixed = fw.decode(arena, rows, tokens, positions, fixed_rows=True)
        fewer = fw.decode(arena, rows, tokens, positions)
        for i, r in enumerate(rows):
            if r is not None:
                assert torch.equal(fewer[i], fixed[i]), (rows, i)


def test_decode_row_counts_are_used_only_where_the_probe_proves_them():
    """A linear that sums in another order below the decode batch's row count gets no smaller decode steps."""
    SplitKBelowBatch = _split_k_below(4)

    class RowByRow(SplitKBelowBatch):
        """Exact by construction: one matrix-vector product per row, whatever the row count."""

        def __call__(self, x):
            return torch.stack([self.w @ row for row in x])

    fw = _forward("llama", torch.float32)
    exact = RowByRow
    assert fw._exact_decode_sizes((1, 2), exact, exact, "test-exact") == (1, 2)
    assert fw._exact_decode_sizes((1, 2), SplitKBelowBatch, exact, "test-split-k") == ()
    assert fw._exact_decode_sizes((1, 2), exact, SplitKBelowBatch, "test-split-k-head") == ()


@pytest.mark.parametrize(("weights", "min_cosine"), [("int8", 0.99), ("int4", 0.85)])
def test_quantized_weights_keep_both_invariants_and_stay_close(weights, min_cosine):
    """Both invariants hold for quantized formats; logits stay close to the dense ones (random tiny weights are
    Gaussian, the worst case for 4 bits: real-model quality is the kernel bench's perplexity column)."""
    dense = _forward("llama", torch.bfloat16)
    fw = _forward("llama", torch.bfloat16, weights=weights)
    ids = _ids(50)
    arena = fw.new_arena(2, 64)
    one_shot = fw.prefill(arena.row(0), ids, 0)
    fw.prefill(arena.row(1), ids[:23], 0, want_logits=False)
    assert torch.equal(fw.prefill(arena.row(1), ids[23:], 23), one_shot)
    ref = dense.prefill(dense.new_arena(1, 64).row(0), ids, 0)
    cos = torch.nn.functional.cosine_similarity(one_shot.float(), ref.float(), dim=0)
    assert cos > min_cosine, cos
    alone = fw.decode(arena, [0, None, None, None], torch.tensor([9, 0, 0, 0]), torch.tensor([50, 0, 0, 0]))[0]
    crowded = fw.decode(arena, [1, 0, None, None], torch.tensor([9, 9, 0, 0]), torch.tensor([50, 50, 0, 0]))
    assert torch.equal(crowded[1], alone) and torch.equal(crowded[0], alone)
    assert fw.weight_bytes < dense.weight_bytes
    assert weights in fw.plan_id and fw.plan_id != dense.plan_id


def test_rejects_what_it_cannot_run():
    fw = _forward("llama", torch.float32)
    arena = fw.new_arena(1, 16)
    with pytest.raises(ValueError, match="capacity"):
        fw.prefill(arena.row(0), _ids(17), 0)
    with pytest.raises(ValueError, match="exactly 4 rows"):
        fw.decode(arena, [0], torch.tensor([1]), torch.tensor([0]))
    from transformers import GPT2Config, GPT2LMHeadModel

    from pcr_rag.model.model import load_model
    from pcr_rag.testing import tiny_tokenizer

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=320)).eval()
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        FastForward(load_model(gpt2, tiny_tokenizer(), dtype=torch.float32))


@pytest.mark.slow
def test_compiled_row_pieces_keep_both_invariants():
    """compile=True: one static-shape graph per piece and row count, shared by every layer; split- and
    batch-invariant like the eager step (its numbers differ from eager, hence its own plan id)."""
    from torch._dynamo.utils import counters

    eager = _forward("llama", torch.bfloat16)
    fw = _forward("llama", torch.bfloat16, compile=True)
    assert fw.plan_id != eager.plan_id and "compiled" in fw.plan_id
    ids = _ids(40)
    arena = fw.new_arena(4, 64)
    graphs_before = counters["stats"]["unique_graphs"]
    one_shot = fw.prefill(arena.row(0), ids, 0)
    fw.prefill(arena.row(1), ids[:21], 0, want_logits=False)
    assert torch.equal(fw.prefill(arena.row(1), ids[21:], 21), one_shot)
    alone = fw.decode(arena, [0, None, None, None], torch.tensor([9, 0, 0, 0]), torch.tensor([40, 0, 0, 0]))[0]
    crowded = fw.decode(arena, [None, 1, None, 0], torch.tensor([0, 9, 0, 9]), torch.tensor([0, 40, 0, 40]))
    assert torch.equal(crowded[3], alone) and torch.equal(crowded[1], alone)
    assert counters["stats"]["unique_graphs"] - graphs_before <= 4  # 2 pieces x (prefill tile, decode batch)


@pytest.mark.parametrize("arch", ARCHS)
def test_warm_up_changes_no_number(arch):
    """The start-up warm-up runs on the scratch row only: a cold forward and a warmed one agree bit for bit."""
    ids = _ids(40)
    results = []
    for warm in (False, True):
        fw = _forward(arch, torch.bfloat16)
        arena = fw.new_arena(4, 64)
        if warm:
            done = fw.warm_up(arena)
            assert done.seconds > done.prefill_s + done.decode_s > 0 and done.prefill_tokens == 16
        logits = fw.prefill(arena.row(1), ids, 0)
        out = fw.decode(arena, [None, 1, None, None], torch.tensor([0, int(logits.argmax()), 0, 0]),
                        torch.tensor([0, 40, 0, 0]))
        results.append((logits, out[1], arena.k[0][1, :, :41].clone()))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_cheapest_short_tiles_keeps_cost_rising_with_size():
    """A size that costs as much as a larger one (a linear pads it to a full tile) is dropped, so the smallest kept
    size that holds a remainder is the cheapest; with nothing padded every size is kept."""
    from pcr_rag.model.forward import cheapest_short_tiles, plan_tiles

    assert cheapest_short_tiles([16, 32, 48], lambda m: m, 256) == (16, 32, 48)
    padded_16 = {16: 300, 32: 32, 48: 48}  # 16 rows are padded to a full tile by some linear: dearer than 32
    kept = cheapest_short_tiles([16, 32, 48], padded_16.__getitem__, 256)
    assert kept == (32, 48)
    assert plan_tiles(10, 256, kept) == (32,) and plan_tiles(40, 256, kept) == (48,)
    assert cheapest_short_tiles([16, 32], lambda m: 256, 256) == ()  # no cheaper than a full tile: none kept


def test_default_short_tiles_are_fine_grained_where_exact():
    """With the default granularity, a remainder runs in the smallest proven-exact multiple of 8 that holds it
    (never the decode batch's 8 rows), so an 18-token suffix pays a 24-row tile where that is exact, not a 32- or
    64-row one."""
    from pcr_rag.model.forward import SHORT_TILE_ROWS

    fw = _forward("llama", torch.float32, tile_rows=256, attention_block=128, short_tile_rows=SHORT_TILE_ROWS,
                  attention_sub_block=32)
    assert SHORT_TILE_ROWS == 8
    sizes = fw.short_tile_sizes
    assert all(m % 8 == 0 and m < 256 and m != fw.batch_rows for m in sizes) and list(sizes) == sorted(sizes)
    want = min((m for m in sizes if m >= 18), default=256)
    assert fw.tile_sizes(18) == (want,)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_norms_are_bit_identical_to_the_model_modules(arch, dtype):
    """`RMSNorm` (float32: one fused call with the weight; bf16: the model's cast-then-scale order; Gemma: 1 + w in
    float32) gives the transformers module's bits, on hidden rows and on per-head rows."""
    from pcr_rag.model.forward import RMSNorm

    model = tiny_loaded_model(arch, dtype=dtype).model
    layer = model.model.layers[0]
    g = torch.Generator().manual_seed(1)
    modules = [layer.input_layernorm, layer.post_attention_layernorm, model.model.norm]
    for m in modules:
        with torch.no_grad():  # the tiny models' norms start at 1 (or 0 for Gemma): make the weight matter
            m.weight.copy_(torch.randn(m.weight.shape, generator=g).to(dtype))
    x = (torch.randn(5, modules[0].weight.shape[0], generator=g) * 3).to(dtype)
    with torch.inference_mode():
        for m in modules:
            assert torch.equal(RMSNorm.of(m, arch == "gemma3")(x), m(x))
        if hasattr(layer.self_attn, "q_norm"):
            qn = layer.self_attn.q_norm
            heads = torch.randn(5, 2, qn.weight.shape[0], generator=g).to(dtype)
            assert torch.equal(RMSNorm.of(qn, arch == "gemma3")(heads), qn(heads))


def test_short_tiles_never_take_a_decode_row_count():
    """A decode step's row counts (the batch, and 1, 2, 4, ... below it) are never short prefill tile sizes (a
    linear may pad those to a full tile), and a larger decode batch keeps its smaller counts."""
    fw = _forward("llama", torch.float32, tile_rows=64, batch_rows=16, short_tile_rows=8)
    assert not {1, 2, 4, 8, 16} & set(fw.short_tile_sizes)
    assert 8 in fw.decode_sizes and fw.short_tile_sizes and min(fw.short_tile_sizes) == 24

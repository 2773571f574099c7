"""Whether a prefill attention block may compute only the query rows a step needs.

A prefill step computes attention in blocks of `ATTENTION_BLOCK` queries aligned to absolute positions, so that
where a step starts or ends never changes a number. A short step (a cache hit's question, say) needs a few of a
block's rows, and the rest are padding the kernel computes anyway. The step computes the span of ``sub_block``-
aligned rows that holds what it needs, ``[a, b)`` with ``a`` and ``b`` multiples of ``sub_block``, in one call.
Whether a row comes out of such a call with the bits it has in the whole block's call is the kernel's choice, per
version, device and dtype (PyTorch's CPU flash-attention kernel works through the queries in blocks of its own, 32
rows whenever there are fewer than 192 queries, starting at the call's first row), so the forward asks once per
process, for every span a step can make, instead of assuming.

The probe's inputs expose summation order, as the GEMM tile probe's do (`tile_probe`): the queries' features and the
keys' features come in cancelling pairs (``q_a = -q_b`` with ``k_a = k_b``), so the scores are small sums of large
products; and the keys come in pairs with equal keys and opposite values (``v_a = -v_b``, large), so each output is
a small sum of large products whose partial sums a different order rounds differently.
"""

from __future__ import annotations

import torch

PAIRED_MAGNITUDE = 256.0  # exact in bf16
_SEED = 0

_exact_cache: dict[tuple, bool] = {}


def _paired(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two disjoint random index sets of equal size covering all but a few of ``range(n)``."""
    perm = torch.randperm(n, generator=g)[: max(0, n - max(2, n // 8)) // 2 * 2]
    return perm[0::2], perm[1::2]


def probe_inputs(heads: int, kv_heads: int, head_dim: int, queries: int, keys: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q [queries, heads, D]``, ``k``, ``v [1, kv_heads, keys, D]`` in ``dtype`` (see the module docstring)."""
    g = torch.Generator().manual_seed(_SEED)
    q = torch.randn(queries, heads, head_dim, generator=g)
    k = torch.randn(1, kv_heads, keys, head_dim, generator=g) * 0.1
    v = torch.randn(1, kv_heads, keys, head_dim, generator=g)
    da, db = _paired(head_dim, g)
    big = (torch.randn(queries, heads, da.numel(), generator=g) * PAIRED_MAGNITUDE).to(dtype).float()
    q[..., da], q[..., db] = big, -big
    k[..., db] = k[..., da]
    ka, kb = _paired(keys, g)
    k[:, :, kb] = k[:, :, ka]
    vbig = (torch.randn(1, kv_heads, ka.numel(), head_dim, generator=g) * PAIRED_MAGNITUDE).to(dtype).float()
    v[:, :, ka], v[:, :, kb] = vbig, -vbig
    return (q.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype))


def sub_blocks_exact(attend, *, block: int, sub_block: int, heads: int, kv_heads: int, head_dim: int,
                     windows: tuple[int | None, ...], dtype: torch.dtype, device: torch.device) -> bool:
    """True when every ``sub_block``-aligned span of a query block (rows ``[a, b)``, both multiples of
    ``sub_block``) gives, through ``attend``, the same bits as those rows of the whole block, on the probe inputs,
    for blocks at several positions and every attention window in ``windows``. ``attend(q [rows, heads, D] view of
    a block buffer, rows (a, b), block index, k, v, window) -> [rows, heads * D]`` is the forward's own call. Cached
    per process by shape, dtype, device and thread count."""
    key = (block, sub_block, heads, kv_heads, head_dim, windows, dtype, str(device), torch.get_num_threads())
    found = _exact_cache.get(key)
    if found is not None:
        return found
    exact = all(_spans_match(attend, block, sub_block, blocks, window,
                             probe_inputs(heads, kv_heads, head_dim, block, blocks * block, dtype, device))
                for blocks in (1, 3, 7)  # keys: one block, a few, and past the kernel's 512-key split
                for window in windows)
    _exact_cache[key] = exact
    return exact


def _spans_match(attend, block: int, sub_block: int, blocks: int, window: int | None,
                 qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> bool:
    """Every aligned span of the last of ``blocks`` query blocks equals those rows of the whole block (stops at
    the first that differs)."""
    q, k, v = qkv
    whole = attend(q, (0, block), blocks - 1, k, v, window)
    return all(torch.equal(attend(q, (a, b), blocks - 1, k, v, window), whole[a:b])
               for a in range(0, block, sub_block) for b in range(a + sub_block, block + 1, sub_block)
               if (a, b) != (0, block))

__all__ = ["PAIRED_MAGNITUDE", "probe_inputs", "sub_blocks_exact"]

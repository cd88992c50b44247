"""A key a row may not attend never reaches that row, whatever it holds and whatever the tiles.

A KV cache's unused slots hold garbage (inf, NaN) behind a padding mask, and a causal row must
not see the keys after it. A masked pair weighs exactly 0, but 0 · inf = NaN in IEEE arithmetic,
so the contract is checked with non-finite values planted at masked and allowed keys, for both
kernels and any block size:

* a row that may attend no planted key is bit-for-bit what it is with those values replaced by 0;
* a row that may attend a planted key is not all finite (it gets IEEE's NaN or ±inf), unless
  the planted value is ±inf in k and makes the score -inf, which weighs 0 like a masked pair;
* a fully masked row is exactly 0 with lse -inf;
* no floating-point warning.
"""

import warnings

import numpy as np
import pytest
from helpers import random_qkv, tiled_shapes
from hypothesis import given, note
from hypothesis import strategies as st

import _flash_masked
import flash_lib
from flash_lib import causal_mask, flash_attention, naive_attention

POISONS = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}


def kernels(block_q, block_k):
    return {
        "flash": lambda *a, **kw: flash_attention(*a, block_q=block_q, block_k=block_k, **kw),
        "naive": naive_attention,
    }


@given(
    **tiled_shapes((1, 24), (1, 24), 29),
    masked=st.sampled_from(["none", "random", "padding"]),
    where=st.sampled_from(["k", "v", "both"]),
    poison=st.sampled_from(sorted(POISONS)),
    data=st.data(),
)
def test_non_finite_keys_reach_exactly_the_rows_allowed_to_attend_them(
    n_q, n_k, block_q, block_k, causal, masked, where, poison, data
):
    rng = np.random.default_rng(n_q * 100 + n_k)
    q, k, v = random_qkv(rng, n_q, n_k, 4, dv=3, batch=(2,))
    mask = None
    if masked == "random":
        mask = rng.random((2, n_q, n_k)) < 0.5
    elif masked == "padding":  # the last keys of each sequence are unused cache slots
        mask = np.broadcast_to(np.arange(n_k) < data.draw(st.integers(0, n_k)), (n_q, n_k))
    planted = data.draw(st.lists(st.integers(0, n_k - 1), min_size=1, max_size=4, unique=True))
    note(f"planted {poison} in {where} at keys {planted}")
    dirty_k, dirty_v, clean_k, clean_v = k.copy(), v.copy(), k.copy(), v.copy()
    for j in planted:
        c = j % 3  # one feature column, so other columns show what reaches them
        if where in ("k", "both"):
            dirty_k[:, j, c], clean_k[:, j, c] = POISONS[poison], 0
        if where in ("v", "both"):
            dirty_v[:, j, c], clean_v[:, j, c] = POISONS[poison], 0
    allowed = np.ones((2, n_q, n_k), bool)
    if mask is not None:
        allowed &= mask
    if causal:
        allowed &= causal_mask(n_q, n_k)
    reaches = allowed[..., planted].any(axis=-1)  # (2, n_q): rows that may attend a planted key
    # A planted value always shows in such a row, except ±inf in k alone: the score is then
    # ±inf by the sign of q, and a score of -inf weighs 0, as a masked pair does.
    shows = reaches if (where != "k" or poison == "nan") else np.zeros_like(reaches)
    empty = ~allowed.any(axis=-1)
    for name, kernel in kernels(block_q, block_k).items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, lse = kernel(q, dirty_k, dirty_v, mask=mask, causal=causal, return_lse=True)
        clean_out, clean_lse = kernel(q, clean_k, clean_v, mask=mask, causal=causal,
                                      return_lse=True)
        np.testing.assert_array_equal(out[~reaches], clean_out[~reaches], err_msg=name)
        np.testing.assert_array_equal(lse[~reaches], clean_lse[~reaches], err_msg=name)
        assert not np.isfinite(out[shows]).all(axis=-1).any(), name
        assert np.all(out[empty] == 0) and np.all(lse[empty] == -np.inf), name


@pytest.mark.parametrize("block", [1, 2, 3, 8, 512])
@pytest.mark.parametrize("kernel", ["flash", "naive"])
def test_a_kv_cache_with_garbage_in_its_unused_slots(kernel, block):
    """The motivating case: 20 of 32 cache slots used, the other 12 full of NaN and ±inf in k
    and v, hidden by a key-padding mask; one decoding query, and a causal prefill of 20. Both
    equal attention over the 20 used slots alone. (Before, this held for block 1 only: with
    larger tiles the garbage turned every row NaN.)"""
    attend = kernels(block, block)[kernel]
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 20, 32, 8, batch=(3,))
    used = np.arange(32) < 20
    k[:, ~used] = rng.choice([np.nan, np.inf, -np.inf], size=(3, 12, 8))
    v[:, ~used] = rng.choice([np.nan, np.inf, -np.inf], size=(3, 12, 8))
    decode = attend(q[:, -1:], k, v, mask=used[None, :])
    decode_ref = attend(q[:, -1:], k[:, :20], v[:, :20])
    prefill = attend(q, k, v, mask=np.tri(20, 32, dtype=bool) & used)
    prefill_ref = attend(q, k[:, :20], v[:, :20], causal=True)
    for out, ref in ((decode, decode_ref), (prefill, prefill_ref)):
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-15)


@given(
    rows=st.integers(1, 6),
    keys=st.integers(1, 6),
    cols=st.integers(1, 4),
    data=st.data(),
)
def test_matmul_over_allowed_pairs_matches_the_sum_of_its_terms(rows, keys, cols, data):
    """``_flash_masked.matmul_allowed(a, b)`` (flash_lib's private helper) against the plain sum of the allowed terms ``a_ij · b_jc``, with
    a holding zeros, negatives and NaN (weights and gradients are never infinite) and b rows of
    ±inf and NaN: the same class (NaN, +inf, -inf or finite) in every entry, and the finite
    entries equal to rounding."""
    values = st.sampled_from([0.0, 1.5, -2.0, 1e-300, np.nan])
    a = np.array(data.draw(st.lists(values, min_size=rows * keys, max_size=rows * keys)))
    values = st.sampled_from([0.0, 1.5, -2.0, 1e-300, np.nan, np.inf, -np.inf])
    b = np.array(data.draw(st.lists(values, min_size=keys * cols, max_size=keys * cols)))
    a, b = a.reshape(rows, keys), b.reshape(keys, cols)
    allowed = np.array(data.draw(st.lists(st.booleans(), min_size=rows * keys,
                                          max_size=rows * keys))).reshape(rows, keys)
    a = np.where(allowed, a, 0.0)  # the kernels' weights are exactly 0 where not allowed
    bad = np.flatnonzero(~np.isfinite(b).all(axis=-1))
    with np.errstate(all="ignore"):
        expected = np.where(allowed[..., None], a[..., None] * b[None], 0).sum(axis=-2)
        got = _flash_masked.matmul_allowed(a, b, allowed=allowed, bad=bad)
    for cls in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(cls(got), cls(expected), err_msg=cls.__name__)
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-12, atol=1e-300)

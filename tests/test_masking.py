"""Masks, causal masking, the tile schedule, and NaN: the conventions of flash_lib's docstring.

* a row with no allowed key gives out exactly 0.0 and lse -inf, with no warning;
* causal is aligned bottom-right: key j allowed for query i iff j <= i + (Nk - Nq);
* the kernel computes exactly the tiles ``tile_schedule`` lists, about half of them when causal;
* an inf or NaN at key j reaches exactly the rows that may attend key j;
* a NaN in row i of q makes row i NaN and leaves every other row bit-for-bit unchanged.
"""

import warnings
from contextlib import contextmanager

import numpy as np
import pytest
from helpers import FLOAT_DTYPES, random_qkv, rowwise_rel_error, tiled_shapes
from hypothesis import given, note
from hypothesis import strategies as st

import flash_lib
from flash_lib import causal_mask, flash_attention, naive_attention, tile_schedule

KERNELS = {
    "flash": lambda *a, **kw: flash_attention(*a, block_q=2, block_k=3, **kw),
    "flash-1x1": lambda *a, **kw: flash_attention(*a, block_q=1, block_k=1, **kw),
    "flash-default": flash_attention,
    "naive": naive_attention,
}


@contextmanager
def strict_floating_point():
    """Any floating-point warning (divide, overflow, invalid) becomes an exception."""
    with warnings.catch_warnings(), np.errstate(divide="raise", over="raise", invalid="raise"):
        warnings.simplefilter("error")
        yield


# ---------------------------------------------------------------------------------------------
# Fully masked rows
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["mask", "causal", "mask and causal"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_fully_masked_rows_are_exact_zeros_with_lse_minus_inf(kernel, dtype, how):
    """Rows with no allowed key (by mask, by causal with Nq > Nk, or by both) come out exactly
    0.0 with lse -inf, under warnings-as-errors and np.errstate(raise); every other row is
    finite. With causal Nq=11 > Nk=7, queries 0..3 have no key."""
    n_q, n_k = 11, 7
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, n_q, n_k, 4, dv=5, dtype=dtype, batch=(2,))
    use_mask, causal = how != "causal", how != "mask"
    mask = rng.random((2, n_q, n_k)) < 0.8
    mask[:, :, -1] = True  # the last key stays allowed, so other rows are not empty by chance
    mask[0, [5, 9]] = False
    mask[1, 4] = False
    allowed = (mask if use_mask else True) & (
        causal_mask(n_q, n_k) if causal else True
    )
    empty = ~np.broadcast_to(allowed, (2, n_q, n_k)).any(axis=-1)
    assert empty.any() and not empty.all()

    with strict_floating_point():
        out, lse = KERNELS[kernel](
            q, k, v, mask=mask if use_mask else None, causal=causal, return_lse=True
        )
        out_only = KERNELS[kernel](q, k, v, mask=mask if use_mask else None, causal=causal)

    assert np.all(out[empty] == 0) and np.all(lse[empty] == -np.inf)
    assert np.all(np.isfinite(out[~empty])) and np.all(np.isfinite(lse[~empty]))
    np.testing.assert_array_equal(out_only, out)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_fully_masked_batch_element(kernel, dtype):
    """A batch element whose whole mask is False is all zeros / -inf; the others are, bit for
    bit, what the same kernel computes for them alone (the empty one does not disturb its
    neighbours), and within a few eps of naive's."""
    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, 9, 6, 4, dtype=dtype, batch=(3,))
    mask = rng.random((3, 9, 6)) < 0.7
    mask[..., 0] = True
    mask[1] = False
    with strict_floating_point():
        out, lse = KERNELS[kernel](q, k, v, mask=mask, causal=True, return_lse=True)
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf)
    for b in (0, 2):
        alone, lse_alone = KERNELS[kernel](q[b], k[b], v[b], mask=mask[b], causal=True,
                                           return_lse=True)
        np.testing.assert_array_equal(out[b], alone)
        np.testing.assert_array_equal(lse[b], lse_alone)
        # 8 eps: flash in base 2 (flash_lib.exponential) rounds k·log2(e) and the lse's
        # conversion too; measured 2.6 eps (float64) and 2.1 (float32) on AVX-512
        naive = naive_attention(q[b], k[b], v[b], mask=mask[b], causal=True)
        assert rowwise_rel_error(out[b], naive) <= 8 * np.finfo(dtype).eps


@pytest.mark.parametrize("kernel", KERNELS)
def test_an_all_false_key_padding_mask_and_no_keys_at_all(kernel):
    """A key-padding mask (..., 1, Nk) that is all False, and Nk = 0, empty every row."""
    q, k, v = random_qkv(np.random.default_rng(9), 5, 4, 3, dv=2, batch=(2,))
    with strict_floating_point():
        out, lse = KERNELS[kernel](q, k, v, mask=np.zeros((2, 1, 4), bool), return_lse=True)
        out0, lse0 = KERNELS[kernel](q, k[:, :0], v[:, :0], causal=True, return_lse=True)
    for o, s in ((out, lse), (out0, lse0)):
        assert o.shape == (2, 5, 2) and np.all(o == 0) and np.all(s == -np.inf)


# ---------------------------------------------------------------------------------------------
# Causal: bottom-right alignment
# ---------------------------------------------------------------------------------------------

SHAPES = [(7, 7), (5, 12), (12, 5), (1, 9), (9, 1), (33, 64), (64, 33), (40, 40)]


@pytest.mark.parametrize("n_q, n_k", SHAPES)
@pytest.mark.parametrize("block_q, block_k", [(1, 1), (3, 5), (16, 8), (70, 70)])
def test_causal_equals_the_explicit_bottom_right_mask(n_q, n_k, block_q, block_k):
    """causal=True is exactly mask=tril(ones, k=Nk-Nq) (j <= i + Nk - Nq), in both kernels and
    combined with a user mask; flash equals naive up to rounding."""
    rng = np.random.default_rng(n_q * 100 + n_k)
    q, k, v = random_qkv(rng, n_q, n_k, 6, dv=3, batch=(2,))
    tril = causal_mask(n_q, n_k)
    user = rng.random((2, n_q, n_k)) < 0.6
    flash = dict(block_q=block_q, block_k=block_k, return_lse=True)
    for mask in (None, user):
        explicit = tril if mask is None else tril & mask
        causal = flash_attention(q, k, v, mask=mask, causal=True, **flash)
        masked = flash_attention(q, k, v, mask=explicit, **flash)
        ref = naive_attention(q, k, v, mask=mask, causal=True, return_lse=True)
        ref_masked = naive_attention(q, k, v, mask=explicit, return_lse=True)
        for a, b in zip(causal, masked):
            # Skipped tiles contribute exactly nothing, so not even rounding may differ.
            np.testing.assert_array_equal(a, b)
        for a, b in zip(ref, ref_masked):
            np.testing.assert_array_equal(a, b)
        assert rowwise_rel_error(causal[0], ref[0]) <= 1e-13


@pytest.mark.parametrize("n_k", [1, 2, 7, 64, 1000])
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_single_query_sees_every_key(kernel, n_k):
    """Nq = 1 (decoding): bottom-right causal allows every key, so causal equals non-causal."""
    q, k, v = random_qkv(np.random.default_rng(n_k), 1, n_k, 8, batch=(3,))
    causal = KERNELS[kernel](q, k, v, causal=True, return_lse=True)
    full = KERNELS[kernel](q, k, v, return_lse=True)
    for a, b in zip(causal, full):
        np.testing.assert_array_equal(a, b)
    assert np.all(np.isfinite(causal[1]))


# ---------------------------------------------------------------------------------------------
# The tile schedule, and that the kernel computes exactly it
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_blocks", [1, 2, 3, 8, 33])
@pytest.mark.parametrize("block", [1, 16, 64])
@pytest.mark.parametrize("partial", [0, 1])
def test_causal_square_schedule_visits_about_half_the_tiles(n_blocks, block, partial):
    """Causal, Nq = Nk, block_q = block_k: with n blocks per side the schedule visits exactly
    n(n+1)/2 of the n² tiles (the diagonal and below), also when the last block is partial."""
    n = n_blocks * block - (partial if block > 1 else 0)
    causal = tile_schedule(n, n, block, block, causal=True)
    assert len(tile_schedule(n, n, block, block)) == n_blocks**2
    assert len(causal) == n_blocks * (n_blocks + 1) // 2
    assert all(k_start <= q_start for q_start, _, k_start, _ in causal)


def test_causal_schedule_with_unequal_blocks_visits_about_half():
    """With block_k = 2·block_q the causal share of tiles still tends to 1/2 (within 1/n)."""
    visited = len(tile_schedule(4096, 4096, 64, 128, causal=True))
    total = len(tile_schedule(4096, 4096, 64, 128))
    assert 0.5 <= visited / total <= 0.5 + 1 / 32


@given(**tiled_shapes((0, 40), (0, 40), 45))
def test_tile_schedule_covers_every_allowed_pair_exactly_once(n_q, n_k, block_q, block_k, causal):
    """The schedule is the block grid minus the tiles with no allowed pair: tiles lie within
    bounds on the grid, come in order (q blocks outer, k blocks inner), cover every allowed
    (i, j) exactly once, and each holds at least one allowed pair (nothing computed in vain)."""
    schedule = tile_schedule(n_q, n_k, block_q, block_k, causal=causal)
    allowed = causal_mask(n_q, n_k) if causal else np.ones((n_q, n_k), bool)
    covered = np.zeros((n_q, n_k), int)
    for q_start, q_stop, k_start, k_stop in schedule:
        assert q_start % block_q == 0 and q_stop == min(q_start + block_q, n_q)
        assert k_start % block_k == 0 and k_stop == min(k_start + block_k, n_k)
        assert 0 <= q_start < q_stop <= n_q and 0 <= k_start < k_stop <= n_k
        assert allowed[q_start:q_stop, k_start:k_stop].any()
        covered[q_start:q_stop, k_start:k_stop] += 1
    assert schedule == sorted(schedule)
    assert np.all(covered[allowed] == 1) and np.all(covered <= 1)


def test_nan_keys_reach_exactly_the_rows_that_may_attend_them_under_causal():
    """Causal, 8 × 8 blocks of 16: NaN in the keys and values of key block j reaches exactly the
    rows i >= 16·j (each may attend key 16·j); the rows above stay bit-for-bit clean, although
    the diagonal tile multiplies their 0 weights with those NaN values."""
    n, block = 128, 16
    q, k, v = random_qkv(np.random.default_rng(5), n, n, 8)
    clean = flash_attention(q, k, v, causal=True, block_q=block, block_k=block)
    for j in range(n // block):
        keys = slice(j * block, (j + 1) * block)
        k_bad, v_bad = k.copy(), v.copy()
        k_bad[keys] = np.nan
        v_bad[keys] = np.nan
        out = flash_attention(q, k_bad, v_bad, causal=True, block_q=block, block_k=block)
        np.testing.assert_array_equal(out[: j * block], clean[: j * block])
        assert np.isnan(out[j * block :]).all()


@given(**tiled_shapes((1, 30), (1, 30), 35), masked=st.booleans())
def test_kernel_computes_exactly_the_scheduled_tiles(n_q, n_k, block_q, block_k, causal, masked):
    """The kernel multiplies exactly the tiles ``tile_schedule`` lists, each once, and no others.

    Watched through the public ``online_softmax_update``, which folds in every tile the kernel
    multiplies: column 0 of ``v`` holds each key's index, so a tile's keys are read off the
    values it is given, and on one worker the tiles come in the schedule's order, each of its
    block's height. (The output cannot show a tile with no allowed pair being computed: masked
    keys never leak.)"""
    seen = []
    update = flash_lib.online_softmax_update

    def recording_update(m, l, acc, s, v, matmul, exp, threshold):
        seen.append((s.shape[-2], s.shape[-1], int(v[0, 0]), int(v[-1, 0]) + 1))
        return update(m, l, acc, s, v, matmul, exp, threshold)

    q, k, v = random_qkv(np.random.default_rng(n_q * 31 + n_k), n_q, n_k, 3, dv=2)
    v[:, 0] = np.arange(n_k)
    mask = np.random.default_rng(n_q).random((n_q, n_k)) < 0.7 if masked else None
    with pytest.MonkeyPatch.context() as patch, flash_lib.threads(1):
        patch.setattr(flash_lib, "online_softmax_update", recording_update)
        flash_attention(q, k, v, mask=mask, causal=causal, block_q=block_q, block_k=block_k)
    schedule = tile_schedule(n_q, n_k, block_q, block_k, causal)
    assert seen == [(b - a, d - c, c, d) for a, b, c, d in schedule]


# ---------------------------------------------------------------------------------------------
# NaN
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("row", [0, 6, 9])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_nan_in_a_query_row_stays_in_that_row(kernel, dtype, causal, row):
    """A NaN in row i of q makes out[i] and lse[i] NaN (never a silent 0), and every other row
    is bit-for-bit what it is without that NaN (the row replaced by zeros), with no warning."""
    rng = np.random.default_rng(row)
    q, k, v = random_qkv(rng, 10, 12, 4, dv=3, dtype=dtype, batch=(2,))
    mask = rng.random((10, 12)) < 0.8
    mask[:, -1] = True
    mask[3] = False  # a fully masked row nearby must stay exactly 0
    clean_q = q.copy()
    clean_q[1, row] = 0
    q[1, row, 2] = np.nan
    with strict_floating_point():
        out, lse = KERNELS[kernel](q, k, v, mask=mask, causal=causal, return_lse=True)
    clean_out, clean_lse = KERNELS[kernel](clean_q, k, v, mask=mask, causal=causal, return_lse=True)

    assert np.isnan(out[1, row]).all() and np.isnan(lse[1, row])
    others = np.ones((2, 10), bool)
    others[1, row] = False
    np.testing.assert_array_equal(out[others], clean_out[others])
    np.testing.assert_array_equal(lse[others], clean_lse[others])
    assert np.all(out[:, 3] == 0)


@given(**tiled_shapes((0, 30), (0, 30), 12),
       window=st.sampled_from([None, (3, 0), (0, None), (5, 2)]))
def test_tile_schedule_of_listed_block_sizes_is_the_one_of_even_blocks(n_q, n_k, block_q, block_k,
                                                                       causal, window):
    """block_q and block_k given as lists of sizes (Dask's chunks, as flash_dask passes them)
    schedule exactly the tiles of the same blocks given as one size; empty blocks never appear."""
    def sizes(n, b):
        listed = [min(b, n - s) for s in range(0, n, b)]
        return [0] + listed[:1] + [0] + listed[1:]  # empty blocks anywhere are skipped

    even = tile_schedule(n_q, n_k, block_q, block_k, causal, window=window)
    listed = tile_schedule(n_q, n_k, sizes(n_q, block_q), tuple(sizes(n_k, block_k)), causal,
                           window=window)
    assert listed == even


def test_tile_schedule_refuses_block_sizes_that_do_not_tile_the_sequence():
    with pytest.raises(ValueError, match=r"block_q's sizes must sum to 10, got \(3, 3\)"):
        tile_schedule(10, 8, [3, 3], 4)
    with pytest.raises(ValueError, match="each of block_k's sizes must be a non-negative integer"):
        tile_schedule(10, 8, 5, [4, -1, 5])
    with pytest.raises(ValueError, match="block_k must be a positive integer, got 0"):
        tile_schedule(10, 8, 5, 0)

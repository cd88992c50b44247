"""merge_attention: attention over disjoint key sets combines exactly into attention over all.

This is the operation behind split-KV (flash-decoding) and ring attention: each part returns
its ``(out, lse)`` and the parts are merged pairwise, in any order and grouping.
"""

import warnings

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from flash_lib import causal_mask, flash_attention, merge_attention


def merge_in_order(parts, order, tree):
    """Merge ``parts`` (a list of (out, lse)) taken in ``order``: left to right, or as a
    balanced tree (pairs first, then pairs of pairs), two of the groupings ring/split-KV use."""
    items = [parts[i] for i in order]
    if not tree:
        acc = items[0]
        for item in items[1:]:
            acc = merge_attention(*acc, *item)
        return acc
    while len(items) > 1:
        merged = [merge_attention(*a, *b) for a, b in zip(items[::2], items[1::2])]
        items = merged + items[len(merged) * 2 :]
    return items[0]


@given(
    n_q=st.integers(1, 40),
    n_k=st.integers(0, 60),
    n_parts=st.integers(2, 5),
    dtype=st.sampled_from([np.float64, np.float32]),
    masking=st.sampled_from(["none", "random", "causal"]),
    tree=st.booleans(),
    data=st.data(),
)
def test_merged_key_chunks_equal_attention_over_all_keys(
    n_q, n_k, n_parts, dtype, masking, tree, data
):
    """Keys cut into 2..5 chunks (some empty: Nk = 0 or fully masked), each attended with
    return_lse=True, merged in a random order and grouping: equals attention over all keys.
    Rows with no allowed key are exactly 0 / -inf. Tolerances per row: each merge weighs a part
    by exp(lse_part - lse), whose argument is rounded at |lse|'s magnitude, so the weights carry
    a relative error of ~eps·(1 + |lse|); out, a convex combination of v's rows, then moves by
    that much times max|v|. Asked: out within 4·eps·(1 + |lse|)·max|v|, lse within
    8·eps·(1 + |lse|); over 26 000 random examples the worst were 1.1 and 2 of those units."""
    cuts = sorted(
        data.draw(st.lists(st.integers(0, n_k), min_size=n_parts - 1, max_size=n_parts - 1))
    )
    bounds = list(zip([0] + cuts, cuts + [n_k]))
    order = data.draw(st.permutations(range(n_parts)), label="order")
    rng = np.random.default_rng(n_q * 1000 + n_k)
    q, k, v = (x.astype(dtype) for x in (rng.standard_normal((2, n, 5)) for n in (n_q, n_k, n_k)))
    mask = None
    if masking == "random":
        mask = rng.random((2, n_q, n_k)) < 0.6
        mask[:, ::4] = False
    elif masking == "causal":  # causal as an explicit mask: its alignment uses the global Nk
        mask = causal_mask(n_q, n_k)
    note(f"chunks {bounds}, merged in order {order}, {'tree' if tree else 'left to right'}")

    parts = [
        flash_attention(
            q,
            k[:, a:b],
            v[:, a:b],
            mask=None if mask is None else mask[..., a:b],
            block_q=7,
            block_k=5,
            return_lse=True,
        )
        for a, b in bounds
    ]
    with warnings.catch_warnings(), np.errstate(divide="raise", over="raise", invalid="raise"):
        warnings.simplefilter("error")
        out, lse = merge_in_order(parts, order, tree)
    ref, ref_lse = flash_attention(q, k, v, mask=mask, block_q=7, block_k=5, return_lse=True)

    assert out.dtype == dtype and lse.dtype == dtype
    empty = ref_lse == -np.inf
    np.testing.assert_array_equal(lse == -np.inf, empty)
    assert np.all(out[empty] == 0)
    eps = np.finfo(dtype).eps
    size = 1 + np.abs(ref_lse[~empty])
    out_err = np.abs(out - ref).max(axis=-1)[~empty] / np.abs(v).max(initial=0)
    assert np.all(out_err <= 4 * eps * size)
    assert np.all(np.abs(lse[~empty] - ref_lse[~empty]) <= 8 * eps * size)


def random_part(rng, shape=(3, 6), dv=4, empty_rows=()):
    """A random (out, lse) pair with the given rows empty (0 and -inf), as a kernel returns."""
    out = rng.standard_normal(shape + (dv,))
    lse = rng.standard_normal(shape) * 30
    for r in empty_rows:
        out[..., r, :] = 0
        lse[..., r] = -np.inf
    return out, lse


def test_merge_is_exactly_symmetric():
    """merge(a, b) == merge(b, a) bit for bit, including rows where either part is empty."""
    rng = np.random.default_rng(0)
    a = random_part(rng, empty_rows=[1, 4])
    b = random_part(rng, empty_rows=[4, 5])
    for x, y in zip(merge_attention(*a, *b), merge_attention(*b, *a)):
        np.testing.assert_array_equal(x, y)


def test_merge_with_an_empty_part_is_the_identity():
    """Merging with a part that has no keys (out 0, lse -inf) returns the other part exactly."""
    rng = np.random.default_rng(1)
    a = random_part(rng)
    empty = np.zeros_like(a[0]), np.full_like(a[1], -np.inf)
    for merged in (merge_attention(*a, *empty), merge_attention(*empty, *a)):
        np.testing.assert_array_equal(merged[0], a[0])
        np.testing.assert_array_equal(merged[1], a[1])


def test_merge_of_two_empty_parts_is_empty_without_warnings():
    """Both parts empty: out 0 and lse -inf, with no floating-point warning."""
    out = np.zeros((2, 3, 4), np.float32)
    lse = np.full((2, 3), -np.inf, np.float32)
    with warnings.catch_warnings(), np.errstate(divide="raise", over="raise", invalid="raise"):
        warnings.simplefilter("error")
        m_out, m_lse = merge_attention(out, lse, out, lse)
    assert np.all(m_out == 0) and np.all(m_lse == -np.inf)


def test_merge_weights_each_part_by_its_lse():
    """A worked case: equal lse gives the mean; lse differing by log 3 gives weights 3/4, 1/4;
    the merged lse is log(e^lse_a + e^lse_b), also for huge lse (no overflow)."""
    out_a, out_b = np.array([[1.0, 0.0]]), np.array([[0.0, 1.0]])
    for base in (0.0, 1e4):
        # base + log 3 is rounded at base's magnitude, which limits what can be asked
        rtol = 4 * np.finfo(float).eps * (1 + base)
        lse_a = np.array([base + np.log(3)])
        out, lse = merge_attention(out_a, lse_a, out_b, np.array([base]))
        np.testing.assert_allclose(out, [[0.75, 0.25]], rtol=rtol)
        np.testing.assert_allclose(lse, [base + np.log(4)], rtol=rtol)
        out, lse = merge_attention(out_a, np.array([base]), out_b, np.array([base]))
        np.testing.assert_array_equal(out, [[0.5, 0.5]])
        np.testing.assert_allclose(lse, [base + np.log(2)], rtol=rtol)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_merge_keeps_the_kernels_dtypes(dtype):
    """out keeps the dtype of the parts' out; lse is float32 at least (as the kernels return it)."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((4, 3)).astype(dtype) for _ in range(3))
    a = flash_attention(q, k[:2], v[:2], return_lse=True)
    b = flash_attention(q, k[2:], v[2:], return_lse=True)
    out, lse = merge_attention(*a, *b)
    assert out.dtype == dtype
    assert lse.dtype == (np.float32 if dtype == np.float16 else dtype)


def test_an_empty_part_contributes_nothing_even_if_its_out_is_nan():
    """A part with lse = -inf has weight 0; its out is ignored, NaN included (0 · NaN would be
    NaN), so garbage in an empty split cannot reach the merged rows."""
    rng = np.random.default_rng(4)
    out_a, lse_a = rng.standard_normal((3, 4)), rng.standard_normal(3)
    out_b, lse_b = np.full((3, 4), np.nan), np.array([-np.inf, -np.inf, 0.5])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    np.testing.assert_array_equal(out[:2], out_a[:2])
    np.testing.assert_array_equal(lse[:2], lse_a[:2])
    assert np.isnan(out[2]).all()  # a part that is not empty still counts, NaN and all


@pytest.mark.parametrize("garbage", [np.inf, -np.inf, np.nan])
def test_an_empty_parts_inf_or_nan_out_is_ignored_without_a_warning(garbage):
    """An empty part (lse = -inf) holding inf in its out: 0 · inf would warn and give NaN. Its out
    is never multiplied, so the merge is the other part exactly and no RuntimeWarning escapes."""
    rng = np.random.default_rng(5)
    out_a, lse_a = rng.standard_normal((3, 4)), rng.standard_normal(3)
    out_b, lse_b = np.full((3, 4), garbage), np.full(3, -np.inf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for out, lse in (merge_attention(out_a, lse_a, out_b, lse_b),
                         merge_attention(out_b, lse_b, out_a, lse_a)):
            np.testing.assert_array_equal(out, out_a)
            np.testing.assert_array_equal(lse, lse_a)
        out, lse = merge_attention(out_b, lse_b, out_b, lse_b)
    np.testing.assert_array_equal(out, 0)
    assert (lse == -np.inf).all()


def test_merging_precise_attention_in_longdouble():
    """precise_attention's longdouble outputs merge in longdouble: the two halves of the keys
    merge into attention over all of them, within a few longdouble eps."""
    from flash_lib import precise_attention

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((n, 6)) for n in (7, 10, 10))
    a = precise_attention(q, k[:4], v[:4], return_lse=True)
    b = precise_attention(q, k[4:], v[4:], return_lse=True)
    out, lse = merge_attention(*a, *b)
    whole, whole_lse = precise_attention(q, k, v, return_lse=True)
    assert out.dtype == lse.dtype == np.longdouble
    eps = np.finfo(np.longdouble).eps
    assert np.abs(out - whole).max() <= 16 * eps * np.abs(v).max()
    assert np.abs(lse - whole_lse).max() <= 16 * eps * (1 + np.abs(whole_lse).max())

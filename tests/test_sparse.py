"""flash_lib.sparse_attention: each query attends exactly its listed keys. Checked against the
dense references with the mask the indices make (naive_attention, and PyTorch SDPA with a boolean
mask), for its empty rows and sentinels, its errors and its memory."""

import numpy as np
import pytest
import torch

import flash_lib
from flash_lib import measure_peak_bytes, naive_attention, sparse_attention


def random_indices(rng, batch, n_q, n_k, topk, unused=0.3):
    """Distinct keys per row (a random permutation's first topk), about ``unused`` of the slots
    -1; rows shuffled so that the sentinels are anywhere in a row."""
    idx = np.argsort(rng.random(batch + (n_q, n_k)), axis=-1)[..., :topk]
    return np.where(rng.random(idx.shape) < unused, -1, idx)


def dense_mask(indices, n_k):
    """(..., Nq, Nk) True where a row lists the key: the dense problem the indices stand for."""
    mask = np.zeros(indices.shape[:-1] + (n_k + 1,), bool)
    np.put_along_axis(mask, np.where(indices < 0, n_k, indices), True, axis=-1)
    return mask[..., :n_k]


@pytest.mark.parametrize("topk", [1, 5, 16])
def test_against_dense_references(topk):
    rng = np.random.default_rng(topk)
    q, k, v = (rng.standard_normal((2, 3, n, d)) for n, d in ((9, 8), (40, 8), (40, 6)))
    idx = random_indices(rng, (2, 3), 9, 40, topk)
    idx[0, 0, 0] = -1  # one row with no key at all
    out, lse = sparse_attention(q, k, v, idx, return_lse=True)
    mask = dense_mask(idx, 40)
    ref, ref_lse = naive_attention(q, k, v, mask=mask, return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-13)
    assert np.all(out[0, 0, 0] == 0) and lse[0, 0, 0] == -np.inf
    rows = mask.any(-1)
    t = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (q, k, v)), attn_mask=torch.from_numpy(mask))
    np.testing.assert_allclose(out[rows], t.numpy()[rows], rtol=0, atol=1e-13)


def test_order_and_sentinels_change_only_rounding_and_never_leak():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((6, 8)) for _ in range(3))
    k[0], v[0] = np.nan, np.inf  # the key a -1 slot would read if taken as an index
    idx = np.array([[1, -1, 2], [3, 2, 1], [-1, -1, -1], [5, -1, -1], [4, 3, 2], [1, 2, 3]])
    out, lse = sparse_attention(q, k, v, idx, return_lse=True)
    assert np.isfinite(out).all() and np.isfinite(lse[[0, 1, 3, 4, 5]]).all()
    reordered = sparse_attention(q, k, v, idx[:, ::-1])  # the same keys, in another order
    np.testing.assert_allclose(reordered, out, rtol=0, atol=1e-15)
    assert np.all(out[2] == 0) and lse[2] == -np.inf
    np.testing.assert_array_equal(out[3], v[5])  # one key: its value exactly


def test_broadcast_heads_and_half_precision():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((4, 10, 8)).astype(np.float16)  # 4 heads
    k, v = (rng.standard_normal((30, 8)).astype(np.float16) for _ in range(2))  # shared
    idx = random_indices(rng, (4,), 10, 30, 7)
    out, lse = sparse_attention(q, k, v, idx, return_lse=True, scale=0.5)
    assert out.dtype == np.float16 and lse.dtype == np.float32 and out.shape == (4, 10, 8)
    ref = naive_attention(*(x.astype(np.float64) for x in (q, k, v)), scale=0.5,
                          mask=dense_mask(idx, 30))
    assert np.max(np.abs(out - ref)) < 2e-3


@pytest.mark.parametrize("bad, match", [
    (np.array([[0, 0]] * 3), "at most once"),
    (np.array([[0, 7]] * 3), r"\[0, Nk=7\)"),
    (np.array([[0, -2]] * 3), r"-1 \(unused\)"),
    (np.array([[0, 1]] * 2), r"Nq=3"),
    (np.zeros((5, 3, 2), int), "broadcast"),
])
def test_bad_indices_are_refused(bad, match):
    q = np.zeros((3, 4))
    k = np.zeros((7, 4))
    with pytest.raises(ValueError, match="indices") as info:
        sparse_attention(q, k, k, bad if bad.ndim < 3 else bad, return_lse=True) if bad.ndim < 3 \
            else sparse_attention(q[None].repeat(2, 0), k, k, bad)
    assert info.match(match)
    with pytest.raises(TypeError, match="indices"):
        sparse_attention(q, k, k, np.zeros((3, 2)))


def test_memory_is_nq_topk_not_nq_nk():
    """Peak memory of a call, from outside (tracemalloc): about 1.5 times the gathered keys and
    values (``Nq · topk · 2d`` float64), and doubling Nq doubles it (an Nq × Nk buffer would
    quadruple it)."""
    rng = np.random.default_rng(3)
    d, topk = 16, 8
    peaks = []
    for n in (2048, 4096):
        q, k, v = (rng.standard_normal((n, d)) for _ in range(3))
        idx = (np.arange(n)[:, None] * 7 + np.arange(topk) * 13) % n  # distinct in each row
        peaks.append(measure_peak_bytes(sparse_attention, q, k, v, idx)[1])
        assert peaks[-1] < 2 * n * topk * 2 * d * 8 < n * n * 8
    assert peaks[1] < 2.1 * peaks[0]


# --- flash_check's cases ---------------------------------------------------------------------


def test_flash_check_passes_flash_lib_and_catches_the_planted_bugs():
    import functools

    import flash_check
    from flash_check import after_fa3

    sparse = functools.partial(flash_lib.sparse_attention, return_lse=True)
    report = flash_check.check_kernel(sparse, features=("sparse", "lse"))
    assert report.ok and "sparse" in {r.case for r in report.results}, report
    assert after_fa3.planted()(np.ones((1, 2)), np.ones((3, 2)), np.ones((3, 2)),
                               indices=np.array([[0, -1]]))[0].shape == (1, 2)
    good = flash_check.check_kernel(after_fa3.planted(), features=("sparse", "lse"))
    assert good.ok, good
    for bug, check in (("sentinel_as_last_key", "non-finite"),
                       ("sentinel_as_first_key", "out error")):
        report = flash_check.check_kernel(after_fa3.planted(bug), features=("sparse", "lse"))
        assert report.failed_cases() == ["sparse"], (bug, report)
        assert check in {f.check for f in report.failures}, (bug, report)

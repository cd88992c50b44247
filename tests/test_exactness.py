"""Exactness: the tiled kernel computes the same numbers as the textbook one, and both are as
close to the truth (``precise_attention``, wider than float64) as their dtype allows."""

import ml_dtypes
import numpy as np
import pytest
from helpers import (
    BFLOAT16,
    FLOAT_DTYPES,
    VS_DENSE,
    dense_attention,
    random_qkv,
    rowwise_rel_error,
)

import flash_lib
from flash_lib import (
    causal_mask,
    flash_attention,
    naive_attention,
    precise_attention,
    rowwise_relative_error,
)


def wide_span_inputs(seed, n_q=203, n_k=157, d=16, dv=12):
    """float64 q, k, v and a mask where many rows' scaled scores span at least 1e6.

    Query row i is multiplied by 10**e with e cycling through 0..6, so rows range from
    ordinary O(1) scores to scores in the millions. The mask has random holes plus two fully
    masked rows (whose reference output is all zeros).
    """
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, n_q, n_k, d, dv, batch=(2,))
    q *= 10.0 ** (np.arange(n_q) % 7)[:, None]
    mask = rng.random((2, n_q, n_k)) < 0.8
    mask[:, [5, 100], :] = False
    return q, k, v, mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "block_q, block_k",
    [
        (1, 64),
        (7, 13),
        (64, 1),
        (32, 32),
        (208, 162),
        (flash_lib.DEFAULT_BLOCK_Q, flash_lib.DEFAULT_BLOCK_K),
    ],
)
def test_flash_matches_naive_on_scores_spanning_1e6(block_q, block_k, causal):
    """float64, rows whose scaled scores span >= 1e6: flash vs naive rowwise error <= 1e-9.

    A missing or wrong rescaling exp(m_old - m_new) shows up here as an O(1) error, because the
    running max jumps by up to 1e6 between key blocks. Fully masked rows must be exactly 0.
    """
    q, k, v, mask = wide_span_inputs(seed=block_q * 1000 + block_k)
    allowed = mask & causal_mask(*mask.shape[-2:]) if causal else mask
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    span = np.where(allowed, scores, -np.inf).max(-1) + np.where(allowed, -scores, -np.inf).max(-1)
    assert np.count_nonzero(span >= 1e6) >= 20, "the inputs must really span 1e6"

    out, lse = flash_attention(
        q, k, v, mask=mask, causal=causal, block_q=block_q, block_k=block_k, return_lse=True
    )
    ref, ref_lse = naive_attention(q, k, v, mask=mask, causal=causal, return_lse=True)

    assert rowwise_rel_error(out, ref) <= 1e-9
    assert np.all(out[:, [5, 100]] == 0)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))
    finite = np.isfinite(ref_lse)
    assert np.all(np.abs(lse[finite] - ref_lse[finite]) <= 1e-9 * (1 + np.abs(ref_lse[finite])))


@pytest.mark.parametrize("kernel", [flash_attention, naive_attention, precise_attention])
@pytest.mark.parametrize("n_q, n_k", [(6, 6), (5, 9), (9, 5)])
def test_against_the_dense_oracle(kernel, n_q, n_k):
    """The default scale is 1/sqrt(d), causal is bottom-right, the mask is ANDed, and lse is
    the natural log of Σ_j exp(s_ij): checked against the tests' dense oracle
    (``helpers.dense_attention``, which shares no code with flash_lib), within VS_DENSE."""
    rng = np.random.default_rng(n_q * 10 + n_k)
    d = 9
    q, k, v = random_qkv(rng, n_q, n_k, d, dv=4, batch=(2,))
    mask = rng.random((2, n_q, n_k)) < 0.7
    mask[..., 0] = True  # key 0: causal allows it to all but the first Nq - Nk queries
    allowed = mask & causal_mask(n_q, n_k)
    rows = allowed.any(axis=-1)
    ref = dense_attention(q[:, -n_k:], k, v, scale=1 / 3, allowed=allowed[:, -n_k:])
    ref, ref_lse = ref.out, ref.lse
    extra = dict(block_q=2, block_k=3) if kernel is flash_attention else {}
    out, lse = kernel(q, k, v, mask=mask, causal=True, return_lse=True, **extra)
    assert np.array_equal(rows[:, -n_k:], np.ones((2, min(n_q, n_k)), bool))
    assert rowwise_rel_error(out[:, -n_k:], ref) <= VS_DENSE
    np.testing.assert_allclose(np.asarray(lse[:, -n_k:], np.float64), ref_lse, rtol=VS_DENSE)
    assert np.all(out[~rows] == 0) and np.all(lse[~rows] == -np.inf)


@pytest.mark.parametrize("kernel", [flash_attention, naive_attention])
def test_cases_checkable_by_hand(kernel):
    """Equal scores (q = 0): out is the mean of v and lse = log(Nk). One key far ahead of the
    others (score 1000 vs 0): out is exactly that key's value and lse exactly its score."""
    n_k = 7
    v = np.arange(n_k * 2, dtype=np.float64).reshape(n_k, 2)
    k = np.zeros((n_k, 4))
    k[3, 0] = 2000.0  # with scale 1/sqrt(4) = 1/2, query e0 scores 1000 on key 3, 0 elsewhere
    q = np.array([[0.0, 0, 0, 0], [1.0, 0, 0, 0]])
    out, lse = kernel(
        q, k, v, return_lse=True, **({"block_k": 2} if kernel is flash_attention else {})
    )
    np.testing.assert_allclose(out[0], v.mean(axis=0), rtol=1e-15)
    np.testing.assert_allclose(lse[0], np.log(n_k), rtol=1e-15)
    np.testing.assert_array_equal(out[1], v[3])
    assert lse[1] == 1000.0


def test_rowwise_metric_demands_exact_zeros():
    """The metric itself: a zero reference row tolerates nothing, NaN counts as infinite error."""
    ref = np.array([[0.0, 0.0], [1.0, -2.0]])
    assert rowwise_rel_error(ref, ref) == 0
    assert rowwise_rel_error(ref + [[1e-300, 0], [0, 0]], ref) == np.inf
    assert rowwise_rel_error(ref + [[0, 0], [0, 2e-3]], ref) == pytest.approx(1e-3)
    assert rowwise_rel_error(ref + [[0, 0], [np.nan, 0]], ref) == np.inf
    with pytest.raises(ValueError, match=r"same shape, got \(2, 2\) and \(2, 1\)"):
        rowwise_rel_error(ref, ref[:, :1])


def score_condition(q, k, scale):
    """Per query row, max over keys of scale · Σ_d |q_d k_d|: the rounding a score can carry."""
    a = np.abs(q.astype(np.float64))
    b = np.abs(k.astype(np.float64))
    return (a @ np.swapaxes(b, -1, -2)).max(axis=-1, initial=0.0) * scale


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("n_k", [1, 10, 97, 400])
@pytest.mark.parametrize("amplitude", [0.1, 1.0, 4.0])
def test_both_kernels_are_close_to_precise_truth(dtype, n_k, amplitude):
    """float64 and float32 vs the longdouble/mpmath truth. Per row i, with
    C_i = max_j scale·Σ_d |q_id k_jd| (the size of the rounding a score can carry):

        |out_i - truth_i| <= eps · (√Nk + C_i) · max|v|
        |lse_i - truth_i| <= 2·eps · (√Nk + C_i + |lse_i|)

    Why: out_i = Σ_j w_ij v_j with weights w_ij = exp(s_ij - lse_i) summing to 1, so an error
    δ in the scores (about eps·C_i) moves out_i by at most ~δ·max|v|, and summing Nk terms in l
    and p·v adds rounding that grows like eps·√Nk; lse also rounds once at its own magnitude.
    Measured on these inputs the worst ratios are 0.26 (out) and 0.33 (lse) of these bounds.
    The truth is fed the same dtype-cast inputs, so only the kernels' own rounding is measured.
    """
    rng = np.random.default_rng(n_k)
    n_q, d = 37, 24
    q, k, v = random_qkv(rng, n_q, n_k, d, dv=8, batch=(2,))
    q, k, v = (x * amplitude for x in (q, k, v))
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    mask = rng.random((n_q, n_k)) < 0.9
    mask[3] = False
    eps = np.finfo(dtype).eps
    rounding = np.sqrt(n_k) + score_condition(q, k, scale=1 / np.sqrt(d))
    v_max = np.abs(v.astype(np.float64)).max(axis=(-2, -1))[:, None]  # per batch element

    truth, truth_lse = precise_attention(q, k, v, mask=mask, return_lse=True)
    empty = truth_lse == -np.inf
    for out, lse in (
        flash_attention(q, k, v, mask=mask, block_q=8, block_k=32, return_lse=True),
        naive_attention(q, k, v, mask=mask, return_lse=True),
    ):
        assert out.dtype == dtype
        out_err = np.abs(out - truth).max(axis=-1).astype(np.float64)
        assert np.all(out_err <= eps * rounding * v_max)
        assert np.all(out[empty] == 0) and np.all(lse[empty] == -np.inf)
        lse_err = np.abs(lse[~empty] - truth_lse[~empty]).astype(np.float64)
        assert np.all(lse_err <= 2 * eps * (rounding + np.abs(truth_lse))[~empty])


@pytest.mark.parametrize("kernel", [flash_attention, naive_attention])
def test_float16_is_computed_in_float32_and_rounded_once(kernel):
    """float16 in: the result is the float32 computation rounded once to float16.

    Checked against the truth on the same float16 inputs, per row: within half a float16 ulp
    (eps16/2 · max|truth_i|) plus the float32 computation's own error, bounded as in
    test_both_kernels_are_close_to_precise_truth. Accumulating in float16 would miss by ~eps16·√Nk.
    """
    rng = np.random.default_rng(16)
    n_k = 300
    q, k, v = random_qkv(rng, 41, n_k, 16, dv=8, dtype=np.float16, batch=(2,))
    out = kernel(q, k, v, causal=True)
    truth = precise_attention(q, k, v, causal=True)
    eps16, eps32 = np.finfo(np.float16).eps, np.finfo(np.float32).eps
    v_max = np.abs(v.astype(np.float64)).max(axis=(-2, -1))[:, None]
    float32_error = eps32 * (np.sqrt(n_k) + score_condition(q, k, scale=0.25)) * v_max
    half_ulp = eps16 / 2 * np.abs(truth).max(axis=-1).astype(np.float64)
    assert out.dtype == np.float16
    assert np.all(np.abs(out - truth).max(axis=-1) <= half_ulp + float32_error)


@pytest.mark.parametrize("kernel", [flash_attention, naive_attention])
def test_float16_scores_and_sums_do_not_overflow_or_stall(kernel):
    """float16 inputs whose dot products (1.6e5) overflow float16 and whose softmax sum over
    4096 equal scores would stall at 2048 in float16 still give the float32-accurate answer."""
    rng = np.random.default_rng(4)
    n_k, d = 4096, 16
    q = np.full((3, d), 100, dtype=np.float16)  # q·k = 16 · 100 · 100 = 1.6e5 > 65504
    q[2] = 0  # all 4096 scores equal: out = mean of v
    k = np.full((n_k, d), 100, dtype=np.float16)
    v = rng.standard_normal((n_k, 4)).astype(np.float16)
    out, lse = kernel(q, k, v, scale=1 / 16, return_lse=True)
    truth, truth_lse = precise_attention(q, k, v, scale=1 / 16, return_lse=True)
    assert lse.dtype == np.float32
    assert rowwise_rel_error(out, truth) <= np.finfo(np.float16).eps
    np.testing.assert_allclose(lse, truth_lse.astype(np.float64), rtol=1e-6)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kernel", [flash_attention, naive_attention, precise_attention])
def test_output_dtypes(kernel, dtype):
    """out keeps the input dtype; lse is float32 for float16 input, else the input dtype.

    (precise_attention returns its wide working dtype instead, so it is only checked for shape.)
    """
    q, k, v = random_qkv(np.random.default_rng(0), 5, 6, 4, dv=3, dtype=dtype)
    out, lse = kernel(q, k, v, return_lse=True)
    assert out.shape == (5, 3) and lse.shape == (5,)
    if kernel is not precise_attention:
        assert out.dtype == dtype
        assert lse.dtype == (np.float32 if dtype == np.float16 else dtype)
        assert kernel(q, k, v).dtype == dtype


def test_mixed_input_dtypes_promote():
    """Mixed float inputs compute and return in NumPy's promoted dtype, as naive does."""
    q, k, v = random_qkv(np.random.default_rng(1), 9, 11, 4)
    out = flash_attention(q.astype(np.float16), k.astype(np.float32), v, block_q=4, block_k=4)
    ref = naive_attention(q.astype(np.float16), k.astype(np.float32), v)
    assert out.dtype == np.float64
    assert rowwise_rel_error(out, ref) <= 1e-13


def test_default_block_sizes_with_partial_blocks():
    """With the default block sizes and N not a multiple of either, flash still equals naive."""
    n = flash_lib.DEFAULT_BLOCK_Q + flash_lib.DEFAULT_BLOCK_K + 3
    q, k, v = random_qkv(np.random.default_rng(2), n, n - 1, 8)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    ref, ref_lse = naive_attention(q, k, v, causal=True, return_lse=True)
    assert rowwise_rel_error(out, ref) <= 1e-13
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-13)


def test_threads_do_not_change_a_single_bit():
    """Running the query blocks on the thread pool gives bit-identical results to running them
    one after another, and repeated runs are bit-identical. (2 × 1100 × 500 = 1.1e6 scores:
    enough for the kernel to bother with threads, which it skips below 2**20.)"""
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1100, 500, 8, batch=(2,))
    mask = rng.random((1100, 500)) < 0.7
    kwargs = dict(mask=mask, causal=True, block_q=64, block_k=128, return_lse=True)
    threaded = flash_attention(q, k, v, **kwargs)
    again = flash_attention(q, k, v, **kwargs)
    with flash_lib.threads(1):
        serial = flash_attention(q, k, v, **kwargs)
    for a, b, c in zip(threaded, again, serial):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_rowwise_metric_counts_identical_non_finite_entries_as_equal():
    """inf where the reference has the same inf, NaN where it has NaN: error 0 (inf - inf is NaN,
    which used to count as an infinite error); a finite entry beside them is measured against
    the row's finite scale; a different infinity, or a non-finite out beside a finite ref, is
    inf."""
    ref = np.array([[np.inf, 1.0], [np.nan, 2.0], [np.inf, 1.0], [1.0, 2.0], [-np.inf, 4.0]])
    out = np.array([[np.inf, 1.0], [np.nan, 2.5], [-np.inf, 1.0], [np.inf, 2.0], [-np.inf, 4.0]])
    err = rowwise_relative_error(out, ref)
    np.testing.assert_array_equal(err, [0.0, 0.25, np.inf, np.inf, 0.0])


def test_measure_peak_bytes_keeps_the_callers_own_peak():
    """Inside a caller's own tracemalloc session, measuring a kernel must not reset the peak the
    caller is tracking: a 4 MB peak reached before the call is still (within 1 KiB) the peak
    after it, and the kernel's own peak is still measured."""
    import tracemalloc

    from flash_lib import measure_peak_bytes

    q = k = v = np.ones((64, 8))
    tracemalloc.start()
    try:
        big = np.ones(4_000_000, np.uint8)
        del big
        _, before = tracemalloc.get_traced_memory()
        (out, _), peak = measure_peak_bytes(flash_attention, q, k, v, return_lse=True)
        _, after = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert before >= 4_000_000
    assert before <= after <= before + 1024, (before, after)
    assert out.nbytes <= peak < 1_000_000


@pytest.mark.parametrize("kernel", [flash_attention, naive_attention])
def test_bfloat16_is_computed_in_float32_and_rounded_once(kernel):
    """bfloat16 in (ml_dtypes): out is the float32 computation rounded once to bfloat16, lse is
    float32. Per row within half a bfloat16 ulp (2**-8 · max|truth_i|) plus float32's error,
    the float16 test's bound with bfloat16's eps; accumulating in bfloat16 (8 bits) would miss
    by ~2**-8·√Nk."""
    rng = np.random.default_rng(17)
    n_k = 300
    q, k, v = (x.astype(BFLOAT16) for x in random_qkv(rng, 41, n_k, 16, dv=8, batch=(2,)))
    out, lse = kernel(q, k, v, causal=True, return_lse=True)
    truth = precise_attention(q, k, v, causal=True)
    assert out.dtype == BFLOAT16 and lse.dtype == np.float32
    eps_bf16, eps32 = float(ml_dtypes.finfo(BFLOAT16).eps), np.finfo(np.float32).eps
    v_max = np.abs(v.astype(np.float64)).max(axis=(-2, -1))[:, None]
    float32_error = eps32 * (np.sqrt(n_k) + score_condition(q.astype(np.float64),
                                                           k.astype(np.float64), scale=0.25))
    half_ulp = eps_bf16 / 2 * np.abs(truth).max(axis=-1).astype(np.float64)
    err = np.abs(out.astype(np.float64) - truth.astype(np.float64)).max(axis=-1)
    assert np.all(err <= half_ulp + float32_error * v_max)


@pytest.mark.parametrize("pair", [(np.float16, BFLOAT16), (BFLOAT16, np.float32),
                                  (BFLOAT16, np.float64)], ids=str)
def test_half_precision_mixes_promote(pair):
    """float16 with bfloat16 has no common NumPy type: both kernels return float32 (as PyTorch
    promotes); bfloat16 with float32 or float64 returns the wider type."""
    q, k, v = random_qkv(np.random.default_rng(1), 9, 11, 4)
    q, k, v = q.astype(pair[0]), k.astype(pair[1]), v.astype(pair[1])
    expected = np.float32 if BFLOAT16 in pair and np.float16 in pair else np.dtype(pair[1])
    for kernel in (flash_attention, naive_attention):
        assert kernel(q, k, v).dtype == expected

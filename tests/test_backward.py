"""flash_attention_backward: the gradients of sum(dout * flash_attention(...)) without storing P.

Checked three independent ways: against the dense oracle ``naive_attention_backward`` (P whole,
the softmax Jacobian written out, no use of D = rowsum(dO ∘ O)); against the same computation in
longdouble (``precise_attention_backward``) with a derived error bound
(``helpers.gradient_bounds``); and against
central finite differences of the forward, which use neither derivation.
"""

import warnings

import numpy as np
import pytest
from helpers import (
    BFLOAT16,
    GARBAGE,
    GRADIENTS_VS_NAIVE,
    check_central_differences,
    gradient_bounds,
    grads,
    random_qkv,
    tiled_shapes,
)
from hypothesis import given
from hypothesis import strategies as st

import flash_lib
from flash_lib import (
    causal_mask,
    flash_attention,
    flash_attention_backward,
    measure_peak_bytes,
    naive_attention_backward,
    precise_attention_backward,
)


def inputs(rng, n_q, n_k, d=8, dv=5, dtype=np.float64, batch=(), amplitude=1.0):
    q, k, v = random_qkv(rng, n_q, n_k, d, dv=dv, batch=batch)
    dout = rng.standard_normal(batch + (n_q, dv))
    q, k = q * amplitude, k * amplitude
    return tuple(x.astype(dtype) for x in (q, k, v, dout))


# ---------------------------------------------------------------------------------------------
# Against the truth, with a derived bound
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("amplitude", [1.0, 6.0, 14.0])
def test_float64_gradients_within_a_derived_bound_of_the_truth(amplitude, causal):
    """Scores of magnitude up to ~1e3 (amplitude 14, d = 8: spans reach 1e3): every entry of
    flash's and naive's dq, dk, dv is within the bound of ``gradient_bounds`` of the longdouble
    truth. (Flash recomputes P = exp(S - lse), whose argument carries lse's rounding too, so its
    errors are up to ~6x naive's here; both are well inside the bound, which is 18x to 1000x
    above the errors seen: it is a worst case over every rounding.)"""
    rng = np.random.default_rng(int(amplitude * 10) + causal)
    q, k, v, dout = inputs(rng, 37, 45, amplitude=amplitude, batch=(2,))
    scale = 1 / np.sqrt(8)
    allowed = causal_mask(37, 45) if causal else np.ones((37, 45), bool)
    scores = np.where(allowed, scale * q @ np.swapaxes(k, -1, -2), np.nan)
    spans = np.nanmax(scores, axis=-1) - np.nanmin(scores, axis=-1)
    truth = precise_attention_backward(q, k, v, dout, causal=causal)
    bounds = gradient_bounds(q, k, v, dout, scale, allowed)
    flash = grads("flash", q, k, v, dout, causal=causal, block_q=8, block_k=16)
    naive = naive_attention_backward(q, k, v, dout, causal=causal)
    for name, f, n, t, b in zip(("dq", "dk", "dv"), flash, naive, truth, bounds):
        err_f, err_n = np.abs(f - t), np.abs(n - t)
        assert np.all(err_f <= b), (name, float((err_f / b).max()))
        assert np.all(err_n <= b), (name, float((err_n / b).max()))
    if amplitude == 14.0:
        assert np.nanmax(spans) >= 1e3


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16], ids=str)
def test_low_precision_gradients_within_a_few_times_naives_own_error(dtype):
    """float32, float16, bfloat16 (computed in float32, rounded once): each gradient's largest
    error against the longdouble truth is at most 2x naive's in the same dtype plus one ulp of
    the dtype at the gradient's size (the rounding of the result itself, which naive may hit
    more luckily), FlashAttention's rule for its own kernels."""
    rng = np.random.default_rng(9)
    q, k, v, dout = inputs(rng, 60, 70, d=16, dv=8, dtype=dtype, batch=(2,))
    truth = precise_attention_backward(q, k, v, dout, causal=True)
    flash = grads("flash", q, k, v, dout, causal=True, block_q=16, block_k=32)
    naive = naive_attention_backward(q, k, v, dout, causal=True)
    eps = float(np.finfo(np.float32).eps if dtype == np.float32 else
                (np.finfo(np.float16).eps if dtype == np.float16 else 2.0**-7))
    for name, f, n, t, x in zip(("dq", "dk", "dv"), flash, naive, truth, (q, k, v)):
        assert f.dtype == n.dtype == x.dtype, name
        t = t.astype(np.float64)
        err_f = np.abs(f.astype(np.float64) - t).max()
        err_n = np.abs(n.astype(np.float64) - t).max()
        assert err_f <= 2 * err_n + eps * np.abs(t).max(), (name, err_f, err_n)


# ---------------------------------------------------------------------------------------------
# Finite differences: independent of both derivations
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(causal=True),
        dict(mask="random"),
        dict(batch="shared kv"),
        dict(scale=0.05, causal=True),
    ],
    ids=["plain", "causal", "mask", "k and v shared by heads", "scale"],
)
def test_directional_derivatives_match_central_differences(case):
    """d/dε sum(dout * flash(q + εδq, k + εδk, v + εδv)) at 0, by central differences with
    ε = 1e-5 (truncation ~ε², rounding ~u/ε: both ~1e-10 here), equals Σ dq·δq + dk·δk + dv·δv
    to 1e-7 relative, along 3 random directions and along one of each argument alone
    (``check_central_differences``)."""
    rng = np.random.default_rng(21)
    kw = {"causal": case.get("causal", False)}
    if "scale" in case:
        kw["scale"] = case["scale"]
    q, k, v, dout = inputs(rng, 13, 17, d=6, dv=4, batch=(3,))
    if case.get("batch") == "shared kv":
        k, v = k[:1], v[:1]
    if case.get("mask") == "random":
        kw["mask"] = rng.random((3, 13, 17)) < 0.6
        kw["mask"][0, 2] = False  # a fully masked row
    dq, dk, dv = grads("flash", q, k, v, dout, block_q=4, block_k=5, **kw)

    def f(q, k, v):
        return float((dout * flash_attention(q, k, v, block_q=4, block_k=5, **kw)).sum())

    check_central_differences(f, (q, k, v), (dq, dk, dv), rng)


# ---------------------------------------------------------------------------------------------
# Against the dense oracle: random shapes, broadcasting, masks, causal, blocks, dtypes
# ---------------------------------------------------------------------------------------------

@given(
    **tiled_shapes((1, 20), (0, 20), 25),
    masking=st.sampled_from(["none", "random", "empty rows"]),
    broadcast=st.sampled_from(["none", "shared kv", "shared q", "mask per head"]),
    dtype=st.sampled_from(sorted(GRADIENTS_VS_NAIVE, key=str)),
    scale=st.sampled_from([None, 0.05, 3.0]),  # 0.05 = 0.8·2^-4: k carries 2^-2 of it
)
def test_flash_backward_matches_the_dense_oracle(n_q, n_k, block_q, block_k, causal, masking,
                                                 broadcast, dtype, scale):
    """Gradients of flash equal naive's within GRADIENTS_VS_NAIVE (its comment says why) times
    the size of their terms (``term_sizes``), in the inputs' shapes and dtypes."""
    rng = np.random.default_rng(n_q * 97 + n_k)
    q, k, v, dout = inputs(rng, n_q, n_k, d=4, dv=3, batch=(2, 3))
    if broadcast == "shared kv":
        k, v = k[:, :1], v[:, :1]
    elif broadcast == "shared q":
        q = q[:1]
    mask = None
    if masking == "random":
        mask = rng.random((n_q, n_k)) < 0.6
    elif masking == "empty rows":
        mask = rng.random((n_q, n_k)) < 0.6
        mask[::3] = False
    if broadcast == "mask per head":
        mask = rng.random((3, n_q, n_k)) < 0.5
    q, k, v, dout = (x.astype(dtype) for x in (q, k, v, dout))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash = grads("flash", q, k, v, dout, mask=mask, causal=causal, scale=scale,
                            block_q=block_q, block_k=block_k)
        naive = naive_attention_backward(q, k, v, dout, mask=mask, causal=causal, scale=scale)
    for name, f, n, x, size in zip(("dq", "dk", "dv"), flash, naive, (q, k, v),
                                   term_sizes(q, k, v, dout, scale)):
        assert f.shape == x.shape and f.dtype == x.dtype, name
        f, n = f.astype(np.float64), n.astype(np.float64)
        assert np.abs(f - n).max(initial=0.0) <= GRADIENTS_VS_NAIVE[np.dtype(dtype)] * size, name


def term_sizes(q, k, v, dout, scale=None):
    """The size of the terms each gradient sums, the unit of its error: a gradient can cancel
    to 0 (one key: dS = dP - D = 0) while its terms, and their rounding, do not.
    dq ~ τ·|dO|·|V|·|K|, dk ~ τ·|dO|·|V|·|Q|, dv ~ |dO| (P sums to 1)."""
    size = {name: float(np.abs(np.asarray(x, np.float64)).max(initial=0.0))
            for name, x in dict(q=q, k=k, v=v, dout=dout).items()}
    tau = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    dq = tau * size["dout"] * size["v"] * size["k"]
    dk = tau * size["dout"] * size["v"] * size["q"]
    return max(dq, 1e-300), max(dk, 1e-300), max(size["dout"], 1e-300)


def test_broadcast_gradients_are_summed_as_autograd_sums_them():
    """k and v shared by every head (shape (1, Nk, d) against q's (4, Nq, d)): their gradients
    are the sums over the heads of the gradients of k and v repeated per head."""
    rng = np.random.default_rng(2)
    q, k, v, dout = inputs(rng, 9, 11, batch=(4,))
    k1, v1 = k[:1], v[:1]
    shared = grads("flash", q, k1, v1, dout, block_q=4, block_k=4)
    repeated = grads("flash", q, np.repeat(k1, 4, axis=0), np.repeat(v1, 4, axis=0), dout,
                           block_q=4, block_k=4)
    assert shared[1].shape == k1.shape and shared[2].shape == v1.shape
    np.testing.assert_allclose(shared[0], repeated[0], rtol=1e-13)
    np.testing.assert_allclose(shared[1], repeated[1].sum(axis=0, keepdims=True), rtol=1e-12)
    np.testing.assert_allclose(shared[2], repeated[2].sum(axis=0, keepdims=True), rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# Empty rows, unseen keys, NaN, masked garbage
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["flash", "naive"])
def test_empty_rows_and_unseen_keys_have_exactly_zero_gradients(kernel):
    """A fully masked row: its dq row is exactly 0 and it adds nothing to dk, dv (they equal
    the gradients with that row's dout set to 0); a key no row may attend: dk = dv = 0 exactly.
    No NaN, no warning (exp(S - lse) with S = lse = -inf would be NaN without the guard)."""
    rng = np.random.default_rng(4)
    q, k, v, dout = inputs(rng, 10, 12, batch=(2,))
    mask = rng.random((10, 12)) < 0.7
    mask[3] = False  # an empty row
    mask[:, 5] = False  # a key nobody attends
    kw = dict(mask=mask, block_q=4, block_k=4)  # blocks: flash's only
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        dq, dk, dv = grads(kernel, q, k, v, dout, **kw)
    assert np.all(dq[:, 3] == 0)
    assert np.all(dk[:, 5] == 0) and np.all(dv[:, 5] == 0)
    quiet = dout.copy()
    quiet[:, 3] = 0
    _, dk0, dv0 = grads(kernel, q, k, v, quiet, **kw)
    np.testing.assert_allclose(dk, dk0, rtol=1e-14, atol=1e-300)
    np.testing.assert_allclose(dv, dv0, rtol=1e-14, atol=1e-300)


def test_a_fully_masked_matrix_has_zero_gradients():
    """Nothing allowed at all: every gradient is exactly 0."""
    rng = np.random.default_rng(5)
    q, k, v, dout = inputs(rng, 6, 7)
    mask = np.zeros((6, 7), bool)
    for g in grads("flash", q, k, v, dout, mask=mask, block_q=2, block_k=3):
        assert np.all(g == 0)


def test_nan_in_a_query_row_reaches_its_dq_row_and_the_keys_it_attends():
    """NaN in q row i: dq row i is NaN, every other dq row is exact; and, as IEEE arithmetic
    gives through P_ij, the dk, dv rows of the keys row i may attend are NaN, the others exact."""
    rng = np.random.default_rng(6)
    q, k, v, dout = inputs(rng, 10, 12)
    mask = rng.random((10, 12)) < 0.5
    mask[4, :6] = False
    mask[4, 6:] = True
    clean = grads("flash", q, k, v, dout, mask=mask, block_q=4, block_k=4)
    q[4, 0] = np.nan
    dq, dk, dv = grads("flash", q, k, v, dout, mask=mask, block_q=4, block_k=4)
    assert np.isnan(dq[4]).all()
    np.testing.assert_array_equal(np.delete(dq, 4, 0), np.delete(clean[0], 4, 0))
    for g, c in ((dk, clean[1]), (dv, clean[2])):
        assert np.isnan(g[6:]).all()
        np.testing.assert_array_equal(g[:6], c[:6])


@given(**GARBAGE)
def test_garbage_at_masked_pairs_stays_out_of_the_gradients(n_q, n_k, block, causal, where,
                                                            poison, data):
    """The forward's masked-key rule, for the gradients: NaN or inf planted in a row of k, v, q
    or dout that only masked pairs meet (a padded key, or a query row that is fully masked)
    leaves every gradient bit-for-bit what it is with that row set to 0."""
    rng = np.random.default_rng(n_q * 13 + n_k)
    q, k, v, dout = inputs(rng, n_q, n_k, d=3, dv=2)
    mask = rng.random((n_q, n_k)) < 0.7
    if where in ("k", "v"):
        row = data.draw(st.integers(0, n_k - 1))
        mask[:, row] = False
    else:
        row = data.draw(st.integers(0, n_q - 1))
        mask[row] = False
    arrays = dict(q=q, k=k, v=v, dout=dout)
    dirty, clean = dict(arrays), dict(arrays)
    dirty[where], clean[where] = arrays[where].copy(), arrays[where].copy()
    dirty[where][row, 0], clean[where][row, 0] = poison, 0
    kw = dict(mask=mask, causal=causal, block_q=block, block_k=block)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = grads("flash", dirty["q"], dirty["k"], dirty["v"], dirty["dout"], **kw)
    want = grads("flash", clean["q"], clean["k"], clean["v"], clean["dout"], **kw)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


# ---------------------------------------------------------------------------------------------
# The schedule, memory, bits
# ---------------------------------------------------------------------------------------------


@given(**tiled_shapes((1, 25), (1, 25), 30))
def test_backward_computes_exactly_the_forwards_tiles(n_q, n_k, block_q, block_k, causal):
    """Every tile the backward recomputes is one the forward's schedule lists, each once.

    Watched through the public ``attention_backward_tile``, which the kernel calls once per tile
    it computes: column 0 of ``v`` holds each key's index and column 0 of ``dout`` each query's,
    so the tile's rows and keys can be read off the blocks it is given."""
    seen = []
    tile = flash_lib.attention_backward_tile

    def recording_tile(q, k, v, dout, *args, **kw):
        seen.append((int(dout[0, 0]), int(dout[-1, 0]) + 1, int(v[0, 0]), int(v[-1, 0]) + 1))
        return tile(q, k, v, dout, *args, **kw)

    q, k, v, dout = inputs(np.random.default_rng(1), n_q, n_k, d=3, dv=2)
    v[:, 0], dout[:, 0] = np.arange(n_k), np.arange(n_q)
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flash_lib, "attention_backward_tile", recording_tile)
        flash_attention_backward(q, k, v, out, lse, dout, causal=causal, block_q=block_q,
                                 block_k=block_k)
    assert sorted(seen) == flash_lib.tile_schedule(n_q, n_k, block_q, block_k, causal)


def test_gradients_are_bit_identical_on_any_number_of_threads():
    """Key blocks on 1, 2 or 4 worker threads, twice each: the same bits. dQ's shares are added
    in key-block order whatever thread computes them."""
    rng = np.random.default_rng(8)
    q, k, v, dout = inputs(rng, 1100, 1000, d=16, dv=16)  # 1.1e6 scores: threads are used
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    results = []
    for threads in (1, 2, 4, 4):
        with flash_lib.threads(threads):
            results.append(flash_attention_backward(q, k, v, out, lse, dout, causal=True,
                                                    block_q=128, block_k=96))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def backward_scratch(n, dtype=np.float32, **blocks):
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((n, 16)).astype(dtype) for _ in range(4))
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True, **blocks)
    grads, peak = measure_peak_bytes(flash_attention_backward, q, k, v, out, lse, dout,
                                     causal=True, **blocks)
    return peak - sum(g.nbytes for g in grads)


def test_backward_scratch_is_flat_in_n():
    """At fixed 512 × 512 blocks, one worker, float32: the backward's scratch is the same within
    5% for N = 1024, 4096 and 16384 (the P it never stores grows 256-fold, 4 MiB to 1 GiB);
    D and the lse are its only O(N) arrays (64 KiB each at N = 16384)."""
    blocks = dict(block_q=512, block_k=512)
    with flash_lib.threads(1):
        backward_scratch(600, **blocks)  # first-call allocations aside
        scratch = {n: backward_scratch(n, **blocks) for n in (1024, 4096, 16384)}
    assert max(scratch.values()) <= 1.05 * min(scratch.values()), scratch


def test_naive_backward_scratch_grows_as_n_squared():
    """The dense oracle holds P, dP and dS: its scratch grows about 4x per doubling of N."""
    def scratch(n):
        rng = np.random.default_rng(0)
        q, k, v, dout = (rng.standard_normal((n, 16)) for _ in range(4))
        grads, peak = measure_peak_bytes(naive_attention_backward, q, k, v, dout)
        return peak - sum(g.nbytes for g in grads)

    s = {n: scratch(n) for n in (256, 512, 1024)}
    assert all(s[n] >= 3 * n * n * 8 for n in s), s
    assert 3.6 <= s[1024] / s[512] <= 4.4 and 3.6 <= s[512] / s[256] <= 4.4, s

"""What more than one test module needs: the tolerances, named by what they compare; the one
dense oracle; the probes and input makers the modules share.

Test modules import from here (``from helpers import ...``: pytest puts ``tests/`` on
``sys.path`` for the modules in it, as it does for ``conftest.py``), and never from one
another. ``conftest.py`` holds only pytest's and Hypothesis's set-up. Inputs come from
``flash_check.random_qkv`` (every call here passes ``d``: its default is 16) and the causal
mask from ``flash_lib.causal_mask``.
"""

import warnings
from typing import NamedTuple, Optional

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

import flash_lib
from flash_check import random_qkv  # noqa: F401 - the tests import it from here
from flash_lib import (
    flash_attention,
    flash_attention_backward,
    naive_attention,
    naive_attention_backward,
    precise_attention_backward,
)

FLOAT_DTYPES = (np.float16, np.float32, np.float64)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# ---------------------------------------------------------------------------------------------
# Tolerances, by what they compare. Each is far below what a mistake gives (a missing rescale, a
# wrong mask, head or key: errors of O(1); a kernel off by one part in a million: 1e-6).
# ---------------------------------------------------------------------------------------------

#: flash vs naive, forward, the same input dtype: ``{dtype: {"out": ..., "lse": ...}}``, used by
#: :func:`assert_close_to_naive`.
#:   out: max |out - ref| / max |v|. ``out`` is a convex combination of rows of v, so v's size is
#:        the natural unit of its error, and it stays meaningful when a row of ``out`` cancels to
#:        nearly zero (where an error relative to |ref| would blow up).
#:   lse: |lse - ref| / (1 + |ref|).
#: float64/float32: each kernel is within ~30 eps of the truth on such inputs (test_exactness.py);
#: over 1000 random examples (HYPOTHESIS_PROFILE=thorough) they differed by at most 2.2 eps, so
#: 64 eps is a ~30x margin.
#: float16: both kernels compute in float32 and round the result once, so their outputs differ
#: by at most one float16 ulp (<= eps16 · |out| <= eps16 · max|v|; seen: 0.43 eps16); their lse
#: is float32, hence float32's tolerance.
FLASH_VS_NAIVE = {
    np.float64: {"out": 64 * np.finfo(np.float64).eps, "lse": 64 * np.finfo(np.float64).eps},
    np.float32: {"out": 64 * np.finfo(np.float32).eps, "lse": 64 * np.finfo(np.float32).eps},
    np.float16: {"out": 1 * np.finfo(np.float16).eps, "lse": 64 * np.finfo(np.float32).eps},
}

#: flash's gradients vs naive's, the same input dtype, in units of the size of the terms each
#: gradient sums (a gradient can cancel to 0 while its terms, and their rounding, do not):
#: float64 1e-12 (~4500 eps); float32 1e-5 (~80 eps); float16 and bfloat16 (computed in float32)
#: about 4 eps of the dtype, because flash's D = rowsum(dO ∘ O) uses the forward's out, rounded
#: to the input dtype. Over 3000 random cases of test_backward's dense-oracle test the largest
#: errors were 0.003, 0.26, 0.17 and 0.44 of these (float64, float32, float16, bfloat16).
#: (test_backward.py had 2e-5 for float32 and test_hardening.py 1e-5: the tighter is kept.)
GRADIENTS_VS_NAIVE = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5,
                      np.dtype(np.float16): 4e-3, BFLOAT16: 3e-2}

#: float64, flash vs naive with every variant, sinks and dropout (and flash_serving's kernels
#: vs naive per sequence), forward and backward, relative to the larger scale (:func:`close`):
#: their errors are ~1e-15 (a few eps); a kernel off by 1e-6 relative fails.
VARIANTS_VS_NAIVE = 1e-12

#: float64, a kernel (flash, naive, precise) vs :func:`dense_attention`, forward and gradients,
#: relative to the larger scale: two roundings of the same formula in different orders, with
#: sinks and dropout's 1/(1 - p) on top; at most 1.8e-15 measured (test_training, test_exactness).
VS_DENSE = 1e-13

#: float64, naive's forward vs :func:`dense_attention` with the variant written out as the
#: oracle's bias, cap or mask: the same formula, normalised in another order; at most 2.4e-16
#: measured (test_variants), and chapters 14 and 15 hold their own oracle to the same limit.
NAIVE_VS_DENSE = 1e-14


def rowwise_rel_error(out, ref):
    """The largest of ``flash_lib.rowwise_relative_error``: the number the exactness claims bound."""
    return float(flash_lib.rowwise_relative_error(out, ref).max(initial=0.0))


def close(a, b, tol=VARIANTS_VS_NAIVE):
    """Entrywise within ``tol`` of the larger of the two arrays' scales."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.abs(b).max(initial=0.0), np.abs(a).max(initial=0.0), 1e-300)
    return np.abs(a - b).max(initial=0.0) <= tol * scale


def assert_close_to_naive(out, lse, ref_out, ref_lse, v, dtype):
    """Check flash's (out, lse) against naive's, both of ``dtype``, with its FLASH_VS_NAIVE row
    (:func:`assert_within`)."""
    assert out.dtype == ref_out.dtype == dtype
    assert_within(out, lse, ref_out, ref_lse, v, FLASH_VS_NAIVE[dtype])


def assert_within(out, lse, ref_out, ref_lse, v, tol):
    """Check (out, lse) against a reference's, in FLASH_VS_NAIVE's units: ``out`` within
    ``tol["out"]`` × max|v|, ``lse`` within ``tol["lse"]`` × (1 + |ref|).

    Rows with lse = -inf (no allowed key) must agree exactly: 0.0 and -inf in both.
    """
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    empty = ref_lse == -np.inf
    np.testing.assert_array_equal(lse == -np.inf, empty, err_msg="fully masked rows differ")
    assert np.all(out[empty] == 0), "a fully masked row is not exactly 0"
    unit = max(float(np.abs(v.astype(np.float64)).max(initial=0.0)), np.finfo(np.float64).tiny)
    out_err = np.abs(out.astype(np.float64) - ref_out.astype(np.float64)).max(initial=0.0) / unit
    assert out_err <= tol["out"], f"out differs from the reference by {out_err:.3g} × max|v|"
    finite = ~empty
    lse_err = (
        np.abs(lse[finite].astype(np.float64) - ref_lse[finite])
        / (1 + np.abs(ref_lse[finite].astype(np.float64)))
    ).max(initial=0.0)
    assert lse_err <= tol["lse"], f"lse differs from the reference by {lse_err:.3g} (relative)"


# ---------------------------------------------------------------------------------------------
# The dense oracle, written from the definitions and sharing no code with flash_lib
# ---------------------------------------------------------------------------------------------


def window_mask(n_q, n_k, left, right):
    """FlashAttention's window_size, written out: key j for query i iff
    i + (Nk - Nq) - left <= j <= i + (Nk - Nq) + right (None: unbounded). Causal is
    ``right = 0``: bottom-right aligned."""
    rel = np.arange(n_k)[None, :] - np.arange(n_q)[:, None] - (n_k - n_q)
    ok = np.ones((n_q, n_k), bool)
    if left is not None:
        ok &= rel >= -left
    if right is not None:
        ok &= rel <= right
    return ok


def alibi_bias(slopes, n_q, n_k):
    """ALiBi's bias matrix, written out: -slope·|i + (Nk - Nq) - j|, one matrix per slope
    (``slopes`` broadcasts to the batch: one per head)."""
    i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    return -np.asarray(slopes)[..., None, None] * np.abs(i + (n_k - n_q) - j)


class Dense(NamedTuple):
    """:func:`dense_attention`'s results, by name."""

    out: np.ndarray
    lse: np.ndarray
    p: np.ndarray
    dq: Optional[np.ndarray] = None
    dk: Optional[np.ndarray] = None
    dv: Optional[np.ndarray] = None
    dsinks: Optional[np.ndarray] = None


def dense_attention(q, k, v, dout=None, *, scale, allowed=None, softcap=None, bias=None,
                    sinks=None, keep=None, p=0.0):
    """Attention, its lse and (given ``dout``) its gradients, over the whole score matrix.

    The tests' one oracle: written here from the definitions, sharing no code with flash_lib
    (whose kernels share input checking, masking and finalisation, so a slip there would fool
    a comparison of one kernel with another), in its own order of operations (P is normalised
    before it meets V; naive divides P V by the row sums). It computes in its inputs' dtype:
    float64, or longdouble for :func:`gradient_bounds`.

    q (..., Nq, d), k, v (..., Nk, ·) broadcast together; ``allowed`` (..., Nq, Nk) bool;
    ``bias`` (..., Nq, Nk), added after the cap (:func:`alibi_bias` writes ALiBi's); ``sinks``
    broadcast to the batch (one per head); ``keep`` (..., Nq, Nk) bool: dropout's Z.

        S = τ q kᵀ,  S_c = c·tanh(S / c),  S_b = S_c + bias,  -inf where not allowed
        [P | P_sink] = softmax([S_b | sink]) row by row (a row of -inf only: P = 0)
        lse = log(Σ_j e^S_b + e^sink)   (-inf for a row with nothing)
        out = (P ∘ Z / (1 - p)) V
        dV = (P ∘ Z / (1 - p))ᵀ dO,  dP = (dO Vᵀ) ∘ Z / (1 - p),  D = rowsum(P ∘ dP)
        dS_b = P ∘ (dP - D),  dS = dS_b ∘ (1 - tanh²(S / c)),  dq = τ dS k,  dk = τ dSᵀ q
        dsink = -Σ_i P_sink,i · D_i

    Returns ``(out, lse, p, dq, dk, dv, dsinks)`` as a :class:`Dense`: ``p`` is P, before
    dropout; the gradients are None without ``dout``, and over the full batch (not summed over
    broadcast axes); ``dsinks`` is None without sinks.
    """
    n_q, n_k = q.shape[-2], k.shape[-2]
    s = scale * (q @ np.swapaxes(k, -1, -2))
    s_b = s if softcap is None else softcap * np.tanh(s / softcap)
    if bias is not None:
        s_b = s_b + bias
    if allowed is not None:
        s_b = np.where(allowed, s_b, -np.inf)
    batch = s_b.shape[:-2]
    sink = np.full(batch + (n_q, 1), -np.inf) if sinks is None else np.broadcast_to(
        np.asarray(sinks, np.float64)[..., None, None], batch + (n_q, 1))
    full = np.concatenate([s_b, sink], axis=-1)
    m = full.max(axis=-1, keepdims=True)
    m = np.where(m == -np.inf, 0, m)
    e = np.exp(full - m)
    total = e.sum(axis=-1, keepdims=True)
    nothing = total == 0  # a row with no allowed key and no sink
    total = np.where(nothing, 1, total)
    lse = np.where(nothing, -np.inf, np.log(total) + m)[..., 0]
    prob = e / total
    P, p_sink = prob[..., :n_k], prob[..., n_k]
    z = np.ones(P.shape) if keep is None else keep / (1 - p)
    out = (P * z) @ v
    if dout is None:
        return Dense(out, lse, P)
    dv = np.swapaxes(P * z, -1, -2) @ dout
    dP = (dout @ np.swapaxes(v, -1, -2)) * z
    D = (P * dP).sum(axis=-1, keepdims=True)
    ds = P * (dP - D)
    if softcap is not None:
        ds = ds * (1 - np.tanh(s / softcap) ** 2)
    dq = scale * ds @ k
    dk = scale * np.swapaxes(ds, -1, -2) @ q
    dsinks = None if sinks is None else -(p_sink * D[..., 0]).sum(axis=-1)
    return Dense(out, lse, P, dq, dk, dv, dsinks)


def gradient_bounds(q, k, v, dout, scale, allowed):
    """Per-entry error bounds on (dq, dk, dv) for a float64 kernel, from the longdouble truth.

    Each gradient is a sum of terms built from P_ij = exp(S_ij - lse_i). The argument S_ij - lse_i
    is computed with an absolute error of about (d + 2)·u·(|S_ij| + |lse_i|) (the dot product's
    d roundings at the scores' magnitude, then lse's), so P_ij carries that as a relative error:
    it grows with the magnitude of the scores, which is why rows whose scores reach 1e3 have
    gradients 1e3 times less accurate than rows of O(1) scores, however a kernel computes them.
    dP_ij = dO_i·V_j and D_i = dO_i·O_i add γ_dv of their terms' magnitudes; summing over Nk keys
    (dq) or Nq queries (dk, dv) adds γ_N of the terms. So with c = d + dv + max(Nq, Nk) + 4,
        |Δ dq_ic| <= c·u·τ Σ_j P_ij (1 + |S_ij| + |lse_i|)·(|dP_ij - D_i| + M_i)·|k_jc|,
        |Δ dk_jc| <= c·u·τ Σ_i P_ij (1 + |S_ij| + |lse_i|)·(|dP_ij - D_i| + M_i)·|q_ic|,
        |Δ dv_jc| <= c·u·Σ_i P_ij (1 + |S_ij| + |lse_i|)·|dO_ic|,
    where M_i = Σ_c |dO_ic|·(max_j |V_jc| + |O_ic|) bounds the terms of dP_ij and D_i. P, lse
    and O are :func:`dense_attention`'s, in longdouble.
    """
    q, k, v, dout = (np.asarray(x, np.longdouble) for x in (q, k, v, dout))
    truth = dense_attention(q, k, v, scale=scale, allowed=allowed)
    p, out = truth.p, truth.out
    lse = np.where(truth.lse == -np.inf, 0, truth.lse)[..., None]  # an empty row: P = 0 anyway
    s = scale * (q @ np.swapaxes(k, -1, -2))
    dp = dout @ np.swapaxes(v, -1, -2)
    d_row = (dout * out).sum(axis=-1, keepdims=True)
    size = np.abs(dout) @ (np.abs(v).max(axis=-2, keepdims=True) + np.abs(out)).swapaxes(-1, -2)
    size = np.diagonal(size, axis1=-2, axis2=-1)[..., None]  # M_i
    w = p * (1 + np.abs(np.where(allowed, s, 0)) + np.abs(lse))
    c = q.shape[-1] + v.shape[-1] + max(q.shape[-2], k.shape[-2]) + 4
    u = np.finfo(np.float64).eps / 2
    ds_size = w * (np.abs(dp - d_row) + size)
    bound_dq = c * u * scale * (ds_size @ np.abs(k))
    bound_dk = c * u * scale * (np.swapaxes(ds_size, -1, -2) @ np.abs(q))
    bound_dv = c * u * (np.swapaxes(w, -1, -2) @ np.abs(dout))
    return bound_dq, bound_dk, bound_dv


# ---------------------------------------------------------------------------------------------
# Probes the modules share
# ---------------------------------------------------------------------------------------------


def grads(kernel, q, k, v, dout, **kw):
    """The gradients of ``kernel`` ("flash": the forward with lse, then the tiled backward, both
    at ``block_q``/``block_k`` if given; "naive" or "precise": the dense backward, which takes
    no blocks) with the same keywords."""
    if kernel == "flash":
        blocks = {name: kw.pop(name) for name in ("block_q", "block_k") if name in kw}
        out, lse = flash_attention(q, k, v, return_lse=True, **kw, **blocks)
        return flash_attention_backward(q, k, v, out, lse, dout, **kw, **blocks)
    for name in ("block_q", "block_k"):
        kw.pop(name, None)
    dense = naive_attention_backward if kernel == "naive" else precise_attention_backward
    return dense(q, k, v, dout, **kw)


def check_central_differences(f, xs, analytic, rng, eps=1e-5, tol=1e-7):
    """Directional derivatives of ``f`` along 3 random directions of all of ``xs`` at once, and
    along one direction of each alone (each argument's own gradient, not just their sum),
    against the analytic ones: central differences with step ``eps`` (truncation ~eps², rounding
    ~u/eps: both ~1e-10 at 1e-5), within ``tol`` relative."""
    for _ in range(3):
        dirs = [rng.standard_normal(np.shape(x)) for x in xs]
        numeric = (f(*(x + eps * d for x, d in zip(xs, dirs)))
                   - f(*(x - eps * d for x, d in zip(xs, dirs)))) / (2 * eps)
        exact = sum(float((g * d).sum()) for g, d in zip(analytic, dirs))
        assert abs(numeric - exact) <= tol * max(1.0, abs(exact)), (numeric, exact)
    for x, g in zip(xs, analytic):
        d = rng.standard_normal(np.shape(x))
        moved = [x_ + (eps * d if x_ is x else 0) for x_ in xs]
        back = [x_ - (eps * d if x_ is x else 0) for x_ in xs]
        numeric = (f(*moved) - f(*back)) / (2 * eps)
        assert abs(numeric - float((g * d).sum())) <= tol * max(1.0, abs(numeric))


def tiled_shapes(n_q, n_k, block):
    """Hypothesis strategies for a problem on a block grid, as ``@given`` keywords: ``n_q`` and
    ``n_k`` in the inclusive ranges ``(low, high)`` given, ``block_q`` and ``block_k`` from 1 to
    ``block`` (which may exceed the sides: one block then covers them), and ``causal``."""
    return dict(n_q=st.integers(*n_q), n_k=st.integers(*n_k), block_q=st.integers(1, block),
                block_k=st.integers(1, block), causal=st.booleans())


#: The variant combinations of test_variants.py's and test_training.py's flash-vs-naive tests
#: (test_hardening.py's fuzz extends them).
VARIANTS = dict(
    **tiled_shapes((1, 18), (1, 18), 20),
    window=st.one_of(st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 6)),
                                          st.one_of(st.none(), st.integers(0, 6)))),
    softcap=st.sampled_from([None, 0.7, 5.0]),
    alibi=st.booleans(),
    gqa=st.booleans(),
    masking=st.sampled_from(["none", "mask", "mask_mod", "both"]),
)


def check_flash_equals_naive(n_q, n_k, block_q, block_k, causal, window, softcap, alibi, gqa,
                             masking, **extra):
    """Forward (out, lse) and backward (dq, dk, dv) of flash against naive with the same
    keywords, float64, within VARIANTS_VS_NAIVE of the larger scale, for one draw of
    :data:`VARIANTS`; ``extra`` keywords on top (test_training.py adds sinks and dropout: the
    units of the gradients' errors grow by 1/(1 - p), and dsinks' is a sum over the rows of
    |D| <= |dO|·|O|)."""
    rng = np.random.default_rng(n_q * 31 + n_k)
    q = 2 * rng.standard_normal((2, 4, n_q, 4))
    h_kv = 2 if gqa else 4
    k, v = 2 * rng.standard_normal((2, h_kv, n_k, 4)), rng.standard_normal((2, h_kv, n_k, 3))
    dout = rng.standard_normal((2, 4, n_q, 3))
    kw = dict(causal=causal, window=window, softcap=softcap, enable_gqa=gqa)
    if alibi:
        kw["alibi_slopes"] = np.array([0.5, 0.25, 0.125, 0.0625])
    if masking in ("mask", "both"):
        kw["mask"] = rng.random((4, n_q, n_k)) < 0.8
    if masking in ("mask_mod", "both"):
        kw["mask_mod"] = lambda i, j: (i + j) % 3 != 1
    kw.update(extra)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = flash_attention(q, k, v, return_lse=True, block_q=block_q, block_k=block_k,
                                   **kw)
        ref, ref_lse = naive_attention(q, k, v, return_lse=True, **kw)
        flash_g = flash_attention_backward(q, k, v, out, lse, dout, block_q=block_q,
                                           block_k=block_k, **kw)
        naive_g = naive_attention_backward(q, k, v, dout, **kw)
    np.testing.assert_array_equal(lse == -np.inf, ref_lse == -np.inf)
    assert np.all(out[ref_lse == -np.inf] == 0)
    finite = ref_lse > -np.inf
    assert close(out, ref) and close(lse[finite], ref_lse[finite])
    # a gradient can cancel to 0 (one key: dS = dP - D = 0) while its terms do not: the unit
    # of its error is the size of those terms, τ·|dO|·|V|·|K or Q| for dq, dk and |dO| for dv
    tau, big = 0.5, np.abs(np.concatenate([q.ravel(), k.ravel()])).max()
    units = (tau * np.abs(dout).max() * np.abs(v).max() * big,) * 2 + (np.abs(dout).max(),)
    units = tuple(u / (1 - extra.get("dropout_p", 0)) for u in units)
    units += (units[2] * np.abs(v).max() * dout[..., 0].size,)  # dsinks, when there are sinks
    assert len(flash_g) == len(naive_g) == 3 + ("sinks" in extra)
    for a, b, unit in zip(flash_g, naive_g, units):
        assert a.shape == b.shape
        assert (np.abs(a - b).max(initial=0.0)
                <= VARIANTS_VS_NAIVE * max(unit, np.abs(b).max(initial=0.0)))


#: Garbage planted where only masked pairs meet it: test_backward.py's rule for the gradients
#: (test_hardening.py extends it with softcap).
GARBAGE = dict(
    n_q=st.integers(1, 12),
    n_k=st.integers(1, 12),
    block=st.integers(1, 14),
    causal=st.booleans(),
    where=st.sampled_from(["k", "v", "q", "dout"]),
    poison=st.sampled_from([np.nan, np.inf]),
    data=st.data(),
)

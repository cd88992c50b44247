"""Shared helpers for the flash_lib test suite: the largest row error, tolerances, the dense
oracle; inputs come from ``flash_check.random_qkv`` (every call here passes ``d``: its default is
16) and the causal mask from ``flash_lib.causal_mask``.

Hypothesis runs under the profile registered here: derandomized (the same examples on every
run and machine), no deadline (timings on a shared CI box are noise), no example database
(nothing written into the checkout). Maintainers can ask for a longer search with
``HYPOTHESIS_PROFILE=thorough pytest tests``.
"""

import os

import numpy as np
from hypothesis import HealthCheck, settings

import flash_lib
from flash_check import random_qkv  # noqa: F401 - the tests import it from here

settings.register_profile(
    "flash",
    derandomize=True,
    deadline=None,
    database=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    parent=settings.get_profile("flash"),
    derandomize=False,
    max_examples=2000,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "flash"))

FLOAT_DTYPES = (np.float16, np.float32, np.float64)

# Flash vs naive, per input dtype: the one table of tolerances for the property tests.
#   out: max |out - ref| / max |v|. ``out`` is a convex combination of rows of v, so v's size is
#        the natural unit of its error, and it stays meaningful when a row of ``out`` cancels to
#        nearly zero (where an error relative to |ref| would blow up).
#   lse: |lse - ref| / (1 + |ref|).
# float64/float32: each kernel is within ~30 eps of the truth on such inputs (test_exactness.py);
# over 1000 random examples (HYPOTHESIS_PROFILE=thorough) they differed by at most 2.2 eps, so
# 64 eps is a ~30x margin, while a missing rescale or a wrong mask gives O(1) errors.
# float16: both kernels compute in float32 and round the result once, so their outputs differ
# by at most one float16 ulp (<= eps16 · |out| <= eps16 · max|v|; seen: 0.43 eps16); their lse
# is float32, hence float32's tolerance.
TOLERANCE = {
    np.float64: {"out": 64 * np.finfo(np.float64).eps, "lse": 64 * np.finfo(np.float64).eps},
    np.float32: {"out": 64 * np.finfo(np.float32).eps, "lse": 64 * np.finfo(np.float32).eps},
    np.float16: {"out": 1 * np.finfo(np.float16).eps, "lse": 64 * np.finfo(np.float32).eps},
}


def rowwise_rel_error(out, ref):
    """The largest of ``flash_lib.rowwise_relative_error``: the number the exactness claims bound."""
    return float(flash_lib.rowwise_relative_error(out, ref).max(initial=0.0))


def assert_close_to_naive(out, lse, ref_out, ref_lse, v, dtype):
    """Check flash's (out, lse) against naive's with the TOLERANCE row of ``dtype``.

    Rows with lse = -inf (no allowed key) must agree exactly: 0.0 and -inf in both.
    """
    tol = TOLERANCE[dtype]
    assert out.dtype == ref_out.dtype == dtype
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    empty = ref_lse == -np.inf
    np.testing.assert_array_equal(lse == -np.inf, empty, err_msg="fully masked rows differ")
    assert np.all(out[empty] == 0), "a fully masked row is not exactly 0"
    unit = max(float(np.abs(v.astype(np.float64)).max(initial=0.0)), np.finfo(np.float64).tiny)
    out_err = np.abs(out.astype(np.float64) - ref_out.astype(np.float64)).max(initial=0.0) / unit
    assert out_err <= tol["out"], f"out differs from naive by {out_err:.3g} × max|v|"
    finite = ~empty
    lse_err = (
        np.abs(lse[finite].astype(np.float64) - ref_lse[finite])
        / (1 + np.abs(ref_lse[finite].astype(np.float64)))
    ).max(initial=0.0)
    assert lse_err <= tol["lse"], f"lse differs from naive by {lse_err:.3g} (relative)"


def dense_softmax(s, v, allowed=None):
    """softmax(s) @ v with -inf where not allowed, and 0 for an empty row: the tests' own dense
    oracle, written here from the definition and sharing no code with flash_lib (whose
    naive_attention it checks)."""
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    total = e.sum(axis=-1, keepdims=True)
    return (e @ v) / np.where(total == 0, 1, total)

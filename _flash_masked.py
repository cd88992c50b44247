"""Masked keys never leak: ``a @ b`` over the allowed pairs only, when ``b`` holds inf or NaN.

A masked pair weighs exactly 0, but IEEE arithmetic makes ``0 · inf = NaN``; the kernels send
the few key blocks whose values hold such numbers (found once per call) through here.

Private to flash_lib: imported by ``flash_lib.py`` only (and by ``tests/test_masked_keys.py``,
which tests :func:`matmul_allowed` itself).
"""

import numpy as np


def matmul_allowed(a, b, *, allowed, bad, out=None):
    """``a @ b`` over the allowed pairs only, where rows ``bad`` of ``b`` hold inf or NaN.

    ``a`` (..., rows, keys) is exactly 0 at the pairs that are not allowed, but IEEE arithmetic
    makes ``0 · inf = NaN``, so a plain matmul would let a masked key's inf or NaN into a row
    that may not attend it. Here the finite part is one matmul with those entries zeroed, and
    the non-finite terms of the allowed pairs are classified exactly: a term ``a_ij · b_jc`` with
    ``b_jc`` non-finite is NaN if ``b_jc`` is NaN or ``a_ij`` is 0 or NaN, else ±inf by sign; a
    sum is NaN if any term is NaN or both infinities occur, else the infinity that occurs.
    Only key blocks holding such values come here (``bad`` is found once per call). ``a`` holds
    finite numbers or NaN (weights; an infinite ``a_ij`` would turn some ±inf entries into NaN).
    """
    finite_b = b.copy()
    b_bad = b[..., bad, :]
    finite_b[..., bad, :] = np.where(np.isfinite(b_bad), b_bad, 0)
    out = np.matmul(a, finite_b, out=out)
    a_bad = a[..., bad]
    ok = np.broadcast_to(allowed, a.shape)[..., bad]
    pos, neg = ok & (a_bad > 0), ok & (a_bad < 0)
    flat = ok & ~(a_bad > 0) & ~(a_bad < 0)  # a is 0 or NaN
    b_pos, b_neg, b_nan = b_bad == np.inf, b_bad == -np.inf, np.isnan(b_bad)

    def some(x, y):  # some j with x_ij and y_jc, as a count through one small matmul
        return np.matmul(x.astype(out.dtype), y.astype(out.dtype)) > 0

    plus = some(pos, b_pos) | some(neg, b_neg)
    minus = some(pos, b_neg) | some(neg, b_pos)
    nan = some(ok, b_nan) | some(flat, b_pos | b_neg) | (plus & minus)
    # Adding 0 leaves a finite sum unchanged; adding ±inf or NaN gives IEEE's sum of the terms.
    out += np.where(nan, np.nan, np.where(plus, np.inf, np.where(minus, -np.inf, 0)))
    return out


def backward_matmul(problem, allowed, dout, q_start, q_stop, k_start, k_stop):
    """The ``matmul`` of flash_lib's ``attention_backward_tile`` for one tile: plain ``a @ b``, or, for an
    operand with inf or NaN rows in this tile and a tile with masked pairs, ``matmul_allowed``."""
    if allowed is None:
        return None
    bad = {
        "dout": problem.nonfinite_rows("dout", q_start, q_stop, dout),
        "q": problem.nonfinite_rows("q", q_start, q_stop),
        "k": problem.nonfinite_rows("k", k_start, k_stop),
    }
    if all(rows is None for rows in bad.values()):
        return None

    def matmul(a, b, which):
        if bad[which] is None:
            return a @ b
        # a is (..., rows, keys) for dS @ K, or its transpose for Pᵀ dO and dSᵀ Q
        ok = allowed if which == "k" else np.swapaxes(allowed, -1, -2)
        return matmul_allowed(a, b, allowed=ok, bad=bad[which])

    return matmul

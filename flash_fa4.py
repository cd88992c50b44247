"""FlashAttention-4's softmax numerics, emulated bit for bit in NumPy.

FA4 (Blackwell, CuTe DSL) computes part of each tile's ``2^x`` on the FMA units instead of the
special function unit (MUFU.EX2), and rescales its accumulator only when a row's maximum grew by
more than a threshold. Both are in Dao-AILab/flash-attention at commit
``0251105a2fb19d2957484b7f023cd8c115286ced``:

* ``flash_attn/cute/utils.py``: ``POLY_EX2`` (lines 28-61, "Obtained from sollya:
  fpminimax(exp(x * log(2.0)), 1, [|1,24...|],[0;1],relative)"), ``evaluate_polynomial`` /
  ``evaluate_polynomial_2`` (Horner, by ``fma_packed_f32x2``), ``add_round_down``
  (``add.rm.ftz.f32``), ``combine_int_frac_ex2`` (``shl.b32`` by 23 then ``add.s32``) and
  ``ex2_emulation`` / ``ex2_emulation_2`` (lines 752-787), which :func:`exp2_poly` follows
  operation by operation;
* ``flash_attn/cute/softmax.py``: ``update_row_max`` (lines 316-332) keeps the old maximum when
  ``(m_old - m_new) · scale_log2 >= -rescale_threshold``; ``apply_exp2_convert`` (lines 361-402)
  sends a fraction of each fragment's exponentials (``ex2_emu_freq``, ``ex2_emu_res``) to
  ``ex2_emulation_2``. flash_lib's ``flash_attention(..., rescale_threshold=t)`` is that rule.
"""

from __future__ import annotations

import numpy as np

__all__ = ["POLY_EX2", "exp2_poly", "fma32", "ulp_error", "rescale_count"]

#: FA4's coefficients of ``2^f ≈ Σ c_i f^i`` on ``f ∈ [0, 1)``, lowest order first, by degree
#: (``flash_attn/cute/utils.py``, ``POLY_EX2``; each is a float32, 24 significant bits). FA4's
#: degree 0 entry is the scalar ``1.0``, which ``ex2_emulation`` cannot evaluate: left out.
POLY_EX2 = {
    1: (1.0, 0.922497093677520751953125),
    2: (1.0, 0.6657850742340087890625, 0.330107033252716064453125),
    3: (1.0, 0.695146143436431884765625, 0.227564394474029541015625,
        0.077119089663028717041015625),
    4: (1.0, 0.693042695522308349609375, 0.2412912547588348388671875,
        5.2225358784198760986328125e-2, 1.3434938155114650726318359375e-2),
    5: (1.0, 0.693151414394378662109375, 0.24016360938549041748046875,
        5.5802188813686370849609375e-2, 9.01452265679836273193359375e-3,
        1.86810153536498546600341796875e-3),
}

#: 1.5 · 2^23: adding it (rounding down) leaves floor(x) in the low mantissa bits
_ROUND_INT = np.float32(2.0**23 + 2.0**22)


def fma32(a, b, c):
    """``a·b + c`` rounded once to float32 (round to nearest even), as the GPU's FFMA.

    The product of two float32 is exact in float64; the float64 sum is rounded *to odd* (its
    exact error, by TwoSum, nudges an inexact even result one ulp towards it), and a
    round-to-odd at 53 bits followed by a round-to-nearest at 24 is the correctly rounded
    result (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums", 2008, thm. 3).
    """
    a, b, c = (np.asarray(x, np.float32).astype(np.float64) for x in (a, b, c))
    with np.errstate(all="ignore"):
        p = a * b
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
        even = (s.view(np.uint64) & np.uint64(1)) == 0
        nudge = (err != 0) & even & np.isfinite(s)
        s = np.where(nudge, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return s.astype(np.float32)


def exp2_poly(x, degree=3):
    """FA4's software ``2^x`` in float32, bit for bit (``ex2_emulation`` with ``poly_degree``).

    With ``x`` rounded to float32 and denormals flushed to zero (the ``.ftz`` of FA4's ops):

    1. ``xc = fmax(x, -127)`` (PTX ``max``: a NaN gives -127, as on the GPU);
    2. ``r = xc + 1.5·2^23`` rounded down (``add.rm``): ``floor(xc)`` is in its low bits;
    3. ``f = xc - (r - 1.5·2^23)``, both rounded to nearest: the fraction, in ``[0, 1]``;
    4. ``p = c_n f^n + … + c_0`` by Horner with one rounding per step (FMA);
    5. the bits of ``r`` shifted left by 23 (only ``floor(xc)`` survives, in the exponent field)
       added as integers to the bits of ``p``: ``p · 2^floor(xc)``.

    FA4 assumes ``x <= 127`` (its inputs are ``s - m <= rescale_threshold``); beyond, the bits
    are what the same operations give, not ``2^x``. Below ``-126`` the exponent field reaches 0
    and the result is a denormal bit pattern below ``2^-126`` (FA4 flushes it in what follows).
    """
    if degree not in POLY_EX2:
        raise ValueError(f"degree must be one of {sorted(POLY_EX2)} (FA4's POLY_EX2), got {degree!r}")
    x = np.asarray(x, dtype=np.float32)
    tiny = np.finfo(np.float32).tiny
    with np.errstate(all="ignore"):
        x = np.where(np.abs(x) < tiny, np.copysign(np.float32(0), x), x).astype(np.float32)
        xc = np.fmax(x, np.float32(-127.0))
        # x + 1.5·2^23 rounded down to float32's grid of integers there: floor(x) + 1.5·2^23
        # (x + C in float64 would round first: -1e-30 + C is C in float64, not C - 1)
        exact = np.floor(xc).astype(np.float64) + float(_ROUND_INT)
        r = exact.astype(np.float32)
        r = np.where(r.astype(np.float64) > exact, np.nextafter(r, np.float32(-np.inf)), r)
        frac = xc - (r - _ROUND_INT)  # float32 - float32: rounded to nearest, as FA4 requires
        coeffs = [np.float32(c) for c in POLY_EX2[degree]]
        p = np.broadcast_to(coeffs[-1], frac.shape).astype(np.float32)
        for c in coeffs[-2::-1]:
            p = fma32(p, frac, c)
        bits = (r.view(np.uint32) << np.uint32(23)) + p.view(np.uint32)  # wraps mod 2^32
    return bits.view(np.float32)[()] if bits.ndim == 0 else bits.view(np.float32)


def ulp_error(y, x):
    """``|y - 2^x| / ulp(2^x)``: the error of a float32 ``y`` against the exact ``2^x`` (``x``
    taken as float32, ``2^x`` in float64, whose own error is 2^-29 float32 ulps), in float32 ulps
    of the exact value."""
    x = np.asarray(x, dtype=np.float32).astype(np.float64)
    exact = np.exp2(x)
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    return np.abs(np.asarray(y, np.float64) - exact) / ulp


def rescale_count(row_tile_maxima, threshold=None):
    """How many times a row's running maximum moves (so that ``acc`` must be rescaled), given the
    maxima of its tiles in order, in base-2 units: the first tile sets it (not counted), each
    later tile whose maximum exceeds the running one moves it; with ``threshold``, only by more
    than ``threshold`` (FA4's ``update_row_max``). ``row_tile_maxima``: (..., tiles).
    Returns ``(moves, maxima)``: the counts (...,) and the running maxima after each tile."""
    t = np.asarray(row_tile_maxima, dtype=np.float64)
    thr = 0.0 if threshold is None else float(threshold)
    if not thr >= 0 or not np.isfinite(thr):
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")
    m = t[..., 0].copy()
    moves = np.zeros(m.shape, dtype=np.int64)
    running = np.empty_like(t)
    running[..., 0] = m
    for j in range(1, t.shape[-1]):
        move = t[..., j] - m > thr
        moves += move
        m = np.where(move, t[..., j], m)
        running[..., j] = m
    return moves, running

"""FlashAttention fused on a CPU: the two matmuls in BLAS, everything between them in one
compiled pass per tile while the tile is in L1/L2.

flash_lib's kernel walks each ``block_q × block_k`` tile of scores five or six times with
separate NumPy calls (mask, row max, subtract, exp, row sum, rescale), each reading and writing
the whole tile. Here ``S = τ Q_i K_jᵀ`` and ``acc += P V_j`` stay NumPy matmuls (BLAS); in between,
one Numba-compiled function goes over the tile once, row by row, while a row (``block_k``
scores, 4 KiB in float64 at 512) sits in L1: mask, causal cut, running max, the exponential,
row sum, and the rescale of ``l`` and ``acc``. The backward does the same between its five
matmuls: ``P = exp(S - lse)`` and ``dS = P ∘ (dP - D)`` in one pass.

The exponential is this module's own (:func:`exp`): a Cody–Waite range reduction
``x = n·ln2 + r``, ``|r| <= ln2/2`` (``ln2`` split in a high part whose products with ``n`` are
exact and a low part), a minimax polynomial for ``e^r`` (degree 11 in float64, 6 in float32,
fitted with ``mpmath.chebyfit``) evaluated with FMAs, and ``2^n`` written into the exponent
bits: no branch and no libm call, so the compiler vectorises it over a row as it does any
arithmetic loop (FlashAttention-4's software exponential, here on SIMD lanes). Its error,
measured in ``tests/test_flash_cpu.py`` over the range the kernels use: at most 0.93 ulp in
float64 and 1.03 ulp in float32 (NumPy's ``exp`` there: 0.68 and 2.30). Inputs below ``lo`` (-708 in float64, -87 in float32, where ``e^x`` nears the
smallest normal) give 0: such a weight is below ``2^-1021`` (``2^-125``) of the row's
largest, so it changes no sum of the row by a representable amount.

The same contracts as flash_lib for the subset it takes (``mask``, ``causal``, ``scale``,
``return_lse``, ``block_q``, ``block_k``): arguments checked by ``flash_lib.check_inputs`` (the
same errors), bottom-right causal, empty rows 0 with lse ``-inf``, an inf or NaN in ``v`` (or
``k``) at a key reaching exactly the rows that may attend it, the scale applied as
``q·r·2^a``, ``k·2^b``; parallel over (batch, query block) units on
``flash_lib.thread_count()`` threads, each unit computed by one thread with BLAS at one thread,
so the bits do not depend on the thread count. float16 and bfloat16 compute in float32.
The backward with an inf or NaN in any input hands the call to
``flash_lib.flash_attention_backward`` (whose masked-key guards cover every operand); finite
inputs, the case that costs, run here.

Compiled on first use and cached on disk (``cache=True``, in ``__pycache__``): the first call
of a fresh checkout compiles for a few seconds, later processes load the machine code.
"""

from __future__ import annotations

import functools
import math
import threading

import numba
import numpy as np

import flash_lib

__all__ = ["DEFAULT_BLOCK_Q", "DEFAULT_BLOCK_K", "flash_attention", "flash_attention_backward",
           "exp"]

#: Query rows per tile, by default: 256 rows × 512 keys is 1 MiB of float64 scores, half this
#: machine's L2 (2 MiB a core), so the tile BLAS writes is still there when the fused pass and
#: then ``P·V`` read it. Chosen by that argument: a sweep of {128, 256, 512} × {256, 512, 1024}
#: on the project's 2-core machine, loaded by other work, varied more between repeats than
#: between sizes.
DEFAULT_BLOCK_Q = 256
#: Keys per tile, by default: one row of scores is 4 KiB in float64, in L1 during its pass.
DEFAULT_BLOCK_K = 512

# --------------------------------------------------------------------------------------------
# The exponential: Cody–Waite reduction, minimax polynomial, exponent bits
# --------------------------------------------------------------------------------------------

_FASTMATH = {"contract"}  # FMAs allowed; never reassociation (Cody–Waite depends on the order)
_JIT = dict(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy", boundscheck=False)

# float64: ln2 = _LN2_HI_64 + _LN2_LO_64; _LN2_HI_64 has 32 significant bits (fdlibm's), so
# n·_LN2_HI_64 is exact for |n| < 2^21. Polynomial: mpmath.chebyfit(exp, [-ln2/2, ln2/2], 12),
# relative error 3.2e-18 (well under float64's 1.1e-16 half-ulp).
_LOG2E_64 = 1.4426950408889634
_LN2_HI_64 = 6.93147180369123816490e-01
_LN2_LO_64 = 1.90821492927058770002e-10
_ROUND_64 = 6755399441055744.0  # 1.5·2^52: y + it - it rounds y to an integer
_LO_64, _HI_64 = -708.0, 709.0
_P64 = (1.0, 1.0, 0.5000000000000019, 0.1666666666666668, 0.0416666666664881,
        0.008333333333319601, 0.0013888888952314775, 0.00019841269890047113,
        2.4801485482328494e-05, 2.755724091857897e-06, 2.763263963904103e-07,
        2.5110037605963777e-08)
(_A0, _A1, _A2, _A3, _A4, _A5, _A6, _A7, _A8, _A9, _A10, _A11) = _P64

# float32: _LN2_HI_32 = 0x3f317200 (15 significant bits; |n| <= 127). Polynomial:
# mpmath.chebyfit(exp, [-ln2/2, ln2/2], 7), relative error 2.0e-9 (float32's half-ulp: 6e-8).
_f32 = np.float32
_LOG2E_32 = _f32(1.4426950408889634)
_LN2_HI_32 = _f32(0.693145751953125)
_LN2_LO_32 = _f32(1.428606765330187e-06)
_ROUND_32 = _f32(12582912.0)  # 1.5·2^23
_LO_32, _HI_32 = _f32(-87.0), _f32(88.0)
_B0, _B1, _B2, _B3, _B4, _B5, _B6 = (_f32(c) for c in (
    1.0, 1.000000037716214, 0.5000000047117757, 0.16666415514653277, 0.04166635289677516,
    0.008375126398153335, 0.0013941108433972674))
_ZERO_32, _INF_32 = _f32(0.0), _f32(np.inf)


@numba.extending.intrinsic
def _bits_of(typingctx, x):
    """The IEEE bits of a float32 (float64) as an int32 (int64): a bitcast, free in a register."""
    to = {numba.types.float32: numba.types.int32, numba.types.float64: numba.types.int64}.get(x)
    if to is None:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(to))
    return to(x), codegen


@numba.extending.intrinsic
def _float_of(typingctx, x):
    """The float32 (float64) whose IEEE bits are this int32 (int64)."""
    to = {numba.types.int32: numba.types.float32, numba.types.int64: numba.types.float64}.get(x)
    if to is None:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(to))
    return to(x), codegen


def _exp_row_64(row, shift):
    """``row[c] = e^(row[c] - shift)`` in place, for a float64 row, in one vectorised loop: the
    polynomial, then ``2^n`` added to its exponent bits (exact: ``e^r >= 2^-0.5`` and
    ``n >= -1021`` keep the result normal). In place on purpose: with a separate input that may
    alias the output, the vectoriser's runtime overlap check fails when they are the same row
    and the scalar loop runs."""
    for c in range(row.shape[0]):
        xc = row[c] - shift
        y = xc if xc > _LO_64 else _LO_64
        y = y if y < _HI_64 else _HI_64
        n = (y * _LOG2E_64 + _ROUND_64) - _ROUND_64  # round(y / ln 2)
        r = (y - n * _LN2_HI_64) - n * _LN2_LO_64  # Cody–Waite: exact first step
        p = _A11
        p = p * r + _A10
        p = p * r + _A9
        p = p * r + _A8
        p = p * r + _A7
        p = p * r + _A6
        p = p * r + _A5
        p = p * r + _A4
        p = p * r + _A3
        p = p * r + _A2
        p = p * r + _A1
        p = p * r + _A0
        p = _float_of(_bits_of(p) + (np.int64(n) << 52))  # p · 2^n
        p = 0.0 if xc < _LO_64 else p  # -inf and the underflowing tail
        p = np.inf if xc > _HI_64 else p
        row[c] = xc if xc != xc else p  # NaN stays NaN


def _exp_row_32(row, shift):
    """:func:`_exp_row_64` for a float32 row (``n >= -126``, with ``e^r > 1`` there)."""
    for c in range(row.shape[0]):
        xc = row[c] - shift
        y = xc if xc > _LO_32 else _LO_32
        y = y if y < _HI_32 else _HI_32
        n = (y * _LOG2E_32 + _ROUND_32) - _ROUND_32
        r = (y - n * _LN2_HI_32) - n * _LN2_LO_32
        p = _B6
        p = p * r + _B5
        p = p * r + _B4
        p = p * r + _B3
        p = p * r + _B2
        p = p * r + _B1
        p = p * r + _B0
        p = _float_of(np.int32(_bits_of(p) + (np.int32(n) << np.int32(23))))  # int32 + int32 is int64 in Numba
        p = _ZERO_32 if xc < _LO_32 else p
        p = _INF_32 if xc > _HI_32 else p
        row[c] = xc if xc != xc else p


def _exp_row(row, shift):  # the compiled code's: its overload picks the dtype's
    raise NotImplementedError  # pragma: no cover - only its overload runs


@numba.extending.overload(_exp_row, jit_options=dict(fastmath=_FASTMATH))
def _exp_row_overload(row, shift):
    return _exp_row_32 if row.dtype == numba.types.float32 else _exp_row_64


@numba.njit(**_JIT)
def _exp_array(out):
    _exp_row(out, out.dtype.type(0))


def exp(x):
    """This module's exponential of a float32 or float64 array, elementwise, in its dtype: the one
    the kernels run (the module docstring). Accurate to 1 ulp on ``[lo, 0]``, where the kernels
    call it; 0 below ``lo`` (-708 in float64, -87 in float32), inf above 709 (88), NaN for NaN."""
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float64):
        raise TypeError(f"x must be a float32 or float64 array, got dtype {x.dtype}")
    out = np.array(x, order="C").reshape(-1)  # a copy, computed in place
    _exp_array(out)
    return out.reshape(x.shape)


# --------------------------------------------------------------------------------------------
# The fused passes
# --------------------------------------------------------------------------------------------


@numba.njit(**_JIT)
def _row_max(row, stop):
    """max of ``row[:stop]`` ignoring NaN (a NaN score still reaches its row through ``exp``),
    -inf if none; eight independent maxima, so no loop-carried chain waits on one compare."""
    ninf = row.dtype.type(-np.inf)
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = ninf
    c = 0
    while c + 8 <= stop:
        x0, x1, x2, x3 = row[c], row[c + 1], row[c + 2], row[c + 3]
        x4, x5, x6, x7 = row[c + 4], row[c + 5], row[c + 6], row[c + 7]
        m0 = x0 if x0 > m0 else m0
        m1 = x1 if x1 > m1 else m1
        m2 = x2 if x2 > m2 else m2
        m3 = x3 if x3 > m3 else m3
        m4 = x4 if x4 > m4 else m4
        m5 = x5 if x5 > m5 else m5
        m6 = x6 if x6 > m6 else m6
        m7 = x7 if x7 > m7 else m7
        c += 8
    while c < stop:
        x0 = row[c]
        m0 = x0 if x0 > m0 else m0
        c += 1
    return max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))


@numba.njit(**_JIT)
def _row_sum(row, stop):
    """``sum(row[:stop])`` with eight partial sums in a fixed order: vectorisable, the same bits
    on every call."""
    zero = row.dtype.type(0)
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = zero
    c = 0
    while c + 8 <= stop:
        s0 += row[c]
        s1 += row[c + 1]
        s2 += row[c + 2]
        s3 += row[c + 3]
        s4 += row[c + 4]
        s5 += row[c + 5]
        s6 += row[c + 6]
        s7 += row[c + 7]
        c += 8
    while c < stop:
        s0 += row[c]
        c += 1
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@numba.njit(**_JIT)
def _mask_row(row, mask_row, stop):
    """-inf where ``mask_row[c]`` is False, over ``row[:stop]``."""
    ninf = row.dtype.type(-np.inf)
    for c in range(stop):
        row[c] = row[c] if mask_row[c] else ninf


@numba.njit(**_JIT)
def _forward_tile(s, m, l, acc, mask, use_mask, diag, q0, k0):
    """Fold one tile of scores ``s`` (rows × keys, scaled) into its rows' ``m``, ``l``, ``acc``
    in one pass, leaving ``P`` in ``s``. Row ``r`` may attend key ``c`` iff
    ``mask[q0 + r, k0 + c]`` (with ``use_mask``; the whole batch entry's mask, so that it is
    compiled for one array layout, not one per tile shape) and ``c <= r + diag`` (causal; a
    ``diag`` >= keys means no cut).

    Per row, while it is in L1: mask; allowed prefix; max; ``m' = max(m, max_c s)``;
    ``p = e^(s - m')`` (0 past the prefix); ``l' = l·e^(m - m') + Σ p``; ``acc *= e^(m - m')``.
    ``acc += P·V_j`` is the caller's BLAS call."""
    rows, keys = s.shape
    dv = acc.shape[1]
    zero = s.dtype.type(0)
    for r in range(rows):
        row = s[r]
        stop = min(max(r + diag + 1, 0), keys)  # keys [0, stop) pass the causal cut
        if use_mask:
            _mask_row(row, mask[q0 + r, k0:], stop)
        for c in range(stop, keys):
            row[c] = zero
        m_old = m[r]
        m_new = max(m_old, _row_max(row, stop))
        m_ref = zero if m_new == -np.inf else m_new  # no allowed key yet: e^(-inf - 0) = 0
        alpha = math.exp(m_old - m_ref)  # once per row: libm is fine
        if stop > 0:
            _exp_row(row[:stop], m_ref)
        l[r] = l[r] * alpha + _row_sum(row, stop)
        m[r] = m_new
        if alpha != 1:
            for c in range(dv):
                acc[r, c] *= alpha


@numba.njit(**_JIT)
def _add_bad_keys(p, acc, v_raw, bad, mask, use_mask, diag, q0, k0):
    """``acc[r] += p[r, c]·v[c]`` in IEEE arithmetic for each key ``c`` in ``bad`` (inf or NaN
    in its ``v`` row, zeroed in the ``V`` BLAS multiplied) and each row ``r`` allowed to attend
    it: so an inf or NaN reaches exactly those rows, as ``0·inf`` would not for the others."""
    rows = p.shape[0]
    dv = acc.shape[1]
    for c in bad:
        for r in range(rows):
            if c > r + diag or (use_mask and not mask[q0 + r, k0 + c]):
                continue
            w = p[r, c]
            for e in range(dv):
                acc[r, e] += w * v_raw[c, e]


@numba.njit(**_JIT)
def _finalize(acc, l, m, out, lse, want_lse):
    """``out = acc / l`` and ``lse = m + log l``; an empty row (``l == 0``) gets 0 and -inf."""
    rows, dv = acc.shape
    for r in range(rows):
        if l[r] == 0:
            for c in range(dv):
                out[r, c] = 0
            if want_lse:
                lse[r] = -np.inf
        else:
            inv = 1 / l[r]
            for c in range(dv):
                out[r, c] = acc[r, c] * inv
            if want_lse:
                lse[r] = m[r] + math.log(l[r])


@numba.njit(**_JIT)
def _backward_tile(s, dp, lse, D, mask, use_mask, diag, q0, k0):
    """One backward tile, one pass: ``P = e^(S - lse)`` into ``s`` and ``dS = P ∘ (dP - D)``
    into ``dp``, both exactly 0 where a pair is not allowed (``lse`` is +inf for an empty row;
    the inputs are finite, so ``0 · (dP - D)`` is 0)."""
    rows, keys = s.shape
    zero = s.dtype.type(0)
    for r in range(rows):
        row, drow = s[r], dp[r]
        stop = min(max(r + diag + 1, 0), keys)
        if use_mask:
            _mask_row(row, mask[q0 + r, k0:], stop)
        if stop > 0:
            _exp_row(row[:stop], lse[r])
        d = D[r]
        for c in range(stop):
            drow[c] = row[c] * (drow[c] - d)
        for c in range(stop, keys):
            row[c] = zero
            drow[c] = zero


# --------------------------------------------------------------------------------------------
# The inputs, as the compiled passes take them
# --------------------------------------------------------------------------------------------


def _split_scale(scale):
    """τ = r·2^e as ``(r·2^a, 2^b)``, ``b = trunc(e/2)``, ``a = e - b``: flash_lib's placement,
    so that neither scaled operand overflows or underflows where the product would not."""
    r, e = math.frexp(scale)
    b = int(e / 2)
    return math.ldexp(r, e - b), math.ldexp(1.0, b)


def _flat(x, batch, dtype):
    """``x`` broadcast to ``batch`` leading dims, as ``(B, rows, cols)`` in C order, ``dtype``."""
    x = np.broadcast_to(np.asarray(x), batch + x.shape[-2:])
    # math.prod, not -1: a reshape cannot infer -1 when there are no queries or keys
    return np.ascontiguousarray(x.reshape((math.prod(batch),) + x.shape[-2:]), dtype=dtype)


def _mask3(mask, batch, n_q, n_k):
    """The mask as ``(B, Nq, Nk)`` bool: a view with stride 0 along the axes it broadcasts over
    where its dims merge, else a copy; a 1 × 1 dummy without a mask."""
    if mask is None:
        return np.ones((1, 1, 1), bool), False
    mask = np.broadcast_to(np.asarray(mask), batch + (n_q, n_k))
    return mask.reshape((math.prod(batch), n_q, n_k)), True


def _setup(q, k, v, mask, causal, scale, block_q, block_k, **saved):
    checked = flash_lib.check_inputs(q, k, v, mask=mask, causal=causal, scale=scale,
                                     block_q=block_q, block_k=block_k, **saved)
    dtype, batch = checked.dtype, checked.batch
    scale_q, scale_k = _split_scale(checked.scale)
    q3 = _flat(q, batch, dtype)
    k3 = _flat(k, batch, dtype)
    if scale_q != 1:  # a new array: q3 may be the caller's own q
        q3 = q3 * dtype.type(scale_q)
    k_scaled = k3 * dtype.type(scale_k) if scale_k != 1 else k3
    v3 = _flat(v, batch, dtype)
    mask3, use_mask = _mask3(mask, batch, checked.n_q, checked.n_k)
    return checked, q3, k3, k_scaled, v3, mask3, use_mask


def _tile(buffer, rows, cols):
    """A C-order ``rows × cols`` view at the start of a 2-D buffer (a partial tile stays
    contiguous, so the compiled pass gets the one layout it was compiled for)."""
    return buffer.reshape(-1)[:rows * cols].reshape(rows, cols)


def _key_stop(causal, q_stop, n_q, n_k):
    """Keys past which no row of a block ending at ``q_stop`` may attend (bottom-right causal)."""
    return min(n_k, max(q_stop - 1 + n_k - n_q + 1, 0)) if causal else n_k


# --------------------------------------------------------------------------------------------
# The forward
# --------------------------------------------------------------------------------------------


def flash_attention(q, k, v, *, mask=None, causal=False, scale=None, return_lse=False,
                    block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K):
    """Exact attention, tile by tile, one fused compiled pass per tile between two BLAS calls.

    ``flash_lib.flash_attention``'s arguments, results and contracts for this subset (the
    module docstring); the same checks and errors (``flash_lib.check_inputs``). Scratch per
    worker thread: one ``block_q × block_k`` tile and ``block_q × dv`` accumulators; besides,
    the inputs in C order in the compute dtype (a copy when they are not already), and with an
    inf or NaN in ``v`` a copy of it with those rows zeroed.
    """
    checked, q3, _, k_s, v3, mask3, use_mask = _setup(q, k, v, mask, causal, scale, block_q,
                                                        block_k)
    dtype, n_q, n_k, dv = checked.dtype, checked.n_q, checked.n_k, checked.dv
    n_b = q3.shape[0]
    out = np.zeros((n_b, n_q, dv), dtype)
    lse = np.full((n_b, n_q), -np.inf, dtype)
    bad = ~np.isfinite(v3).all(axis=-1)  # keys whose v holds inf or NaN, per batch entry
    v_mm = np.where(bad[..., None], dtype.type(0), v3) if bad.any() else v3
    bq, bk = min(block_q, max(n_q, 1)), min(block_k, max(n_k, 1))
    local = threading.local()

    def work(unit, cancelled):
        b, q_start, q_stop = unit
        if not hasattr(local, "buffers"):
            local.buffers = (np.empty((bq, bk), dtype), np.empty((bq, dv), dtype))
        s_buf, pv_buf = local.buffers
        rows = q_stop - q_start
        q_i = q3[b, q_start:q_stop]
        m = np.full(rows, -np.inf, dtype)
        l = np.zeros(rows, dtype)
        acc = np.zeros((rows, dv), dtype)
        mb = mask3[b if mask3.shape[0] > 1 else 0]
        for k_start in range(0, _key_stop(causal, q_stop, n_q, n_k), bk):
            if cancelled.is_set():  # another worker failed: stop before the next tile
                return
            k_stop = min(k_start + bk, n_k)
            s = np.matmul(q_i, k_s[b, k_start:k_stop].T, out=_tile(s_buf, rows, k_stop - k_start))
            diag = q_start + n_k - n_q - k_start if causal else k_stop - k_start
            _forward_tile(s, m, l, acc, mb, use_mask, diag, q_start, k_start)
            acc += np.matmul(s, v_mm[b, k_start:k_stop], out=_tile(pv_buf, rows, dv))
            bad_here = np.flatnonzero(bad[b, k_start:k_stop])
            if bad_here.size:
                _add_bad_keys(s, acc, v3[b, k_start:k_stop], bad_here, mb, use_mask, diag,
                              q_start, k_start)
        _finalize(acc, l, m, out[b, q_start:q_stop], lse[b, q_start:q_stop], return_lse)

    units = [(b, s, min(s + bq, n_q)) for s in range(0, n_q, bq) for b in range(n_b)]
    with np.errstate(invalid="ignore"):  # inf - inf where a row meets an inf: its NaN is due
        flash_lib.run_blocks(work, units, n_scores=n_b * n_q * n_k)
    out = out.reshape(checked.batch + (n_q, dv)).astype(checked.out_dtype, copy=False)
    return (out, lse.reshape(checked.batch + (n_q,))) if return_lse else out


# --------------------------------------------------------------------------------------------
# The backward
# --------------------------------------------------------------------------------------------


def flash_attention_backward(q, k, v, out, lse, dout, *, mask=None, causal=False, scale=None,
                             block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K):
    """``(dq, dk, dv)``, the gradients of ``sum(dout * flash_attention(q, k, v, ...))``, as
    ``flash_lib.flash_attention_backward`` for this subset: FlashAttention-2's loop, key blocks
    on the threads, each holding its ``dK_j``, ``dV_j``; ``dQ_i``'s shares added in key-block
    order (so the bits do not depend on the threads). Per tile: ``S = QKᵀ`` and ``dP = dO Vᵀ``
    (BLAS), the fused pass ``P = e^(S - lse)``, ``dS = P ∘ (dP - D)``, then ``dV += Pᵀ dO``,
    ``dK += dSᵀ Q`` and ``dQ += dS K`` (BLAS). An input holding inf or NaN goes to
    ``flash_lib.flash_attention_backward``."""
    checked, q3, k3, k_s, v3, mask3, use_mask = _setup(
        q, k, v, mask, causal, scale, block_q, block_k, out=out, lse=lse, dout=dout)
    if not all(np.isfinite(x).all() for x in (q3, k3, v3, np.asarray(dout))):
        return flash_lib.flash_attention_backward(q, k, v, out, lse, dout, mask=mask,
                                                  causal=causal, scale=scale, block_q=block_q,
                                                  block_k=block_k)
    dtype, n_q, n_k, d, dv = checked.dtype, checked.n_q, checked.n_k, checked.d, checked.dv
    scale_q, scale_k = _split_scale(checked.scale)
    n_b = q3.shape[0]
    do3 = _flat(dout, checked.batch, dtype)
    o3 = _flat(out, checked.batch, dtype)
    lse3 = np.ascontiguousarray(np.broadcast_to(np.asarray(lse), checked.batch + (n_q,)),
                                dtype=dtype).reshape(n_b, n_q)
    lse3 = np.where(lse3 == -np.inf, dtype.type(np.inf), lse3)  # empty rows: P = e^(-inf) = 0
    D = np.multiply(do3, o3).sum(axis=-1)  # rowsum(dO ∘ O), once per row; pairwise, as flash_lib
    dq = np.zeros((n_b, n_q, d), dtype)
    dk = np.zeros((n_b, n_k, d), dtype)
    dvv = np.zeros((n_b, n_k, dv), dtype)
    bq, bk = min(block_q, max(n_q, 1)), min(block_k, max(n_k, 1))
    n_qb = -(-n_q // bq)
    turns = [flash_lib.InOrder(n_qb) for _ in range(n_b)]  # dQ_i's shares in key-block order
    local = threading.local()

    def work(unit, cancelled):
        b, k_start, k_stop = unit
        j = k_start // bk
        if not hasattr(local, "buffers"):
            local.buffers = (np.empty((bq, bk), dtype), np.empty((bq, bk), dtype),
                             np.empty((bq, d), dtype))
        s_buf, dp_buf, dq_buf = local.buffers
        ks_j, v_j = k_s[b, k_start:k_stop], v3[b, k_start:k_stop]  # τ_k K_j, V_j
        dk_j = np.zeros((k_stop - k_start, d), dtype)
        dv_j = np.zeros((k_stop - k_start, dv), dtype)
        mb = mask3[b if mask3.shape[0] > 1 else 0]
        for i in range(n_qb):
            q_start, q_stop = i * bq, min((i + 1) * bq, n_q)
            rows, keys = q_stop - q_start, k_stop - k_start
            visit = not causal or k_start <= q_stop - 1 + n_k - n_q
            if visit:
                q_i, do_i = q3[b, q_start:q_stop], do3[b, q_start:q_stop]
                s = np.matmul(q_i, ks_j.T, out=_tile(s_buf, rows, keys))
                dp = np.matmul(do_i, v_j.T, out=_tile(dp_buf, rows, keys))
                diag = q_start + n_k - n_q - k_start if causal else keys
                _backward_tile(s, dp, lse3[b, q_start:q_stop], D[b, q_start:q_stop], mb,
                               use_mask, diag, q_start, k_start)
                dv_j += s.T @ do_i
                dk_j += dp.T @ q_i
                share = np.matmul(dp, ks_j, out=_tile(dq_buf, rows, d))  # times τ_q at the end
            with turns[b].turn(i, j, cancelled) as mine:  # dQ_i += dS_ij K_j, key-block order
                if not mine:  # cancelled: the block before failed, its turn never comes
                    return
                if visit:
                    dq[b, q_start:q_stop] += share
        dk[b, k_start:k_stop] = dk_j * dtype.type(scale_k)
        dvv[b, k_start:k_stop] = dv_j

    units = [(b, s, min(s + bk, n_k)) for b in range(n_b) for s in range(0, n_k, bk)]
    flash_lib.run_blocks(work, units, n_scores=n_b * n_q * n_k)
    dq *= dtype.type(scale_q)
    batch = checked.batch
    grads = []
    for g, x, rows in ((dq, q, n_q), (dk, k, n_k), (dvv, v, n_k)):
        g = g.reshape(batch + g.shape[1:])
        grads.append(flash_lib.sum_to(g, np.shape(x)).astype(np.asarray(x).dtype, copy=False))
    return tuple(grads)

"""FlashAttention's forward pass, exact, in plain NumPy.

Attention of queries ``q`` over keys ``k`` and values ``v`` is

    S = scale · q kᵀ,   P = softmax(S) row by row,   out = P v,

and the textbook way (:func:`naive_attention`) stores the whole ``Nq × Nk`` matrix ``S``.
:func:`flash_attention` computes the same ``out`` without ever holding more than one
``block_q × block_k`` tile of ``S``: it walks over key blocks and keeps, for each query row,

* ``m``   -- the running maximum of the scores seen so far (so ``exp`` never overflows),
* ``l``   -- the running denominator ``Σ exp(s - m)`` over those scores,
* ``acc`` -- the running numerator ``Σ exp(s - m) · v`` (a ``dv``-vector per row).

When a new tile raises the maximum from ``m`` to ``m'``, everything summed so far was scaled
by ``exp(-m)`` instead of ``exp(-m')``; multiplying ``l`` and ``acc`` by ``exp(m - m')``
corrects that exactly. After the last tile ``out = acc / l`` and the row's log-sum-exp is
``lse = m + log(l)``.

Symbols, used throughout the code and the notebooks:

=========== ===============================================================================
``Nq, Nk``  number of queries, number of keys
``d, dv``   feature size of queries/keys, feature size of values
``block_q`` rows of queries in one tile; ``block_k``: keys in one tile
``m``       running row maximum of the scaled, masked scores
``l``       running row sum of ``exp(s - m)``
``lse``     log-sum-exp of a row's scaled, masked scores: ``m + log(l)`` (natural log)
=========== ===============================================================================

Conventions (the same in both kernels, see ``README.md`` for how others differ):

* ``mask[..., i, j]`` True means query ``i`` may attend to key ``j`` (PyTorch SDPA and JAX).
* ``causal=True`` allows key ``j`` for query ``i`` iff ``j <= i + (Nk - Nq)``: the diagonal is
  aligned bottom-right, as in FlashAttention >= 2.1, so the last query sees every key.
* A row with no allowed key gives ``out`` exactly ``0.0`` and ``lse = -inf``, with no NaN and no
  floating-point warning.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
import os
import threading
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from threadpoolctl import ThreadpoolController

__all__ = [
    "DEFAULT_BLOCK_Q",
    "DEFAULT_BLOCK_K",
    "flash_attention",
    "naive_attention",
    "precise_attention",
    "merge_attention",
    "tile_schedule",
    "measure_peak_bytes",
    "rowwise_relative_error",
]

#: Queries in one tile, by default. Chosen by measurement (``bench/bench_flash.py --sweep-blocks``,
#: N = 4096, d = 64, 2 cores): per tile NumPy pays a fixed cost of a dozen Python-level calls, so
#: tiles must be large for the two matmuls and the exp to dominate. 512 × 512 was within 0.3% of
#: the fastest of {64, …, 1024}² in float64 and float32; 64-wide tiles took 1.2-5× as long, and
#: 1024-row blocks leave too few blocks to share between threads at small N. The scores tile is
#: then 2 MiB in float64, whatever N is.
DEFAULT_BLOCK_Q = 512
#: Keys in one tile, by default (chosen with ``DEFAULT_BLOCK_Q``).
DEFAULT_BLOCK_K = 512

# Query blocks are independent, so they run on a small thread pool: NumPy releases the GIL in
# matmul, exp and the reductions, which the single-threaded elementwise passes need to use both
# cores. Each block is computed by exactly the same calls whichever thread runs it, so results are
# bit-identical from run to run. FLASH_LIB_THREADS=1 turns it off.
_THREADS = max(1, int(os.environ.get("FLASH_LIB_THREADS", min(os.cpu_count() or 1, 4))))
_PARALLEL_MIN_SCORES = 1 << 20
# The kernel's matmuls are tile-sized: BLAS threads would only fight our workers (or, without
# workers, spin between small calls), so the kernel runs with one BLAS thread (see _one_blas_thread).
_BLAS = ThreadpoolController()  # found once at import, a limit then costs ~10 µs to set
_blas_lock = threading.Lock()
_blas_users = 0
_blas_limiter = None

_FLOAT_DTYPES = (np.float16, np.float32, np.float64)


# --------------------------------------------------------------------------------------------
# Input checking, shared by both kernels so they accept and reject exactly the same inputs.
# --------------------------------------------------------------------------------------------


def _as_float_array(name, x):
    x = np.asarray(x)
    if x.dtype.type not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a float16, float32 or float64 array, got dtype {x.dtype}"
        )
    if x.ndim < 2:
        raise ValueError(
            f"{name} must have at least 2 dimensions (..., N, features), got shape {x.shape}"
        )
    return x


def _int_at_least(name, value, low):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        kind = "positive" if low == 1 else "non-negative"
        raise ValueError(f"{name} must be a {kind} integer, got {value!r}")
    return int(value)


def _check_inputs(q, k, v, mask, causal, scale):
    """Validate and normalise the arguments; return everything the kernels need."""
    q = _as_float_array("q", q)
    k = _as_float_array("k", k)
    v = _as_float_array("v", v)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same feature size d (last axis), "
            f"got q.shape={q.shape} and k.shape={k.shape}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same number of keys Nk (axis -2), "
            f"got k.shape={k.shape} and v.shape={v.shape}"
        )
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    try:
        batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ValueError(
            f"the leading (batch) dimensions of q, k and v must broadcast together, got "
            f"q.shape={q.shape}, k.shape={k.shape}, v.shape={v.shape}"
        ) from None
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_:
            raise TypeError(
                f"mask must be a boolean array (True = may attend), got dtype {mask.dtype}"
            )
        try:
            full = np.broadcast_shapes(mask.shape, batch + (n_q, n_k))
        except ValueError:
            full = None
        if full is None or full[-2:] != (n_q, n_k):
            raise ValueError(
                f"mask of shape {mask.shape} does not broadcast to (..., Nq, Nk) = "
                f"{batch + (n_q, n_k)}"
            )
        batch = full[:-2]
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    elif (
        isinstance(scale, bool)
        or not isinstance(scale, numbers.Real)
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    out_dtype = np.result_type(q.dtype, k.dtype, v.dtype)
    # float16 has 11 bits of mantissa and overflows at 65504: sums and products run in float32.
    acc_dtype = np.float32 if out_dtype == np.float16 else out_dtype
    return q, k, v, mask, bool(causal), float(scale), batch, out_dtype, np.dtype(acc_dtype)


def _finalize(acc, l, m):
    """``out = acc / l`` and ``lse = m + log(l)``, with empty rows (``l == 0``) as 0 and -inf.

    ``l == 0`` exactly when no key was allowed, because the largest allowed score contributes
    ``exp(0) = 1``. A NaN row has ``l`` NaN, which is not 0, so it stays NaN in both outputs.
    """
    empty = l == 0
    out = acc / np.where(empty, 1, l)[..., None]
    lse = np.full_like(l, -np.inf)
    np.log(l, out=lse, where=~empty)
    lse += m
    return out, lse


# --------------------------------------------------------------------------------------------
# The reference
# --------------------------------------------------------------------------------------------


def naive_attention(q, k, v, *, mask=None, causal=False, scale=None, return_lse=False):
    """Textbook attention: the full ``Nq × Nk`` score matrix, then a max-subtracted softmax.

    Same arguments, results and conventions as :func:`flash_attention` (minus the block sizes);
    it is the oracle the tiled kernel is tested against, so it stays as plain as possible.
    """
    q, k, v, mask, causal, scale, batch, out_dtype, acc = _check_inputs(
        q, k, v, mask, causal, scale
    )
    n_q, n_k = q.shape[-2], k.shape[-2]
    allowed = _allowed(mask, causal, n_q, n_k, 0, n_q, 0, n_k)
    out, lse = _dense_attention(q, k, v, allowed, scale, batch, acc)
    out = out.astype(out_dtype, copy=False)
    return (out, lse) if return_lse else out


def _dense_attention(q, k, v, allowed, scale, batch, dtype):
    """The full score matrix in ``dtype``, then a max-subtracted softmax: naive and precise."""
    s = (q.astype(dtype) @ np.swapaxes(k.astype(dtype), -1, -2)) * dtype.type(scale)
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    s = np.broadcast_to(s, batch + s.shape[-2:])  # v or mask may carry more batch dims than q, k
    m = s.max(axis=-1, initial=-np.inf)
    # Any finite reference point works for an empty row (all its scores are -inf); 0 avoids
    # the NaN of -inf - (-inf).
    p = np.exp(s - np.where(m == -np.inf, 0, m)[..., None])
    return _finalize(p @ v.astype(dtype), p.sum(axis=-1), m)


def precise_attention(q, k, v, *, mask=None, causal=False, scale=None, return_lse=False):
    """Attention in more precision than float64: the truth the other kernels are measured against.

    Same semantics as :func:`naive_attention`; the scale is the float64 number the kernels use,
    so only the kernels' own rounding is measured. Computed in ``np.longdouble`` where that is
    wider than float64 (x86-64: 64-bit mantissa; aarch64 Linux: 113-bit), else with ``mpmath`` at
    40 significant digits, elementwise and slow: meant for small inputs. Returns float64 arrays
    from the mpmath path and longdouble arrays otherwise.
    """
    q, k, v, mask, causal, scale, batch, _, _ = _check_inputs(q, k, v, mask, causal, scale)
    n_q, n_k = q.shape[-2], k.shape[-2]
    allowed = _allowed(mask, causal, n_q, n_k, 0, n_q, 0, n_k)
    if np.finfo(np.longdouble).nmant > np.finfo(np.float64).nmant:
        out, lse = _dense_attention(q, k, v, allowed, scale, batch, np.dtype(np.longdouble))
    else:  # pragma: no cover - only where longdouble is float64 (macOS arm64, Windows)
        allowed = np.broadcast_to(True if allowed is None else allowed, batch + (n_q, n_k))
        out, lse = _mpmath_attention(q, k, v, allowed, scale, batch)
    return (out, lse) if return_lse else out


def _mpmath_attention(q, k, v, allowed, scale, batch):  # pragma: no cover - see caller
    import mpmath

    mp = mpmath.mp.clone()
    mp.dps = 40
    q, k, v = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (q, k, v))
    out = np.zeros(batch + (q.shape[-2], v.shape[-1]))
    lse = np.full(batch + (q.shape[-2],), -np.inf)
    for idx in np.ndindex(*batch, q.shape[-2]):
        b, i = idx[:-1], idx[-1]
        keys = [j for j in range(k.shape[-2]) if allowed[b + (i, j)]]
        if not keys:
            continue
        s = [mp.mpf(scale) * mp.fsum(mp.mpf(x) * mp.mpf(y) for x, y in zip(q[b + (i,)], k[b + (j,)]))
             for j in keys]
        mx = max(s)
        w = [mp.exp(x - mx) for x in s]
        total = mp.fsum(w)
        for c in range(v.shape[-1]):
            out[b + (i, c)] = float(mp.fsum(wj * mp.mpf(v[b + (j, c)]) for wj, j in zip(w, keys)) / total)
        lse[b + (i,)] = float(mx + mp.log(total))
    return out, lse


# --------------------------------------------------------------------------------------------
# The tiled kernel
# --------------------------------------------------------------------------------------------


def tile_schedule(n_q, n_k, block_q, block_k, causal=False):
    """The tiles :func:`flash_attention` visits, in order, as ``(q_start, q_stop, k_start, k_stop)``.

    Query blocks in the outer loop, key blocks in the inner loop (FlashAttention-2's order: each
    query block's ``m``, ``l`` and ``acc`` live through one inner loop). The last block in each
    direction may be partial. With ``causal=True`` a tile is visited only if at least one of its
    (query, key) pairs is allowed, that is ``k_start <= (q_stop - 1) + (n_k - n_q)``; the tiles
    above the bottom-right-aligned diagonal are skipped without being computed.
    """
    n_q = _int_at_least("n_q", n_q, 0)
    n_k = _int_at_least("n_k", n_k, 0)
    block_q = _int_at_least("block_q", block_q, 1)
    block_k = _int_at_least("block_k", block_k, 1)
    return [
        (q_start, q_stop, k_start, k_stop)
        for q_start, q_stop in _query_blocks(n_q, block_q)
        for k_start, k_stop in _key_blocks(q_stop, n_q, n_k, block_k, causal)
    ]


# The kernel walks these two generators directly rather than a materialised schedule, whose list
# would hold one tuple per tile: O(Nq·Nk / (block_q·block_k)) memory.
def _query_blocks(n_q, block_q):
    for q_start in range(0, n_q, block_q):
        yield q_start, min(q_start + block_q, n_q)


def _key_blocks(q_stop, n_q, n_k, block_k, causal):
    # One past the last key that the block's last query (q_stop - 1) may see.
    k_end = max(0, min(n_k, q_stop + (n_k - n_q))) if causal else n_k
    for k_start in range(0, k_end, block_k):
        yield k_start, min(k_start + block_k, n_k)


def _allowed(mask, causal, n_q, n_k, q_start, q_stop, k_start, k_stop):
    """Boolean tile of allowed (query, key) pairs, or None when every pair is allowed."""
    allowed = None
    if mask is not None:
        allowed = np.broadcast_to(mask, mask.shape[:-2] + (n_q, n_k))[
            ..., q_start:q_stop, k_start:k_stop
        ]
    # Only tiles crossing the causal diagonal need an explicit causal mask.
    if causal and k_stop - 1 > q_start + (n_k - n_q):
        rows = np.arange(q_start, q_stop)[:, None] + (n_k - n_q)
        tri = np.arange(k_start, k_stop)[None, :] <= rows
        allowed = tri if allowed is None else allowed & tri
    return allowed


def flash_attention(
    q,
    k,
    v,
    *,
    mask=None,
    causal=False,
    scale=None,
    block_q=DEFAULT_BLOCK_Q,
    block_k=DEFAULT_BLOCK_K,
    return_lse=False,
):
    """Exact attention, computed tile by tile without storing the ``Nq × Nk`` scores.

    Parameters
    ----------
    q, k, v : arrays of shape ``(..., Nq, d)``, ``(..., Nk, d)``, ``(..., Nk, dv)``
        float16, float32 or float64. Leading (batch, head) dimensions broadcast by NumPy's rules
        across ``q``, ``k``, ``v`` and ``mask``. float16 is computed in float32.
    mask : bool array broadcastable to ``(..., Nq, Nk)``, optional
        True where query ``i`` may attend to key ``j``.
    causal : bool
        Also forbid key ``j`` for query ``i`` unless ``j <= i + (Nk - Nq)`` (bottom-right).
    scale : float, optional
        Multiplies the scores; default ``1 / sqrt(d)``.
    block_q, block_k : int
        Tile size: queries per block and keys per block. The last blocks may be partial.
    return_lse : bool
        Also return the log-sum-exp of each row's scaled, masked scores.

    Returns
    -------
    out : ndarray
        Shape ``(..., Nq, dv)``, in the inputs' dtype.
    lse : ndarray
        Shape ``(..., Nq)``, only with ``return_lse=True``: float32 for float16 inputs (as
        FlashAttention stores it), else the inputs' dtype; ``-inf`` for rows with no allowed key.

    Notes
    -----
    Memory: besides the inputs and the returned arrays, each worker thread holds one query
    block's tiles, ``O(batch · block_q · (block_k + d + dv))`` elements, independent of ``Nq``
    and ``Nk`` (``tests/test_memory.py`` measures it).

    NaN: a NaN in row ``i`` of ``q`` makes row ``i`` of ``out`` (and of ``lse``) NaN and leaves
    every other row exact. A NaN in key ``j`` of ``k`` reaches every row allowed to attend key
    ``j``; one in ``v`` reaches every row whose tiles multiply it, even with weight 0 (IEEE
    ``0 · NaN = NaN``). NaN is never turned into a silent number.
    """
    q, k, v, mask, causal, scale, batch, out_dtype, acc = _check_inputs(
        q, k, v, mask, causal, scale
    )
    block_q = _int_at_least("block_q", block_q, 1)
    block_k = _int_at_least("block_k", block_k, 1)
    n_q, n_k, dv = q.shape[-2], k.shape[-2], v.shape[-1]

    # Broadcast views (no copies), so that every tile below has the full batch shape and the
    # per-tile updates can run in place.
    q, k, v = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (q, k, v))
    out = np.zeros(batch + (n_q, dv), dtype=out_dtype)
    # Not allocated unless asked for: it would be O(Nq) scratch.
    lse = np.full(batch + (n_q,), -np.inf, dtype=acc) if return_lse else None

    def attend(query_block):
        """One query block over its key blocks: the online-softmax recurrence, tile by tile."""
        q_start, q_stop = query_block
        rows = batch + (q_stop - q_start,)
        # Scale the (block_q × d) queries once rather than every (block_q × block_k) tile.
        q_blk = q[..., q_start:q_stop, :].astype(acc) * acc.type(scale)
        m = np.full(rows, -np.inf, dtype=acc)  # running max of the scores
        l = np.zeros(rows, dtype=acc)  # running Σ exp(s - m)
        acc_blk = np.zeros(rows + (dv,), dtype=acc)  # running Σ exp(s - m) · v
        # The scores tile and the p·v product are reused across key blocks: one allocation each.
        s_buf = np.empty(rows + (min(block_k, n_k),), dtype=acc)
        pv = np.empty(rows + (dv,), dtype=acc)
        # exactly this query block's tiles of tile_schedule(...)
        for k_start, k_stop in _key_blocks(q_stop, n_q, n_k, block_k, causal):
            k_blk = k[..., k_start:k_stop, :].astype(acc, copy=False)
            v_blk = v[..., k_start:k_stop, :].astype(acc, copy=False)
            s = s_buf[..., : k_stop - k_start]
            # s = scale · q kᵀ for this tile (the scale is already in q_blk)
            np.matmul(q_blk, np.swapaxes(k_blk, -1, -2), out=s)
            allowed = _allowed(mask, causal, n_q, n_k, q_start, q_stop, k_start, k_stop)
            if allowed is not None:
                np.copyto(s, -np.inf, where=~allowed)
            m_new = np.maximum(m, s.max(axis=-1))
            # m_ref = m', except 0 for rows with no allowed key yet: there every score is -inf,
            # and -inf - (-inf) would be NaN, while any finite reference gives exp(-inf) = 0.
            m_ref = np.where(m_new == -np.inf, 0, m_new)
            # alpha = exp(m - m'): moves what was summed against the old max onto the new one.
            alpha = np.exp(m - m_ref)
            # p = exp(s - m'), in place: s becomes p.
            np.subtract(s, m_ref[..., None], out=s)
            p = np.exp(s, out=s)
            # l' = l · exp(m - m') + Σ_j p_j
            l *= alpha
            l += p.sum(axis=-1)
            # acc' = acc · exp(m - m') + p v
            acc_blk *= alpha[..., None]
            acc_blk += np.matmul(p, v_blk, out=pv)
            m = m_new
        # Divide once, at the end.
        out[..., q_start:q_stop, :], lse_blk = _finalize(acc_blk, l, m)
        if return_lse:
            lse[..., q_start:q_stop] = lse_blk

    # Threads only pay for themselves on real work (a thread pool costs ~0.1 ms to start).
    n_scores = math.prod(batch) * n_q * n_k
    n_blocks = -(-n_q // block_q)
    workers = min(_THREADS, n_blocks) if n_scores >= _PARALLEL_MIN_SCORES else 1
    _run_blocks(attend, _query_blocks(n_q, block_q), workers)
    return (out, lse) if return_lse else out


@contextlib.contextmanager
def _one_blas_thread():
    """Limit BLAS to one thread while any flash_attention call runs, then restore it.

    The BLAS thread count is process-wide, so concurrent calls share one limit: the first to
    enter sets it and the last to leave restores the caller's setting.
    """
    global _blas_users, _blas_limiter
    with _blas_lock:
        if _blas_users == 0:
            _blas_limiter = _BLAS.limit(limits=1, user_api="blas")
        _blas_users += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_users -= 1
            if _blas_users == 0:
                _blas_limiter.restore_original_limits()


def _run_blocks(fn, blocks, workers):
    """Run ``fn`` on every query block, on ``workers`` threads each with one BLAS thread.

    Workers take the next block from one shared iterator, so the bookkeeping is O(workers)
    whatever the number of blocks. Each worker runs in a copy of the caller's context, so
    ``np.errstate`` (a context variable) holds inside the workers as it does for the caller.
    """
    blocks = iter(blocks)
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                block = next(blocks, None)
            if block is None:
                return
            fn(block)

    with _one_blas_thread():
        if workers == 1:
            work()
            return
        with ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(contextvars.copy_context().run, work) for _ in range(workers)]
            for f in futures:
                f.result()


# --------------------------------------------------------------------------------------------
# Combining partial results, and measuring memory and error
# --------------------------------------------------------------------------------------------


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Combine the attention of the same queries over two disjoint key sets A and B.

    With ``lse = log Σ exp(s)`` over each set, the weights of A and B in the union are
    ``exp(lse_a - lse)`` and ``exp(lse_b - lse)`` where ``lse = log(exp(lse_a) + exp(lse_b))``;
    computed against ``m = max(lse_a, lse_b)`` so that nothing overflows:

        out = (exp(lse_a - m) · out_a + exp(lse_b - m) · out_b) / (exp(lse_a - m) + exp(lse_b - m))

    This is split-KV / flash-decoding's final reduction and ring attention's step. A part with
    ``lse = -inf`` (no allowed key) has weight 0; if both are empty the row stays 0 with
    ``lse = -inf``. The formula is symmetric, so ``merge(a, b) == merge(b, a)`` exactly;
    different groupings of three or more parts agree up to rounding.

    Returns ``(out, lse)`` with ``out`` in the dtype of ``out_a``/``out_b`` and ``lse`` in the
    dtype of the lse arguments (float32 at least).
    """
    out_a = _as_float_array("out_a", out_a)
    out_b = _as_float_array("out_b", out_b)
    lse_a = np.asarray(lse_a)
    lse_b = np.asarray(lse_b)
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.dtype.type not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be a float array, got dtype {x.dtype}")
    if out_a.shape != out_b.shape:
        raise ValueError(
            f"out_a and out_b must have the same shape, got {out_a.shape} and {out_b.shape}"
        )
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.shape != out_a.shape[:-1]:
            raise ValueError(
                f"{name} must have shape out.shape[:-1] = {out_a.shape[:-1]}, got {x.shape}"
            )
    work = np.result_type(lse_a.dtype, lse_b.dtype, out_a.dtype, np.float32)
    lse_a, lse_b = lse_a.astype(work), lse_b.astype(work)
    m = np.maximum(lse_a, lse_b)
    m_ref = np.where(m == -np.inf, 0, m)
    w_a, w_b = np.exp(lse_a - m_ref), np.exp(lse_b - m_ref)
    out, lse = _finalize(
        w_a[..., None] * out_a.astype(work) + w_b[..., None] * out_b.astype(work),
        w_a + w_b,
        m_ref,
    )
    out_dtype = np.result_type(out_a.dtype, out_b.dtype)
    lse_dtype = np.result_type(lse_a.dtype, lse_b.dtype, np.float32)
    return out.astype(out_dtype, copy=False), lse.astype(lse_dtype, copy=False)


def measure_peak_bytes(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)``; return ``(result, peak_bytes)`` allocated during the call.

    Measured from outside by ``tracemalloc``, where NumPy reports its array buffers, so it is
    evidence about the kernel rather than the kernel's word about itself. ``peak_bytes`` counts
    from the traced total at the call, so it includes the returned arrays: subtract their
    ``nbytes`` to get the scratch memory. Allocations from all threads are counted.
    """
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        result = fn(*args, **kwargs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        if started:
            tracemalloc.stop()
    return result, peak - base


def rowwise_relative_error(out, ref):
    """Error of each row against a reference: ``max_c |out_ic - ref_ic| / max_c |ref_ic|``.

    The metric of this project's tests, chapters and benchmark: relative to the row's own scale,
    so that a row of small outputs is held to the same standard as a row of large ones. A row
    whose reference is all zeros (a fully masked row) has error 0 only if ``out``'s row is exactly
    zero too, else inf. NaN in ``out`` where ``ref`` has none is inf; a row that is NaN in both
    counts as 0. Computed in the wider of the two dtypes (``ref`` may be longdouble). Returns an
    array of shape ``out.shape[:-1]``.
    """
    wide = np.result_type(out, ref, np.float64)
    out, ref = np.asarray(out, wide), np.asarray(ref, wide)
    if out.shape != ref.shape:
        raise ValueError(f"out and ref must have the same shape, got {out.shape} and {ref.shape}")
    if out.shape[-1] == 0:
        return np.zeros(out.shape[:-1])
    diff = np.abs(out - ref).max(axis=-1)
    size = np.abs(ref).max(axis=-1)
    zero_ref = size == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        err = np.where(zero_ref, np.where(diff == 0, 0, np.inf), diff / np.where(zero_ref, 1, size))
    both_nan = np.isnan(out).all(axis=-1) & np.isnan(ref).all(axis=-1)
    return np.where(both_nan, 0, np.where(np.isnan(err), np.inf, err))

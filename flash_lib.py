"""FlashAttention, forward and backward, exact, in plain NumPy.

    S = τ · q kᵀ,   P = softmax(S) row by row,   out = P v        (τ = ``scale``, 1/√d by default)

:func:`naive_attention` stores the whole ``Nq × Nk`` matrix ``S``; :func:`flash_attention` never
holds more than one ``block_q × block_k`` tile of it, and keeps per query row the state

* ``m``   -- the running maximum of the scores seen so far (so ``exp`` never overflows),
* ``l``   -- the running denominator ``Σ exp(s - m)``,
* ``acc`` -- the running numerator ``Σ exp(s - m) · v``.

A tile that raises the maximum from ``m`` to ``m'`` rescales ``l`` and ``acc`` by ``exp(m - m')``
(:func:`online_softmax_update`); at the end ``out = acc / l`` and ``lse = m + log(l)``. The
backward (:func:`flash_attention_backward`, FlashAttention-2's) recomputes each tile's
``P = exp(S - lse)`` and needs ``D = rowsum(dout ∘ out)`` (:func:`attention_backward_tile`).

Where NumPy computes ``2^x`` faster than ``e^x`` (its AVX-512 loops: :func:`exponential`), the
kernels work in base 2, as FlashAttention does on a GPU: ``log2(e)`` is folded into the keys'
scale, so the scores come out as ``S·log2(e)`` and ``e^(s - m) = 2^(s·log2 e - m·log2 e)``;
``m`` and the tile's ``lse`` are then in base-2 units, and the returned lse is converted back
with one multiply per row (``lse = (m + log2 l) · ln 2``).

=========== ===============================================================================
``Nq, Nk``  number of queries, number of keys
``d, dv``   feature size of queries/keys, feature size of values
``τ``       the scale (``scale``), ``1/√d`` unless given
``block_q`` rows of queries in one tile; ``block_k``: keys in one tile
``m``       running row maximum of the scaled, masked scores
``l``       running row sum of ``exp(s - m)``
``lse``     log-sum-exp of a row's scaled, masked scores: ``m + log(l)`` (natural log)
``unit``    what the kernels' scores are multiplied by: 1 (base e), or ``log2(e)`` (base 2)
``D``       ``rowsum(dout ∘ out)`` per query row, in the backward: ``Σ_j P_ij dP_ij``
=========== ===============================================================================

Contracts, the same in every kernel here (README.md and the chapters say why and how others differ):

* ``mask[..., i, j]`` True means query ``i`` may attend to key ``j`` (PyTorch SDPA and JAX).
* ``causal``: key ``j`` for query ``i`` iff ``j <= i + (Nk - Nq)``, bottom-right (:func:`causal_mask`).
* Empty rows: ``out`` exactly 0 and ``lse = -inf``, no NaN, no warning, whatever q, k, v hold.
  With ``sinks`` no row is empty: a row with no allowed key gets ``out`` 0 and ``lse = sink``.
* Dropout keeps element ``(b, i, j)`` (flat batch index, global query and key positions) by 16
  bits of Philox4x32-7 (FlashAttention-2's rounds) of that position and the seed: the same mask
  whatever the blocks, threads or visiting order, drawn again per tile by the backward, never
  stored. ``lse`` is undropped.
* Masked keys never leak: an inf or NaN at key ``j`` reaches exactly the rows that may attend it.
* A NaN in row ``i`` of ``q`` makes row ``i`` NaN and leaves every other row exact.
* The scale ``τ = r·2^e`` is applied as ``q · r·2^a`` and ``k · 2^b``, ``a + b = e``, ``b = trunc(e/2)``.
* Threads (:func:`threads`, ``FLASH_LIB_THREADS``) and BLAS held at one thread: the same bits
  on any number of threads, from any calling thread; Ctrl-C stops a call within about a tile.
* The exponential (:func:`exponential`; ``FLASH_LIB_EXP``, :func:`use_exponential`) is one per
  compute dtype and machine, chosen from the loops NumPy dispatches to, never from a timing; a
  call whose base-2 scores could overflow where the natural ones do not (``|S|`` beyond
  ``max / log2(e)``) uses ``e``.
* The same bits in any memory layout: an input not in C order is copied to it once per call
  (axes broadcast with stride 0 stay views), since BLAS and NumPy pick kernels by strides.
* float16 and bfloat16 (``ml_dtypes``) compute in float32; without ml_dtypes bfloat16 is refused.

Beside this file, private to it (copy them with it): ``_flash_inputs.py`` (the checks),
``_flash_runtime.py`` (threads, BLAS), ``_flash_masked.py`` (the matmul that keeps masked inf
and NaN out), ``_flash_dropout.py`` (the dropout mask's Philox) and ``_flash_measure.py`` (peak
memory, the error metric).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import threading
from dataclasses import dataclass

import numpy as np

import _flash_dropout as _dropout
import _flash_inputs as _inputs
import _flash_masked as _masked
import _flash_runtime as _runtime
from _flash_measure import measure_peak_bytes, rowwise_relative_error

__all__ = [
    "DEFAULT_BLOCK_Q",
    "DEFAULT_BLOCK_K",
    "exponential",
    "use_exponential",
    "online_softmax_update",
    "flash_attention",
    "naive_attention",
    "precise_attention",
    "attention_backward_tile",
    "flash_attention_backward",
    "naive_attention_backward",
    "precise_attention_backward",
    "merge_attention",
    "tile_schedule",
    "causal_mask",
    "dropout_keep",
    "check_arrays",
    "threads",
    "thread_count",
    "worker_count",
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

# The default thread count: FLASH_LIB_THREADS, read at import (default: the number of cores, at
# most 4); threads(n) overrides it for one context.
_THREADS = _runtime.threads_from_environment()
_THREADS_HERE = contextvars.ContextVar("flash_lib_threads", default=None)
# FLASH_LIB_EXP, read at import: "auto" (the default), "exp" or "exp2"; use_exponential(name)
# overrides it for one context
_EXPONENTIAL = _runtime.exponential_from_environment()
_EXPONENTIAL_HERE = contextvars.ContextVar("flash_lib_exponential", default=None)
#: log2(e) and ln(2): e^x = 2^(x·log2 e), and log x = log2(x) · ln 2
LOG2E, LN2 = 1 / math.log(2), math.log(2)


@contextlib.contextmanager
def threads(n):
    """Run the kernel calls made inside ``with flash_lib.threads(n):`` on up to ``n`` worker threads.

    Per context, not process-wide: the setting is a context variable, so it holds for the
    calling thread (and asyncio task) only, other threads keep theirs, and a new thread starts
    at the default, ``FLASH_LIB_THREADS``. The count changes the speed, never the bits.
    """
    token = _THREADS_HERE.set(_inputs.int_at_least("threads(n): n", n, 1))
    try:
        yield
    finally:
        _THREADS_HERE.reset(token)


def thread_count():
    """The worker-thread count in force here: the innermost :func:`threads`, else the default."""
    n = _THREADS_HERE.get()
    return _THREADS if n is None else n


def worker_count(n_blocks, n_scores):
    """The worker threads a kernel call here runs its ``n_blocks`` blocks on (query blocks in the
    forward, key blocks in the backward), for ``n_scores`` scores in all (batch × Nq × Nk): one
    below 2²⁰ scores, where a thread pool costs more than it saves, else up to
    :func:`thread_count`, at most one per block."""
    return _runtime.worker_count(thread_count(), n_blocks, n_scores)


def exponential(dtype):
    """The exponential the kernels use for compute dtype ``dtype`` (float32 for half-precision
    inputs) on this machine: ``np.exp2`` for float32 where NumPy runs an AVX-512 loop for it
    (there it took 0.46x the time of ``np.exp`` on a tile, and the forward 0.95x), else ``np.exp``.
    ``FLASH_LIB_EXP=exp`` or ``exp2`` forces one for every dtype, and :func:`use_exponential`
    for one context. In base 2 the scores carry ``log2(e)``, folded into the keys' scale (the
    module docstring)."""
    dtype = np.dtype(dtype)
    choice = _EXPONENTIAL_HERE.get() or _EXPONENTIAL
    return _runtime.exponential(np.float32 if dtype in _inputs.HALF_DTYPES else dtype, choice)


@contextlib.contextmanager
def use_exponential(name):
    """Compute the kernel calls made inside ``with flash_lib.use_exponential(name):`` with
    ``name``'s exponential: ``"exp"`` (base e) or ``"exp2"`` (base 2) for every dtype, or
    ``"auto"`` (:func:`exponential`'s choice for this machine). Per context, as :func:`threads`.
    The base changes the last bits of the results, within the same error bounds (chapter 7)."""
    if name not in _runtime.EXPONENTIALS:
        raise ValueError(f"use_exponential(name): name must be one of "
                         f"{', '.join(_runtime.EXPONENTIALS)}, got {name!r}")
    token = _EXPONENTIAL_HERE.set(name)
    try:
        yield
    finally:
        _EXPONENTIAL_HERE.reset(token)


def _unit(exp):
    """What the scores are multiplied by for ``exp``: 1 for ``np.exp``, log2(e) for ``np.exp2``."""
    return LOG2E if exp is np.exp2 else 1.0


def _exponential_for(problem):
    """The call's exponential: :func:`exponential` of its compute dtype, unless a base-2 score
    could overflow where the natural one does not (``|S| · log2(e)`` beyond the dtype's range:
    the inputs' bound ``Problem.score_bound``, or a sink), then ``np.exp``."""
    exp = exponential(problem.acc)
    if exp is np.exp2:
        largest = problem.score_bound
        if problem.sinks is not None:
            largest = max(largest, float(np.abs(problem.sinks).max()))
        # half the range: room for the scores' rounding beyond the exact bound
        if not largest * LOG2E < 0.5 * float(np.finfo(problem.acc).max):
            return np.exp
    return exp


def check_arrays(q, k, v, mask=None, *, enable_gqa=False):
    """Check ``q``, ``k``, ``v`` and ``mask`` as every kernel does (dtypes, shapes, broadcasting),
    reading only their ``shape``, ``ndim`` and ``dtype`` (a Dask array is not computed), and
    return the leading (batch) shape of the results. Raises the kernels' own errors."""
    return _inputs.check_arrays(q, k, v, mask, enable_gqa=enable_gqa)[2]


_VARIANTS = ("mask", "causal", "scale", "window", "softcap", "alibi_slopes", "enable_gqa", "mask_mod",
             "sinks", "dropout_p", "dropout_seed", "dropout_offset")


def _problem(args):
    """A kernel's own arguments (its ``locals()`` on entry), checked: an ``_inputs.Problem``."""
    return _inputs.check_inputs(q=args["q"], k=args["k"], v=args["v"], band_of=_Band.of,
                                **{name: args[name] for name in _VARIANTS})


def _ieee_quiet():
    """IEEE's "invalid" flag is ignored inside the kernels and references. The only invalid
    operations left are those that give NaN to a row allowed to meet an inf or NaN (inf - inf,
    0 · inf), which is what the contract gives such rows: the empty-row and masked-key guards keep
    them from every other row. A new errstate per use (a decorator's is safe per call too)."""
    return np.errstate(invalid="ignore")


# --------------------------------------------------------------------------------------------
# The recurrence
# --------------------------------------------------------------------------------------------


def online_softmax_update(m, l, acc, s, v, matmul=np.matmul, exp=np.exp):
    """Fold one tile of scores into its rows' running state ``(m, l, acc)``, in place.

    m, l: (..., rows); acc: (..., rows, dv); v: the tile's values, (..., keys, dv);
    s: the tile's scaled scores, (..., rows, keys), -inf where a pair is not allowed;
    s is overwritten with p. ``matmul(p, v)`` is ``p @ v``: the kernel passes one that
    reuses a buffer and keeps masked keys out (``_matmul_allowed``). ``exp``: ``np.exp``, or
    ``np.exp2`` when ``s`` and ``m`` are in base-2 units (multiplied by log2(e)); the kernel
    passes :func:`exponential`'s choice. Below, e^x is ``exp`` in either base.
    """
    # m' = max(m, max_j s_j)
    m_new = np.maximum(m, s.max(axis=-1))
    # A row with no allowed key yet has m' = -inf, and -inf - (-inf) is NaN;
    # any finite reference gives the same e^(-inf) = 0 there: use 0.
    m_ref = np.where(m_new == -np.inf, 0, m_new)
    # alpha = e^(m - m') re-expresses what was summed against m'
    alpha = exp(m - m_ref)
    # p_j = e^(s_j - m')
    p = exp(np.subtract(s, m_ref[..., None], out=s), out=s)
    # l' = l·e^(m - m') + Σ_j p_j
    l *= alpha
    l += p.sum(axis=-1)
    # acc' = acc·e^(m - m') + Σ_j p_j v_j
    acc *= alpha[..., None]
    acc += matmul(p, v)
    m[...] = m_new


def _initial_state(problem, rows, unit=1.0):
    """Each row's ``(m, l)`` before its first key: ``(-inf, 0)``; with a sink, ``(sink, 1)``: the
    sink is one key already seen, of score ``sink`` (times ``unit``) and value 0 (``acc`` stays 0)."""
    if problem.sinks is None:
        return np.full(rows, -np.inf, problem.acc), np.zeros(rows, problem.acc)
    sinks = (problem.sinks * unit).astype(problem.acc)
    return np.broadcast_to(sinks, rows).copy(), np.ones(rows, problem.acc)


def _finalize(acc, l, m, exp=np.exp):
    """``out = acc / l`` and ``lse = m + log(l)``, with empty rows (``l == 0``) as 0 and -inf.
    With ``exp = np.exp2`` (``m`` in base 2), ``lse = (m + log2(l)) · ln 2``, in natural units.

    ``l == 0`` exactly when no key was allowed, because the largest allowed score contributes
    ``exp(0) = 1``. A NaN row has ``l`` NaN, which is not 0, so it stays NaN in both outputs.
    """
    empty = l == 0
    out = acc / np.where(empty, 1, l)[..., None]
    lse = np.full_like(l, -np.inf)
    (np.log2 if exp is np.exp2 else np.log)(l, out=lse, where=~empty)
    lse += m
    if exp is np.exp2:
        lse *= LN2  # back to natural units: one multiply per row
    return out, lse


# --------------------------------------------------------------------------------------------
# The tiled kernel
# --------------------------------------------------------------------------------------------


def flash_attention(q, k, v, *, mask=None, causal=False, scale=None, block_q=DEFAULT_BLOCK_Q,
                    block_k=DEFAULT_BLOCK_K, return_lse=False, window=None, softcap=None,
                    alibi_slopes=None, enable_gqa=False, mask_mod=None, sinks=None, dropout_p=0.0,
                    dropout_seed=None, dropout_offset=(0, 0)):
    """Exact attention, computed tile by tile without storing the ``Nq × Nk`` scores.

    Parameters
    ----------
    q, k, v : arrays of shape ``(..., Nq, d)``, ``(..., Nk, d)``, ``(..., Nk, dv)``
        float16, bfloat16 (``ml_dtypes``), float32 or float64. Leading (batch, head) dimensions
        broadcast by NumPy's rules across ``q``, ``k``, ``v`` and ``mask``. float16 and bfloat16
        are computed in float32.
    mask : bool array broadcastable to ``(..., Nq, Nk)``, optional
        True where query ``i`` may attend to key ``j``.
    causal : bool
        Also forbid key ``j`` for query ``i`` unless ``j <= i + (Nk - Nq)`` (bottom-right).
    scale : float, optional
        τ, multiplies the scores; default ``1 / sqrt(d)``. Any real number (int, Fraction,
        NumPy scalar) that is a positive normal number of the compute dtype (float32 for
        half-precision inputs); ``softcap`` and the ALiBi slopes are checked the same way.
    block_q, block_k : int
        Tile size: queries per block and keys per block. The last blocks may be partial.
    return_lse : bool
        Also return the log-sum-exp of each row's scaled, masked scores.
    window : (left, right), optional
        Local attention, FlashAttention's ``window_size``: key ``j`` is allowed for query ``i``
        iff ``i + (Nk - Nq) - left <= j <= i + (Nk - Nq) + right``; ``None`` on a side means
        unbounded (FlashAttention's -1). ANDed with ``causal`` (which is ``right = 0``) and the
        masks. Tiles outside the band are never computed: the cost grows as N·(left + right).
    softcap : float > 0, optional
        ``s ← softcap · tanh(s / softcap)`` on the scaled scores, before the bias and the masks
        (FlashAttention, Gemma 2). A normal number of the compute dtype.
    alibi_slopes : array, optional
        Broadcastable to the leading (batch, head) dims, e.g. ``(H,)`` or ``(B, H)``: adds
        ``-slope · |i + (Nk - Nq) - j|`` to the (capped) scores, FlashAttention's ALiBi. Each
        nonzero slope normal in the compute dtype, and its bias at distance
        ``max(Nq, Nk) - 1`` finite there.
    enable_gqa : bool
        Grouped-query attention, as PyTorch SDPA's ``enable_gqa``: axis -3 of ``q`` holds ``Hq``
        heads, of ``k`` and ``v`` ``Hkv`` heads dividing ``Hq``; query head ``h`` attends kv
        head ``h // (Hq // Hkv)``. k and v are broadcast to the groups, never copied.
    mask_mod : callable, optional
        FlexAttention's ``mask_mod`` in NumPy form: ``mask_mod(q_idx, k_idx)`` with integer
        arrays of global positions of shapes ``(tile_q, 1)`` and ``(1, tile_k)`` returns a
        boolean array broadcastable to ``(..., tile_q, tile_k)`` (its leading dims may differ
        per batch or head). ANDed with the rest; a tile where it is all False is never
        multiplied. Called from the kernel's worker threads.
    sinks : array, optional
        Attention sinks (gpt-oss; FlashAttention-3's ``s_aux``): one logit per head, finite,
        broadcastable to the leading dims as ``alibi_slopes``. Each row's softmax gets one more
        key, of score ``sink`` (not scaled, not capped) and value 0: ``P_ij = exp(s_ij - lse_i)``,
        ``lse_i = log(exp(sink) + Σ_j exp(s_ij))``. The backward then also returns ``dsinks``.
    dropout_p : real number in [0, 1)
        Dropout on the weights, FlashAttention's: ``out = (P ∘ Z / (1 - p)) V``, ``Z`` the keep
        mask of :func:`dropout_keep` (Bernoulli(1 - p) per element); ``lse`` stays undropped.
        0 (the default) draws nothing: the same bits as no dropout.
    dropout_seed : int in [0, 2**64)
        Keys the mask; needed when ``dropout_p > 0``. The backward given it draws the same mask.
    dropout_offset : (row, key)
        Global position of this call's first query and first key in the mask: a shard of a
        larger problem draws its slice of the whole problem's mask (flash_dask does).

    Returns
    -------
    out : ndarray
        Shape ``(..., Nq, dv)``, in the inputs' dtype.
    lse : ndarray
        Shape ``(..., Nq)``, only with ``return_lse=True``: float32 for half-precision inputs
        (as FlashAttention stores it), else the inputs' dtype; ``-inf`` for rows with no
        allowed key.

    Notes
    -----
    Memory: besides the inputs and the returned arrays, each worker thread holds one query
    block's tiles, ``O(batch · block_q · (block_k + d + dv))`` elements, independent of ``Nq``
    and ``Nk`` (``tests/test_memory.py`` measures it), plus one boolean per key.

    The module docstring states the contracts: empty rows, masked keys, NaN, the scale's
    placement, threads and BLAS.
    """
    problem = _problem(locals())
    block_q = _inputs.int_at_least("block_q", block_q, 1)
    block_k = _inputs.int_at_least("block_k", block_k, 1)
    out = np.zeros(problem.batch + (problem.n_q, problem.dv), dtype=problem.out_dtype)
    # Not allocated unless asked for: it would be O(Nq) scratch.
    lse = np.full(problem.batch + (problem.n_q,), -np.inf, problem.acc) if return_lse else None
    # e^x, or 2^x with the scores in base-2 units: log2(e) rides on the keys' scale τ_k
    exp = _exponential_for(problem)
    unit = _unit(exp)

    def attend(query_block, cancelled):
        """One query block over its key blocks: the online-softmax recurrence, tile by tile."""
        q_start, q_stop = query_block
        rows = problem.batch + (q_stop - q_start,)
        q_blk = problem.q_tile(q_start, q_stop)
        m, l = _initial_state(problem, rows, unit)
        acc = np.zeros(rows + (problem.dv,), dtype=problem.acc)
        # The scores tile and the p·v product are reused across key blocks: one allocation each.
        # (Per worker for the whole call, as the backward's, measured 1-2% slower on one thread.)
        s_buf = np.empty(rows + (min(block_k, problem.n_k),), dtype=problem.acc)
        pv = np.empty(rows + (problem.dv,), dtype=problem.acc)
        # exactly this query block's tiles of tile_schedule(...)
        key_blocks = functools.partial(problem.band.key_blocks, q_start, q_stop, block_k)
        keeps = problem.keep_walk((q_start, q_stop, k_start, k_stop)
                                  for k_start, k_stop in key_blocks())
        for k_start, k_stop in key_blocks():
            if cancelled.is_set():
                return
            allowed = _allowed(problem, q_start, q_stop, k_start, k_stop)
            if allowed is False:  # mask_mod allows no pair here: never multiplied
                continue
            s = _scores(problem, q_blk, problem.k_tile(k_start, k_stop, unit=unit),
                        q_start, q_stop, k_start, k_stop, out=s_buf[..., : k_stop - k_start],
                        unit=unit)
            if allowed is not None:
                np.copyto(s, -np.inf, where=~allowed)
            bad = problem.bad_values(k_start, k_stop) if allowed is not None else None
            if bad is None:
                matmul = functools.partial(np.matmul, out=pv)
            else:
                matmul = functools.partial(_masked.matmul_allowed, allowed=allowed, bad=bad, out=pv)
            keep = keeps((q_start, q_stop, k_start, k_stop))
            if keep is not None:
                matmul = _dropped(matmul, keep)
            online_softmax_update(m, l, acc, s, problem.v_tile(k_start, k_stop), matmul, exp)
        if problem.dropout_p:  # out = (P ∘ Z / (1 - p)) V: the 1 / (1 - p) once per row
            acc *= problem.dropout_scale(problem.acc)
        # Divide once, at the end.
        out[..., q_start:q_stop, :], lse_blk = _finalize(acc, l, m, exp)
        if problem.sinks is not None and unit != 1:
            # (sink·log2 e)·ln 2 rounds; a row its keys added nothing to keeps lse = sink exactly
            sink = np.broadcast_to(problem.sinks.astype(problem.acc), rows)
            lse_blk = np.where((l == 1) & (m == (problem.sinks * unit).astype(problem.acc)),
                               sink, lse_blk)
        if lse is not None:
            lse[..., q_start:q_stop] = lse_blk

    with _ieee_quiet():  # the workers inherit it
        _runtime.run_blocks(attend, _blocks(problem.n_q, block_q), threads=thread_count(),
                            n_blocks=-(-problem.n_q // block_q), n_scores=problem.n_scores)
    out, lse = problem.merge_heads(out), problem.merge_heads(lse)
    return (out, lse) if return_lse else out


def _dropped(matmul, keep):
    """``matmul`` applied to ``p ∘ Z`` (Z the tile's keep mask): the forward's dropout. It comes
    after :func:`online_softmax_update` has added the undropped ``p`` to ``l``, so ``l`` and the
    lse are the softmax's own, and only what reaches ``acc`` is dropped."""
    def dropped(p, v):
        return matmul(np.multiply(p, keep, out=p), v)  # p̃_ij = p_ij · Z_ij, in place
    return dropped


def tile_schedule(n_q, n_k, block_q, block_k, causal=False, *, window=None, mask_mod=None):
    """The tiles :func:`flash_attention` visits, in order, as ``(q_start, q_stop, k_start, k_stop)``.

    Query blocks in the outer loop, key blocks in the inner loop (FlashAttention-2's order: each
    query block's ``m``, ``l`` and ``acc`` live through one inner loop). The last block in each
    direction may be partial. A tile is visited iff it holds a pair that ``causal`` and
    ``window`` allow (for causal alone: iff its bottom-left pair, last query and first key, is
    allowed) and, with ``mask_mod``, one that ``mask_mod`` allows (in any batch entry); the
    others are skipped without being computed. The ``mask`` array never skips a tile.

    ``block_q`` and ``block_k`` may also list uneven block sizes summing to ``n_q`` and ``n_k``
    (Dask's chunks: ``flash_dask`` schedules its shards with this); empty blocks are never visited.
    """
    n_q = _inputs.int_at_least("n_q", n_q, 0)
    n_k = _inputs.int_at_least("n_k", n_k, 0)
    q_blocks, k_blocks = _blocks_of("block_q", n_q, block_q), _blocks_of("block_k", n_k, block_k)
    band = _Band.of(n_q, n_k, _inputs.check_bool("causal", causal), _inputs.checked_window(window))
    mask_mod = _inputs.checked_mask_mod(mask_mod)
    return [
        (q_start, q_stop, k_start, k_stop)
        for q_start, q_stop in q_blocks if q_stop > q_start
        for k_start, k_stop in (band.key_blocks(q_start, q_stop, block_k)
                                if isinstance(block_k, int) else k_blocks)
        if k_stop > k_start and band.visits(q_start, q_stop, k_start, k_stop)
        and (mask_mod is None
             or _inputs.call_mask_mod(mask_mod, q_start, q_stop, k_start, k_stop).any())
    ]


def _blocks_of(name, n, size):
    """``(start, stop)`` of blocks of ``size`` (the last partial), or of the sizes listed."""
    if not isinstance(size, (tuple, list)):
        return list(_blocks(n, _inputs.int_at_least(name, size, 1)))
    for s in size:
        _inputs.int_at_least(f"each of {name}'s sizes", s, 0)
    if sum(size) != n:
        raise ValueError(f"{name}'s sizes must sum to {n}, got {tuple(size)!r}")
    stops = np.cumsum(size, dtype=int).tolist()
    return list(zip([0] + stops[:-1], stops))


def dropout_keep(dropout_seed, dropout_p, shape, offset=(0, 0)):
    """The dropout keep mask the kernels use, materialised: bool ``shape = (..., Nq, Nk)``, True
    where element ``(b, i, j)`` is kept (``b`` the flat C-order index over ``shape[:-2]``, ``i``,
    ``j`` the row and key plus ``offset``), probability ``1 - round(p·2¹⁶)/2¹⁶`` each (within
    ``2⁻¹⁷`` of ``1 - p``), from 16 bits of Philox4x32-7 keyed by the seed and the position
    (``_flash_dropout.py``). For tests and figures: the kernels compute it a tile or two at a time
    and never store it."""
    shape, (i, j), drop = _inputs.checked_keep_args(dropout_seed, dropout_p, shape, offset)
    if not drop["dropout_p"]:
        return np.ones(shape, bool)
    return _dropout.keep(drop["dropout_seed"], _dropout.threshold(drop["dropout_p"]),
                         math.prod(shape[:-2]), (i, i + shape[-2]), (j, j + shape[-1])).reshape(shape)


def causal_mask(n_q, n_k):
    """The pairs ``causal=True`` allows, as an explicit ``(n_q, n_k)`` boolean mask: key ``j`` for
    query ``i`` iff ``j <= i + (n_k - n_q)`` (bottom-right, FlashAttention >= 2.1)."""
    n_q = _inputs.int_at_least("n_q", n_q, 0)
    n_k = _inputs.int_at_least("n_k", n_k, 0)
    return np.tril(np.ones((n_q, n_k), dtype=bool), k=n_k - n_q)


# The kernel walks these generators directly rather than a materialised schedule, whose list
# would hold one tuple per tile: O(Nq·Nk / (block_q·block_k)) memory.
def _blocks(n_q, block_q):
    for q_start in range(0, n_q, block_q):
        yield q_start, min(q_start + block_q, n_q)


@dataclass(frozen=True)
class _Band:
    """The pairs ``causal`` and ``window`` allow: key ``j`` for query ``i`` iff
    ``-left <= j - i - (Nk - Nq) <= right`` (``None``: unbounded); ``causal`` is ``right = 0``.

    Over a tile, ``j - i - (Nk - Nq)`` runs through every integer from its value at the
    bottom-left pair (last query, first key) to its value at the top-right pair (first query,
    last key), so those two corners decide everything: the tile holds an allowed pair iff the
    bottom-left is not right of the band and the top-right not left of it, and needs an explicit
    mask iff either corner lies outside.
    """

    n_q: int
    n_k: int
    left: int | None
    right: int | None

    @staticmethod
    def of(n_q, n_k, causal, window):
        left, right = (None, None) if window is None else window
        if causal:
            right = 0 if right is None else min(right, 0)
        return _Band(n_q, n_k, left, right)

    def corners(self, q_start, q_stop, k_start, k_stop):
        offset = self.n_k - self.n_q
        return k_start - (q_stop - 1) - offset, (k_stop - 1) - q_start - offset

    def visits(self, q_start, q_stop, k_start, k_stop):
        bottom_left, top_right = self.corners(q_start, q_stop, k_start, k_stop)
        return ((self.right is None or bottom_left <= self.right)
                and (self.left is None or top_right >= -self.left))

    def key_blocks(self, q_start, q_stop, block_k):
        """The key blocks that query block ``q_start:q_stop`` visits, in order."""
        offset = self.n_k - self.n_q
        lo = 0 if self.left is None else max(0, q_start + offset - self.left)
        hi = self.n_k if self.right is None else min(self.n_k, q_stop + offset + self.right)
        for k_start in range(lo - lo % block_k, hi, block_k):
            yield k_start, min(k_start + block_k, self.n_k)

    def tile(self, q_start, q_stop, k_start, k_stop):
        """Boolean tile of the pairs the band allows, or None when it allows all of them."""
        bottom_left, top_right = self.corners(q_start, q_stop, k_start, k_stop)
        cut_right = self.right is not None and top_right > self.right
        cut_left = self.left is not None and bottom_left < -self.left
        if not (cut_right or cut_left):
            return None
        # j - i - (Nk - Nq) <= right and >= -left, compared without forming the integer tile
        i = np.arange(q_start, q_stop)[:, None] + (self.n_k - self.n_q)
        j = np.arange(k_start, k_stop)[None, :]
        if cut_right and cut_left:
            return (j <= i + self.right) & (j >= i - self.left)
        return j <= i + self.right if cut_right else j >= i - self.left


def _allowed(problem, q_start, q_stop, k_start, k_stop):
    """A tile's allowed pairs: a boolean array ``(..., rows, keys)``, None when every pair is
    allowed, or False when ``mask_mod`` allows none (the kernels then skip the tile)."""
    allowed = problem.band.tile(q_start, q_stop, k_start, k_stop)
    if problem.mask_mod is not None:
        mod = problem.mask_mod_tile(q_start, q_stop, k_start, k_stop)
        if not mod.any():
            return False
        allowed = mod if allowed is None else allowed & mod
    if problem.mask is not None:
        mask = problem.mask
        tile = np.broadcast_to(mask, mask.shape[:-2] + (problem.n_q, problem.n_k))[
            ..., q_start:q_stop, k_start:k_stop
        ]
        allowed = tile if allowed is None else allowed & tile
    return allowed


def _scores(problem, q, k, q_start, q_stop, k_start, k_stop, out=None, grad=False, unit=1.0):
    """``S = (τ_q q)(τ_k k)ᵀ`` for one tile, then the score variants: softcap, then ALiBi.

    ``q``, ``k``: the tile's scaled queries and keys. With ``grad=True`` also returns
    ``dS_capped / dS = 1 - tanh²(S / softcap)`` (None without softcap), which the backward needs.
    ``unit``: log2(e) when ``k`` carries it (base-2 scores): the cap and the slopes carry it too.
    """
    if out is None:  # the whole batch, as the forward's buffer: v, mask may add batch dims
        out = np.empty(problem.batch + (q_stop - q_start, k_stop - k_start), np.result_type(q, k))
    s = np.matmul(q, np.swapaxes(k, -1, -2), out=out)
    slope = None
    if problem.softcap is not None:
        cap = s.dtype.type(problem.softcap * unit)
        with np.errstate(over="ignore"):  # |s / c| beyond the dtype is ±inf, and tanh(±inf) = ±1
            t = np.tanh(np.divide(s, cap, out=s), out=s)  # t = tanh(s / c)
        slope = 1 - t * t if grad else None
        np.multiply(t, cap, out=s)  # s ← c·tanh(s / c)
    if problem.alibi is not None:
        i = np.arange(q_start, q_stop)[:, None] + (problem.n_k - problem.n_q)
        distance = np.abs(i - np.arange(k_start, k_stop)[None, :]).astype(s.dtype)
        s -= (problem.alibi * unit).astype(s.dtype) * distance  # -slope·|i + (Nk - Nq) - j|
    return (s, slope) if grad else s


# --------------------------------------------------------------------------------------------
# The backward pass
# --------------------------------------------------------------------------------------------


def attention_backward_tile(q, k, v, dout, lse, D, dk, dv, allowed=None, matmul=None,
                            scores=None, dropout=None, dp_buffer=None, exp=np.exp, k_scores=None):
    """One tile (i, j) of FlashAttention-2's backward: adds to dK_j and dV_j in place,
    returns this tile's share of dQ_i.

    q, k: the tile's scaled queries and keys (τ_q·q_i, τ_k·k_j: q kᵀ is the forward's
    S_ij); v: V_j; dout: dO_i; lse: the forward's lse_i, +inf for a row with no
    allowed key; D: D_i = rowsum(dO_i ∘ O_i); dk, dv: the dK_j, dV_j accumulators
    (dk and the returned dS_ij K_j lack their factors τ_k and τ_q).
    ``matmul(a, b, which)`` is ``a @ b``; the kernel's keeps masked pairs out when an
    operand holds inf or NaN (``which`` names that operand).
    ``scores(q, k)`` returns S_ij with the score variants applied, and softcap's
    derivative 1 - tanh² (or None); by default (q kᵀ, None).
    ``dropout``: ``(Z_ij, 1 / (1 - p))``, the tile's boolean keep mask and the kept weights'
    factor, as the forward drew them (or None). ``dp_buffer``: an array of the tile's shape to
    hold P ∘ Z (with dropout), then dP and dS (the kernel reuses one per worker: a fresh 2 MiB
    tile each time can cost its page faults again), or None.
    ``exp``: ``np.exp``, or ``np.exp2`` with S_ij and lse_i in base-2 units (multiplied by
    log2(e)), S_ij then computed from ``k_scores`` = log2(e)·K_j (scaled), while dQ's share
    uses ``k``. By default ``k_scores`` is ``k``.
    """
    matmul = matmul or (lambda a, b, which: a @ b)
    k_scores = k if k_scores is None else k_scores
    # S_ij, recomputed as the forward computed it
    s, slope = scores(q, k_scores) if scores else (q @ np.swapaxes(k_scores, -1, -2), None)
    if allowed is not None:
        np.copyto(s, -np.inf, where=~allowed)
    # P_ij = e^(S_ij - lse_i): one exp, no max, no sum
    p = exp(np.subtract(s, lse[..., None], out=s), out=s)
    if allowed is not None and np.isnan(lse).any():
        # e^(-inf - NaN) is NaN: a NaN row's masked pairs must still weigh 0
        np.copyto(p, 0, where=~allowed)
    p_used, dout_used = p, dout
    if dropout is not None:
        # the forward weighed V_j by P̃_ij = P_ij ∘ Z_ij / (1 - p); the factor 1 / (1 - p) rides
        # on dO_i (rows × dv) instead of on the tile (rows × keys)
        keep, factor = dropout
        # P_ij ∘ Z_ij goes to the buffer dP takes next: dV's product is done with it by then
        p_used, dout_used = np.multiply(p, keep, out=dp_buffer), dout * factor
    # dV_j += P̃_ijᵀ dO_i = (P_ij ∘ Z_ij)ᵀ (dO_i / (1 - p))
    dv += matmul(np.swapaxes(p_used, -1, -2), dout_used, "dout")
    # dP_ij = dO_i V_jᵀ (∘ Z_ij / (1 - p): P_ij reaches the loss only through P̃_ij)
    dp = np.matmul(dout_used, np.swapaxes(v, -1, -2), out=dp_buffer)
    if dropout is not None:
        dp *= keep
    # dS_ij = P_ij ∘ (dP_ij - D_i)
    ds = np.multiply(p, np.subtract(dp, D[..., None], out=dp), out=dp)
    if slope is not None:
        # through softcap: dS_raw = dS ∘ (1 - tanh²(S_raw / c))
        ds *= slope
    # inf or NaN in V_j (dP) or K_j, Q_i (the slope) reached masked pairs too: their dS is 0
    _masked_pairs_zero(ds, allowed)
    # dK_j += dS_ijᵀ Q_i
    dk += matmul(np.swapaxes(ds, -1, -2), q, "q")
    # dQ_i += dS_ij K_j
    return matmul(ds, k, "k")


def _masked_pairs_zero(ds, allowed):
    """The one rule for masked pairs in every backward (flash's tiles, naive's and precise's
    dense chain): their ``dS`` is exactly 0, set last, after every factor of the chain rule
    (``dP - D``, softcap's ``1 - tanh²``), whatever inf or NaN those factors held there."""
    if allowed is not None:
        np.copyto(ds, 0, where=~allowed)


def flash_attention_backward(q, k, v, out, lse, dout, *, mask=None, causal=False, scale=None,
                             block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K, window=None,
                             softcap=None, alibi_slopes=None, enable_gqa=False, mask_mod=None,
                             sinks=None, dropout_p=0.0, dropout_seed=None, dropout_offset=(0, 0)):
    """The gradients of ``sum(dout * flash_attention(q, k, v, ...))`` without storing ``P``.

    Parameters
    ----------
    q, k, v, mask, causal, scale, block_q, block_k, window, softcap, alibi_slopes, enable_gqa, mask_mod
        As for :func:`flash_attention`, and the same as the forward call.
    sinks, dropout_p, dropout_seed, dropout_offset
        As for :func:`flash_attention`, the same as the forward call: each tile's keep mask is
        drawn again from the seed, and ``dV = (P ∘ Z/(1-p))ᵀ dO``, ``dP = (dO Vᵀ) ∘ Z/(1-p)``,
        ``dS = P ∘ (dP - D)`` with ``D = rowsum(dO ∘ O)`` still (``O = (P ∘ Z/(1-p)) V``).
    out, lse
        What ``flash_attention(q, k, v, ..., return_lse=True)`` returned: shapes
        ``(..., Nq, dv)`` and ``(..., Nq)``, ``...`` being the broadcast batch of q, k, v, mask.
    dout : array of the shape of ``out``
        The gradient of the loss with respect to ``out``.

    Returns
    -------
    dq, dk, dv : ndarrays
        Each of its input's shape and dtype. An input broadcast over leading dims gets the sum of
        the gradients over those dims, as autograd gives it (k and v shared by every head get
        the sum of the heads' gradients). Half-precision inputs compute in float32.
    dsinks : ndarray
        Only with ``sinks``: of sinks' shape, in the compute dtype, summed likewise;
        ``dsinks_h = -Σ_i exp(sink_h - lse_i) · D_i`` over head h's rows.

    Notes
    -----
    FlashAttention-2's backward (Dao 2023, Algorithm 2). ``D = rowsum(dout ∘ out)`` is computed
    once; then each tile of the forward's schedule recomputes ``S`` and ``P = exp(S - lse)``
    from the saved lse (one exp; no max, no sum) and adds its terms to ``dV``, ``dK`` and ``dQ``
    (:func:`attention_backward_tile`). Loop order: key blocks outside, each on one worker that
    keeps its ``dK_j``, ``dV_j`` and walks the query blocks in order, so ``dK``, ``dV`` need
    no sharing; the key blocks' shares of ``dQ_i`` are added in key-block order, each worker
    waiting for its turn (FlashAttention's deterministic mode does the same with a semaphore),
    so the bits do not depend on the threads. Scratch per worker:
    ``O(block_q·block_k + (block_q + block_k)·(d + dv))`` elements, plus ``D`` and the lse (O(Nq)),
    and a float32 ``dq`` accumulator for half-precision ``q``.

    Empty rows: their lse is ``-inf`` (``log 0``), and ``exp(S - lse)`` with ``S = -inf`` would
    be NaN; the backward uses ``+inf`` for them instead (which is what FlashAttention 2 stores),
    so ``P = 0`` exactly: their ``dq`` row is exactly 0 and they add nothing to ``dk``, ``dv``.
    A key no row attends gets ``dk = dv = 0`` exactly. Non-finite values follow the forward's
    rule: an inf or NaN in ``q``, ``k``, ``v`` or ``dout`` reaches only the pairs allowed to
    meet it (softcap's ``1 - tanh²`` included: a masked pair's ``dS`` is 0, set last); a NaN in
    row ``i`` of ``q`` makes row ``i`` of ``dq`` NaN, and, through ``P_ij``, the ``dk``, ``dv``
    rows of the keys row ``i`` attends (what IEEE arithmetic gives). An inf in row ``i`` of
    ``dout`` does the same to ``dq`` and ``dk`` (``D_i`` is NaN, as the dense chain's
    ``dP_ij - rowsum(P ∘ dP)`` is at every allowed pair), and gives ``dv`` IEEE's ``Pᵀ dO``.
    """
    problem = _problem(locals())
    block_q = _inputs.int_at_least("block_q", block_q, 1)
    block_k = _inputs.int_at_least("block_k", block_k, 1)
    out, lse, dout = _inputs.check_saved(problem, out, lse, dout)
    acc, batch, n_q, n_k = problem.acc, problem.batch, problem.n_q, problem.n_k
    # D_i = rowsum(dO_i ∘ O_i) = Σ_j P_ij dP_ij, once per row: P is never needed whole.
    D = np.empty(batch + (n_q,), acc)
    for q_start, q_stop in _blocks(n_q, block_q):
        rows = slice(q_start, q_stop)
        dout_rows = dout[..., rows, :].astype(acc, copy=False)
        D[..., rows] = np.einsum("...c,...c->...", dout_rows, out[..., rows, :].astype(acc, copy=False))
        # An inf in dO_i makes every allowed dS_ij NaN in the dense chain (dP_ij - rowsum(P ∘ dP)
        # is inf - inf or NaN there); dO_i·O_i is ±inf instead, and dP_ij - D_i could be ±inf.
        D[..., rows] = np.where(np.isfinite(dout_rows).all(axis=-1), D[..., rows], np.nan)
    lse = np.where(lse == -np.inf, np.inf, lse).astype(acc, copy=False)
    # P = e^(S - lse), or 2^(S·log2 e - lse·log2 e): the forward's exponential, the same scores
    exp = _exponential_for(problem)
    unit = _unit(exp)
    dq = np.zeros(problem.q.shape, acc)  # the shares Σ_j dS_ij K_j, times τ_q at the end
    dk = np.zeros(problem.k.shape, problem.k.dtype)
    dv = np.zeros(problem.v.shape, problem.v.dtype)
    turns = _runtime.InOrder(-(-n_q // block_q))  # dQ_i's shares, added in key-block order
    # Each worker's buffers: S (then P) and dP (then dS) of a tile; τ_q Q_i; the three products
    # added to dV_j, dK_j and dQ_i
    rows_max, keys_max = min(block_q, n_q), min(block_k, n_k)
    buffers = _per_worker(lambda: (
        [np.empty(batch + (rows_max, keys_max), acc) for _ in range(2)],
        np.empty(problem.q.shape[:-2] + (rows_max, problem.q.shape[-1]), acc),
        {"dout": np.empty(batch + (keys_max, problem.dv), acc),  # P̃ᵀ dO, for dV_j
         "q": np.empty(batch + (keys_max, problem.q.shape[-1]), acc),  # dSᵀ Q_i, for dK_j
         "k": np.empty(batch + (rows_max, problem.q.shape[-1]), acc)}))  # dS K_j, dQ_i's share

    def key_block(block, cancelled):
        """One key block over every query block: dK_j, dV_j resident, dQ's shares added in turn."""
        k_start, k_stop = block
        j = k_start // block_k
        k_blk = problem.k_tile(k_start, k_stop)  # τ_k K_j, for dQ's shares
        # τ_k·log2(e)·K_j in base 2, for S
        k_exp = problem.k_tile(k_start, k_stop, unit=unit) if unit != 1 else k_blk
        v_blk = problem.v_tile(k_start, k_stop)
        dk_blk = np.zeros(batch + k_blk.shape[-2:], acc)
        dv_blk = np.zeros(batch + v_blk.shape[-2:], acc)
        keys = k_stop - k_start
        tiles, q_buf, products = buffers()
        tiles = [t[..., :keys] for t in tiles]

        def into_buffers(a, b, which):  # a @ b into its buffer, cut to this tile's rows
            return np.matmul(a, b, out=products[which][..., : a.shape[-2], :])
        keeps = problem.keep_walk((q_start, q_stop, k_start, k_stop)
                                  for q_start, q_stop in _blocks(n_q, block_q)
                                  if problem.band.visits(q_start, q_stop, k_start, k_stop))
        for i, (q_start, q_stop) in enumerate(_blocks(n_q, block_q)):
            if cancelled.is_set():
                return
            share = None
            visits = problem.band.visits(q_start, q_stop, k_start, k_stop)
            allowed = _allowed(problem, q_start, q_stop, k_start, k_stop) if visits else False
            if allowed is not False:
                rows = slice(q_start, q_stop)
                matmul = (_masked.backward_matmul(problem, allowed, dout, q_start, q_stop, k_start,
                                                  k_stop) or into_buffers)
                keep = keeps((q_start, q_stop, k_start, k_stop))  # the forward's Z, again
                dropout = None if keep is None else (keep, problem.dropout_scale(acc))
                s_buf, dp_buf = (t[..., : q_stop - q_start, :] for t in tiles)
                share = attention_backward_tile(
                    problem.q_tile(q_start, q_stop, out=q_buf), k_blk, v_blk,
                    dout[..., rows, :].astype(acc, copy=False), lse[..., rows] * acc.type(unit),
                    D[..., rows],
                    dk_blk, dv_blk, allowed, matmul,
                    functools.partial(_scores, problem, q_start=q_start, q_stop=q_stop,
                                      k_start=k_start, k_stop=k_stop, out=s_buf, grad=True,
                                      unit=unit),
                    dropout, dp_buf, exp, k_exp,
                )
                share = _sum_to(share, dq.shape[:-2] + share.shape[-2:])
            with turns.turn(i, j, cancelled) as mine:
                if not mine:
                    return
                if share is not None:
                    dq[..., q_start:q_stop, :] += share
        dk_blk *= acc.type(problem.scale_k)
        dk[..., k_start:k_stop, :] = _sum_to(dk_blk, dk.shape[:-2] + dk_blk.shape[-2:])
        dv[..., k_start:k_stop, :] = _sum_to(dv_blk, dv.shape[:-2] + dv_blk.shape[-2:])

    with _ieee_quiet():  # the workers inherit it
        _runtime.run_blocks(key_block, _blocks(n_k, block_k), threads=thread_count(),
                            n_blocks=-(-n_k // block_k), n_scores=problem.n_scores)
    dq *= acc.type(problem.scale_q)
    grads = problem.input_shapes(dq.astype(problem.q.dtype, copy=False), dk, dv)
    return grads if problem.sinks is None else grads + (_dsinks(problem, lse, D),)


def _per_worker(make):
    """``get()`` returns the calling worker thread's buffers for this call: ``make()``'s, made at
    its first block and reused for the others. A tile-sized array made per block is handed back
    to the OS when freed and, made again, faulted in page by page (512 faults for a 2 MiB tile)."""
    local = threading.local()

    def get():
        if not hasattr(local, "buffers"):
            local.buffers = make()
        return local.buffers
    return get


def _dsinks(problem, lse, D):
    """``dsinks_h = -Σ_i exp(sink_h - lse_i) · D_i`` over head h's rows, summed to sinks' shape.

    The sink is one more key, of score ``sink`` and value 0: it enters ``out_i`` only through
    the denominator, ``∂P_ij/∂sink = -P_ij · P_i,sink`` with ``P_i,sink = exp(sink - lse_i)``,
    so ``Σ_j dP_ij · ∂P_ij/∂sink = -P_i,sink · D_i`` (``D_i = Σ_j P_ij dP_ij``)."""
    p_sink = np.exp(problem.sinks.astype(lse.dtype) - lse)
    return _sum_to(problem.merge_heads(-(p_sink * D).sum(axis=-1)), problem.sinks_shape)


def _sum_to(x, shape):
    """Sum ``x`` over the dims along which an array of ``shape`` was broadcast to ``x.shape``."""
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and x.shape[lead + i] != 1
    )
    return x.sum(axis=axes).reshape(shape) if axes else x


# --------------------------------------------------------------------------------------------
# The references
# --------------------------------------------------------------------------------------------


def naive_attention(q, k, v, *, mask=None, causal=False, scale=None, return_lse=False,
                    window=None, softcap=None, alibi_slopes=None, enable_gqa=False, mask_mod=None,
                    sinks=None, dropout_p=0.0, dropout_seed=None, dropout_offset=(0, 0)):
    """Textbook attention: the full ``Nq × Nk`` score matrix, then a max-subtracted softmax.

    Same arguments, results and conventions as :func:`flash_attention` (minus the block sizes);
    it is the oracle the tiled kernel is tested against, so it stays as plain as possible. Its
    one matmul uses the BLAS threads the caller has set.
    """
    problem = _problem(locals())
    out, lse = _dense_attention(problem, problem.acc)
    out = problem.merge_heads(out.astype(problem.out_dtype, copy=False))
    lse = problem.merge_heads(lse)
    return (out, lse) if return_lse else out


def precise_attention(q, k, v, *, mask=None, causal=False, scale=None, return_lse=False,
                      window=None, softcap=None, alibi_slopes=None, enable_gqa=False,
                      mask_mod=None, sinks=None, dropout_p=0.0,
                      dropout_seed=None, dropout_offset=(0, 0)):
    """Attention in more precision than float64: the truth the other kernels are measured against.

    Same semantics as :func:`naive_attention`; the scale is the float64 number the kernels use,
    so only the kernels' own rounding is measured. Computed in ``np.longdouble`` where that is
    wider than float64 (x86-64: 64-bit mantissa; aarch64 Linux: 113-bit), else with ``mpmath`` at
    40 significant digits, elementwise and slow: meant for small inputs. Returns float64 arrays
    from the mpmath path and longdouble arrays otherwise.
    """
    problem = _problem(locals())
    if np.finfo(np.longdouble).nmant > np.finfo(np.float64).nmant:
        out, lse = _dense_attention(problem, np.dtype(np.longdouble))
    else:  # pragma: no cover - only where longdouble is float64 (macOS arm64, Windows)
        out, lse = _mpmath_attention(problem)
    out, lse = problem.merge_heads(out), problem.merge_heads(lse)
    return (out, lse) if return_lse else out


def _dense_softmax(problem, dtype, grad=False):
    """The one dense reference: the whole score matrix in ``dtype``, then ``p = exp(s - m)``
    against each row's max ``m``: ``p, m, allowed`` (None: all pairs); with ``grad=True``
    also the scores and softcap's slope (first and last). Naive, precise and the backward's."""
    n_q, n_k = problem.n_q, problem.n_k
    s = _scores(problem, problem.q_tile(0, n_q, dtype), problem.k_tile(0, n_k, dtype),
                0, n_q, 0, n_k, grad=grad)
    s, slope = s if grad else (s, None)
    allowed = _dense_allowed(problem)
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    m = s.max(axis=-1, initial=-np.inf)
    if problem.sinks is not None:  # the sink is one more score of the row
        m = np.maximum(m, problem.sinks.astype(dtype))
    p = np.exp(s - _reference(m)[..., None])
    return (s, p, m, allowed, slope) if grad else (p, m, allowed)


def _denominator(problem, p, m):
    """``Σ_j p_ij``, plus the sink's ``exp(sink - m_i)`` (it takes probability, carries no value)."""
    l = p.sum(axis=-1)
    return l if problem.sinks is None else l + np.exp(problem.sinks.astype(m.dtype) - m)


def _reference(m):
    """The reference point of ``exp(s - m)``: the row max, or 0 for an empty row, whose -inf would
    give -inf - (-inf) = NaN (:func:`online_softmax_update` spells it out: chapter 5 prints it)."""
    return np.where(m == -np.inf, 0, m)


@_ieee_quiet()
def _dense_attention(problem, dtype):
    """naive's and precise's forward: :func:`_dense_softmax`, then ``p v / Σ p``."""
    p, m, allowed = _dense_softmax(problem, dtype)
    l = _denominator(problem, p, m)  # the undropped softmax's
    z = _dense_dropout(problem, dtype)
    p = p if z is None else p * z  # P ∘ Z / (1 - p), unnormalised
    v = problem.v_tile(0, problem.n_k, dtype)
    bad = problem.bad_values(0, problem.n_k) if allowed is not None else None
    pv = p @ v if bad is None else _masked.matmul_allowed(p, v, allowed=allowed, bad=bad)
    return _finalize(pv, l, m)


def _dense_dropout(problem, dtype):
    """``Z / (1 - p)`` over the whole matrix, from :func:`dropout_keep`'s mask; None without dropout."""
    keep = problem.keep_tile(0, problem.n_q, 0, problem.n_k)
    return None if keep is None else np.multiply(keep, problem.dropout_scale(dtype), dtype=dtype)


def naive_attention_backward(q, k, v, dout, *, mask=None, causal=False, scale=None,
                             window=None, softcap=None, alibi_slopes=None, enable_gqa=False,
                             mask_mod=None, sinks=None, dropout_p=0.0, dropout_seed=None,
                             dropout_offset=(0, 0)):
    """The dense oracle of :func:`flash_attention_backward`: ``P`` whole, then the textbook chain.

    ``P = softmax(S)``, ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P ∘ (dP - rowsum(P ∘ dP))`` (the
    softmax Jacobian applied row by row), ``dQ = τ dS K``, ``dK = τ dSᵀ Q``; the same conventions,
    scale placement, broadcasting and gradient dtypes. It needs no ``out`` or ``lse``, and does
    not use the identity ``rowsum(P ∘ dP) = rowsum(dO ∘ O)`` the tiled kernel rests on.
    """
    problem = _problem(locals())
    dout = _inputs.check_saved(problem, dout=dout)
    grads = _dense_backward(problem, dout, problem.acc)
    return problem.input_shapes(*(g.astype(x.dtype, copy=False)
                                  for g, x in zip(grads, (problem.q, problem.k, problem.v)))
                                ) + grads[3:]


def precise_attention_backward(q, k, v, dout, *, mask=None, causal=False, scale=None,
                               window=None, softcap=None, alibi_slopes=None, enable_gqa=False,
                               mask_mod=None, sinks=None, dropout_p=0.0,
                               dropout_seed=None, dropout_offset=(0, 0)):
    """:func:`naive_attention_backward` in ``np.longdouble``: the truth gradients are measured
    against (x86-64 and aarch64 Linux, where longdouble is wider than float64). Returns
    longdouble arrays."""
    problem = _problem(locals())
    dout = _inputs.check_saved(problem, dout=dout)
    grads = _dense_backward(problem, dout, np.dtype(np.longdouble))
    return problem.input_shapes(*grads[:3]) + grads[3:]


@_ieee_quiet()
def _dense_backward(problem, dout, dtype):
    n_q, n_k = problem.n_q, problem.n_k
    q, k, v = problem.q_tile(0, n_q, dtype), problem.k_tile(0, n_k, dtype), problem.v_tile(0, n_k, dtype)
    dout = dout.astype(dtype)
    # s stays alive as in a textbook backward: chapter 13 counts S, P, dP, dS at the peak
    s, p, m, allowed, slope = _dense_softmax(problem, dtype, grad=True)
    l = _denominator(problem, p, m)
    p /= np.where(l == 0, 1, l)[..., None]  # P = softmax(S); an empty row stays 0
    if allowed is not None:  # and a masked pair weighs exactly 0, in a NaN row too
        p = np.where(allowed, p, 0)
    dp = dout @ np.swapaxes(v, -1, -2)
    if allowed is not None:  # what a masked pair's dP holds must not reach rowsum(P ∘ dP)
        dp = np.where(allowed, dp, 0)
    z = _dense_dropout(problem, dtype)
    if z is not None:  # out = P̃ V with P̃ = P ∘ Z / (1 - p): dP = dP̃ ∘ Z / (1 - p)
        dp = dp * z
    D = (p * dp).sum(axis=-1, keepdims=True)  # the sink's dP is 0: its value is 0
    ds = p * (dp - D)
    if slope is not None:  # the chain rule through softcap
        ds = ds * slope
    _masked_pairs_zero(ds, allowed)

    def matmul(a, b, allowed_for_a, name, x):
        bad = None if allowed is None else problem.nonfinite_rows(name, 0, x.shape[-2], x)
        return a @ b if bad is None else _masked.matmul_allowed(a, b, allowed=allowed_for_a, bad=bad)

    allowed_t = None if allowed is None else np.swapaxes(allowed, -1, -2)
    dv = matmul(np.swapaxes(p if z is None else p * z, -1, -2), dout, allowed_t, "dout", dout)
    dq = matmul(ds, k, allowed, "k", problem.k) * dtype.type(problem.scale_q)
    dk = matmul(np.swapaxes(ds, -1, -2), q, allowed_t, "q", problem.q) * dtype.type(problem.scale_k)
    grads = tuple(_sum_to(g, x.shape[:-2] + g.shape[-2:])
                  for g, x in zip((dq, dk, dv), (problem.q, problem.k, problem.v)))
    if problem.sinks is None:
        return grads
    return grads + (_dsinks(problem, m + np.log(l), D[..., 0]),)  # lse = m + log l, never -inf


def _dense_allowed(problem):
    """The whole Nq × Nk matrix of allowed pairs, or None when every pair is allowed."""
    allowed = _allowed(problem, 0, problem.n_q, 0, problem.n_k)
    return np.zeros((problem.n_q, problem.n_k), bool) if allowed is False else allowed


def _mpmath_attention(problem):  # pragma: no cover - see precise_attention
    import mpmath

    mp = mpmath.mp.clone()
    mp.dps = 40
    batch, n_q, n_k = problem.batch, problem.n_q, problem.n_k
    if (problem.softcap is not None or problem.alibi is not None or problem.sinks is not None
            or problem.dropout_p):
        raise NotImplementedError("softcap, ALiBi, sinks and dropout need np.longdouble wider "
                                  "than float64")
    allowed = _allowed(problem, 0, n_q, 0, n_k)
    allowed = np.broadcast_to(True if allowed is None else allowed, batch + (n_q, n_k))
    q, k, v = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (problem.q, problem.k, problem.v))
    out = np.zeros(batch + (n_q, problem.dv))
    lse = np.full(batch + (n_q,), -np.inf)
    for idx in np.ndindex(*batch, n_q):
        b, i = idx[:-1], idx[-1]
        keys = [j for j in range(n_k) if allowed[b + (i, j)]]
        if not keys:
            continue
        s = [mp.mpf(problem.scale) * mp.fsum(mp.mpf(x) * mp.mpf(y) for x, y in zip(q[b + (i,)], k[b + (j,)]))
             for j in keys]
        mx = max(s)
        w = [mp.exp(x - mx) for x in s]
        total = mp.fsum(w)
        for c in range(problem.dv):
            out[b + (i, c)] = float(mp.fsum(wj * mp.mpf(v[b + (j, c)]) for wj, j in zip(w, keys)) / total)
        lse[b + (i,)] = float(mx + mp.log(total))
    return out, lse


# --------------------------------------------------------------------------------------------
# Combining partial results
# --------------------------------------------------------------------------------------------


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Combine the attention of the same queries over two disjoint key sets A and B.

    With ``lse = log Σ exp(s)`` over each set, the weights of A and B in the union are
    ``exp(lse_a - lse)`` and ``exp(lse_b - lse)`` where ``lse = log(exp(lse_a) + exp(lse_b))``;
    computed against ``m = max(lse_a, lse_b)`` so that nothing overflows:

        out = (exp(lse_a - m) · out_a + exp(lse_b - m) · out_b) / (exp(lse_a - m) + exp(lse_b - m))

    This is split-KV / flash-decoding's final reduction and ring attention's step. A part with
    ``lse = -inf`` (no allowed key) contributes nothing, whatever its ``out`` holds (even NaN);
    if both are empty the row is 0 with ``lse = -inf``. An ``lse`` of ``+inf`` is refused: it is
    how FlashAttention marks an empty row, not a sum. The formula is symmetric, so
    ``merge(a, b) == merge(b, a)`` exactly; groupings of three or more parts agree up to rounding.

    Accepts the outputs of every kernel here, :func:`precise_attention`'s longdouble included.
    Returns ``(out, lse)`` with ``out`` in the dtype of ``out_a``/``out_b`` and ``lse`` in the
    dtype of the lse arguments (float32 at least).
    """
    out_a, lse_a, out_b, lse_b = _inputs.check_merge(out_a, lse_a, out_b, lse_b)
    work = np.result_type(lse_a.dtype, lse_b.dtype, out_a.dtype, out_b.dtype, np.float32)
    lse_a, lse_b = lse_a.astype(work), lse_b.astype(work)
    m = np.maximum(lse_a, lse_b)
    m_ref = _reference(m)
    w_a, w_b = np.exp(lse_a - m_ref), np.exp(lse_b - m_ref)

    def weighted(w, out, lse):  # an empty part weighs 0, and 0 · NaN must not be NaN
        return np.where((lse == -np.inf)[..., None], 0, w[..., None] * out.astype(work))

    out, lse = _finalize(weighted(w_a, out_a, lse_a) + weighted(w_b, out_b, lse_b), w_a + w_b, m_ref)
    out_dtype = np.result_type(out_a.dtype, out_b.dtype)
    lse_dtype = np.result_type(lse_a.dtype, lse_b.dtype, np.float32)
    return out.astype(out_dtype, copy=False), lse.astype(lse_dtype, copy=False)

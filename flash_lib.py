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
kernels compute every ``e^x`` as ``2^(x·log2 e)``, as FlashAttention does on a GPU. FlashAttention
multiplies the score and the maximum by ``τ·log2(e)`` (``csrc/flash_attn/src/softmax.h``,
``scale_apply_exp2``: ``exp2f(s·scale - max·scale)``) and keeps its lse in base 2 inside the
kernel; the kernels here multiply the difference ``x = s - m`` (forward) or ``s - lse``
(backward) instead, and keep the scores, ``m`` and the lse in nats, so the forward and the
backward compute the same ``S`` and the lse the backward reads is the one the forward's rows
summed to. Its cost in precision, derived: ``x`` is rounded twice more (``log2 e`` to the dtype,
and the product), ``|δx| <= 2u|x|`` on top of base e's, relative to the exponent, never to the
score. With ``|x| = |s - m| <= 2μ`` (``μ`` chapter 7's magnitude, ``|s| <= μ``) a weight's
relative error grows from ``2γ_{d+2}μ`` to at most ``2γ_{d+2}μ + 4uμ <= 2γ_{d+4}μ``: chapter 7's
bound with ``γ_{d+4}`` for ``γ_{d+2}`` (``s - lse`` adds ``log Nk`` to ``|x|``, a term ``u log Nk``).
Folding ``log2 e`` into the keys, or into the scores (FlashAttention's place) and the lse, rounds
``S`` and the lse at their own size, which took float32 gradients past FlashAttention's own
acceptance rule (``tests/test_fa_rule.py``).

=========== ===============================================================================
``Nq, Nk``  number of queries, number of keys
``d, dv``   feature size of queries/keys, feature size of values
``τ``       the scale (``scale``), ``1/√d`` unless given
``block_q`` rows of queries in one tile; ``block_k``: keys in one tile
``m``       running row maximum of the scaled, masked scores
``l``       running row sum of ``exp(s - m)``
``lse``     log-sum-exp of a row's scaled, masked scores: ``m + log(l)`` (natural log)
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
  compute dtype and machine, chosen from the loops NumPy dispatches to, never from a timing; in
  either base the scores, the maxima and the lse are in nats (``e^x`` as ``2^(x·log2 e)``).
* The same bits in any memory layout: an input not in C order is copied to it once per call
  (axes broadcast with stride 0 stay views), since BLAS and NumPy pick kernels by strides.
* float16 and bfloat16 (``ml_dtypes``) compute in float32; without ml_dtypes bfloat16 is refused.

This file is the algorithm: the recurrence, the two tile loops, the schedule, the merge. Beside
it, and copied with it: ``flash_reference.py`` (the dense references, exported here),
``_flash_inputs.py`` (the checks, and the problem they build), ``_flash_tiles.py`` (one tile's
allowed pairs, score variants and dropout mask), ``_flash_runtime.py`` (threads, BLAS, the
exponential's choice), ``_flash_masked.py`` (the matmul that keeps masked inf and NaN out),
``_flash_dropout.py`` (the dropout mask's Philox), ``_flash_sparse.py`` (top-k sparse
attention) and ``_flash_measure.py`` (peak memory, the error metric). Each imports only modules below it; none imports this one.
"""

from __future__ import annotations

import functools
import math

import numpy as np

import _flash_dropout as _dropout
import _flash_inputs as _inputs
import _flash_runtime as _runtime
import _flash_sparse as _sparse
import _flash_tiles as tiles
from _flash_measure import measure_peak_bytes, rowwise_relative_error
from _flash_runtime import exponential, thread_count, threads, use_exponential
from flash_reference import (naive_attention, naive_attention_backward, precise_attention,
                             precise_attention_backward)

__all__ = [
    "DEFAULT_BLOCK_Q",
    "DEFAULT_BLOCK_K",
    "exponential",
    "use_exponential",
    "exp_as_exp2",
    "online_softmax_update",
    "flash_attention",
    "attention_forward_block",
    "naive_attention",
    "precise_attention",
    "attention_backward_tile",
    "attention_backward_block",
    "flash_attention_backward",
    "naive_attention_backward",
    "precise_attention_backward",
    "merge_attention",
    "sparse_attention",
    "tile_schedule",
    "causal_mask",
    "dropout_keep",
    "check_inputs",
    "check_arrays",
    "sum_to",
    "threads",
    "thread_count",
    "worker_count",
    "run_blocks",
    "InOrder",
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
#: log2(e) and ln(2): e^x = 2^(x·log2 e), and log x = log2(x) · ln 2
LOG2E, LN2 = _inputs.LOG2E, _inputs.LN2


# --------------------------------------------------------------------------------------------
# The recurrence
# --------------------------------------------------------------------------------------------


def online_softmax_update(m, l, acc, s, v, matmul=np.matmul, exp=np.exp, threshold=None):
    """Fold one tile of scores into its rows' running state ``(m, l, acc)``, in place.

    m, l: (..., rows); acc: (..., rows, dv); v: the tile's values, (..., keys, dv);
    s: the tile's scaled scores, (..., rows, keys), -inf where a pair is not allowed;
    s is overwritten with p. ``matmul(p, v)`` is ``p @ v``: the kernel passes one that
    reuses a buffer and keeps masked keys out (``_matmul_allowed``). ``exp``: ``np.exp`` or
    :func:`exp_as_exp2` (the kernel's, by :func:`exponential`'s choice: ``s``, ``m`` in nats),
    or ``np.exp2`` when ``s`` and ``m`` are in base-2 units (multiplied by log2(e)). Below, e^x
    is ``exp`` in either base.
    ``threshold`` (in the units of ``s``): FA4's conditional rescaling, a row's finite ``m`` moves
    only when the tile's maximum exceeds it by more than ``threshold``; ``p`` is then at most
    ``e^threshold`` and the final ``acc / l`` is the same quotient.
    """
    # m' = max(m, max_j s_j)
    m_new = np.maximum(m, s.max(axis=-1))
    if threshold is not None:  # keep m unless m' - m > threshold (an -inf m always moves)
        finite = np.isfinite(m)
        keep = finite & (m_new - np.where(finite, m, 0) <= threshold)
        m_new = np.where(keep, m, m_new)
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


def exp_as_exp2(x, out=None):
    """``e^x`` computed as ``2^(x·log2 e)``, ``x`` an array in nats: what the kernels use for ``e^x``
    where :func:`exponential` is ``np.exp2``. ``log2 e`` is rounded to ``x``'s dtype and the
    product once more, so ``x`` errs by at most ``2u|x|`` more than in base e, relative to the
    exponent itself (``s - m`` or ``s - lse``, never the score's size). A product beyond the
    dtype is ``-inf`` (``2^-inf = 0``, as ``e^x`` underflows there), without a warning."""
    with np.errstate(over="ignore"):
        x2 = np.multiply(x, x.dtype.type(LOG2E), out=out)
    return np.exp2(x2, out=x2)


def _kernel_exp(dtype):
    """The kernels' ``e^x`` for ``dtype``: ``np.exp``, or :func:`exp_as_exp2` where
    :func:`exponential` (this machine's choice, or ``use_exponential``'s) is ``np.exp2``."""
    return exp_as_exp2 if exponential(dtype) is np.exp2 else np.exp


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
# The tiled kernel
# --------------------------------------------------------------------------------------------


def flash_attention(q, k, v, *, mask=None, causal=False, scale=None, block_q=DEFAULT_BLOCK_Q,
                    block_k=DEFAULT_BLOCK_K, return_lse=False, window=None, softcap=None,
                    alibi_slopes=None, enable_gqa=False, mask_mod=None, sinks=None, dropout_p=0.0,
                    dropout_seed=None, dropout_offset=(0, 0), rescale_threshold=None):
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
    dropout_p : real number in [0, 1 - 2**-9]
        Dropout on the weights, FlashAttention's: ``out = (P ∘ Z / (1 - p)) V``, ``Z`` the keep
        mask of :func:`dropout_keep`, Bernoulli(``1 - round(p·2¹⁶)/2¹⁶``) per element, within
        ``2⁻¹⁷`` of ``1 - p``: so ``E[P ∘ Z / (1 - p)] = P`` within a relative ``2⁻¹⁷/(1 - p)``,
        at most ``2⁻⁸`` for the ``p`` accepted (a larger ``p`` is refused: its 16-bit threshold
        cannot keep ``1 - p`` of the weights). ``lse`` stays undropped. 0 (the default) draws
        nothing: the same bits as no dropout.
    dropout_seed : int in [0, 2**64)
        Keys the mask; needed when ``dropout_p > 0``. The backward given it draws the same mask.
    dropout_offset : (row, key)
        Global position of this call's first query and first key in the mask: a shard of a
        larger problem draws its slice of the whole problem's mask (flash_dask does).
    rescale_threshold : real number in [0, 64], optional
        FlashAttention-4's conditional rescaling (``flash_attn/cute/softmax.py``,
        ``update_row_max``), in base-2 units (``log2`` of a factor): a row's running maximum moves
        only when a tile's maximum exceeds it by more than ``t``, so ``acc`` and ``l`` are
        rescaled less often and each ``p`` is at most ``2^t``. The quotient ``acc / l`` is the
        same; only rounding differs. ``acc`` grows up to ``2^t · Nk · max|v|``, which must stay
        finite in the compute dtype. ``None``: the maximum moves on every increase.

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
    problem = _inputs.problem(q, k, v, mask=mask, causal=causal, scale=scale, window=window,
                              softcap=softcap, alibi_slopes=alibi_slopes, enable_gqa=enable_gqa,
                              mask_mod=mask_mod, sinks=sinks, dropout_p=dropout_p,
                              dropout_seed=dropout_seed, dropout_offset=dropout_offset)
    block_q, block_k = _inputs.block_sizes(block_q, block_k)
    threshold = _rescale_threshold(rescale_threshold)
    out = np.zeros(problem.batch + (problem.n_q, problem.dv), dtype=problem.out_dtype)
    # Not allocated unless asked for: it would be O(Nq) scratch.
    lse = np.full(problem.batch + (problem.n_q,), -np.inf, problem.dtype) if return_lse else None
    # e^x, by np.exp or as 2^(x·log2 e): the scores, m and the lse in nats either way
    exp = _kernel_exp(problem.dtype)
    if threshold is not None:  # given in base-2 units, as FA4: 2^t = e^(t·ln 2), t·ln 2 nats
        threshold = threshold * LN2
    block = functools.partial(attention_forward_block, problem, block_k=block_k, exp=exp,
                              out=out, lse=lse, threshold=threshold)
    with _runtime.ieee_quiet():  # the workers inherit it
        _runtime.run_blocks(block, tiles.blocks(problem.n_q, block_q), threads=thread_count(),
                            n_blocks=-(-problem.n_q // block_q), n_scores=problem.n_scores)
    out, lse = problem.merge_heads(out), problem.merge_heads(lse)
    return (out, lse) if return_lse else out


def attention_forward_block(problem, query_block, cancelled, *, block_k, exp, out, lse,
                            threshold=None):
    """The forward's tile loop for one query block ``Q_i = q[q_start:q_stop]``: chapter 5's
    algorithm box, over the key blocks ``K_j, V_j`` of its band, into ``out`` (and ``lse``).

    :func:`flash_attention` runs it on its worker threads, one query block each: ``problem`` is
    its checked problem (``_flash_inputs.Problem``), ``query_block`` is ``(q_start, q_stop)``,
    ``cancelled`` an event that stops the loop before its next tile, ``exp`` the call's ``e^x``
    (:func:`flash_attention` passes ``np.exp`` or :func:`exp_as_exp2`: scores, ``m`` and the lse
    in nats either way). Every extra of a tile (its allowed pairs, the masked-key product, the
    dropout keep mask) is behind ``tile`` (``_flash_tiles.Tile``), so what is left is the box.
    ``threshold``: FA4's conditional rescaling, in nats (:func:`online_softmax_update`).
    """
    q_start, q_stop = query_block
    rows = problem.batch + (q_stop - q_start,)
    q_i = problem.q_tile(q_start, q_stop)  # τ_q Q_i, read once
    m, l = problem.initial_state(rows)  # -inf and 0 (with a sink: the sink and 1)
    acc = np.zeros(rows + (problem.dv,), dtype=problem.dtype)
    # S_ij and P_ij V_j: one buffer each for the whole loop
    s_buf = np.empty(rows + (min(block_k, problem.n_k),), dtype=problem.dtype)
    pv = np.empty(rows + (problem.dv,), dtype=problem.dtype)
    for tile in problem.row(q_start, q_stop, block_k):  # K_j, V_j of Q_i's band, in order
        if cancelled.is_set():  # Ctrl-C, or another worker failed
            return
        if tile.allowed is False:  # mask_mod allows no pair here: never multiplied
            continue
        s = tile.scores(q_i, out=s_buf)  # S_ij = τ Q_i K_jᵀ, then softcap, ALiBi
        tile.mask(s)  # -inf where a pair is not allowed
        online_softmax_update(m, l, acc, s, tile.v, tile.pv(out=pv), exp, threshold)
    if problem.dropout_p:  # out = (P ∘ Z / (1 - p)) V: the 1 / (1 - p) once per row
        acc *= problem.dropout_scale(problem.dtype)
    out[..., q_start:q_stop, :], lse_i = _finalize(acc, l, m)  # O_i = acc / l, once
    if lse is not None:
        lse[..., q_start:q_stop] = lse_i


def _rescale_threshold(value):
    """``rescale_threshold`` checked: None, or a real number in [0, 64] (2^64 leaves float32
    room for ``Nk · max|v|`` up to 2^63), as a float."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                      np.floating)):
        raise TypeError(f"rescale_threshold must be a real number or None, got "
                        f"{type(value).__name__}")
    if not 0 <= float(value) <= 64:
        raise ValueError(f"rescale_threshold must be in [0, 64] (base-2 units), got {value!r}")
    return float(value)


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
    band = tiles.Band.of(n_q, n_k, _inputs.check_bool("causal", causal), _inputs.checked_window(window))
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
        return list(tiles.blocks(n, _inputs.int_at_least(name, size, 1)))
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


# --------------------------------------------------------------------------------------------
# The backward pass
# --------------------------------------------------------------------------------------------


def attention_backward_tile(q, k, v, dout, lse, D, dk, dv, allowed=None, matmul=None,
                            scores=None, dropout=None, dp_buffer=None, exp=np.exp):
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
    ``exp``: ``np.exp`` or :func:`exp_as_exp2` (the kernel's), S_ij and lse_i in nats; or
    ``np.exp2`` when ``scores`` returns S_ij in base-2 units (times log2(e)) and lse_i is in them.
    """
    matmul = matmul or (lambda a, b, which: a @ b)
    # S_ij, recomputed as the forward computed it
    s, slope = scores(q, k) if scores else (q @ np.swapaxes(k, -1, -2), None)
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
    tiles.masked_pairs_zero(ds, allowed)
    # dK_j += dS_ijᵀ Q_i
    dk += matmul(np.swapaxes(ds, -1, -2), q, "q")
    # dQ_i += dS_ij K_j
    return matmul(ds, k, "k")


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
    problem = _inputs.problem(q, k, v, mask=mask, causal=causal, scale=scale, window=window,
                              softcap=softcap, alibi_slopes=alibi_slopes, enable_gqa=enable_gqa,
                              mask_mod=mask_mod, sinks=sinks, dropout_p=dropout_p,
                              dropout_seed=dropout_seed, dropout_offset=dropout_offset)
    block_q, block_k = _inputs.block_sizes(block_q, block_k)
    out, lse, dout = _inputs.check_saved(problem, out, lse, dout)
    dtype, batch, n_q, n_k = problem.dtype, problem.batch, problem.n_q, problem.n_k
    # D_i = rowsum(dO_i ∘ O_i) = Σ_j P_ij dP_ij, once per row: P is never needed whole.
    D = np.empty(batch + (n_q,), dtype)
    for q_start, q_stop in tiles.blocks(n_q, block_q):
        rows = slice(q_start, q_stop)
        dout_rows = dout[..., rows, :].astype(dtype, copy=False)
        # NumPy's sum over the last, contiguous axis is pairwise (einsum's loop is not): float32
        # RMS error 0.6 of einsum's at dv = 256, the largest about half (tests/test_fa_rule.py)
        with np.errstate(over="ignore", invalid="ignore"):  # inf or NaN: as IEEE says, unwarned
            D[..., rows] = np.multiply(dout_rows, out[..., rows, :].astype(dtype, copy=False)).sum(
                axis=-1)
        # An inf in dO_i makes every allowed dS_ij NaN in the dense chain (dP_ij - rowsum(P ∘ dP)
        # is inf - inf or NaN there); dO_i·O_i is ±inf instead, and dP_ij - D_i could be ±inf.
        D[..., rows] = np.where(np.isfinite(dout_rows).all(axis=-1), D[..., rows], np.nan)
    lse = np.where(lse == -np.inf, np.inf, lse).astype(dtype, copy=False)
    # P = e^(S - lse), by the forward's exponential, from the forward's scores and lse in nats
    exp = _kernel_exp(dtype)
    dq = np.zeros(problem.q.shape, dtype)  # the shares Σ_j dS_ij K_j, times τ_q at the end
    dk = np.zeros(problem.k.shape, problem.k.dtype)
    dv = np.zeros(problem.v.shape, problem.v.dtype)
    # Each worker's buffers: S (then P) and dP (then dS) of a tile; τ_q Q_i; the three products
    # added to dV_j, dK_j and dQ_i
    rows_max, keys_max, d = min(block_q, n_q), min(block_k, n_k), problem.q.shape[-1]
    buffers = _runtime.per_worker(lambda: (
        [np.empty(batch + (rows_max, keys_max), dtype) for _ in range(2)],
        np.empty(problem.q.shape[:-2] + (rows_max, d), dtype),
        {"dout": np.empty(batch + (keys_max, problem.dv), dtype),  # P̃ᵀ dO, for dV_j
         "q": np.empty(batch + (keys_max, d), dtype),  # dSᵀ Q_i, for dK_j
         "k": np.empty(batch + (rows_max, d), dtype)}))  # dS K_j, dQ_i's share
    block = functools.partial(attention_backward_block, problem, block_q=block_q, block_k=block_k,
                              exp=exp, dout=dout, lse=lse, D=D, grads=(dq, dk, dv),
                              turns=_runtime.InOrder(-(-n_q // block_q)), buffers=buffers)
    with _runtime.ieee_quiet():  # the workers inherit it
        _runtime.run_blocks(block, tiles.blocks(n_k, block_k), threads=thread_count(),
                            n_blocks=-(-n_k // block_k), n_scores=problem.n_scores)
    dq *= dtype.type(problem.scale_q)
    grads = problem.input_shapes(dq.astype(problem.q.dtype, copy=False), dk, dv)
    if problem.sinks is None:
        return grads
    with _runtime.ieee_quiet():  # a NaN row's D is NaN: its dsinks term is, without a warning
        return grads + (problem.dsinks(lse, D),)


def attention_backward_block(problem, key_block, cancelled, *, block_q, block_k, exp, dout, lse,
                             D, grads, turns, buffers):
    """The backward's tile loop for one key block ``K_j, V_j = k, v[k_start:k_stop]``:
    chapter 12's loop, over every query block ``Q_i`` in order, with ``dK_j`` and ``dV_j`` held
    here and ``dQ_i``'s shares added in key-block order.

    :func:`flash_attention_backward` runs it on its worker threads, one key block each:
    ``problem`` is its checked problem, ``key_block`` is ``(k_start, k_stop)``, ``cancelled``
    stops the loop before its next tile; ``dout``, ``lse`` (``+inf`` for an empty row) and ``D``
    are the whole call's; ``grads`` the ``(dq, dk, dv)`` it fills; ``turns`` the order of the
    additions to ``dq`` (``_flash_runtime.InOrder``); ``buffers()`` this worker's scratch.
    """
    k_start, k_stop = key_block
    j = k_start // block_k
    dq, dk, dv = grads
    dtype, batch = problem.dtype, problem.batch
    k_j = problem.k_tile(k_start, k_stop)  # τ_k K_j, for S and dQ's shares
    v_j = problem.v_tile(k_start, k_stop)
    dk_j = np.zeros(batch + k_j.shape[-2:], dtype)
    dv_j = np.zeros(batch + v_j.shape[-2:], dtype)
    tile_buffers, q_buf, products = buffers()
    tile_buffers = [t[..., : k_stop - k_start] for t in tile_buffers]
    for i, tile in enumerate(problem.column(k_start, k_stop, block_q)):  # every Q_i
        if cancelled.is_set():  # Ctrl-C, or another worker failed
            return
        share = None
        if tile.allowed is not False:  # else the band or mask_mod allows no pair here
            rows = slice(tile.q_start, tile.q_stop)
            s_buf, dp_buf = (t[..., : tile.q_stop - tile.q_start, :] for t in tile_buffers)
            share = attention_backward_tile(
                problem.q_tile(tile.q_start, tile.q_stop, out=q_buf), k_j, v_j,
                dout=dout[..., rows, :].astype(dtype, copy=False),
                lse=lse[..., rows], D=D[..., rows], dk=dk_j, dv=dv_j,
                allowed=tile.allowed, matmul=tile.backward_matmul(dout, products),
                scores=functools.partial(tile.scores_of, out=s_buf, grad=True),
                dropout=tile.dropout(), dp_buffer=dp_buf, exp=exp)
            share = sum_to(share, dq.shape[:-2] + share.shape[-2:])
        with turns.turn(i, j, cancelled) as mine:  # dQ_i += dS_ij K_j, in key-block order
            if not mine:
                return
            if share is not None:
                dq[..., tile.q_start:tile.q_stop, :] += share
    dk_j *= dtype.type(problem.scale_k)
    dk[..., k_start:k_stop, :] = sum_to(dk_j, dk.shape[:-2] + dk_j.shape[-2:])
    dv[..., k_start:k_stop, :] = sum_to(dv_j, dv.shape[:-2] + dv_j.shape[-2:])


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
    m_ref = np.where(m == -np.inf, 0, m)  # an empty row's -inf: any finite reference gives 0
    w_a, w_b = np.exp(lse_a - m_ref), np.exp(lse_b - m_ref)

    def weighted(w, out, lse):  # an empty part weighs 0: its out (inf, NaN) is never multiplied
        shape = np.broadcast_shapes(w.shape + (1,), out.shape)
        return np.multiply(w[..., None], out, out=np.zeros(shape, work), dtype=work,
                           where=(lse != -np.inf)[..., None])

    out, lse = _finalize(weighted(w_a, out_a, lse_a) + weighted(w_b, out_b, lse_b), w_a + w_b, m_ref)
    out_dtype = np.result_type(out_a.dtype, out_b.dtype)
    lse_dtype = np.result_type(lse_a.dtype, lse_b.dtype, np.float32)
    return out.astype(out_dtype, copy=False), lse.astype(lse_dtype, copy=False)


def sparse_attention(q, k, v, indices, *, scale=None, return_lse=False):
    """Top-k sparse attention: query ``i`` attends exactly the keys ``indices[..., i, :]`` lists
    (DeepSeek Sparse Attention's selected keys; FlashAttention's ``gather_kv_indices``).

    ``q (..., Nq, d)``, ``k (..., Nk, d)``, ``v (..., Nk, dv)`` as :func:`flash_attention`
    (checked by :func:`check_inputs`); ``indices (..., Nq, topk)`` integers, ``-1`` an unused slot,
    each other entry in ``[0, Nk)`` and listed at most once per row (else ValueError naming
    ``indices``; its leading dims broadcast with the others'). A row with no key gets ``out`` 0 and
    ``lse = -inf``; an unused slot reads nothing (an inf or NaN at key 0 stays out). The order of a
    row's indices changes only rounding. Memory: the gathered keys and values,
    ``O(batch · Nq · topk · (d + dv))``, never ``Nq × Nk``. Returns ``out`` (and ``lse``) as
    :func:`flash_attention`."""
    return _sparse.sparse_attention(q, k, v, indices, scale=scale, return_lse=return_lse)


# --------------------------------------------------------------------------------------------
# The one way in for code built on flash_lib
# --------------------------------------------------------------------------------------------


def check_inputs(q, k, v, *, mask=None, causal=False, scale=None, window=None, softcap=None,
                 alibi_slopes=None, enable_gqa=False, mask_mod=None, sinks=None, dropout_p=0.0,
                 dropout_seed=None, dropout_offset=(0, 0), block_q=None, block_k=None, out=None,
                 lse=None, dout=None):
    """Check a call's arguments as every kernel here checks them, without computing anything.

    The arguments of :func:`flash_attention` (and, with ``out``, ``lse``, ``dout``, of
    :func:`flash_attention_backward`): the same rules, the same ``TypeError`` and ``ValueError``
    messages, in the same order. Arrays are read for their ``shape``, ``ndim`` and ``dtype`` only,
    so a Dask array is not computed; the scalars, ``sinks`` and ``alibi_slopes`` are checked by
    value. The code built on flash_lib (``flash_dask``, ``flash_serving``, ``flash_triton``)
    validates through this, so that it accepts exactly what the kernels accept.

    Returns
    -------
    Checked
        A frozen record: ``batch`` (the leading dims of ``out`` and ``lse``), ``n_q``, ``n_k``,
        ``d``, ``dv``, ``out_dtype``, ``dtype`` (the compute dtype, also the lse's and dsinks':
        float32 for 16-bit inputs), ``scale`` (τ as the kernels apply it, ``1/√d`` unless given)
        and ``groups`` (query heads per kv head with ``enable_gqa``, else None).
    """
    return _inputs.check(q, k, v, mask=mask, causal=causal, scale=scale, window=window,
                         softcap=softcap, alibi_slopes=alibi_slopes, enable_gqa=enable_gqa,
                         mask_mod=mask_mod, sinks=sinks, dropout_p=dropout_p,
                         dropout_seed=dropout_seed, dropout_offset=dropout_offset, block_q=block_q,
                         block_k=block_k, out=out, lse=lse, dout=dout)


def check_arrays(q, k, v, mask=None, *, enable_gqa=False):
    """Check ``q``, ``k``, ``v`` and ``mask`` as every kernel does (dtypes, shapes, broadcasting),
    reading only their ``shape``, ``ndim`` and ``dtype`` (a Dask array is not computed), and
    return the leading (batch) shape of the results: :func:`check_inputs` with the arrays alone."""
    return _inputs.check_arrays(q, k, v, mask, enable_gqa=enable_gqa)[2]


def sum_to(x, shape):
    """Sum ``x`` over the dims along which an array of ``shape`` was broadcast to ``x.shape``: the
    gradient of a broadcast input, as autograd gives it (a ``k`` shared by every head gets the
    sum of the heads' gradients). ``shape`` may have fewer dims than ``x``."""
    return tiles.sum_to(x, shape)


def worker_count(n_blocks, n_scores):
    """The worker threads a kernel call here runs its ``n_blocks`` blocks on (query blocks in the
    forward, key blocks in the backward), for ``n_scores`` scores in all (batch × Nq × Nk): one
    below 2²⁰ scores, where a thread pool costs more than it saves, else up to
    :func:`thread_count`, at most one per block."""
    return _runtime.worker_count(thread_count(), n_blocks, n_scores)


def run_blocks(work_on, blocks, *, n_scores):
    """Call ``work_on(block, cancelled)`` for every block of the sequence ``blocks`` on the
    kernels' threads (:func:`worker_count` of them), as flash_lib's own kernels run their query
    or key blocks: BLAS held at one thread (its thread count changes its rounding), each worker in
    a copy of the caller's context (``np.errstate`` holds there), and on the first exception of a
    worker or a Ctrl-C, ``cancelled`` (a ``threading.Event``) set, every worker stopped before its
    next tile, and the exception raised here. For kernels built beside flash_lib (flash_cpu)."""
    _runtime.run_blocks(work_on, blocks, n_blocks=len(blocks), n_scores=n_scores,
                        threads=thread_count())


#: Turns for adding shares to shared rows in a fixed order whatever thread is ready first
#: (the backward's dQ_i, in key-block order): ``with turns.turn(i, j, cancelled) as mine:``.
InOrder = _runtime.InOrder

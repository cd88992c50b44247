"""FlashAttention, forward and backward, exact, in plain NumPy.

Attention of queries ``q`` over keys ``k`` and values ``v`` is

    S = τ · q kᵀ,   P = softmax(S) row by row,   out = P v,      (τ = ``scale``, 1/√d by default)

and the textbook way (:func:`naive_attention`) stores the whole ``Nq × Nk`` matrix ``S``.
:func:`flash_attention` computes the same ``out`` without ever holding more than one
``block_q × block_k`` tile of ``S``: it walks over key blocks and keeps, for each query row,

* ``m``   -- the running maximum of the scores seen so far (so ``exp`` never overflows),
* ``l``   -- the running denominator ``Σ exp(s - m)`` over those scores,
* ``acc`` -- the running numerator ``Σ exp(s - m) · v`` (a ``dv``-vector per row).

When a new tile raises the maximum from ``m`` to ``m'``, everything summed so far was scaled
by ``exp(-m)`` instead of ``exp(-m')``; multiplying ``l`` and ``acc`` by ``exp(m - m')``
corrects that exactly. After the last tile ``out = acc / l`` and the row's log-sum-exp is
``lse = m + log(l)``. That recurrence is :func:`online_softmax_update`; the rest of this file
is what feeds it tiles (:func:`flash_attention`), what checks it (:func:`naive_attention`,
:func:`precise_attention`), and what runs it on several threads.

The backward pass (:func:`flash_attention_backward`, FlashAttention-2's) never stores ``P``
either: it recomputes each tile's ``P = exp(S - lse)`` from the lse the forward saved, and
needs ``D = rowsum(dout ∘ out)`` besides; one tile's arithmetic is :func:`attention_backward_tile`.
Every kernel takes the same variants: a sliding ``window``, ``softcap``, ALiBi
(``alibi_slopes``), grouped-query heads (``enable_gqa``) and FlexAttention-style ``mask_mod``;
the tiles that ``causal``, ``window`` and ``mask_mod`` rule out are never computed
(:func:`tile_schedule` lists the ones that are).

Symbols, used throughout the code and the notebooks:

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

Contracts, the same in every kernel here (``README.md`` says how other libraries differ):

* ``mask[..., i, j]`` True means query ``i`` may attend to key ``j`` (PyTorch SDPA and JAX).
* ``causal=True`` allows key ``j`` for query ``i`` iff ``j <= i + (Nk - Nq)``: the diagonal is
  aligned bottom-right, as in FlashAttention >= 2.1, so the last query sees every key.
* **Empty rows.** A row with no allowed key gives ``out`` exactly ``0.0`` and ``lse = -inf``,
  with no NaN and no floating-point warning, whatever ``q``, ``k`` and ``v`` hold.
  (FlashAttention stores ``+inf`` as such a row's lse; :func:`merge_attention` says how to
  convert.)
* **Masked keys never leak.** An inf or NaN in ``k`` or ``v`` at key ``j`` reaches exactly the
  rows allowed to attend key ``j``, for every block size: a row that may not attend it is
  computed as if key ``j`` did not exist. This is the padding of a KV cache, whose unused slots
  hold garbage. A weight of exactly 0 is not enough for that, because ``0 · inf = NaN`` in IEEE
  arithmetic; ``_matmul_allowed`` handles the few key blocks that hold such values (they are
  found once per call, so finite inputs pay nothing). Rows allowed to attend a non-finite key
  get what IEEE arithmetic gives (NaN or ±inf); a score of ``-inf`` weighs 0, like a masked one.
* **NaN in q.** A NaN in row ``i`` of ``q`` makes row ``i`` of ``out`` and ``lse`` NaN (unless the
  row is fully masked) and leaves every other row exact.
* **The scale** is applied to the inputs, not to the scores: ``τ = r·2^e`` (``0.5 <= r < 1``) is
  applied as ``q · r·2^a`` and ``k · 2^b`` with ``a + b = e`` and ``b = trunc(e/2)``. Why:

  - *accuracy*: a power of two scales exactly, so the scores round exactly as ``(τq)kᵀ``; that
    and ``τ(qkᵀ)`` carry the same error bound (one rounding of ``τ`` per product against the
    dot product's ``d`` roundings), and agree bit for bit when ``τ`` is a power of two;
  - *cost*: scaling inputs touches ``(block_q + block_k)·d`` numbers per tile; scaling the
    scores would be one more pass over all ``block_q·block_k`` of them;
  - *range*: ``τq`` alone overflows for ``q = 1e300, τ = 1e10`` although every score is finite,
    and ``qkᵀ`` overflows float32 for ``q = k = 1e20`` before ``τ = 1e-30`` shrinks it; with
    ``√τ`` on each side neither does, unless the scores themselves are near the limit.
* **Threads.** Query blocks run on up to ``FLASH_LIB_THREADS`` threads (default: the number
  of cores, at most 4) and every tile is computed by the same calls whichever thread runs it,
  so results are bit-identical from run to run, from any calling thread, and whatever runs
  concurrently. That needs BLAS at one thread: how many threads a BLAS uses changes how it
  splits a matmul, and with it the rounding. NumPy's OpenBLAS keeps that count in one
  process-wide variable, so a call holds it at 1 while it runs and puts back exactly what it
  found (the caller's setting, unless another thread changed it meanwhile) when it returns,
  raises or is interrupted; calls are serialised by a lock, so no call ever sees another's
  setting. While a call runs, other threads' NumPy matmuls run on one BLAS thread too.
  Ctrl-C stops a call within about one tile.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import math
import numbers
import os
import threading
import tracemalloc
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
from threadpoolctl import ThreadpoolController

try:  # bfloat16 is not a NumPy dtype; ml_dtypes (a dependency) provides it.
    import ml_dtypes

    _BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is in pyproject.toml's dependencies
    _BFLOAT16 = None

__all__ = [
    "DEFAULT_BLOCK_Q",
    "DEFAULT_BLOCK_K",
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


# --------------------------------------------------------------------------------------------
# The recurrence
# --------------------------------------------------------------------------------------------


def online_softmax_update(m, l, acc, s, v, matmul=np.matmul):
    """Fold one tile of scores into its rows' running state ``(m, l, acc)``, in place.

    m, l: (..., rows); acc: (..., rows, dv); v: the tile's values, (..., keys, dv);
    s: the tile's scaled scores, (..., rows, keys), -inf where a pair is not allowed;
    s is overwritten with p. ``matmul(p, v)`` is ``p @ v``: the kernel passes one that
    reuses a buffer and keeps masked keys out (``_matmul_allowed``).
    """
    # m' = max(m, max_j s_j)
    m_new = np.maximum(m, s.max(axis=-1))
    # A row with no allowed key yet has m' = -inf, and -inf - (-inf) is NaN;
    # any finite reference gives the same e^(-inf) = 0 there: use 0.
    m_ref = np.where(m_new == -np.inf, 0, m_new)
    # alpha = e^(m - m') re-expresses what was summed against m'
    alpha = np.exp(m - m_ref)
    # p_j = e^(s_j - m')
    p = np.exp(np.subtract(s, m_ref[..., None], out=s), out=s)
    # l' = l·e^(m - m') + Σ_j p_j
    l *= alpha
    l += p.sum(axis=-1)
    # acc' = acc·e^(m - m') + Σ_j p_j v_j
    acc *= alpha[..., None]
    acc += matmul(p, v)
    m[...] = m_new


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
    window=None,
    softcap=None,
    alibi_slopes=None,
    enable_gqa=False,
    mask_mod=None,
):
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
        τ, multiplies the scores; default ``1 / sqrt(d)``. Must be a normal number of the
        compute dtype (float32 for half-precision inputs).
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
        (FlashAttention, Gemma 2).
    alibi_slopes : array, optional
        Broadcastable to the leading (batch, head) dims, e.g. ``(H,)`` or ``(B, H)``: adds
        ``-slope · |i + (Nk - Nq) - j|`` to the (capped) scores, FlashAttention's ALiBi.
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
    problem = _check_inputs(q, k, v, mask, causal, scale, window, softcap, alibi_slopes,
                            enable_gqa, mask_mod)
    block_q = _int_at_least("block_q", block_q, 1)
    block_k = _int_at_least("block_k", block_k, 1)
    out = np.zeros(problem.batch + (problem.n_q, problem.dv), dtype=problem.out_dtype)
    # Not allocated unless asked for: it would be O(Nq) scratch.
    lse = np.full(problem.batch + (problem.n_q,), -np.inf, problem.acc) if return_lse else None

    def attend(query_block, cancelled):
        """One query block over its key blocks: the online-softmax recurrence, tile by tile."""
        q_start, q_stop = query_block
        rows = problem.batch + (q_stop - q_start,)
        q_blk = problem.q_tile(q_start, q_stop)
        m = np.full(rows, -np.inf, dtype=problem.acc)
        l = np.zeros(rows, dtype=problem.acc)
        acc = np.zeros(rows + (problem.dv,), dtype=problem.acc)
        # The scores tile and the p·v product are reused across key blocks: one allocation each.
        s_buf = np.empty(rows + (min(block_k, problem.n_k),), dtype=problem.acc)
        pv = np.empty(rows + (problem.dv,), dtype=problem.acc)
        # exactly this query block's tiles of tile_schedule(...)
        for k_start, k_stop in problem.band.key_blocks(q_start, q_stop, block_k):
            if cancelled.is_set():
                return
            allowed = _allowed(problem, q_start, q_stop, k_start, k_stop)
            if allowed is False:  # mask_mod allows no pair here: never multiplied
                continue
            s = _scores(problem, q_blk, problem.k_tile(k_start, k_stop),
                        q_start, q_stop, k_start, k_stop, out=s_buf[..., : k_stop - k_start])
            if allowed is not None:
                np.copyto(s, -np.inf, where=~allowed)
            bad = problem.bad_values(k_start, k_stop) if allowed is not None else None
            if bad is None:
                matmul = functools.partial(np.matmul, out=pv)
            else:
                matmul = functools.partial(_matmul_allowed, allowed=allowed, bad=bad, out=pv)
            online_softmax_update(m, l, acc, s, problem.v_tile(k_start, k_stop), matmul)
        # Divide once, at the end.
        out[..., q_start:q_stop, :], lse_blk = _finalize(acc, l, m)
        if lse is not None:
            lse[..., q_start:q_stop] = lse_blk

    # Threads only pay for themselves on real work (a thread pool costs ~0.1 ms to start).
    n_scores = math.prod(problem.batch) * problem.n_q * problem.n_k
    n_blocks = -(-problem.n_q // block_q)
    workers = min(_THREADS, n_blocks) if n_scores >= _PARALLEL_MIN_SCORES else 1
    with np.errstate(invalid="ignore"):  # see _IEEE_QUIET; the workers inherit it
        _run_blocks(attend, _query_blocks(problem.n_q, block_q), workers)
    out, lse = problem.merge_heads(out), problem.merge_heads(lse)
    return (out, lse) if return_lse else out


def tile_schedule(n_q, n_k, block_q, block_k, causal=False, *, window=None, mask_mod=None):
    """The tiles :func:`flash_attention` visits, in order, as ``(q_start, q_stop, k_start, k_stop)``.

    Query blocks in the outer loop, key blocks in the inner loop (FlashAttention-2's order: each
    query block's ``m``, ``l`` and ``acc`` live through one inner loop). The last block in each
    direction may be partial. A tile is visited iff it holds a pair that ``causal`` and
    ``window`` allow (for causal alone: iff its bottom-left pair, last query and first key, is
    allowed) and, with ``mask_mod``, one that ``mask_mod`` allows (in any batch entry); the
    others are skipped without being computed. The ``mask`` array never skips a tile.
    """
    n_q = _int_at_least("n_q", n_q, 0)
    n_k = _int_at_least("n_k", n_k, 0)
    block_q = _int_at_least("block_q", block_q, 1)
    block_k = _int_at_least("block_k", block_k, 1)
    band = _Band.of(n_q, n_k, _bool("causal", causal), _checked_window(window))
    mask_mod = _checked_mask_mod(mask_mod)
    return [
        (q_start, q_stop, k_start, k_stop)
        for q_start, q_stop in _query_blocks(n_q, block_q)
        for k_start, k_stop in band.key_blocks(q_start, q_stop, block_k)
        if mask_mod is None or _call_mask_mod(mask_mod, q_start, q_stop, k_start, k_stop).any()
    ]


def causal_mask(n_q, n_k):
    """The pairs ``causal=True`` allows, as an explicit ``(n_q, n_k)`` boolean mask: key ``j`` for
    query ``i`` iff ``j <= i + (n_k - n_q)`` (bottom-right, FlashAttention >= 2.1)."""
    n_q = _int_at_least("n_q", n_q, 0)
    n_k = _int_at_least("n_k", n_k, 0)
    return np.tril(np.ones((n_q, n_k), dtype=bool), k=n_k - n_q)


# The kernel walks these generators directly rather than a materialised schedule, whose list
# would hold one tuple per tile: O(Nq·Nk / (block_q·block_k)) memory.
def _query_blocks(n_q, block_q):
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


def _scores(problem, q, k, q_start, q_stop, k_start, k_stop, out=None, grad=False):
    """``S = (τ_q q)(τ_k k)ᵀ`` for one tile, then the score variants: softcap, then ALiBi.

    ``q``, ``k``: the tile's scaled queries and keys. With ``grad=True`` also returns
    ``dS_capped / dS = 1 - tanh²(S / softcap)`` (None without softcap), which the backward needs.
    """
    s = np.matmul(q, np.swapaxes(k, -1, -2), out=out)
    slope = None
    if problem.softcap is not None:
        cap = s.dtype.type(problem.softcap)
        t = np.tanh(np.divide(s, cap, out=s), out=s)  # t = tanh(s / c)
        slope = 1 - t * t if grad else None
        np.multiply(t, cap, out=s)  # s ← c·tanh(s / c)
    if problem.alibi is not None:
        i = np.arange(q_start, q_stop)[:, None] + (problem.n_k - problem.n_q)
        distance = np.abs(i - np.arange(k_start, k_stop)[None, :]).astype(s.dtype)
        bias = -problem.alibi.astype(s.dtype) * distance  # -slope·|i + (Nk - Nq) - j|
        if np.broadcast_shapes(s.shape, bias.shape) == s.shape:
            s += bias
        else:
            s = s + bias
    return (s, slope) if grad else s


def _matmul_allowed(a, b, *, allowed, bad, out=None):
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


# --------------------------------------------------------------------------------------------
# The backward pass
# --------------------------------------------------------------------------------------------


def attention_backward_tile(q, k, v, dout, lse, D, dk, dv, allowed=None, matmul=None,
                            scores=None):
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
    """
    matmul = matmul or (lambda a, b, which: a @ b)
    # S_ij, recomputed as the forward computed it
    s, slope = scores(q, k) if scores else (q @ np.swapaxes(k, -1, -2), None)
    if allowed is not None:
        np.copyto(s, -np.inf, where=~allowed)
    # P_ij = e^(S_ij - lse_i): one exp, no max, no sum
    p = np.exp(np.subtract(s, lse[..., None], out=s), out=s)
    if allowed is not None and np.isnan(lse).any():
        # e^(-inf - NaN) is NaN: a NaN row's masked pairs must still weigh 0
        np.copyto(p, 0, where=~allowed)
    # dV_j += P_ijᵀ dO_i
    dv += matmul(np.swapaxes(p, -1, -2), dout, "dout")
    # dP_ij = dO_i V_jᵀ
    dp = dout @ np.swapaxes(v, -1, -2)
    # dS_ij = P_ij ∘ (dP_ij - D_i)
    ds = np.multiply(p, np.subtract(dp, D[..., None], out=dp), out=dp)
    if allowed is not None:
        # inf or NaN in V_j made dP NaN at masked pairs too: their dS is 0
        np.copyto(ds, 0, where=~allowed)
    if slope is not None:
        # through softcap: dS_raw = dS ∘ (1 - tanh²(S_raw / c))
        ds *= slope
    # dK_j += dS_ijᵀ Q_i
    dk += matmul(np.swapaxes(ds, -1, -2), q, "q")
    # dQ_i += dS_ij K_j
    return matmul(ds, k, "k")


def flash_attention_backward(
    q,
    k,
    v,
    out,
    lse,
    dout,
    *,
    mask=None,
    causal=False,
    scale=None,
    block_q=DEFAULT_BLOCK_Q,
    block_k=DEFAULT_BLOCK_K,
    window=None,
    softcap=None,
    alibi_slopes=None,
    enable_gqa=False,
    mask_mod=None,
):
    """The gradients of ``sum(dout * flash_attention(q, k, v, ...))`` without storing ``P``.

    Parameters
    ----------
    q, k, v, mask, causal, scale, block_q, block_k, window, softcap, alibi_slopes, enable_gqa, mask_mod
        As for :func:`flash_attention`, and the same as the forward call.
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
    meet it; a NaN in row ``i`` of ``q`` makes row ``i`` of ``dq`` NaN, and, through ``P_ij``,
    the ``dk``, ``dv`` rows of the keys row ``i`` attends (what IEEE arithmetic gives).
    """
    problem = _check_inputs(q, k, v, mask, causal, scale, window, softcap, alibi_slopes,
                            enable_gqa, mask_mod)
    block_q = _int_at_least("block_q", block_q, 1)
    block_k = _int_at_least("block_k", block_k, 1)
    out, lse, dout = _check_saved(problem, out, lse, dout)
    acc, batch, n_q, n_k = problem.acc, problem.batch, problem.n_q, problem.n_k
    # D_i = rowsum(dO_i ∘ O_i) = Σ_j P_ij dP_ij, once per row: P is never needed whole.
    D = np.empty(batch + (n_q,), acc)
    for q_start, q_stop in _query_blocks(n_q, block_q):
        rows = slice(q_start, q_stop)
        D[..., rows] = np.einsum("...c,...c->...", dout[..., rows, :].astype(acc, copy=False),
                                 out[..., rows, :].astype(acc, copy=False))
    lse = np.where(lse == -np.inf, np.inf, lse).astype(acc, copy=False)
    dq = np.zeros(problem.q.shape, acc)  # the shares Σ_j dS_ij K_j, times τ_q at the end
    dk = np.zeros(problem.k.shape, problem.k.dtype)
    dv = np.zeros(problem.v.shape, problem.v.dtype)
    n_q_blocks = -(-n_q // block_q)
    turn = [0] * n_q_blocks  # turn[i]: the key block whose share of dQ_i is added next
    turns = threading.Condition()

    def key_block(block, cancelled):
        """One key block over every query block: dK_j, dV_j resident, dQ's shares added in turn."""
        k_start, k_stop = block
        j = k_start // block_k
        k_blk = problem.k_tile(k_start, k_stop)
        v_blk = problem.v_tile(k_start, k_stop)
        dk_blk = np.zeros(batch + k_blk.shape[-2:], acc)
        dv_blk = np.zeros(batch + v_blk.shape[-2:], acc)
        for i, (q_start, q_stop) in enumerate(_query_blocks(n_q, block_q)):
            if cancelled.is_set():
                return
            share = None
            visits = problem.band.visits(q_start, q_stop, k_start, k_stop)
            allowed = _allowed(problem, q_start, q_stop, k_start, k_stop) if visits else False
            if allowed is not False:
                rows = slice(q_start, q_stop)
                matmul = _backward_matmul(problem, allowed, dout, q_start, q_stop, k_start, k_stop)
                share = attention_backward_tile(
                    problem.q_tile(q_start, q_stop), k_blk, v_blk,
                    dout[..., rows, :].astype(acc, copy=False), lse[..., rows], D[..., rows],
                    dk_blk, dv_blk, allowed, matmul,
                    functools.partial(_scores, problem, q_start=q_start, q_stop=q_stop,
                                      k_start=k_start, k_stop=k_stop, grad=True),
                )
                share = _sum_to(share, dq.shape[:-2] + share.shape[-2:])
            with turns:
                while turn[i] != j:
                    if cancelled.is_set():
                        return
                    turns.wait(0.05)
                if share is not None:
                    dq[..., q_start:q_stop, :] += share
                turn[i] = j + 1
                turns.notify_all()
        dk_blk *= acc.type(problem.scale_k)
        dk[..., k_start:k_stop, :] = _sum_to(dk_blk, dk.shape[:-2] + dk_blk.shape[-2:])
        dv[..., k_start:k_stop, :] = _sum_to(dv_blk, dv.shape[:-2] + dv_blk.shape[-2:])

    n_scores = math.prod(batch) * n_q * n_k
    n_blocks = -(-n_k // block_k)
    workers = min(_THREADS, n_blocks) if n_scores >= _PARALLEL_MIN_SCORES else 1
    key_blocks = ((k0, min(k0 + block_k, n_k)) for k0 in range(0, n_k, block_k))
    with np.errstate(invalid="ignore"):  # see _IEEE_QUIET; the workers inherit it
        _run_blocks(key_block, key_blocks, workers)
    dq *= acc.type(problem.scale_q)
    return problem.input_shapes(dq.astype(problem.q.dtype, copy=False), dk, dv)


def _backward_matmul(problem, allowed, dout, q_start, q_stop, k_start, k_stop):
    """The ``matmul`` of :func:`attention_backward_tile` for one tile: plain ``a @ b``, or, for an
    operand with inf or NaN rows in this tile and a tile with masked pairs, ``_matmul_allowed``."""
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
        return _matmul_allowed(a, b, allowed=ok, bad=bad[which])

    return matmul


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
                    window=None, softcap=None, alibi_slopes=None, enable_gqa=False, mask_mod=None):
    """Textbook attention: the full ``Nq × Nk`` score matrix, then a max-subtracted softmax.

    Same arguments, results and conventions as :func:`flash_attention` (minus the block sizes);
    it is the oracle the tiled kernel is tested against, so it stays as plain as possible. Its
    one matmul uses the BLAS threads the caller has set.
    """
    problem = _check_inputs(q, k, v, mask, causal, scale, window, softcap, alibi_slopes,
                            enable_gqa, mask_mod)
    out, lse = _dense_attention(problem, problem.acc)
    out = problem.merge_heads(out.astype(problem.out_dtype, copy=False))
    lse = problem.merge_heads(lse)
    return (out, lse) if return_lse else out


def precise_attention(q, k, v, *, mask=None, causal=False, scale=None, return_lse=False,
                      window=None, softcap=None, alibi_slopes=None, enable_gqa=False,
                      mask_mod=None):
    """Attention in more precision than float64: the truth the other kernels are measured against.

    Same semantics as :func:`naive_attention`; the scale is the float64 number the kernels use,
    so only the kernels' own rounding is measured. Computed in ``np.longdouble`` where that is
    wider than float64 (x86-64: 64-bit mantissa; aarch64 Linux: 113-bit), else with ``mpmath`` at
    40 significant digits, elementwise and slow: meant for small inputs. Returns float64 arrays
    from the mpmath path and longdouble arrays otherwise.
    """
    problem = _check_inputs(q, k, v, mask, causal, scale, window, softcap, alibi_slopes,
                            enable_gqa, mask_mod)
    if np.finfo(np.longdouble).nmant > np.finfo(np.float64).nmant:
        out, lse = _dense_attention(problem, np.dtype(np.longdouble))
    else:  # pragma: no cover - only where longdouble is float64 (macOS arm64, Windows)
        out, lse = _mpmath_attention(problem)
    out, lse = problem.merge_heads(out), problem.merge_heads(lse)
    return (out, lse) if return_lse else out


@np.errstate(invalid="ignore")  # see _IEEE_QUIET
def _dense_attention(problem, dtype):
    """The full score matrix in ``dtype``, then a max-subtracted softmax: naive and precise."""
    n_q, n_k = problem.n_q, problem.n_k
    s = _scores(problem, problem.q_tile(0, n_q, dtype), problem.k_tile(0, n_k, dtype),
                0, n_q, 0, n_k)
    allowed = _dense_allowed(problem)
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    s = np.broadcast_to(s, problem.batch + s.shape[-2:])  # v or mask may carry more batch dims
    m = s.max(axis=-1, initial=-np.inf)
    # Any finite reference point works for an empty row (all its scores are -inf); 0 avoids
    # the NaN of -inf - (-inf).
    p = np.exp(s - np.where(m == -np.inf, 0, m)[..., None])
    v = problem.v_tile(0, n_k, dtype)
    bad = problem.bad_values(0, n_k) if allowed is not None else None
    pv = p @ v if bad is None else _matmul_allowed(p, v, allowed=allowed, bad=bad)
    return _finalize(pv, p.sum(axis=-1), m)


def naive_attention_backward(q, k, v, dout, *, mask=None, causal=False, scale=None,
                             window=None, softcap=None, alibi_slopes=None, enable_gqa=False,
                             mask_mod=None):
    """The dense oracle of :func:`flash_attention_backward`: ``P`` whole, then the textbook chain.

    ``P = softmax(S)``, ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P ∘ (dP - rowsum(P ∘ dP))`` (the
    softmax Jacobian applied row by row), ``dQ = τ dS K``, ``dK = τ dSᵀ Q``; the same conventions,
    scale placement, broadcasting and gradient dtypes. It needs no ``out`` or ``lse``, and does
    not use the identity ``rowsum(P ∘ dP) = rowsum(dO ∘ O)`` the tiled kernel rests on.
    """
    problem = _check_inputs(q, k, v, mask, causal, scale, window, softcap, alibi_slopes,
                            enable_gqa, mask_mod)
    dout = _check_saved(problem, dout=dout)
    grads = _dense_backward(problem, dout, problem.acc)
    return problem.input_shapes(*(g.astype(x.dtype, copy=False)
                                  for g, x in zip(grads, (problem.q, problem.k, problem.v))))


def precise_attention_backward(q, k, v, dout, *, mask=None, causal=False, scale=None,
                               window=None, softcap=None, alibi_slopes=None, enable_gqa=False,
                               mask_mod=None):
    """:func:`naive_attention_backward` in ``np.longdouble``: the truth gradients are measured
    against (x86-64 and aarch64 Linux, where longdouble is wider than float64). Returns
    longdouble arrays."""
    problem = _check_inputs(q, k, v, mask, causal, scale, window, softcap, alibi_slopes,
                            enable_gqa, mask_mod)
    dout = _check_saved(problem, dout=dout)
    return problem.input_shapes(*_dense_backward(problem, dout, np.dtype(np.longdouble)))


@np.errstate(invalid="ignore")  # see _IEEE_QUIET
def _dense_backward(problem, dout, dtype):
    n_q, n_k = problem.n_q, problem.n_k
    q, k, v = problem.q_tile(0, n_q, dtype), problem.k_tile(0, n_k, dtype), problem.v_tile(0, n_k, dtype)
    dout = dout.astype(dtype)
    allowed = _dense_allowed(problem)
    s, slope = _scores(problem, q, k, 0, n_q, 0, n_k, grad=True)
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    m = s.max(axis=-1, initial=-np.inf)
    p = np.exp(s - np.where(m == -np.inf, 0, m)[..., None])
    l = p.sum(axis=-1)
    p /= np.where(l == 0, 1, l)[..., None]  # P = softmax(S); an empty row stays 0
    if allowed is not None:  # and a masked pair weighs exactly 0, in a NaN row too
        p = np.where(allowed, p, 0)
    dp = dout @ np.swapaxes(v, -1, -2)
    if allowed is not None:  # what a masked pair's dP holds must not reach rowsum(P ∘ dP)
        dp = np.where(allowed, dp, 0)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    if allowed is not None:
        ds = np.where(allowed, ds, 0)
    if slope is not None:  # the chain rule through softcap
        ds = ds * slope

    def matmul(a, b, allowed_for_a, name, x):
        bad = None if allowed is None else problem.nonfinite_rows(name, 0, x.shape[-2], x)
        return a @ b if bad is None else _matmul_allowed(a, b, allowed=allowed_for_a, bad=bad)

    allowed_t = None if allowed is None else np.swapaxes(allowed, -1, -2)
    dv = matmul(np.swapaxes(p, -1, -2), dout, allowed_t, "dout", dout)
    dq = matmul(ds, k, allowed, "k", problem.k) * dtype.type(problem.scale_q)
    dk = matmul(np.swapaxes(ds, -1, -2), q, allowed_t, "q", problem.q) * dtype.type(problem.scale_k)
    return tuple(_sum_to(g, x.shape[:-2] + g.shape[-2:])
                 for g, x in zip((dq, dk, dv), (problem.q, problem.k, problem.v)))


def _dense_allowed(problem):
    """The whole Nq × Nk matrix of allowed pairs, or None when every pair is allowed."""
    allowed = _allowed(problem, 0, problem.n_q, 0, problem.n_k)
    return np.zeros((problem.n_q, problem.n_k), bool) if allowed is False else allowed


def _mpmath_attention(problem):  # pragma: no cover - see precise_attention
    import mpmath

    mp = mpmath.mp.clone()
    mp.dps = 40
    batch, n_q, n_k = problem.batch, problem.n_q, problem.n_k
    if problem.softcap is not None or problem.alibi is not None:
        raise NotImplementedError("softcap and ALiBi need np.longdouble wider than float64")
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
# Combining partial results, and measuring memory and error
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
    out_a = _as_float_array("out_a", out_a, longdouble=True)
    out_b = _as_float_array("out_b", out_b, longdouble=True)
    lse_a, lse_b = np.asarray(lse_a), np.asarray(lse_b)
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.dtype.type not in _FLOAT_DTYPES + (np.longdouble,):
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
        if np.any(x == np.inf):
            raise ValueError(
                f"{name} is +inf in {np.count_nonzero(x == np.inf)} row(s). FlashAttention "
                f"writes +inf as the lse of a row with no allowed key (its out is 0); flash_lib "
                f"writes -inf, which is log(0), the lse such a row has. Convert before merging: "
                f"np.where({name} == np.inf, -np.inf, {name})"
            )
    work = np.result_type(lse_a.dtype, lse_b.dtype, out_a.dtype, out_b.dtype, np.float32)
    lse_a, lse_b = lse_a.astype(work), lse_b.astype(work)
    m = np.maximum(lse_a, lse_b)
    m_ref = np.where(m == -np.inf, 0, m)
    w_a, w_b = np.exp(lse_a - m_ref), np.exp(lse_b - m_ref)

    def weighted(w, out, lse):  # an empty part weighs 0, and 0 · NaN must not be NaN
        return np.where((lse == -np.inf)[..., None], 0, w[..., None] * out.astype(work))

    out, lse = _finalize(weighted(w_a, out_a, lse_a) + weighted(w_b, out_b, lse_b), w_a + w_b, m_ref)
    out_dtype = np.result_type(out_a.dtype, out_b.dtype)
    lse_dtype = np.result_type(lse_a.dtype, lse_b.dtype, np.float32)
    return out.astype(out_dtype, copy=False), lse.astype(lse_dtype, copy=False)


def measure_peak_bytes(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)``; return ``(result, peak_bytes)`` allocated during the call.

    Measured from outside by ``tracemalloc``, where NumPy reports its array buffers, so it is
    evidence about the kernel rather than the kernel's word about itself. ``peak_bytes`` counts
    from the traced total at the call, so it includes the returned arrays: subtract their
    ``nbytes`` to get the scratch memory. Allocations from all threads are counted.

    If the caller is tracing already, its own peak survives the call: tracemalloc can only
    reset the peak, not set it, so a peak above what this call reached is re-created afterwards
    by one short-lived allocation (it may come out a few hundred bytes higher than it was).
    """
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    _, callers_peak = tracemalloc.get_traced_memory()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        result = fn(*args, **kwargs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        if started:
            tracemalloc.stop()
        elif callers_peak > tracemalloc.get_traced_memory()[1]:
            np.empty(callers_peak - tracemalloc.get_traced_memory()[0], np.uint8)  # freed at once
    return result, peak - base


def rowwise_relative_error(out, ref):
    """Error of each row against a reference: ``max_c |out_ic - ref_ic| / max_c |ref_ic|``.

    The metric of this project's tests, chapters and benchmark: relative to the row's own scale,
    so that a row of small outputs is held to the same standard as a row of large ones.
    Entries where ``ref`` is not finite must match exactly (the same infinity, or NaN for NaN),
    so identical inf rows have error 0; the finite entries are measured against the largest
    finite ``|ref|`` of the row. A row whose finite reference is all zeros (a fully masked
    row) has error 0 only if ``out``'s row matches exactly, else inf. A non-finite ``out`` where
    ``ref`` is finite is inf. Computed in the wider of the two dtypes (``ref`` may be
    longdouble). Returns an array of shape ``out.shape[:-1]``.
    """
    wide = np.result_type(out, ref, np.float64)
    out, ref = np.asarray(out, wide), np.asarray(ref, wide)
    if out.ndim == 0 or ref.ndim == 0:
        raise ValueError(
            f"out and ref must have at least 1 dimension (..., features), got shapes "
            f"{out.shape} and {ref.shape}"
        )
    if out.shape != ref.shape:
        raise ValueError(f"out and ref must have the same shape, got {out.shape} and {ref.shape}")
    if out.shape[-1] == 0:
        return np.zeros(out.shape[:-1])
    finite = np.isfinite(ref)
    same = (out == ref) | (np.isnan(out) & np.isnan(ref))
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(same, 0, np.where(finite & np.isfinite(out), np.abs(out - ref), np.inf))
    size = np.where(finite, np.abs(ref), 0).max(axis=-1)
    worst = diff.max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        err = np.where(size == 0, np.where(worst == 0, 0, np.inf), worst / np.where(size == 0, 1, size))
    return err


# --------------------------------------------------------------------------------------------
# Input checking, shared by every kernel so that they accept and reject exactly the same inputs
# --------------------------------------------------------------------------------------------

_FLOAT_DTYPES = (np.float16, np.float32, np.float64)
_FLOAT_NAMES = "float16, bfloat16, float32 or float64"


@dataclass(frozen=True)
class _Problem:
    """Validated inputs (``q``, ``k``, ``v``, ``mask`` unbroadcast) and what the kernels derive.

    With ``enable_gqa`` the head axis of ``q`` (and of the mask, the ALiBi slopes, mask_mod's
    result) is split into (Hkv, groups) and ``k``, ``v`` get a groups axis of 1, so that NumPy's
    broadcasting pairs each query head with its kv head; ``merge_heads`` and ``input_shapes``
    undo the split on the results.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None
    band: _Band  # causal and window
    scale: float
    scale_q: float  # r·2^a, see the module docstring
    scale_k: float  # 2^b
    softcap: float | None
    alibi: np.ndarray | None  # the slopes, shaped (..., 1, 1) to broadcast against a tile
    mask_mod: object  # callable or None
    batch: tuple
    out_dtype: np.dtype
    acc: np.dtype  # the compute dtype
    groups: int | None = None  # with enable_gqa: query heads per kv head
    shapes: tuple = ()  # the caller's q, k, v shapes
    user_batch: tuple = ()  # the broadcast batch as the caller sees it (Hq heads)

    @property
    def n_q(self):
        return self.q.shape[-2]

    @property
    def n_k(self):
        return self.k.shape[-2]

    @property
    def dv(self):
        return self.v.shape[-1]

    def q_tile(self, start, stop, dtype=None):
        dtype = self.acc if dtype is None else dtype
        return np.multiply(self.q[..., start:stop, :], dtype.type(self.scale_q), dtype=dtype)

    def k_tile(self, start, stop, dtype=None):
        dtype = self.acc if dtype is None else dtype
        k = self.k[..., start:stop, :]
        if self.scale_k == 1:
            return k.astype(dtype, copy=False)
        return np.multiply(k, dtype.type(self.scale_k), dtype=dtype)

    def v_tile(self, start, stop, dtype=None):
        return self.v[..., start:stop, :].astype(self.acc if dtype is None else dtype, copy=False)

    def mask_mod_tile(self, q_start, q_stop, k_start, k_stop):
        """``mask_mod`` on one tile, checked, with its head axis split for grouped queries."""
        allowed = _call_mask_mod(self.mask_mod, q_start, q_stop, k_start, k_stop)
        expected = self.user_batch + (q_stop - q_start, k_stop - k_start)
        if not _broadcasts_to(allowed.shape, expected):
            raise ValueError(
                f"mask_mod returned an array of shape {allowed.shape}, which does not broadcast "
                f"to (..., tile_q, tile_k) = {expected}"
            )
        return _split_heads(allowed, -3, self.groups) if self.groups else allowed

    def merge_heads(self, x):
        """A result with the grouped-query split (…, Hkv, groups, Nq, …) back to (…, Hq, Nq, …)."""
        if not self.groups or x is None:
            return x
        lead = len(self.batch) - 2
        return x.reshape(x.shape[:lead] + (-1,) + x.shape[lead + 2:])

    def input_shapes(self, dq, dk, dv):
        """Gradients in the caller's shapes of q, k, v (undoing the grouped-query split)."""
        return tuple(g.reshape(shape) for g, shape in zip((dq, dk, dv), self.shapes))

    @functools.cached_property
    def _nonfinite(self):
        return {}  # name -> sorted row indices, filled on first use (once per call)

    def nonfinite_rows(self, name, start, stop, x=None):
        """Positions, within rows ``start:stop`` of ``q``, ``k``, ``v`` (or ``x``, under
        ``name``), of the rows holding an inf or NaN; or None when there are none."""
        if name not in self._nonfinite:
            self._nonfinite[name] = _nonfinite_rows(getattr(self, name) if x is None else x)
        rows = self._nonfinite[name]
        lo, hi = np.searchsorted(rows, (start, stop))
        return rows[lo:hi] - start if hi > lo else None

    def bad_values(self, k_start, k_stop):
        """Positions, within keys ``k_start:k_stop``, of values holding inf or NaN; or None."""
        return self.nonfinite_rows("v", k_start, k_stop)


def _nonfinite_rows(x):
    """Sorted indices (axis -2) of the rows of ``x`` holding an inf or NaN in any batch entry.

    A chunk of rows at a time, so that finding them needs no scratch proportional to N.
    """
    batch_axes = tuple(range(x.ndim - 2))
    found = [
        start + np.flatnonzero(~np.isfinite(chunk).all(axis=-1).all(axis=batch_axes))
        for start in range(0, x.shape[-2], 1024)
        for chunk in [x[..., start : start + 1024, :]]
    ]
    return np.concatenate(found) if found else np.zeros(0, dtype=np.intp)


def _check_saved(problem, out=None, lse=None, dout=None):
    """The forward's ``out`` and ``lse`` and the incoming ``dout``, checked against q, k, v."""
    shapes = {"out": problem.user_batch + (problem.n_q, problem.dv),
              "lse": problem.user_batch + (problem.n_q,)}
    shapes["dout"] = shapes["out"]
    checked = []
    for name, x in (("out", out), ("lse", lse), ("dout", dout)):
        if x is None:
            continue
        x = np.asarray(x)
        if not (x.dtype.type in _FLOAT_DTYPES or x.dtype == _BFLOAT16):
            raise TypeError(f"{name} must be a {_FLOAT_NAMES} array, got dtype {x.dtype}")
        if x.shape != shapes[name]:
            raise ValueError(
                f"{name} must have shape {shapes[name]}, what the forward returns for these q, k, v "
                f"(and mask), got {x.shape}"
            )
        if problem.groups:
            x = _split_heads(x, -2 if name == "lse" else -3, problem.groups)
        checked.append(x)
    return checked[0] if len(checked) == 1 else tuple(checked)


def _as_float_array(name, x, longdouble=False):
    x = np.asarray(x)
    ok = x.dtype.type in _FLOAT_DTYPES or x.dtype == _BFLOAT16
    if not ok and not (longdouble and x.dtype == np.longdouble):
        raise TypeError(f"{name} must be a {_FLOAT_NAMES} array, got dtype {x.dtype}")
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


def _bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def _result_dtype(*dtypes):
    """The output dtype: NumPy's promotion, with float16 and bfloat16 (no common type) → float32."""
    half = {np.dtype(np.float16), _BFLOAT16}
    if len(set(dtypes)) > 1 and set(dtypes) <= half:
        return np.dtype(np.float32)
    rest = [d for d in dtypes if d != _BFLOAT16] or [_BFLOAT16]
    return np.result_type(*rest)


def _checked_scale(scale, d, acc):
    """``scale`` as a float64, refused unless it is a normal number of the compute dtype."""
    if scale is None:
        return 1.0 / math.sqrt(d) if d > 0 else 1.0
    if (
        isinstance(scale, bool)
        or not isinstance(scale, numbers.Real)
        or scale != scale  # NaN
        or scale <= 0
        or (not isinstance(scale, numbers.Integral) and np.isinf(scale))
    ):
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    with np.errstate(over="ignore", under="ignore"):  # a longdouble beyond float64's range
        try:
            as_float = float(scale)
        except OverflowError:  # an int such as 10**400
            as_float = math.inf
    info = np.finfo(acc)
    if not float(info.tiny) <= as_float <= float(info.max):
        raise ValueError(
            f"scale = {scale!r} is outside the normal range of the compute dtype {acc} "
            f"[{float(info.tiny):.4g}, {float(info.max):.4g}]: in {acc} it "
            f"{'overflows' if as_float > 1 else 'vanishes'}"
        )
    return as_float


def _split_scale(scale):
    """τ = r·2^e (0.5 <= r < 1) → (r·2^a, 2^b) with a + b = e, b = trunc(e/2)."""
    r, e = math.frexp(scale)
    b = int(e / 2)
    return math.ldexp(r, e - b), math.ldexp(1.0, b)


def _check_inputs(q, k, v, mask, causal, scale, window=None, softcap=None, alibi_slopes=None,
                  enable_gqa=False, mask_mod=None):
    """Validate and normalise the arguments of every kernel; return a :class:`_Problem`."""
    q = _as_float_array("q", q)
    k = _as_float_array("k", k)
    v = _as_float_array("v", v)
    shapes = (q.shape, k.shape, v.shape)
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
    groups = None
    if _bool("enable_gqa", enable_gqa):
        groups = _gqa_groups(q, k, v)
        hkv = k.shape[-3]
        q = q.reshape(q.shape[:-3] + (hkv, groups) + q.shape[-2:])
        k, v = k[..., None, :, :], v[..., None, :, :]
    try:
        batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ValueError(
            f"the leading (batch) dimensions of q, k and v must broadcast together, got "
            f"q.shape={shapes[0]}, k.shape={shapes[1]}, v.shape={shapes[2]}"
        ) from None
    # the batch as the caller sees it: with grouped queries, Hq heads rather than (Hkv, groups)
    user_batch = batch[:-2] + (batch[-2] * batch[-1],) if groups else batch
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_:
            raise TypeError(
                f"mask must be a boolean array (True = may attend), got dtype {mask.dtype}"
            )
        try:
            full = np.broadcast_shapes(mask.shape, user_batch + (n_q, n_k))
        except ValueError:
            full = None
        if full is None or full[-2:] != (n_q, n_k):
            raise ValueError(
                f"mask of shape {mask.shape} does not broadcast to (..., Nq, Nk) = "
                f"{user_batch + (n_q, n_k)}"
            )
        user_batch = full[:-2]
        if groups:
            mask = _split_heads(mask, -3, groups)
        batch = np.broadcast_shapes(batch, mask.shape[:-2])
    band = _Band.of(n_q, n_k, _bool("causal", causal), _checked_window(window))
    out_dtype = _result_dtype(q.dtype, k.dtype, v.dtype)
    # float16 has 11 bits of mantissa and overflows at 65504, bfloat16 has 8 bits: sums and
    # products run in float32.
    acc = np.dtype(np.float32) if out_dtype in (np.float16, _BFLOAT16) else out_dtype
    scale = _checked_scale(scale, d, acc)
    scale_q, scale_k = _split_scale(scale)
    softcap = _checked_softcap(softcap)
    alibi = _checked_alibi(alibi_slopes, user_batch, groups)
    mask_mod = _checked_mask_mod(mask_mod)
    return _Problem(q, k, v, mask, band, scale, scale_q, scale_k, softcap, alibi, mask_mod,
                    batch, out_dtype, acc, groups, shapes, user_batch)


def _gqa_groups(q, k, v):
    """Query heads per kv head, checked: axis -3 holds the heads, Hkv divides Hq."""
    if min(q.ndim, k.ndim, v.ndim) < 3:
        raise ValueError(
            f"enable_gqa needs a head axis (-3) in q, k and v, got q.shape={q.shape}, "
            f"k.shape={k.shape}, v.shape={v.shape}"
        )
    h_q, h_kv = q.shape[-3], k.shape[-3]
    if v.shape[-3] != h_kv or h_kv == 0 or h_q % h_kv:
        raise ValueError(
            f"enable_gqa needs k and v with the same number of heads Hkv (axis -3) dividing "
            f"q's Hq, got q.shape={q.shape}, k.shape={k.shape}, v.shape={v.shape}"
        )
    return h_q // h_kv


def _split_heads(x, axis, groups):
    """Split the head axis ``axis`` of an array aligned with q's leading dims into
    (Hkv, groups); a head axis of 1, or none, stays broadcastable."""
    if x.ndim < -axis:
        return x
    axis = x.ndim + axis
    heads = x.shape[axis]
    split = (heads // groups, groups) if heads != 1 else (1, 1)
    return x.reshape(x.shape[:axis] + split + x.shape[axis + 1:])


def _checked_window(window):
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(
            f"window must be None or a pair (left, right) of non-negative integers or None, "
            f"got {window!r}"
        )
    for side, value in zip(("left", "right"), window):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                                  or value < 0):
            raise ValueError(
                f"window's {side} must be a non-negative integer or None (unbounded), got "
                f"{value!r} in window={window!r}"
            )
    return tuple(None if value is None else int(value) for value in window)


def _checked_softcap(softcap):
    if softcap is None:
        return None
    if (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
            or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(
            f"softcap must be a finite positive number (None turns it off), got {softcap!r}"
        )
    return float(softcap)


def _broadcasts_to(shape, target):
    """Whether an array of ``shape`` broadcasts to exactly ``target`` (not to something larger)."""
    try:
        return np.broadcast_shapes(shape, target) == target
    except ValueError:
        return False


def _checked_alibi(slopes, batch, groups):
    if slopes is None:
        return None
    slopes = np.asarray(slopes)
    if slopes.dtype.kind not in "fiu":
        raise TypeError(f"alibi_slopes must be an array of real numbers, got dtype {slopes.dtype}")
    if not _broadcasts_to(slopes.shape, batch):
        raise ValueError(
            f"alibi_slopes of shape {slopes.shape} does not broadcast to the leading (batch, "
            f"head) dims {batch}: give one slope per head, e.g. shape (H,) or (B, H)"
        )
    slopes = slopes.astype(np.float64)
    if not np.isfinite(slopes).all():
        raise ValueError(f"alibi_slopes must be finite, got {slopes}")
    slopes = slopes[..., None, None]  # broadcasts against a tile's (rows, keys)
    return _split_heads(slopes, -3, groups) if groups else slopes


def _checked_mask_mod(mask_mod):
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(f"mask_mod must be a callable mask_mod(q_idx, k_idx) or None, got "
                        f"{mask_mod!r}")
    return mask_mod


def _call_mask_mod(mask_mod, q_start, q_stop, k_start, k_stop):
    """``mask_mod(q_idx, k_idx)`` on one tile's global positions, checked to be boolean."""
    q_idx = np.arange(q_start, q_stop)[:, None]
    k_idx = np.arange(k_start, k_stop)[None, :]
    allowed = np.asarray(mask_mod(q_idx, k_idx))
    if allowed.dtype != np.bool_:
        raise TypeError(
            f"mask_mod must return a boolean array (True = may attend), got dtype "
            f"{allowed.dtype}"
        )
    tile = (q_stop - q_start, k_stop - k_start)
    if not _broadcasts_to(allowed.shape[-2:], tile):
        raise ValueError(
            f"mask_mod returned an array of shape {allowed.shape}, which does not broadcast "
            f"to (..., tile_q, tile_k) = (..., {tile[0]}, {tile[1]})"
        )
    return allowed


# --------------------------------------------------------------------------------------------
# Threads and BLAS
# --------------------------------------------------------------------------------------------


def _threads_from_environment():
    raw = os.environ.get("FLASH_LIB_THREADS")
    if raw is None:
        return min(os.cpu_count() or 1, 4)
    try:
        threads = int(raw)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(f"FLASH_LIB_THREADS must be a positive integer, got {raw!r}")
    return threads


# Query blocks are independent, so they run on a small thread pool: NumPy releases the GIL in
# matmul, exp and the reductions, which the single-threaded elementwise passes need to use all
# cores. FLASH_LIB_THREADS=1 turns it off.
_THREADS = _threads_from_environment()
_PARALLEL_MIN_SCORES = 1 << 20
# One kernel call at a time holds BLAS at one thread (see _one_blas_thread).
_KERNEL_LOCK = threading.Lock()
# True inside a kernel call (and its workers): a nested call runs inline, under the outer's lock.
_IN_KERNEL = contextvars.ContextVar("flash_lib_in_kernel", default=False)
# Found once at import (NumPy's BLAS is loaded by then); setting a count then costs ~1 µs.
_BLAS_LIBS = ThreadpoolController().select(user_api="blas").lib_controllers


def _run_blocks(work_on, blocks, workers):
    """Call ``work_on(block, cancelled)`` for every block, on ``workers`` threads, BLAS at one.

    Workers take the next block from one shared iterator, so the bookkeeping is O(workers)
    whatever the number of blocks. Each worker runs in a copy of the caller's context, so
    ``np.errstate`` (a context variable) holds inside the workers as it does for the caller.
    If a worker raises, or the caller is interrupted (Ctrl-C), ``cancelled`` is set: every worker
    stops before its next tile, and the exception reaches the caller once they have.
    """
    cancelled = threading.Event()
    if _IN_KERNEL.get():
        for block in blocks:
            work_on(block, cancelled)
        return
    with _KERNEL_LOCK, _one_blas_thread():
        token = _IN_KERNEL.set(True)
        try:
            if workers == 1:
                for block in blocks:
                    work_on(block, cancelled)
                return
            blocks, take = iter(blocks), threading.Lock()

            def work():
                _one_blas_thread_here()
                while not cancelled.is_set():
                    with take:
                        block = next(blocks, None)
                    if block is None:
                        return
                    work_on(block, cancelled)

            pool = ThreadPoolExecutor(workers, thread_name_prefix="flash_lib")
            try:
                futures = [pool.submit(contextvars.copy_context().run, work) for _ in range(workers)]
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)  # Ctrl-C interrupts this
                for future in done:
                    future.result()
            finally:
                cancelled.set()
                pool.shutdown(wait=True)
        finally:
            _IN_KERNEL.reset(token)


@contextlib.contextmanager
def _one_blas_thread():
    """Hold each BLAS library at one thread during a kernel call, then restore what was there.

    How many threads a BLAS uses changes how it splits a matmul, and so the rounding (measured
    with NumPy's OpenBLAS: a 512 × 64 × 512 float32 product differs in 37% of rows between 1
    and 2 threads), and the kernel's own threads already use the cores. NumPy's OpenBLAS keeps
    the count in one process-wide variable. threadpoolctl (>= 3.8) lets only one "controlling"
    Python thread change it and silently ignores the others, which would leave a call from any
    other thread at the caller's count, so OpenBLAS's own setter is called instead. What is put
    back is what was found, unless another thread changed it during the call: theirs stands.
    """
    found = [(lib, lib.get_num_threads()) for lib in _BLAS_LIBS]
    for lib, _ in found:
        _set_blas_threads(lib, 1)
    try:
        yield
    finally:
        for lib, threads in found:
            if threads is not None and lib.get_num_threads() == 1:
                _set_blas_threads(lib, threads)


def _one_blas_thread_here():
    """A BLAS threaded by OpenMP keeps its count per thread: each worker sets its own."""
    for lib in _BLAS_LIBS:
        if lib.threading_layer == "openmp":
            lib.set_num_threads(1)


def _set_blas_threads(lib, threads):
    if lib.internal_api == "openblas" and lib.threading_layer != "openmp":
        _openblas_setter(lib)(threads)
    else:
        lib.set_num_threads(threads)


@functools.cache
def _openblas_setter(lib):
    """``openblas_set_num_threads`` of this OpenBLAS, under whichever affixes its build uses."""
    for prefix, suffix in itertools.product(("", "scipy_"), ("", "64_", "_64")):
        name = f"{prefix}openblas_set_num_threads{suffix}"
        if hasattr(lib.dynlib, name) and hasattr(lib.dynlib, name.replace("set", "get")):
            return getattr(lib.dynlib, name)
    return lib.set_num_threads  # pragma: no cover - an OpenBLAS without the setter

"""One tile of flash_lib's kernels, and what it needs besides the algorithm box: which pairs it
allows (causal, window, the mask, ``mask_mod``), the score variants (softcap, ALiBi), the product
that keeps masked inf and NaN out, and the dropout keep mask.

The kernels in ``flash_lib.py`` read as the algorithm box because everything here is behind one
object per tile, :class:`Tile`, which the checked problem (``_flash_inputs.Problem``) hands out
along a kernel's walk: :meth:`Problem.row` for the forward's query block, :meth:`Problem.column`
for the backward's key block.

Private to flash_lib: imported by ``_flash_inputs.py``, ``flash_reference.py`` and
``flash_lib.py`` only. It imports nothing of theirs: a problem is passed in and read.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

import _flash_dropout as dropout
import _flash_masked as masked


@dataclass(frozen=True)
class Band:
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
        return Band(n_q, n_k, left, right)

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


def blocks(n, size):
    """``(start, stop)`` of the blocks of ``size`` along ``n`` (the last one partial), generated:
    the kernels walk them without listing them (a list is O(N / block) memory)."""
    for start in range(0, n, size):
        yield start, min(start + size, n)


def allowed_pairs(problem, q_start, q_stop, k_start, k_stop):
    """A tile's allowed pairs: a boolean array ``(..., rows, keys)``, None when every pair is
    allowed, or False when ``mask_mod`` allows none (the kernels then skip the tile)."""
    pairs = problem.band.tile(q_start, q_stop, k_start, k_stop)
    if problem.mask_mod is not None:
        mod = problem.mask_mod_tile(q_start, q_stop, k_start, k_stop)
        if not mod.any():
            return False
        pairs = mod if pairs is None else pairs & mod
    if problem.mask is not None:
        mask = problem.mask
        tile = np.broadcast_to(mask, mask.shape[:-2] + (problem.n_q, problem.n_k))[
            ..., q_start:q_stop, k_start:k_stop
        ]
        pairs = tile if pairs is None else pairs & tile
    return pairs


def tile_scores(problem, q, k, q_start, q_stop, k_start, k_stop, out=None, grad=False):
    """``S = (τ_q q)(τ_k k)ᵀ`` for one tile, then the score variants: softcap, then ALiBi.

    ``q``, ``k``: the tile's scaled queries and keys. With ``grad=True`` also returns
    ``dS_capped / dS = 1 - tanh²(S / softcap)`` (None without softcap), which the backward needs.
    """
    if out is None:  # the whole batch, as the forward's buffer: v, mask may add batch dims
        out = np.empty(problem.batch + (q_stop - q_start, k_stop - k_start), np.result_type(q, k))
    # with softcap a product beyond the dtype is ±inf, then capped to ±softcap below (without it
    # the problem's check refused such q, k and scale before any tile)
    with np.errstate(over="ignore" if problem.softcap is not None else None):
        s = np.matmul(q, np.swapaxes(k, -1, -2), out=out)
    slope = None
    if problem.softcap is not None:
        cap = s.dtype.type(problem.softcap)
        with np.errstate(over="ignore"):  # |s / c| beyond the dtype is ±inf, and tanh(±inf) = ±1
            t = np.tanh(np.divide(s, cap, out=s), out=s)  # t = tanh(s / c)
        slope = 1 - t * t if grad else None
        np.multiply(t, cap, out=s)  # s ← c·tanh(s / c)
    if problem.alibi is not None:
        i = np.arange(q_start, q_stop)[:, None] + (problem.n_k - problem.n_q)
        distance = np.abs(i - np.arange(k_start, k_stop)[None, :]).astype(s.dtype)
        s -= problem.alibi.astype(s.dtype) * distance  # -slope·|i + (Nk - Nq) - j|
    return (s, slope) if grad else s


class Tile:
    """Tile ``(Q_i, K_j)`` of one kernel call: its pairs, its scores, its products, its keep mask.

    ``allowed`` (computed when first read, after the kernel's check for cancellation): None
    (every pair allowed), a boolean array ``(..., rows, keys)``, or False (nothing allowed: the
    band leaves the tile out, ``visits`` False, or ``mask_mod`` allows none; the kernel skips
    it). ``keep``: the dropout keep mask ``Z_ij``, drawn by ``keep_walk`` when first read (None
    without dropout).
    """

    def __init__(self, problem, q_start, q_stop, k_start, k_stop, keep_walk=None, visits=True):
        self.problem, self.keep_walk, self.visits = problem, keep_walk, visits
        self.q_start, self.q_stop, self.k_start, self.k_stop = q_start, q_stop, k_start, k_stop

    @functools.cached_property
    def allowed(self):
        if not self.visits:
            return False
        return allowed_pairs(self.problem, self.q_start, self.q_stop, self.k_start, self.k_stop)

    @functools.cached_property
    def keep(self):
        if self.keep_walk is None or self.allowed is False:
            return None
        return self.keep_walk((self.q_start, self.q_stop, self.k_start, self.k_stop))

    @property
    def v(self):
        """``V_j``, in the compute dtype."""
        return self.problem.v_tile(self.k_start, self.k_stop)

    def scores(self, q, out=None):
        """``S_ij = τ Q_i K_jᵀ`` with softcap and ALiBi; ``q`` is ``τ_q Q_i``;
        into ``out``, a buffer of the block's rows and at least the tile's keys."""
        k = self.problem.k_tile(self.k_start, self.k_stop)
        return self.scores_of(q, k, out=out)

    def scores_of(self, q, k, out=None, grad=False):
        """:meth:`scores` given the tile's keys ``k`` (``τ_k K_j``) already scaled; with
        ``grad=True`` also softcap's slope (:func:`tile_scores`)."""
        if out is not None:
            out = out[..., : self.k_stop - self.k_start]
        return tile_scores(self.problem, q, k, self.q_start, self.q_stop, self.k_start,
                           self.k_stop, out=out, grad=grad)

    def mask(self, s):
        """``-inf`` into ``s`` where the tile's pairs are not allowed."""
        if self.allowed is not None:
            np.copyto(s, -np.inf, where=~self.allowed)

    def pv(self, out):
        """The forward's ``matmul(p, v)``: ``p @ v`` into ``out``; over the allowed pairs only
        when ``V_j`` holds inf or NaN and some pair is masked (``_flash_masked``); and with
        dropout, of ``p ∘ Z_ij``, after :func:`flash_lib.online_softmax_update` has added the
        undropped ``p`` to ``l`` (so that ``l`` and the lse are the softmax's own)."""
        bad = (self.problem.bad_values(self.k_start, self.k_stop)
               if self.allowed is not None else None)
        keep = self.keep

        def matmul(p, v):
            if keep is not None:
                p = np.multiply(p, keep, out=p)  # p̃_ij = p_ij · Z_ij, in place
            if bad is None:
                return np.matmul(p, v, out=out)
            return masked.matmul_allowed(p, v, allowed=self.allowed, bad=bad, out=out)
        return matmul

    def backward_matmul(self, dout, products):
        """The backward's ``matmul(a, b, which)``: ``a @ b`` into ``products[which]`` (cut to the
        tile's rows), or over the allowed pairs only where operand ``which`` holds inf or NaN."""
        allowed_only = masked.backward_matmul(self.problem, self.allowed, dout, self.q_start,
                                              self.q_stop, self.k_start, self.k_stop)
        if allowed_only is not None:
            return allowed_only

        def into_buffers(a, b, which):
            return np.matmul(a, b, out=products[which][..., : a.shape[-2], :])
        return into_buffers

    def dropout(self):
        """``(Z_ij, 1 / (1 - p))`` for the backward, the forward's keep mask drawn again; or None."""
        if self.keep is None:
            return None
        return self.keep, self.problem.dropout_scale(self.problem.dtype)


class KeepWalk:
    """A worker's dropout keep masks along its walk: ``walk(tile)`` is that tile's
    ``Problem.keep_tile``. Up to ``per_draw`` consecutive tiles of the walk that make one rectangle
    (the same rows and adjoining keys, or the same keys and adjoining rows) are drawn in one call
    (``_flash_dropout``: why). The last draw is kept and the tiles inside it sliced out; the walk
    is read one tile ahead at most, so that it costs O(1) memory however long it is."""

    def __init__(self, problem, tiles, per_draw):
        self.problem, self.tiles, self.per_draw = problem, iter(tiles), per_draw
        self.ahead = None  # a tile read from the walk that the last draw did not cover
        self.drawn = None  # (q_start, q_stop, k_start, k_stop), mask

    def __call__(self, tile):
        q_start, q_stop, k_start, k_stop = tile
        if self.drawn is not None:
            (i0, i1, j0, j1), mask = self.drawn
            if i0 <= q_start and q_stop <= i1 and j0 <= k_start and k_stop <= j1:
                return mask[..., q_start - i0 : q_stop - i0, k_start - j0 : k_stop - j0]
        while self._next() != tile:  # tiles the kernel skipped (mask_mod allowed none there)
            pass
        span = tile
        for _ in range(self.per_draw - 1):
            after = next(self.tiles, None)
            joined = None if after is None else _joined(span, after)
            if joined is None:
                self.ahead = after
                break
            span = joined
        # one buffer per worker thread for every draw: the last draw's tiles are done with
        (i0, i1, j0, j1), scratch = span, self.problem.dropout_scratch
        size = math.prod(self.problem.batch) * (i1 - i0) * (j1 - j0)
        if getattr(scratch, "mask", None) is None or scratch.mask.size < size:
            scratch.mask = np.empty(size, bool)
        mask = self.problem.keep_tile(*span, out=scratch.mask[:size])
        self.drawn = span, mask
        return mask[..., : q_stop - q_start, : k_stop - k_start]

    def _next(self):
        tile, self.ahead = self.ahead, None
        return next(self.tiles) if tile is None else tile


def _joined(span, tile):
    """The rectangle ``span`` and ``tile`` make together, or None when they make none."""
    (i0, i1, j0, j1), (q_start, q_stop, k_start, k_stop) = span, tile
    if (i0, i1) == (q_start, q_stop) and j1 == k_start:
        return i0, i1, j0, k_stop
    if (j0, j1) == (k_start, k_stop) and i1 == q_start:
        return i0, q_stop, j0, j1
    return None


def tiles_per_draw(problem):
    """How many tiles a keep walk draws at once: ``mask_mod`` may skip any tile, so then one."""
    return 1 if problem.mask_mod is not None else dropout.TILES_PER_DRAW


def masked_pairs_zero(ds, pairs):
    """The one rule for masked pairs in every backward (flash's tiles, naive's and precise's
    dense chain): their ``dS`` is exactly 0, set last, after every factor of the chain rule
    (``dP - D``, softcap's ``1 - tanh²``), whatever inf or NaN those factors held there."""
    if pairs is not None:
        np.copyto(ds, 0, where=~pairs)


def sum_to(x, shape):
    """Sum ``x`` over the dims along which an array of ``shape`` was broadcast to ``x.shape``:
    the gradient of an input that was broadcast (a ``k`` shared by every head gets the sum of
    the heads' gradients, as autograd gives it). ``shape`` may have fewer dims than ``x``."""
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and x.shape[lead + i] != 1
    )
    return x.sum(axis=axes).reshape(shape) if axes else x

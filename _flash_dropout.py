"""flash_lib's dropout mask: Philox4x32-10, vectorised in NumPy, keyed by each element's position.

A dropout mask drawn from a stateful generator depends on the order in which tiles draw from it:
another block size, another thread count or the backward's other loop order would give another
mask. A counter-based generator is a pure function ``bits = philox(counter, key)`` instead, so
each element's keep bit is a function of its own coordinates and the seed, computed wherever and
whenever the element is: the forward's tile and the backward's tile of the same pair agree, and
no mask is ever stored.

Philox4x32-10 (Salmon, Moraes, Dror, Shaw 2011, "Parallel random numbers: as easy as 1, 2, 3";
Random123's ``philox4x32``, curand's ``Philox4_32_10``, Triton's ``tl.randint4x``, the generator
FlashAttention draws its dropout mask from): a 128-bit counter ``(c0, c1, c2, c3)`` and a 64-bit
key ``(k0, k1)``, ten rounds of::

    p0 = c0 · 0xD2511F53,  p1 = c2 · 0xCD9E8D57                  (32 × 32 → 64-bit products)
    (c0, c1, c2, c3) ← (hi(p1) ^ c1 ^ k0, lo(p1), hi(p0) ^ c3 ^ k1, lo(p0))
    (k0, k1) ← (k0 + 0x9E3779B9, k1 + 0xBB67AE85) mod 2³²         (between rounds)

give four 32-bit words. flash_lib's element ``(b, i, j)`` (``b`` the flat batch index, ``i``, ``j``
the global query and key positions) uses counter ``(j // 4, i, b mod 2³², b // 2³²)`` and key
``(seed mod 2³², seed // 2³²)``, and takes word ``j % 4``: no two elements share a counter word,
so the bits are independent across rows (one stream per row started at ``[row, 0, 0, 0]`` would
overlap its neighbour's). It is kept iff ``word >= t``, ``t = round(p · 2³²)``: probability
exactly ``1 - t / 2³²``, within ``2⁻³³`` of ``1 - p``.

Why not NumPy's own ``np.random.Philox``: it is Philox4x64 (not the generator GPU kernels use)
and serial, one stream per call: one 512 × 512 tile took 2.0 ms of ``random_raw`` plus a Python
call per row here. This one computes ``CHUNK`` counters at once with uint64 products, in place in
preallocated buffers (NumPy has no 32 × 32 → 64-bit multiply-high, so a word lives in a uint64).
One 512 × 512 tile (65536 counters, about 90 array passes each) took 1.4-1.6 ms on one AMD EPYC
Zen 4 core (2026-12-01, a loaded machine), the same at 16384 or 32768 counters a pass and slower
at 4096 (per-call overhead) or 65536 (out of the L2 cache).

Private to flash_lib: imported by ``flash_lib.py`` and ``_flash_inputs.py`` only (and by
``tests/test_training.py``, which checks :func:`philox4x32` against Random123's known answers).
"""

from __future__ import annotations

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57  # the round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # the key's Weyl increments: the golden ratio and sqrt(3) - 1
LO = 0xFFFFFFFF
ROUNDS = 10
#: Counters computed per pass: their six uint64 buffers (768 KiB) fit a Zen 4 core's 1 MiB L2, and
#: the ~90 NumPy calls per pass are long enough that their overhead is small (module docstring).
CHUNK = 1 << 14


def threshold(p):
    """``t = round(p · 2³²)``: an element is kept iff its 32-bit word is ``>= t``."""
    return round(p * 2**32)


def philox4x32(counter, key):
    """Philox4x32-10 of one or many counters: ``counter`` four arrays (or ints) below 2³² that
    broadcast together, ``key`` two ints below 2³²; returns the four output words as uint64
    arrays. The plain form of the rounds (what :func:`keep` computes in place)."""
    c = tuple(np.asarray(x, np.uint64) for x in counter)
    for r in range(ROUNDS):
        c = _round(c, *_round_key(key, r))
    return c


def _round_key(key, r):
    """The key of round ``r`` (from 0): bumped by the Weyl increments r times, mod 2³²."""
    return (key[0] + r * W0) & LO, (key[1] + r * W1) & LO


def _round(c, k0, k1):
    """One round on uint64 arrays holding 32-bit words (any shapes that broadcast together)."""
    c0, c1, c2, c3 = c
    p0, p1 = c0 * np.uint64(M0), c2 * np.uint64(M1)  # < 2⁶⁴: exact
    return ((p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0), p1 & np.uint64(LO),
            (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1), p0 & np.uint64(LO))


def keep(seed, t, n_batch, rows, keys, scratch=None):
    """The keep mask of a block: bool ``(n_batch, rows[1] - rows[0], keys[1] - keys[0])``.

    ``seed`` an int in [0, 2⁶⁴); ``t`` from :func:`threshold`; ``rows``, ``keys``: ``(start, stop)``
    global positions (the caller's offset added). Lines (one batch entry, one row) are taken
    ``CHUNK`` counters at a time, whatever the block's shape. ``scratch``: an object (one per
    thread, e.g. a ``threading.local``) to keep the buffers in from one call to the next.
    """
    (i0, i1), (j0, j1) = rows, keys
    n_rows, n_keys = i1 - i0, j1 - j0
    out = np.empty((n_batch, n_rows, n_keys), bool)
    if out.size == 0:
        return out
    first = j0 // 4
    n_ctr = (j1 - 1) // 4 - first + 1  # counters per line: each gives 4 consecutive keys
    lines = max(1, CHUNK // n_ctr)
    flat = out.reshape(n_batch * n_rows, n_keys)
    ctr0 = np.arange(first, first + n_ctr, dtype=np.uint64)[None, :]
    buffers, words = _scratch(scratch, lines, n_ctr)
    for start in range(0, n_batch * n_rows, lines):
        line = np.arange(start, min(start + lines, n_batch * n_rows), dtype=np.uint64)[:, None]
        b, row = np.divmod(line, np.uint64(n_rows))
        c = [x[: len(line)] for x in buffers]
        hi = b >> np.uint64(32)  # one number unless the chunk crosses b = 2³² (never, in practice)
        hi = hi[0, 0] if hi[0, 0] == hi[-1, 0] else hi
        _rounds(c, (ctr0, row + np.uint64(i0), b & np.uint64(LO), hi), seed)
        w = words[: len(line)]
        for word in range(4):
            np.greater_equal(c[word], t, out=w[..., word])
        flat[start : start + len(line)] = w.reshape(len(line), 4 * n_ctr)[:, j0 - 4 * first:][:, :n_keys]
    return out


def _scratch(scratch, lines, n_ctr):
    """The buffers for ``lines × n_ctr`` counters: six uint64 (the state and the two products)
    and the words' keep bits, ``6·8 + 4`` bytes per counter; kept in ``scratch`` from one tile
    to the next (fresh ones each tile cost their page faults again)."""
    held = getattr(scratch, "buffers", None)
    if held is None or held[1].shape != (lines, n_ctr, 4):
        held = ([np.empty((lines, n_ctr), np.uint64) for _ in range(6)],
                np.empty((lines, n_ctr, 4), bool))
        if scratch is not None:
            scratch.buffers = held
    return held


def _rounds(c, counter, seed):
    """The ten rounds, the last eight in place on the buffers ``c`` (four state words, two
    products). The counter comes as broadcast columns, c0 per key and c1, c2 (and c3 unless it
    is one number) per line; through the first two rounds each word depends on the key alone
    or the line alone (round 1: p0 = c0·M0, p1 = c2·M1; round 2: p0 from the line's c0, p1
    from the key's c2), so they cost a few vectors, and the buffers are filled from them."""
    key = (seed & LO, seed >> 32)
    y0, y1, y2, y3 = _round(counter, *_round_key(key, 0))  # y0, y1 per line; y2, y3 per key
    x0, x1, x2, x3, p0, p1 = c
    k0, k1 = _round_key(key, 1)
    q0, q1 = y0 * np.uint64(M0), y2 * np.uint64(M1)  # round 2 writes the buffers directly
    np.bitwise_xor(q1 >> np.uint64(32), y1 ^ np.uint64(k0), out=x0)
    np.copyto(x1, q1 & np.uint64(LO))
    np.bitwise_xor(q0 >> np.uint64(32), y3 ^ np.uint64(k1), out=x2)
    np.copyto(x3, q0 & np.uint64(LO))
    for r in range(2, ROUNDS):
        k0, k1 = _round_key(key, r)
        np.multiply(x0, M0, out=p0)
        np.multiply(x2, M1, out=p1)
        # c0 ← hi(p1) ^ c1 ^ k0, c1 ← lo(p1)
        np.bitwise_xor(x1, k0, out=x1)
        np.right_shift(p1, 32, out=x0)
        np.bitwise_xor(x0, x1, out=x0)
        np.bitwise_and(p1, LO, out=x1)
        # c2 ← hi(p0) ^ c3 ^ k1, c3 ← lo(p0)
        np.bitwise_xor(x3, k1, out=x3)
        np.right_shift(p0, 32, out=x2)
        np.bitwise_xor(x2, x3, out=x2)
        np.bitwise_and(p0, LO, out=x3)

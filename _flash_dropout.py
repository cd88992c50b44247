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
call per row here. This one computes a chunk of counters at once with uint64 products in
preallocated buffers, in place: ``CHUNK`` counters (128 Ki elements) per pass, which stay in the
L2 cache; 65536 counters at once went out of cache and took 4.8× as long as one chunk
(AMD EPYC Zen 4, measured 2026-12-01).

Private to flash_lib: imported by ``flash_lib.py`` and ``_flash_inputs.py`` only (and by
``tests/test_training.py``, which checks :func:`philox4x32` against Random123's known answers).
"""

from __future__ import annotations

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57  # the round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # the key's Weyl increments: the golden ratio and sqrt(3) - 1
LO = 0xFFFFFFFF
ROUNDS = 10
#: Counters computed per pass: their six uint64 buffers (1.5 MiB) stay in a Zen 4 core's 1 MiB L2
#: with the tile and fill it about as well as anything smaller; see the module docstring.
CHUNK = 1 << 15


def threshold(p):
    """``t = round(p · 2³²)``: an element is kept iff its 32-bit word is ``>= t``."""
    return round(p * 2**32)


def philox4x32(counter, key):
    """Philox4x32-10 of one or many counters: ``counter`` four arrays (or ints) below 2³² that
    broadcast together, ``key`` two ints below 2³²; returns the four output words as uint64
    arrays. The plain form of the rounds (what :func:`keep` computes in place)."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint64) for c in counter)
    k0, k1 = key
    for r in range(ROUNDS):
        p0, p1 = c0 * np.uint64(M0), c2 * np.uint64(M1)
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0), p1 & np.uint64(LO), \
            (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1), p0 & np.uint64(LO)
        k0, k1 = (k0 + W0) & LO, (k1 + W1) & LO
    return c0, c1, c2, c3


def keep(seed, t, n_batch, rows, keys):
    """The keep mask of a block: bool ``(n_batch, rows[1] - rows[0], keys[1] - keys[0])``.

    ``seed`` an int in [0, 2⁶⁴); ``t`` from :func:`threshold`; ``rows``, ``keys``: ``(start, stop)``
    global positions (the caller's offset added). Lines (one batch entry, one row) are taken
    ``CHUNK`` counters at a time, whatever the block's shape.
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
    buffers = [np.empty((lines, n_ctr), np.uint64) for _ in range(6)]
    words = np.empty((lines, n_ctr, 4), bool)
    for start in range(0, n_batch * n_rows, lines):
        line = np.arange(start, min(start + lines, n_batch * n_rows), dtype=np.uint64)[:, None]
        b, row = np.divmod(line, np.uint64(n_rows))
        c = [x[: len(line)] for x in buffers]
        _rounds(c, ctr0, row + np.uint64(i0), b & np.uint64(LO), b >> np.uint64(32), seed)
        w = words[: len(line)]
        for word in range(4):
            np.greater_equal(c[word], t, out=w[..., word])
        flat[start : start + len(line)] = w.reshape(len(line), 4 * n_ctr)[:, j0 - 4 * first:][:, :n_keys]
    return out


def _rounds(c, c0, c1, c2, c3, seed):
    """The ten rounds in place on the buffers ``c`` (four state words, two products): the
    first from the counter's broadcast columns ``c0`` (per key) and ``c1, c2, c3`` (per line),
    which fills the buffers, the other nine from the buffers themselves."""
    k0, k1 = seed & LO, seed >> 32
    x0, x1, x2, x3, p0, p1 = c
    # round 1: p0 = c0·M0 depends on the key only, p1 = c2·M1 on the line only
    q0, q1 = c0 * np.uint64(M0), c2 * np.uint64(M1)
    x0[...] = (q1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0)
    x1[...] = q1 & np.uint64(LO)
    np.bitwise_xor(q0 >> np.uint64(32), c3 ^ np.uint64(k1), out=x2)
    x3[...] = q0 & np.uint64(LO)
    for r in range(1, ROUNDS):
        k0, k1 = (k0 + W0) & LO, (k1 + W1) & LO
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

"""flash_lib's dropout mask: Philox4x32-7, vectorised in NumPy, keyed by each element's position.

A dropout mask drawn from a stateful generator depends on the order in which tiles draw from it:
another block size, another thread count or the backward's other loop order would give another
mask. A counter-based generator is a pure function ``bits = philox(counter, key)`` instead, so
each element's keep bit is a function of its own coordinates and the seed, computed wherever and
whenever the element is: the forward's tile and the backward's tile of the same pair agree, and
no mask is ever stored.

Philox4x32 (Salmon, Moraes, Dror, Shaw 2011, "Parallel random numbers: as easy as 1, 2, 3";
Random123's ``philox4x32``, curand's ``Philox4_32_10``, Triton's ``tl.randint4x``): a 128-bit
counter ``(c0, c1, c2, c3)`` and a 64-bit key ``(k0, k1)``, rounds of::

    p0 = c0 · 0xD2511F53,  p1 = c2 · 0xCD9E8D57                  (32 × 32 → 64-bit products)
    (c0, c1, c2, c3) ← (hi(p1) ^ c1 ^ k0, lo(p1), hi(p0) ^ c3 ^ k1, lo(p0))
    (k0, k1) ← (k0 + 0x9E3779B9, k1 + 0xBB67AE85) mod 2³²         (between rounds)

give four 32-bit words. Random123, curand and Triton run 10 rounds by default; FlashAttention-2
runs 7 (``csrc/flash_attn/src/philox.cuh``: a loop of 6 rounds, then one more), and so does this
module. The Random123 authors' own benchmark lists Philox4x32-7 under "Crush-resistant with *NO*
safety margin" (Random123-Boost, ``libs/random/performance/prf_speed.cpp``): by that label the
fewest rounds that pass TestU01's Crush batteries; Random123's documentation calls its default
of 10 "a considerable safety margin over the minimum number of rounds with no known statistical
flaws". A dropout mask asks less of a generator than a simulation does, and the rounds are most
of the mask's cost. :func:`philox4x32` takes ``rounds``: the tests check the round function
against Random123's 10-round known answers and the 7 rounds against Triton's
``tl.randint4x(seed, offset, n_rounds=7)``.

flash_lib's element ``(b, i, j)`` (``b`` the flat batch index, ``i``, ``j`` the global query and
key positions) uses counter ``(j // 8, i, b mod 2³², b // 2³²)`` and key ``(seed mod 2³², seed //
2³²)``; it takes output word ``(j % 8) // 2``, its low 16 bits for even ``j`` and its high 16 bits
for odd ``j``. No two elements share 16 bits of a counter's output, so the bits are independent
across rows (one stream per row started at ``[row, 0, 0, 0]`` would overlap its neighbour's).
It is kept iff that 16-bit number is ``>= t``, ``t = round(p · 2¹⁶)``: probability exactly
``1 - t / 2¹⁶``, within ``2⁻¹⁷`` of ``1 - p``.

Why 16 bits, where FlashAttention-2 uses 8 (16 elements per counter, ``dropout.h``): 8 bits make
the keep probability a multiple of 1/256 (FlashAttention-2's is ``(floor(255·(1-p)) + 1) / 256``,
0.8984375 for p = 0.1, 1/640 below 0.9), a bias a keep-rate test sees: over 2²² elements the
standard deviation of the rate at p = 0.1 is ``sqrt(0.09 / 2²²) = 1.46e-4``, so 1/640 is 10.7 of
them (it passes 3 of them from about 3.3e5 elements on). 16 bits bound the bias by ``2⁻¹⁷ =
7.6e-6``, 0.052 of that standard deviation, about a twentieth (3 of them only past 1.4e10
elements), with half the counters 32 bits an element would need.

Why not NumPy's own ``np.random.Philox``: it is Philox4x64 (not the generator GPU kernels use)
and serial, one stream per call: one 512 × 512 tile took 2.0 ms of ``random_raw`` plus a Python
call per row here. This one computes ``CHUNK`` counters at once with uint64 products, in place in
preallocated buffers (NumPy has no 32 × 32 → 64-bit multiply-high, so a word lives in a
uint64). The first two rounds cost vectors only (a word depends on the line alone or the counter
alone); the last writes the output two words to a uint64, whose four uint16s are then the eight
keys' numbers in order, so one comparison gives the mask. One 512 × 512 tile (32768 counters)
takes about 0.5 ms on one AMD EPYC Zen 4 core (2026-12-01), against 1.5-1.7 ms, timed alongside,
for the Philox4x32-10 at 32 bits an element this module used before.

Why the words go in pairs, ``(c0, c2)`` and ``(c1, c3)`` as one array each: one NumPy call then
does both words' step, so a round is five calls instead of ten, with the same arithmetic and
shorter code. It did not make two threads measurably faster, and two threads are where the mask
costs most: each call gives the GIL up and takes it back, and two worker threads drawing at once
hand it to each other at nearly every call. ``bench/threads_vs_processes.py`` measured it (AMD
EPYC Zen 4, 2 cores, 2026-12-01, forward at N = 4096, with dropout minus without): the mask cost
0.65 ms a 512 × 512 tile on one thread, 0.56 ms a tile in each of two processes, and 1.22 ms a
tile in each of two threads (float32; float64 0.89, 0.80, 1.63). Drawing four tiles' masks in one
call cut the two-thread cost by about a third in a separate test, but it needs four tiles'
buffers per worker (about 9 MiB) and would make the kernels' scratch grow with N up to four
tiles, so the kernels draw one tile at a time.

Private to flash_lib: imported by ``flash_lib.py`` and ``_flash_inputs.py`` only (and by
``tests/test_training.py``, which checks :func:`philox4x32` against the known answers).
"""

from __future__ import annotations

import sys

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57  # the round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # the key's Weyl increments: the golden ratio and sqrt(3) - 1
LO = 0xFFFFFFFF
ROUNDS = 7  # FlashAttention-2's count (module docstring); Random123's default is 10
BITS = 16  # bits of a word per element: two elements per 32-bit word, eight per counter
PER_COUNTER = 4 * 32 // BITS
#: A uint64's four 16-bit quarters from the least significant, as a slice of its uint16s in memory
#: order (reversed on a big-endian machine).
ORDER = slice(None) if sys.byteorder == "little" else slice(None, None, -1)
#: Counters computed per pass: a 512 × 512 tile's 32768 in one (their buffers, 72 bytes a counter,
#: 2.3 MiB), faster here than 16384 (in a Zen 4 core's 1 MiB L2) or 8192: the ~50 NumPy calls per
#: pass must be long for their overhead to be small (module docstring).
CHUNK = 1 << 15


def threshold(p):
    """``t = round(p · 2¹⁶)``: an element is kept iff its 16-bit number is ``>= t``."""
    return round(p * 2**BITS)


def philox4x32(counter, key, rounds=ROUNDS):
    """Philox4x32 of one or many counters, ``rounds`` rounds (7 here, 10 in Random123's and
    Triton's default): ``counter`` four arrays (or ints) below 2³² that broadcast together,
    ``key`` two ints below 2³²; returns the four output words as uint64 arrays. The plain form
    of the rounds (what :func:`keep` computes in place)."""
    c = tuple(np.asarray(x, np.uint64) for x in counter)
    for r in range(rounds):
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
    first = j0 // PER_COUNTER
    n_ctr = (j1 - 1) // PER_COUNTER - first + 1  # counters per line: each gives 8 consecutive keys
    lines = max(1, CHUNK // n_ctr)
    flat = out.reshape(n_batch * n_rows, n_keys)
    ctr0 = np.arange(first, first + n_ctr, dtype=np.uint64)[None, :]
    buffers, packed, bits = _scratch(scratch, lines, n_ctr)
    aligned = j0 == PER_COUNTER * first and n_keys == PER_COUNTER * n_ctr
    for start in range(0, n_batch * n_rows, lines):
        line = np.arange(start, min(start + lines, n_batch * n_rows), dtype=np.uint64)[:, None]
        b, row = np.divmod(line, np.uint64(n_rows))
        hi = b >> np.uint64(32)  # one number unless the chunk crosses b = 2³² (never, in practice)
        hi = hi[0, 0] if hi[0, 0] == hi[-1, 0] else hi
        w = packed[: len(line)]
        _rounds([x[:, : len(line)] for x in buffers], (ctr0, row + np.uint64(i0), b & np.uint64(LO), hi),
                seed, packed=w)
        # the uint16s of (word0 | word1·2³², word2 | word3·2³²) are the 8 keys' numbers in order
        numbers = w.view(np.uint16).reshape(len(line), 2 * n_ctr, 4)[..., ORDER]
        if aligned:  # straight into the mask (tiles start at multiples of 8 keys)
            np.greater_equal(numbers, t, out=flat[start : start + len(line)].reshape(numbers.shape))
        else:
            kept = bits[: len(line)]
            np.greater_equal(numbers, t, out=kept.reshape(numbers.shape))
            flat[start : start + len(line)] = kept[:, j0 - PER_COUNTER * first:][:, :n_keys]
    return out


def _scratch(scratch, lines, n_ctr):
    """The buffers for ``lines × n_ctr`` counters: three pairs of uint64 words (the state's (c0,
    c2) and (c1, c3), and the two products), the output packed two words to a uint64, and the
    eight keys' keep bits, ``6·8 + 2·8 + 8`` bytes per counter; kept in ``scratch`` from one tile
    to the next (fresh ones each tile cost their page faults again)."""
    held = getattr(scratch, "buffers", None)
    if held is None or held[1].shape != (lines, n_ctr, 2):
        held = ([np.empty((2, lines, n_ctr), np.uint64) for _ in range(3)],
                np.empty((lines, n_ctr, 2), np.uint64),
                np.empty((lines, PER_COUNTER * n_ctr), bool))
        if scratch is not None:
            scratch.buffers = held
    return held


#: (M0, M1) as a column for the pair (c0, c2): one call multiplies both words
MULTIPLIERS = np.array([M0, M1], np.uint64)


def _rounds(buffers, counter, seed, rounds=ROUNDS, packed=None):
    """The ``rounds`` rounds (at least 3), from the third on in place on ``buffers = (A, B, P)``,
    uint64 arrays of shape ``(2,) + state``: A holds the words (c0, c2), B (c1, c3), P the products
    (c0·M0, c2·M1). Each word pair is one array so that one NumPy call does both words' step
    (module docstring). At the end ``(c0, c1, c2, c3) = (A[0], B[0], A[1], B[1])``;
    with ``packed`` (uint64, the state's shape plus 2) the last round writes ``(c0 | c1·2³², c2 |
    c3·2³²)`` there instead.

    The counter comes as broadcast columns, c0 per counter of a line and c1, c2 (and c3 unless
    it is one number) per line. Through the first rounds a word depends on the counter's c0
    alone or on the line alone, so it costs a vector, not a buffer: round 1 (p0 = c0·M0, p1 =
    c2·M1) gives vectors only; round 2 gives c0 and c2 in full but c1 = lo(c2·M1) per counter
    and c3 = lo(c0·M0) per line, which round 3 xors into its outputs as they are."""
    key = (seed & LO, seed >> 32)
    y0, y1, y2, y3 = _round(counter, *_round_key(key, 0))  # y0, y1 per line; y2, y3 per counter
    A, B, P = buffers
    column = (2,) + (1,) * (A.ndim - 1)
    k0, k1 = _round_key(key, 1)
    q0, q1 = y0 * np.uint64(M0), y2 * np.uint64(M1)  # round 2 writes c0, c2 to the buffers
    np.bitwise_xor(q1 >> np.uint64(32), y1 ^ np.uint64(k0), out=A[0])
    np.bitwise_xor(q0 >> np.uint64(32), y3 ^ np.uint64(k1), out=A[1])
    s1, s3 = q1 & np.uint64(LO), q0 & np.uint64(LO)  # its c1 (per counter), c3 (per line)
    swapped = P[::-1]  # (c2·M1, c0·M0): the products in the order of the words they make
    for r in range(2, rounds):
        k0, k1 = _round_key(key, r)
        np.multiply(A, MULTIPLIERS.reshape(column), out=P)
        # (c0, c2) ← (hi(c2·M1) ^ c1 ^ k0, hi(c0·M0) ^ c3 ^ k1)
        np.right_shift(swapped, 32, out=A)
        if r == 2:  # c1, c3 are round 2's vectors
            np.bitwise_xor(A[0], s1 ^ np.uint64(k0), out=A[0])
            np.bitwise_xor(A[1], s3 ^ np.uint64(k1), out=A[1])
        else:
            np.bitwise_xor(B, np.array([k0, k1], np.uint64).reshape(column), out=B)
            np.bitwise_xor(A, B, out=A)
        if packed is not None and r == rounds - 1:
            # c1·2³² = lo(c2·M1)·2³² = (c2·M1)·2³² mod 2⁶⁴: the high half shifts out
            np.left_shift(swapped, 32, out=B)
            np.bitwise_or(A, B, out=np.moveaxis(packed, -1, 0))
            return
        # (c1, c3) ← (lo(c2·M1), lo(c0·M0))
        np.bitwise_and(swapped, LO, out=B)

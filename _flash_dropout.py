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
and serial, one stream per call, so a tile costs a Python call per row. This one computes
``CHUNK`` counters at once with uint64 products, in place in preallocated buffers (NumPy has no
32 × 32 → 64-bit multiply-high, so a word lives in a uint64). The first two rounds cost vectors
only (a word depends on the line alone or the counter alone); the last writes the output two
words to a uint64, whose four uint16s are then the eight keys' numbers in order, so one
comparison gives the mask. ``bench/RESULTS.md`` (2026-12-01) has what a tile's mask and a round
cost, against ``np.random.Philox``, the Philox4x32-10 at 32 bits an element this module used
before, and the five-call round the one below replaced.

Why the words go in pairs, ``(c0, c2)`` as one array and the products ``(c0·M0, c2·M1)`` as
another: one NumPy call then does both words' step. The pair ``(c1, c3)`` is never stored on its
own: it is the low halves of the previous round's products, and its one use is the next round's
xor, which reads those halves in place (a uint32 view of the uint64 products). A round is then
three calls (a multiply and two xors), where each word apart took ten calls and (c1, c3) as a
third pair took five.

Why a draw covers two tiles (:data:`TILES_PER_DRAW`): a draw is about 25 NumPy calls whatever its
size, and on two worker threads each call gives the GIL up and takes it back, handing it to the
other worker at nearly every call, so a tile's mask cost about twice as much in each of two
threads as in each of two processes (``bench/threads_vs_processes.py``). Drawing two tiles per
call halves the hand-overs per tile, which made fwd+bwd with dropout measurably faster against
fwd+bwd without (``bench/bench_flash.py --training-only``); four tiles gained nothing more
(``bench/RESULTS.md``, 2026-12-01, has the figures). The buffers then hold two tiles' counters,
3.5 MiB a worker at 512 × 512 tiles, still fixed whatever N.

Private to flash_lib: imported by ``flash_lib.py`` and ``_flash_inputs.py`` only (and by
``tests/test_training.py``, which checks :func:`philox4x32` against the known answers).
"""

from __future__ import annotations

import math
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
#: Tiles whose masks the kernels draw in one call, along each worker's walk (module docstring)
TILES_PER_DRAW = 2
#: Counters computed per pass: two 512 × 512 tiles' 65536 in one (their buffers, 56 bytes a
#: counter, 3.5 MiB; 48 without the bits of an unaligned block), where 8192 a pass made fwd+bwd
#: with dropout a third slower again on two threads: a pass's ~25 NumPy calls must be long for
#: their overhead to be small (module docstring).
CHUNK = TILES_PER_DRAW << 15


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


def keep(seed, t, n_batch, rows, keys, scratch=None, out=None):
    """The keep mask of a block: bool ``(n_batch, rows[1] - rows[0], keys[1] - keys[0])``.

    ``seed`` an int in [0, 2⁶⁴); ``t`` from :func:`threshold`; ``rows``, ``keys``: ``(start, stop)``
    global positions (the caller's offset added). Lines (one batch entry, one row) are taken
    ``CHUNK`` counters at a time, whatever the block's shape. ``scratch``: an object (one per
    thread, e.g. a ``threading.local``) to keep the buffers in from one call to the next;
    ``out``: a flat bool array of the mask's size to write the mask to.
    """
    (i0, i1), (j0, j1) = rows, keys
    n_rows, n_keys = i1 - i0, j1 - j0
    shape = (n_batch, n_rows, n_keys)
    out = np.empty(shape, bool) if out is None else out.reshape(shape)
    if out.size == 0:
        return out
    first = j0 // PER_COUNTER
    n_ctr = (j1 - 1) // PER_COUNTER - first + 1  # counters per line: each gives 8 consecutive keys
    lines = max(1, CHUNK // n_ctr)
    flat = out.reshape(n_batch * n_rows, n_keys)
    ctr0 = np.arange(first, first + n_ctr, dtype=np.uint64)[None, :]
    buffers, bits = _scratch(scratch, lines * n_ctr)
    aligned = j0 == PER_COUNTER * first and n_keys == PER_COUNTER * n_ctr
    for start in range(0, n_batch * n_rows, lines):
        line = np.arange(start, min(start + lines, n_batch * n_rows), dtype=np.uint64)[:, None]
        b, row = np.divmod(line, np.uint64(n_rows))
        hi = b >> np.uint64(32)  # one number unless the chunk crosses b = 2³² (never, in practice)
        hi = hi[0, 0] if hi[0, 0] == hi[-1, 0] else hi
        state = (2, len(line), n_ctr)  # contiguous views: the packed output reshapes one of them
        w = _rounds([x[: math.prod(state)].reshape(state) for x in buffers],
                    (ctr0, row + np.uint64(i0), b & np.uint64(LO), hi), seed, packed=True)
        # the uint16s of (word0 | word1·2³², word2 | word3·2³²) are the 8 keys' numbers in order
        numbers = w.view(np.uint16).reshape(len(line), 2 * n_ctr, 4)[..., ORDER]
        if aligned:  # straight into the mask (tiles start at multiples of 8 keys)
            np.greater_equal(numbers, t, out=flat[start : start + len(line)].reshape(numbers.shape))
        else:
            kept = bits[: numbers.size].reshape(len(line), PER_COUNTER * n_ctr)
            np.greater_equal(numbers, t, out=kept.reshape(numbers.shape))
            flat[start : start + len(line)] = kept[:, j0 - PER_COUNTER * first:][:, :n_keys]
    return out


def _scratch(scratch, counters):
    """Flat buffers for ``counters`` counters: three of two uint64 words a counter (the state's
    (c0, c2) and two rounds' products, the last of which takes the packed output), and the eight
    keys' keep bits, ``3·16 + 8`` bytes per counter. Kept in ``scratch`` from one draw to the next
    at ``CHUNK`` counters (or the most yet asked for), whatever the draw's shape: fresh ones each
    draw would cost their page faults again."""
    held = getattr(scratch, "buffers", None)
    if held is None or held[1].size < PER_COUNTER * counters:
        counters = max(counters, CHUNK)
        held = ([np.empty(2 * counters, np.uint64) for _ in range(3)],
                np.empty(PER_COUNTER * counters, bool))
        if scratch is not None:
            scratch.buffers = held
    return held


#: (M0, M1) as a column for the pair (c0, c2): one call multiplies both words
MULTIPLIERS = np.array([M0, M1], np.uint64)
#: Where a uint64's low and high 32-bit halves sit among its two uint32s in memory
HALVES = (0, 1) if sys.byteorder == "little" else (1, 0)


def _low(x):
    """The low 32-bit halves of the uint64 array ``x`` (last axis contiguous), a uint32 view."""
    return x.view(np.uint32)[..., HALVES[0]::2]


def _high(x):
    """The high 32-bit halves of ``x``, a uint32 view."""
    return x.view(np.uint32)[..., HALVES[1]::2]


def _rounds(buffers, counter, seed, rounds=ROUNDS, packed=False):
    """The ``rounds`` rounds (at least 3), from the third on in place on ``buffers = (A, P, P')``,
    contiguous uint64 arrays of shape ``(2,) + state``. A holds the words (c0, c2) in its low
    halves (its high halves stay 0); P and P' take turns holding a round's products (c0·M0,
    c2·M1), whose low halves are the next (c3, c1) (module docstring). Returns ``(c0, c1, c2,
    c3)`` as uint64 arrays; with ``packed``, the uint64 array of shape ``state + (2,)`` holding
    ``(c0 | c1·2³², c2 | c3·2³²)`` instead, written over the last round's products.

    The counter comes as broadcast columns, c0 per counter of a line and c1, c2 (and c3 unless
    it is one number) per line. Through the first rounds a word depends on the counter's c0
    alone or on the line alone, so it costs a vector, not a buffer: round 1 (p0 = c0·M0, p1 =
    c2·M1) gives vectors only; round 2 gives c0 and c2 in full but c1 = lo(c2·M1) per counter
    and c3 = lo(c0·M0) per line, which round 3 xors into its outputs as they are."""
    key = (seed & LO, seed >> 32)
    y0, y1, y2, y3 = _round(counter, *_round_key(key, 0))  # y0, y1 per line; y2, y3 per counter
    A, *products = buffers
    column = (2,) + (1,) * (A.ndim - 1)
    k0, k1 = _round_key(key, 1)
    q0, q1 = y0 * np.uint64(M0), y2 * np.uint64(M1)  # round 2 writes c0, c2 to the buffers
    np.bitwise_xor(q1 >> np.uint64(32), y1 ^ np.uint64(k0), out=A[0])  # whole words: high halves 0
    np.bitwise_xor(q0 >> np.uint64(32), y3 ^ np.uint64(k1), out=A[1])
    lows = (q1 & np.uint64(LO), q0 & np.uint64(LO))  # its c1 (per counter), c3 (per line)
    for r in range(2, rounds):
        k = _round_key(key, r)
        P, previous = products[r % 2], products[(r - 1) % 2]
        np.multiply(A, MULTIPLIERS.reshape(column), out=P)
        swapped = P[::-1]  # (c2·M1, c0·M0): the products in the order of the words they make
        # (c0, c2) ← (hi(c2·M1) ^ c1 ^ k0, hi(c0·M0) ^ c3 ^ k1), (c1, c3) the last lo(products)
        if r == 2:  # c1, c3 are round 2's vectors
            for word in (0, 1):
                np.bitwise_xor(_high(swapped[word]), (lows[word] ^ np.uint64(k[word])).astype(np.uint32),
                               out=_low(A[word]))
        else:
            np.bitwise_xor(_high(swapped), _low(previous[::-1]), out=_low(A))
            np.bitwise_xor(A, np.array(k, np.uint64).reshape(column), out=A)
    if packed:
        # c1·2³² = lo(c2·M1)·2³² = (c2·M1)·2³² mod 2⁶⁴: the high half shifts out
        np.left_shift(swapped, 32, out=previous)
        words = P.reshape(P.shape[1:] + (2,))  # P's memory, now free: a view, P being contiguous
        np.bitwise_or(A, previous, out=np.moveaxis(words, -1, 0))
        return words
    (c0, c2), (c1, c3) = A, _low(swapped).astype(np.uint64)
    return c0, c1, c2, c3

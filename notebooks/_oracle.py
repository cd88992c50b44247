"""The oracle of chapters 14 and 15: the variants' dense construction, and the two checks.

Chapter 14 prints this file; chapter 15 imports it, and chapters 17 and 18 its ``worst``. Every variant is checked twice:
`flash_attention` against `naive_attention` with the same keywords, and `naive_attention`
against `dense_attention`, written here from the formulas in its own order of operations, so
that the oracle itself is pinned.
"""

import numpy as np

from flash_lib import flash_attention, naive_attention, rowwise_relative_error, tile_schedule

# The limit for float64 agreements "to rounding": 1e-14, 45 machine epsilons. Every such
# difference in chapters 14 and 15 was at most 3e-15 at every NPY_DISABLE_CPU_FEATURES level
# (CONTRIBUTING.md), and any error of a variant (a window off by one, a wrong head, a missing
# cap, a kernel off by one part in a million) is far above it.
ROUNDING = 1e-14


def dense_attention(q, k, v, *, scale, allowed=None, bias=None, softcap=None):
    """The four steps for the whole score matrix: scale, cap, add the bias, mask; a softmax
    whose empty rows are 0. Written from the formulas, independently of flash_lib, and in
    another order: P is normalised before it meets V (naive divides P V by the row sums)."""
    s = scale * (q @ np.swapaxes(k, -1, -2))
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = p.sum(axis=-1, keepdims=True)
    return (p / np.where(l == 0, 1, l)) @ v


def worst(a, b):
    """chapter 7's metric, the worst row"""
    return float(rowwise_relative_error(a, b).max())


def magnitude(x, limit=ROUNDING):
    """A stable way to print an error: the stated limit it is under (its last digits, and
    whether it is exactly 0, are the CPU's rounding, so they are not printed), or, for a real
    error, the number."""
    return f"< {limit:.0e}" if x < limit else f"{x:.1e} (not < {limit:.0e})"


class Checks(dict):
    """variant -> (flash vs naive, naive vs the dense construction), kept for the asserts."""

    def run(self, name, q, k, v, dense_out, block_q=16, block_k=16, **keywords):
        """Both checks for one variant, printed."""
        naive = naive_attention(q, k, v, **keywords)
        flash = flash_attention(q, k, v, block_q=block_q, block_k=block_k, **keywords)
        self[name] = (worst(flash, naive), worst(naive, dense_out))
        print(f"{name:<34} flash vs naive {magnitude(self[name][0]):<16} "
              f"naive vs dense {magnitude(self[name][1])}")

    def run_masks(self, masks, n, block, q, k, v):
        """Both checks for each mask (name -> (keywords, the dense boolean mask written from its
        definition)) over n tokens with block x block tiles, and the tiles: those tile_schedule
        lists and those holding an allowed pair, per mask, to be compared."""
        every_tile = tile_schedule(n, n, block, block)
        schedules, holding = {}, {}
        for name, (keywords, allowed) in masks.items():
            schedules[name] = tile_schedule(n, n, block, block, **keywords)
            holding[name] = [t for t in every_tile if allowed[t[0]:t[1], t[2]:t[3]].any()]
            dense = dense_attention(q, k, v, scale=1 / np.sqrt(q.shape[-1]), allowed=allowed)
            self.run(name, q, k, v, dense, block_q=block, block_k=block, **keywords)
        return schedules, holding

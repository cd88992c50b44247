"""Property-based: over random shapes, broadcasting, block sizes, masks, causal and dtypes, the
tiled kernel agrees with the textbook one (tolerances: ``FLASH_VS_NAIVE`` in helpers.py).

Hypothesis draws only small integers and a seed; the arrays come from
``np.random.default_rng(seed)``, which keeps generation and shrinking fast.
"""

import warnings

import numpy as np
from helpers import FLOAT_DTYPES, assert_close_to_naive
from hypothesis import given, note
from hypothesis import strategies as st

from flash_lib import flash_attention, naive_attention

# Python loops over tiles cost ~50 µs each; cap the tiles per example so tiny blocks stay cheap.
MAX_TILES = 300

sizes = st.one_of(st.integers(1, 9), st.integers(1, 300))


def thin(rng, shape):
    """A random shape that broadcasts to ``shape``: some dims set to 1, leading ones dropped."""
    dims = [n if rng.random() < 0.6 else 1 for n in shape]
    return tuple(dims[rng.integers(0, len(dims) + 1) :])


def block_sizes(n, smallest=1):
    """Block sizes from ``smallest`` to n + 5; half the draws from the interesting ones (1, a
    prime, a third, n - 1, n, n + 1, n + 5), since Hypothesis alone favours the smallest."""
    smallest = max(1, min(smallest, n + 5))
    special = sorted({b for b in (1, 2, 7, n // 3, n - 1, n, n + 1, n + 5) if b >= smallest})
    return st.one_of(st.sampled_from(special), st.integers(smallest, n + 5))


@st.composite
def attention_cases(draw):
    """Everything one flash-vs-naive comparison needs, built from a seed and a few integers."""
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    n_q, n_k = draw(sizes), draw(sizes)
    d, dv = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    block_q = draw(block_sizes(n_q))
    q_blocks = -(-n_q // block_q)
    # block_k from 1 to Nk + 5, except that the tile count stays under MAX_TILES
    block_k = draw(block_sizes(n_k, smallest=-(-n_k // max(1, MAX_TILES // q_blocks))))
    causal = draw(st.booleans())
    mask_kind = draw(st.sampled_from(["none", "random", "key padding", "query rows"]))
    density = draw(st.sampled_from([0.0, 0.3, 0.7, 0.95, 1.0]))
    seed = draw(st.integers(0, 2**32 - 1))

    rng = np.random.default_rng(seed)
    q = rng.standard_normal(thin(rng, batch) + (n_q, d))
    k = rng.standard_normal(thin(rng, batch) + (n_k, d))
    v = rng.standard_normal(thin(rng, batch) + (n_k, dv))
    mask = None
    if mask_kind != "none":
        rows, cols = {"random": (n_q, n_k), "key padding": (1, n_k), "query rows": (n_q, 1)}[
            mask_kind
        ]
        mask = rng.random(thin(rng, batch) + (rows, cols)) < density
        if mask.ndim > 2 and mask.shape[0] > 1 and rng.random() < 0.5:
            mask[rng.integers(mask.shape[0])] = False  # one fully masked matrix
        if rows > 1:
            mask[..., rng.integers(0, rows, size=rng.integers(0, 3)), :] = False  # masked rows
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    return dict(q=q, k=k, v=v, mask=mask, causal=causal, block_q=block_q, block_k=block_k)


@given(attention_cases())
def test_flash_matches_naive(case):
    """out and lse of flash equal naive's within the per-dtype tolerance, fully masked rows are
    exactly 0 / -inf in both, shapes broadcast, and no floating-point warning is raised."""
    case = dict(case)
    q, k, v, mask = case.pop("q"), case.pop("k"), case.pop("v"), case.pop("mask")
    blocks = dict(block_q=case.pop("block_q"), block_k=case.pop("block_k"))
    note(
        f"q{q.shape} k{k.shape} v{v.shape} mask{None if mask is None else mask.shape} "
        f"{q.dtype} {blocks} {case}"
    )
    with warnings.catch_warnings(), np.errstate(divide="raise", over="raise", invalid="raise"):
        warnings.simplefilter("error")
        out, lse = flash_attention(q, k, v, mask=mask, **blocks, **case, return_lse=True)
        ref, ref_lse = naive_attention(q, k, v, mask=mask, **case, return_lse=True)

    shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
    if mask is not None:
        shapes.append(mask.shape[:-2])
    batch = np.broadcast_shapes(*shapes)
    assert out.shape == batch + (q.shape[-2], v.shape[-1])
    assert lse.shape == batch + (q.shape[-2],)
    assert_close_to_naive(out, lse, ref, ref_lse, v, q.dtype.type)

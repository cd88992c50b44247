"""Conformance checks for attention kernels: is someone else's kernel right, and if not, why?

``allclose(atol=1e-2)`` on random inputs passes the classic attention bugs: a missing online-softmax
rescale shows only when a row's maximum rises late, the NaN of a fully masked row only when a row
is fully masked, a wrong causal alignment only when ``Nq != Nk``. :func:`check_kernel` runs a kernel
through cases built to expose each of them, in float64, float32 and float16, and returns a
:class:`Report`: what was measured, the bound it had to meet, and for each failure a one-line
diagnosis of the likely cause::

    import flash_check
    report = flash_check.check_kernel(my_attention)          # features mask, causal, lse
    print(report)                                             # a table, failures, skips
    assert report.ok, report.failures

or from a shell (exit status 1 on any failure)::

    python -m flash_check my_package.my_module:my_attention --features mask causal --dtypes float32

The kernel
----------
``fn(q, k, v, *, mask=None, causal=False, scale=None)`` takes NumPy arrays ``q (..., Nq, d)``,
``k (..., Nk, d)``, ``v (..., Nk, dv)`` (the same leading dims) and returns ``out (..., Nq, dv)``,
or ``(out, lse)`` with ``lse (..., Nq)`` when ``"lse"`` is among the features; anything
``np.asarray`` accepts (a CPU torch tensor, a JAX array). A keyword is passed only when the case
uses it, so a kernel without masks is called without ``mask=``. A GPU kernel is checked through a
thin wrapper that moves the arrays; :func:`torch_sdpa` is one (``device="cuda"`` for a GPU).
The conventions checked are ``flash_lib``'s: ``mask`` True = may attend; ``causal`` allows key ``j``
for query ``i`` iff ``j <= i + (Nk - Nq)`` (bottom-right, FlashAttention >= 2.1); a fully masked row
gives ``out`` exactly 0, and ``lse = lse_empty`` (flash_lib writes -inf, FlashAttention +inf,
PyTorch's CPU flash op 0.0); ``lse`` is the natural log-sum-exp of the scaled, masked scores.

The bound
---------
Every accuracy case is measured against ``flash_lib.precise_attention`` (extended precision) on
the very inputs the kernel got, with ``flash_lib.rowwise_relative_error`` (each row's
``max |out - truth| / max |truth|``; its largest value over the rows). The kernel passes when::

    error(kernel) <= FACTOR * error(flash_lib.naive_attention in the same dtype) + FLOOR[dtype]

the rule of FlashAttention's own tests (``FACTOR`` = 2 there): a kernel may be as inexact as the
textbook computation in its dtype, twice over, not more. The floor covers cases where naive is
exact (a single key, ties). ``lse`` likewise, with the error ``|lse - truth| / (1 + |truth|)``.
Chapter 15 of the tutorial measures flash_lib, PyTorch and JAX against this rule and justifies
the values of ``FACTOR``, ``OUT_FLOOR`` and ``LSE_FLOOR`` below.

Adding cases
------------
A case is a :class:`Case`: a name, its reason (one line, printed in the report), the features it
needs, and ``make(rng, dtype) -> Inputs``. ``Inputs.kwargs`` are the keywords given to the kernel
*and* to ``flash_lib.naive_attention`` / ``precise_attention``, which compute the bound and the
truth. A case for a keyword flash_lib takes needs nothing else; the window's, for instance, is ::

    def _window(rng, dtype):
        q, k, v = random_qkv(rng, 60, 90, dtype=dtype, batch=(2,))
        return Inputs(q, k, v, {"window": (7, 3)})

    register_case(Case("window", "sliding window (7, 3) with Nq = 60 < Nk = 90: ...", _window,
                       needs=("window",), hint="wrong with a window: ..."))

and ``check_kernel(fn, features=("mask", "causal", "lse", "window"))`` runs it (without
``"window"`` in the features it is listed as skipped). A feature name is known once a registered
case needs it; :data:`FEATURES` describes the built-in ones. A case with its own kind of check
(such as ``memory``) passes ``run=`` instead, a function ``(ctx) -> list[Failure]``.

The variants
------------
Features ``"window"`` (``window=(left, right)``), ``"softcap"``, ``"alibi"`` (``alibi_slopes=``),
``"gqa"`` (``enable_gqa=True``) and ``"mask_mod"`` (:data:`VARIANTS`), with FlashAttention's
conventions as flash_lib documents them, each have cases of their own, skipped unless the feature
is listed. Their failures are diagnosed by comparing the output with the classic mistakes, each
written out densely here: a window off by one at an edge, aligned top-left or with its sides
swapped; softcap applied after the mask, after the bias or before the scale; ALiBi's sign
flipped, its distance aligned top-left, or attention-gym's causal-only form used without causal
(and, under causal, an lse shifted by that form's per-row constant); GQA grouped as ``h mod Hkv``;
a mask_mod inverted, called with its arguments swapped, on tile-local positions, with its batch
dims dropped, or whose tiles are skipped by their corners; and each variant ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import math
import sys
import warnings
import zlib
from collections.abc import Callable

import numpy as np

import flash_lib

__all__ = [
    "FEATURES",
    "VARIANTS",
    "DEFAULT_FEATURES",
    "DTYPES",
    "FACTOR",
    "OUT_FLOOR",
    "LSE_FLOOR",
    "Inputs",
    "Case",
    "CASES",
    "register_case",
    "Failure",
    "Skip",
    "Result",
    "Report",
    "check_kernel",
    "random_qkv",
    "torch_sdpa",
    "torch_flash_for_cpu_with_lse",
    "jax_dot_product_attention",
    "main",
]

#: The features a kernel may declare; a case that needs one the kernel lacks is skipped.
FEATURES = {
    "mask": "takes mask= (bool, True = may attend), broadcastable to (..., Nq, Nk)",
    "causal": "takes causal= (bool), aligned bottom-right: key j allowed iff j <= i + (Nk - Nq)",
    "lse": "returns (out, lse), lse the natural log-sum-exp of each row's scaled, masked scores",
    "dv": "values may be narrower or wider than queries and keys (dv != d)",
    "memory": "allocates its memory through NumPy or Python, where tracemalloc sees it",
    # The variants (flash_lib's keywords, FlashAttention's conventions)
    "window": "takes window=(left, right), FlashAttention's window_size: key j allowed iff "
              "i + (Nk - Nq) - left <= j <= i + (Nk - Nq) + right (None: unbounded)",
    "softcap": "takes softcap=c > 0: s <- c * tanh(s / c) on the scaled scores, before the bias "
               "and the masks",
    "alibi": "takes alibi_slopes= of shape (H,) or (B, H): adds -slope * |i + (Nk - Nq) - j| "
             "to the (capped) scores",
    "gqa": "takes enable_gqa=True with k, v of Hkv heads (axis -3) dividing q's Hq: query head "
           "h reads kv head h // (Hq / Hkv)",
    "mask_mod": "takes mask_mod=f, f(q_idx, k_idx) -> bool array (True = may attend) of global "
                "positions, q_idx of shape (rows, 1), k_idx (1, keys), leading dims allowed",
}
#: The variants' features, each with its cases below.
VARIANTS = ("window", "softcap", "alibi", "gqa", "mask_mod")
DEFAULT_FEATURES = ("mask", "causal", "lse")
#: The dtypes a kernel can be checked in, in the order they are checked.
DTYPES = ("float64", "float32", "float16")

#: The bound: ``error <= FACTOR * naive's error + floor``. 2 is FlashAttention's factor. Chapter 15
#: measures the largest ratio of a correct kernel's error to naive's (flash_lib at three tile
#: shapes, PyTorch SDPA math and flash, JAX), over the cases where naive's error exceeds 4 eps:
#: 1.66 when it was written (float32; 1.55 in float64, 1.46 in float16).
FACTOR = 2.0
#: The floor of the out error, in units of the dtype's eps (its machine epsilon): where naive is
#: within an ulp or two (one key, ties, one dominant key) a kernel summing in another order may
#: still be a few ulps off. Measured need, ``max(error - FACTOR * naive's)``: 5.3 eps in float64
#: and 3.8 in float32 (flash_lib with block_k = 1 over 1000 keys, a thousand rescales in a row),
#: 0.01 eps in float16, whose single final rounding dominates every kernel's error.
OUT_FLOOR = {"float64": 8 * float(np.finfo(np.float64).eps),
             "float32": 8 * float(np.finfo(np.float32).eps),
             "float16": 1 * float(np.finfo(np.float16).eps)}
#: The floor of the lse error, in units of the eps of the lse's dtype (float32 for float16
#: inputs, as flash_lib and FlashAttention store it). Measured need: at most 0.7 eps.
LSE_FLOOR = {"float64": 4 * float(np.finfo(np.float64).eps),
             "float32": 4 * float(np.finfo(np.float32).eps),
             "float16": 4 * float(np.finfo(np.float32).eps)}


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Inputs:
    """One case's inputs in one dtype.

    ``kwargs`` go to the kernel and to flash_lib's references. ``nan_rows`` (bool, shape
    ``(..., Nq)``) marks rows that must come out NaN (NaN in q); ``clean`` holds ``(q, k, v)``
    for the references when the kernel's inputs carry garbage the references need not see.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    kwargs: dict = dataclasses.field(default_factory=dict)
    nan_rows: np.ndarray | None = None
    clean: tuple | None = None


@dataclasses.dataclass(frozen=True)
class Case:
    """A named case: how to build its inputs, what it needs, why it exists, what a failure means.

    ``make(rng, dtype)`` returns :class:`Inputs`. ``hint`` is the diagnosis of an accuracy
    failure when no more specific cause is found. ``dtypes`` restricts the case (None: every
    dtype checked); ``once`` runs it in one dtype only. ``run(ctx)`` replaces the accuracy check.
    """

    name: str
    reason: str
    make: Callable
    needs: tuple = ()
    hint: str = ""
    dtypes: tuple | None = None
    once: bool = False
    run: Callable | None = None


#: The registered cases, by name, in the order they are checked.
CASES: dict = {}


def register_case(case):
    """Add ``case`` to :data:`CASES` (replacing one of the same name); returns it."""
    if not isinstance(case, Case):
        raise TypeError(f"case must be a flash_check.Case, got {type(case).__name__}")
    CASES[case.name] = case
    return case


def random_qkv(rng, n_q, n_k, d=16, dv=None, dtype=np.float64, batch=()):
    """Standard-normal ``q (*batch, Nq, d)``, ``k (*batch, Nk, d)``, ``v (*batch, Nk, dv)``."""
    dv = d if dv is None else dv
    return tuple(rng.standard_normal(batch + shape).astype(dtype)
                 for shape in ((n_q, d), (n_k, d), (n_k, dv)))


def _bottom_right(n_q, n_k):
    return np.tril(np.ones((n_q, n_k), dtype=bool), k=n_k - n_q)


def _random(rng, dtype):
    return Inputs(*random_qkv(rng, 70, 90, dtype=dtype, batch=(2, 3)))


def _late_max(rng, dtype):
    # Scores 256 · k[:, 0] + (the rest): k[:, 0] rises from -4096 to 0 along the keys, so every
    # key block raises the running max, by ~1e6 in all (every row spans >= 1e6). The last 8 keys
    # tie at k[:, 0] = 0 and the other 15 features (std ~1) mix them: the answer is not one key.
    # Every number is exact in float16; the top scores are O(1), so rounding stays small.
    n_q, n_k = 48, 1100
    q, k, v = random_qkv(rng, n_q, n_k)
    q[:, 1:] *= 0.5
    k[:, 1:] *= 0.5
    q[:, 0] = 256
    k[:, 0] = np.round(np.linspace(-4096, 0, n_k))
    k[-8:, 0] = 0
    return Inputs(q.astype(dtype), k.astype(dtype), v.astype(dtype), {"scale": 1.0})


def _sizes(n_q, n_k):
    def make(rng, dtype):
        return Inputs(*random_qkv(rng, n_q, n_k, dtype=dtype))
    return make


def _decode(rng, dtype):
    return Inputs(*random_qkv(rng, 1, 1000, dtype=dtype), {"causal": True})


def _causal(n_q, n_k):
    def make(rng, dtype):
        return Inputs(*random_qkv(rng, n_q, n_k, dtype=dtype), {"causal": True})
    return make


def _key_padding(rng, dtype):
    q, k, v = random_qkv(rng, 100, 100, dtype=dtype, batch=(4,))
    mask = np.ones((4, 1, 100), dtype=bool)  # one mask row per sequence, broadcast over queries
    mask[1, :, 70:] = False  # right padding
    mask[2, :, :60] = False  # left padding: the first 60 keys, whole key blocks, masked
    mask[3, :, 1:] = False  # a single key
    return Inputs(q, k, v, {"mask": mask})


def _random_mask(rng, dtype):
    q, k, v = random_qkv(rng, 64, 200, dtype=dtype, batch=(2,))
    density = np.where(np.arange(64) < 10, 0.02, 0.5)[:, None]  # ten sparse rows, some empty
    return Inputs(q, k, v, {"mask": rng.random((2, 64, 200)) < density})


def _empty_rows(rng, dtype):
    q, k, v = random_qkv(rng, 40, 90, dtype=dtype)
    mask = rng.random((40, 90)) < 0.7
    mask[[0, 7, 8, 20, 39]] = False
    return Inputs(q, k, v, {"mask": mask})


def _all_masked(rng, dtype):
    q, k, v = random_qkv(rng, 20, 30, dtype=dtype)
    return Inputs(q, k, v, {"mask": np.zeros((20, 30), dtype=bool)})


def _causal_and_mask(rng, dtype):
    q, k, v = random_qkv(rng, 40, 100, dtype=dtype)
    mask = np.ones((1, 100), dtype=bool)
    mask[:, :10] = mask[:, 90:] = False
    return Inputs(q, k, v, {"mask": mask, "causal": True})


def _nan_in_q(rng, dtype):
    q, k, v = random_qkv(rng, 16, 40, dtype=dtype, batch=(2,))
    q[0, 3, 5] = np.nan
    nan_rows = np.zeros((2, 16), dtype=bool)
    nan_rows[0, 3] = True
    return Inputs(q, k, v, nan_rows=nan_rows)


def _large_scale(rng, dtype):
    q, k, v = random_qkv(rng, 40, 60)
    return Inputs((q / 50).astype(dtype), (k / 50).astype(dtype), v.astype(dtype),
                  {"scale": 1e4})


def _tiny_scale(rng, dtype):
    q, k, v = random_qkv(rng, 40, 60)
    return Inputs((30 * q).astype(dtype), (30 * k).astype(dtype), v.astype(dtype),
                  {"scale": 1e-4})


def _float16_overflow(rng, dtype):
    # Eight distinct key rows, each repeated 5 times: ties are exact, so the answer is the mean
    # of the values of a row's top key group. q·k ~ 1000 and scale 100: scores ~1e5 > 65504.
    q = 8 + rng.standard_normal((24, 16))
    distinct = 8 + rng.standard_normal((8, 16))
    k = distinct[rng.permutation(np.repeat(np.arange(8), 5))]
    v = rng.standard_normal((40, 16))
    return Inputs(q.astype(dtype), k.astype(dtype), v.astype(dtype), {"scale": 100.0})


def _masked_nonfinite(rng, dtype):
    # A KV cache whose unused slots hold garbage: sequence 1 uses 30 of its 48 slots.
    q, k, v = random_qkv(rng, 24, 48, dtype=dtype, batch=(2,))
    mask = np.ones((2, 24, 48), dtype=bool)
    mask[1, :, 30:] = False
    mask[1, 5, :] = False  # and one query that may see nothing
    clean = tuple(x.copy() for x in (q, k, v))
    k[1, 30:34] = np.nan
    v[1, 34:40] = np.inf
    v[1, 40:44] = -np.inf
    v[1, 44:] = np.nan
    return Inputs(q, k, v, {"mask": mask}, clean=clean)


def _dv(rng, dtype):
    return Inputs(*random_qkv(rng, 40, 70, d=16, dv=24, dtype=dtype))


_SIZES_REASON = ("sizes that are not multiples of common block sizes (16 ... 512): a dropped "
                 "or garbled last partial block shows here")
_SIZES_HINT = ("wrong at a size that is not a multiple of the block size: the last partial "
               "block (of keys or of queries) is mishandled")
_CAUSAL_HINT = ("wrong with causal=True: the diagonal is misplaced, or tiles that cross it are "
                "not masked")
_MASK_HINT = "wrong with a mask: masked keys still count, or the mask is broadcast wrongly"

for _case in [
    Case("random", "plain random inputs with batch dims (2, 3): the baseline", _random,
         hint="wrong on plain random inputs"),
    Case("late_max", "scores spanning >= 1e6 whose row maximum rises in every key block",
         _late_max,
         hint="wrong only when a row's maximum rises in a later key block: the running sums l "
              "and acc are not rescaled by exp(m - m') when the max moves from m to m'"),
    *(Case(f"size_{n_q}x{n_k}", _SIZES_REASON, _sizes(n_q, n_k), hint=_SIZES_HINT)
      for n_q, n_k in ((1, 1), (63, 65), (65, 63), (127, 129), (129, 127), (1000, 17),
                       (3, 1000))),
    Case("decode", "one query over 1000 keys with causal=True: the query sees every key",
         _decode, needs=("causal",), hint=_CAUSAL_HINT),
    Case("causal_square", "causal, Nq = Nk = 130", _causal(130, 130), needs=("causal",),
         hint=_CAUSAL_HINT),
    Case("causal_wide", "causal with Nq = 50 < Nk = 130: the diagonal ends bottom-right",
         _causal(50, 130), needs=("causal",), hint=_CAUSAL_HINT),
    Case("causal_tall", "causal with Nq = 130 > Nk = 50: the first 80 rows see no key",
         _causal(130, 50), needs=("causal",), hint=_CAUSAL_HINT),
    Case("key_padding", "per-sequence key padding (right, left, all but one key), a mask "
         "(4, 1, Nk) broadcast over queries", _key_padding, needs=("mask",), hint=_MASK_HINT),
    Case("random_mask", "random masks, dense and sparse (some rows empty)", _random_mask,
         needs=("mask",), hint=_MASK_HINT),
    Case("empty_rows", "five fully masked rows, the first and the last among them",
         _empty_rows, needs=("mask",), hint=_MASK_HINT),
    Case("all_masked", "a fully masked matrix: every row empty", _all_masked, needs=("mask",),
         hint=_MASK_HINT),
    Case("causal_and_mask", "causal (Nq = 40 < Nk = 100) and a padding mask together",
         _causal_and_mask, needs=("mask", "causal"),
         hint="wrong with causal and a mask together: they are not ANDed, or misaligned"),
    Case("nan_in_q", "NaN in one row of q: that row is NaN, every other row exact", _nan_in_q,
         hint="wrong rows next to a NaN row of q"),
    Case("large_scale", "scale = 1e4 with small q, k", _large_scale,
         hint="wrong with a large scale: the scale is dropped, or applied twice or too late"),
    Case("tiny_scale", "scale = 1e-4 with large q, k", _tiny_scale,
         hint="wrong with a tiny scale: the scale is dropped, or applied twice or too late"),
    Case("float16_overflow", "float16 inputs whose scores (~1e5) pass float16's 65504",
         _float16_overflow, dtypes=("float16",),
         hint="scores past 65504 are mishandled in float16: compute q·kᵀ and the softmax in "
              "float32"),
    Case("masked_nonfinite", "NaN in k and ±inf, NaN in v at padded keys no row may attend",
         _masked_nonfinite, needs=("mask",),
         hint="values at keys a row may not attend changed that row"),
    Case("dv", "values of width dv = 24 with d = 16", _dv, needs=("dv",),
         hint="wrong when dv != d"),
]:
    register_case(_case)


# --------------------------------------------------------------------------------------------
# The variants' cases (flash_lib's keywords; FlashAttention's and FlexAttention's conventions)
# --------------------------------------------------------------------------------------------

#: The ALiBi paper's slopes for H heads, 2^(-8 (h + 1) / H) (attention-gym's generate_alibi_bias).
def _alibi_slopes(heads):
    return 2.0 ** (-8 * (np.arange(heads) + 1) / heads)


def _window(rng, dtype):
    # Nq < Nk, so the window's offset Nk - Nq = 30 matters; both edges inside the keys.
    q, k, v = random_qkv(rng, 60, 90, dtype=dtype, batch=(2,))
    return Inputs(q, k, v, {"window": (7, 3)})


def _window_zero(rng, dtype):
    # window (0, 0): query i sees key i + (Nk - Nq) alone, so out is exactly that value row.
    q, k, v = random_qkv(rng, 40, 50, dtype=dtype)
    return Inputs(q, k, v, {"window": (0, 0)})


def _window_and_mask(rng, dtype):
    # (12, None) ANDed with causal is (12, 0); Nq > Nk empties the first 20 rows; and key padding.
    q, k, v = random_qkv(rng, 80, 60, dtype=dtype, batch=(2,))
    mask = np.ones((2, 1, 60), dtype=bool)
    mask[1, :, 50:] = False
    return Inputs(q, k, v, {"window": (12, None), "causal": True, "mask": mask})


def _capped_qkv(rng, n_q, n_k, dtype, batch=()):
    # q scaled up: scaled scores of spread ~4, so that a cap of 3 bites on most rows
    q, k, v = random_qkv(rng, n_q, n_k, batch=batch)
    return (4 * q).astype(dtype), k.astype(dtype), v.astype(dtype)


def _softcap(rng, dtype):
    return Inputs(*_capped_qkv(rng, 48, 96, dtype, batch=(2,)), {"softcap": 3.0})


def _softcap_causal(rng, dtype):
    # Nq = Nk: the first rows may see few keys and must not see many
    return Inputs(*_capped_qkv(rng, 64, 64, dtype), {"softcap": 3.0, "causal": True})


def _alibi(rng, dtype):
    q, k, v = random_qkv(rng, 40, 70, dtype=dtype, batch=(2, 4))
    return Inputs(q, k, v, {"alibi_slopes": _alibi_slopes(4)})


def _alibi_cap_causal(rng, dtype):
    q, k, v = _capped_qkv(rng, 50, 80, dtype, batch=(2, 4))
    slopes = np.stack([_alibi_slopes(4), _alibi_slopes(4)[::-1]])  # (B, H)
    return Inputs(q, k, v, {"alibi_slopes": slopes, "softcap": 3.0, "causal": True})


def _gqa(rng, dtype):
    q = rng.standard_normal((2, 6, 40, 16)).astype(dtype)
    k, v = (rng.standard_normal((2, 2, 70, 16)).astype(dtype) for _ in range(2))
    return Inputs(q, k, v, {"enable_gqa": True})


def _mqa_causal(rng, dtype):
    q = rng.standard_normal((2, 4, 30, 16)).astype(dtype)
    k, v = (rng.standard_normal((2, 1, 50, 16)).astype(dtype) for _ in range(2))
    return Inputs(q, k, v, {"enable_gqa": True, "causal": True})


def _document_ids():
    # Two packed sequences of 100 tokens; -1 marks padding, which sees nothing and is seen by none.
    first = np.repeat([0, 1, 2, 3, 4], [5, 12, 3, 40, 40])
    second = np.repeat([0, 1, 2, -1], [9, 46, 30, 15])
    return np.stack([first, second])


def _same_document(docs):
    def mask_mod(q_idx, k_idx):  # (2, rows, keys): one layout per sequence of the batch
        return (docs[:, q_idx] == docs[:, k_idx]) & (docs[:, q_idx] >= 0)
    return mask_mod


def _mask_mod_document(rng, dtype):
    q, k, v = random_qkv(rng, 100, 100, dtype=dtype, batch=(2,))
    return Inputs(q, k, v, {"mask_mod": _same_document(_document_ids()), "causal": True})


def _prefix_lm(q_idx, k_idx):
    return (k_idx < 30) | (k_idx <= q_idx)


def _mask_mod_prefix(rng, dtype):
    return Inputs(*random_qkv(rng, 90, 90, dtype=dtype), {"mask_mod": _prefix_lm})


def _dilated(q_idx, k_idx):
    distance = np.abs(q_idx - k_idx)
    return (distance <= 40) & (distance % 3 == 0)


def _mask_mod_dilated(rng, dtype):
    return Inputs(*random_qkv(rng, 100, 100, dtype=dtype), {"mask_mod": _dilated})


_WINDOW_HINT = ("wrong with a window: its edges are off by one, or it is not aligned "
                "bottom-right (keys i + (Nk - Nq) - left ... i + (Nk - Nq) + right)")
_SOFTCAP_HINT = "wrong with softcap: c * tanh(s / c) on the scaled scores, before bias and masks"
_ALIBI_HINT = "wrong with ALiBi: the bias is -slope_h * |i + (Nk - Nq) - j|, one slope per head"
_GQA_HINT = "wrong with grouped-query heads: query head h reads kv head h // (Hq / Hkv)"
_MASK_MOD_HINT = ("wrong with mask_mod: it is called with global positions, True = may attend, "
                  "and a tile may be skipped only where it is False on every pair")

for _case in [
    Case("window", "sliding window (7, 3) with Nq = 60 < Nk = 90: both edges, offset 30",
         _window, needs=("window",), hint=_WINDOW_HINT),
    Case("window_zero", "window (0, 0): each query sees exactly key i + (Nk - Nq)", _window_zero,
         needs=("window",), hint=_WINDOW_HINT),
    Case("window_and_mask", "window (12, None) with causal (Nq = 80 > Nk = 60: 20 empty rows) "
         "and key padding, ANDed", _window_and_mask, needs=("window", "causal", "mask"),
         hint=_WINDOW_HINT),
    Case("softcap", "softcap 3 on scores of spread ~4", _softcap, needs=("softcap",),
         hint=_SOFTCAP_HINT),
    Case("softcap_causal", "softcap 3 with causal, Nq = Nk = 64: masked scores must stay -inf",
         _softcap_causal, needs=("softcap", "causal"), hint=_SOFTCAP_HINT),
    Case("alibi", "ALiBi, 4 heads, slopes 2^(-8(h+1)/H), not causal, Nq = 40 < Nk = 70",
         _alibi, needs=("alibi",), hint=_ALIBI_HINT),
    Case("alibi_cap_causal", "ALiBi with (B, H) slopes, softcap 3 and causal, Nq = 50 < "
         "Nk = 80", _alibi_cap_causal, needs=("alibi", "softcap", "causal"),
         hint=_ALIBI_HINT),
    Case("gqa", "grouped-query attention, Hq = 6 over Hkv = 2", _gqa, needs=("gqa",),
         hint=_GQA_HINT),
    Case("mqa_causal", "multi-query attention (Hkv = 1) with causal, Nq = 30 < Nk = 50",
         _mqa_causal, needs=("gqa", "causal"), hint=_GQA_HINT),
    Case("mask_mod_document", "mask_mod: packed documents, one layout per sequence (leading "
         "dim), padding rows empty, with causal", _mask_mod_document,
         needs=("mask_mod", "causal"), hint=_MASK_MOD_HINT),
    Case("mask_mod_prefix", "mask_mod: prefix-LM, (k < 30) | (k <= q)", _mask_mod_prefix,
         needs=("mask_mod",), hint=_MASK_MOD_HINT),
    Case("mask_mod_dilated", "mask_mod: dilated window, |i - j| <= 40 and divisible by 3 (sparse "
         "inside tiles)", _mask_mod_dilated, needs=("mask_mod",), hint=_MASK_MOD_HINT),
]:
    register_case(_case)


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Failure:
    """One failed check: where, what was measured against which bound, and the likely cause."""

    case: str
    dtype: str
    check: str
    measured: str
    bound: str
    diagnosis: str

    def __str__(self):
        return (f"{self.case} [{self.dtype}] {self.check}: {self.measured} (bound: {self.bound})"
                f"\n    diagnosis: {self.diagnosis}")


@dataclasses.dataclass(frozen=True)
class Skip:
    """A case that was not run, and why (a feature or dtype the kernel was not checked for)."""

    case: str
    reason: str


@dataclasses.dataclass
class Result:
    """One case in one dtype: the errors measured, naive's, the bounds (None where not measured)."""

    case: str
    dtype: str
    out_error: float | None = None
    out_naive: float | None = None
    out_bound: float | None = None
    lse_error: float | None = None
    lse_naive: float | None = None
    lse_bound: float | None = None
    note: str = ""
    failures: list = dataclasses.field(default_factory=list)

    @property
    def ok(self):
        return not self.failures


@dataclasses.dataclass
class Report:
    """What :func:`check_kernel` found. ``ok`` is True when no check failed."""

    kernel: str
    features: tuple
    dtypes: tuple
    lse_empty: float
    results: list
    skipped: list

    @property
    def failures(self):
        """Every :class:`Failure`, in the order the cases ran."""
        return [f for r in self.results for f in r.failures]

    @property
    def ok(self):
        return not self.failures

    def failed_cases(self):
        """The names of the cases with a failure, each once, in order."""
        return list(dict.fromkeys(f.case for f in self.failures))

    def by_dtype(self):
        """``{dtype: failing case names}`` for every dtype in :data:`DTYPES`; None if not run."""
        return {dtype: ([r.case for r in self.results if r.dtype == dtype and not r.ok]
                        if any(r.dtype == dtype for r in self.results) else None)
                for dtype in DTYPES}

    def __str__(self):
        def num(x):
            return "" if x is None else f"{x:.2g}"

        lines = [
            f"check_kernel({self.kernel})",
            f"features: {', '.join(self.features) or '(none)'}; dtypes: {', '.join(self.dtypes)};"
            f" lse_empty: {self.lse_empty}",
            f"bound: error <= {FACTOR:g} x naive_attention's error (same dtype, vs "
            f"precise_attention) + a floor of a few eps",
            "",
            f"{'case':<18} {'dtype':<8} {'out err':>8} {'bound':>8} {'lse err':>8} "
            f"{'bound':>8}  result",
        ]
        for r in self.results:
            status = "ok" if r.ok else "FAIL: " + ", ".join(dict.fromkeys(f.check for f in r.failures))
            lines.append(f"{r.case:<18} {r.dtype:<8} {num(r.out_error):>8} {num(r.out_bound):>8} "
                         f"{num(r.lse_error):>8} {num(r.lse_bound):>8}  {status}"
                         + (f"  ({r.note})" if r.note else ""))
        failures = self.failures
        if failures:
            lines += ["", f"{len(failures)} failure(s):"]
            lines += [f"  {f}" for f in failures]
        if self.skipped:
            lines += ["", f"skipped ({len(self.skipped)}):"]
            lines += [f"  {s.case}: {s.reason}" for s in self.skipped]
        n_bad = sum(not r.ok for r in self.results)
        lines += ["", f"{'PASS' if self.ok else 'FAIL'}: {len(self.results) - n_bad} of "
                  f"{len(self.results)} case runs passed, {len(self.skipped)} skipped"]
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The references, computed once per case, dtype and seed
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _Reference:
    inputs: Inputs
    out: np.ndarray  # the truth (longdouble)
    lse: np.ndarray
    naive_out: np.ndarray
    naive_lse: np.ndarray
    rows: np.ndarray  # rows measured for accuracy: allowed keys, not NaN by design
    empty: np.ndarray  # rows with no allowed key


@functools.lru_cache(maxsize=512)
def _reference(case, dtype, seed):
    rng = np.random.default_rng([seed, zlib.crc32(case.name.encode())])
    inputs = case.make(rng, np.dtype(dtype))
    q, k, v = inputs.clean if inputs.clean is not None else (inputs.q, inputs.k, inputs.v)
    with np.errstate(invalid="ignore"):  # the NaN row of nan_in_q
        out, lse = flash_lib.precise_attention(q, k, v, **inputs.kwargs, return_lse=True)
        naive_out, naive_lse = flash_lib.naive_attention(q, k, v, **inputs.kwargs,
                                                         return_lse=True)
    nan_rows = np.zeros(lse.shape, bool) if inputs.nan_rows is None else inputs.nan_rows
    empty = (lse == -np.inf) & ~nan_rows
    rows = ~empty & ~nan_rows
    if not (np.isfinite(out[rows]).all() and np.isfinite(naive_out[rows]).all()):
        raise RuntimeError(f"case {case.name!r} ({dtype}): the references are not finite")
    for x in (inputs.q, inputs.k, inputs.v, out, lse, naive_out, naive_lse, rows, empty):
        x.flags.writeable = False
    return _Reference(inputs, out, lse, naive_out, naive_lse, rows, empty)


def _max_error(out, ref):
    """The largest rowwise relative error (0 for no rows)."""
    if out.shape[0] == 0:
        return 0.0
    return float(flash_lib.rowwise_relative_error(out, ref).max())


def _lse_error(lse, ref):
    if lse.size == 0:
        return 0.0
    wide = np.result_type(lse, ref, np.float64)
    lse, ref = lse.astype(wide), ref.astype(wide)
    with np.errstate(invalid="ignore"):
        err = np.abs(lse - ref) / (1 + np.abs(ref))
    return float(np.where(np.isnan(err), np.inf, err).max())


# --------------------------------------------------------------------------------------------
# Running one case
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Context:
    """What a case's check sees: the kernel, the settings, the earlier results (for diagnoses)."""

    fn: Callable
    case: Case
    dtype: str
    features: tuple
    lse_empty: float
    seed: int
    done: dict  # (case name, dtype) -> Result, for the runs so far

    def fail(self, result, check, measured, bound, diagnosis):
        result.failures.append(Failure(self.case.name, self.dtype, check, measured, bound,
                                       diagnosis))


def _call(fn, q, k, v, kwargs):
    """Call the kernel with fresh copies; floating-point warnings are recorded, not shown."""
    with warnings.catch_warnings(record=True) as caught, np.errstate(all="ignore"):
        warnings.simplefilter("always")
        result = fn(q, k, v, **kwargs)
    return result, caught


def _split(result, want_lse):
    """(out, lse) from what the kernel returned, or a string saying what is wrong with it."""
    if want_lse:
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            return None, None, (f"returned {type(result).__name__}, expected (out, lse) because "
                                f"'lse' is among the features")
        out, lse = result
        return np.asarray(out), np.asarray(lse), None
    if isinstance(result, (tuple, list)):
        return None, None, (f"returned a {type(result).__name__} of {len(result)}, expected out "
                            f"alone ('lse' is not among the features)")
    return np.asarray(result), None, None


def _accuracy(ctx):
    """The default check: shape, inputs untouched, empty rows, NaN rows, out and lse errors."""
    ref = _reference(ctx.case, ctx.dtype, ctx.seed)
    inputs = ref.inputs
    result = Result(ctx.case.name, ctx.dtype)
    want_lse = "lse" in ctx.features
    q, k, v = (x.copy() for x in (inputs.q, inputs.k, inputs.v))
    kwargs = {key: (val.copy() if isinstance(val, np.ndarray) else val)
              for key, val in inputs.kwargs.items()}
    try:
        returned, caught = _call(ctx.fn, q, k, v, kwargs)
    except Exception as exc:  # the kernel's own error is the finding
        used = ", ".join(f"{key}=" for key in inputs.kwargs) or "no keyword"
        message = " ".join(str(exc).split())
        ctx.fail(result, "raised", f"{type(exc).__name__}: {message[:160]}", "no exception",
                 f"the kernel raised on this case ({used}; q {inputs.q.shape}, k "
                 f"{inputs.k.shape}, v {inputs.v.shape}); if it does not support what the "
                 f"case needs ({', '.join(ctx.case.needs) or 'nothing beyond the basics'}), "
                 f"leave that feature out")
        return result
    if caught:
        result.note = f"warned: {caught[0].message}"[:60]
    if not all(np.array_equal(a, b, equal_nan=True) for a, b in
               ((q, inputs.q), (k, inputs.k), (v, inputs.v))):
        ctx.fail(result, "inputs", "q, k or v changed during the call", "inputs untouched",
                 "the kernel writes into its inputs (an in-place scale or mask?)")
    out, lse, problem = _split(returned, want_lse)
    if problem is None and out.shape != ref.out.shape:
        problem = f"out has shape {out.shape}, expected {ref.out.shape}"
    if problem is None and want_lse and lse.shape != ref.lse.shape:
        problem = f"lse has shape {lse.shape}, expected {ref.lse.shape} (out.shape[:-1])"
    if problem is not None:
        ctx.fail(result, "shape", problem, "as documented", problem)
        return result

    why = _Diagnosis(ctx, ref, out, lse)
    _check_empty_rows(ctx, result, ref, out, lse, why)
    _check_nan_rows(ctx, result, ref, out, lse)

    rows = ref.rows
    bad = rows & ~np.isfinite(out).all(axis=-1)
    if bad.any():
        ctx.fail(result, "non-finite", f"{_nonfinite_kind(out[bad])} in {int(bad.sum())} of "
                 f"{int(rows.sum())} rows", "finite wherever the exact output is",
                 why.explain_nonfinite(bad))
    measured = rows & ~bad
    err = _max_error(out[measured], ref.out[measured])
    naive = _max_error(ref.naive_out[measured], ref.out[measured])
    bound = FACTOR * naive + OUT_FLOOR[ctx.dtype]
    result.out_error, result.out_naive, result.out_bound = err, naive, bound
    why.out_error = err
    if err > bound:
        why.out_failed = True
        ctx.fail(result, "out error", f"{err:.2g}", f"{FACTOR:g} x naive's {naive:.2g} + "
                 f"{OUT_FLOOR[ctx.dtype]:.2g} = {bound:.2g}", why.explain_out())
    if want_lse:
        bad = rows & ~np.isfinite(lse)
        measured = rows & ~bad
        err = _lse_error(lse[measured], ref.lse[measured])
        naive = _lse_error(ref.naive_lse[measured], ref.lse[measured])
        bound = FACTOR * naive + LSE_FLOOR[ctx.dtype]
        result.lse_error, result.lse_naive, result.lse_bound = err, naive, bound
        if bad.any():
            ctx.fail(result, "lse non-finite", f"{_nonfinite_kind(lse[bad])} in "
                     f"{int(bad.sum())} of {int(rows.sum())} rows",
                     "finite wherever the exact lse is", why.explain_nonfinite(bad, of_lse=True))
        if err > bound:
            ctx.fail(result, "lse error", f"{err:.2g}", f"{FACTOR:g} x naive's {naive:.2g} + "
                     f"{LSE_FLOOR[ctx.dtype]:.2g} = {bound:.2g}", why.explain_lse(measured, err))
    return result


def _nonfinite_kind(x):
    kinds = [name for name, hit in (("NaN", np.isnan(x).any()), ("+inf", (x == np.inf).any()),
                                    ("-inf", (x == -np.inf).any())) if hit]
    return "/".join(kinds)


def _check_empty_rows(ctx, result, ref, out, lse, why):
    empty = ref.empty
    if not empty.any():
        return
    rows = out[empty]
    n = int(empty.sum())
    not_zero = ~(rows == 0).all(axis=-1)
    if not_zero.any():
        nan = np.isnan(rows).any(axis=-1)
        what = (f"{int(nan.sum())} of {n} rows NaN" if nan.any()
                else f"{int(not_zero.sum())} of {n} rows not 0 (max |out| {np.abs(rows).max():.2g})")
        ctx.fail(result, "empty rows", what, "out exactly 0", why.explain_empty(rows, nan))
    if lse is not None:
        got = lse[empty].astype(np.float64)
        same = (got == ctx.lse_empty) | (np.isnan(got) & np.isnan(ctx.lse_empty))
        if not same.all():
            values = ", ".join(f"{x:.6g}" for x in np.unique(got[~same])[:3])
            ctx.fail(result, "empty lse", f"lse {values} in {int((~same).sum())} of {n} rows",
                     f"lse_empty = {ctx.lse_empty}", why.explain_empty_lse(got[~same], values))


def _check_nan_rows(ctx, result, ref, out, lse):
    nan_rows = ref.inputs.nan_rows
    if nan_rows is None:
        return
    stays = np.isnan(out[nan_rows]).all()
    if lse is not None:
        stays = stays and np.isnan(lse[nan_rows]).all()
    if not stays:
        ctx.fail(result, "NaN row", "a row of q holding NaN gave numbers", "that row all NaN",
                 "the NaN in q became a silent number: NaN must propagate (a NaN-ignoring max "
                 "such as np.fmax or np.nanmax, or a where() that hides it?)")


def _passed(ctx, case, dtype):
    result = ctx.done.get((case, dtype))
    return result is not None and result.ok


_KEEP = object()  # "as the case says", for _Diagnosis.allowed
#: The keywords that decide which pairs may attend.
_PAIRWISE = ("mask", "causal", "window", "mask_mod")
#: The keywords whose answer depends on the keys' positions or heads.
_POSITIONAL = ("window", "alibi_slopes", "mask_mod", "enable_gqa")
#: Block sizes tried when a mistake depends on the kernel's tiles (square tiles).
_BLOCKS = (8, 16, 32, 64, 128, 256, 512)


def _alibi_bias(slopes, n_q, n_k, form):
    """ALiBi's bias, (..., Nq, Nk), in one of its forms: FlashAttention's ("bottom-right",
    -slope·|i + (Nk - Nq) - j|) and the mistakes "flipped", "top-left" and "gym" (attention-gym's
    slope·(j - i), right only under causal masking)."""
    i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    slopes = np.asarray(slopes, np.longdouble)[..., None, None]
    distance = {"bottom-right": np.abs(i + (n_k - n_q) - j), "flipped": -np.abs(i + (n_k - n_q) - j),
                "top-left": np.abs(i - j), "gym": i - j}[form]
    return -slopes * distance


def _dense_variant(q, k, v, scale, allowed, *, softcap=None, bias=None, cap_at="scores",
                   groups=None):
    """Attention with the variants written out densely, in longdouble, for the diagnoses: the
    truth with the defaults, a classic mistake otherwise. ``cap_at``: where softcap is applied,
    "scores" (the scaled scores: right), "unscaled" (q·kᵀ before the scale), "biased" (after
    the ALiBi bias) or "masked" (after the mask, where c·tanh(-inf) = -c). ``groups``: None, or
    how query heads find their kv head, "repeat" (h // (Hq/Hkv): right) or "tile" (h mod Hkv)."""
    wide = np.longdouble
    q, k, v = (x.astype(wide) for x in (q, k, v))
    if groups is not None:
        g = q.shape[-3] // k.shape[-3]
        if groups == "repeat":
            k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
        else:
            reps = (1,) * (k.ndim - 3) + (g, 1, 1)
            k, v = np.tile(k, reps), np.tile(v, reps)
    raw = q @ np.swapaxes(k, -1, -2)
    cap = None if softcap is None else wide(softcap)

    def capped(x):
        return cap * np.tanh(x / cap)

    s = wide(scale) * (capped(raw) if cap is not None and cap_at == "unscaled" else raw)
    if cap is not None and cap_at == "scores":
        s = capped(s)
    if bias is not None:
        s = s + bias
    if cap is not None and cap_at == "biased":
        s = capped(s)
    s = np.where(allowed, s, -np.inf)
    if cap is not None and cap_at == "masked":
        s = capped(s)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    total = p.sum(axis=-1, keepdims=True)
    return (p @ v) / np.where(total == 0, 1, total)


def _tile_corners_kept(allowed, block):
    """For square tiles of ``block``: True on the pairs of every tile where ``allowed`` holds at
    one of its four corners (what a kernel that tests only the corners would compute)."""
    n_q, n_k = allowed.shape[-2:]
    kept = np.zeros(allowed.shape, dtype=bool)
    for q0 in range(0, n_q, block):
        q1 = min(q0 + block, n_q) - 1
        for k0 in range(0, n_k, block):
            k1 = min(k0 + block, n_k) - 1
            corners = allowed[..., [q0, q0, q1, q1], [k0, k1, k0, k1]].any(axis=-1)
            kept[..., q0:q1 + 1, k0:k1 + 1] = corners[..., None, None]
    return kept


class _Diagnosis:
    """Finds the likely cause of a failure, by comparing the kernel's output with the outputs of
    known mistakes (top-left causal, a dropped key block, an ignored scale, the variants'
    classic mistakes) and, where that is not enough, by probing the kernel on one row with its
    keys reordered."""

    def __init__(self, ctx, ref, out, lse):
        self.ctx, self.ref, self.out, self.lse = ctx, ref, out, lse
        self.inputs = ref.inputs
        self.q, self.k, self.v = (ref.inputs.clean if ref.inputs.clean is not None
                                  else (ref.inputs.q, ref.inputs.k, ref.inputs.v))
        self.n_q, self.n_k = ref.out.shape[-2], ref.inputs.k.shape[-2]
        self.out_error = None  # set by the caller once measured
        self.out_failed = False
        self._out = None

    # What the kernel output is compared with -------------------------------------------------

    def allowed(self, window=_KEEP, mask_mod=_KEEP, window_offset=None, causal_offset=None):
        """The (..., Nq, Nk) pairs that may attend, from the case's mask, causal, window and
        mask_mod, written out here from their definitions; a mistake's pairs with the keywords
        replaced (``window``, ``mask_mod``) or the diagonal moved (``*_offset``, default
        Nk - Nq)."""
        kwargs = self.inputs.kwargs
        offset = self.n_k - self.n_q
        rel = np.arange(self.n_k)[None, :] - np.arange(self.n_q)[:, None]  # j - i
        allowed = np.ones(self.ref.lse.shape + (self.n_k,), dtype=bool)
        if kwargs.get("mask") is not None:
            allowed = allowed & kwargs["mask"]
        if kwargs.get("causal"):
            allowed = allowed & (rel <= (offset if causal_offset is None else causal_offset))
        window = kwargs.get("window") if window is _KEEP else window
        if window is not None:
            shift = rel - (offset if window_offset is None else window_offset)
            left, right = window
            if left is not None:
                allowed = allowed & (shift >= -left)
            if right is not None:
                allowed = allowed & (shift <= right)
        mask_mod = kwargs.get("mask_mod") if mask_mod is _KEEP else mask_mod
        if mask_mod is not None:
            allowed = allowed & np.asarray(mask_mod(np.arange(self.n_q)[:, None],
                                                    np.arange(self.n_k)[None, :]), dtype=bool)
        return allowed

    def positional(self):
        """True if the case's answer depends on where each key is (window, ALiBi, mask_mod) or
        which head it belongs to (GQA), so that reordering or dropping keys changes it."""
        return any(key in self.inputs.kwargs for key in _POSITIONAL)

    def _other_kwargs(self, *drop):
        return {key: val for key, val in self.inputs.kwargs.items() if key not in drop}

    def _closer_to(self, alt, rows=None):
        """True if the kernel's output is far closer to ``alt`` than to the truth."""
        rows = self.ref.rows if rows is None else rows
        to_alt = _max_error(self.out[rows], alt[rows])
        to_truth = _max_error(self.out[rows], self.ref.out[rows])
        return to_alt <= 0.01 * to_truth and to_alt < 1e-2

    def top_left(self):
        if (not self.inputs.kwargs.get("causal") or self.n_q == self.n_k
                or "window" in self.inputs.kwargs):  # the window's own diagnoses say it
            return None
        mask = np.tril(np.ones((self.n_q, self.n_k), dtype=bool))
        if self.inputs.kwargs.get("mask") is not None:
            mask = mask & self.inputs.kwargs["mask"]
        alt = flash_lib.precise_attention(self.q, self.k, self.v, mask=mask,
                                          **self._other_kwargs("mask", "causal"))
        everywhere = np.ones(self.ref.lse.shape, dtype=bool)
        if self._closer_to(alt, everywhere):
            return (f"causal is aligned top-left (key j allowed iff j <= i): with Nq = {self.n_q} "
                    f"!= Nk = {self.n_k} it must be bottom-right, j <= i + (Nk - Nq) "
                    f"(FlashAttention >= 2.1; in PyTorch pass "
                    f"torch.nn.attention.bias.causal_lower_right, not is_causal=True)")
        return None

    def dropped_keys(self):
        if "alibi_slopes" in self.inputs.kwargs:  # the bias depends on Nk: not comparable
            return None
        allowed = np.broadcast_to(self.allowed(), self.ref.lse.shape + (self.n_k,))
        for b in (8, 16, 32, 64, 128, 256, 512):
            n = self.n_k - self.n_k % b
            if n == self.n_k:
                continue
            if n == 0:
                alt = np.zeros(self.ref.out.shape)
            else:
                alt = flash_lib.precise_attention(self.q, self.k[..., :n, :], self.v[..., :n, :],
                                                  mask=allowed[..., :n],
                                                  **self._other_kwargs(*_PAIRWISE))
            if self._closer_to(alt):
                return (f"the output is attention over the first {n} of {self.n_k} keys: the "
                        f"last partial key block is dropped (block_k divides {n}; loop to Nk, "
                        f"not to the last multiple of block_k)")
        return None

    def tail_rows(self):
        row_err = flash_lib.rowwise_relative_error(self.out, self.ref.out)
        wrong = np.where(self.ref.rows, row_err, 0) > 1e-2
        wrong = wrong.any(axis=tuple(range(wrong.ndim - 1)))
        for b in (8, 16, 32, 64, 128, 256, 512):
            first = self.n_q - self.n_q % b
            if 0 < first < self.n_q and wrong[first:].all() and not wrong[:first].any():
                return (f"rows {first} to {self.n_q - 1} are wrong, the rows before them right: "
                        f"the last partial query block is dropped or mishandled (block_q "
                        f"divides {first})")
        return None

    def scale_ignored(self):
        scale = self.inputs.kwargs.get("scale")
        if scale is None:
            return None
        alt = flash_lib.precise_attention(self.q, self.k, self.v, **self._other_kwargs("scale"))
        if self._closer_to(alt):
            return (f"the scale argument ({scale:g}) is ignored: the output is attention with "
                    f"the default 1/sqrt(d)")
        return None

    def key_order(self):
        """Probe one row: right with its keys in descending order of score, wrong ascending?

        Attention does not depend on the order of the keys. A kernel that forgets to rescale l
        and acc when the running max rises (or exponentiates against the previous max) is
        right when the max comes first and wrong when it rises, whatever its block size.
        """
        ctx, ref = self.ctx, self.ref
        if self.positional():  # reordering keys changes the answer
            return None
        allowed = np.broadcast_to(self.allowed(), ref.lse.shape + (self.n_k,))
        row_err = flash_lib.rowwise_relative_error(self.out, ref.out)
        candidates = ref.rows & (allowed.sum(axis=-1) >= 2)
        if not candidates.any():
            return None
        row = np.unravel_index(np.argmax(np.where(candidates, row_err, -1)), row_err.shape)
        batch = ref.lse.shape[:-1]
        q, k, v = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (self.q, self.k, self.v))
        keys = allowed[row]
        q_row = q[row[:-1]][row[-1]][None]
        k_row, v_row = k[row[:-1]][keys], v[row[:-1]][keys]
        score = (k_row.astype(np.float64) @ q_row[0].astype(np.float64))
        other = self._other_kwargs("mask", "causal")
        errors = []
        for order in (np.argsort(-score, kind="stable"), np.argsort(score, kind="stable")):
            args = (q_row.copy(), k_row[order].copy(), v_row[order].copy())
            try:
                returned, _ = _call(ctx.fn, *args, dict(other))
            except Exception:
                return None
            out, _, problem = _split(returned, "lse" in ctx.features)
            if problem or out.shape != (1, v_row.shape[-1]):
                return None
            truth = flash_lib.precise_attention(*args, **other)
            naive = flash_lib.naive_attention(*args, **other)
            errors.append((_max_error(out, truth),
                           FACTOR * _max_error(naive, truth) + OUT_FLOOR[ctx.dtype]))
        (err_first, bound_first), (err_last, bound_last) = errors
        if err_first <= bound_first and not err_last <= 10 * bound_last:
            return (f"the result depends on the order of the keys: on one row, error "
                    f"{err_first:.2g} with its largest score first, {err_last:.2g} with it last: "
                    f"when the running max rises from m to m', l and acc are not rescaled by "
                    f"exp(m - m') (or p is taken against the old max)")
        return None

    def _variant(self, allowed=None, softcap=_KEEP, alibi="bottom-right", cap_at="scores",
                 groups="repeat"):
        """The case's attention written out densely, with one thing changed (a mistake)."""
        kwargs = self.inputs.kwargs
        scale = kwargs.get("scale")
        scale = 1 / math.sqrt(self.q.shape[-1]) if scale is None else scale
        slopes = kwargs.get("alibi_slopes")
        bias = None if slopes is None or alibi is None else _alibi_bias(slopes, self.n_q,
                                                                        self.n_k, alibi)
        return _dense_variant(
            self.q, self.k, self.v, scale, self.allowed() if allowed is None else allowed,
            softcap=kwargs.get("softcap") if softcap is _KEEP else softcap, bias=bias,
            cap_at=cap_at, groups=groups if kwargs.get("enable_gqa") else None)

    def _variant_alternatives(self):
        """(diagnosis, output) for each classic mistake of the variants this case uses."""
        kwargs = self.inputs.kwargs
        window, cap = kwargs.get("window"), kwargs.get("softcap")
        mask_mod, slopes = kwargs.get("mask_mod"), kwargs.get("alibi_slopes")
        if window is not None:
            left, right = window
            for side, value, edge in (("left", left, "i + (Nk - Nq) - left <= j"),
                                      ("right", right, "j <= i + (Nk - Nq) + right")):
                for alt in (() if value is None else (value - 1, value + 1)):
                    if alt < 0:
                        continue
                    other = (alt, right) if side == "left" else (left, alt)
                    yield (f"window off by one at the {side} edge: the kernel computes "
                           f"window={other}, not {window} (the window is inclusive: {edge})",
                           self._variant(self.allowed(window=other)))
            yield ("the window is aligned top-left (around j = i), not bottom-right around "
                   "j = i + (Nk - Nq) as FlashAttention's window_size",
                   self._variant(self.allowed(window_offset=0)))
            yield ("the window and causal are both aligned top-left (around j = i), not "
                   "bottom-right (j = i + (Nk - Nq))",
                   self._variant(self.allowed(window_offset=0, causal_offset=0)))
            if left != right:
                yield (f"the window's sides are swapped: window=(left, right) counts left keys "
                       f"before the diagonal and right after it, got {window[::-1]}",
                       self._variant(self.allowed(window=window[::-1])))
            yield "the window is ignored", self._variant(self.allowed(window=None))
        if cap is not None:
            if not self.allowed().all():
                yield ("softcap applied after the mask: c·tanh(-inf / c) = -c, so masked keys get "
                       "weight exp(-c - m); cap the scaled scores first, then set masked ones to "
                       "-inf", self._variant(cap_at="masked"))
            if slopes is not None:
                yield ("softcap applied after the ALiBi bias: cap the scaled scores, then add "
                       "the bias (FlashAttention's order)", self._variant(cap_at="biased"))
            yield ("softcap applied to q·kᵀ before the scale: it caps the scaled scores, "
                   "c·tanh(τ·q·kᵀ / c) (FlashAttention passes softmax_scale / softcap to tanh)",
                   self._variant(cap_at="unscaled"))
            yield "softcap is ignored", self._variant(softcap=None)
        if slopes is not None:
            yield ("ALiBi's sign is flipped: the bias is -slope·|i + (Nk - Nq) - j|, a penalty "
                   "growing with the distance", self._variant(alibi="flipped"))
            yield ("ALiBi's distance is aligned top-left, |i - j|: FlashAttention measures it "
                   "from the query's position, |i + (Nk - Nq) - j|", self._variant(alibi="top-left"))
            if not kwargs.get("causal"):
                yield ("ALiBi written as slope·(j - i) (attention-gym's score_mod): that equals "
                       "-slope·|i + (Nk - Nq) - j| up to a constant per row only under causal "
                       "masking; without it, keys after the diagonal get a bonus instead of a "
                       "penalty", self._variant(alibi="gym"))
            yield "ALiBi's bias is ignored", self._variant(alibi=None)
        if kwargs.get("enable_gqa"):
            yield ("GQA grouped as h mod Hkv instead of h // (Hq/Hkv): query heads 0, 1, ... of "
                   "a group are consecutive (FlashAttention: 'head 0, 1, 2 of Q will attention to "
                   "head 0 of K, V'; SDPA: repeat_interleave), not every Hkv-th head "
                   "(np.tile, Tensor.repeat)", self._variant(groups="tile"))
        if mask_mod is not None:
            i, j = np.arange(self.n_q)[:, None], np.arange(self.n_k)[None, :]
            mod = np.asarray(mask_mod(i, j), dtype=bool)
            yield ("mask_mod's result is inverted: True means may attend (FlexAttention's "
                   "convention), not masked out",
                   self._variant(self.allowed(mask_mod=lambda a, b: ~mod)))
            yield ("mask_mod is called with its arguments swapped: it takes (q_idx, k_idx), "
                   "in that order", self._variant(self.allowed(
                       mask_mod=lambda a, b: np.asarray(mask_mod(b, a), dtype=bool))))
            if mod.ndim > 2 and mod.shape[0] > 1:
                first = mod[(0,) * (mod.ndim - 2)]
                yield ("mask_mod's leading (batch, head) dims are dropped: its first entry is "
                       "used for every sequence", self._variant(
                           self.allowed(mask_mod=lambda a, b: first)))
            yield ("mask_mod is ignored", self._variant(self.allowed(mask_mod=None)))
            for b in _BLOCKS:
                if b >= max(self.n_q, self.n_k):
                    break
                local = np.asarray(mask_mod(i % b, j % b), dtype=bool)
                yield (f"mask_mod is called with positions local to the tile (0 ... {b - 1}, "
                       f"block {b}), not global ones",
                       self._variant(self.allowed(mask_mod=lambda a, c: local)))
                yield (f"tiles are skipped when mask_mod is False at their four corners (block "
                       f"{b}): a tile may be skipped only if mask_mod is False on every pair of "
                       f"it (create_block_mask sums the whole block)",
                       self._variant(self.allowed() & _tile_corners_kept(mod, b)))

    def variant_mistakes(self):
        """The classic mistake of a variant that explains the output, if one does: the kernel's
        output is within 5% of its distance to the truth from that mistake's output."""
        if not any(key in self.inputs.kwargs for key in _POSITIONAL + ("softcap",)):
            return None
        rows = self.ref.rows & np.isfinite(self.out).all(axis=-1)
        if not rows.any():
            return None
        to_truth = _max_error(self.out[rows], self.ref.out[rows])
        best = None
        for why, alt in self._variant_alternatives():
            to_alt = _max_error(self.out[rows], alt[rows])
            if to_alt <= 0.05 * to_truth and to_alt < 1e-2 and (best is None or to_alt < best[0]):
                best = (to_alt, why)
        return None if best is None else best[1]

    def precision_loss(self, err):
        eps32 = float(np.finfo(np.float32).eps)
        if self.ctx.dtype == "float64" and 1e-3 * eps32 < err < 1e3 * eps32:
            return (f"float64 result only as accurate as float32 (error {err:.2g}, float32's eps "
                    f"{eps32:.2g}): some step (scores, softmax or P·V) runs in float32")
        return None

    def float16_only(self):
        return self.ctx.dtype == "float16" and _passed(self.ctx, self.ctx.case.name, "float32")

    # The diagnoses ------------------------------------------------------------------------

    def explain_out(self):
        """Why the output's error is above the bound (computed once, reused for the lse)."""
        if self._out is None:
            self._out = (self.variant_mistakes() or self.top_left() or self.dropped_keys()
                         or self.tail_rows() or self.scale_ignored()
                         or self.precision_loss(self.out_error or 0.0) or self.key_order())
            if self._out is None and self.float16_only():
                self._out = ("fails in float16 only, where float32 passed: the sums are "
                             "accumulated in float16 (l, acc or P·V); accumulate in float32, as "
                             "FlashAttention does, and round once at the end")
            if self._out is None:
                self._out = self.ctx.case.hint or "error above the bound"
        return self._out

    def explain_nonfinite(self, bad, of_lse=False):
        name, inputs = self.ctx.case.name, self.inputs
        top_left = self.top_left()
        if top_left:
            return top_left
        if name == "late_max":
            return ("exp overflowed where the row max rises: p = exp(s - m) is taken against a "
                    "stale running max; use the new max m' = max(m, rowmax(s)) for p and for "
                    "the rescale exp(m - m')")
        if name == "float16_overflow" or self.float16_only():
            return ("non-finite in float16 only: scores past 65504 overflow float16; compute "
                    "q·kᵀ and the softmax in float32")
        if inputs.clean is not None:
            return ("non-finite values in k or v at keys these rows may not attend reached them "
                    "(0 · inf = NaN in P·V): leave masked keys out of P·V, or zero their v")
        if inputs.nan_rows is not None:
            return "the NaN in one row of q reached other rows: rows must stay independent"
        allowed = np.broadcast_to(self.allowed(), self.ref.lse.shape + (self.n_k,))
        values = self.lse[bad] if of_lse else self.out[bad]
        if np.isnan(values).any() and (~allowed[..., 0][bad]).all():
            return ("NaN in rows that have allowed keys but whose first keys are masked: a key "
                    "block with no allowed key gives exp(-inf - (-inf)) = NaN while the running "
                    "max is still -inf; guard it (a finite reference, e.g. 0, for such rows)")
        dropped = self.dropped_keys()
        if dropped:
            return dropped
        return f"non-finite where the exact result is finite: {self.ctx.case.hint}"

    def explain_empty(self, rows, nan):
        if nan.any() and self.inputs.clean is not None:
            return ("fully masked row is NaN: non-finite values in k or v at keys it may not "
                    "attend reached it (0 · inf = NaN in P·V): leave masked keys out of P·V, or "
                    "zero their v")
        if nan.any() and "mask_mod" in self.inputs.kwargs:
            return ("fully masked row is NaN: mask_mod allows none of its pairs, so its tiles are "
                    "skipped or all -inf and l = 0; out = acc / l is then 0 / 0 (or the "
                    "exp(-inf - (-inf)) guard is missing): return 0 where l = 0")
        if nan.any():
            return ("fully masked row is NaN: the exp(-inf - (-inf)) guard is missing (use a "
                    "finite reference, e.g. 0, where the running max is still -inf, and 0 "
                    "where l = 0)")
        top_left = self.top_left()
        if top_left:
            return top_left
        v_mean = np.broadcast_to(self.inputs.v.astype(np.float64).mean(axis=-2, keepdims=True),
                                 self.ref.out.shape)[self.ref.empty]
        tol = 2e-2 if self.ctx.dtype == "float16" else 1e-5
        if np.allclose(rows.astype(np.float64), v_mean, rtol=tol, atol=tol):
            return ("fully masked row gets uniform weights (the mean of all values): masked "
                    "scores are set to a large finite negative number (-1e9, -0.7 * finfo.max) "
                    "instead of -inf, and empty rows are not zeroed")
        return "fully masked rows are not 0: an empty row must give the empty sum, 0"

    def explain_empty_lse(self, got, values):
        expected = f"expected lse_empty = {self.ctx.lse_empty}"
        if np.isnan(got).any():
            return (f"the lse of a fully masked row is NaN, {expected}: log(0) or "
                    f"-inf - (-inf) of an empty row is not guarded")
        if np.isfinite(got).all() and (np.abs(got) > 1e6).all():
            return (f"the lse of a fully masked row is {values}, {expected}: masked scores are a "
                    f"large finite number rather than -inf")
        top_left = self.top_left()
        if top_left:
            return top_left
        return (f"the lse of a fully masked row is {values}, {expected}; if that is the "
                f"kernel's convention (FlashAttention writes +inf, PyTorch's CPU flash op 0.0), "
                f"pass it as lse_empty")

    def alibi_row_constant(self, rows):
        """Under causal masking, ALiBi written as slope·(j - i) (attention-gym) or slope·j
        (FlashAttention's CUDA kernel) gives the same output but an lse shifted by a constant
        per row: say which, if the lse is off by exactly that."""
        kwargs = self.inputs.kwargs
        if kwargs.get("alibi_slopes") is None or not kwargs.get("causal"):
            return None
        shape = self.ref.lse.shape
        slopes = np.broadcast_to(np.asarray(kwargs["alibi_slopes"], np.float64)[..., None], shape)
        position = np.arange(self.n_q) + (self.n_k - self.n_q)  # i + (Nk - Nq)
        shift = (self.lse.astype(np.float64) - self.ref.lse.astype(np.float64))[rows]
        forms = {"slope·(j - i), attention-gym's form, which shifts it by slope·(Nk - Nq)":
                 slopes * (self.n_k - self.n_q),
                 "slope·j, as FlashAttention's CUDA kernel adds it under causal "
                 "(csrc/flash_attn/src/alibi.h), which shifts it by slope·(i + Nk - Nq)":
                 slopes * position}
        for form, expected in forms.items():
            expected = expected[rows]
            if np.abs(expected).max(initial=0) > 1e-3 and np.allclose(shift, expected, rtol=1e-4,
                                                                       atol=1e-4):
                return (f"the output is right but the lse is that of ALiBi written as {form}: "
                        f"under causal masking the two biases differ by a constant per row, "
                        f"which softmax ignores and the lse does not; the lse expected is that "
                        f"of -slope·|i + (Nk - Nq) - j|")
        return None

    def explain_lse(self, rows, err):
        got = self.lse[rows].astype(np.float64)
        true = self.ref.lse[rows].astype(np.float64)
        if got.size and np.allclose(got, true * math.log2(math.e), rtol=1e-3, atol=1e-3):
            return ("lse is in log base 2 (lse · log2(e), as kernels built on exp2 store it): "
                    "multiply by ln 2 to return the natural log-sum-exp")
        if self.out_failed:
            return f"as the output: {self.explain_out()}"
        alibi = self.alibi_row_constant(rows)
        if alibi:
            return alibi
        if got.size > 1:
            shift = got - true
            c = float(np.mean(shift))
            if abs(c) > 1e-3 and np.ptp(shift) < 1e-3 * abs(c):
                near = " = ln 2" if abs(c - math.log(2)) < 1e-3 else ""
                return f"lse is off by the same constant {c:.4g}{near} in every row"
        precision = self.precision_loss(err)
        if precision:
            return precision
        if self.float16_only():
            return ("lse wrong in float16 only, where float32 passed: part of it (the scores, "
                    "exp or the sum l) is computed at float16 precision; FlashAttention keeps "
                    "them in float32")
        return "lse wrong: " + (self.ctx.case.hint or "error above the bound")


# --------------------------------------------------------------------------------------------
# The memory case
# --------------------------------------------------------------------------------------------

_MEMORY_SIZES = (512, 4096)
#: Scratch below this is not compared: allocator noise and per-call constants.
_MEMORY_FLOOR = 1 << 20
#: The growth exponent allowed between the two sizes: linear (a row state, an lse) passes.
MEMORY_EXPONENT = 1.5


def _memory(ctx):
    """Scratch bytes (peak - returned arrays) at N = 512 and 4096: must grow slower than N^1.5."""
    result = Result(ctx.case.name, ctx.dtype)
    rng = np.random.default_rng([ctx.seed, zlib.crc32(b"memory")])
    scratch = []
    for n in _MEMORY_SIZES:
        q, k, v = random_qkv(rng, n, n, dtype=np.dtype(ctx.dtype))
        with warnings.catch_warnings(record=True), np.errstate(all="ignore"):
            warnings.simplefilter("always")
            returned, peak = flash_lib.measure_peak_bytes(ctx.fn, q, k, v)
        arrays = returned if isinstance(returned, (tuple, list)) else (returned,)
        scratch.append(peak - sum(getattr(a, "nbytes", 0) for a in arrays))
        del returned, arrays
    small, large = (max(s, _MEMORY_FLOOR) for s in scratch)
    exponent = math.log(large / small) / math.log(_MEMORY_SIZES[1] / _MEMORY_SIZES[0])
    result.note = (f"scratch {scratch[0] / 2**20:.1f} MiB at N = {_MEMORY_SIZES[0]}, "
                   f"{scratch[1] / 2**20:.1f} MiB at N = {_MEMORY_SIZES[1]}")
    if exponent > MEMORY_EXPONENT:
        ctx.fail(result, "memory", f"scratch grows as N^{exponent:.2f} ({result.note})",
                 f"N^{MEMORY_EXPONENT:g}",
                 f"working memory grows as N^{exponent:.1f}: the kernel materialises the Nq x Nk "
                 f"scores (O(N²) memory; one N x N float32 matrix at N = {_MEMORY_SIZES[1]} is "
                 f"{_MEMORY_SIZES[1] ** 2 * 4 / 2**20:.0f} MiB)")
    return result


register_case(Case("memory", f"scratch memory at N = {_MEMORY_SIZES[0]} and {_MEMORY_SIZES[1]} "
                   f"(float32 where checked), measured by tracemalloc", None, needs=("memory",),
                   once=True, run=_memory))


# --------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------


def _known_features():
    return dict.fromkeys([*FEATURES, *(f for c in CASES.values() for f in c.needs)])


def _kernel_name(fn):
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if isinstance(fn, functools.partial):
        inner = _kernel_name(fn.func)
        args = ", ".join(f"{key}={val!r}" for key, val in fn.keywords.items())
        return f"partial({inner}, {args})"
    return f"{module}.{name}" if module and name else repr(fn)


def check_kernel(fn, *, features=DEFAULT_FEATURES, dtypes=DTYPES, lse_empty=-np.inf, seed=0,
                 cases=None):
    """Run the attention kernel ``fn`` through every registered case; return a :class:`Report`.

    Parameters
    ----------
    fn : callable
        ``fn(q, k, v, *, mask=None, causal=False, scale=None)`` returning ``out`` (or
        ``(out, lse)`` with the ``"lse"`` feature); only the keywords a case uses are passed,
        among them, with their features, ``window``, ``softcap``, ``alibi_slopes``,
        ``enable_gqa`` and ``mask_mod`` (flash_lib's keywords).
    features : iterable of str
        What the kernel supports (see :data:`FEATURES`); cases needing anything else are skipped.
    dtypes : iterable of str
        Input dtypes to check, from :data:`DTYPES`.
    lse_empty : float
        The lse the kernel writes for a row with no allowed key (-inf here, +inf in
        FlashAttention, 0.0 in PyTorch's CPU flash op).
    seed : int
        Seeds every case's inputs (each case has its own stream, independent of the others).
    cases : iterable of str, optional
        Only these cases (default: all of :data:`CASES`).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(features, str) or isinstance(dtypes, str):
        raise TypeError("features and dtypes must be sequences of names, e.g. ('mask',), "
                        f"got {features!r}, {dtypes!r}")
    features, dtypes = tuple(features), tuple(dtypes)
    known = _known_features()
    unknown = [f for f in features if f not in known]
    if unknown:
        raise ValueError(f"features {unknown} are unknown; known: {list(known)}")
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise ValueError(f"dtypes must be a non-empty selection of {DTYPES}, got {dtypes!r}")
    dtypes = tuple(d for d in DTYPES if d in dtypes)  # checked in a fixed order (diagnoses)
    try:
        lse_empty = float(lse_empty)
    except (TypeError, ValueError):
        raise TypeError(f"lse_empty must be a float, got {lse_empty!r}") from None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if cases is None:
        selected = list(CASES.values())
    else:
        cases = [cases] if isinstance(cases, str) else list(cases)
        missing = [c for c in cases if c not in CASES]
        if missing:
            raise ValueError(f"cases {missing} are not registered; registered: {list(CASES)}")
        selected = [CASES[c] for c in cases]

    results, skipped, done = [], [], {}
    for case in selected:
        lacking = [f for f in case.needs if f not in features]
        if lacking:
            skipped.append(Skip(case.name, f"needs feature {', '.join(map(repr, lacking))}: "
                                           f"{'; '.join(FEATURES.get(f, f) for f in lacking)}"))
            continue
        run_dtypes = [d for d in dtypes if case.dtypes is None or d in case.dtypes]
        if not run_dtypes:
            skipped.append(Skip(case.name, f"runs in {', '.join(case.dtypes)} only"))
            continue
        if case.once:
            run_dtypes = ["float32" if "float32" in run_dtypes else run_dtypes[0]]
        for dtype in run_dtypes:
            ctx = _Context(fn, case, dtype, features, lse_empty, int(seed), done)
            with np.errstate(all="ignore"):  # the diagnoses handle non-finite output on purpose
                result = (case.run or _accuracy)(ctx)
            done[case.name, dtype] = result
            results.append(result)
    return Report(_kernel_name(fn), features, dtypes, lse_empty, results, skipped)


# --------------------------------------------------------------------------------------------
# Real kernels, through thin wrappers
# --------------------------------------------------------------------------------------------


def _flatten_batch(q, k, v, mask, causal, causal_alignment):
    """(B, N, d) views of q, k, v, and the combined boolean mask (B, Nq, Nk) or None."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    batch = q.shape[:-2]
    flat = [np.ascontiguousarray(x).reshape((-1,) + x.shape[-2:]) for x in (q, k, v)]
    allowed = None if mask is None else np.broadcast_to(mask, batch + (n_q, n_k))
    if causal:
        diagonal = n_k - n_q if causal_alignment == "bottom-right" else 0
        tri = np.tril(np.ones((n_q, n_k), dtype=bool), k=diagonal)
        allowed = np.broadcast_to(tri, batch + (n_q, n_k)) if allowed is None else allowed & tri
    if allowed is not None:
        allowed = np.ascontiguousarray(allowed).reshape(-1, n_q, n_k)
    return flat, allowed, batch


def _alignment(causal_alignment):
    if causal_alignment not in ("bottom-right", "top-left"):
        raise ValueError(f"causal_alignment must be 'bottom-right' or 'top-left', got "
                         f"{causal_alignment!r}")
    return causal_alignment


def torch_sdpa(backend="math", *, causal_alignment="bottom-right", device="cpu"):
    """PyTorch's ``scaled_dot_product_attention`` as a kernel for :func:`check_kernel`.

    ``backend`` ("math", "flash", "efficient", "cudnn") is forced with ``sdpa_kernel``, so the
    call fails rather than silently running another one. NumPy arrays go to ``device`` as
    (batch, 1 head, N, d) tensors and come back. ``causal=True`` becomes PyTorch's own
    bottom-right bias, ``torch.nn.attention.bias.causal_lower_right`` (without a mask), or
    ``is_causal=True`` with ``causal_alignment="top-left"``, PyTorch's convention (its docs:
    ``torch.ones(L, S).tril(diagonal=0)``); with a mask, the causal triangle is ANDed into it.
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    backends = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    if backend not in backends:
        raise ValueError(f"backend must be one of {list(backends)}, got {backend!r}")
    _alignment(causal_alignment)

    def sdpa(q, k, v, *, mask=None, causal=False, scale=None):
        n_q, n_k = q.shape[-2], k.shape[-2]
        if mask is None and causal:  # PyTorch's own causal: top-left flag or bottom-right bias
            (tq, tk, tv), _, batch = _flatten_batch(q, k, v, None, False, causal_alignment)
            bias = causal_lower_right(n_q, n_k) if causal_alignment == "bottom-right" else None
            is_causal = causal_alignment == "top-left"
        else:
            (tq, tk, tv), allowed, batch = _flatten_batch(q, k, v, mask, causal, causal_alignment)
            bias = None if allowed is None else torch.from_numpy(allowed[:, None]).to(device)
            is_causal = False
        tq, tk, tv = (torch.from_numpy(x[:, None]).to(device) for x in (tq, tk, tv))
        with sdpa_kernel(backends[backend]):
            out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=bias,
                                                 is_causal=is_causal, scale=scale)
        return out[:, 0].cpu().numpy().reshape(batch + out.shape[-2:])

    sdpa.__qualname__ = f"torch_sdpa(backend={backend!r}, causal_alignment={causal_alignment!r})"
    return sdpa


def torch_flash_for_cpu_with_lse(q, k, v, *, mask=None, causal=False, scale=None):
    """PyTorch's private CPU flash op, which also returns the lse: ``(out, lse)``.

    ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` (what SDPA's flash backend
    runs on the CPU); it takes an additive float mask, so the boolean mask (and a bottom-right
    causal triangle) becomes 0 / -inf. Its lse of a fully masked row is 0.0: check it with
    ``lse_empty=0.0``. A private op: its signature may change between releases.
    """
    import torch

    (tq, tk, tv), allowed, batch = _flatten_batch(q, k, v, mask, causal, "bottom-right")
    tq, tk, tv = (torch.from_numpy(x[:, None]) for x in (tq, tk, tv))
    bias = None
    if allowed is not None:
        bias = torch.zeros(allowed[:, None].shape, dtype=tq.dtype)
        bias.masked_fill_(torch.from_numpy(~allowed[:, None]), float("-inf"))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = op(tq, tk, tv, attn_mask=bias, scale=scale)
    return (out[:, 0].numpy().reshape(batch + out.shape[-2:]),
            lse[:, 0].numpy().reshape(batch + lse.shape[-1:]))


def jax_dot_product_attention(*, causal_alignment="bottom-right", implementation="xla"):
    """``jax.nn.dot_product_attention`` as a kernel for :func:`check_kernel`.

    Turns on ``jax_enable_x64`` (process-wide) so float64 stays float64, and runs it under
    ``jax.jit``: XLA compiles it once per shape and dtype (about a second each on a busy 2-core
    machine, so a full check takes a minute). Arrays go in as (batch, N, 1 head, d), JAX's layout. ``causal=True`` becomes an explicit bottom-right mask,
    or ``is_causal=True`` with ``causal_alignment="top-left"``, JAX's own convention.
    """
    import jax

    jax.config.update("jax_enable_x64", True)
    _alignment(causal_alignment)
    # Compiled once per shape and dtype, as a model would run it (eager dispatch compiles every
    # primitive separately and is several times slower to start).
    compiled = jax.jit(jax.nn.dot_product_attention,
                       static_argnames=("is_causal", "implementation"))

    def attention(q, k, v, *, mask=None, causal=False, scale=None):
        if mask is None and causal and causal_alignment == "top-left":
            (jq, jk, jv), allowed, batch = _flatten_batch(q, k, v, None, False, "top-left")
            is_causal = True
        else:
            (jq, jk, jv), allowed, batch = _flatten_batch(q, k, v, mask, causal, causal_alignment)
            is_causal = False
        out = compiled(
            jq[:, :, None], jk[:, :, None], jv[:, :, None], scale=scale, is_causal=is_causal,
            mask=None if allowed is None else allowed[:, None], implementation=implementation)
        return np.asarray(out)[:, :, 0].reshape(batch + out.shape[1:2] + out.shape[-1:])

    attention.__qualname__ = (f"jax_dot_product_attention(causal_alignment="
                              f"{causal_alignment!r}, implementation={implementation!r})")
    return attention


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------


def _load(target):
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected package.module:function, got {target!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def main(argv=None):
    """``python -m flash_check package.module:function [--features ...] [--dtypes ...]``."""
    parser = argparse.ArgumentParser(
        prog="python -m flash_check",
        description="Check an attention kernel against flash_lib's conventions and accuracy "
                    "bounds; print the report; exit 1 on any failure.")
    parser.add_argument("kernel", help="package.module:function, the kernel to check")
    parser.add_argument("--features", nargs="*", default=list(DEFAULT_FEATURES),
                        metavar="FEATURE", help=f"what the kernel supports, among "
                        f"{', '.join(_known_features())} (default: {' '.join(DEFAULT_FEATURES)})")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES,
                        metavar="DTYPE", help=f"dtypes to check (default: {' '.join(DTYPES)})")
    parser.add_argument("--lse-empty", type=float, default=-np.inf,
                        help="the lse the kernel writes for a fully masked row (default: -inf)")
    parser.add_argument("--cases", nargs="+", metavar="CASE", help="run only these cases")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        fn = _load(args.kernel)
    except (ValueError, ImportError, AttributeError) as exc:
        parser.error(f"cannot load the kernel {args.kernel!r}: {exc}")
    try:
        report = check_kernel(fn, features=args.features, dtypes=args.dtypes,
                              lse_empty=args.lse_empty, seed=args.seed, cases=args.cases)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    # Run the importable module's main, so that the kernel's module, if it imports flash_check,
    # sees the same registry of cases as the command line.
    from flash_check import main as _main

    sys.exit(_main())

"""The built-in cases, registered into ``flash_check.CASES`` on import, in the order they run.

Imported once by ``flash_check`` itself, before ``training.py`` and ``serving.py``, whose cases
follow these; a new case is one :func:`flash_check.register_case` call in any module, as below.
The classic cases come first (each exposes one classic bug), then the variants' (window, softcap,
ALiBi, GQA, mask_mod; skipped unless the kernel lists the feature), then the memory case (its own
check, ``run=``).
"""

from __future__ import annotations

import math
import warnings
import zlib

import numpy as np

import flash_lib
from flash_check._core import MEMORY_EXPONENT, Case, Inputs, Result, random_qkv, register_case
from flash_check._gradients import _with_nonfinite_gradients

# --------------------------------------------------------------------------------------------
# The classic cases
# --------------------------------------------------------------------------------------------


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


#: The non-finite cases' garbage, one kind per batch element: (array, value).
_GARBAGE = (("v", np.nan), ("v", np.inf), ("v", -np.inf), ("k", np.nan))


def _plant(q, k, v, keys, mask=None):
    """Garbage at one key per batch element (``keys``), one kind each (:data:`_GARBAGE`): the
    inputs, ``clean`` copies, and the rows that must come out not finite (``garbage_rows``: they
    attend an inf or NaN in v) or NaN in out and lse (``nan_rows``: NaN in k, so in the score)."""
    clean = tuple(x.copy() for x in (q, k, v))
    n_q, n_k = q.shape[-2], k.shape[-2]
    allowed = np.ones((len(keys), n_q, n_k), bool) if mask is None else mask.copy()
    if mask is None:  # causal, Nq = Nk here
        allowed &= flash_lib.causal_mask(n_q, n_k)
    garbage_rows = np.zeros((len(keys), n_q), bool)
    nan_rows = np.zeros((len(keys), n_q), bool)
    for b, (j, (where, value)) in enumerate(zip(keys, _GARBAGE)):
        {"k": k, "v": v}[where][b, j] = value
        (nan_rows if where == "k" else garbage_rows)[b] = allowed[b, :, j]
    return Inputs(q, k, v, {"causal": True} if mask is None else {"mask": mask},
                  nan_rows=nan_rows, clean=clean, garbage_rows=garbage_rows)


def _causal_nonfinite(rng, dtype):
    # Causal self-attention, Nq = Nk = 80 (a KV cache's slots past each row's position may hold
    # anything): one key of each batch element holds garbage, hidden from the rows before it,
    # attended from it on. The keys are odd, so for every block size of 2 or more the first row
    # that attends one shares its query block with rows that may not: a kernel that keeps only
    # the keys no row of a tile attends out of P·V leaks there (as one that masks nothing, on
    # every row before the key).
    q, k, v = random_qkv(rng, 80, 80, dtype=dtype, batch=(4,))
    return _plant(q, k, v, keys=(21, 45, 67, 37))


def _partial_nonfinite(rng, dtype):
    # A random mask (70% of the pairs) over Nq = 96 rows and Nk = 80 keys, and in each batch
    # element one key holding garbage that only one or two rows (odd ones) may attend: hidden
    # from every other row, among them the rest of those rows' query blocks, at any block size.
    q, k, v = random_qkv(rng, 96, 80, dtype=dtype, batch=(4,))
    mask = rng.random((4, 96, 80)) < 0.7
    keys, attend = (50, 13, 79, 70), ((37,), (45, 77), (3,), (61,))
    for b, (j, rows) in enumerate(zip(keys, attend)):
        mask[b, :, j] = False
        mask[b, list(rows), j] = True
    return _plant(q, k, v, keys, mask=mask)


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
    Case("masked_nonfinite", "NaN in k and ±inf, NaN in v at padded keys no row may attend; "
         "with backward=, the gradients", _masked_nonfinite, needs=("mask",),
         hint="values at keys a row may not attend changed that row",
         run=_with_nonfinite_gradients),
    Case("causal_nonfinite", "NaN, ±inf in v and NaN in k at one key per sequence, beyond the "
         "causal diagonal of the rows before it; with backward=, the gradients",
         _causal_nonfinite, needs=("causal",),
         hint="values at keys beyond a row's causal diagonal changed that row",
         run=_with_nonfinite_gradients),
    Case("partial_nonfinite", "NaN, ±inf in v and NaN in k at a key the mask allows for "
         "one or two rows of a tile and hides from the others; with backward=, the gradients",
         _partial_nonfinite, needs=("mask",),
         hint="values at keys a row may not attend changed that row",
         run=_with_nonfinite_gradients),
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
# The memory case
# --------------------------------------------------------------------------------------------

_MEMORY_SIZES = (512, 4096)
#: Scratch below this is not compared: allocator noise and per-call constants.
_MEMORY_FLOOR = 1 << 20


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

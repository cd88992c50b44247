"""The cases after FlashAttention-3: FA4's conditional rescaling (feature ``"rescale_threshold"``)
and top-k sparse attention (``"sparse"``), each skipped unless its feature is listed; and
:func:`planted`, small kernels with one bug each in those features, for the tests and chapters
19 and 20.

Registered when ``flash_check`` imports this module, after ``serving.py``'s cases.

* ``"rescale_threshold"``: ``fn(q, k, v, *, rescale_threshold=8.0, scale=None)`` (flash_lib's
  keyword; FA4's ``rescale_threshold``, base-2 units): a row's maximum moves only when a tile's
  maximum exceeds it by more than the threshold. The case's scores rise along the keys by about
  a unit per key (the maximum lags behind on every tile, each ``p`` up to ``2^8``), and fall in
  a second half; the result must meet the runner's bound against ``flash_lib.precise_attention``.
* ``"sparse"``: ``fn(q, k, v, *, indices, scale=None)`` with ``indices (..., Nq, topk)``, ``-1``
  an unused slot (``flash_lib.sparse_attention``'s contract): each query attends exactly its
  listed keys. The case lists no row the last key, whose ``k`` and ``v`` hold NaN: a kernel that
  reads the sentinel ``-1`` as an index (NumPy's and PyTorch's last element) puts NaN in every
  row with a sentinel. One row lists nothing: its ``out`` must be exactly 0 (and its ``lse``
  ``lse_empty``).
"""

from __future__ import annotations

import zlib

import numpy as np

import flash_lib
from flash_check._core import (FACTOR, FEATURE_KEYWORDS, FEATURES, LSE_FLOOR, OUT_FLOOR, Case,
                               Result, _call, _lse_error, _max_error, _split, random_qkv,
                               register_case)

FEATURES.update({
    "rescale_threshold": "takes rescale_threshold= (FA4's conditional rescaling, base-2 units)",
    "sparse": "takes indices= (..., Nq, topk), -1 unused: top-k sparse attention",
})
FEATURE_KEYWORDS.update({"rescale_threshold": ("rescale_threshold",), "sparse": ("indices",)})

#: The threshold the case passes: FA4's for 16-bit inputs (``flash_attn/cute/flash_fwd_sm100.py``
#: line 2190 at 0251105a; 0 for FP8, whose P already uses ``max_offset = 8``)
THRESHOLD = 8.0


def _rising(rng, dtype):
    """Scores that rise by about 0.7 (base 2) per key for 48 keys, then fall: the running maximum
    is passed on every tile of 16 keys; q (2, 8, 16)."""
    q, k, v = random_qkv(rng, 8, 96, dtype=np.float64, batch=(2,))
    q = np.abs(q) * 0.25 + 0.5
    ramp = np.concatenate([np.arange(48), 48 - np.arange(48)]) * 0.12
    k = k * 0.05 + ramp[:, None]
    return tuple(a.astype(dtype) for a in (q, k, v))


def _sparse_inputs(rng, dtype):
    """q (2, 10, 16), k, v (2, 40, 16); indices (2, 10, 12) with a third of the slots -1, row 3
    all -1, key 39 (NaN in k and v) listed by no row."""
    q, k, v = random_qkv(rng, 10, 40, dtype=np.float64, batch=(2,))
    k[..., 39, :], v[..., 39, :] = np.nan, np.nan
    idx = np.argsort(rng.random((2, 10, 39)), axis=-1)[..., :12]
    idx = np.where(rng.random(idx.shape) < 1 / 3, -1, idx)
    idx[:, 3] = -1
    mask = np.zeros((2, 10, 41), bool)
    np.put_along_axis(mask, np.where(idx < 0, 40, idx), True, axis=-1)
    return tuple(a.astype(dtype) for a in (q, k, v)), idx, mask[..., :40]


def _check(ctx, result, q, k, v, kwargs, ref_kwargs, diagnosis):
    """Call the kernel with ``kwargs``; measure out (and lse) against precise_attention with
    ``ref_kwargs`` on the same inputs, under the runner's bound."""
    want_lse = "lse" in ctx.features
    try:
        returned, _ = _call(ctx.fn, q, k, v, kwargs)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        ctx.fail(result, "raised", f"{type(exc).__name__}: {str(exc)[:160]}", "no exception",
                 f"the kernel does not take {', '.join(kwargs)} as documented")
        return None
    out, lse, problem = _split(returned, want_lse)
    if problem:
        ctx.fail(result, "shape", problem, "as documented", problem)
        return None
    out = np.asarray(out)
    wide = [a.astype(np.float64) for a in (q, k, v)]
    with np.errstate(all="ignore"):
        truth, truth_lse = flash_lib.precise_attention(*wide, return_lse=True, **ref_kwargs)
        naive, naive_lse = flash_lib.naive_attention(q, k, v, return_lse=True, **ref_kwargs)
    rows = np.isfinite(truth_lse)
    bad = ~np.isfinite(out[rows])
    if bad.any():
        ctx.fail(result, "non-finite", f"NaN or inf in {int(bad.any(-1).sum())} rows",
                 "finite", diagnosis)
        return None
    result.out_error, result.out_naive, result.out_bound = _within_bound(
        ctx, result, "out error", _max_error, out[rows], naive[rows], truth[rows], OUT_FLOOR,
        diagnosis)
    if not np.all(out[~rows] == 0):
        ctx.fail(result, "empty rows", "a row with no key gave numbers", "out exactly 0",
                 "a row with no listed key must give 0 (its l is 0: guard the division)")
    if want_lse:
        lse = np.asarray(lse)
        result.lse_error, result.lse_naive, result.lse_bound = _within_bound(
            ctx, result, "lse error", _lse_error, lse[rows], naive_lse[rows], truth_lse[rows],
            LSE_FLOOR, diagnosis)
    return out


def _within_bound(ctx, result, check, error, got, naive, truth, floor, diagnosis):
    """``(error, naive's error, bound)`` of ``got`` against ``truth``, the bound FACTOR · naive's
    + ``floor`` of the dtype; ``check`` fails with ``diagnosis`` when the error is above it."""
    err, naive_err = error(got, truth), error(naive, truth)
    bound = FACTOR * naive_err + floor[ctx.dtype]
    if not err <= bound:
        ctx.fail(result, check, f"{err:.2g}", f"{bound:.2g}", diagnosis)
    return err, naive_err, bound


def _rescale_case(ctx):
    result = Result(ctx.case.name, ctx.dtype)
    rng = np.random.default_rng([ctx.seed, zlib.crc32(b"rescale_threshold")])
    q, k, v = _rising(rng, np.dtype(ctx.dtype))
    _check(ctx, result, q, k, v, {"rescale_threshold": THRESHOLD}, {},
           "wrong with rescale_threshold: a kept maximum must leave acc and l as they are, a "
           "moved one must rescale both by 2^(m - m'); the final acc / l then divides out the lag")
    return result


def _sparse_case(ctx):
    result = Result(ctx.case.name, ctx.dtype)
    rng = np.random.default_rng([ctx.seed, zlib.crc32(b"sparse")])
    (q, k, v), idx, mask = _sparse_inputs(rng, np.dtype(ctx.dtype))
    _check(ctx, result, q, k, v, {"indices": idx}, {"mask": mask},
           "wrong with indices: the sentinel -1 read as an index (the last key, whose k and v "
           "are NaN here), or keys not the listed ones")
    return result


register_case(Case("rescale_threshold", f"FA4's conditional rescaling, threshold {THRESHOLD:g}, "
                   "on scores that rise along the keys (the maximum lags on every tile)", None,
                   needs=("rescale_threshold",), run=_rescale_case))
register_case(Case("sparse", "top-k sparse attention, a third of the slots -1, one row with "
                   "none, NaN at the one key no row lists", None, needs=("sparse",),
                   run=_sparse_case))


# --------------------------------------------------------------------------------------------
# Planted bugs
# --------------------------------------------------------------------------------------------

#: The bugs :func:`planted` can plant, and what each does.
BUGS = {
    "moved_max_not_rescaled": "a moved maximum rescales acc but not l",
    "kept_max_overwritten": "a kept maximum (within the threshold) is still overwritten by the "
                            "tile's, without rescaling",
    "sentinel_as_last_key": "the sentinel -1 is used as an index: the last key",
    "sentinel_as_first_key": "a -1 slot is clipped to key 0 and not masked",
}


def _lazy_kernel(bug, q, k, v, rescale_threshold, scale, block=16):
    """Tiled attention with FA4's conditional rescaling, in base 2, with ``bug`` planted."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    tau = (1 / np.sqrt(q.shape[-1]) if scale is None else scale) * np.log2(np.e)
    m = np.full(q.shape[:-1], -np.inf)
    l = np.zeros(q.shape[:-1])
    acc = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for start in range(0, k.shape[-2], block):
        s = (q @ np.swapaxes(k[..., start:start + block, :], -1, -2)) * tau
        tile = s.max(-1)
        move = ~np.isfinite(m) | (tile - m > rescale_threshold)
        m_new = np.where(move, np.maximum(m, tile), m)
        alpha = np.exp2(np.where(np.isfinite(m), m - m_new, 0.0))
        p = np.exp2(s - m_new[..., None])
        if bug == "moved_max_not_rescaled":
            l = l + p.sum(-1)
        else:
            l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p @ v[..., start:start + block, :]
        m = np.where(~move & (bug == "kept_max_overwritten"), np.maximum(m, tile), m_new)
    out = acc / l[..., None]
    return out, (m + np.log2(l)) / np.log2(np.e)


def _sparse_kernel(bug, q, k, v, indices, scale):
    """Dense-gather sparse attention with ``bug`` planted."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    tau = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    idx = np.asarray(indices)
    used = idx >= 0 if bug is None else np.ones(idx.shape, bool)
    take = np.where(idx >= 0, idx, 0) if bug != "sentinel_as_last_key" else idx
    flat = np.broadcast_to(take, q.shape[:-2] + idx.shape[-2:]).reshape(q.shape[:-2] + (-1, 1))
    k_g = np.take_along_axis(k, flat, axis=-2).reshape(idx.shape + (k.shape[-1],))
    v_g = np.take_along_axis(v, flat, axis=-2).reshape(idx.shape + (v.shape[-1],))
    v_g = np.where(used[..., None], v_g, 0)
    s = np.where(used, np.einsum("...qd,...qkd->...qk", q, k_g) * tau, -np.inf)
    m = s.max(-1)
    m_ref = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m_ref[..., None])
    l = p.sum(-1)
    out = np.einsum("...qk,...qkd->...qd", p, v_g) / np.where(l == 0, 1, l)[..., None]
    lse = np.where(l == 0, -np.inf, np.log(np.where(l == 0, 1, l)) + m_ref)
    return out, lse


def planted(bug=None):
    """A kernel for the ``"rescale_threshold"`` and ``"sparse"`` features (and ``"lse"``), in
    float64, with one of :data:`BUGS` planted (None: none). Without ``rescale_threshold`` or
    ``indices`` it is dense attention with a threshold of 0."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"bug must be one of {', '.join(BUGS)} or None, got {bug!r}")

    def kernel(q, k, v, *, rescale_threshold=0.0, indices=None, scale=None):
        with np.errstate(all="ignore"):
            if indices is not None:
                out, lse = _sparse_kernel(bug if bug and bug.startswith("sentinel") else None,
                                          q, k, v, indices, scale)
            else:
                out, lse = _lazy_kernel(bug, q, k, v, rescale_threshold, scale)
        dtype = np.asarray(q).dtype
        return out.astype(dtype), lse.astype(np.result_type(dtype, np.float32))

    kernel.__name__ = f"planted_{bug}"
    return kernel

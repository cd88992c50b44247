"""The gradient check: the kernel's backward called, each gradient held to the output's rule.

Used by the cases that check a backward when :func:`flash_check.check_kernel` is given one
(``backward=``): the sinks and dropout cases of ``training.py``. Below the cases' modules, so that
any of them can check gradients.

The gradient bound is the output's rule applied to each gradient as a whole: ``max|g - t| /
max|t| <= FACTOR · naive's + GRAD_FLOOR[dtype]`` (a row of ``dk`` can be a few ulps by
cancellation, so it is not measured row by row).
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from flash_check._core import FACTOR
from flash_check.diagnose import Mistake, always, explain

#: The floor of a gradient's error (max |g - t| / max |t|), in eps of the dtype: a backward sums
#: dS·K over key blocks and dSᵀ·Q over query blocks in another order than the dense product.
#: Measured need, max(error - FACTOR · naive's), over flash_lib at 512 x 512 and 16 x 16 tiles
#: and the bug zoo's backward, on the sinks and dropout cases (AVX-512 machine, OpenBLAS
#: SkylakeX): 1.1 eps (float32's dsinks) and below 0.5 eps everywhere else; float16: 0.4 eps
#: (dsinks, whose D = rowsum(dO∘O) uses the float16 out the kernel returned).
GRAD_FLOOR = {"float64": 8 * float(np.finfo(np.float64).eps),
              "float32": 8 * float(np.finfo(np.float32).eps),
              "float16": 2 * float(np.finfo(np.float16).eps)}


def _backward(ctx, result, args, kwargs, n_grads):
    """The kernel's backward on ``args`` (q, k, v, out, lse, dout), or None after a failure."""
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            returned = ctx.backward(*(np.array(x, copy=True) for x in args), **kwargs)
    except Exception as exc:
        ctx.fail(result, "backward raised", f"{type(exc).__name__}: "
                 f"{' '.join(str(exc).split())[:160]}", "no exception",
                 f"the backward raised on this case ({', '.join(kwargs) or 'no keyword'})")
        return None
    if not isinstance(returned, (tuple, list)) or len(returned) != n_grads:
        what = "(dq, dk, dv, dsinks)" if n_grads == 4 else "(dq, dk, dv)"
        ctx.fail(result, "backward shape", f"returned {type(returned).__name__} of "
                 f"{len(returned) if isinstance(returned, (tuple, list)) else 1}",
                 what, f"the backward must return {what}" + (
                     " with sinks= (flash_lib's flash_attention_backward)" if n_grads == 4
                     else ""))
        return None
    return [np.asarray(g) for g in returned]


def _global_error(g, t):
    """max |g - t| / max |t| (0 when both are 0), in the wider dtype; inf if not finite."""
    wide = np.result_type(g, t, np.float64)
    g, t = np.asarray(g, wide), np.asarray(t, wide)
    if g.size == 0:
        return 0.0
    if not np.isfinite(g).all():
        return math.inf
    scale = np.abs(t).max()
    diff = np.abs(g - t).max()
    return float(diff / scale) if scale > 0 else (0.0 if diff == 0 else math.inf)


#: Why a gradient (``name``) is above its bound (``flipped``: it matches the truth negated).
GRADIENT = (
    Mistake(lambda ev, f: f["name"] == "dsinks" and f["flipped"],
            "dsinks has the wrong sign: dsinks_h = -Σ_i exp(sink_h - lse_i)·D_i (the sink takes "
            "probability exp(sink - lse_i) from row i's keys, and d out_i / d sink = "
            "-exp(sink - lse_i)·out_i)"),
    Mistake(lambda ev, f: f["name"] == "dsinks",
            "dsinks wrong: dsinks_h = -Σ_i exp(sink_h - lse_i)·D_i, D_i = rowsum(dO∘O), summed "
            "over every axis the sinks were broadcast along"),
    Mistake(lambda ev, f: f["dropout"],
            "{name} wrong with dropout on, although dV's mask is the forward's: dP = "
            "(dO·Vᵀ)∘Z/(1 - p) and dS = P∘(dP - D) with D = rowsum(dO∘O) of the dropped output"),
    Mistake(lambda ev, f: f["sinks"],
            "{name} wrong with sinks: the backward's P = exp(S - lse) must use the lse that "
            "includes the sink; the tile loop is otherwise unchanged"),
    Mistake(always, "{name} wrong: {hint}"),
)


def _check_gradients(ctx, result, grads, truth, naive, names, *, dropout, sinks):
    """Each gradient's shape, then its error against FACTOR · naive's + GRAD_FLOOR."""
    for name, g, t, n in zip(names, grads, truth, naive):
        if not _same_shape(ctx, result, name, g, t):
            continue
        err, naive_err = _global_error(g, t), _global_error(n, t)
        bound = FACTOR * naive_err + GRAD_FLOOR[ctx.dtype]
        if err > bound:
            flipped = _global_error(-g.astype(np.float64), t) <= bound
            ctx.fail(result, f"{name} error", f"{err:.2g}", f"{FACTOR:g} x naive's "
                     f"{naive_err:.2g} + {GRAD_FLOOR[ctx.dtype]:.2g} = {bound:.2g}",
                     explain(GRADIENT, ctx, name=name, flipped=flipped, dropout=dropout,
                             sinks=sinks, hint=ctx.case.hint))


def _same_shape(ctx, result, name, g, t):
    if g.shape == np.shape(t):
        return True
    extra = (" (dsinks has the sinks' shape: summed over every axis they were broadcast along)"
             if name == "dsinks" else " (the input's: a broadcast input gets the gradient summed "
             "over the axes it was broadcast along)")
    ctx.fail(result, f"{name} shape", f"{g.shape}", f"{np.shape(t)}",
             f"{name} has shape {g.shape}, expected {np.shape(t)}{extra}")
    return False

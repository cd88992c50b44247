"""The gradient check: the kernel's backward called, each gradient held to the output's rule.

Used by the cases that check a backward when :func:`flash_check.check_kernel` is given one
(``backward=``): the non-finite cases of ``cases.py`` (:func:`_with_nonfinite_gradients`), the
sinks and dropout cases of ``training.py``.

The gradient bound is the output's rule applied to each gradient as a whole: ``max|g - t| /
max|t| <= FACTOR · naive's + GRAD_FLOOR[dtype]`` (a row of ``dk`` can be a few ulps by
cancellation, so it is not measured row by row).

Garbage at masked keys (the non-finite cases) must not reach a gradient it cannot reach in exact
arithmetic. The backward gets what a right forward returns, the exact ``out`` and ``lse`` rounded
to the kernel's dtypes, so that its check does not depend on the forward's; the rows that attend
the garbage (their out not finite by design) are left out of the loss: their ``dout`` is 0, and
the ``out`` and ``lse`` given for them are those of the clean inputs (finite), so that ``D_i =
rowsum(dO_i ∘ O_i)`` is 0 and ``P = exp(S - lse)`` finite there. A right backward then computes
the gradient of ``Σ_i dO_i·O_i`` over the other rows, finite everywhere except ``dq`` of the rows
that attend garbage and ``dk``, ``dv`` of the garbage keys some row attends (a pair allowed to
meet a NaN carries it); the truth is ``flash_lib.precise_attention_backward`` on the clean inputs
with that ``dout``, measured everywhere else.
"""

from __future__ import annotations

import functools
import math
import warnings
import zlib

import numpy as np

import flash_lib
from flash_check import diagnose
from flash_check._core import FACTOR, _reference
from flash_check._runner import _accuracy
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


# --------------------------------------------------------------------------------------------
# The non-finite cases: garbage in k and v must not reach a gradient it cannot reach
# --------------------------------------------------------------------------------------------


def _dq_leak(garbage, bad, probe):
    """Why dq is not finite on rows (``bad``) that may not attend the garbage: which rows, from
    which keys (``probe``: :class:`flash_check.diagnose.Garbage`'s), and how a backward lets it
    through, by where the garbage is (k or v)."""
    sources = garbage.sources(bad, probe)
    if not sources.any():
        return None
    through_k, through_v = garbage.through(sources)
    how = []
    if through_v:
        how.append("from v: dP = dO·Vᵀ reads every key's v, so it is NaN at the garbage key for "
                   "every row, and at a masked pair dS = P∘(dP - D) = 0 · NaN: set dS to 0 at the "
                   "masked pairs (where), as the forward keeps them out of P·V")
    if through_k:
        how.append("from k: dQ = dS·K multiplies a masked pair's dS = 0 by the NaN in k "
                   "(0 · NaN = NaN): keep masked pairs out of dS·K (select with where, or zero a "
                   "masked key's k), and S = Q·Kᵀ, NaN there too, out of P = exp(S - lse)")
    how = "; ".join(how)
    return (f"garbage at keys these rows may not attend reached their dq: "
            f"{garbage.describe(sources)}. {how[0].upper()}{how[1:]}")


def _key_leak(garbage, name, bad):
    """Why dk or dv (``name``) is not finite at keys (``bad``, (*batch, Nk)) whose exact
    gradient is finite: the keys, and the pairs of theirs a backward must leave out."""
    parts = []
    for b in np.ndindex(garbage.batch):
        keys = np.flatnonzero(bad[b])
        if keys.size:
            own = keys[garbage.keys[b][keys]]
            held = f" ({garbage.kind(b, own)})" if own.size else ""
            parts.append(f"{garbage.where(b)}key{'s' * (keys.size > 1)} "
                         f"{diagnose.spans(keys)}{held}")
    where = "; ".join(parts[:4]) + (f"; and {len(parts) - 4} more" if len(parts) > 4 else "")
    if not (bad & ~garbage.keys).any():
        how = [why for flags, why in (
            (garbage.in_v, "dS = P∘(dP - D) is 0 · NaN there (dP = dO·Vᵀ reads the key's v): set "
                           "dS to 0 at masked pairs"),
            (garbage.in_k, "P = exp(S - lse) is NaN there (S = Q·Kᵀ reads the key's k): set S to "
                           "-inf, or P to 0, at masked pairs")) if (bad & flags).any()]
        return (f"{name} is not finite at garbage keys that no row may attend: {where}. A key no "
                f"row attends must get dk = dv = 0, its masked pairs adding exactly 0: "
                + "; ".join(how))
    return (f"{name} is not finite at keys whose exact gradient is: {where}: garbage reached "
            f"them through masked pairs (dS = P∘(dP - D) or P = exp(S - lse) not set to 0 "
            f"there)")


def _dq_probe(ctx, garbage, args, kwargs, which):
    """The rows whose dq is not finite when the backward gets the garbage of ``which`` ("k" or
    "v") alone, the rest of its arguments ``args`` (out, lse, dout) unchanged."""
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            dq = np.asarray(ctx.backward(*(np.array(x, copy=True) for x in garbage.only(which)),
                                         *(np.array(x, copy=True) for x in args), **kwargs)[0])
        return ~np.isfinite(dq).all(axis=-1)
    except Exception:
        return np.ones(garbage.hidden.shape[:-1], bool)  # no answer: every row a suspect


def _nonfinite_gradients(ctx, result):
    """The backward on the case's inputs, garbage included (see the module's docstring)."""
    ref = _reference(ctx.case, ctx.dtype, ctx.seed)
    inputs = ref.inputs
    dtype = inputs.q.dtype
    none = np.zeros(ref.lse.shape, bool)
    poisoned = ((none if inputs.nan_rows is None else inputs.nan_rows)
                | (none if inputs.garbage_rows is None else inputs.garbage_rows))
    rng = np.random.default_rng([ctx.seed, zlib.crc32(ctx.case.name.encode()), 1])
    dout = np.where(poisoned[..., None], 0, rng.standard_normal(ref.out.shape)).astype(dtype)
    out = np.where(poisoned[..., None], 0, ref.out).astype(dtype)
    lse = np.where(ref.empty, ctx.lse_empty, ref.lse).astype(
        np.float32 if dtype == np.float16 else dtype)
    args = (out, lse, dout)
    grads = _backward(ctx, result, (inputs.q, inputs.k, inputs.v, *args), dict(inputs.kwargs), 3)
    if grads is None:
        return
    q, k, v = inputs.clean
    truth = flash_lib.precise_attention_backward(q, k, v, dout, **inputs.kwargs)
    naive = flash_lib.naive_attention_backward(q, k, v, dout, **inputs.kwargs)
    garbage = diagnose.Garbage(diagnose.Evidence(ctx, ref, None, None))
    reached = garbage.keys & garbage.allowed.any(axis=-2)  # garbage keys some row attends
    where = {"dq": ~poisoned, "dk": ~reached, "dv": ~reached}
    for name, g, t, n in zip(("dq", "dk", "dv"), grads, truth, naive):
        if not _same_shape(ctx, result, name, g, t):
            continue
        measured = where[name]
        bad = measured & ~np.isfinite(g).all(axis=-1)
        if bad.any():
            what = "rows" if name == "dq" else "keys"
            ctx.fail(result, f"{name} non-finite", f"{diagnose.nonfinite_kinds(g[bad])} in "
                     f"{int(bad.sum())} of {int(measured.sum())} {what}",
                     f"finite wherever the exact {name} is",
                     (name == "dq" and _dq_leak(garbage, bad, functools.partial(
                         _dq_probe, ctx, garbage, args, inputs.kwargs)))
                     or _key_leak(garbage, name, bad))
            continue
        err = _global_error(g[measured], t[measured])
        naive_err = _global_error(n.astype(dtype)[measured], t[measured])
        bound = FACTOR * naive_err + GRAD_FLOOR[ctx.dtype]
        if err > bound:
            ctx.fail(result, f"{name} error", f"{err:.2g}", f"{FACTOR:g} x naive's "
                     f"{naive_err:.2g} + {GRAD_FLOOR[ctx.dtype]:.2g} = {bound:.2g}",
                     f"{name} wrong where the garbage cannot reach it: {ctx.case.hint}")
    note = (f"gradients checked where the garbage cannot reach: dq of {int(where['dq'].sum())} "
            f"rows, dk and dv of {int(where['dk'].sum())} keys")
    result.note = f"{result.note}; {note}" if result.note else note


def _with_nonfinite_gradients(ctx):
    """The accuracy check, then, given the kernel's backward, the gradients on the same inputs
    (garbage included), whatever the forward returned: the backward gets the exact out and lse
    (so the kernel need not have the ``lse`` feature here)."""
    result = _accuracy(ctx)
    if ctx.backward is None:
        result.note = result.note or "gradients not checked: no backward= given"
    else:
        _nonfinite_gradients(ctx, result)
    return result

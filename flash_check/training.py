"""The training features' cases: attention sinks (feature ``"sinks"``) and dropout
(``"dropout"``), each skipped unless the feature is listed; and the gradient checks they run when
:func:`flash_check.check_kernel` is given the kernel's ``backward=``.

Registered when ``flash_check`` imports this module, after ``cases.py``'s cases. The conventions
are flash_lib's (issue 24), FlashAttention's and gpt-oss's:

* ``sinks=``: one logit per head, broadcastable to the result's batch dims (``(H,)`` or
  ``(B, H)``), neither scaled nor softcapped: ``lse_i = log(exp(sink) + Σ_j exp(s_ij))``,
  ``P_ij = exp(s_ij - lse_i)``, ``out = P·V``. A row with no allowed key gives ``out = 0`` and
  ``lse = sink`` (no row is empty). The sinks cases are ordinary accuracy cases (the truth is
  ``flash_lib.precise_attention(..., sinks=)``); the first two also check the gradients,
  ``dsinks`` included (``dsinks_h = -Σ_i exp(sink_h - lse_i)·D_i``, summed over the axes the
  sinks were broadcast along), when a backward is given.
* ``dropout_p=, dropout_seed=``: ``out = (P∘Z/(1 - p))·V`` with ``P`` the undropped softmax and
  ``Z`` a keep mask, Bernoulli(1 - p) per element (b, i, j); the lse is the undropped one. The
  dropout case reads the kernel's mask off its output: on ``q = 0`` (uniform ``P = 1/Nk``) and
  ``v`` = the identity, ``out[i, j] = Z_ij / (Nk·(1 - p))``. A kernel's random numbers are its
  own, so by default the mask is held to what dropout must be, never to flash_lib's Philox:

  - the keep rate is within ``1 - p ± t``;
  - masks that must be independent agree as often as independent masks do, ``a = p² + (1 - p)²
    ± t``: rows ``i`` and ``i + L`` and keys ``j`` and ``j + L`` for every lag ``L`` from 1 to
    :data:`MAX_LAG` = 128 (a mask drawn at tile-local positions repeats with its tile's size),
    row ``i + 1`` against row ``i`` shifted by -8 ... 8 keys (the trap of one stream per row
    started at ``counter=[row, 0, 0, 0]``), every pair of batch elements (a mask keyed by the
    head alone), seeds ``s`` and ``s + 1``. Each ``t`` is Bernstein's bound at a false-alarm
    probability of :data:`FALSE_ALARM` / m over the m comparisons, so a correct generator fails
    any of them with probability at most 1e-6 (derived in :func:`_half_width`); a failure says
    which index the mask ignores or repeats, with what period;

  with ``dropout_generator=`` (``"flash_lib"``: :func:`flash_lib.dropout_keep`), the kernel
  claims that generator, and its masks for two seeds must be the generator's at every pair;
  where they are not, :data:`DROPOUT_GENERATOR` names the index drawn wrongly (the batch index
  ignored, a tile-local row or key index, i and j swapped), else what the statistics find. Then:

  - the same seed gives the same mask twice, and, for a kernel that takes ``block_q`` and
    ``block_k``, at other block sizes (a mask drawn tile by tile from a stateful generator
    changes with the tiles);
  - on random inputs of the same shapes and seed, ``out`` is within the usual bound of ``(P∘Z/(1 -
    p))·V`` built in extended precision with that mask (and ``naive`` with it in the kernel's
    dtype), the lse within its bound of the undropped lse;
  - with a backward: the mask read off ``dV`` (``q = 0``, ``dout`` = the identity: ``dV[j, i] =
    Z_ij / (Nk·(1 - p))``) is the forward's, pair for pair, and ``dq``, ``dk``, ``dv`` on the
    random inputs are within their bound of the dense backward with that mask, which is the
    gradient of the forward just checked: the gradient is consistent with the forward under
    the same seed.

The gradient bound (``_gradients.py``) is the output's rule applied to each gradient as a whole:
``max|g - t| / max|t| <= FACTOR · naive's + GRAD_FLOOR[dtype]``.

Each check's diagnoses stand beside it, a table of :class:`flash_check.diagnose.Mistake` (a
condition on the facts the check measured, a message; the first row that holds names the cause).
The rows of :data:`DROPOUT_OUT` and :data:`DROPOUT_LSE` each carry what a kernel making their
mistake returns on the same random inputs and mask, as diagnose's variant table does.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
import zlib

import numpy as np

import flash_lib
from flash_check._core import (FACTOR, LSE_FLOOR, OUT_FLOOR, Case, Inputs, Result, _call,
                               _lse_error, _max_error, _reference, _split, random_qkv,
                               register_case)
from flash_check._gradients import _backward, _check_gradients
from flash_check._runner import _accuracy
from flash_check.diagnose import Mistake, always, explain

#: The dropout case: p, the batch dims and sizes of its arrays, the block sizes it tries.
DROPOUT_P = 0.3
DROPOUT_SHAPE = ((2, 2), 144, 160)
DROPOUT_BLOCKS = ((16, 16), (40, 24))
#: What the probe's two batch dims stand for, in the diagnoses.
DROPOUT_DIMS = ("batch", "head")
#: Rows (and keys) are compared with those 1 ... MAX_LAG positions on: a mask drawn at tile-local
#: positions repeats with the tile's size, 16 to 128 in FlashAttention's kernels (and Nq = 144,
#: Nk = 160 leave 16 rows and 32 keys at the largest lag).
MAX_LAG = 128
#: The tile sizes a claimed generator's diagnosis tries for a tile-local index.
TILES = (16, 32, 64, 128)
#: The probability that a correct generator fails any of the dropout case's statistical checks,
#: whatever the seed and the kernel (Bernstein's inequality and a union bound: _half_width).
FALSE_ALARM = 1e-6
#: Shifts (in keys) at which row i + 1's mask is compared with row i's.
ROW_SHIFTS = range(-8, 9)


# --------------------------------------------------------------------------------------------
# Sinks
# --------------------------------------------------------------------------------------------


def _sinks(rng, dtype):
    # Sinks of -1 ... 6 against ~70 keys of scores ~N(0, 1/4): the sink takes 0.5% to 85% of a row
    q, k, v = random_qkv(rng, 40, 70, dtype=dtype, batch=(2, 4))
    return Inputs(q, k, v, {"sinks": np.array([-1.0, 2.0, 4.0, 6.0])})


def _sinks_empty_rows(rng, dtype):
    q, k, v = random_qkv(rng, 30, 50, dtype=dtype, batch=(2, 3))
    mask = rng.random((2, 3, 30, 50)) < 0.6
    mask[:, :, [0, 7, 29]] = False  # rows with no allowed key: out 0, lse = sink
    sinks = np.array([[-3.0, 0.5, 2.0], [1.0, 5.0, -0.5]])  # (B, H)
    return Inputs(q, k, v, {"mask": mask, "sinks": sinks})


def _sinks_causal(rng, dtype):
    q, k, v = random_qkv(rng, 80, 50, dtype=dtype, batch=(2,))  # Nq > Nk: 30 rows see no key
    return Inputs(q, k, v, {"causal": True, "sinks": np.array([1.5, 3.0])})


def _sinks_softcap(rng, dtype):
    q, k, v = random_qkv(rng, 48, 64, batch=(2,))
    q = (4 * q).astype(dtype)  # scaled scores of spread ~4, capped at 3; sinks above the cap
    return Inputs(q, k.astype(dtype), v.astype(dtype), {"softcap": 3.0,
                                                        "sinks": np.array([4.0, 5.0])})


_SINKS_HINT = ("wrong with sinks: lse_i = log(exp(sink) + Σ_j exp(s_ij)), the sink unscaled and "
               "uncapped; start each row at m = sink, l = 1, acc = 0")


def _with_gradients(ctx):
    """The accuracy check, then the gradients' when the kernel's backward is given."""
    result = _accuracy(ctx)
    if ctx.backward is None or "lse" not in ctx.features:
        result.note = ("gradients not checked: " + ("no backward= given" if ctx.backward is None
                                                    else "the backward needs the lse feature"))
    elif result.ok:
        _sinks_gradients(ctx, result)
    return result


def _sinks_gradients(ctx, result):
    ref = _reference(ctx.case, ctx.dtype, ctx.seed)
    inputs = ref.inputs
    rng = np.random.default_rng([ctx.seed, zlib.crc32(ctx.case.name.encode()), 1])
    dout = rng.standard_normal(ref.out.shape).astype(inputs.q.dtype)
    returned, _ = _call(ctx.fn, inputs.q.copy(), inputs.k.copy(), inputs.v.copy(),
                        dict(inputs.kwargs))
    out, lse, problem = _split(returned, True)
    if problem is not None:
        return
    truth = flash_lib.precise_attention_backward(inputs.q, inputs.k, inputs.v, dout,
                                                 **inputs.kwargs)
    naive = flash_lib.naive_attention_backward(inputs.q, inputs.k, inputs.v, dout,
                                               **inputs.kwargs)
    grads = _backward(ctx, result, (inputs.q, inputs.k, inputs.v, out, lse, dout),
                      dict(inputs.kwargs), 4)
    if grads is not None:
        _check_gradients(ctx, result, grads, truth, naive, ("dq", "dk", "dv", "dsinks"),
                         dropout=False, sinks=True)
        result.note = "gradients checked, dsinks included"


for _case in [
    Case("sinks", "attention sinks, one logit per head (-1 ... 6) broadcast over the batch, "
         "Nq = 40 < Nk = 70; with backward=, the gradients and dsinks", _sinks,
         needs=("sinks",), hint=_SINKS_HINT, run=_with_gradients),
    Case("sinks_empty_rows", "sinks of shape (B, H) with a mask leaving rows with no key: there "
         "out = 0 and lse = sink; with backward=, the gradients", _sinks_empty_rows,
         needs=("sinks", "mask"), hint=_SINKS_HINT, run=_with_gradients),
    Case("sinks_causal", "sinks with causal, Nq = 80 > Nk = 50: the first 30 rows see only the "
         "sink", _sinks_causal, needs=("sinks", "causal"), hint=_SINKS_HINT),
    Case("sinks_softcap", "sinks (4, 5) above a softcap of 3: the cap applies to the scores, not "
         "to the sink", _sinks_softcap, needs=("sinks", "softcap"), hint=_SINKS_HINT),
]:
    register_case(_case)


def _is(field, value):
    """A condition: the fact ``field`` is ``value``."""
    return lambda ev, f: f[field] == value


# --------------------------------------------------------------------------------------------
# Dropout
# --------------------------------------------------------------------------------------------


def _dense(q, k, v, keep, p, scale, dtype, dout=None):
    """Dropout attention written out in ``dtype`` (longdouble: the truth): ``(out, lse)``, or the
    gradients ``(dq, dk, dv)`` of ``sum(dout * out)``, for the mask ``keep`` (rescale 1/(1-p))."""
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) * dtype(scale)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    prob = e / l
    z = np.where(keep, dtype(1) / (dtype(1) - dtype(p)), dtype(0))
    out = (prob * z) @ v
    if dout is None:
        return out, (m + np.log(l))[..., 0]
    dout = dout.astype(dtype)
    dv = np.swapaxes(prob * z, -1, -2) @ dout
    dp = (dout @ np.swapaxes(v, -1, -2)) * z
    ds = prob * (dp - (dout * out).sum(axis=-1, keepdims=True))
    return ds @ k * dtype(scale), np.swapaxes(ds, -1, -2) @ q * dtype(scale), dv


def _compute(dtype):
    return np.float32 if dtype in (np.float16,) or dtype.name == "bfloat16" else dtype.type


class _Stop(Exception):
    """A failure recorded; the rest of the dropout case cannot run."""


def _near(x, value, tol):
    return x.size > 0 and bool(np.all(np.abs(x - value) <= tol))


# The conditions on a keep mask read off a kernel (``ratio``: 0 dropped, 1 kept), forward or
# backward: not finite; no entry dropped or scaled (dropout ignored); kept entries unscaled.
def _ratio_nonfinite(ev, f):
    return not np.isfinite(f["ratio"]).all()


def _ratio_ignored(ev, f):
    return _near(f["ratio"], 1 - f["p"], f["tol"])


def _ratio_unscaled(ev, f):
    return _near(f["ratio"][f["ratio"] != 0], 1 - f["p"], f["tol"])


#: Why the output on uniform weights (q = 0) and v = identity is not a keep mask over
#: Nk·(1 - p): ``ratio`` = out·Nk·(1 - p), which must be 0 (dropped) or 1 (kept) everywhere.
DROPOUT_VALUES = (
    Mistake(_ratio_nonfinite, "NaN or inf in the output with dropout on, on finite inputs"),
    Mistake(_ratio_ignored, "dropout is ignored: every weight is kept and none is scaled (is "
            "dropout_p passed through to the kernel?)"),
    Mistake(_ratio_unscaled,
            "the kept weights are not divided by 1 - p: out = (P∘Z)·V where dropout is "
            "(P∘Z/(1 - p))·V, whose expectation over the mask Z is P·V"),
    Mistake(lambda ev, f: _near(f["row_sums"], 1.0, f["tol"]),
            "the kept weights are renormalised to sum to 1 (the mask applied before the row sum "
            "l, or a softmax over the kept keys): dropout keeps the undropped softmax P, zeroes "
            "the dropped entries and divides the rest by 1 - p"),
    Mistake(always, "on uniform weights (q = 0) and v = identity, out·Nk·(1 - p) must be 0 or 1 "
            "(out = (P∘Z/(1 - p))·V, Z a mask of 0s and 1s); found {values}"),
)


#: Why the keep mask read off the backward (``ratio`` = dV·Nk·(1 - p) on q = 0, dout = identity)
#: is not the forward's (``differ`` of ``total`` pairs).
DROPOUT_BACKWARD = (
    Mistake(_ratio_nonfinite, "NaN or inf in dv with dropout on, on finite inputs"),
    Mistake(_ratio_ignored,
            "the backward ignores dropout: dV = Pᵀ·dO, where it must be (P∘Z/(1 - p))ᵀ·dO with "
            "the forward's mask Z, regenerated from the seed"),
    Mistake(_ratio_unscaled,
            "the backward omits 1/(1 - p): dV = (P∘Z)ᵀ·dO, where it must be (P∘Z/(1 - p))ᵀ·dO, "
            "as must dP = (dO·Vᵀ)∘Z/(1 - p)"),
    Mistake(lambda ev, f: f["differ"] > 0,
            "the backward's keep mask differs from the forward's in {differ} of {total} pairs "
            "(read off dV on q = 0, dout = identity): the backward must regenerate the forward's "
            "mask element by element, from the same seed and the same counter (b, i, j), "
            "whatever order it visits the tiles in (key block first, in FlashAttention-2); a "
            "stateful generator, a counter with i and j swapped or tile-local positions give "
            "another mask"),
    Mistake(always, "dV·Nk·(1 - p) on q = 0, dout = identity must be 0 or 1; found {values}"),
)


# --------------------------------------------------------------------------------------------
# Dropout's statistics: the keep rate and independence, at every lag up to the tile sizes
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _half_width(sizes, variance, delta):
    """The half-width ``t`` of the interval a comparison's mean must fall in: a correct
    generator's mean falls outside ``expected ± t`` with probability at most ``delta``.

    A comparison of two keep masks is the mean of indicators ``X = [x = y]`` over pairs of
    distinct elements; for a correct generator, whose keep bits are independent Bernoulli(1 - p),
    each ``X`` is Bernoulli(``a``), ``a = p² + (1 - p)²``, of variance ``σ² = a(1 - a)`` (the keep
    rate is the mean of the bits themselves, ``a = 1 - p``, ``σ² = p(1 - p)``). Within one mask
    the pairs share elements: at lag ``L`` along an axis, element ``x + L`` ends the pair that
    starts at ``x`` and starts the next one, so the ``X`` are not independent. Split the pairs
    into two classes by the parity of ``⌊x / L⌋`` (``x`` the first element's position along the
    axis): the pair a pair's second element starts lies in the other class, so no element is in
    two pairs of one class, and a class's ``X`` are independent (a comparison of two different
    masks is one class). Bernstein's inequality for the mean of ``n_c`` independent variables in
    ``[0, 1]`` of variance ``σ²``::

        P(|mean_c - a| >= t) <= 2 exp(-n_c t² / (2σ² + 2t/3)),

    and if every class's mean is within ``t`` of ``a``, so is the comparison's (a weighted
    average of them), so ``P(|mean - a| >= t) <= Σ_c 2 exp(-n_c t² / (2σ² + 2t/3))``. ``t`` is
    the root of that sum = ``delta``. The case makes ``m`` comparisons and gives each ``delta =
    FALSE_ALARM / m``: by the union bound, which holds whatever the dependence between them, a
    correct generator fails any at all with probability at most :data:`FALSE_ALARM`. No normal
    approximation is involved, so the bound holds for the smallest classes too. ``sizes``: the
    classes' ``n_c``; an empty comparison (or one too small for any ``t <= 1``) gets ``inf``.
    """
    sizes = [n for n in sizes if n > 0]

    def tail(t):
        return sum(2 * math.exp(-n * t * t / (2 * variance + 2 * t / 3)) for n in sizes)

    if not sizes or tail(1.0) > delta:
        return math.inf
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (low, middle) if tail(middle) <= delta else (middle, high)
    return high


def _lag_classes(length, lag, other=1):
    """The two classes of the pairs ``(x, x + lag)`` along an axis of ``length``, ``⌊x / lag⌋``
    even and odd, each pair counted ``other`` times (the positions along the other axes)."""
    x = np.arange(max(length - lag, 0))
    odd = int((x // lag % 2).sum())
    return (other * (x.size - odd), other * odd)


@dataclasses.dataclass
class _Comparison:
    """One statistic of the keep mask against what a correct generator gives: ``agree`` the
    measured mean, ``expected`` and ``variance`` a correct generator's, ``sizes`` the classes of
    independent indicators (:func:`_half_width`), ``half`` the half-width; where it was taken:
    ``what`` ("rate", "rows", "keys", "batch" or "seed"), ``lag`` (rows or keys apart),
    ``shift`` (keys, row i + 1 against row i), ``pair`` (two flat batch indices)."""

    what: str
    agree: float
    expected: float
    variance: float
    sizes: tuple
    lag: int = 0
    shift: int = 0
    pair: tuple = ()
    half: float = math.inf

    @property
    def z(self):
        """The deviation in units of the half-width: above 1, a failure."""
        return abs(self.agree - self.expected) / self.half


def _comparisons(keep, other_seed, p):
    """Every statistic the dropout case holds a kept mask (*batch, Nq, Nk) to, half-widths
    set: the keep rate; rows ``i`` and ``i + L`` for every ``L`` = 1 ... :data:`MAX_LAG` (and row
    ``i + 1`` shifted by :data:`ROW_SHIFTS` keys); keys ``j`` and ``j + L`` likewise (rows and
    keys in the first batch element: the others may be its copies, found as such); every pair of
    batch elements; the masks of seeds ``s`` and ``s + 1`` (``other_seed``)."""
    a = p * p + (1 - p) ** 2
    flat = keep.reshape((-1,) + keep.shape[-2:])
    first = flat[0]
    n_q, n_k = first.shape

    def agreement(what, x, y, sizes, **where):
        return _Comparison(what, float(np.mean(x == y)) if x.size else a, a, a * (1 - a),
                           sizes, **where)

    found = [_Comparison("rate", float(keep.mean()), 1 - p, p * (1 - p), (keep.size,))]
    for shift in ROW_SHIFTS:
        lo, hi = max(0, shift), n_k - max(0, -shift)
        found.append(agreement("rows", first[1:, lo - shift:hi - shift], first[:-1, lo:hi],
                               _lag_classes(n_q, 1, hi - lo), lag=1, shift=shift))
    for lag in range(2, min(MAX_LAG, n_q - 1) + 1):
        found.append(agreement("rows", first[lag:], first[:-lag], _lag_classes(n_q, lag, n_k),
                               lag=lag))
    for lag in range(1, min(MAX_LAG, n_k - 1) + 1):
        found.append(agreement("keys", first[:, lag:], first[:, :-lag],
                               _lag_classes(n_k, lag, n_q), lag=lag))
    for b1, b2 in itertools.combinations(range(len(flat)), 2):
        found.append(agreement("batch", flat[b1], flat[b2], (flat[b1].size,), pair=(b1, b2)))
    found.append(agreement("seed", keep, other_seed, (keep.size,)))
    delta = FALSE_ALARM / len(found)
    for c in found:
        c.half = _half_width(c.sizes, c.variance, delta)
    return found


def _period(failing, what, tested):
    """The facts of the failing comparisons along rows or keys: the smallest lag (its
    comparison's numbers), whether every multiple of it tested fails too (a period), and the
    other failing lags."""
    by_lag = {c.lag: c for c in failing if c.shift == 0}
    first = by_lag[min(by_lag)]
    multiples = range(2 * first.lag, tested + 1, first.lag)
    also = [lag for lag in sorted(by_lag) if lag != first.lag]
    return {**dataclasses.asdict(first), "z": first.z,
            "period": first.lag > 1 and all(m in by_lag for m in multiples),
            "tile": first.lag in TILES,
            "index": "i" if what == "rows" else "j", "one": what[:-1],
            "also": (f", and at lag{'s' * (len(also) > 1)} {', '.join(map(str, also[:6]))}"
                     f"{'...' if len(also) > 6 else ''}") if also else ""}


def _batch_dims(pairs, batch):
    """The batch dims the copies among batch elements ignore, if the copies are exactly the pairs
    that differ in those dims alone; else None."""
    index = list(np.ndindex(batch))

    def differ(x, y):
        return {d for d in range(len(batch)) if index[x][d] != index[y][d]}

    dims = set().union(*(differ(x, y) for x, y in pairs))
    expected = {(x, y) for x, y in itertools.combinations(range(len(index)), 2)
                if differ(x, y) <= dims}
    return sorted(dims) if set(pairs) == expected else None


def _ignored(dims, batch):
    """``"the batch index: batches 0 and 1 draw the same mask for each head"`` for the batch
    dims a mask ignores (None: no such pattern, "")."""
    if not dims:
        return ""
    names = [DROPOUT_DIMS[d] for d in dims]
    kept = [DROPOUT_DIMS[d] for d in range(len(batch)) if d not in dims]
    if len(names) > 1:
        return f"the {' and '.join(names)} indices: every element draws the same mask"
    plural, n = {"batch": "batches", "head": "heads"}[names[0]], batch[dims[0]]
    return (f"the {names[0]} index: {plural} {'0 and 1' if n == 2 else f'0–{n - 1}'} draw the "
            f"same mask"
            + (f" for each {kept[0]}" if kept else ""))


def _findings(comparisons, batch, n_q, n_k):
    """The failures, at most one per statistic ("rate", "rows", "keys", "batch", "seed"): the
    check's name, what was measured, the bound, and the facts of its diagnosis. Where some
    comparison finds copies (agreement 1: a repeat along rows or keys, batch elements or seeds
    that share a mask), only the statistics with copies are reported: the others' bounds assume
    distinct elements, and a mask that repeats holds each element several times."""
    found = []
    copied = {c.what for c in comparisons if c.what != "rate" and c.agree == 1.0}
    for what in ("rate", "rows", "keys", "batch", "seed"):
        failing = [c for c in comparisons if c.what == what and c.z > 1]
        if not failing or (copied and what not in copied):
            continue
        worst = max(failing, key=lambda c: c.z)
        facts = {**dataclasses.asdict(worst), "z": worst.z}
        if what == "rows" and not any(c.shift == 0 for c in failing if c.lag == 1):
            facts = facts if worst.shift else _period(failing, what, min(MAX_LAG, n_q - 1))
        elif what in ("rows", "keys"):
            facts = _period(failing, what, min(MAX_LAG, (n_q if what == "rows" else n_k) - 1))
        elif what == "batch":
            copies = [c.pair for c in failing if c.agree == 1.0]
            dims = _batch_dims(copies, batch) if copies else None
            index = list(np.ndindex(batch))
            facts.update(ignores=_ignored(dims, batch), pairs=", ".join(
                f"{index[x]} and {index[y]}" for x, y in (copies or [worst.pair])[:4]))
        check = "keep rate" if what == "rate" else f"independent {what}"
        measured = (f"{facts['agree']:.4f} over {sum(worst.sizes)} pairs" if what == "rate"
                    else f"agreement {facts['agree']:.3f}" + (
                        f" at lag {facts['lag']}" if what in ("rows", "keys") else ""))
        digits = 4 if what == "rate" else 3
        found.append((check, measured, f"{facts['expected']:.{digits}f} ± "
                                       f"{facts['half']:.{digits}f}", facts))
    return found


def _axis(ev, f, what, **more):
    return f["what"] == what and all(f.get(key) == value for key, value in more.items())


_NOT_EXPECTED = ("(agreement {agree:.3f}{also}; independent masks agree {expected:.3f} ± "
                 "{half:.3f})")

#: Why masks that must be independent agree more (or less) often than independent ones: the
#: facts of :func:`_findings` (``what``: "rows", "keys", "batch" or "seed"; the smallest ``lag``
#: that fails, ``period`` if its multiples fail too, ``tile`` if it is a tile size; ``shift``).
DROPOUT_CORRELATED = (
    Mistake(lambda ev, f: f["what"] == "rows" and f["shift"] != 0,
            "row i + 1's keep mask is row i's shifted by {shift} keys (agreement {agree:.3f}; "
            "independent masks agree {expected:.3f} ± {half:.3f}): one generator stream per row "
            "started at counter=[row, 0, 0, 0] overlaps the next row's stream (NumPy's Philox "
            "advances the counter once per 4 words); derive each element's counter so that no "
            "two coincide, e.g. (j // 4, i, b) taking word j % 4"),
    Mistake(lambda ev, f: _axis(ev, f, "rows", lag=1),
            "neighbouring query rows have the same keep mask " + _NOT_EXPECTED + ": the counter "
            "ignores the query position i"),
    Mistake(lambda ev, f: _axis(ev, f, "keys", lag=1),
            "neighbouring keys' masks agree on {agree:.3f} of the pairs (independent masks agree "
            "{expected:.3f} ± {half:.3f}): the random numbers are not independent from key to "
            "key"),
    Mistake(lambda ev, f: f.get("period") and f.get("tile"),
            "the keep mask repeats along {what} with period {lag}: a tile-local {one} index, "
            "{index} mod {lag} (the position in a block of {lag} {what}), not the global {one} "
            "{index} ({what} {index} and {index} + {lag} agree on {agree:.3f} of the pairs{also}; "
            "independent masks agree {expected:.3f} ± {half:.3f}): draw each element's number at "
            "its global position (b, i, j), plus the kernel's offsets"),
    Mistake(lambda ev, f: f.get("period"),
            "the keep mask repeats along {what} with period {lag} ({what} {index} and "
            "{index} + {lag} agree on {agree:.3f} of the pairs{also}; independent masks agree "
            "{expected:.3f} ± {half:.3f}): the counter of (b, i, j) wraps every {lag} {what}"),
    Mistake(lambda ev, f: f["what"] in ("rows", "keys"),
            "{what} {lag} apart have correlated keep masks " + _NOT_EXPECTED + ": the random "
            "numbers of elements {lag} {what} apart overlap"),
    Mistake(lambda ev, f: f["what"] == "batch" and f["ignores"],
            "the mask ignores {ignores} (agreement {agree:.3f}; independent masks agree "
            "{expected:.3f} ± {half:.3f}): key each element's number by its (batch, head) "
            "position too (flash_lib: by the flat index b over every batch dim)"),
    Mistake(lambda ev, f: f["what"] == "batch",
            "batch elements (batch, head) {pairs} have correlated keep masks (agreement "
            "{agree:.3f}; independent masks agree {expected:.3f} ± {half:.3f}): their random "
            "numbers overlap"),
    Mistake(lambda ev, f: f["what"] == "seed",
            "the masks of seeds s and s + 1 agree on {agree:.3f} of the pairs (independent masks "
            "agree {expected:.3f} ± {half:.3f}): the mask does not follow dropout_seed"),
    Mistake(always, "the keep masks of {what} are not independent (agreement {agree:.3f}; "
            "independent masks agree {expected:.3f} ± {half:.3f})"),
)


# --------------------------------------------------------------------------------------------
# Dropout: a kernel that claims a generator
# --------------------------------------------------------------------------------------------


def _name(generator):
    module = getattr(generator, "__module__", None)
    name = getattr(generator, "__qualname__", None) or getattr(generator, "__name__", None)
    return f"{module}.{name}" if module and name else repr(generator)


def _is_mask(build):
    """A condition: the kernel's mask is ``build(generator, seed, p, shape)``."""
    def test(ev, f):
        try:
            other = np.asarray(build(f["generator"], f["seed"], f["p"], f["shape"]), bool)
        except ValueError:  # a shape the candidate cannot take
            return False
        return other.shape == f["keep"].shape and np.array_equal(other, f["keep"])
    return test


def _tile_local(axis, tile):
    """The generator at positions taken mod ``tile`` along ``axis`` (-2 rows, -1 keys)."""
    def build(gen, seed, p, shape):
        if shape[axis] <= tile:
            raise ValueError("no repeat")
        small = list(shape)
        small[axis] = tile
        return np.take(gen(seed, p, tuple(small)), np.arange(shape[axis]) % tile, axis=axis)
    return build


def _keyed_by(dims):
    """The generator keyed by the batch dims ``dims`` alone (the others ignored)."""
    def build(gen, seed, p, shape):
        batch = shape[:-2]
        kept = tuple(batch[d] if d in dims else 1 for d in range(len(batch)))
        small = tuple(n for n in kept if n > 1) if len(dims) else ()
        return np.broadcast_to(gen(seed, p, small + shape[-2:]).reshape(kept + shape[-2:]),
                               shape)
    return build


#: Why a kernel's mask is not the generator it claims, ``generator(seed, p, shape)``: each row a
#: mistake and the mask a kernel making it draws (the first that is the kernel's names it), then
#: what the statistics found, then the count of pairs that differ.
DROPOUT_GENERATOR = (
    Mistake(_is_mask(_keyed_by((1,))),
            "the keep mask is {name}'s keyed by the head alone: the mask ignores the batch index, "
            "batches 0 and 1 draw the same mask for each head; key it by the flat index b over "
            "(batch, heads), as {name} does"),
    Mistake(_is_mask(_keyed_by((0,))),
            "the keep mask is {name}'s keyed by the batch alone: the mask ignores the head index, "
            "heads 0 and 1 draw the same mask in each batch; key it by the flat index b over "
            "(batch, heads), as {name} does"),
    Mistake(_is_mask(_keyed_by(())),
            "the keep mask is {name}'s for one (batch, head) element, the same for all: the mask "
            "ignores the batch and head indices; key it by the flat index b over (batch, heads)"),
    *(Mistake(_is_mask(_tile_local(-1, tile)),
              f"the keep mask is {{name}}'s at (b, i, j mod {tile}): it repeats along keys with "
              f"period {tile}, a tile-local key index; draw each element at its global key "
              f"position j (plus the kernel's key offset)") for tile in TILES),
    *(Mistake(_is_mask(_tile_local(-2, tile)),
              f"the keep mask is {{name}}'s at (b, i mod {tile}, j): it repeats along rows with "
              f"period {tile}, a tile-local row index; draw each element at its global row "
              f"position i (plus the kernel's row offset)") for tile in TILES),
    Mistake(_is_mask(lambda gen, seed, p, shape: np.swapaxes(
        gen(seed, p, shape[:-2] + shape[-2:][::-1]), -1, -2)),
            "the keep mask is {name}'s with i and j swapped, at (b, j, i): pass the row position "
            "first"),
    Mistake(lambda ev, f: f["statistics"], "the keep mask is not {name}'s ({differ} of {total} "
            "pairs differ), and {statistics}"),
    Mistake(always, "the keep mask differs from {name}(seed, p, shape) in {differ} of {total} "
            "pairs and shows none of the patterns looked for here: the kernel does not draw "
            "{name}'s numbers at the global positions (b, i, j), with this seed and p (another "
            "generator, another threshold, or an offset?)"),
)


#: Why the kept pairs change between calls: with other block sizes (``blocks``), or with the same.
DROPOUT_UNSTABLE = (
    Mistake(lambda ev, f: f["blocks"] is None,
            "two calls with the same seed kept different pairs ({differ} of {total}): the mask "
            "must be a function of the seed and the element alone (a global or stateful "
            "generator that is not reseeded?)"),
    Mistake(always, "the kept pairs change with the block sizes: (block_q, block_k) = {blocks} "
            "keeps {differ} of {total} pairs differently from the default tiles: the mask is "
            "drawn tile by tile from a stateful generator (np.random.Generator, "
            "torch.Generator), so it depends on the tiles and the order they are visited, or "
            "from tile-local positions; draw each element's number from a counter-based "
            "generator keyed by the seed, at a counter made of the element's own (b, i, j), as "
            "FlashAttention does with Philox"),
)


class _Dropout:
    """The dropout case's probes of one kernel: the masks read off its output."""

    def __init__(self, ctx, result):
        self.ctx, self.result = ctx, result
        self.dtype = np.dtype(ctx.dtype)
        self.batch, self.n_q, self.n_k = DROPOUT_SHAPE
        self.p = DROPOUT_P
        # a seed with both 32-bit halves nonzero (Philox's two key words), below 2**63
        self.seed = (0x9E3779B97F4A7C15 * (ctx.seed + 1)) % 2**63
        self.rng = np.random.default_rng([ctx.seed, zlib.crc32(b"dropout")])
        self.want_lse = "lse" in ctx.features
        self.tol = 1e-2  # of out·Nk·(1 - p), 0 or 1: float16's rounding is 5e-4

    def keywords(self, seed=None, **extra):
        return {"dropout_p": self.p, "dropout_seed": self.seed if seed is None else seed,
                **extra}

    def call(self, q, k, v, kwargs, what):
        try:
            returned, _ = _call(self.ctx.fn, q, k, v, kwargs)
        except Exception as exc:
            self.ctx.fail(self.result, "raised", f"{type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:160]}", "no exception",
                          f"the kernel raised on {what} ({', '.join(f'{key}=' for key in kwargs)});"
                          f" if it has no dropout, leave the feature out")
            raise _Stop from None
        out, lse, problem = _split(returned, self.want_lse)
        if problem is None and out.shape != q.shape[:-1] + (v.shape[-1],):
            problem = f"out has shape {out.shape}, expected {q.shape[:-1] + (v.shape[-1],)}"
        if problem is not None:
            self.ctx.fail(self.result, "shape", problem, "as documented", problem)
            raise _Stop
        return out, lse

    def probe_inputs(self, dv=None):
        shape = self.batch
        q = np.zeros(shape + (self.n_q, 16), self.dtype)
        k = self.rng.standard_normal(shape + (self.n_k, 16)).astype(self.dtype)
        if dv is None:  # v = identity: out[i, j] = P_ij Z_ij / (1 - p)
            v = np.broadcast_to(np.eye(self.n_k, dtype=self.dtype), shape + (self.n_k,) * 2)
        else:
            v = self.rng.standard_normal(shape + (self.n_k, dv)).astype(self.dtype)
        return q, k, np.ascontiguousarray(v)

    def keep(self, check, **kwargs):
        """The keep mask of one call on q = 0 and v = identity (fails the case if it is none)."""
        q, k, v = self.probe_inputs()
        out, _ = self.call(q, k, v, self.keywords(**kwargs), "the dropout probe (q = 0, v = I)")
        ratio = out.astype(np.float64) * self.n_k * (1 - self.p)
        return self.read(ratio, out.astype(np.float64).sum(axis=-1), check,
                         DROPOUT_VALUES, "keep values")

    def read(self, ratio, row_sums, check, table, name):
        kept, dropped = np.abs(ratio - 1) <= self.tol, np.abs(ratio) <= self.tol
        if not (kept | dropped).all():
            odd = ratio[~(kept | dropped)]
            values = ", ".join(f"{x:.4g}" for x in np.unique(np.round(odd, 4))[:4])
            self.ctx.fail(self.result, name, f"{odd.size} of {ratio.size} entries neither 0 "
                          f"nor 1 ({values}{'...' if odd.size > 4 else ''})", "0 or 1",
                          explain(table, self.ctx, ratio=ratio, p=self.p, tol=self.tol,
                                  row_sums=row_sums, values=values, differ=0,
                                  total=ratio.size))
            raise _Stop
        return kept

    def same(self, keep, other, blocks):
        differ = int((keep != other).sum())
        if differ:
            self.ctx.fail(self.result, "same mask", f"{differ} of {keep.size} pairs differ",
                          "the same kept pairs",
                          explain(DROPOUT_UNSTABLE, self.ctx, blocks=blocks, differ=differ,
                                  total=keep.size))


def _takes_blocks(fn):
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "block_q" in parameters and "block_k" in parameters


#: Why the keep rate is outside 1 - p ± half (``rate``, ``p``, ``half``: the half-width).
DROPOUT_RATE = (
    Mistake(lambda ev, f: abs(f["rate"] - f["p"]) <= f["half"],
            "the kernel keeps with probability p = {p:g}, not 1 - p: keep an element iff its "
            "uniform number is >= p (FlashAttention: iff its random word >= p·2³²)"),
    Mistake(always, "the keep rate is outside 1 - p ± {half:.4f}: the uniform numbers or the threshold "
            "are wrong (a word scaled by 2⁻³¹ instead of 2⁻³², a signed comparison, a threshold "
            "rounded from p in low precision?)"),
)


@dataclasses.dataclass(frozen=True, eq=False)
class _RandomRun:
    """The dropout case on random inputs: q, k, v, the keep mask read off the probe, p, the scale,
    and the truth (P∘Z/(1 - p))·V in extended precision; what the mistakes of
    :data:`DROPOUT_OUT` and :data:`DROPOUT_LSE` compute their outputs from."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    keep: np.ndarray
    p: float
    scale: float
    truth: np.ndarray


def _returns(mistake, error):
    """A condition: the kernel returned (``got``) what ``mistake(run)`` computes, to within 1% of
    its ``error`` from the truth (``err``)."""
    return lambda run, facts: error(facts["got"], mistake(run)) <= 0.01 * facts["err"]


def _scores(run):
    """The scaled scores q·kᵀ·scale in extended precision."""
    wide = np.longdouble
    return run.q.astype(wide) @ np.swapaxes(run.k, -1, -2).astype(wide) * run.scale


def _not_rescaled(run):
    """(P∘Z)·V: the kept weights not divided by 1 - p."""
    return run.truth * (1 - run.p)


def _renormalised(run):
    """Softmax over the kept keys only: the mask applied before the row sum."""
    s = _scores(run)
    e = np.where(run.keep, np.exp(s - s.max(axis=-1, keepdims=True)), 0)
    return (e / e.sum(axis=-1, keepdims=True)) @ run.v.astype(np.longdouble)


def _undropped(run):
    """Attention without dropout: every weight kept, none scaled."""
    return _dense(run.q, run.k, run.v, np.ones_like(run.keep), 0.0, run.scale, np.longdouble)[0]


def _kept_lse(run):
    """The log-sum-exp of the kept scores only."""
    return np.log(np.where(run.keep, np.exp(_scores(run)), 0).sum(axis=-1))


#: Why the output with dropout, on random inputs, is above its bound against the truth built with
#: the mask read off the probe: each row a mistake with what a kernel making it returns on the same
#: inputs and mask; the first whose output is the kernel's names it, else the last row.
DROPOUT_OUT = (
    Mistake(_returns(_not_rescaled, _max_error),
            "the output is (P∘Z)·V: the kept weights are not divided by 1 - p"),
    Mistake(_returns(_renormalised, _max_error),
            "the output is softmax over the kept keys: the mask is applied before the row sum "
            "l, which must stay the undropped one"),
    Mistake(_returns(_undropped, _max_error),
            "the output is attention without dropout on these inputs, although dropout showed on "
            "the probe: dropout depends on the inputs?"),
    Mistake(always, "wrong with dropout on random inputs, although the keep mask read off the "
            "probe (same seed, shape and p) was right: the mask depends on q, k or v, or the "
            "dropped weights reach P·V"),
)

#: Why the lse with dropout is above its bound against the undropped lse, as above.
DROPOUT_LSE = (
    Mistake(_returns(_kept_lse, _lse_error),
            "the lse is that of the kept scores only: FlashAttention's lse is the undropped one, "
            "which the backward's P = exp(S - lse) needs"),
    Mistake(always, "lse wrong with dropout on: it is the undropped log-sum-exp of the scores"),
)


def _statistics(ctx, probe, keep, other_seed):
    """The failures of the mask's statistics: (check, measured, bound, diagnosis) each."""
    comparisons = _comparisons(keep, other_seed, probe.p)
    return comparisons[0], [
        (check, measured, bound,
         explain(DROPOUT_RATE, ctx, rate=facts["agree"], p=probe.p, half=facts["half"])
         if check == "keep rate" else explain(DROPOUT_CORRELATED, ctx, **facts))
        for check, measured, bound, facts in _findings(comparisons, probe.batch, probe.n_q,
                                                       probe.n_k)]


def _independent(ctx, result, probe, keep, other_seed, notes):
    """A kernel whose generator is its own: the mask's statistics."""
    rate, failures = _statistics(ctx, probe, keep, other_seed)
    notes.append(f"keep rate {rate.agree:.4f}, 1 - p = {1 - probe.p:g} ± {rate.half:.4f}; rows "
                 f"and keys compared at lags 1 ... {MAX_LAG}")
    for failure in failures:
        ctx.fail(result, *failure)


def _claimed(ctx, result, probe, keep, other_seed, notes):
    """A kernel that claims a generator: its mask is the generator's at every pair (and if not,
    which index it ignores or repeats, or what else its statistics show)."""
    generator, name = ctx.dropout_generator, _name(ctx.dropout_generator)
    for seed, mask in ((probe.seed, keep), (probe.seed + 1, other_seed)):
        expected = np.asarray(generator(seed, probe.p, mask.shape), bool)
        differ = int((mask != expected).sum())
        if differ:
            _, failures = _statistics(ctx, probe, keep, other_seed)
            statistics = failures[0][3] if failures else ""
            ctx.fail(result, "generator", f"{differ} of {mask.size} pairs differ",
                     f"{name}(seed, p, shape)", explain(
                         DROPOUT_GENERATOR, ctx, keep=mask, generator=generator, seed=seed,
                         p=probe.p, shape=mask.shape, name=name, differ=differ,
                         total=mask.size, statistics=statistics))
            return
    notes.append(f"the mask is {name}'s at every pair (seeds s and s + 1)")


def _dropout(ctx):
    result = Result(ctx.case.name, ctx.dtype)
    probe = _Dropout(ctx, result)
    try:
        _dropout_checks(ctx, result, probe)
    except _Stop:
        pass
    return result


def _dropout_checks(ctx, result, probe):
    p = probe.p
    keep = probe.keep("keep values")
    other_seed = probe.keep("keep values", seed=probe.seed + 1)
    notes = []
    if ctx.dropout_generator is None:
        _independent(ctx, result, probe, keep, other_seed, notes)
    else:
        _claimed(ctx, result, probe, keep, other_seed, notes)
    n_k = probe.n_k
    # The same mask again, and at other block sizes
    probe.same(keep, probe.keep("keep values"), None)
    if _takes_blocks(ctx.fn):
        for block_q, block_k in DROPOUT_BLOCKS:
            probe.same(keep, probe.keep("keep values", block_q=block_q, block_k=block_k),
                       (block_q, block_k))
        notes.append(f"block sizes {', '.join(f'{a}x{b}' for a, b in DROPOUT_BLOCKS)}")
    else:
        notes.append("block sizes not checked (no block_q, block_k)")
    if not result.ok:
        result.note = "; ".join(notes)
        return

    # Accuracy on random inputs, against (P∘Z/(1-p))·V with the mask just read
    q, k, v = random_qkv(probe.rng, probe.n_q, n_k, dtype=probe.dtype, batch=probe.batch)
    kwargs = probe.keywords()
    out, lse = probe.call(q.copy(), k.copy(), v.copy(), kwargs, "random inputs")
    scale = 1 / math.sqrt(q.shape[-1])
    compute = _compute(probe.dtype)
    truth, truth_lse = _dense(q, k, v, keep, p, scale, np.longdouble)
    run = _RandomRun(q, k, v, keep, p, scale, truth)
    naive, naive_lse = _dense(q, k, v, keep, p, scale, compute)
    naive = naive.astype(probe.dtype)
    err, naive_err = _max_error(out, truth), _max_error(naive, truth)
    bound = FACTOR * naive_err + OUT_FLOOR[ctx.dtype]
    result.out_error, result.out_naive, result.out_bound = err, naive_err, bound
    if err > bound:
        ctx.fail(result, "out error", f"{err:.2g}", f"{FACTOR:g} x naive's {naive_err:.2g} + "
                 f"{OUT_FLOOR[ctx.dtype]:.2g} = {bound:.2g}",
                 explain(DROPOUT_OUT, run, got=out, err=err))
    if lse is not None:
        err = _lse_error(lse, truth_lse)
        naive_err = _lse_error(naive_lse.astype(lse.dtype), truth_lse)
        bound = FACTOR * naive_err + LSE_FLOOR[ctx.dtype]
        result.lse_error, result.lse_naive, result.lse_bound = err, naive_err, bound
        if err > bound:
            ctx.fail(result, "lse error", f"{err:.2g}", f"{bound:.2g}",
                     explain(DROPOUT_LSE, run, got=lse, err=err))
    if ctx.backward is None or lse is None:
        notes.append("gradients not checked" + (": no backward= given" if ctx.backward is None
                                                else ": needs the lse feature"))
        result.note = "; ".join(notes)
        return
    if not result.ok:
        result.note = "; ".join(notes)
        return

    # The backward: its mask, read off dV on q = 0 and dout = identity, is the forward's
    pq, pk, pv = probe.probe_inputs(dv=probe.n_q)
    pout, plse = probe.call(pq.copy(), pk.copy(), pv.copy(), kwargs, "the backward's probe")
    eye = np.ascontiguousarray(np.broadcast_to(np.eye(probe.n_q, dtype=probe.dtype),
                                               probe.batch + (probe.n_q,) * 2))
    grads = _backward(ctx, result, (pq, pk, pv, pout, plse, eye), dict(kwargs), 3)
    if grads is None:
        return
    if grads[2].shape != pv.shape:
        ctx.fail(result, "dv shape", f"{grads[2].shape}", f"{pv.shape}",
                 f"dv has shape {grads[2].shape}, expected v's {pv.shape}")
        return
    ratio = np.swapaxes(grads[2].astype(np.float64), -1, -2) * n_k * (1 - p)
    try:
        back = probe.read(ratio, ratio.sum(axis=-1), "backward keep", DROPOUT_BACKWARD,
                          "backward mask")
    except _Stop:
        return
    differ = int((back != keep).sum())
    if differ:
        ctx.fail(result, "backward mask", f"{differ} of {keep.size} pairs differ",
                 "the forward's mask", explain(
                     DROPOUT_BACKWARD, ctx, ratio=ratio, p=p, tol=probe.tol,
                     differ=differ, total=keep.size, values=""))
        return
    # The gradients on the random inputs, against the dense backward with the same mask
    dout = probe.rng.standard_normal(out.shape).astype(probe.dtype)
    grads = _backward(ctx, result, (q, k, v, out, lse, dout), dict(kwargs), 3)
    if grads is None:
        return
    truth = _dense(q, k, v, keep, p, scale, np.longdouble, dout)
    naive = [g.astype(probe.dtype) for g in _dense(q, k, v, keep, p, scale, compute, dout)]
    _check_gradients(ctx, result, grads, truth, naive, ("dq", "dk", "dv"), dropout=True,
                     sinks=False)
    notes.append("the backward's mask and gradients checked")
    result.note = "; ".join(notes)


register_case(Case(
    "dropout", f"dropout p = {DROPOUT_P:g}, the mask read off q = 0, v = I: its keep rate, rows "
    f"and keys independent at lags 1 ... {MAX_LAG}, batch elements and seeds (or, claimed, the "
    f"generator's mask at every pair), the same mask again and at other block sizes, out and "
    f"lse on random inputs; with backward=, the backward's mask and the gradients", None,
    needs=("dropout",), once=True, run=_dropout,
    hint="wrong with dropout: out = (P∘Z/(1 - p))·V with the undropped P"))

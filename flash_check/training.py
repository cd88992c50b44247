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
  ``Z`` a keep mask, Bernoulli(1 - p) per element (b, i, j); the lse is the undropped one. A
  kernel's random numbers are its own, so the dropout case reads the kernel's mask off its output
  and holds it to what dropout must be, never to flash_lib's Philox stream: on ``q = 0`` (uniform
  ``P = 1/Nk``) and ``v`` = the identity, ``out[i, j] = Z_ij / (Nk·(1 - p))``. Then:

  - the keep rate is within ``1 - p ± 5σ``, ``σ = sqrt(p(1 - p)/n)`` over the ``n`` pairs
    (binomial; a correct generator falls outside with probability 6e-7);
  - masks that must be independent agree as often as independent masks do, ``a = p² + (1 - p)²``
    ± 5σ: row ``i + 1`` against row ``i`` shifted by -8 ... 8 keys (the trap of one stream per
    row started at ``counter=[row, 0, 0, 0]``), neighbouring keys, neighbouring batch elements,
    seeds ``s`` and ``s + 1``. Comparisons within one array share elements (each indicator
    ``[x == y]`` shares one with at most two others), so σ² here is ``(a(1 - a) + 2|c|)/n``, ``c =
    p³ + (1 - p)³ - a²`` the covariance of two indicators that share an element;
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
import inspect
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
DROPOUT_SHAPE = ((2, 2), 96, 160)
DROPOUT_BLOCKS = ((16, 16), (40, 24))
#: Masks are compared at 5 standard deviations (two-sided: 5.7e-7 for one comparison).
SIGMAS = 5.0
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


#: Why two masks that must be independent agree more (or less) often than independent ones:
#: ``what`` is "rows" (row i + 1 against row i, ``shift`` keys on), "batch", "keys" or "seed".
DROPOUT_CORRELATED = (
    Mistake(lambda ev, f: f["what"] == "rows" and f["shift"] != 0,
            "row i + 1's keep mask is row i's shifted by {shift} keys (agreement {agree:.3f}; "
            "independent masks agree {expected:.3f} ± {half:.3f}): one generator stream per row "
            "started at counter=[row, 0, 0, 0] overlaps the next row's stream (NumPy's Philox "
            "advances the counter once per 4 words); derive each element's counter so that no "
            "two coincide, e.g. (j // 4, i, b) taking word j % 4"),
    Mistake(_is("what", "rows"),
            "neighbouring query rows have the same keep mask (agreement {agree:.3f}; independent "
            "masks agree {expected:.3f} ± {half:.3f}): the counter ignores the query position i"),
    Mistake(_is("what", "batch"),
            "neighbouring batch elements (heads) have the same keep mask (agreement {agree:.3f}; "
            "independent masks agree {expected:.3f} ± {half:.3f}): the counter ignores the batch "
            "index b"),
    Mistake(_is("what", "seed"),
            "the masks of seeds s and s + 1 agree on {agree:.3f} of the pairs (independent masks "
            "agree {expected:.3f} ± {half:.3f}): the mask does not follow dropout_seed"),
    Mistake(always, "neighbouring keys' masks agree on {agree:.3f} of the pairs (independent "
            "masks agree {expected:.3f} ± {half:.3f}): the random numbers are not independent "
            "from key to key"),
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

    def agreement(self, what, a, b, shared, shift=0):
        """How masks a and b (equal shapes) agree, against independent masks: a dict of the
        facts, with ``z`` the deviation in units of the 5σ half-width (above 1: a failure);
        ``shared``: the indicators share elements (compared within one array)."""
        p, n = self.p, a.size
        agree = float(np.mean(a == b)) if n else 0.0
        expected = p * p + (1 - p) ** 2
        var = expected * (1 - expected)
        if shared:
            var += 2 * abs(p ** 3 + (1 - p) ** 3 - expected ** 2)
        half = SIGMAS * math.sqrt(var / max(n, 1))
        return {"what": what, "shift": shift, "agree": agree, "expected": expected,
                "half": half, "z": abs(agree - expected) / half if n else 0.0}

    def independent(self, comparisons):
        """Fail on the comparisons whose masks are copies (agreement 1), else on the most
        significant one beyond 5σ: one finding, the most telling (a copied stream makes every
        other comparison over the same elements noisier than independent masks would be)."""
        copies = [c for c in comparisons if c["agree"] == 1.0]
        worst = max(comparisons, key=lambda c: c["z"])
        for c in copies or ([worst] if worst["z"] > 1 else []):
            self.ctx.fail(self.result, f"independent {c['what']}", f"agreement {c['agree']:.3f}",
                          f"{c['expected']:.3f} ± {c['half']:.3f}",
                          explain(DROPOUT_CORRELATED, self.ctx, **c))

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


#: Why the keep rate is outside 1 - p ± 5σ (``rate``, ``p``, ``half``: the half-width).
DROPOUT_RATE = (
    Mistake(lambda ev, f: abs(f["rate"] - f["p"]) <= f["half"],
            "the kernel keeps with probability p = {p:g}, not 1 - p: keep an element iff its "
            "uniform number is >= p (FlashAttention: iff its random word >= p·2³²)"),
    Mistake(always, "the keep rate is outside 1 - p ± 5σ: the uniform numbers or the threshold "
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
    notes = []
    # The keep rate: binomial, n pairs
    n = keep.size
    rate = float(keep.mean())
    half = SIGMAS * math.sqrt(p * (1 - p) / n)
    notes.append(f"keep rate {rate:.4f}, 1 - p = {1 - p:g} ± {half:.4f}")
    if abs(rate - (1 - p)) > half:
        ctx.fail(result, "keep rate", f"{rate:.4f} over {n} pairs", f"{1 - p:g} ± {half:.4f} "
                 f"(5σ)", explain(DROPOUT_RATE, ctx, rate=rate, p=p,
                                           half=half))
    # Independence: rows against shifted rows and keys (in the first batch element: the others
    # may be its copies, reported as such), batch elements, seeds
    n_k = probe.n_k
    flat = keep.reshape((-1,) + keep.shape[-2:])
    first = flat[0]
    comparisons = [probe.agreement("rows", first[1:, max(0, -shift):n_k - max(0, shift)],
                                   first[:-1, max(0, shift):n_k - max(0, -shift)], shared=True,
                                   shift=shift) for shift in ROW_SHIFTS]
    comparisons += [probe.agreement("keys", first[:, 1:], first[:, :-1], shared=True),
                    probe.agreement("batch", flat[1:], flat[:-1], shared=True),
                    probe.agreement("seed", keep, probe.keep("keep values", seed=probe.seed + 1),
                                    shared=False)]
    probe.independent(comparisons)
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
    "dropout", f"dropout p = {DROPOUT_P:g}, the mask read off q = 0, v = I: keep rate within 5σ, "
    f"independent rows, keys, heads and seeds, the same mask again and at other block sizes, "
    f"out and lse on random inputs; with backward=, the backward's mask and the gradients", None,
    needs=("dropout",), once=True, run=_dropout,
    hint="wrong with dropout: out = (P∘Z/(1 - p))·V with the undropped P"))

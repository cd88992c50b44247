"""The tutorial's exercises: the learner writes each kernel step, and flash_check grades it.

Each chapter that teaches a step ends with a "Your turn" section: a statement, a stub, a grade cell
and a hidden solution. In a notebook::

    from flash_check.exercises import grade, stub
    merge = stub("merge")             # replace with your own def merge(out_a, lse_a, out_b, lse_b)
    grade("merge", merge)             # not implemented yet / passed / what is wrong, and where

:data:`EXERCISES` lists them (name -> chapter, title, signature). :func:`grade` runs the cases the
step needs, smallest first (a 1 × 1 tile, an all-masked row, two tiles with a growing max, ...),
stops at the first failure and turns it into a hint: the case, what is wrong and where to look,
never the solution's code. The hints are diagnoses in flash_check's manner (the tables of
:mod:`flash_check.diagnose`: a condition and a message per known mistake, the first that holds
wins): the learner's answer is compared with what each classic mistake computes on the same
inputs (a rescale left out, causal aligned top-left, a page index off by one, ...). The forward
ends with :func:`flash_check.check_kernel`'s own cases (float32, its memory case included), whose
diagnoses become the hint. A stub gives "not implemented yet", an exception in the learner's code
one line naming the case that raised it.

From a shell, ``python -m flash_check.exercises`` grades your answers: it imports the module
``my_solutions`` from the current directory (or ``--from MODULE``) and prints every exercise
with its status (a function missing from the module: not implemented yet).

The solutions are in ``flash_check/_solutions.py`` and ``_solutions_triton.py`` (the Triton
exercise, graded only where Triton is installed); :func:`show_solution` prints one.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import inspect
import math
import sys
import traceback
import warnings
from collections.abc import Callable

import numpy as np

import flash_lib
import flash_serving
from flash_check import _solutions
from flash_check._runner import check_kernel
from flash_check.diagnose import Mistake, always, explain

__all__ = ["EXERCISES", "Exercise", "Grade", "CaseResult", "grade", "stub", "show_solution",
           "main", "NOT_IMPLEMENTED"]

#: The hint of a stub (or of any function that raises NotImplementedError).
NOT_IMPLEMENTED = "not implemented yet: write the function in place of the stub, then re-run grade"


@dataclasses.dataclass(frozen=True)
class Exercise:
    """One exercise: where it is taught, what it asks, the signature the grader calls."""

    name: str
    chapter: int
    title: str
    signature: str


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """One case of a grade: its name, whether the answer passed it, and what was found."""

    name: str
    ok: bool
    message: str = ""


@dataclasses.dataclass(frozen=True)
class Grade:
    """What :func:`grade` found: ``passed``, the ``hint`` (empty when passed), the ``cases`` run
    (the last one is the first that failed)."""

    name: str
    passed: bool
    hint: str
    cases: tuple

    def __str__(self):
        if self.passed:
            return f"{self.name}: passed ({len(self.cases)} of {len(self.cases)} cases)"
        if self.hint == NOT_IMPLEMENTED:
            return f"{self.name}: {NOT_IMPLEMENTED}"
        done = sum(c.ok for c in self.cases)
        return (f"{self.name}: not yet ({done} case(s) passed, then {self.cases[-1].name!r} "
                f"failed)\nhint: {self.hint}")

    __repr__ = __str__


class _Wrong(Exception):
    """Raised inside a case: the answer is wrong, and the message says why (the hint)."""


# --------------------------------------------------------------------------------------------
# Comparing an answer with the truth, and with the classic mistakes
# --------------------------------------------------------------------------------------------


#: How close an answer must be: rowwise relative error (flash_lib.rowwise_relative_error), loose
#: enough for an answer that computes in float32 (its errors here are below 1e-6), far below any
#: mistake's (0.01 and up).
TOL = 1e-4


def _array(name, x, shape):
    """``x`` as a float64 array of ``shape``, or a _Wrong saying what it is instead."""
    try:
        a = np.asarray(x, dtype=np.float64) if not isinstance(x, np.ndarray) or x.dtype != bool \
            else x
    except (TypeError, ValueError):
        raise _Wrong(f"{name} is a {type(x).__name__}, expected an array of shape {shape}") \
            from None
    if a.shape != tuple(shape):
        raise _Wrong(f"{name} has shape {a.shape}, expected {tuple(shape)}")
    return a


def _unpack(result, names, shapes):
    """The arrays of a tuple result, each checked for its shape."""
    if len(names) == 1:
        return (_array(names[0], result, shapes[0]),)
    if not isinstance(result, (tuple, list)) or len(result) != len(names):
        raise _Wrong(f"returned {type(result).__name__}"
                     f"{' of ' + str(len(result)) if isinstance(result, (tuple, list)) else ''}, "
                     f"expected a tuple ({', '.join(names)})")
    return tuple(_array(n, x, s) for n, x, s in zip(names, result, shapes))


def _bad(got, want, tol=TOL):
    """Where ``got`` is not ``want``: another non-finite value (-inf, NaN), or off by more than
    ``tol`` relative to its row's largest magnitude (as flash_lib.rowwise_relative_error; 1-D
    arrays: to each value's), that scale floored at 1e-3 of the array's largest (a gradient's
    row that is nearly 0 in exact arithmetic is rounding noise in float32)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    with np.errstate(invalid="ignore"):
        same = (got == want) | (np.isnan(got) & np.isnan(want))
        w = np.where(finite, np.abs(want), 0)
        scale = w if w.ndim < 2 else np.broadcast_to(w.max(axis=-1, keepdims=True), w.shape)
        scale = np.maximum(np.maximum(scale, 1e-3 * w.max(initial=0)), 1e-300)
        near = finite & np.isfinite(got) & (np.abs(got - want) <= tol * np.maximum(scale, 1))\
            if w.ndim < 2 else finite & np.isfinite(got) & (np.abs(got - want) <= tol * scale)
    return ~(same | near)


def _close(got, want, tol=TOL):
    """``got`` equals ``want`` within ``tol`` where it is finite, and exactly elsewhere."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return got.shape == want.shape and not _bad(got, want, tol).any()


def _where_wrong(name, got, want):
    """One line: where ``got`` first differs from ``want`` and by how much."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bad = _bad(got, want)
    if not bad.any():
        return False
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    return (f"{name}[{', '.join(map(str, idx))}] is {got[idx]:.6g}, expected {want[idx]:.6g} "
            f"({int(bad.sum())} of {bad.size} values wrong)")


@dataclasses.dataclass(frozen=True)
class _Evidence:
    """What a mistake's condition sees: the case's inputs, the answer's and the truth's outputs
    (tuples of arrays, in the order of ``names``)."""

    case: str
    inputs: dict
    got: tuple
    want: tuple
    names: tuple


def _computes(mistake):
    """A condition: the answer equals what ``mistake(**inputs)`` computes (and the truth does
    not), on every output the mistake changes."""

    def test(ev, facts):
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            wrong = mistake(**ev.inputs)
        wrong = wrong if isinstance(wrong, tuple) else (wrong,)
        differs = [not _close(w, t) for w, t in zip(wrong, ev.want)]
        return any(differs) and all(_close(g, w) for g, w, d in zip(ev.got, wrong, differs) if d)
    return test


def _nan_where_finite(ev, facts):
    for name, g, w in zip(ev.names, ev.got, ev.want):
        bad = np.isnan(g) & ~np.isnan(w)
        if bad.any():
            return {"name": name, "at": tuple(int(i) for i in np.argwhere(bad)[0])}
    return False


def _first_wrong(ev, facts):
    for name, g, w in zip(ev.names, ev.got, ev.want):
        where = _where_wrong(name, g, w)
        if where:
            return {"where": where}
    return False


#: The last rows of every table: NaN where the truth is finite, else where the values differ.
_GENERIC = (
    Mistake(_nan_where_finite, "{name} is NaN at {at} where the right answer is finite: an "
            "-inf - (-inf) or 0 · inf somewhere (a row or part with no allowed key yet?)"),
    Mistake(_first_wrong, "{where}"),
    Mistake(always, "wrong values"),
)


def _compare(case, inputs, got, want, names, table):
    """Raise _Wrong with the diagnosis unless ``got`` matches ``want`` output by output."""
    if all(_close(g, w) for g, w in zip(got, want)):
        return
    ev = _Evidence(case, inputs, got, want, names)
    raise _Wrong(explain(tuple(table) + _GENERIC, ev))


def _fresh(inputs):
    """Copies of the inputs, so that an answer that writes into them changes nothing here."""
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}


# --------------------------------------------------------------------------------------------
# merge (chapter 3)
# --------------------------------------------------------------------------------------------


def _merge_truth(out_a, lse_a, out_b, lse_b):
    return flash_lib.merge_attention(out_a, lse_a, out_b, lse_b)


def _merge_variant(out_a, lse_a, out_b, lse_b, *, normalise=True, stable=True, lse_max=False,
                   guard=True, select=True, average=False):
    """The merge with one step changed (the classic mistakes)."""
    if average:
        return (out_a + out_b) / 2, np.logaddexp(lse_a, lse_b)
    m = np.maximum(lse_a, lse_b) if stable else np.zeros_like(lse_a)
    if guard:
        m = np.where(m == -np.inf, 0, m)
    w_a, w_b = np.exp(lse_a - m), np.exp(lse_b - m)
    if select:
        out_a = np.where(lse_a[:, None] == -np.inf, 0, out_a)
        out_b = np.where(lse_b[:, None] == -np.inf, 0, out_b)
    total = w_a + w_b
    out = w_a[:, None] * out_a + w_b[:, None] * out_b
    if normalise:
        out = out / total[:, None]
    lse = np.maximum(lse_a, lse_b) if lse_max else m + np.log(total)
    if guard and normalise:
        empty = total == 0
        out = np.where(empty[:, None], 0, out)
        lse = np.where(empty, -np.inf, lse)
    return out, lse


_MERGE_MISTAKES = (
    Mistake(_computes(functools.partial(_merge_variant, average=True)),
            "out is the plain average of out_a and out_b: each part must weigh by its share of "
            "the total, exp(lse_a - lse) and exp(lse_b - lse)"),
    Mistake(_computes(functools.partial(_merge_variant, normalise=False)),
            "out is w_a·out_a + w_b·out_b without dividing by w_a + w_b: the weights must sum "
            "to 1 (each out is already normalised by its own part's sum)"),
    Mistake(_computes(functools.partial(_merge_variant, lse_max=True)),
            "out is right but lse is max(lse_a, lse_b): the merged lse is the log of the sum of "
            "both parts' sums, m + log(exp(lse_a - m) + exp(lse_b - m))"),
    Mistake(_computes(functools.partial(_merge_variant, stable=False)),
            "exp(lse) overflowed (lse here is near 800): subtract m = max(lse_a, lse_b) before "
            "taking exp, and add it back to the lse"),
    Mistake(_computes(functools.partial(_merge_variant, guard=False)),
            "a row where both parts are empty (lse_a = lse_b = -inf) came out NaN: with m = -inf, "
            "lse - m is -inf - (-inf) = NaN; use a finite m there, and give out 0, lse -inf"),
    Mistake(_computes(functools.partial(_merge_variant, select=False)),
            "an empty part (lse = -inf) whose out holds NaN or inf leaked into the merged row: "
            "its weight is 0, but 0 · NaN = NaN; select (np.where) instead of multiplying"),
)


def _merge_case(out_a, lse_a, out_b, lse_b):
    def run(fn):
        inputs = dict(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
        want = _merge_truth(**inputs)
        got = _unpack(fn(*_fresh(inputs).values()), ("out", "lse"), (out_a.shape, lse_a.shape))
        _compare("merge", inputs, got, want, ("out", "lse"), _MERGE_MISTAKES)
    return run


def _merge_cases():
    rng = np.random.default_rng(3)

    def part(rows, dv=4, shift=0.0):
        return rng.standard_normal((rows, dv)), rng.standard_normal(rows) + shift

    one = (*part(1, 1), *part(1, 1))
    two = (*part(6), *part(6, shift=1.5))
    far = (*part(5, shift=800.0), *part(5, shift=801.0))
    out_a, lse_a, out_b, lse_b = part(4) + part(4)
    lse_b = lse_b.copy()
    lse_b[1:3] = -np.inf
    out_b = out_b.copy()
    out_b[1] = 0.0
    out_b[2] = 0.0
    empty = (out_a, lse_a, out_b, lse_b)
    both = (out_a, np.where(np.arange(4) == 0, -np.inf, lse_a), out_b,
            np.where(np.arange(4) == 0, -np.inf, lse_b))
    garbage_b = out_b.copy()
    garbage_b[1], garbage_b[2] = np.nan, np.inf
    garbage = (out_a, lse_a, garbage_b, lse_b)
    return {
        "one_row": ("one row, one value: out_a, out_b of shape (1, 1)", _merge_case(*one)),
        "two_parts": ("six rows, the parts' lse about 1.5 apart", _merge_case(*two)),
        "large_lse": ("lse near 800, where exp(lse) overflows float64", _merge_case(*far)),
        "empty_part": ("rows 1-2 of part b are empty (lse_b = -inf, out_b = 0)",
                       _merge_case(*empty)),
        "both_empty": ("row 0 empty in both parts: out 0, lse -inf", _merge_case(*both)),
        "empty_part_garbage": ("an empty part's out holds NaN and inf (never read, as a split "
                               "with no allowed key may leave it)", _merge_case(*garbage)),
    }


# --------------------------------------------------------------------------------------------
# online_update (chapter 5)
# --------------------------------------------------------------------------------------------


def _update_truth(m, l, acc, s, v):
    m, l, acc, s = m.copy(), l.copy(), acc.copy(), s.copy()
    with np.errstate(invalid="ignore"):  # a NaN input propagates, as it should
        flash_lib.online_softmax_update(m, l, acc, s, v)
    return m, l, acc


def _update_variant(m, l, acc, s, v, *, rescale_l=True, rescale_acc=True, guard=True,
                    new_max=True, keep_m=False):
    m_new = np.maximum(m, s.max(axis=1))
    ref = np.where(m_new == -np.inf, 0, m_new) if guard else m_new
    alpha = np.exp(m - ref)
    # the stale max: p against the old m (where it is finite), alpha against the new one
    p = np.exp(s - (ref if new_max else np.where(m == -np.inf, ref, m))[:, None])
    l = (l * alpha if rescale_l else l) + p.sum(axis=1)
    acc = (acc * alpha[:, None] if rescale_acc else acc) + p @ v
    return (m if keep_m else m_new), l, acc


def _fold(update, tiles, rows, dv):
    """The state after folding ``tiles`` [(s, v), ...] through ``update`` from the empty state."""
    state = (np.full(rows, -np.inf), np.zeros(rows), np.zeros((rows, dv)))
    for s, v in tiles:
        result = update(*(x.copy() for x in state), s.copy(), v.copy())
        state = _unpack(result, ("m", "l", "acc"), ((rows,), (rows,), (rows, dv)))
    return state


def _fold_mistake(**kwargs):
    def mistake(tiles, rows, dv):
        return _fold(functools.partial(_update_variant, **kwargs), tiles, rows, dv)
    return _computes(mistake)


_UPDATE_MISTAKES = (
    Mistake(_fold_mistake(rescale_acc=False, rescale_l=False),
            "when a row's max rises from m to m', neither l nor acc is rescaled: multiply both by "
            "alpha = exp(m - m') before adding the new tile's terms"),
    Mistake(_fold_mistake(rescale_acc=False),
            "acc is not rescaled when a row's max rises from m to m' (l is): multiply acc by "
            "alpha = exp(m - m') before adding p @ v"),
    Mistake(_fold_mistake(rescale_l=False),
            "l is not rescaled when a row's max rises from m to m' (acc is): multiply l by "
            "alpha = exp(m - m') before adding the tile's sum of p"),
    Mistake(_fold_mistake(new_max=False),
            "p is taken against the old max m, not the new m' = max(m, rowmax(s)): the tile's "
            "terms then live on another scale than l and acc (and overflow when the max jumps)"),
    Mistake(_fold_mistake(keep_m=True),
            "m is returned unchanged: return the new running max m' = max(m, rowmax(s))"),
    Mistake(_fold_mistake(guard=False),
            "NaN in a row whose scores so far are all -inf: m' = -inf there, and s - m' is "
            "-inf - (-inf) = NaN; subtract a finite reference (0) where m' = -inf, so that the "
            "row stays m = -inf, l = 0, acc = 0"),
)


def _update_case(tiles, rows, dv):
    def run(fn):
        want = _fold(_update_truth, tiles, rows, dv)
        got = _fold(fn, tiles, rows, dv)
        _compare("online_update", dict(tiles=tiles, rows=rows, dv=dv), got, want,
                 ("m", "l", "acc"), _UPDATE_MISTAKES)
    return run


def _update_cases():
    rng = np.random.default_rng(5)

    def tile(rows, cols, dv, shift=0.0):
        return rng.standard_normal((rows, cols)) + shift, rng.standard_normal((cols, dv))

    one = [tile(1, 1, 1)]
    first = [tile(4, 8, 3)]
    growing = [tile(4, 8, 3), tile(4, 8, 3, shift=6.0)]
    masked = [tile(4, 8, 3), tile(4, 8, 3)]
    masked[0][0][1] = -np.inf  # row 1: nothing allowed in the first tile
    masked[0][0][2, :5] = -np.inf  # row 2: some keys masked
    empty = [tile(4, 8, 3), tile(4, 8, 3, shift=4.0)]
    for s, _ in empty:
        s[3] = -np.inf  # row 3: no key at all, in any tile
    return {
        "one_by_one": ("one row, one key, dv = 1, from the empty state", _update_case(one, 1, 1)),
        "one_tile": ("one 4 × 8 tile from the empty state (m = -inf, l = 0, acc = 0)",
                     _update_case(first, 4, 3)),
        "growing_max": ("two tiles, the second's scores about 6 larger: every row's max rises",
                        _update_case(growing, 4, 3)),
        "masked_first_tile": ("row 1's scores are all -inf in the first tile, finite in the "
                              "second", _update_case(masked, 4, 3)),
        "all_masked_row": ("row 3's scores are -inf in every tile: it must stay m = -inf, l = 0, "
                           "acc = 0", _update_case(empty, 4, 3)),
    }


# --------------------------------------------------------------------------------------------
# forward (chapters 5 and 6)
# --------------------------------------------------------------------------------------------


def _forward_variant(q, k, v, *, causal=False, top_left=False, normalise=True, scale=None,
                     lse_plain=False, lse_base2=False, keys=None, tail_empty_nan=False):
    n_q, n_k = q.shape[0], k.shape[0]
    scale = 1 / math.sqrt(q.shape[1]) if scale is None else scale
    s = scale * (q @ k.T)
    allowed = np.ones((n_q, n_k), bool)
    if causal:
        allowed = np.tril(allowed) if top_left else flash_lib.causal_mask(n_q, n_k)
    if keys is not None:
        allowed[:, keys:] = False
    s = np.where(allowed, s, -np.inf)
    m = s.max(axis=1)
    ref = np.where(m == -np.inf, 0, m)
    p = np.exp(s - ref[:, None])
    l = p.sum(axis=1)
    empty = l == 0
    acc = p @ v
    out = acc / np.where(empty, 1, l)[:, None] if normalise else acc
    if tail_empty_nan:
        out = np.where(empty[:, None], np.nan, out)
    lse = np.where(empty, -np.inf, ref if lse_plain else ref + np.log(np.where(empty, 1, l)))
    if lse_base2:
        lse = lse * math.log2(math.e)
    return out, lse


def _forward_mistake(**kwargs):
    def mistake(q, k, v, causal, block_q, block_k):
        return _forward_variant(q, k, v, causal=causal, **kwargs)
    return _computes(mistake)


def _keys_dropped(ev, facts):
    q, k, v = ev.inputs["q"], ev.inputs["k"], ev.inputs["v"]
    n_k, block = k.shape[0], ev.inputs["block_k"]
    first = n_k - n_k % block
    if 0 < first < n_k and _computes(functools.partial(_forward_variant, keys=first))(
            _Evidence(ev.case, dict(q=q, k=k, v=v, causal=ev.inputs["causal"]), ev.got, ev.want,
                      ev.names), facts):
        return {"first": first, "n_k": n_k}
    return False


def _tail_rows(ev, facts):
    """Rows from a multiple of block_q on are wrong, the rows before right (flash_check's
    diagnosis of a dropped last query block, on the answer's own block size)."""
    out, want, block = ev.got[0], ev.want[0], ev.inputs["block_q"]
    wrong = _bad(out, want).any(axis=1)
    first = len(wrong) - len(wrong) % block
    if 0 < first < len(wrong) and wrong[first:].all() and not wrong[:first].any():
        return {"first": first, "last": len(wrong) - 1}
    return False


def _only(index, names):
    """A condition: of the outputs, exactly those at ``index`` are wrong."""
    def test(ev, facts):
        wrong = [not _close(g, w) for g, w in zip(ev.got, ev.want)]
        return wrong == [i in index for i in range(len(names))]
    return test


_FORWARD_MISTAKES = (
    Mistake(_forward_mistake(normalise=False),
            "out is acc, not acc / l: divide each row by its sum l at the end"),
    Mistake(_forward_mistake(scale=1.0),
            "the scores are not scaled: s = q·kᵀ / sqrt(d)"),
    Mistake(_forward_mistake(lse_plain=True),
            "lse is the running max m alone: the log-sum-exp is m + log(l)"),
    Mistake(_forward_mistake(lse_base2=True),
            "lse is in base 2: return the natural log-sum-exp, m + log(l)"),
    Mistake(_forward_mistake(top_left=True),
            "causal is aligned top-left (key j allowed iff j <= i): with Nq != Nk it must be "
            "bottom-right, j <= i + (Nk - Nq)"),
    Mistake(_keys_dropped,
            "the output is attention over the first {first} of {n_k} keys: the last, partial key "
            "block is dropped (loop up to Nk, with a shorter last block)"),
    Mistake(_forward_mistake(tail_empty_nan=True),
            "a row with no allowed key (under causal with Nq > Nk, the first Nq - Nk rows) is "
            "NaN: l = 0 there, so acc / l is 0 / 0; give out 0 and lse -inf"),
    Mistake(_tail_rows,
            "rows {first} to {last} are wrong, the rows before them right: the last, partial "
            "query block is dropped or mishandled (block_q divides {first})"),
    Mistake(_only((1,), ("out", "lse")),
            "out is right but lse is not: lse = m + log(l), the natural log of each row's sum of "
            "exp(s), with m the row's final max"),
)


def _forward_case(n_q, n_k, d, causal, block_q, block_k, seed, grow=False, **call):
    def run(fn):
        rng = np.random.default_rng(seed)
        q, k, v = (rng.standard_normal(shape) for shape in ((n_q, d), (n_k, d), (n_k, d)))
        if grow:  # keys that score ever higher: each row's max rises tile after tile
            k = k + np.linspace(0, 4, n_k)[:, None] * np.sign(q.sum(axis=0))[None, :]
        inputs = dict(q=q, k=k, v=v, causal=causal, block_q=block_q, block_k=block_k)
        want = _forward_variant(q, k, v, causal=causal)
        fresh = _fresh(inputs)
        got = _unpack(fn(fresh.pop("q"), fresh.pop("k"), fresh.pop("v"), **fresh, **call),
                      ("out", "lse"), ((n_q, d), (n_q,)))
        _compare("forward", inputs, got, want, ("out", "lse"), _FORWARD_MISTAKES)
    return run


def _forward_as_kernel(fn):
    """The learner's forward as a flash_check kernel: q, k, v (..., N, d) head by head."""

    def kernel(q, k, v, *, causal=False, scale=None):
        if scale is not None:  # the forward's scale is 1/sqrt(d): fold another one into q
            q = (q * (scale * math.sqrt(q.shape[-1]))).astype(q.dtype)
        lead = q.shape[:-2]
        outs, lses = [], []
        for index in np.ndindex(*lead):
            out, lse = fn(q[index], k[index], v[index], causal=causal, block_q=64, block_k=64)
            outs.append(np.asarray(out))
            lses.append(np.asarray(lse))
        if not lead:
            return outs[0], lses[0]
        return (np.stack(outs).reshape(*lead, *outs[0].shape),
                np.stack(lses).reshape(*lead, *lses[0].shape))
    kernel.__name__ = getattr(fn, "__name__", "forward")
    return kernel


#: flash_check's own cases the forward must pass, in float32 (its memory case at N = 512 and 4096)
FORWARD_CHECK_CASES = ("random", "late_max", "size_1x1", "size_63x65", "size_65x63",
                       "size_1000x17", "size_3x1000", "decode", "causal_square", "causal_wide",
                       "causal_tall", "memory")


def _forward_check(fn):
    report = check_kernel(_forward_as_kernel(fn), features=("causal", "lse", "memory"),
                          dtypes=("float32",), cases=FORWARD_CHECK_CASES)
    if not report.ok:
        failure = report.failures[0]
        raise _Wrong(f"flash_check case {failure.case!r} ({failure.check}: {failure.measured}): "
                     f"{failure.diagnosis}")


def _forward_cases():
    return {
        "one_by_one": ("one query, one key, d = 1", _forward_case(1, 1, 1, False, 64, 64, 1)),
        "one_tile": ("8 queries, 8 keys, d = 4: one tile",
                     _forward_case(8, 8, 4, False, 64, 64, 2)),
        "growing_max": ("40 × 96 keys in tiles of 16: every row's max rises from tile to tile",
                        _forward_case(40, 96, 8, False, 16, 16, 3, grow=True)),
        "partial_blocks": ("70 queries, 100 keys, blocks of 32: the last blocks are partial",
                           _forward_case(70, 100, 8, False, 32, 32, 4)),
        "causal_wide": ("causal, Nq = 40 < Nk = 100: bottom-right, key j <= i + 60",
                        _forward_case(40, 100, 8, True, 16, 32, 5)),
        "causal_empty_rows": ("causal, Nq = 100 > Nk = 40: rows 0-59 have no key (out 0, lse "
                              "-inf)", _forward_case(100, 40, 8, True, 32, 16, 6)),
        "flash_check": ("flash_check.check_kernel's cases in float32: " +
                        ", ".join(FORWARD_CHECK_CASES) + " (scratch memory must not grow as N²)",
                        _forward_check),
    }


# --------------------------------------------------------------------------------------------
# backward (chapters 12 and 13)
# --------------------------------------------------------------------------------------------


def _backward_variant(q, k, v, out, lse, dout, *, causal=False, use_D=True, scale_dq=True,
                      scale_dk=True, top_left=False, empty_nan=False, d_from="out"):
    n_q, n_k = q.shape[0], k.shape[0]
    scale = 1 / math.sqrt(q.shape[1])
    s = scale * (q @ k.T)
    allowed = np.ones((n_q, n_k), bool)
    if causal:
        allowed = np.tril(allowed) if top_left else flash_lib.causal_mask(n_q, n_k)
    lse_safe = np.where(lse == -np.inf, 0, lse)
    p = np.where(allowed, np.exp(np.where(allowed, s, 0) - lse_safe[:, None]), 0)
    if empty_nan:
        p = np.where((lse == -np.inf)[:, None], np.nan, p)
    dv = p.T @ dout
    dp = dout @ v.T
    D = (dout * out).sum(axis=1) if d_from == "out" else dp.sum(axis=1)
    ds = p * (dp - D[:, None]) if use_D else p * dp
    dq = ds @ k * (scale if scale_dq else 1)
    dk = ds.T @ q * (scale if scale_dk else 1)
    return dq, dk, dv


def _backward_mistake(**kwargs):
    def mistake(q, k, v, out, lse, dout, causal, block_q, block_k):
        return _backward_variant(q, k, v, out, lse, dout, causal=causal, **kwargs)
    return _computes(mistake)


_BACKWARD_MISTAKES = (
    Mistake(_backward_mistake(use_D=False),
            "dS = P ∘ dP without D: the softmax's gradient is dS = P ∘ (dP - D), with "
            "D_i = rowsum(dO ∘ O)_i (chapter 12)"),
    Mistake(_backward_mistake(scale_dq=False, scale_dk=False),
            "dq and dk lack the softmax scale: S = scale · Q·Kᵀ, so dQ = scale · dS·K and "
            "dK = scale · dSᵀ·Q"),
    Mistake(_backward_mistake(scale_dq=False),
            "dq lacks the softmax scale (dk has it): dQ = scale · dS·K"),
    Mistake(_backward_mistake(scale_dk=False),
            "dk lacks the softmax scale (dq has it): dK = scale · dSᵀ·Q"),
    Mistake(_backward_mistake(top_left=True),
            "causal is aligned top-left (key j allowed iff j <= i): with Nq != Nk it must be "
            "bottom-right, j <= i + (Nk - Nq), as in the forward"),
    Mistake(_backward_mistake(empty_nan=True),
            "NaN from a row with no allowed key (lse = -inf): exp(s - lse) is exp(+inf) there; "
            "such a row has P = 0 and adds nothing to any gradient"),
    Mistake(_only((0, 1), ("dq", "dk", "dv")),
            "dv is right, dq and dk are not: P is right, so look at dS = P ∘ (dP - D), with "
            "dP = dO·Vᵀ and D_i = rowsum(dO ∘ O)_i, and at dQ = scale · dS·K, "
            "dK = scale · dSᵀ·Q"),
    Mistake(_only((2,), ("dq", "dk", "dv")),
            "dq and dk are right, dv is not: dV = Pᵀ·dO, summed over every query block, with no "
            "scale"),
)


def _backward_case(n_q, n_k, d, causal, block_q, block_k, seed):
    def run(fn):
        rng = np.random.default_rng(seed)
        q, k, v, dout = (rng.standard_normal(shape)
                         for shape in ((n_q, d), (n_k, d), (n_k, d), (n_q, d)))
        out, lse = flash_lib.flash_attention(q, k, v, causal=causal, return_lse=True)
        inputs = dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, causal=causal,
                      block_q=block_q, block_k=block_k)
        want = flash_lib.flash_attention_backward(q, k, v, out, lse, dout, causal=causal)
        fresh = _fresh(inputs)
        args = [fresh.pop(x) for x in ("q", "k", "v", "out", "lse", "dout")]
        got = _unpack(fn(*args, **fresh), ("dq", "dk", "dv"), (q.shape, k.shape, v.shape))
        _compare("backward", inputs, got, want, ("dq", "dk", "dv"), _BACKWARD_MISTAKES)
    return run


def _backward_cases():
    return {
        "one_by_one": ("one query, one key, d = 1 (dq = dk = 0: one key takes all the weight)",
                       _backward_case(1, 1, 1, False, 64, 64, 11)),
        "one_tile": ("8 queries, 8 keys, d = 4: one tile",
                     _backward_case(8, 8, 4, False, 64, 64, 12)),
        "tiles": ("70 queries, 100 keys in blocks of 32 and 16", _backward_case(70, 100, 8, False,
                                                                                32, 16, 13)),
        "causal_wide": ("causal, Nq = 40 < Nk = 100: bottom-right",
                        _backward_case(40, 100, 8, True, 16, 32, 14)),
        "causal_empty_rows": ("causal, Nq = 100 > Nk = 40: rows 0-59 have no key (lse = -inf)",
                              _backward_case(100, 40, 8, True, 32, 16, 15)),
    }


# --------------------------------------------------------------------------------------------
# attend_tile: the Triton forward's inner loop (chapter 16)
# --------------------------------------------------------------------------------------------


def _triton():
    """The Triton exercise's module (solution and grading kernel), imported on first use: Triton
    is not installed everywhere."""
    return importlib.import_module("flash_check._solutions_triton")


def _tile_variant(s, v, *, rescale_l=True, rescale_acc=True, guard=True, base=2.0):
    """The state after folding base-2 tiles from the empty state, with one step changed."""
    ln_base = math.log(base)

    def update(m, l, acc, st, vt):
        return _base_update(m, l, acc, st, vt, ln_base, rescale_l, rescale_acc, guard)
    return _fold(update, list(zip(s, v)), s.shape[1], v.shape[2])


def _base_update(m, l, acc, s, v, ln_base, rescale_l, rescale_acc, guard):
    m_new = np.maximum(m, s.max(axis=1))
    ref = np.where(m_new == -np.inf, 0, m_new) if guard else m_new
    alpha = np.exp((m - ref) * ln_base)
    p = np.exp((s - ref[:, None]) * ln_base)
    l = (l * alpha if rescale_l else l) + p.sum(axis=1)
    acc = (acc * alpha[:, None] if rescale_acc else acc) + p @ v
    return m_new, l, acc


def _tile_mistake(**kwargs):
    return _computes(lambda s, v: _tile_variant(s, v, **kwargs))


_TILE_MISTAKES = (
    Mistake(_tile_mistake(rescale_acc=False, rescale_l=False),
            "neither l nor acc is rescaled when a row's max rises: multiply both by "
            "alpha = exp2(m - m_new)"),
    Mistake(_tile_mistake(rescale_acc=False),
            "acc is not rescaled when a row's max rises (l is): multiply it by alpha = "
            "exp2(m - m_new) before adding the tile's p·v"),
    Mistake(_tile_mistake(rescale_l=False),
            "l is not rescaled when a row's max rises (acc is): multiply it by alpha = "
            "exp2(m - m_new) before adding the tile's row sums of p"),
    Mistake(_tile_mistake(base=math.e),
            "exp where the scores are in base 2: s already carries the factor log2(e), so p = "
            "exp2(s - m) (tl.math.exp2), and alpha likewise"),
    Mistake(_tile_mistake(guard=False),
            "NaN in a row whose scores so far are all -inf: m_new = -inf there and s - m_new is "
            "NaN; subtract 0 where m_new = -inf (tl.where)"),
)


def _tile_case(s, v):
    def run(fn):
        mod = _triton()
        want = _tile_variant(s, v)
        got = mod.run_tiles(fn, s, v)
        _compare("attend_tile", dict(s=s, v=v), got, want, ("m", "l", "acc"), _TILE_MISTAKES)
    return run


def _tile_cases():
    rng = np.random.default_rng(16)
    size = 16  # tl.dot wants every side >= 16

    def tiles(n, shift=0.0):
        s = (rng.standard_normal((n, size, size)) * 2 +
             shift * np.arange(n)[:, None, None]).astype(np.float32)
        return s, rng.standard_normal((n, size, size)).astype(np.float32)

    one = tiles(1)
    growing = tiles(3, shift=5.0)
    masked = tiles(2, shift=3.0)
    masked[0][0, 1] = -np.inf  # row 1: nothing allowed in the first tile
    masked[0][:, 2] = -np.inf  # row 2: nothing allowed at all
    return {
        "one_tile": ("one 16 × 16 tile of base-2 scores from the empty state", _tile_case(*one)),
        "growing_max": ("three tiles whose scores grow by about 5 each: every max rises",
                        _tile_case(*growing)),
        "masked_rows": ("row 1 all -inf in the first tile; row 2 all -inf throughout (it must "
                        "stay m = -inf, l = 0, acc = 0)", _tile_case(*masked)),
    }


# --------------------------------------------------------------------------------------------
# keep_mask: dropout's keep mask from a counter (chapter 17)
# --------------------------------------------------------------------------------------------


def _keep_variant(seed, p, shape, offset=(0, 0), *, rounds=7, swap_halves=False,
                  swap_counter=False, ignore_offset=(False, False), one_batch=False,
                  keep_below=False,
                  word=lambda j: j % 8 // 2):
    *batch, rows, keys = shape
    n = math.prod(batch)
    b = np.arange(n, dtype=np.uint64).reshape(*batch, 1, 1) * (0 if one_batch else 1)
    off = tuple(0 if ignore else o for ignore, o in zip(ignore_offset, offset))
    i = np.arange(off[0], off[0] + rows, dtype=np.uint64)[:, None]
    j = np.arange(off[1], off[1] + keys, dtype=np.uint64)[None, :]
    b, i, j = np.broadcast_arrays(b.astype(np.uint64), i, j)
    c0, c1 = (i, j // 8) if swap_counter else (j // 8, i)
    words = _solutions.philox4x32(c0, c1, b & np.uint64(0xFFFFFFFF), b >> np.uint64(32),
                                  seed & 0xFFFFFFFF, seed >> 32, rounds=rounds)
    w = np.choose(word(j).astype(np.intp), words)
    even = (j % 2 == 0) != swap_halves
    number = np.where(even, w & np.uint64(0xFFFF), w >> np.uint64(16))
    t = round(p * 2**16)
    return number < t if keep_below else number >= t


def _keep_mistake(**kwargs):
    return _computes(lambda seed, p, shape, offset: _keep_variant(seed, p, shape, offset,
                                                                  **kwargs).astype(np.float64))


_KEEP_MISTAKES = (
    Mistake(_keep_mistake(keep_below=True),
            "the mask keeps with probability p, not 1 - p: an element is kept iff its 16-bit "
            "number is >= t = round(p · 2¹⁶)"),
    Mistake(_keep_mistake(swap_halves=True),
            "the two halves of each word are swapped: even j takes the low 16 bits, odd j the "
            "high 16 bits"),
    Mistake(_keep_mistake(swap_counter=True),
            "the counter's first two words are swapped: it is "
            "(j // 8, i, b mod 2³², b // 2³²)"),
    *(Mistake(_keep_mistake(ignore_offset=ignored),
              f"the offset is ignored ({which}): i and j are global positions, offset + the local "
              f"index (a shard starting at row 5 gets rows 5, 6, ... of the whole mask)")
      for ignored, which in (((True, True), "both"), ((True, False), "offset[0], the rows'"),
                             ((False, True), "offset[1], the keys'"))),
    Mistake(_keep_mistake(one_batch=True),
            "every batch entry and head got the same mask: b, the flat index over the leading "
            "axes, goes into the counter's last two words"),
    Mistake(_keep_mistake(rounds=10),
            "10 Philox rounds: flash_lib (as FlashAttention-2) runs 7"),
    Mistake(_keep_mistake(word=lambda j: j % 4),
            "the wrong word of the counter's output: element j takes word (j mod 8) // 2, two "
            "elements a word"),
)


def _keep_case(seed, p, shape, offset):
    def run(fn):
        want = flash_lib.dropout_keep(seed, p, shape, offset=offset)
        result = fn(seed, p, shape, offset)
        got = np.asarray(result)
        if got.shape != tuple(shape):
            raise _Wrong(f"the mask has shape {got.shape}, expected {tuple(shape)}")
        if got.dtype != bool:
            raise _Wrong(f"the mask has dtype {got.dtype}, expected bool (True = kept)")
        inputs = dict(seed=seed, p=p, shape=shape, offset=offset)
        if not np.array_equal(got, want):
            ev = _Evidence("keep_mask", inputs, (got.astype(np.float64),),
                           (want.astype(np.float64),), ("mask",))
            first = tuple(int(x) for x in np.argwhere(got != want)[0])
            raise _Wrong(explain(_KEEP_MISTAKES + (
                Mistake(always, f"{int((got != want).sum())} of {got.size} elements differ from "
                                f"flash_lib.dropout_keep, the first at {first}"),), ev))
    return run


def _keep_cases():
    return {
        "one_counter": ("one row of 8 keys (one counter), p = 0.5",
                        _keep_case(7, 0.5, (1, 8), (0, 0))),
        "rows_and_keys": ("(13, 37), p = 0.3: several counters per row, odd and even j",
                          _keep_case(2026, 0.3, (13, 37), (0, 0))),
        "offset": ("(9, 21) at offset (5, 11), p = 0.1: a shard of a larger mask",
                   _keep_case(1234, 0.1, (9, 21), (5, 11))),
        "batch_and_heads": ("(2, 3, 6, 10), p = 0.2: six heads, each its own b",
                            _keep_case(99, 0.2, (2, 3, 6, 10), (0, 0))),
        "large_seed": ("seed 2⁴⁰ + 5, p = 0.25: the key is (seed mod 2³², seed // 2³²)",
                       _keep_case(2**40 + 5, 0.25, (4, 16), (0, 0))),
    }


# --------------------------------------------------------------------------------------------
# attention_with_sinks (chapter 18)
# --------------------------------------------------------------------------------------------


def _sinks_variant(q, k, v, sinks, *, causal=False, scaled=False, lse_without=False,
                   empty_guard=False, sign=1.0, first_head=False, numerator=False,
                   top_left=False):
    n_q, n_k = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1])
    s = scale * (q @ np.swapaxes(k, -1, -2))
    if causal:
        allowed = np.tril(np.ones((n_q, n_k), bool)) if top_left else \
            flash_lib.causal_mask(n_q, n_k)
        s = np.where(allowed, s, -np.inf)
    sink = sign * np.asarray(sinks, np.float64)
    if first_head:
        sink = np.full_like(sink, sink[0])
    sink = (sink * scale if scaled else sink)[:, None]
    m = np.maximum(s.max(axis=-1, initial=-np.inf), sink)
    p = np.exp(s - m[..., None])
    l = p.sum(axis=-1) + np.exp(sink - m)
    out = p @ v
    if numerator:  # the sink as a key whose value is v's first key
        out = out + np.exp(sink - m)[..., None] * v[:, :1, :]
    out = out / l[..., None]
    lse = m + np.log(l)
    if lse_without:
        lse = np.log(np.exp(s - m[..., None]).sum(axis=-1)) + m
    if empty_guard:
        empty = ~np.isfinite(s).any(axis=-1)
        lse = np.where(empty, -np.inf, lse)
    return out, lse


def _sinks_mistake(**kwargs):
    def mistake(q, k, v, sinks, causal):
        return _sinks_variant(q, k, v, sinks, causal=causal, **kwargs)
    return _computes(mistake)


_SINKS_MISTAKES = (
    Mistake(_sinks_mistake(top_left=True),
            "causal is aligned top-left (key j allowed iff j <= i): with Nq != Nk it must be "
            "bottom-right, j <= i + (Nk - Nq)"),
    Mistake(_sinks_mistake(scaled=True),
            "the sink is multiplied by the softmax scale: it is a logit added as is, unscaled"),
    Mistake(_sinks_mistake(sign=-1.0),
            "the sink's sign is flipped: the denominator gains exp(+sink)"),
    Mistake(_sinks_mistake(first_head=True),
            "every head uses sinks[0]: head h has its own logit sinks[h]"),
    Mistake(_sinks_mistake(lse_without=True),
            "out is right but lse leaves the sink out: lse = log(exp(sink) + Σ_j exp(s_j))"),
    Mistake(_sinks_mistake(empty_guard=True),
            "a row with no allowed key has lse -inf: with a sink no row is empty (out 0, lse = "
            "the sink); the empty-row guard overrides the sink"),
    Mistake(_sinks_mistake(numerator=True),
            "the sink adds a value to out: it is in the denominator only (a key whose value is "
            "0)"),
)


def _sinks_case(heads, n_q, n_k, d, causal, seed, sinks=None):
    def run(fn):
        rng = np.random.default_rng(seed)
        q, k, v = (rng.standard_normal((heads, n, d)) for n in (n_q, n_k, n_k))
        s = rng.standard_normal(heads) + 1.0 if sinks is None else np.asarray(sinks, float)
        inputs = dict(q=q, k=k, v=v, sinks=s, causal=causal)
        want = flash_lib.flash_attention(q, k, v, sinks=s, causal=causal, return_lse=True)
        fresh = _fresh(inputs)
        got = _unpack(fn(fresh.pop("q"), fresh.pop("k"), fresh.pop("v"), fresh.pop("sinks"),
                         **fresh), ("out", "lse"), ((heads, n_q, d), (heads, n_q)))
        _compare("attention_with_sinks", inputs, got, want, ("out", "lse"), _SINKS_MISTAKES)
    return run


def _sinks_cases():
    return {
        "one_key": ("one head, one query, one key, sink 0: half the weight goes to the sink",
                    _sinks_case(1, 1, 1, 4, False, 21, sinks=[0.0])),
        "heads": ("three heads, each its own sink, 12 queries, 20 keys",
                  _sinks_case(3, 12, 20, 8, False, 22, sinks=[-1.0, 0.5, 3.0])),
        "causal": ("causal, Nq = 10 < Nk = 25, two heads", _sinks_case(2, 10, 25, 8, True, 23)),
        "empty_rows": ("causal, Nq = 30 > Nk = 12: rows 0-17 have no key (out 0, lse = the sink)",
                       _sinks_case(2, 30, 12, 8, True, 24, sinks=[0.7, -0.2])),
    }


# --------------------------------------------------------------------------------------------
# paged_decode (chapter 21)
# --------------------------------------------------------------------------------------------


def _paged_variant(q, k_cache, v_cache, block_table, cache_seqlens, *, page_shift=0,
                   whole_pages=False, empty_nan=False, scale=None, contiguous=False,
                   extra_keys=0):
    n_batch, n_heads, d = q.shape
    page_size = k_cache.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = np.zeros((n_batch, n_heads, v_cache.shape[-1]))
    for b in range(n_batch):
        n = int(cache_seqlens[b])
        if n == 0:
            out[b] = np.nan if empty_nan else 0
            continue
        n += extra_keys
        n_pages = -(-n // page_size)
        if contiguous:
            pages = b * block_table.shape[1] + np.arange(n_pages)
        else:
            pages = block_table[b, page_shift:page_shift + n_pages]
        pages = np.clip(pages, 0, k_cache.shape[0] - 1)
        keys = k_cache[pages].transpose(1, 0, 2, 3).reshape(n_heads, -1, d)
        values = v_cache[pages].transpose(1, 0, 2, 3).reshape(n_heads, -1, v_cache.shape[-1])
        if not whole_pages:
            keys, values = keys[:, :n], values[:, :n]
        s = np.einsum("hd,hnd->hn", q[b], keys) * scale
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[b] = np.einsum("hn,hnd->hd", p, values) / p.sum(axis=1, keepdims=True)
    return out


def _paged_mistake(**kwargs):
    return _computes(lambda **inputs: _paged_variant(**inputs, **kwargs))


_PAGED_MISTAKES = (
    Mistake(_paged_mistake(whole_pages=True),
            "the slots past cache_seqlens[b] in the last page are read (they hold garbage here, "
            "NaN): only positions < cache_seqlens[b] are keys"),
    Mistake(_paged_mistake(page_shift=1),
            "a page index off by one: logical page t of sequence b is block_table[b, t], t = "
            "position // page_size, from t = 0"),
    Mistake(_paged_mistake(contiguous=True),
            "the pages are read as if contiguous (b·max_pages + t): look each one up in "
            "block_table[b, t]"),
    *(Mistake(_paged_mistake(extra_keys=extra),
              f"one key too {which}: sequence b's keys are its positions 0 to "
              f"cache_seqlens[b] - 1, all of them")
      for extra, which in ((1, "many"), (-1, "few"))),
    Mistake(_paged_mistake(empty_nan=True),
            "a sequence of length 0 gives NaN: it has no key, and its output is the empty sum, "
            "zeros"),
    Mistake(_paged_mistake(scale=1.0),
            "the scores are not scaled: s = q·k / sqrt(d)"),
)


def _paged_case(lengths, page_size, n_heads, d, n_pages, seed):
    def run(fn):
        rng = np.random.default_rng(seed)
        lengths_ = np.asarray(lengths)
        max_pages = max(1, max(-(-n // page_size) for n in lengths))
        # free pages hold a finished sequence's stale keys; free slots of used pages, NaN
        k_cache, v_cache = rng.standard_normal((2, n_pages, n_heads, page_size, d))
        order = rng.permutation(n_pages)
        block_table = np.full((len(lengths), max_pages + 1), n_pages - 1)  # unused: any page
        used = 0
        for b, n in enumerate(lengths):
            for t in range(-(-n // page_size)):
                page = order[used]
                used += 1
                block_table[b, t] = page
                filled = min(page_size, n - t * page_size)
                k_cache[page, :, filled:] = v_cache[page, :, filled:] = np.nan
                k_cache[page, :, :filled] = rng.standard_normal((n_heads, filled, d))
                v_cache[page, :, :filled] = rng.standard_normal((n_heads, filled, d))
        q = rng.standard_normal((len(lengths), n_heads, d))
        inputs = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                      cache_seqlens=lengths_)
        want = flash_serving.flash_attention_with_kvcache(
            q[:, :, None], k_cache, v_cache, cache_seqlens=lengths_, block_table=block_table,
            causal=True)[:, :, 0]
        fresh = _fresh(inputs)
        got = _unpack(fn(*fresh.values()), ("out",), ((len(lengths), n_heads, d),))
        _compare("paged_decode", inputs, got, (want,), ("out",), _PAGED_MISTAKES)
    return run


def _paged_cases():
    return {
        "one_page": ("one sequence of 4 keys in one page of 4 slots, one head",
                     _paged_case([4], 4, 1, 8, 3, 31)),
        "pages_in_any_order": ("two sequences of 8 and 12 keys in pages of 4, scattered over "
                               "the pool", _paged_case([8, 12], 4, 2, 8, 9, 32)),
        "partial_last_page": ("lengths 7 and 13 in pages of 4: the last page's free slots hold "
                              "NaN", _paged_case([7, 13], 4, 2, 8, 12, 33)),
        "empty_sequence": ("lengths 5, 0 and 9: a sequence with no key gives zeros",
                           _paged_case([5, 0, 9], 4, 2, 8, 12, 34)),
    }


# --------------------------------------------------------------------------------------------
# The exercises, and grading
# --------------------------------------------------------------------------------------------

#: name -> :class:`Exercise`, in the order of the chapters.
EXERCISES = {e.name: e for e in (
    Exercise("merge", 3, "Merge two partial results by their log-sum-exps",
             "merge(out_a, lse_a, out_b, lse_b) -> (out, lse)"),
    Exercise("online_update", 5, "Fold one tile into the running state (m, l, acc)",
             "online_update(m, l, acc, s, v) -> (m, l, acc)"),
    Exercise("forward", 6, "The tiled forward: causal, empty rows, O(block) memory",
             "forward(q, k, v, *, causal=False, block_q=64, block_k=64) -> (out, lse)"),
    Exercise("backward", 13, "The tiled backward, P recomputed from lse",
             "backward(q, k, v, out, lse, dout, *, causal=False, block_q=64, block_k=64) "
             "-> (dq, dk, dv)"),
    Exercise("attend_tile", 16, "The Triton forward's inner loop, in base 2",
             "@triton.jit attend_tile(m, l, acc, s, v) -> (m, l, acc)"),
    Exercise("keep_mask", 17, "Dropout's keep mask from a Philox counter",
             "keep_mask(seed, p, shape, offset=(0, 0)) -> bool array"),
    Exercise("attention_with_sinks", 18, "Attention with one sink logit per head",
             "attention_with_sinks(q, k, v, sinks, *, causal=False) -> (out, lse)"),
    Exercise("paged_decode", 21, "Decoding against a paged KV cache",
             "paged_decode(q, k_cache, v_cache, block_table, cache_seqlens) -> out"),
)}

_CASES = {"merge": _merge_cases, "online_update": _update_cases, "forward": _forward_cases,
          "backward": _backward_cases, "attend_tile": _tile_cases, "keep_mask": _keep_cases,
          "attention_with_sinks": _sinks_cases, "paged_decode": _paged_cases}


def _exercise(name):
    if name not in EXERCISES:
        raise ValueError(f"name must be one of {list(EXERCISES)}, got {name!r}")
    return EXERCISES[name]


def _raised_briefly(exc, fn):
    """``TypeError: message (line N of your_function)``: the exception and the deepest line of
    the learner's code it passed through, if any."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= 160 else text[:157] + "..."
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "fn", None), "__code__", None)
    where = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if code is not None and frame.filename == code.co_filename and frame.filename != __file__:
            where = f" (in {frame.name}, line {frame.lineno}: {(frame.line or '').strip()})"
    return f"{type(exc).__name__}: {text}{where}"


def grade(name, fn):
    """Grade ``fn`` as the answer to exercise ``name``; returns a :class:`Grade`.

    Runs the exercise's cases smallest first and stops at the first failure, whose hint says
    what is wrong and where to look. A stub (a function raising NotImplementedError) gives
    "not implemented yet"; an exception in ``fn`` is reported in one line with the case that
    raised it. Floating-point warnings inside ``fn`` are not shown: its NaN are graded instead.
    """
    exercise = _exercise(name)
    if not callable(fn):
        raise TypeError(f"fn must be a function (your {exercise.signature}), got "
                        f"{type(fn).__name__}")
    if getattr(fn, "_exercise_stub", False):
        return Grade(name, False, NOT_IMPLEMENTED, (CaseResult("stub", False, NOT_IMPLEMENTED),))
    done = []
    for case, (about, run) in _CASES[name]().items():
        try:
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                run(fn)
        except NotImplementedError:
            return Grade(name, False, NOT_IMPLEMENTED,
                         tuple(done) + (CaseResult(case, False, "not implemented yet"),))
        except _Wrong as wrong:
            hint = f"case {case!r} ({about}): {wrong}"
            return Grade(name, False, hint, tuple(done) + (CaseResult(case, False, str(wrong)),))
        except ImportError as exc:  # Triton missing: the exercise cannot run here
            message = f"cannot be graded here: {exc}"
            return Grade(name, False, message, tuple(done) + (CaseResult(case, False, message),))
        except Exception as exc:  # the learner's code raised: one line, with the case
            message = f"your code raised {_raised_briefly(exc, fn)}"
            hint = f"case {case!r} ({about}): {message}"
            return Grade(name, False, hint, tuple(done) + (CaseResult(case, False, message),))
        done.append(CaseResult(case, True))
    return Grade(name, True, "", tuple(done))


def _signature(name):
    return _exercise(name).signature.split(" -> ")[0].removeprefix("@triton.jit ")


def stub(name):
    """A function with exercise ``name``'s signature that raises NotImplementedError."""
    exercise = _exercise(name)

    def not_yet(*args, **kwargs):
        raise NotImplementedError(f"{name}: {NOT_IMPLEMENTED}")
    not_yet.__name__ = not_yet.__qualname__ = name
    not_yet._exercise_stub = True
    not_yet.__doc__ = f"Your turn (chapter {exercise.chapter}): {exercise.signature}"
    return not_yet


def solution(name):
    """The solution of exercise ``name`` (the tests grade it; a learner need not look)."""
    _exercise(name)
    if name == "attend_tile":
        return _triton().attend_tile
    return getattr(_solutions, name)


def show_solution(name):
    """Print the solution's source (the chapters' hidden "show solution" cells call this)."""
    fn = solution(name)
    print(inspect.getsource(getattr(fn, "fn", fn)).rstrip())


def main(argv=None):
    """``python -m flash_check.exercises [--from MODULE]``: every exercise with its status."""
    parser = argparse.ArgumentParser(prog="python -m flash_check.exercises",
                                     description="Grade your answers to the tutorial's exercises.")
    parser.add_argument("--from", dest="module", default="my_solutions",
                        help="the module holding your functions, named as the exercises "
                             "(default: my_solutions, from the current directory)")
    args = parser.parse_args(argv)
    sys.path.insert(0, "")
    try:
        module = importlib.import_module(args.module)
    except ModuleNotFoundError as exc:
        if exc.name != args.module:
            raise
        module = None
        print(f"no module {args.module!r} here: write your answers in {args.module}.py "
              f"(functions named as below), or pass --from MODULE\n")
    passed = 0
    for name, exercise in EXERCISES.items():
        fn = getattr(module, name, None) or stub(name)
        result = grade(name, fn)
        passed += result.passed
        status = ("passed" if result.passed else "not implemented yet"
                  if result.hint == NOT_IMPLEMENTED else "not yet: " + result.hint)
        print(f"ch {exercise.chapter:>2}  {name:<21} {status}")
    print(f"\n{passed} of {len(EXERCISES)} exercises passed")
    return 0 if passed == len(EXERCISES) else 1


if __name__ == "__main__":
    sys.exit(main())

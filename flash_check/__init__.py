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
Chapter 20 of the tutorial measures flash_lib, PyTorch and JAX against this rule and justifies
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
``"gqa"`` (``enable_gqa=True``), ``"mask_mod"``, and the training features ``"sinks"`` and
``"dropout"`` (``dropout_p=``, ``dropout_seed=``) (:data:`VARIANTS`), with FlashAttention's
conventions as flash_lib documents them, each have cases of their own, skipped unless the feature
is listed. Given the kernel's ``backward=``, the sinks and dropout cases check its gradients too
(``dsinks``; the backward's keep mask against the forward's). Their failures are diagnosed by
comparing the output with the classic mistakes (:mod:`flash_check.diagnose`): a window off by one
at an edge, aligned top-left or with its sides swapped; softcap applied after the mask, after the
bias or before the scale; ALiBi's sign flipped, its distance aligned top-left, or attention-gym's
causal-only form used without causal (and, under causal, an lse shifted by that form's per-row
constant); GQA grouped as ``h mod Hkv``; a mask_mod inverted, called with its arguments swapped, on
tile-local positions, with its batch dims dropped, or whose tiles are skipped by their corners; a
sink counted twice (split-KV), scaled, softcapped or with its sign flipped, an empty row's lse that
is not the sink, dsinks' sign; a dropout mask drawn per tile from a stateful generator (it changes
with the block sizes), rows whose streams overlap, the keep probability p for 1 - p, a missing
1/(1 - p), a backward that regenerates another mask; and each variant ignored. A kernel's dropout mask
is read off its output (``q = 0`` makes ``P`` uniform, ``v`` = the identity makes ``out[i, j] =
P_ij·Z_ij/(1 - p)``), so the checks hold any generator to what dropout must be, not to flash_lib's
Philox.

The package
-----------
This module holds the API: the constants, the types, the registry and the runner
(:func:`check_kernel`). Beside it: ``cases.py`` (the built-in cases, registered on import),
``diagnose.py`` (the known mistakes, a table of condition and message per check), ``training.py``
(the sinks and dropout cases, and the gradient checks), ``adapters.py``
(PyTorch and JAX as kernels), ``bugs.py`` (small tiled kernels with one classic bug each, for the
tests and chapter 20) and ``__main__.py`` (the command line).
"""

from __future__ import annotations

import dataclasses
import functools
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
    # The training features (flash_check/training.py)
    "sinks": "takes sinks= of shape (H,) or (B, H), one logit per head, unscaled and uncapped: "
             "lse_i = log(exp(sink) + sum_j exp(s_ij)); a row with no allowed key gives out 0, "
             "lse = sink",
    "dropout": "takes dropout_p=, dropout_seed=: out = (P∘Z/(1 - p))·V, Z Bernoulli(1 - p) per "
               "(b, i, j) from the seed (a function of the element alone), the lse undropped",
}
#: The variants' features, each with its cases below (the training features' in training.py).
VARIANTS = ("window", "softcap", "alibi", "gqa", "mask_mod", "sinks", "dropout")
DEFAULT_FEATURES = ("mask", "causal", "lse")
#: The dtypes a kernel can be checked in, in the order they are checked.
DTYPES = ("float64", "float32", "float16")

#: The bound: ``error <= FACTOR * naive's error + floor``. 2 is FlashAttention's factor. Chapter 20
#: measures the largest ratio of a correct kernel's error to naive's (flash_lib at three tile
#: shapes, PyTorch SDPA math and flash, JAX), over the cases where naive's error exceeds 4 eps:
#: 1.2-1.4 with NumPy's AVX-512, AVX2 and baseline loops and OpenBLAS's SkylakeX and Haswell
#: kernels; 2.0 (float64) and 2.3 (float32) with OpenBLAS's Sandybridge kernel, where the floor
#: carries the rest.
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
#: The memory case: the growth exponent of scratch allowed between its two sizes (linear, a row
#: state or an lse, passes; the N x N scores fail).
MEMORY_EXPONENT = 1.5


# --------------------------------------------------------------------------------------------
# Cases: their type and registry (the built-in ones are in cases.py)
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
    backward: Callable | None = None  # the kernel's backward, if given

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
        arrays = dict(out=result[0], lse=result[1])
    elif isinstance(result, (tuple, list)):
        return None, None, (f"returned a {type(result).__name__} of {len(result)}, expected out "
                            f"alone ('lse' is not among the features)")
    else:
        arrays = dict(out=result)
    for name, x in arrays.items():
        try:  # a torch tensor that requires grad, a foreign object: a finding, not a crash
            arrays[name] = x = np.asarray(x)
        except Exception as exc:
            return None, None, (f"{name} is a {type(x).__name__} that NumPy cannot read "
                                f"({type(exc).__name__}: {' '.join(str(exc).split())[:100]}); "
                                f"return a NumPy array (a torch tensor: .detach().numpy())")
        if not _real_float(x.dtype):
            return None, None, (f"{name} has dtype {x.dtype}, expected a real floating-point "
                                f"dtype (float16, bfloat16, float32, float64 or wider)")
    return arrays["out"], arrays.get("lse"), None


def _real_float(dtype):
    """float16 to longdouble, or ml_dtypes' bfloat16 (whose kind NumPy reports as 'V')."""
    return dtype.kind == "f" or dtype.name == "bfloat16"


def _crashed(ctx, exc, during):
    """A Result holding one Failure for an exception raised while checking the kernel."""
    result = Result(ctx.case.name, ctx.dtype)
    message = " ".join(str(exc).split())
    ctx.fail(result, "crashed", f"{type(exc).__name__}: {message[:160]}", "a result to check",
             f"{during} raised: the kernel returned or did something the checks cannot read "
             f"(an array of objects, a tensor that requires grad, an exception inside the "
             f"case's own run)")
    return result


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
    if problem is not None and problem.startswith(("out has dtype", "lse has dtype")):
        ctx.fail(result, "dtype", problem, "a real float dtype", problem)
        return result
    if problem is None and out.shape != ref.out.shape:
        problem = f"out has shape {out.shape}, expected {ref.out.shape}"
    if problem is None and want_lse and lse.shape != ref.lse.shape:
        problem = f"lse has shape {lse.shape}, expected {ref.lse.shape} (out.shape[:-1])"
    if problem is not None:
        ctx.fail(result, "shape", problem, "as documented", problem)
        return result

    why = diagnose.Evidence(ctx, ref, out, lse)
    _check_empty_rows(ctx, result, ref, out, lse, why)
    _check_nan_rows(ctx, result, ref, out, lse)

    rows = ref.rows
    bad = rows & ~np.isfinite(out).all(axis=-1)
    if bad.any():
        ctx.fail(result, "non-finite", f"{_nonfinite_kind(out[bad])} in {int(bad.sum())} of "
                 f"{int(rows.sum())} rows", "finite wherever the exact output is",
                 why.explain(diagnose.NON_FINITE, bad=bad, of_lse=False))
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
                     "finite wherever the exact lse is",
                     why.explain(diagnose.NON_FINITE, bad=bad, of_lse=True))
        if err > bound:
            ctx.fail(result, "lse error", f"{err:.2g}", f"{FACTOR:g} x naive's {naive:.2g} + "
                     f"{LSE_FLOOR[ctx.dtype]:.2g} = {bound:.2g}",
                     why.explain(diagnose.LSE_ERROR, rows=measured, err=err))
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
        ctx.fail(result, "empty rows", what, "out exactly 0",
                 why.explain(diagnose.EMPTY_ROWS, rows=rows, nan=nan))
    if lse is not None:
        got = lse[empty].astype(np.float64)
        same = (got == ctx.lse_empty) | (np.isnan(got) & np.isnan(ctx.lse_empty))
        if not same.all():
            values = ", ".join(f"{x:.6g}" for x in np.unique(got[~same])[:3])
            ctx.fail(result, "empty lse", f"lse {values} in {int((~same).sum())} of {n} rows",
                     f"lse_empty = {ctx.lse_empty}",
                     why.explain(diagnose.EMPTY_LSE, got=got[~same], values=values,
                                 lse_empty=ctx.lse_empty))


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


# --------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------


def _known_features():
    return dict.fromkeys([*FEATURES, *(f for c in CASES.values() for f in c.needs)])


def _kernel_name(fn):
    module = getattr(fn, "__module__", None)
    if module == "flash_check.adapters":  # named as flash_check exports them: flash_check.torch_sdpa
        module = "flash_check"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if isinstance(fn, functools.partial):
        inner = _kernel_name(fn.func)
        args = ", ".join(f"{key}={val!r}" for key, val in fn.keywords.items())
        return f"partial({inner}, {args})"
    return f"{module}.{name}" if module and name else repr(fn)


def check_kernel(fn, *, features=DEFAULT_FEATURES, dtypes=DTYPES, lse_empty=-np.inf, seed=0,
                 cases=None, backward=None):
    """Run the attention kernel ``fn`` through every registered case; return a :class:`Report`.

    Parameters
    ----------
    fn : callable
        ``fn(q, k, v, *, mask=None, causal=False, scale=None)`` returning ``out`` (or
        ``(out, lse)`` with the ``"lse"`` feature); only the keywords a case uses are passed,
        among them, with their features, ``window``, ``softcap``, ``alibi_slopes``,
        ``enable_gqa``, ``mask_mod``, ``sinks``, ``dropout_p`` and ``dropout_seed`` (flash_lib's
        keywords; the dropout case also passes ``block_q`` and ``block_k`` to a kernel whose
        signature has them, to check that the mask does not depend on the tiles).
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
    backward : callable, optional
        The kernel's backward, ``backward(q, k, v, out, lse, dout, **keywords)`` returning
        ``(dq, dk, dv)``, and ``(dq, dk, dv, dsinks)`` with ``sinks=``
        (``flash_lib.flash_attention_backward``'s signature; ``out`` and ``lse`` are what the
        kernel returned, so it needs the ``"lse"`` feature). Given, the ``sinks`` and
        ``sinks_empty_rows`` cases check the gradients and ``dsinks``, and the ``dropout`` case
        the backward's keep mask and the gradients under the forward's seed.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if backward is not None and not callable(backward):
        raise TypeError(f"backward must be callable or None, got {type(backward).__name__}")
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
            ctx = _Context(fn, case, dtype, features, lse_empty, int(seed), done, backward)
            try:
                with np.errstate(all="ignore"):  # the diagnoses handle non-finite output
                    result = (case.run or _accuracy)(ctx)
            except Exception as exc:  # every kernel call and check: a Failure, never a crash
                result = _crashed(ctx, exc, f"case {case.name!r} ({dtype})")
            done[case.name, dtype] = result
            results.append(result)
    return Report(_kernel_name(fn), features, dtypes, lse_empty, results, skipped)


def main(argv=None):
    """``python -m flash_check package.module:function [--features ...] [--dtypes ...]``: see
    ``flash_check/__main__.py``; returns the exit status."""
    from flash_check.__main__ import main as cli  # imported when called: -m runs that file itself

    return cli(argv)


# The parts that use the names above, imported last: the known mistakes, the built-in cases (which
# register themselves, in the order the report lists them) and the adapters.
from flash_check import diagnose  # noqa: E402
from flash_check import cases  # noqa: E402, F401
from flash_check.adapters import (  # noqa: E402
    jax_dot_product_attention,
    torch_flash_for_cpu_with_lse,
    torch_sdpa,
)

"""What every part of flash_check shares, at the bottom of the package: it imports no other part.

The bound's constants, the features a kernel declares, the cases' type and registry, the results
and the report, the references a case is measured against, and the plumbing of one check (its
context, calling the kernel, reading what it returned). Every other module builds on these:
``diagnose.py`` (the known mistakes), ``_runner.py`` (the accuracy check and
:func:`check_kernel`), the cases (``cases.py``, ``training.py``, ``serving.py``), the command
line (``_cli.py``); ``__init__.py`` re-exports the public names.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import zlib
from collections.abc import Callable

import numpy as np

import flash_lib

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
#: The keywords every case needing a feature passes the kernel (with ``True`` or a value). A
#: kernel whose signature requires a keyword (a parameter beyond q, k, v without a default, such
#: as a packed batch's ``cu_seqlens_q``) can take only the cases that pass it; the runner skips
#: the others and says why. ``serving.py`` adds its features'.
FEATURE_KEYWORDS = {"mask": ("mask",), "causal": ("causal",), "window": ("window",),
                    "softcap": ("softcap",), "alibi": ("alibi_slopes",), "gqa": ("enable_gqa",),
                    "mask_mod": ("mask_mod",), "sinks": ("sinks",),
                    "dropout": ("dropout_p", "dropout_seed")}
#: The variants' features, each with its cases below (the training features' in training.py).
VARIANTS = ("window", "softcap", "alibi", "gqa", "mask_mod", "sinks", "dropout")
DEFAULT_FEATURES = ("mask", "causal", "lse")
#: The dtypes a kernel can be checked in, in the order they are checked.
DTYPES = ("float64", "float32", "float16")

#: The bound: ``error <= FACTOR * naive's error + floor``. 2 is FlashAttention's factor. Chapter 23
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
    ``(..., Nq)``) marks rows whose out and lse must come out NaN (NaN in q, or in k at a key the
    row attends); ``garbage_rows`` rows that attend an inf or NaN in v: their out must not be
    finite (the garbage reaches exactly the rows allowed to attend it) and is not measured, their
    lse is (it does not read v). ``clean`` holds ``(q, k, v)`` for the references when the
    kernel's inputs carry garbage the references need not see (the entries where the two differ
    are the garbage, which the diagnoses and the gradient check locate).
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    kwargs: dict = dataclasses.field(default_factory=dict)
    nan_rows: np.ndarray | None = None
    clean: tuple | None = None
    garbage_rows: np.ndarray | None = None


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


def _known_features():
    """Every feature name: the built-in ones and any a registered case needs."""
    return dict.fromkeys([*FEATURES, *(f for c in CASES.values() for f in c.needs)])


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
    rows: np.ndarray  # rows whose out is measured: allowed keys, finite by design
    empty: np.ndarray  # rows with no allowed key
    lse_rows: np.ndarray  # rows whose lse is measured: rows, and the garbage rows (v unread)


@functools.lru_cache(maxsize=512)
def _reference(case, dtype, seed):
    rng = np.random.default_rng([seed, zlib.crc32(case.name.encode())])
    inputs = case.make(rng, np.dtype(dtype))
    q, k, v = inputs.clean if inputs.clean is not None else (inputs.q, inputs.k, inputs.v)
    with np.errstate(invalid="ignore"):  # the NaN row of nan_in_q
        out, lse = flash_lib.precise_attention(q, k, v, **inputs.kwargs, return_lse=True)
        naive_out, naive_lse = flash_lib.naive_attention(q, k, v, **inputs.kwargs,
                                                         return_lse=True)
    none = np.zeros(lse.shape, bool)
    nan_rows = none if inputs.nan_rows is None else inputs.nan_rows
    garbage_rows = none if inputs.garbage_rows is None else inputs.garbage_rows
    empty = (lse == -np.inf) & ~nan_rows
    lse_rows = ~empty & ~nan_rows
    rows = lse_rows & ~garbage_rows
    if not (np.isfinite(out[rows]).all() and np.isfinite(naive_out[rows]).all()):
        raise RuntimeError(f"case {case.name!r} ({dtype}): the references are not finite")
    for x in (inputs.q, inputs.k, inputs.v, out, lse, naive_out, naive_lse, rows, empty,
              lse_rows):
        x.flags.writeable = False
    return _Reference(inputs, out, lse, naive_out, naive_lse, rows, empty, lse_rows)


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
# One check: what it sees, calling the kernel, reading what it returned
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
    #: the dropout generator the kernel claims, (seed, p, shape) -> keep mask, or None
    dropout_generator: Callable | None = None

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

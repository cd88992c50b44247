"""The runner: :func:`check_kernel`, and the check a case gets unless it brings its own.

:func:`check_kernel` validates its arguments, skips the cases whose features or dtypes the kernel
was not checked for and those that do not pass a keyword its signature requires, and runs every
other case in every dtype, turning any exception into a :class:`Failure` (a report, never a
crash). The default check, :func:`_accuracy`, measures a case's output and lse against the
references of ``_core.py`` and asks ``diagnose.py`` why a check failed; ``training.py`` reuses it
before checking the gradients.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np

import flash_lib
from flash_check import diagnose
from flash_check._core import (CASES, DEFAULT_FEATURES, DTYPES, FACTOR, FEATURE_KEYWORDS,
                               FEATURES, LSE_FLOOR, OUT_FLOOR, Report, Result, Skip, _call,
                               _Context, _known_features, _lse_error, _max_error, _reference,
                               _split)

# --------------------------------------------------------------------------------------------
# The default check: accuracy
# --------------------------------------------------------------------------------------------


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
    _check_garbage_rows(ctx, result, ref, out, why)

    rows = ref.rows
    bad = rows & ~np.isfinite(out).all(axis=-1)
    if bad.any():
        ctx.fail(result, "non-finite", f"{diagnose.nonfinite_kinds(out[bad])} in "
                 f"{int(bad.sum())} of {int(rows.sum())} rows",
                 "finite wherever the exact output is",
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
        rows = ref.lse_rows
        bad = rows & ~np.isfinite(lse)
        measured = rows & ~bad
        err = _lse_error(lse[measured], ref.lse[measured])
        naive = _lse_error(ref.naive_lse[measured], ref.lse[measured])
        bound = FACTOR * naive + LSE_FLOOR[ctx.dtype]
        result.lse_error, result.lse_naive, result.lse_bound = err, naive, bound
        if bad.any():
            ctx.fail(result, "lse non-finite", f"{diagnose.nonfinite_kinds(lse[bad])} in "
                     f"{int(bad.sum())} of {int(rows.sum())} rows",
                     "finite wherever the exact lse is",
                     why.explain(diagnose.NON_FINITE, bad=bad, of_lse=True))
        if err > bound:
            ctx.fail(result, "lse error", f"{err:.2g}", f"{FACTOR:g} x naive's {naive:.2g} + "
                     f"{LSE_FLOOR[ctx.dtype]:.2g} = {bound:.2g}",
                     why.explain(diagnose.LSE_ERROR, rows=measured, err=err))
    return result


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
                 why.explain(diagnose.EMPTY_ROWS, rows=rows, nan=nan,
                             nan_rows=empty & np.isnan(out).any(axis=-1)))
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


def _check_garbage_rows(ctx, result, ref, out, why):
    """Rows allowed to attend an inf or NaN in v must not come out finite: the garbage reaches
    exactly the rows allowed to attend it, never a row that may not, and is never hidden."""
    garbage_rows = ref.inputs.garbage_rows
    if garbage_rows is None:
        return
    hidden = garbage_rows & np.isfinite(out).all(axis=-1)
    if hidden.any():
        ctx.fail(result, "garbage row", f"{int(hidden.sum())} of {int(garbage_rows.sum())} rows "
                 f"that attend an inf or NaN in v came out finite", "not finite",
                 why.explain(diagnose.GARBAGE_HIDDEN, hidden=hidden))


# --------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------


def _crashed(ctx, exc, during):
    """A Result holding one Failure for an exception raised while checking the kernel."""
    result = Result(ctx.case.name, ctx.dtype)
    message = " ".join(str(exc).split())
    ctx.fail(result, "crashed", f"{type(exc).__name__}: {message[:160]}", "a result to check",
             f"{during} raised: the kernel returned or did something the checks cannot read "
             f"(an array of objects, a tensor that requires grad, an exception inside the "
             f"case's own run)")
    return result


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


def _required_keywords(fn):
    """The parameters of ``fn`` without a default beyond the three that take q, k, v (a packed
    batch's ``cu_seqlens_q``, a cache's ``cache_seqlens``): what every call must pass. Nothing
    when the signature cannot be read (a builtin): then every case is tried."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    positional, required = 3, []  # q, k, v fill the first three positional parameters
    for p in parameters:
        if p.kind is p.VAR_POSITIONAL:
            positional = 0
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and positional:
            positional -= 1
        elif p.kind is not p.VAR_KEYWORD and p.default is p.empty:
            required.append(p.name)
    return tuple(required)


def check_kernel(fn, *, features=DEFAULT_FEATURES, dtypes=DTYPES, lse_empty=-np.inf, seed=0,
                 cases=None, backward=None, dropout_generator=None):
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
        What the kernel supports (see :data:`FEATURES`); cases needing anything else are skipped,
        and so are the cases that do not pass a keyword the kernel's signature requires (a
        varlen kernel's ``cu_seqlens_q``: the dense cases call ``fn(q, k, v, ...)`` without it;
        ``_core.FEATURE_KEYWORDS`` says what each feature's cases pass).
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
        the backward's keep mask and the gradients under the forward's seed; the non-finite
        cases (``masked_nonfinite``, ``causal_nonfinite``, ``partial_nonfinite``) check that
        garbage in k and v reaches no gradient it cannot reach.
    dropout_generator : None, "flash_lib" or callable, optional
        The generator whose keep mask the kernel claims to draw, ``generator(seed, p, shape)``
        returning the bool mask of ``shape = (..., Nq, Nk)`` at the global positions ``(b, i,
        j)`` (``"flash_lib"``: :func:`flash_lib.dropout_keep`, Philox4x32-7 keyed by ``b`` the
        flat batch index). Given, the dropout case holds the kernel's mask to it, pair for pair,
        and names the index a differing mask ignores or repeats; by default (None) it holds the
        mask to what any generator must give: the keep rate, and independence of rows and of
        keys at every lag up to 128, of batch elements and of seeds (needs ``"dropout"`` among
        the features).
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
    if isinstance(dropout_generator, str):
        if dropout_generator != "flash_lib":
            raise ValueError(f"dropout_generator must be None, 'flash_lib' or a callable "
                             f"(seed, p, shape) -> keep mask, got {dropout_generator!r}")
        dropout_generator = flash_lib.dropout_keep
    elif dropout_generator is not None and not callable(dropout_generator):
        raise TypeError(f"dropout_generator must be None, 'flash_lib' or a callable (seed, p, "
                        f"shape) -> keep mask, got {type(dropout_generator).__name__}")
    if dropout_generator is not None and "dropout" not in features:
        raise ValueError("dropout_generator is given, but 'dropout' is not among the features: "
                         "the dropout case, which uses it, would not run")
    if cases is None:
        selected = list(CASES.values())
    else:
        cases = [cases] if isinstance(cases, str) else list(cases)
        missing = [c for c in cases if c not in CASES]
        if missing:
            raise ValueError(f"cases {missing} are not registered; registered: {list(CASES)}")
        selected = [CASES[c] for c in cases]

    required = _required_keywords(fn)
    results, skipped, done = [], [], {}
    for case in selected:
        lacking = [f for f in case.needs if f not in features]
        if lacking:
            skipped.append(Skip(case.name, f"needs feature {', '.join(map(repr, lacking))}: "
                                           f"{'; '.join(FEATURES.get(f, f) for f in lacking)}"))
            continue
        passed = {key for f in case.needs for key in FEATURE_KEYWORDS.get(f, ())}
        unpassed = [key for key in required if key not in passed]
        if unpassed:
            skipped.append(Skip(case.name, f"does not apply: the kernel requires "
                                           f"{', '.join(f'{key}=' for key in unpassed)}, which "
                                           f"this case does not pass"))
            continue
        run_dtypes = [d for d in dtypes if case.dtypes is None or d in case.dtypes]
        if not run_dtypes:
            skipped.append(Skip(case.name, f"runs in {', '.join(case.dtypes)} only"))
            continue
        if case.once:
            run_dtypes = ["float32" if "float32" in run_dtypes else run_dtypes[0]]
        for dtype in run_dtypes:
            ctx = _Context(fn, case, dtype, features, lse_empty, int(seed), done, backward,
                           dropout_generator)
            try:
                with np.errstate(all="ignore"):  # the diagnoses handle non-finite output
                    result = (case.run or _accuracy)(ctx)
            except Exception as exc:  # every kernel call and check: a Failure, never a crash
                result = _crashed(ctx, exc, f"case {case.name!r} ({dtype})")
            done[case.name, dtype] = result
            results.append(result)
    return Report(_kernel_name(fn), features, dtypes, lse_empty, results, skipped)

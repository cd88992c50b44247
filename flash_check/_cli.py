"""The command line: ``python -m flash_check package.module:function [--features ...] ...``.

:func:`main` is ``flash_check.main``, which ``python -m flash_check`` (``__main__.py``) runs. It
uses the package's registry, so a kernel's module that imports flash_check (to register a case)
sees the same cases.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect

import numpy as np

from flash_check._core import DEFAULT_FEATURES, DTYPES, _known_features
from flash_check._runner import check_kernel


def _load(target):
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected package.module:function, got {target!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _with_lse(fn, features):
    """With the ``lse`` feature, a kernel that takes ``return_lse`` (flash_lib's, flash_triton's)
    is called with ``return_lse=True``, so that it returns the ``(out, lse)`` the cases check."""
    if "lse" not in features:
        return fn
    try:
        takes_it = "return_lse" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or extension function without a signature
        return fn
    return functools.partial(fn, return_lse=True) if takes_it else fn


def main(argv=None):
    """``python -m flash_check package.module:function [--features ...] [--dtypes ...]``, with
    ``argv`` the arguments (default: the command line's): prints the report and returns the exit
    status, 1 on any failure (bad arguments exit with status 2, as argparse does)."""
    parser = argparse.ArgumentParser(
        prog="python -m flash_check",
        description="Check an attention kernel against flash_lib's conventions and accuracy "
                    "bounds; print the report; exit 1 on any failure.")
    parser.add_argument("kernel", help="package.module:function, the kernel to check")
    parser.add_argument("--features", nargs="*", default=list(DEFAULT_FEATURES),
                        metavar="FEATURE", help=f"what the kernel supports, among "
                        f"{', '.join(_known_features())} (default: {' '.join(DEFAULT_FEATURES)})")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES,
                        metavar="DTYPE", help=f"dtypes to check (default: {' '.join(DTYPES)})")
    parser.add_argument("--lse-empty", type=float, default=-np.inf,
                        help="the lse the kernel writes for a fully masked row (default: -inf)")
    parser.add_argument("--cases", nargs="+", metavar="CASE", help="run only these cases")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backward", metavar="BACKWARD",
                        help="package.module:function, the kernel's backward (q, k, v, out, lse, "
                             "dout, **keywords) -> (dq, dk, dv[, dsinks]): the sinks and dropout "
                             "cases then check the gradients")
    parser.add_argument("--dropout-generator", metavar="GENERATOR",
                        help="the generator whose keep mask the kernel claims: flash_lib "
                             "(flash_lib.dropout_keep), or package.module:function (seed, p, "
                             "shape) -> keep mask; the dropout case then checks the mask against "
                             "it pair for pair (default: the generator-agnostic statistics)")
    args = parser.parse_args(argv)
    try:
        fn = _load(args.kernel)
        backward = None if args.backward is None else _load(args.backward)
        generator = args.dropout_generator
        if generator is not None and generator != "flash_lib":
            generator = _load(generator)
    except (ValueError, ImportError, AttributeError) as exc:
        parser.error(f"cannot load the kernel {args.kernel!r}, its backward or its dropout "
                     f"generator: {exc}")
    try:
        report = check_kernel(_with_lse(fn, args.features), features=args.features,
                              dtypes=args.dtypes, lse_empty=args.lse_empty, seed=args.seed,
                              cases=args.cases, backward=backward, dropout_generator=generator)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    print(report)
    return 0 if report.ok else 1

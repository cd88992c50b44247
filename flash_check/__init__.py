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
Chapter 23 of the tutorial measures flash_lib, PyTorch and JAX against this rule and justifies
the values of ``FACTOR``, ``OUT_FLOOR`` and ``LSE_FLOOR`` (``_core.py``).

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
with the block sizes), rows whose streams overlap, a mask that ignores the batch or head index or
repeats along rows or keys with a tile's period (a tile-local index), the keep probability p for
1 - p, a missing 1/(1 - p), a backward that regenerates another mask; and each variant ignored. A
kernel's dropout mask is read off its output (``q = 0`` makes ``P`` uniform, ``v`` = the identity
makes ``out[i, j] = P_ij·Z_ij/(1 - p)``). By default the checks hold any generator to what dropout
must be (a keep rate of 1 - p, rows and keys independent at every lag up to 128, batch elements
and seeds independent), not to flash_lib's Philox; a kernel that claims a generator
(``dropout_generator="flash_lib"``, ``--dropout-generator flash_lib``) is held to its mask at
every pair.

Garbage
-------
Three cases put inf and NaN in ``k`` and ``v`` at keys some rows may not attend: padded keys no
row may attend (``masked_nonfinite``), keys past the causal diagonal of the rows before them
(``causal_nonfinite``) and keys the mask allows for one or two rows of a tile and hides from the
others (``partial_nonfinite``). The garbage must reach exactly the rows allowed to attend it; a
leak is reported with the rows it reached and the key it came from (and, where the rows are those
sharing a query block with a row that attends the key, the block size: a kernel that zeroes the
v of keys no row of a tile may attend). Given ``backward=``, the gradients too: the garbage must
reach no gradient it cannot reach in exact arithmetic.

The package
-----------
This module is the API: it re-exports the public names of the modules below and imports the
built-in cases, which register themselves. Each module imports only modules listed before it
(``tests/test_check.py`` holds the package to that: no import cycle, no import inside a function):

- ``_core.py``: the constants, the types, the registry, the results, the references;
- ``diagnose.py``: the known mistakes of the accuracy check, a table of condition and message per
  check;
- ``_runner.py``: the accuracy check and :func:`check_kernel`;
- ``_gradients.py``: the gradient check (a backward's gradients against the output's rule, and
  the non-finite cases' gradients where the garbage cannot reach them);
- ``cases.py``: the built-in cases (the classic ones, the non-finite ones, the variants',
  memory);
- ``training.py``: the sinks and dropout cases and their own tables of known mistakes;
- ``serving.py``: the packed-batch and KV-cache cases;
- ``after_fa3.py``: FA4's conditional rescaling and top-k sparse attention, their cases and
  planted bugs (``after_fa3.planted``);
- ``adapters.py``: PyTorch and JAX as kernels, and FlashAttention's layouts;
- ``_cli.py``: the command line, :func:`main` (``__main__.py`` runs it);
- ``exercises.py``, which no other module imports: the tutorial's exercises and their grader
  (``python -m flash_check.exercises``), with the solutions in ``_solutions.py`` and, for the
  Triton exercise, ``_solutions_triton.py`` (imported only when that exercise is graded);
- ``bugs.py``, which no other module imports: small tiled kernels with one classic bug each, for
  the tests and chapter 23.
"""

from __future__ import annotations

from flash_check._core import (CASES, DEFAULT_FEATURES, DTYPES, FACTOR, FEATURES, LSE_FLOOR,
                               MEMORY_EXPONENT, OUT_FLOOR, VARIANTS, Case, Failure, Inputs, Report,
                               Result, Skip, random_qkv, register_case)
from flash_check._runner import check_kernel
# The built-in cases register themselves when imported, in the order the report lists them.
from flash_check import cases, training, serving, after_fa3  # noqa: F401
from flash_check.adapters import (jax_dot_product_attention, torch_flash_for_cpu_with_lse,
                                  torch_sdpa)
from flash_check._cli import main

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

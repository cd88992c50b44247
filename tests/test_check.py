"""flash_check: a clean kernel passes, each classic bug fails with its cause named, the CLI works,
and real kernels (PyTorch SDPA, JAX) get the results the README states.

The broken kernels are flash_check.bugs' small tiled kernels with a switch per bug (the ones
chapter 23 prints), written independently of flash_lib.
"""

import ast
import functools
import graphlib
import importlib.util
import itertools
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import flash_check
import flash_lib
from flash_check import bugs, training
from flash_check._core import _Context, _reference
from flash_check.bugs import tiled_attention, variant_attention, variant_attention_backward

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALL = ("mask", "causal", "lse", "dv")
#: The cases with inf and NaN in k and v at keys some rows may not attend.
NONFINITE = ("masked_nonfinite", "causal_nonfinite", "partial_nonfinite")
VARIANTS = flash_check.VARIANTS
#: The serving cases (flash_check/serving.py: their kernels take cu_seqlens or a cache) and the
#: after-FlashAttention-3 ones (flash_check/after_fa3.py: rescale_threshold, sparse indices).
OTHER_SIGNATURE_CASES = [name for name, case in flash_check.CASES.items()
                 if set(case.needs) & {"varlen", "kvcache", "paged", "rescale_threshold", "sparse"}]
#: The cases that need a variant feature (the serving ones with sinks or dropout left out).
VARIANT_CASES = [name for name, case in flash_check.CASES.items()
                 if set(case.needs) & set(VARIANTS) and name not in OTHER_SIGNATURE_CASES]


def bugged(bug):
    return functools.partial(tiled_attention, bug=bug)


#: The tiled kernel with one tile: right, but it holds the whole Nq x Nk score matrix.
dense = bugged("quadratic_memory")


def diagnoses(report, case=None):
    return " | ".join(f.diagnosis for f in report.failures if case is None or f.case == case)


# --- clean kernels pass ---------------------------------------------------------------------


@pytest.mark.parametrize("blocks", [{}, {"block_q": 16, "block_k": 16}, {"block_q": 7, "block_k": 1}],
                         ids=["default tiles", "16x16", "7x1"])
def test_flash_lib_passes_every_case(blocks):
    """With every feature, the variants included (sinks and dropout), and the backward's
    gradients, at the default and 16 x 16 tiles; at 7 x 1 (a thousand rescales in a row) the
    classic cases' forward only, since one key per tile makes the variant cases' per-tile work
    (mask_mod, bias) and the backward cost seconds here."""
    kernel = functools.partial(flash_lib.flash_attention, return_lse=True, **blocks)
    variants = VARIANTS if blocks.get("block_k") != 1 else ()
    backward = (functools.partial(flash_lib.flash_attention_backward, **blocks) if variants
                else None)  # at 7 x 1, the forward's rounding alone
    features = ALL + variants + (("memory",) if not blocks else ())
    report = flash_check.check_kernel(kernel, features=features, backward=backward)
    assert report.ok, str(report)
    skipped = (set() if "memory" in features else {"memory"}) | (
        set() if variants else set(VARIANT_CASES)) | set(OTHER_SIGNATURE_CASES)
    assert {s.case for s in report.skipped} == skipped
    assert {r.case for r in report.results} == set(flash_check.CASES) - skipped
    notes = {r.case: r.note for r in report.results}
    if variants:
        for case in NONFINITE:
            assert notes[case].startswith("gradients checked where the garbage cannot reach")
        assert "the backward's mask and gradients checked" in notes["dropout"], notes["dropout"]
        assert notes["sinks"] == notes["sinks_empty_rows"] == "gradients checked, dsinks included"


def test_the_clean_tiled_kernel_passes():
    report = flash_check.check_kernel(tiled_attention, features=ALL)
    assert report.ok, str(report)


def test_naive_passes_except_memory():
    """naive_attention holds the N x N scores: the memory case must say so, and only it."""
    kernel = functools.partial(flash_lib.naive_attention, return_lse=True)
    report = flash_check.check_kernel(kernel, features=ALL + ("memory",))
    assert report.failed_cases() == ["memory"], str(report)
    assert "materialises the Nq x Nk scores" in diagnoses(report)
    assert report.failures[0].measured.startswith("scratch grows as N^2.0")


# --- each classic bug fails, and the diagnosis names its cause ------------------------------

BUGS = {
    # bug: (a case it must fail, words its diagnosis there must contain)
    "missing_rescale": ("late_max", "not rescaled by exp(m - m')"),
    "nan_empty_rows": ("empty_rows", "fully masked row is NaN: the exp(-inf - (-inf)) guard"),
    "top_left": ("causal_wide", "causal is aligned top-left"),
    "lse_base2": ("random", "lse is in log base 2"),
    "drop_partial_block": ("size_63x65", "the last partial key block is dropped"),
    "float16_accumulation": ("float16_overflow", "overflow float16"),
    "uniform_empty_rows": ("empty_rows", "uniform weights"),
    "stale_max": ("late_max", "stale running max"),
    "garbage_per_tile": ("partial_nonfinite", "exactly the rows that share a 16-row query block"),
    "garbage_past_diagonal": ("causal_nonfinite", "rows 0–20 from key 21 (v NaN; beyond their "
                              "causal diagonal; rows 21–79 attend it)"),
}


def test_every_bug_of_the_zoo_is_tested():
    """Each bug flash_check.bugs can make has its test here (quadratic_memory: the memory test),
    and a misspelt bug is refused rather than run as the clean kernel."""
    assert set(bugs.BUGS) == set(BUGS) | {"quadratic_memory"}
    assert set(bugs.VARIANT_BUGS) == (set(VARIANT_BUGS) | set(TRAINING_BUGS)
                                      | set(GARBAGE_BACKWARD_BUGS))
    q, k, v = flash_check.random_qkv(np.random.default_rng(0), 4, 4)
    for kernel in (tiled_attention, variant_attention):
        with pytest.raises(ValueError, match="bug must be None or one of"):
            kernel(q, k, v, bug="missing rescale")


@pytest.mark.parametrize("bug", BUGS)
def test_each_bug_is_caught_with_its_cause(bug):
    case, words = BUGS[bug]
    report = flash_check.check_kernel(bugged(bug), features=ALL)
    assert not report.ok
    assert case in report.failed_cases(), str(report)
    assert words in diagnoses(report, case), diagnoses(report, case)


def test_missing_rescale_is_found_by_reordering_keys():
    """On plain random inputs too: right with a row's largest score first, wrong with it last."""
    report = flash_check.check_kernel(bugged("missing_rescale"), features=ALL, cases=["random"])
    assert "depends on the order of the keys" in diagnoses(report), diagnoses(report)


def test_nan_empty_rows_also_breaks_left_padded_rows():
    report = flash_check.check_kernel(bugged("nan_empty_rows"), features=ALL,
                                      cases=["key_padding"])
    assert "whose first keys are masked" in diagnoses(report), diagnoses(report)


def test_float16_accumulation_fails_in_float16_only():
    report = flash_check.check_kernel(bugged("float16_accumulation"), features=ALL)
    assert {f.dtype for f in report.failures} == {"float16"}, str(report)
    assert "accumulated in float16" in diagnoses(report), diagnoses(report)


def test_quadratic_memory_is_caught():
    report = flash_check.check_kernel(dense, features=ALL + ("memory",))
    assert report.failed_cases() == ["memory"], str(report)
    assert "O(N²) memory" in diagnoses(report)


def test_scale_ignored_is_named():
    def ignores_scale(q, k, v, **kwargs):
        kwargs.pop("scale", None)
        return flash_lib.flash_attention(q, k, v, **kwargs, return_lse=True)

    report = flash_check.check_kernel(ignores_scale, features=ALL)
    assert set(report.failed_cases()) == {"late_max", "large_scale", "tiny_scale",
                                          "float16_overflow"}, str(report)
    assert "the scale argument (10000) is ignored" in diagnoses(report, "large_scale")


def test_a_nan_that_becomes_a_number_or_spreads_is_caught():
    def hides(q, k, v, **kwargs):  # as if NaN were filtered out with nan_to_num
        out, lse = flash_lib.flash_attention(q, k, v, **kwargs, return_lse=True)
        return np.nan_to_num(out), np.nan_to_num(lse)

    def spreads(q, k, v, **kwargs):  # a NaN anywhere in a batch element poisons all its rows
        out, lse = flash_lib.flash_attention(q, k, v, **kwargs, return_lse=True)
        poisoned = np.isnan(out).any(axis=(-2, -1), keepdims=True)
        return np.where(poisoned, np.nan, out), np.where(poisoned[..., 0], np.nan, lse)

    report = flash_check.check_kernel(hides, cases=["nan_in_q"], dtypes=("float64",))
    assert "NaN row" in {f.check for f in report.failures}, str(report)
    assert "became a silent number" in diagnoses(report)
    report = flash_check.check_kernel(spreads, cases=["nan_in_q"], dtypes=("float64",))
    assert {f.check for f in report.failures} >= {"non-finite"}, str(report)
    assert "reached other rows" in diagnoses(report)


# --- garbage (inf, NaN) at keys a row may not attend: forward and backward ------------------


def test_masked_garbage_that_leaks_is_named():
    """The textbook kernel masks the weights and multiplies every value: all three non-finite
    cases fail, each row that got garbage named with the key it came from."""
    report = flash_check.check_kernel(_weights_only, features=("mask", "causal"), cases=NONFINITE)
    assert report.failed_cases() == list(NONFINITE)
    assert "reached" in diagnoses(report) and "0 · inf = NaN in P·V" in diagnoses(report)
    causal = diagnoses(report, "causal_nonfinite")
    for rows_from_key in ("batch 0, rows 0–20 from key 21 (v NaN", "batch 1, rows 0–44 from key "
                          "45 (v +inf", "batch 2, rows 0–66 from key 67 (v -inf"):
        assert rows_from_key in causal, causal
    assert "from key 37" not in causal  # NaN in k is kept out of the scores by where: no leak
    assert flash_check.check_kernel(tiled_attention, features=("mask", "causal", "lse"),
                                    cases=NONFINITE).ok


def test_the_garbage_per_tile_is_flash_triton_s_leak():
    """flash_triton's forward before issue 33 zeroed the v of keys no row of a tile may attend:
    the rows that leak are exactly those sharing a query block with a row that attends the key,
    and the diagnosis says which, from which key, and the block size (16 here; 32 in Triton)."""
    report = flash_check.check_kernel(bugged("garbage_per_tile"), features=ALL, cases=NONFINITE)
    assert report.failed_cases() == ["causal_nonfinite", "partial_nonfinite"], str(report)
    assert {f.check for f in report.failures} == {"non-finite"}
    causal = next(f for f in report.failures if f.case == "causal_nonfinite")
    assert causal.measured == "NaN in 21 of 170 rows"
    assert causal.diagnosis.startswith(
        "non-finite values in k or v at keys these rows may not attend reached them: batch 0, "
        "rows 16–20 from key 21 (v NaN; beyond their causal diagonal; rows 21–79 attend it); "
        "batch 1, rows 32–44 from key 45 (v +inf; beyond their causal diagonal; rows 45–79 "
        "attend it); batch 2, rows 64–66 from key 67 (v -inf; beyond their causal diagonal; rows "
        "67–79 attend it). From v: a masked pair weighs 0, but 0 · inf = NaN in P·V; these are "
        "exactly the rows that share a 16-row query block with a row that attends the key"), (
        causal.diagnosis)
    partial = diagnoses(report, "partial_nonfinite")
    assert ("batch 0, rows 32–36, 38–47 from key 50 (v NaN; masked for them; row 37 attends it)"
            in partial), partial
    # the same rows at another tile size, 8: the block is read off the rows that leaked
    report = flash_check.check_kernel(functools.partial(tiled_attention, bug="garbage_per_tile",
                                                        block=8),
                                      cases=["causal_nonfinite"], dtypes=("float64",))
    assert "batch 0, rows 16–20 from key 21" in diagnoses(report)
    assert "share a 8-row query block" in diagnoses(report), diagnoses(report)


def test_garbage_that_is_hidden_is_caught():
    """Garbage must reach exactly the rows allowed to attend it: a kernel that sanitises v (as a
    quick fix of a leak might) gives those rows numbers, and is told so."""
    def sanitises(q, k, v, **kwargs):
        return flash_lib.flash_attention(q, np.nan_to_num(k), np.nan_to_num(v), **kwargs,
                                         return_lse=True)

    report = flash_check.check_kernel(sanitises, cases=["causal_nonfinite"], dtypes=("float64",))
    assert {f.check for f in report.failures} == {"garbage row", "NaN row"}, str(report)
    hidden = next(f for f in report.failures if f.check == "garbage row")
    assert hidden.measured == "107 of 107 rows that attend an inf or NaN in v came out finite"
    assert "batch 0, rows 21–79 (key 21: v NaN)" in hidden.diagnosis, hidden.diagnosis


GARBAGE_BACKWARD_BUGS = {
    # bug: (the gradient that fails, words of its diagnosis in causal_nonfinite)
    "garbage_ds_unmasked": ("dq", "batch 0, rows 0–20 from key 21 (v NaN; beyond their causal "
                            "diagonal; rows 21–79 attend it)", "From v: dP = dO·Vᵀ reads every "
                            "key's v"),
    "garbage_k_in_dq": ("dq", "batch 3, rows 0–36 from key 37 (k NaN; beyond their causal "
                        "diagonal; rows 37–79 attend it)", "From k: dQ = dS·K multiplies a "
                        "masked pair's dS = 0 by the NaN in k"),
}


@pytest.mark.parametrize("bug", GARBAGE_BACKWARD_BUGS)
def test_each_garbage_backward_bug_is_caught_with_its_rows_and_key(bug):
    """flash_triton's backward before issue 33 (dS not zeroed at masked pairs), and dS·K over
    every key: each non-finite case fails in every dtype, naming the rows and the key; the
    forward is right, and the right backward passes."""
    gradient, where, how = GARBAGE_BACKWARD_BUGS[bug]
    report = flash_check.check_kernel(
        variant_attention, features=ALL, cases=NONFINITE,
        backward=functools.partial(variant_attention_backward, bug=bug))
    assert report.failed_cases() == list(NONFINITE), str(report)
    assert {f.check for f in report.failures} <= {"dq non-finite", "dk non-finite"}
    for dtype in flash_check.DTYPES:
        failure = next(f for f in report.failures if f.case == "causal_nonfinite"
                       and f.dtype == dtype and f.check == f"{gradient} non-finite")
        assert where in failure.diagnosis and how in failure.diagnosis, failure.diagnosis
    masked = diagnoses(report, "masked_nonfinite")  # the probes tell k's garbage from v's
    assert ("from keys 34–47 (v +inf at 34–39" if bug == "garbage_ds_unmasked"
            else "from keys 30–33 (k NaN") in masked, masked
    assert flash_check.check_kernel(variant_attention, features=ALL, cases=NONFINITE,
                                    backward=variant_attention_backward).ok


def test_a_key_no_row_attends_must_get_zero_gradients():
    """dk at garbage keys masked for every row: its exact value is 0, a leak there is named."""
    report = flash_check.check_kernel(
        variant_attention, features=ALL, cases=["masked_nonfinite"], dtypes=("float64",),
        backward=functools.partial(variant_attention_backward, bug="garbage_ds_unmasked"))
    failure = next(f for f in report.failures if f.check == "dk non-finite")
    assert failure.measured == "NaN in 14 of 96 keys"
    assert failure.diagnosis.startswith(
        "dk is not finite at garbage keys that no row may attend: batch 1, keys 34–47 (v +inf at "
        "34–39; v -inf at 40–43; v NaN at 44–47). A key no row attends must get dk = dv = 0"), (
        failure.diagnosis)


def _weights_only(q, k, v, *, mask=None, causal=False, scale=None):
    """Textbook dense attention that masks the weights, not the values (as most kernels do)."""
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    acc = np.float32 if q.dtype == np.float16 else q.dtype
    s = (q.astype(acc) @ np.swapaxes(k, -1, -2).astype(acc)) * scale
    ok = np.ones(s.shape, bool)
    if mask is not None:
        ok = ok & mask
    if causal:
        ok = ok & flash_lib.causal_mask(q.shape[-2], k.shape[-2])
    s = np.where(ok, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(m == -np.inf, 0, m))
    l = p.sum(axis=-1, keepdims=True)
    return ((p @ v.astype(acc)) / np.where(l == 0, 1, l)).astype(q.dtype)


# --- the report, features, conventions, bad input -------------------------------------------


def test_report_is_a_readable_table_with_failures_and_skips():
    report = flash_check.check_kernel(bugged("lse_base2"), features=("mask", "lse"),
                                      dtypes=("float64",))
    text = str(report)
    assert text.splitlines()[0].startswith("check_kernel(")
    for case in ("random", "late_max", "empty_rows"):
        assert re.search(rf"^{case}\s+float64\s", text, re.M), case
    assert "FAIL" in text and "lse is in log base 2" in text
    assert re.search(r"^  decode: needs feature 'causal'", text, re.M), text
    failure = report.failures[0]
    assert (failure.case, failure.dtype, failure.check) == ("random", "float64", "lse error")
    assert failure.measured and "naive" in failure.bound and failure.diagnosis
    assert text.rstrip().endswith("skipped") and text.splitlines()[-1].startswith("FAIL")


def test_unsupported_features_are_skipped_and_listed():
    kernel = functools.partial(flash_lib.flash_attention)  # out only: no "lse"
    report = flash_check.check_kernel(kernel, features=(), dtypes=("float32",))
    assert report.ok, str(report)
    skipped = {s.case: s.reason for s in report.skipped}
    needing = {c.name for c in flash_check.CASES.values() if c.needs}
    assert set(skipped) >= needing
    assert "needs feature 'mask'" in skipped["key_padding"]
    assert "runs in float16 only" in skipped["float16_overflow"]
    assert all(r.lse_error is None for r in report.results)


def test_a_kernel_returning_the_wrong_thing_fails_clearly():
    report = flash_check.check_kernel(flash_lib.flash_attention, features=("lse",),
                                      dtypes=("float64",), cases=["random"])
    assert [f.check for f in report.failures] == ["shape"]
    assert "expected (out, lse)" in report.failures[0].diagnosis


def test_lse_empty_is_the_kernels_convention():
    def plus_inf(q, k, v, **kwargs):  # FlashAttention's convention for empty rows
        out, lse = flash_lib.flash_attention(q, k, v, **kwargs, return_lse=True)
        return out, np.where(lse == -np.inf, np.inf, lse)

    cases = ["empty_rows", "all_masked", "causal_tall"]
    assert flash_check.check_kernel(plus_inf, lse_empty=np.inf, cases=cases).ok
    report = flash_check.check_kernel(plus_inf, cases=cases)
    assert {f.check for f in report.failures} == {"empty lse"}, str(report)
    assert "pass it as lse_empty" in diagnoses(report)


def test_a_kernel_that_raises_or_writes_its_inputs_is_reported():
    def raises(q, k, v, **kwargs):
        raise RuntimeError("no kernel for this shape")

    def writes(q, k, v, **kwargs):
        q *= 1.0 / np.sqrt(q.shape[-1])
        return flash_lib.flash_attention(q, k, v, **kwargs, scale=1.0)

    report = flash_check.check_kernel(raises, features=(), dtypes=("float32",), cases=["random"])
    assert report.failures[0].check == "raised"
    assert "RuntimeError: no kernel for this shape" in report.failures[0].measured
    report = flash_check.check_kernel(writes, features=(), dtypes=("float64",), cases=["random"])
    assert [f.check for f in report.failures] == ["inputs"]


@pytest.fixture
def registry():
    """flash_check.CASES, given back after the test with the cases it held before (the registry
    is one dict, shared by every module of flash_check: rebinding the name would not do)."""
    saved = dict(flash_check.CASES)
    yield flash_check.CASES
    flash_check.CASES.clear()
    flash_check.CASES.update(saved)


def test_a_new_case_is_one_registration(registry):
    """The way the variants will be added: a Case with its own feature, skipped without it."""

    def make(rng, dtype):
        q, k, v = flash_check.random_qkv(rng, 9, 33, dtype=dtype)
        return flash_check.Inputs(q, k, v, {"scale": 0.5, "causal": True})

    flash_check.register_case(flash_check.Case("halved_causal", "a scale of 0.5 with causal",
                                               make, needs=("causal", "halving")))
    kernel = functools.partial(flash_lib.flash_attention, return_lse=True)
    report = flash_check.check_kernel(kernel, cases=["halved_causal"])
    assert [s.case for s in report.skipped] == ["halved_causal"]
    report = flash_check.check_kernel(kernel, features=DEFAULT + ("halving",),
                                      cases=["halved_causal"])
    assert report.ok and [r.case for r in report.results] == ["halved_causal"] * 3
    assert flash_check.check_kernel(bugged("top_left"), features=DEFAULT + ("halving",),
                                    cases=["halved_causal"]).failed_cases() == ["halved_causal"]


DEFAULT = flash_check.DEFAULT_FEATURES


@pytest.mark.parametrize("kwargs, error", [
    ({"features": ("mask", "windw")}, "features \\['windw'\\] are unknown"),
    ({"features": "mask"}, "sequences of names"),
    ({"dtypes": ("bfloat16",)}, "dtypes must be a non-empty selection"),
    ({"dtypes": ()}, "dtypes must be a non-empty selection"),
    ({"cases": ["no_such_case"]}, "not registered"),
    ({"seed": -1}, "seed must be a non-negative integer"),
    ({"lse_empty": "inf?"}, "lse_empty must be a float"),
    ({"dropout_generator": "philox"}, "dropout_generator must be None, 'flash_lib' or a callable"),
    ({"dropout_generator": 7}, "dropout_generator must be None, 'flash_lib' or a callable"),
    ({"dropout_generator": "flash_lib"}, "'dropout' is not among the features"),
])
def test_bad_arguments_are_named(kwargs, error):
    with pytest.raises((ValueError, TypeError), match=error):
        flash_check.check_kernel(flash_lib.flash_attention, **kwargs)
    with pytest.raises(TypeError, match="fn must be callable"):
        flash_check.check_kernel("flash_lib.flash_attention")


def test_the_bound_rule_is_the_documented_one():
    """Loosening the bound would let the float16-accumulation kernel through: pin the numbers."""
    assert flash_check.FACTOR == 2.0
    eps = {name: float(np.finfo(name).eps) for name in flash_check.DTYPES}
    assert flash_check.OUT_FLOOR == {"float64": 8 * eps["float64"], "float32": 8 * eps["float32"],
                                     "float16": eps["float16"]}
    report = flash_check.check_kernel(tiled_attention, cases=["random"], dtypes=("float32",))
    (result,) = report.results
    assert result.out_bound == pytest.approx(2 * result.out_naive + 8 * eps["float32"])
    assert 0 < result.out_error <= result.out_bound


# --- the variants: window, softcap, ALiBi, GQA, mask_mod ------------------------------------


def test_variant_cases_are_skipped_unless_their_feature_is_listed():
    kernel = functools.partial(flash_lib.flash_attention, return_lse=True)
    report = flash_check.check_kernel(kernel, dtypes=("float32",))
    skipped = {s.case: s.reason for s in report.skipped}
    assert set(VARIANT_CASES) <= set(skipped) and len(VARIANT_CASES) >= 10
    assert skipped["window"].startswith("needs feature 'window': takes window=(left, right)")
    assert "needs feature 'gqa': takes enable_gqa=True" in skipped["gqa"]
    assert "'mask_mod'" in skipped["mask_mod_document"]
    report = flash_check.check_kernel(kernel, features=DEFAULT + ("window",), dtypes=("float32",),
                                      cases=VARIANT_CASES)
    assert {r.case for r in report.results} == {"window", "window_zero", "window_and_mask"}
    assert report.ok, str(report)


def test_the_variants_written_here_pass_every_variant_case():
    """A second implementation, tiled, passes in every dtype: the cases hold each variant to
    its conventions, not to flash_lib's code."""
    report = flash_check.check_kernel(variant_attention, features=ALL + VARIANTS,
                                      cases=VARIANT_CASES, backward=variant_attention_backward)
    assert report.ok, str(report)
    assert len(report.results) == sum(1 if flash_check.CASES[name].once else 3
                                      for name in VARIANT_CASES)


def test_the_diagnoses_reference_is_the_truth():
    """The one dense softmax the diagnoses write themselves (for softcap at the wrong step and
    ALiBi's wrong forms), set to the right step and form, is precise_attention on every variant
    case: so a mistake's output differs from the truth by that mistake only."""
    for name in VARIANT_CASES:
        if flash_check.CASES[name].make is None:  # the dropout case: a check of its own
            continue
        ref = _reference(flash_check.CASES[name], "float64", 0)
        ctx = _Context(variant_attention, flash_check.CASES[name], "float64", ALL + VARIANTS,
                       -np.inf, 0, {})
        why = flash_check.diagnose.Evidence(ctx, ref, ref.out, ref.lse)
        assert flash_lib.rowwise_relative_error(why.misplaced(), ref.out).max() < 1e-15, name


VARIANT_BUGS = {
    # bug: (the case it must fail, words of the diagnosis there)
    "window_left_off_by_one": ("window", "window off by one at the left edge"),
    "window_top_left": ("window", "the window is aligned top-left"),
    "softcap_after_mask": ("softcap_causal", "softcap applied after the mask"),
    "softcap_after_bias": ("alibi_cap_causal", "softcap applied after the ALiBi bias"),
    "alibi_gym_form": ("alibi", "(attention-gym's score_mod)"),
    "alibi_top_left": ("alibi", "ALiBi's distance is aligned top-left"),
    "gqa_h_mod_hkv": ("gqa", "GQA grouped as h mod Hkv instead of h // (Hq/Hkv)"),
    "mask_mod_inverted": ("mask_mod_prefix", "mask_mod's result is inverted"),
    "mask_mod_swapped": ("mask_mod_prefix", "called with its arguments swapped"),
    "mask_mod_corner_skip": ("mask_mod_dilated",
                             "skipped when mask_mod is False at their four corners (block 16)"),
    "mask_mod_local_indices": ("mask_mod_document", "positions local to the tile (0 ... 15, "
                               "block 16)"),
}


@pytest.mark.parametrize("bug", VARIANT_BUGS)
def test_each_variant_bug_is_caught_with_its_cause(bug):
    """In every dtype, the signature case fails with the diagnosis that names the mistake."""
    case, words = VARIANT_BUGS[bug]
    cases = [case, "alibi_cap_causal"] if bug == "alibi_gym_form" else [case]
    report = flash_check.check_kernel(functools.partial(variant_attention, bug=bug),
                                      features=ALL + VARIANTS, cases=cases)
    failing = [f for f in report.failures if f.case == case]
    assert {f.dtype for f in failing} == set(flash_check.DTYPES), str(report)
    for dtype in flash_check.DTYPES:
        assert any(words in f.diagnosis for f in failing if f.dtype == dtype), (
            dtype, diagnoses(report, case))
    if bug == "alibi_gym_form":  # under causal, the same output as ours; the lse is shifted
        causal = [f for f in report.failures if f.case == "alibi_cap_causal"]
        assert {f.check for f in causal} == {"lse error"}, str(report)
        assert all("attention-gym's form, which shifts it by slope·(Nk - Nq)" in f.diagnosis
                   for f in causal), diagnoses(report, "alibi_cap_causal")


# --- the training features: sinks and dropout -----------------------------------------------

TRAINING_BUGS = {
    # bug: (the case it must fail, the check, words of the diagnosis there)
    "dropout_stateful_tiles": ("dropout", "same mask", "the kept pairs change with the block "
                               "sizes: (block_q, block_k) = (40, 24)"),
    "dropout_backward_other_mask": ("dropout", "backward mask", "the backward's keep mask "
                                    "differs from the forward's"),
    "dropout_no_rescale": ("dropout", "keep values", "the kept weights are not divided by 1 - p"),
    "sink_counted_twice": ("sinks", "out error", "the sink is counted 2 times"),
    "dsinks_sign": ("sinks", "dsinks error", "dsinks has the wrong sign"),
}
TRAINING = ("sinks", "dropout")
#: The cases of the training features (sinks and dropout).
TRAINING_CASES = [name for name, case in flash_check.CASES.items()
                  if set(case.needs) & set(TRAINING) and name not in OTHER_SIGNATURE_CASES]


@pytest.mark.parametrize("bug", TRAINING_BUGS)
def test_each_training_bug_is_caught_with_its_cause(bug):
    """The bug zoo's kernel and its backward, each with one training bug: its signature case
    fails that check with the diagnosis naming the mistake (in every dtype the case runs)."""
    case, check, words = TRAINING_BUGS[bug]
    report = flash_check.check_kernel(
        functools.partial(variant_attention, bug=bug), features=ALL + VARIANTS,
        cases=TRAINING_CASES, backward=functools.partial(variant_attention_backward, bug=bug))
    failing = [f for f in report.failures if f.case == case and f.check == check]
    dtypes = {"float32"} if flash_check.CASES[case].once else set(flash_check.DTYPES)
    assert {f.dtype for f in failing} == dtypes, str(report)
    assert all(words in f.diagnosis for f in failing), diagnoses(report, case)
    if bug.startswith("sink"):  # every case with a sink shows it, and dropout is untouched
        assert set(report.failed_cases()) == {n for n in TRAINING_CASES if n != "dropout"}
    elif bug.startswith("dropout"):
        assert report.failed_cases() == ["dropout"], str(report)


def test_training_cases_are_skipped_unless_their_feature_is_listed():
    report = flash_check.check_kernel(variant_attention, features=ALL, cases=TRAINING_CASES)
    skipped = {s.case: s.reason for s in report.skipped}
    assert set(skipped) == set(TRAINING_CASES) and not report.results
    assert skipped["dropout"].startswith("needs feature 'dropout': takes dropout_p=")
    assert skipped["sinks"].startswith("needs feature 'sinks': takes sinks=")
    assert skipped["sinks_softcap"].startswith("needs feature 'sinks', 'softcap'")
    report = flash_check.check_kernel(variant_attention, features=ALL + ("sinks",),
                                      cases=TRAINING_CASES)
    assert {r.case for r in report.results} == {"sinks", "sinks_empty_rows", "sinks_causal"}
    assert report.ok and all(r.note == "gradients not checked: no backward= given"
                             for r in report.results if r.case != "sinks_causal")


def test_the_dropout_probe_reads_flash_libs_own_mask():
    """The mask the dropout case reads off flash_lib's output (q = 0, v = identity) is exactly
    flash_lib.dropout_keep's, at the default tiles and at the others the case tries."""
    ctx = _Context(functools.partial(flash_lib.flash_attention, return_lse=True),
                   flash_check.CASES["dropout"], "float32", ALL + TRAINING, -np.inf, 0, {})
    probe = training._Dropout(ctx, flash_check.Result("dropout", "float32"))
    expected = flash_lib.dropout_keep(probe.seed, probe.p, probe.batch + (probe.n_q, probe.n_k))
    assert np.array_equal(probe.keep("keep values"), expected)
    for block_q, block_k in training.DROPOUT_BLOCKS:
        assert np.array_equal(probe.keep("keep values", block_q=block_q, block_k=block_k),
                              expected)
    assert not probe.result.failures


def test_the_lag_classes_hold_each_element_once():
    """The derivation of training._half_width splits the pairs (x, x + L) into two classes by the
    parity of x // L, in each of which no element appears twice (so its indicators are
    independent for a correct generator): checked pair by pair, with the classes' sizes."""
    for length, lag in [(160, 1), (160, 7), (160, 32), (144, 64), (160, 128), (144, 143)]:
        classes = {0: [], 1: []}
        for x in range(length - lag):
            classes[x // lag % 2] += [x, x + lag]
        for members in classes.values():
            assert len(members) == len(set(members)), (length, lag)
        assert training._lag_classes(length, lag) == (len(classes[0]) // 2,
                                                      len(classes[1]) // 2)


def test_the_dropout_bound_is_the_derived_one():
    """The half-width is the root of the Bernstein tail Σ_c 2 exp(-n_c t² / (2σ² + 2t/3)) =
    FALSE_ALARM / m over the case's m comparisons; on 20 masks of a correct generator no
    comparison fails; and the interval is 7 to 10 standard deviations of the real spread of the
    agreement of neighbouring keys, measured over 2000 masks: wide enough never to fail a
    correct generator (a normal approximation at the same family-wise rate would take 6.5), not
    so wide that a correlation of a few percent goes unseen."""
    p = training.DROPOUT_P
    batch, n_q, n_k = training.DROPOUT_SHAPE
    rng = np.random.default_rng(5)
    masks = rng.random((21,) + batch + (n_q, n_k)) >= p
    comparisons = [training._comparisons(masks[i], masks[i + 1], p) for i in range(20)]
    assert max(c.z for found in comparisons for c in found) < 1
    first = comparisons[0]
    m = len(first)
    assert m == 1 + len(training.ROW_SHIFTS) + (training.MAX_LAG - 1) + training.MAX_LAG + 6 + 1
    for c in first:
        tail = sum(2 * np.exp(-n * c.half ** 2 / (2 * c.variance + 2 * c.half / 3))
                   for n in c.sizes if n)
        assert tail == pytest.approx(training.FALSE_ALARM / m, rel=1e-6), c
    agree = np.concatenate([np.mean((lambda x: x[..., 1:] == x[..., :-1])(
        rng.random((100, n_q, n_k)) >= p), axis=(1, 2)) for _ in range(20)])
    half = next(c.half for c in first if c.what == "keys" and c.lag == 1)
    assert 7 < half / agree.std() < 10, half / agree.std()


def _dense_dropout(keep_of, *, rescale=True, renormalise=False, kept_lse=False,
                   backward_rescale=True, backward_keep=True):
    """A dense kernel with dropout and its backward, the mask from ``keep_of(seed, p, shape)``;
    the switches plant one mistake each. Returns (kernel, backward)."""
    def scores(q, k, scale):
        scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
        return q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64) * scale, scale

    def kernel(q, k, v, *, dropout_p=0.0, dropout_seed=None, scale=None):
        s, _ = scores(q, k, scale)
        keep = keep_of(dropout_seed, dropout_p, s.shape)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        kept = np.where(keep, e, 0)
        l = (kept if renormalise else e).sum(axis=-1, keepdims=True)
        out = (kept / l / ((1 - dropout_p) if rescale and not renormalise else 1)) @ v
        lse = np.log((kept if kept_lse else e).sum(axis=-1)) + s.max(axis=-1)
        return out.astype(q.dtype), lse.astype(q.dtype)

    def backward(q, k, v, out, lse, dout, *, dropout_p=0.0, dropout_seed=None, scale=None):
        s, scale = scores(q, k, scale)
        p = np.exp(s - lse[..., None].astype(np.float64))
        keep = keep_of(dropout_seed, dropout_p, s.shape) if backward_keep else True
        z = np.where(keep, 1 / (1 - dropout_p) if backward_rescale else 1, 0)
        dout = dout.astype(np.float64)
        dv = np.swapaxes(p * z, -1, -2) @ dout
        ds = p * ((dout @ np.swapaxes(v, -1, -2)) * z - (dout * out).sum(-1, keepdims=True))
        return tuple(g.astype(q.dtype) for g in (ds @ k * scale,
                                                  np.swapaxes(ds, -1, -2) @ q * scale, dv))

    return kernel, backward


def _philox_per_row(seed, p, shape):
    """The issue's trap: one NumPy Philox stream per row, started at counter=[row, 0, 0, 0]
    (and one key per batch element): row i + 1's numbers are row i's, 4 on."""
    batch, (n_q, n_k) = shape[:-2], shape[-2:]
    rows = [np.random.Generator(np.random.Philox(key=[seed, b], counter=[r, 0, 0, 0])).random(n_k)
            for b in range(int(np.prod(batch))) for r in range(n_q)]
    return np.reshape(rows, shape) >= p


def _counter(seed, p, shape):
    b = bugs._batch_index(shape[:-2])
    return bugs.counter_keep(seed, p, b, np.arange(shape[-2])[:, None],
                             np.arange(shape[-1])[None, :])


DROPOUT_MISTAKES = {
    # name: (the kernel and backward, the check that fails, words of its diagnosis)
    "correct": (_dense_dropout(_counter), None, None),
    "one Philox stream per row": (_dense_dropout(_philox_per_row), "independent rows",
                                  "row i + 1's keep mask is row i's shifted by 4 keys"),
    "keeps with probability p": (_dense_dropout(lambda s, p, shape: ~_counter(s, p, shape)),
                                 "keep rate", "keeps with probability p = 0.3, not 1 - p"),
    "heads share a mask": (_dense_dropout(lambda s, p, shape: np.broadcast_to(
        _counter(s, p, shape[-2:]), shape)), "independent batch",
        "the mask ignores the batch and head indices: every element draws the same mask"),
    "seed ignored": (_dense_dropout(lambda s, p, shape: _counter(7, p, shape)),
                     "independent seed", "the mask does not follow dropout_seed"),
    "renormalised": (_dense_dropout(_counter, renormalise=True), "keep values",
                     "renormalised to sum to 1"),
    "lse of the kept scores": (_dense_dropout(_counter, kept_lse=True), "lse error",
                               "the lse is that of the kept scores only"),
    "backward ignores dropout": (_dense_dropout(_counter, backward_keep=False,
                                                backward_rescale=False),
                                 "backward mask", "the backward ignores dropout"),
    "backward omits 1/(1-p)": (_dense_dropout(_counter, backward_rescale=False), "backward mask",
                               "the backward omits 1/(1 - p)"),
}


@pytest.mark.parametrize("mistake", DROPOUT_MISTAKES)
def test_dropout_mistakes_are_named(mistake):
    """Dense kernels with one dropout mistake each (the issue's overlapping Philox streams among
    them): the dropout case fails the right check with the right diagnosis; the correct one,
    with a mask of its own (not flash_lib's), passes."""
    (kernel, backward), check, words = DROPOUT_MISTAKES[mistake]
    report = flash_check.check_kernel(kernel, features=("lse", "dropout"), cases=["dropout"],
                                      backward=backward)
    if check is None:
        assert report.ok, str(report)
        assert "block sizes not checked (no block_q, block_k)" in report.results[0].note
        return
    failing = [f for f in report.failures if f.check == check]
    assert failing and all(words in f.diagnosis for f in failing), str(report)


def _keep_at(index):
    """flash_lib's keep mask drawn at the positions ``index(b, i, j)`` (of the probe's (batch,
    head) element, row, key) returns: the four broken masks of issue 33 item 4."""
    def keep_of(seed, p, shape):
        b, h, i, j = np.indices(shape, sparse=True)
        b, h, i, j = index(b, h, i, j)
        whole = flash_lib.dropout_keep(seed, p, shape)
        return whole[b, h, i, j]
    return keep_of


BROKEN_MASKS = {
    # name: (where the mask is drawn, the generic check and its words, the claimed check's words)
    "keyed by head only": (lambda b, h, i, j: (0 * b, h, i, j), "independent batch",
                           "the mask ignores the batch index: batches 0 and 1 draw the same mask "
                           "for each head",
                           "keyed by the head alone: the mask ignores the batch index"),
    "keys repeat every 32": (lambda b, h, i, j: (b, h, i, j % 32), "independent keys",
                             "the keep mask repeats along keys with period 32: a tile-local key "
                             "index, j mod 32",
                             "at (b, i, j mod 32): it repeats along keys with period 32, a "
                             "tile-local key index"),
    "keys repeat every 64": (lambda b, h, i, j: (b, h, i, j % 64), "independent keys",
                             "the keep mask repeats along keys with period 64: a tile-local key "
                             "index, j mod 64",
                             "at (b, i, j mod 64): it repeats along keys with period 64"),
    "rows repeat every 64": (lambda b, h, i, j: (b, h, i % 64, j), "independent rows",
                             "the keep mask repeats along rows with period 64: a tile-local row "
                             "index, i mod 64",
                             "at (b, i mod 64, j): it repeats along rows with period 64, a "
                             "tile-local row index"),
}


@pytest.mark.parametrize("mistake", BROKEN_MASKS)
@pytest.mark.parametrize("claim", [None, "flash_lib"], ids=["any generator", "flash_lib's"])
def test_broken_dropout_masks_are_named(mistake, claim):
    """Exact (P∘Z/(1 - p))·V kernels whose mask Z is flash_lib's drawn at the wrong positions:
    the batch index ignored, keys or rows repeating with a tile's period. Their keep rate is
    right and neighbours look independent; the comparisons at every lag up to 128 (any
    generator) or against flash_lib.dropout_keep pair for pair (a kernel that claims it) fail,
    with the index named, and nothing else does."""
    index, check, words, claimed_words = BROKEN_MASKS[mistake]
    kernel, _ = _dense_dropout(_keep_at(index))
    report = flash_check.check_kernel(kernel, features=("lse", "dropout"), cases=["dropout"],
                                      dropout_generator=claim)
    (failure,) = report.failures
    if claim is None:
        assert failure.check == check and words in failure.diagnosis, str(report)
    else:
        assert failure.check == "generator", str(report)
        assert failure.diagnosis.startswith(
            f"the keep mask is flash_lib.dropout_keep's {claimed_words}"), failure.diagnosis


def test_correct_dropout_passes_with_and_without_a_claim():
    """flash_lib's kernel passes both ways, its mask flash_lib.dropout_keep's at every pair; the
    bug zoo's, whose generator is its own, passes the statistics and fails the claim, told that
    its numbers are not flash_lib's."""
    kernel = functools.partial(flash_lib.flash_attention, return_lse=True)
    for claim in (None, "flash_lib", flash_lib.dropout_keep):
        report = flash_check.check_kernel(kernel, features=("lse", "dropout"), cases=["dropout"],
                                          backward=flash_lib.flash_attention_backward,
                                          dropout_generator=claim)
        assert report.ok, str(report)
        note = report.results[0].note
        assert ("rows and keys compared at lags 1 ... 128" if claim is None else
                "the mask is flash_lib.dropout_keep's at every pair") in note, note
    assert flash_check.check_kernel(variant_attention, features=("lse", "dropout"),
                                    cases=["dropout"]).ok
    report = flash_check.check_kernel(variant_attention, features=("lse", "dropout"),
                                      cases=["dropout"], dropout_generator="flash_lib")
    assert [f.check for f in report.failures] == ["generator"], str(report)
    assert "does not draw flash_lib.dropout_keep's numbers" in report.failures[0].diagnosis


def _right_on_the_probe(mistaken):
    """A kernel right on the dropout probe (q = 0) and ``mistaken`` on any other q: the probe's
    checks pass, so the output on random inputs is the first to fail."""
    right, _ = _dense_dropout(_counter)
    return lambda q, k, v, **kw: (right if not q.any() else mistaken)(q, k, v, **kw)


OUTPUT_MISTAKES = {
    # name: (the mistaken kernel, words of the out error's diagnosis)
    "no rescale": (_dense_dropout(_counter, rescale=False)[0], "the output is (P∘Z)·V"),
    "renormalised": (_dense_dropout(_counter, renormalise=True)[0],
                     "the output is softmax over the kept keys"),
    "undropped": (lambda q, k, v, dropout_p, **kw: _dense_dropout(_counter)[0](q, k, v, **kw),
                  "the output is attention without dropout on these inputs"),
    "none of these": (lambda q, k, v, **kw: tuple(1.01 * x for x in
                                                  _dense_dropout(_counter)[0](q, k, v, **kw)),
                      "the mask depends on q, k or v"),
}


@pytest.mark.parametrize("mistake", OUTPUT_MISTAKES)
def test_dropout_output_mistakes_are_named(mistake):
    """Each row of training.DROPOUT_OUT, by what its mistake returns on the random inputs."""
    mistaken, words = OUTPUT_MISTAKES[mistake]
    report = flash_check.check_kernel(_right_on_the_probe(mistaken), features=("lse", "dropout"),
                                      cases=["dropout"])
    failing = [f for f in report.failures if f.check == "out error"]
    assert failing and words in failing[0].diagnosis, str(report)


SINK_MISTAKES = {
    # name: (what the kernel does to the sinks before flash_lib sees them, case, words)
    "scaled": (lambda sinks, kw: sinks / 4, "sinks", "the sink is multiplied by the scale"),
    "softcapped": (lambda sinks, kw: 3 * np.tanh(sinks / 3) if "softcap" in kw else sinks,
                   "sinks_softcap", "the sink is softcapped"),
    "sign flipped": (lambda sinks, kw: -sinks, "sinks", "the sink's sign is flipped"),
    "ignored": (lambda sinks, kw: None, "sinks", "the sinks are ignored"),
}


@pytest.mark.parametrize("mistake", SINK_MISTAKES)
def test_sink_mistakes_are_named(mistake):
    change, case, words = SINK_MISTAKES[mistake]

    def kernel(q, k, v, *, sinks=None, **kwargs):
        return flash_lib.flash_attention(q, k, v, sinks=change(np.asarray(sinks), kwargs),
                                         return_lse=True, **kwargs)

    report = flash_check.check_kernel(kernel, features=ALL + VARIANTS, cases=[case])
    assert report.failed_cases() == [case], str(report)
    assert all(words in f.diagnosis for f in report.failures if f.check == "out error"), (
        diagnoses(report))


def test_an_empty_rows_lse_that_is_not_the_sink_is_named():
    """A kernel whose empty-row guard overrides the sink (lse -inf where no key is allowed)."""
    def kernel(q, k, v, **kwargs):
        out, lse = flash_lib.flash_attention(q, k, v, return_lse=True, **kwargs)
        _, bare = flash_lib.flash_attention(q, k, v, return_lse=True,
                                            **{**kwargs, "sinks": None})
        return out, np.where(bare == -np.inf, -np.inf, lse)

    report = flash_check.check_kernel(kernel, features=ALL + VARIANTS,
                                      cases=["sinks_empty_rows", "sinks_causal"])
    assert set(report.failed_cases()) == {"sinks_empty_rows", "sinks_causal"}, str(report)
    assert {f.check for f in report.failures} == {"lse non-finite"}, str(report)
    assert all("with a sink no row is empty" in f.diagnosis for f in report.failures)


def test_backward_must_be_callable():
    with pytest.raises(TypeError, match="backward must be callable or None"):
        flash_check.check_kernel(flash_lib.flash_attention, backward="flash_lib.backward")


# --- the command line -----------------------------------------------------------------------


def _cli(tmp_path, *args):
    (tmp_path / "kernels_under_test.py").write_text(
        "import functools\nimport flash_lib\n"
        "good = functools.partial(flash_lib.flash_attention, return_lse=True)\n"
        "def base2(q, k, v, **kw):\n"
        "    out, lse = flash_lib.flash_attention(q, k, v, **kw, return_lse=True)\n"
        "    return out, lse * 1.4426950408889634\n"
        "def flipped(*args, **kw):\n"
        "    *grads, dsinks = flash_lib.flash_attention_backward(*args, **kw)\n"
        "    return (*grads, -dsinks)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    return subprocess.run([sys.executable, "-m", "flash_check", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_passes_a_good_kernel_and_fails_a_bad_one(tmp_path):
    good = _cli(tmp_path, "kernels_under_test:good", "--dtypes", "float32",
                "--cases", "random", "causal_wide", "empty_rows")
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.splitlines()[-1] == "PASS: 3 of 3 case runs passed, 0 skipped"
    bad = _cli(tmp_path, "kernels_under_test:base2", "--features", "lse", "--dtypes", "float64",
               "--cases", "random", "empty_rows")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "lse is in log base 2" in bad.stdout
    assert "empty_rows: needs feature 'mask'" in bad.stdout
    grads = _cli(tmp_path, "kernels_under_test:good", "--features", "lse", "sinks",
                 "--dtypes", "float64", "--cases", "sinks", "--backward",
                 "kernels_under_test:flipped")
    assert grads.returncode == 1, grads.stdout + grads.stderr
    assert "dsinks has the wrong sign" in grads.stdout
    claimed = _cli(tmp_path, "kernels_under_test:good", "--features", "lse", "dropout",
                   "--dtypes", "float32", "--cases", "dropout", "--dropout-generator", "flash_lib")
    assert claimed.returncode == 0, claimed.stdout + claimed.stderr
    assert "the mask is flash_lib.dropout_keep's at every pair" in claimed.stdout


def test_cli_rejects_what_it_cannot_load(tmp_path):
    for target, words in (("kernels_under_test", "expected package.module:function"),
                          ("kernels_under_test:missing", "cannot load the kernel"),
                          ("no_such_module:f", "cannot load the kernel")):
        run = _cli(tmp_path, target)
        assert run.returncode == 2 and words in run.stderr, (target, run.stderr)
    run = _cli(tmp_path, "kernels_under_test:good", "--features", "windw")
    assert run.returncode == 2 and "unknown" in run.stderr
    run = _cli(tmp_path, "kernels_under_test:good", "--features", "dropout",
               "--dropout-generator", "kernels_under_test:nothing")
    assert run.returncode == 2 and "its dropout generator" in run.stderr, run.stderr


# --- the package imports one way -----------------------------------------------------------


def _package_imports():
    """Each flash_check module's imports of the package, read from its source: ``{module:
    {module it imports: names it takes from it}}``, and the imports of the package that stand
    anywhere but at the module's head (a function's body, below the first definition)."""
    package = ROOT / "flash_check"
    modules = {path.stem for path in package.glob("*.py")}
    graph, misplaced = {}, []
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        body = tree.body[1:] if ast.get_docstring(tree) is not None else tree.body
        head = list(itertools.takewhile(lambda n: isinstance(n, (ast.Import, ast.ImportFrom)),
                                        body))
        edges = graph[path.stem] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = [(alias.name.partition(".")[2] or "__init__", None)
                         for alias in node.names if alias.name.split(".")[0] == "flash_check"]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:  # relative: from . import x, from .x import y
                    module = "flash_check" + ("." + module if module else "")
                if module.split(".")[0] != "flash_check":
                    continue
                target = module.partition(".")[2]
                found = [(target, alias.name) if target else
                         (alias.name, None) if alias.name in modules else ("__init__", alias.name)
                         for alias in node.names]
            else:
                continue
            for target, name in found:
                edges.setdefault(target, set()).update([name] if name else [])
            if found and node not in head:
                misplaced.append(f"{path.name}:{node.lineno}")
    return graph, misplaced


def _private_module(name):
    return name.startswith("_") and not name.startswith("__")


def test_flash_check_imports_one_way():
    """The package's modules form layers: _core at the bottom imports none of the others, no
    module imports one that imports it back (directly or through others), every import of the
    package stands at its module's head (none in a function or below the code, where a cycle
    hides), and a private name (_x) comes only from a private module below (_core, _runner)."""
    graph, misplaced = _package_imports()
    assert not misplaced, f"imports of flash_check outside a module's head: {misplaced}"
    assert graph["_core"] == {}, graph["_core"]
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"flash_check imports itself in a loop: {' -> '.join(exc.args[1])}")
    # __init__ re-exports from the modules below it; only __main__ (python -m) stands above it
    above = {module for module, edges in graph.items() if {"__init__", "__main__"} & set(edges)}
    assert above == {"__main__"}, above
    private = [f"{module} takes {name} from {target}" for module, edges in graph.items()
               for target, names in edges.items() for name in names
               if name.startswith("_") and not _private_module(target)]
    assert not private, private


# --- real kernels ---------------------------------------------------------------------------

HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_JAX = importlib.util.find_spec("jax") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (`make setup` "
                                 "installs it)")
needs_jax = pytest.mark.skipif(not HAVE_JAX, reason="JAX is not installed (the jax extra: "
                               "pip install -e '.[jax]')")


def real_kernels():
    """The README's results table: (label, kernel, features, lse_empty) for what is installed."""
    kernels = [("flash_lib.flash_attention", functools.partial(flash_lib.flash_attention,
                                                               return_lse=True), ALL, -np.inf)]
    if HAVE_TORCH:
        kernels += [
            ("torch SDPA, math, causal_lower_right", flash_check.torch_sdpa("math"),
             ("mask", "causal", "dv"), -np.inf),
            ("torch SDPA, flash, causal_lower_right", flash_check.torch_sdpa("flash"),
             ("mask", "causal"), -np.inf),
            ("torch SDPA, math, is_causal=True",
             flash_check.torch_sdpa("math", causal_alignment="top-left"),
             ("mask", "causal", "dv"), -np.inf),
            ("torch _scaled_dot_product_flash_attention_for_cpu, with lse",
             flash_check.torch_flash_for_cpu_with_lse, ("mask", "causal", "lse"), 0.0),
        ]
    if HAVE_JAX:
        kernels += [
            ("jax.nn.dot_product_attention, bottom-right mask",
             flash_check.jax_dot_product_attention(), ("mask", "causal"), -np.inf),
            ("jax.nn.dot_product_attention, is_causal=True",
             flash_check.jax_dot_product_attention(causal_alignment="top-left"),
             ("mask", "causal"), -np.inf),
        ]
    return kernels


#: XLA compiles JAX's kernel for every new shape and dtype (about a second each here): JAX runs
#: these cases only, in float64 and float32, as the README's table says.
JAX_CASES = {"jax.nn.dot_product_attention, bottom-right mask": ("random", "empty_rows"),
             "jax.nn.dot_product_attention, is_causal=True": ("causal_wide",)}
JAX_DTYPES = {"jax.nn.dot_product_attention, bottom-right mask": ("float64", "float32"),
              "jax.nn.dot_product_attention, is_causal=True": ("float32",)}


@functools.lru_cache(maxsize=None)
def real_reports():
    reports = {}
    for label, fn, features, lse_empty in real_kernels():
        subset = ({"cases": JAX_CASES[label], "dtypes": JAX_DTYPES[label]}
                  if label in JAX_CASES else {})
        reports[label] = flash_check.check_kernel(fn, features=features, lse_empty=lse_empty,
                                                  **subset)
    return reports


def results_row(report):
    """One row of the README table: the failing cases in each dtype, "pass", or "not run"."""
    return ["not run" if failed is None else ", ".join(failed) or "pass"
            for failed in report.by_dtype().values()]


def torch_vectorizes():
    """Whether PyTorch runs its AVX2 or AVX-512 code (ATEN_CPU_CAPABILITY can choose another)."""
    import torch

    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


#: What a README cell may add after "; " to the cases that fail on every CPU: failures of one
#: check that depend on the CPU, and the CPUs on which most of the dtype's other cases have them.
#: PyTorch's CPU flash op computes exp(s - m), for float16 inputs, to within about 1e-4 in its
#: vector loop (its weights are stored in float16) and exactly past the last full vector of a
#: 512-key block, and sums those weights for the lse: so its float16 lse fails on the cases whose
#: top keys that loop handles, which depends on the vector width (late_max: fails with AVX2's 8
#: lanes, passes with AVX-512's 16), and on none in its scalar build.
CPU_DEPENDENT = {"on AVX2 and AVX-512 CPUs also the lse error of most other cases "
                 "(which ones depends on the CPU: below)": ("lse error", torch_vectorizes)}


@needs_torch
def test_torch_sdpa_bottom_right_passes_all_but_masked_garbage():
    """Garbage reaches rows that may not attend it, through v (0 · inf in P·V) and through k (the
    boolean mask becomes an additive -inf, and NaN + (-inf) = NaN)."""
    reports = real_reports()
    for label in ("torch SDPA, math, causal_lower_right", "torch SDPA, flash, causal_lower_right"):
        report = reports[label]
        assert report.failed_cases() == list(NONFINITE), str(report)
        assert "0 · inf = NaN in P·V" in diagnoses(report)
        assert ("batch 3, rows 0–60, 62–95 from key 70 (k NaN; masked for them; row 61 attends "
                "it)" in diagnoses(report, "partial_nonfinite"))


@needs_torch
def test_torch_is_causal_is_flagged_top_left():
    report = real_reports()["torch SDPA, math, is_causal=True"]
    assert {"decode", "causal_wide", "causal_tall", "causal_and_mask"} <= set(
        report.failed_cases()), str(report)
    assert "causal_square" not in report.failed_cases()  # Nq = Nk: the conventions agree
    for case in ("decode", "causal_wide", "causal_tall"):
        assert "causal is aligned top-left" in diagnoses(report, case)


@needs_torch
def test_torch_cpu_flash_op_lse():
    """Its lse of an empty row is 0.0; its float16 lse is less exact than float32 arithmetic
    where its vector loops run (which cases fail depends on the CPU: see CPU_DEPENDENT)."""
    report = real_reports()["torch _scaled_dot_product_flash_attention_for_cpu, with lse"]
    assert set(NONFINITE) <= set(report.failed_cases())
    other = [f for f in report.failures if f.case not in NONFINITE]
    assert {(f.dtype, f.check) for f in other} <= {("float16", "lse error")}, str(report)
    if torch_vectorizes():
        assert other and "in float16 only" in other[0].diagnosis, str(report)


@needs_jax
def test_jax_empty_rows_get_uniform_weights_and_float64_is_float32():
    report = real_reports()["jax.nn.dot_product_attention, bottom-right mask"]
    assert "uniform weights" in diagnoses(report, "empty_rows")
    float64 = [f for f in report.failures if f.dtype == "float64" and f.check == "out error"]
    assert {f.case for f in float64} == {"random", "empty_rows"}, str(report)
    assert all("only as accurate as float32" in f.diagnosis for f in float64), str(report)
    float32 = {(f.case, f.check) for f in report.failures if f.dtype == "float32"}
    assert float32 == {("empty_rows", "empty rows")}, str(report)


@needs_jax
def test_jax_is_causal_is_flagged_top_left():
    report = real_reports()["jax.nn.dot_product_attention, is_causal=True"]
    assert "causal is aligned top-left" in diagnoses(report, "causal_wide")


def test_readme_results_table_matches_what_the_checks_find():
    """Every row of the README's table for an installed kernel is what check_kernel finds now.

    A cell lists the cases that fail on every CPU; where it adds, after "; ", one of
    CPU_DEPENDENT's notes, the other failures in that dtype must be of that note's check only,
    and on the CPUs the note names they must be most of the dtype's other cases.
    """
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Checking a kernel", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 4:
            rows[cells[0].strip("`")] = [c.replace("`", "") for c in cells[1:4]]
    labels = [label for label, *_ in real_kernels()]
    assert set(labels) <= set(rows), sorted(set(labels) - set(rows))
    for label in labels:
        report = real_reports()[label]
        for dtype, cell, found in zip(flash_check.DTYPES, rows[label], results_row(report)):
            everywhere, _, note = cell.partition("; ")
            if not note:
                assert cell == found, (label, dtype, found)
                continue
            assert note in CPU_DEPENDENT, (label, dtype, note)
            check, on_these_cpus = CPU_DEPENDENT[note]
            results = [r for r in report.results if r.dtype == dtype]
            failed = [r.case for r in results if not r.ok]
            listed = everywhere.split(", ")
            assert [c for c in failed if c in listed] == listed, (label, dtype, failed)
            extra = [r for r in results if not r.ok and r.case not in listed]
            assert all({f.check for f in r.failures} == {check} for r in extra), (
                label, dtype, [(r.case, [f.check for f in r.failures]) for r in extra])
            if on_these_cpus():
                assert len(extra) > (len(results) - len(listed)) / 2, (label, dtype, failed)

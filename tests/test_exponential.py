"""The kernels' exponential: e^x, or 2^(x·log2 e) with x in nats (issues 21 and 33).

``flash_lib.exponential(dtype)`` is chosen from the loops NumPy dispatches to; the rest of the
suite runs whichever this machine chose, so every test here runs both bases
(``flash_lib.use_exponential``), on any CPU: the base-2 path is tested on an AVX2 machine too.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import assert_close_to_naive, gradient_bounds, random_qkv, rowwise_rel_error

import flash_lib
from flash_lib import (flash_attention, flash_attention_backward, naive_attention,
                       naive_attention_backward, precise_attention, precise_attention_backward)

BASES = ("exp", "exp2")


@pytest.fixture(params=BASES)
def base(request):
    """Run the test with the kernels in base e, then in base 2 (both dtypes)."""
    with flash_lib.use_exponential(request.param):
        yield request.param


def chosen_in_a_fresh_process(**environ):
    """``flash_lib.exponential``'s names for float32 and float64 in a new interpreter started
    with ``environ`` added (NumPy and flash_lib read theirs at import)."""
    code = ("import numpy as np, flash_lib; "
            "print(flash_lib.exponential(np.float32).__name__, "
            "flash_lib.exponential(np.float64).__name__)")
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **environ),
                          capture_output=True, text=True, check=True)
    return done.stdout.split()


def exp2_loop(char):
    """NumPy's own word for the loop it runs for exp2 on dtype ``char`` (e.g. "X86_V4")."""
    from numpy.lib.introspect import opt_func_info

    return opt_func_info(func_name="^exp2$")["exp2"][char * 2]["current"]


# ---------------------------------------------------------------------------------------------
# The choice
# ---------------------------------------------------------------------------------------------


def test_the_choice_is_numpys_avx512_exp2_loop_for_float32_and_exp_for_float64():
    """auto: exp2 for float32 (and half precision, computed in float32) exactly where NumPy
    reports an AVX-512 loop for it; float64 keeps exp everywhere (exp2 gained nothing
    measurable there). Read here from NumPy's table, not from flash_lib's code."""
    avx512 = exp2_loop("f").startswith(("X86_V4", "AVX512"))
    expected = np.exp2 if avx512 else np.exp
    with flash_lib.use_exponential("auto"):
        assert flash_lib.exponential(np.float32) is expected
        assert flash_lib.exponential(np.float16) is expected
        assert flash_lib.exponential(np.float64) is np.exp


@pytest.mark.parametrize("disabled, float32_exp", [
    ("", None),  # this CPU's own loops: whatever NumPy reports
    ("X86_V4 AVX512_ICL AVX512_SPR", np.exp),  # AVX2 loops: float32's exp2 is scalar there
    ("X86_V3 X86_V4 AVX512_ICL AVX512_SPR", np.exp),  # baseline
])
def test_a_process_with_numpys_avx512_loops_off_chooses_exp(disabled, float32_exp):
    """The choice follows NumPy's dispatch in a fresh process (NPY_DISABLE_CPU_FEATURES is read
    at import): with the AVX-512 loops off, exp for both dtypes."""
    if os.environ.get("FLASH_LIB_EXP", "auto") != "auto":
        pytest.skip("FLASH_LIB_EXP forces the choice in this run")
    float32, float64 = chosen_in_a_fresh_process(NPY_DISABLE_CPU_FEATURES=disabled)
    assert float64 == "exp"
    if float32_exp is None:
        avx512 = exp2_loop("f").startswith(("X86_V4", "AVX512"))
        float32_exp = np.exp2 if avx512 else np.exp
    assert float32 == float32_exp.__name__


@pytest.mark.parametrize("value, chosen", [("exp", "exp exp"), ("exp2", "exp2 exp2")])
def test_flash_lib_exp_forces_one_for_both_dtypes(value, chosen):
    assert chosen_in_a_fresh_process(FLASH_LIB_EXP=value) == chosen.split()


def test_a_bad_flash_lib_exp_is_refused_at_import_naming_it():
    env = dict(os.environ, FLASH_LIB_EXP="e")
    done = subprocess.run([sys.executable, "-c", "import flash_lib"], env=env,
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert "ValueError: FLASH_LIB_EXP must be one of auto, exp, exp2, got 'e'" in done.stderr


def test_use_exponential_holds_for_its_context_only_and_refuses_a_bad_name():
    import threading

    before = (flash_lib.exponential(np.float32), flash_lib.exponential(np.float64))
    seen = []
    with flash_lib.use_exponential("exp2"):
        assert flash_lib.exponential(np.float64) is np.exp2
        with flash_lib.use_exponential("exp"):
            assert flash_lib.exponential(np.float32) is np.exp
        assert flash_lib.exponential(np.float32) is np.exp2
        other = threading.Thread(target=lambda: seen.append(flash_lib.exponential(np.float64)))
        other.start()
        other.join()
    assert seen == [before[1]]  # a new thread starts at the default
    assert (flash_lib.exponential(np.float32), flash_lib.exponential(np.float64)) == before
    with pytest.raises(ValueError, match=r"^use_exponential\(name\): name must be one of auto, "
                                         r"exp, exp2, got 'base2'$"):
        with flash_lib.use_exponential("base2"):
            pass


# ---------------------------------------------------------------------------------------------
# Both bases: exact, forward and backward, with every feature
# ---------------------------------------------------------------------------------------------

FEATURES = {
    "plain": {},
    "causal, mask": {"causal": True, "mask": "random"},
    "softcap": {"softcap": 3.0},
    "alibi": {"alibi_slopes": np.array([0.5, 0.125]), "causal": True},
    "sinks": {"sinks": np.array([1.5, -0.75])},
    "dropout": {"dropout_p": 0.2, "dropout_seed": 5},
    "window": {"window": (9, 3)},
}


def problem(dtype, feature, seed=3):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 37, 45, 16, dv=7, batch=(2,), dtype=dtype)
    dout = rng.standard_normal((2, 37, 7)).astype(dtype)
    kw = dict(FEATURES[feature])
    if kw.get("mask") == "random":
        kw["mask"] = rng.random((37, 45)) < 0.6
    return (q, k, v, dout), kw


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_each_base_agrees_with_naive_forward_and_backward(base, dtype, feature):
    """out and lse within the suite's tolerance of naive's (which is always base e), and the
    gradients (dsinks too) within 64 eps of naive's, relative to each gradient's size."""
    (q, k, v, dout), kw = problem(dtype, feature)
    out, lse = flash_attention(q, k, v, return_lse=True, block_q=8, block_k=16, **kw)
    ref_out, ref_lse = naive_attention(q, k, v, return_lse=True, **kw)
    assert_close_to_naive(out, lse, ref_out, ref_lse, v, dtype)
    got = flash_attention_backward(q, k, v, out, lse, dout, block_q=8, block_k=16, **kw)
    want = naive_attention_backward(q, k, v, dout, **kw)
    eps = np.finfo(dtype).eps
    for g, w in zip(got, want):
        scale = max(float(np.abs(w).max()), 1e-300)
        assert np.abs(g.astype(np.float64) - w).max() <= 64 * eps * scale


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_base_2_is_really_base_2_and_as_close_to_the_truth(dtype, monkeypatch):
    """Forced exp2, the kernels compute e^x as 2^(x·log2 e) (``flash_lib.exp_as_exp2``, seen
    from inside the recurrence) and their bits differ from base e's; both are within 16 eps of
    the truth, row by row."""
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 200, 300, 32, dv=16, batch=(2,), dtype=dtype)
    truth, truth_lse = precise_attention(q, k, v, return_lse=True, causal=True)
    outs, seen = {}, []
    update = flash_lib.online_softmax_update

    def watching(m, l, acc, s, v, matmul, exp, threshold):
        seen.append(exp)
        return update(m, l, acc, s, v, matmul, exp, threshold)

    monkeypatch.setattr(flash_lib, "online_softmax_update", watching)
    for name in BASES:
        seen.clear()
        with flash_lib.use_exponential(name):
            outs[name] = flash_attention(q, k, v, return_lse=True, causal=True, block_q=64,
                                         block_k=64)
        assert set(seen) == {{"exp": np.exp, "exp2": flash_lib.exp_as_exp2}[name]}
        out, lse = outs[name]
        assert rowwise_rel_error(out, truth) <= 16 * np.finfo(dtype).eps
        assert np.abs(lse - truth_lse).max() <= 16 * np.finfo(dtype).eps * np.abs(truth_lse).max()
    assert not np.array_equal(outs["exp"][0], outs["exp2"][0])


def test_base_2_gradients_within_the_derived_bound_of_the_truth():
    """float64, forced exp2: dq, dk, dv against the longdouble truth, within the derived
    per-entry bound (``helpers.gradient_bounds``, built for base e: base 2 adds two roundings of
    each exponent, inside its (d + dv + N + 4)·u allowance)."""
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 70, 90, 16, dv=8)
    dout = rng.standard_normal((70, 8))
    with flash_lib.use_exponential("exp2"):
        out, lse = flash_attention(q, k, v, return_lse=True, causal=True, block_q=16, block_k=32)
        got = flash_attention_backward(q, k, v, out, lse, dout, causal=True, block_q=16,
                                       block_k=32)
    truth = precise_attention_backward(q, k, v, dout, causal=True)
    allowed = flash_lib.causal_mask(70, 90)
    bounds = gradient_bounds(q, k, v, dout, 1 / 4, allowed)
    for g, t, b in zip(got, truth, bounds):
        assert np.all(np.abs(g - t) <= b)


# ---------------------------------------------------------------------------------------------
# Where base 2 could change the answer: overflow, NaN, the sink's exact lse
# ---------------------------------------------------------------------------------------------


def test_scores_beyond_max_over_log2e_are_right_in_base_2(monkeypatch):
    """float32 scores of 2.56e38 and 2.72e38 are finite, but times log2(e) they would overflow
    (inf - inf = NaN in a kernel that scaled the scores). Base 2 multiplies only s - m by
    log2(e), in nats: forced exp2, the call stays in base 2 (seen from inside the recurrence)
    and gives base e's bits, with no warning; scores a thousand times smaller too."""
    q = np.array([[1.6e19]], np.float32)
    k = np.array([[1.6e19], [1.7e19]], np.float32)
    v = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    seen, update = [], flash_lib.online_softmax_update

    def watching(m, l, acc, s, v, matmul, exp, threshold):
        seen.append(exp)
        return update(m, l, acc, s, v, matmul, exp, threshold)

    monkeypatch.setattr(flash_lib, "online_softmax_update", watching)
    results = {}
    for name in BASES:
        with flash_lib.use_exponential(name):
            results[name] = flash_attention(q, k, v, scale=1.0, return_lse=True)
    assert seen == [np.exp, flash_lib.exp_as_exp2]
    for got, want in zip(results["exp2"], results["exp"]):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(results["exp2"][0], [[0.0, 1.0]])  # softmax([2.56, 2.72]e38)
    assert np.isfinite(results["exp2"][1]).all()
    seen.clear()
    with flash_lib.use_exponential("exp2"):
        out = flash_attention(q * 1e-3, k * 1e-3, v, scale=1.0)
    assert seen == [flash_lib.exp_as_exp2]
    np.testing.assert_array_equal(out, [[0.0, 1.0]])


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_a_nan_or_inf_input_does_not_move_the_other_rows_to_base_e(poison):
    """A NaN or inf in one row of q computes that row as IEEE says in either base, and the
    other rows keep their base-2 bits (no check of the values chooses the base)."""
    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, 12, 20, 8, dv=3)
    bad = q.copy()
    bad[5, 2] = poison
    with flash_lib.use_exponential("exp2"):
        clean = flash_attention(q, k, v, block_q=4, block_k=8)
        out = flash_attention(bad, k, v, block_q=4, block_k=8)
    np.testing.assert_array_equal(np.delete(out, 5, 0), np.delete(clean, 5, 0))
    with flash_lib.use_exponential("exp"):
        assert not np.array_equal(clean, flash_attention(q, k, v, block_q=4, block_k=8))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_row_its_keys_add_nothing_to_keeps_lse_equal_to_the_sink(base, dtype):
    """With a sink, a row with no allowed key (or whose keys all underflow to 0 against the
    sink) has lse = sink exactly in both bases, not sink·log2(e)·ln(2) rounded."""
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 6, 5, 4, dv=2, batch=(3,), dtype=dtype)
    sinks = np.array([0.75, -1.5, 1 / 3])
    mask = np.ones((6, 5), bool)
    mask[2] = False  # row 2: no key
    k[..., 4, :] = 0  # key 4 scores 0 against every query ...
    mask[4] = [False] * 4 + [True]  # ... and is row 4's only key: its weight is e^(0 - sink)
    big = np.array([200.0, 200.0, 200.0]) if dtype == np.float32 else np.array([900.0] * 3)
    out, lse = flash_attention(q, k, v, mask=mask, sinks=sinks, return_lse=True)
    np.testing.assert_array_equal(lse[:, 2], sinks.astype(dtype))
    assert np.all(out[:, 2] == 0)
    # a sink so large that e^(0 - sink) underflows: the row's keys add nothing
    out, lse = flash_attention(q, k, v, mask=mask, sinks=big, return_lse=True)
    np.testing.assert_array_equal(lse[:, 4], big.astype(dtype))
    np.testing.assert_array_equal(lse[:, 2], big.astype(dtype))

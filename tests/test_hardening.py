"""Issue 23: nine ways the backward, the variants and flash_check broke their contracts, one test
(or more) per finding, then the fuzz that found them, as a hypothesis test.

1. softcap let masked NaN/inf into the gradients (0 · NaN from 1 - tanh² at masked pairs);
2. a softcap or ALiBi slope beyond float32 gave NaN output in float32/float16/bfloat16;
3. flash_attention_backward refused v or a mask with more batch dims than q·kᵀ;
4. enable_gqa crashed every kernel when the output was empty (Nq = 0 or dv = 0);
5. flash_check crashed on what a kernel returned or raised, and never checked the out dtype;
6. scalar parameters at the edge of the dtype gave RuntimeWarnings;
7. unclear errors for a Fraction scale, an int softcap of 10**400, a bfloat16 lse in merge;
8. ±inf in dout gave flash ±inf where the dense chain (naive, precise) gives NaN;
9. the bits depended on the memory layout of the inputs.
"""

import contextlib
import fractions
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
from helpers import BFLOAT16, GARBAGE, GRADIENTS_VS_NAIVE, VARIANTS, grads
from hypothesis import given, settings
from hypothesis import strategies as st

import flash_check
import flash_lib as fl

FORWARDS = (fl.flash_attention, fl.naive_attention, fl.precise_attention)


@contextlib.contextmanager
def strict():
    """Every warning an error: the kernels promise none on accepted inputs."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def same_bits(a, b):
    """Equal, NaN where NaN, and the same sign of every zero."""
    a, b = np.asarray(a), np.asarray(b)
    return (a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
            and np.array_equal(np.signbit(a), np.signbit(b)))


# ---------------------------------------------------------------------------------------------
# 1. softcap: masked NaN/inf stays out of the gradients, in every backward
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["flash", "naive", "precise"])
@pytest.mark.parametrize("poison", ["nan", "inf,-inf"])
def test_the_issues_softcap_reproducer(kernel, poison):
    """Only row 3 may attend key 3 (causal): its NaN (or inf, -inf) reaches dq row 3 only,
    as without softcap."""
    q, k, v = np.random.default_rng(0).standard_normal((3, 4, 2))
    k[3] = [np.nan, np.nan] if poison == "nan" else [np.inf, -np.inf]
    with strict():
        dq, _, _ = grads(kernel, q, k, v, np.ones((4, 2)), causal=True, softcap=2.0)
    np.testing.assert_array_equal(np.isfinite(dq).all(-1), [True, True, True, False])


@given(**{**GARBAGE, "poison": st.sampled_from([np.nan, np.inf, -np.inf]),
          "where": st.sampled_from(["k", "q"]),
          "kernel": st.sampled_from(["flash", "naive", "precise"]),
          "cap": st.sampled_from([0.5, 2.0])})
@settings(max_examples=120)
def test_softcap_keeps_garbage_at_masked_pairs_out_of_every_backward(
        n_q, n_k, block, causal, where, poison, data, kernel, cap):
    """test_backward's masked-garbage rule with softcap on, for flash, naive and precise: NaN
    or ±inf in a key no row may attend, or in a fully masked query row, leaves every gradient
    bit for bit what it is with that row 0 (a fully masked NaN row of q once made all of dk NaN)."""
    rng = np.random.default_rng(n_q * 13 + n_k)
    q, k, v = rng.standard_normal((3, max(n_q, n_k), 3))
    q, k, v, dout = q[:n_q], k[:n_k], v[:n_k, :2], rng.standard_normal((n_q, 2))
    mask = rng.random((n_q, n_k)) < 0.7
    row = data.draw(st.integers(0, (n_k if where == "k" else n_q) - 1))
    if where == "k":
        mask[:, row] = False
    else:
        mask[row] = False
    dirty, clean = dict(q=q.copy(), k=k.copy()), dict(q=q.copy(), k=k.copy())
    dirty[where][row, 0], clean[where][row, 0] = poison, 0
    kw = dict(mask=mask, causal=causal, softcap=cap, block_q=block, block_k=block)
    with strict():
        got = grads(kernel, dirty["q"], dirty["k"], v, dout, **kw)
    want = grads(kernel, clean["q"], clean["k"], v, dout, **kw)
    for g, w in zip(got, want):
        assert same_bits(g, w)


# ---------------------------------------------------------------------------------------------
# 2, 6, 7. Every scalar parameter checked against the compute dtype, by one checker
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32])
@pytest.mark.parametrize("kwargs, name", [(dict(softcap=1e39), "softcap"),
                                          (dict(alibi_slopes=1e39), "each of alibi_slopes"),
                                          (dict(alibi_slopes=np.array([1.0, -1e39])),
                                           "each of alibi_slopes")])
@pytest.mark.parametrize("kernel", FORWARDS)
def test_a_parameter_beyond_float32_is_refused_not_nan(dtype, kwargs, name, kernel):
    """float32 compute: softcap or a slope of 1e39 is inf there (then NaN output); refused,
    naming the argument, its value and float32's range."""
    q = np.ones((2, 3, 4), dtype)
    with strict(), pytest.raises(ValueError, match=f"^{re.escape(name)} = 1e\\+39 is outside "
                                                   f".*compute dtype float32"):
        kernel(q, q, q, **kwargs)


@pytest.mark.parametrize("dtype, kwargs, name, value", [
    (np.float64, dict(softcap=5e-324), "softcap", "5e-324"),
    (np.float32, dict(softcap=1e-40), "softcap", "1e-40"),
    (np.float64, dict(alibi_slopes=1e308), "each of alibi_slopes", "1e+308"),
])
def test_edge_parameters_are_refused_with_a_clear_error_not_a_warning(dtype, kwargs, name,
                                                                      value):
    """A subnormal softcap overflowed s / c, a slope of 1e308 overflowed slope · distance: both
    warned. Now a ValueError naming the argument, its value and the range."""
    q = np.ones((3, 4), dtype)
    for kernel in FORWARDS:
        with strict(), pytest.raises(ValueError, match=re.escape(f"{name} = {value} is outside")):
            kernel(q, q, q, **kwargs)


def test_a_small_normal_softcap_saturates_without_a_warning():
    """softcap = 1e-300 (normal) with scores of 1e10: s / c overflows to ±inf, whose tanh is
    ±1 exactly: c · sign(s), computed without a warning, the same in flash and naive."""
    rng = np.random.default_rng(1)
    q, k, v = 1e10 * rng.standard_normal((3, 5, 4))
    dout = rng.standard_normal((5, 4))
    with strict():
        out, lse = fl.flash_attention(q, k, v, softcap=1e-300, return_lse=True, block_k=2)
        ref, ref_lse = fl.naive_attention(q, k, v, softcap=1e-300, return_lse=True)
        g = grads("flash", q, k, v, dout, softcap=1e-300)
        ng = grads("naive", q, k, v, dout, softcap=1e-300)
    np.testing.assert_allclose(out, ref, rtol=1e-14)
    for a, b in zip(g, ng):
        assert np.isfinite(a).all() and np.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_a_fraction_scale_is_a_real_number():
    """scale = Fraction(1, 3) (a numbers.Real) once raised "ufunc 'isinf' not supported"."""
    q, k, v = np.random.default_rng(2).standard_normal((3, 4, 5))
    for kernel in FORWARDS:
        with strict():
            assert same_bits(kernel(q, k, v, scale=fractions.Fraction(1, 3)),
                             kernel(q, k, v, scale=1 / 3))


@pytest.mark.parametrize("name", ["scale", "softcap"])
def test_a_huge_int_is_a_value_error_naming_the_argument(name):
    """softcap = 10**400 raised a bare OverflowError while scale = 10**400 got a ValueError;
    both go through the one checker now."""
    q = np.ones((3, 4))
    with pytest.raises(ValueError, match=f"^{name} = 1000.*is outside the normal range of the "
                                         f"compute dtype float64"):
        fl.flash_attention(q, q, q, **{name: 10**400})


def test_merge_accepts_a_bfloat16_lse():
    """A bfloat16 lse was refused as "must be a float array, got dtype bfloat16": it is one of
    the dtypes the kernels accept, and merges as the same numbers in float32 do."""
    rng = np.random.default_rng(3)
    out = rng.standard_normal((2, 3, 4)).astype(np.float32)
    lse = rng.standard_normal((2, 3)).astype(BFLOAT16)
    got = fl.merge_attention(out, lse, out[::-1], lse[::-1])
    want = fl.merge_attention(out, lse.astype(np.float32), out[::-1], lse[::-1].astype(np.float32))
    assert all(same_bits(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------------------------------------------
# 3. One broadcasting path: v or mask with more batch dims than q·kᵀ, in the backward too
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", ["v", "mask"])
@pytest.mark.parametrize("variant", [dict(), dict(causal=True), dict(window=(1, 1)),
                                     dict(softcap=2.0), dict(alibi_slopes=0.5),
                                     dict(enable_gqa=True)],
                         ids=["plain", "causal", "window", "softcap", "alibi", "gqa"])
def test_the_backward_broadcasts_as_the_forward(extra, variant):
    """q (…, 4, 3) and k (…, 5, 3) with v (2, …, 5, 2) or a mask (2, …, 4, 5): flash's backward
    raised "non-broadcastable output operand"; now it matches naive's."""
    rng = np.random.default_rng(4)
    heads = (2,) if variant.get("enable_gqa") else ()
    q = rng.standard_normal(heads + (4, 3))
    k = rng.standard_normal(((1,) if heads else ()) + (5, 3))  # with GQA: 1 kv head
    v = rng.standard_normal(((2,) if extra == "v" else ()) + k.shape[:-1] + (2,))
    kw = dict(variant)
    if extra == "mask":
        kw["mask"] = rng.random((2,) + heads + (4, 5)) < 0.8
    with strict():
        out, lse = fl.flash_attention(q, k, v, return_lse=True, block_q=3, block_k=2, **kw)
        dout = rng.standard_normal(out.shape)
        got = fl.flash_attention_backward(q, k, v, out, lse, dout, block_q=3, block_k=2, **kw)
        want = fl.naive_attention_backward(q, k, v, dout, **kw)
    for g, w, x in zip(got, want, (q, k, v)):
        assert g.shape == x.shape
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# 4. enable_gqa with an empty output
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_q, dv", [(0, 4), (3, 0), (0, 0)])
@pytest.mark.parametrize("kernel", FORWARDS)
def test_gqa_with_an_empty_output(kernel, n_q, dv):
    """merge_heads' reshape(-1) cannot infer the head count of an empty array; every kernel
    now returns the empty result of the right shape, and the backward empty gradients."""
    q, k, v = np.ones((1, 4, n_q, 5)), np.ones((1, 2, 6, 5)), np.ones((1, 2, 6, dv))
    with strict():
        out, lse = kernel(q, k, v, enable_gqa=True, return_lse=True)
        assert out.shape == (1, 4, n_q, dv) and lse.shape == (1, 4, n_q)
        if kernel is fl.flash_attention:
            g = fl.flash_attention_backward(q, k, v, out, lse, np.ones_like(out), enable_gqa=True)
            assert [x.shape for x in g] == [q.shape, k.shape, v.shape]
            assert all(not x.any() for x in g)


# ---------------------------------------------------------------------------------------------
# 5. flash_check reports what a kernel does, it never crashes on it
# ---------------------------------------------------------------------------------------------


def _object_out(q, k, v, **kw):
    return fl.flash_attention(q, k, v, **kw).astype(object)


def _complex_out(q, k, v, **kw):
    return fl.flash_attention(q, k, v, **kw).astype(np.complex128)


def _raises_when_big(q, k, v, **kw):
    if q.shape[-2] > 256:  # inside the memory case only
        raise MemoryError("no room")
    return fl.flash_attention(q, k, v, **kw)


def _failed_checks(report):
    return {f.check for f in report.failures}


@pytest.mark.parametrize("kernel, check", [(_object_out, "dtype"), (_complex_out, "dtype")])
def test_flash_check_fails_an_output_of_the_wrong_dtype(kernel, check):
    """An object array crashed np.isfinite (the CLI then called it a usage error, exit 2); a
    complex128 output passed. Both are a 'dtype' Failure in every case now."""
    report = flash_check.check_kernel(kernel, features=("mask", "causal"))
    assert not report.ok and _failed_checks(report) == {check}
    assert all(f.check == check for r in report.results for f in r.failures)
    assert len({r.case for r in report.failures}) == len({r.case for r in report.results})


def test_flash_check_reports_a_kernel_raising_inside_the_memory_case():
    """The memory case called the kernel outside any try: its exception escaped check_kernel."""
    report = flash_check.check_kernel(_raises_when_big, features=("memory",), cases=["memory"])
    (failure,) = report.failures
    assert failure.check == "crashed" and "MemoryError: no room" in failure.measured


def test_flash_check_reports_a_tensor_that_requires_grad():
    """A torch tensor with requires_grad: .numpy() raised a RuntimeError out of check_kernel."""
    torch = pytest.importorskip("torch")

    def kernel(q, k, v, **kw):
        return torch.from_numpy(np.ascontiguousarray(fl.flash_attention(q, k, v, **kw))
                                ).requires_grad_(True)

    report = flash_check.check_kernel(kernel, features=("mask",), dtypes=("float64",),
                                      cases=["random", "key_padding"])
    assert len(report.failures) == 2
    assert all(f.check == "shape" and "detach" in f.diagnosis for f in report.failures)


def test_the_cli_fails_an_object_array_kernel_with_exit_1(tmp_path):
    """The CLI said "usage error" (exit 2) for a kernel whose output crashed a check."""
    (tmp_path / "objkernel.py").write_text(
        "import flash_lib\n"
        "def kernel(q, k, v, **kw):\n"
        "    return flash_lib.flash_attention(q, k, v, **kw).astype(object)\n")
    run = subprocess.run([sys.executable, "-m", "flash_check", "objkernel:kernel",
                          "--cases", "random", "--dtypes", "float64", "--features", "mask"],
                         cwd=tmp_path, capture_output=True, text=True,
                         env={**__import__("os").environ,
                              "PYTHONPATH": f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}"})
    assert run.returncode == 1, run.stderr
    assert "dtype object" in run.stdout


# ---------------------------------------------------------------------------------------------
# 8. ±inf in dout: flash gives what the dense chain gives
# ---------------------------------------------------------------------------------------------


def nonfinite_pattern(x):
    x = np.asarray(x, dtype=np.float64)
    return np.isnan(x), x == np.inf, x == -np.inf


@given(n_q=st.integers(1, 9), n_k=st.integers(1, 9), block=st.integers(1, 10),
       causal=st.booleans(), masked=st.booleans(), poison=st.sampled_from([np.inf, -np.inf]),
       data=st.data())
@settings(max_examples=80)
def test_an_inf_in_dout_gives_flash_the_references_nan_and_inf(n_q, n_k, block, causal, masked,
                                                              poison, data):
    """An inf in dO_i: the dense chain's dP_ij - rowsum(P ∘ dP) is inf - inf or NaN at every
    allowed pair of row i, so dq_i and the dk rows of the keys row i attends are NaN. flash's
    D_i = dO_i·O_i was ±inf and gave ±inf there; it is NaN now, as in naive and precise."""
    rng = np.random.default_rng(n_q * 7 + n_k)
    q, k = rng.standard_normal((2, n_q, 3)), rng.standard_normal((2, n_k, 3))
    q, k, v, dout = q[0], k[0], k[1, :, :2], rng.standard_normal((n_q, 2))
    dout[data.draw(st.integers(0, n_q - 1)), data.draw(st.integers(0, 1))] = poison
    kw = dict(causal=causal, block_q=block, block_k=block)
    if masked:
        kw["mask"] = rng.random((n_q, n_k)) < 0.7
    with strict():
        flash = grads("flash", q, k, v, dout, **kw)
        for kernel in ("naive", "precise"):
            for g, ref in zip(flash, grads(kernel, q, k, v, dout, **kw)):
                for a, b in zip(nonfinite_pattern(g), nonfinite_pattern(ref)):
                    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# 9. The bits do not depend on the memory layout
# ---------------------------------------------------------------------------------------------


def laid_out(x, layout):
    """The same values as ``x`` in another memory layout (a view where one exists)."""
    if layout == "fortran":
        return np.asfortranarray(x)
    if layout == "strided":  # every other element of a twice-as-long buffer
        big = np.empty(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
        big[..., ::2] = x
        return big[..., ::2]
    if layout == "transposed":  # a transposed view of the (features, N) matrices
        return np.ascontiguousarray(np.swapaxes(x, -1, -2)).swapaxes(-1, -2)
    if layout == "reversed":  # negative strides
        return x[..., ::-1, :].copy()[..., ::-1, :]
    return x


LAYOUTS = ["contiguous", "fortran", "strided", "transposed", "reversed"]


@pytest.mark.parametrize("layout", LAYOUTS[1:])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_results_do_not_depend_on_the_layout(layout, dtype):
    """Fortran-order, strided, transposed and reversed q, k, v, out, lse, dout: the same bits as
    C order, in every kernel (BLAS and NumPy's loops pick kernels by strides, so each call
    normalises its inputs to C order once)."""
    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal((2, 37, 16)).astype(dtype) for _ in range(4))
    kw = dict(causal=True, softcap=3.0, block_q=16, block_k=8)
    out, lse = fl.flash_attention(q, k, v, return_lse=True, **kw)
    want = fl.flash_attention_backward(q, k, v, out, lse, dout, **kw)
    L = lambda x: laid_out(x, layout)  # noqa: E731
    got_out, got_lse = fl.flash_attention(L(q), L(k), L(v), return_lse=True, **kw)
    assert same_bits(got_out, out) and same_bits(got_lse, lse)
    got = fl.flash_attention_backward(L(q), L(k), L(v), L(out), L(lse[..., None])[..., 0],
                                      L(dout), **kw)
    assert all(same_bits(g, w) for g, w in zip(got, want))
    del kw["block_q"], kw["block_k"]
    for kernel in (fl.naive_attention, fl.precise_attention):
        assert same_bits(kernel(L(q), L(k), L(v), **kw), kernel(q, k, v, **kw))
    for kernel in (fl.naive_attention_backward, fl.precise_attention_backward):
        for g, w in zip(kernel(L(q), L(k), L(v), L(dout), **kw), kernel(q, k, v, dout, **kw)):
            assert same_bits(g, w)


def test_a_broadcast_input_is_not_materialised():
    """Normalising the layout copies only what is not C order; an axis broadcast with stride 0
    stays a view (a k shared by 64 heads is not copied 64 times)."""
    rng = np.random.default_rng(6)
    q = rng.standard_normal((64, 300, 16))
    k = np.broadcast_to(np.asfortranarray(rng.standard_normal((300, 16))), (64, 300, 16))
    shared = np.ascontiguousarray(k[0])  # (300, 16), broadcast by the kernel: never copied
    _, peak = fl.measure_peak_bytes(fl.flash_attention, q, k, k)
    _, peak_c = fl.measure_peak_bytes(fl.flash_attention, q, shared, shared)
    assert peak <= peak_c + 2 * k[0].nbytes + (1 << 16)  # k's one matrix copied, not 64


# ---------------------------------------------------------------------------------------------
# The fuzz: variant combinations × masks × non-finite injections × dtypes × layouts
# ---------------------------------------------------------------------------------------------

FUZZ = {
    **VARIANTS,
    "n_q": st.integers(0, 12),  # 0: an empty output (with enable_gqa too)
    "n_k": st.integers(1, 12),
    "dv": st.sampled_from([0, 1, 3]),
    "softcap": st.sampled_from([None, 0.7, 5.0, 2e-38]),  # 2e-38: s / c overflows in float32
    "extra": st.sampled_from(["none", "v", "mask"]),  # more batch dims than q·kᵀ
    "dtype": st.sampled_from([np.float64, np.float32, np.float16, BFLOAT16]),
    "layout": st.sampled_from(LAYOUTS),
    "inject": st.sampled_from(["none", "q", "k", "v", "dout"]),
    "poison": st.sampled_from([np.nan, np.inf, -np.inf]),
    "data": st.data(),
}


@given(**FUZZ)
@settings(max_examples=600)
def test_fuzz_flash_agrees_with_naive_and_with_itself_in_every_layout(
        n_q, n_k, block_q, block_k, causal, window, softcap, alibi, gqa, masking, dv, extra,
        dtype, layout, inject, poison, data):
    """For every combination: no warning; flash's forward and backward have naive's NaN and ±inf
    pattern and its finite values within the dtype's tolerance; and flash gives the same bits
    whatever the memory layout of its inputs."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng([n_q, n_k, dv])
    h_kv = 2 if gqa else 4
    batch_v = (2,) if extra == "v" else ()
    q = rng.standard_normal((4, n_q, 4))
    k = rng.standard_normal((h_kv, n_k, 4))
    v = rng.standard_normal(batch_v + (h_kv, n_k, dv))
    kw = dict(causal=causal, window=window, softcap=softcap, enable_gqa=gqa)
    if alibi:
        kw["alibi_slopes"] = np.array([0.5, 0.25, 0.125, 0.0625])
    if masking in ("mask", "both"):
        kw["mask"] = rng.random(((2,) if extra == "mask" else ()) + (4, n_q, n_k)) < 0.8
    if masking in ("mask_mod", "both"):
        kw["mask_mod"] = lambda i, j: (i + j) % 3 != 1
    batch = np.broadcast_shapes(batch_v + (4,), kw["mask"].shape[:-2] if "mask" in kw else ())
    dout = rng.standard_normal(batch + (n_q, dv))
    arrays = dict(q=q, k=k, v=v, dout=dout)
    if inject != "none" and arrays[inject].size:
        x = arrays[inject]
        x[tuple(data.draw(st.integers(0, n - 1)) for n in x.shape)] = poison
    q, k, v, dout = (arrays[name].astype(dtype) for name in ("q", "k", "v", "dout"))
    blocks = dict(block_q=block_q, block_k=block_k)
    with strict():
        out, lse = fl.flash_attention(q, k, v, return_lse=True, **blocks, **kw)
        ref, ref_lse = fl.naive_attention(q, k, v, return_lse=True, **kw)
        g = fl.flash_attention_backward(q, k, v, out, lse, dout, **blocks, **kw)
        ng = fl.naive_attention_backward(q, k, v, dout, **kw)
        L = lambda x: laid_out(x, layout)  # noqa: E731
        out2, lse2 = fl.flash_attention(L(q), L(k), L(v), return_lse=True, **blocks, **kw)
        g2 = fl.flash_attention_backward(L(q), L(k), L(v), L(out), lse, L(dout), **blocks, **kw)
    assert same_bits(out2, out) and same_bits(lse2, lse)
    assert all(same_bits(a, b) for a, b in zip(g2, g))
    # the gradients' per-dtype bound for out, lse and every gradient alike, in a coarser unit
    # than test_backward's term sizes: 16 × the larger of 1 and the reference's largest entry
    tol = GRADIENTS_VS_NAIVE[dtype]
    for a, b in zip((out, lse, *g), (ref, ref_lse, *ng)):
        assert a.shape == b.shape and a.dtype == b.dtype
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        for pa, pb in zip(nonfinite_pattern(a), nonfinite_pattern(b)):
            np.testing.assert_array_equal(pa, pb)
        finite = np.isfinite(b)
        unit = max(1.0, np.abs(b[finite]).max(initial=0.0))
        assert np.abs(a[finite] - b[finite]).max(initial=0.0) <= tol * unit * 16


def test_dsinks_of_rows_with_opposite_infinities_warns_nothing():
    """``dsinks`` sums ``exp(sink - lse_i)·D_i`` over rows: with an inf in ``v`` and ``dout`` rows
    of opposite signs, ``D`` holds +inf and -inf and the sum is NaN (what IEEE arithmetic gives,
    as every other gradient of such rows), with no RuntimeWarning escaping the call (it used to
    be computed outside the kernel's errstate)."""
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((1, 6, 4)) for _ in range(3))
    v[0, 2, 0] = np.inf
    dout = np.ones((1, 6, 4))
    dout[0, 1, 0] = -1
    sinks = np.array(0.5)
    out, lse = fl.flash_attention(q, k, v, sinks=sinks, return_lse=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dsinks = fl.flash_attention_backward(q, k, v, out, lse, dout, sinks=sinks)[3]
    assert np.isnan(dsinks)


def test_scores_beyond_the_compute_dtype_are_refused_or_capped_without_a_warning():
    """float32 q = k = 1 with scale = 3e38: the scores 8·3e38 overflow float32 (they were inf,
    then NaN rows, with "overflow encountered in matmul"). Without softcap the kernels refuse
    them, naming scale and the bound; with softcap the product's ±inf is capped to ±softcap, as
    the extended-precision truth is, with no warning."""
    x = np.ones((1, 4, 8), np.float32)
    for kernel in (fl.flash_attention, fl.naive_attention, fl.precise_attention):
        with pytest.raises(ValueError, match=r"scale = 3e\+38 with these q and k gives scores up "
                                             r"to 2\.4e\+39 .* beyond the compute dtype float32"):
            kernel(x, x, x, scale=3e38)
    big = x * np.float32(1e20)  # q·k = 8e40, beyond float32 for any scale of 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fl.flash_attention(big, big, x, softcap=5.0, block_q=2, block_k=2)
    truth = fl.precise_attention(*(a.astype(np.float64) for a in (big, big, x)), softcap=5.0)
    np.testing.assert_array_equal(out, truth.astype(np.float32))

"""flash_triton: the Triton kernels (run by Triton's interpreter on a CPU) against flash_lib.

Skipped, with the reason, when the gpu extra (triton, torch) is missing. The interpreter runs one
program at a time in Python, so the sizes are small; the whole file takes ~30 s on a loaded
2-core machine.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="flash_triton needs PyTorch (`make setup` installs it)")
# Not importorskip("triton"): triton must be imported after flash_triton has set TRITON_INTERPRET.
if importlib.util.find_spec("triton") is None:
    pytest.skip("flash_triton needs Triton, which publishes wheels for Linux x86_64 and aarch64 "
                "only", allow_module_level=True)

import flash_check  # noqa: E402
import flash_lib  # noqa: E402
import flash_triton  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EPS = {np.float32: np.finfo(np.float32).eps, np.float16: np.finfo(np.float16).eps}


def qkv(rng, n_q, n_k, d=16, dv=None, dtype=np.float32, batch=(2,)):
    dv = d if dv is None else dv
    return tuple(rng.standard_normal(batch + s).astype(dtype)
                 for s in ((n_q, d), (n_k, d), (n_k, dv)))


def as64(*xs):
    return tuple(x.astype(np.float64) for x in xs)


# Shapes that exercise the tile logic: partial query and key blocks (BLOCK 32), Nq != Nk both ways
# (the bottom-right shift), one query row, d and dv not powers of two (the padded BLOCK_D).
SHAPES = [(70, 90, 16, 16), (90, 70, 16, 24), (1, 100, 16, 16), (33, 64, 20, 12)]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q, n_k, d, dv", SHAPES)
def test_forward_matches_flash_lib(n_q, n_k, d, dv, causal, dtype):
    rng = np.random.default_rng([n_q, n_k, d, causal])
    q, k, v = qkv(rng, n_q, n_k, d, dv, dtype)
    out, lse = flash_triton.attention(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == dtype and out.shape == (2, n_q, dv) and lse.shape == (2, n_q)
    ref, ref_lse = flash_lib.precise_attention(*as64(q, k, v), causal=causal, return_lse=True)
    empty = np.isneginf(ref_lse)  # causal with Nq > Nk: the top rows see no key
    assert np.array_equal(np.isneginf(lse), empty)
    assert np.all(out[empty] == 0)
    # Measured (every shape here, native, AVX2 and baseline NumPy loops alike): float32 5.3 eps,
    # float16 0.84 eps (p and out rounded to float16 once each; the matmuls accumulate in
    # float32). Bounds ~4x and ~2x that.
    bound = (20 if dtype == np.float32 else 2) * EPS[dtype]
    assert np.max(flash_lib.rowwise_relative_error(out[~empty], ref[~empty])) <= bound
    assert np.max(np.abs(lse[~empty] - ref_lse[~empty]) / (1 + np.abs(ref_lse[~empty]))) \
        <= 20 * EPS[np.float32]


def test_forward_masks_and_empty_rows():
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, 40, 70, batch=(3,))
    padding = np.ones((3, 1, 70), dtype=bool)  # one row per sequence: read with query stride 0
    padding[1, :, 50:] = False
    padding[2, :, :] = False  # every row of sequence 2 empty
    full = rng.random((3, 40, 70)) < 0.3
    full[0, [0, 5, 39]] = False
    for mask in (padding, full):
        for causal in (False, True):
            out, lse = flash_triton.attention(q, k, v, mask=mask, causal=causal, return_lse=True)
            ref, ref_lse = flash_lib.precise_attention(*as64(q, k, v), mask=mask, causal=causal,
                                                       return_lse=True)
            empty = np.isneginf(ref_lse)
            assert empty.any()
            assert np.array_equal(np.isneginf(lse), empty)  # flash_lib's -inf, not FA's +inf
            assert np.all(out[empty] == 0)
            error = np.max(flash_lib.rowwise_relative_error(out[~empty], ref[~empty]))
            assert error <= 20 * EPS[np.float32]


def test_inputs_broadcast_and_untouched():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 3, 20, 16)).astype(np.float32)
    k, v = qkv(rng, 30, 30, batch=(1, 3))[1:]  # k, v shared by the batch
    copies = [x.copy() for x in (q, k, v)]
    out = flash_triton.attention(q, k, v)
    assert out.shape == (2, 3, 20, 16)
    assert all(np.array_equal(a, b) for a, b in zip((q, k, v), copies))
    ref = flash_lib.precise_attention(*as64(q, k, v))
    assert np.max(flash_lib.rowwise_relative_error(out, ref)) <= 20 * EPS[np.float32]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("causal", [False, True])
# (63, 64): Nk - Nq = 1, so under causal the first query row a key block meets is the last row
# of a query block: the dk/dv loop's first query block is exactly on the edge.
@pytest.mark.parametrize("n_q, n_k, d, dv", [(70, 90, 16, 16), (90, 70, 16, 24), (63, 64, 16, 16)])
def test_backward_matches_flash_lib(n_q, n_k, d, dv, causal, dtype):
    rng = np.random.default_rng([7, n_q, n_k, causal])
    q, k, v = qkv(rng, n_q, n_k, d, dv, dtype)
    out, lse = flash_triton.attention(q, k, v, causal=causal, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = flash_triton.attention_backward(q, k, v, out, lse, dout, causal=causal)
    # flash_lib's backward in float64 on the same values (and its own forward's out and lse)
    q64, k64, v64, dout64 = as64(q, k, v, dout)
    out64, lse64 = flash_lib.flash_attention(q64, k64, v64, causal=causal, return_lse=True)
    refs = flash_lib.flash_attention_backward(q64, k64, v64, out64, lse64, dout64, causal=causal)
    # Measured (native, AVX2, baseline): float32 6.5e-7 of the gradient's largest entry;
    # float16 5.1e-4 (P, dS and out rounded to float16). Bounds ~15x and ~10x that.
    bound = 1e-5 if dtype == np.float32 else 5e-3
    for name, g, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert g.dtype == dtype and g.shape == ref.shape, name
        assert np.max(np.abs(g - ref)) <= bound * np.max(np.abs(ref)), name


def test_backward_empty_rows_and_unattended_keys():
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, 40, 70, batch=(2,))
    mask = np.ones((2, 40, 70), dtype=bool)
    mask[0, :5] = False  # five empty rows
    mask[1, :, 60:] = False  # ten keys no row attends
    out, lse = flash_triton.attention(q, k, v, mask=mask, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = flash_triton.attention_backward(q, k, v, out, lse, dout, mask=mask)
    assert np.all(dq[0, :5] == 0)
    assert np.all(dk[1, 60:] == 0) and np.all(dv[1, 60:] == 0)
    refs = flash_lib.flash_attention_backward(*as64(q, k, v, out.astype(np.float64)),
                                              lse.astype(np.float64), dout.astype(np.float64),
                                              mask=mask)
    for g, ref in zip((dq, dk, dv), refs):
        assert np.all(np.isfinite(g))
        assert np.max(np.abs(g - ref)) <= 1e-5 * np.max(np.abs(ref))


def test_backward_sums_over_broadcast_inputs():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((3, 20, 16)).astype(np.float32)
    k, v = qkv(rng, 30, 30, batch=(1,))[1:]
    out, lse = flash_triton.attention(q, k, v, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    grads = flash_triton.attention_backward(q, k, v, out, lse, dout)
    refs = flash_lib.flash_attention_backward(*as64(q, k, v, out, lse, dout))
    for g, ref in zip(grads, refs):
        assert g.shape == ref.shape
        assert np.max(np.abs(g - ref)) <= 1e-5 * np.max(np.abs(ref))


def test_flash_check_cli_passes():
    """The issue's command: with the lse feature, the command line calls a kernel that takes
    return_lse with return_lse=True."""
    cmd = [sys.executable, "-m", "flash_check", "flash_triton:attention",
           "--features", "causal", "lse", "--dtypes", "float32", "float16"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "PASS: 35 of 35 case runs passed" in run.stdout


def test_flash_check_masks_and_out_alone():
    # the mask cases (key padding, empty rows, NaN at padded keys) and attention itself (no lse)
    masked = ["key_padding", "empty_rows", "all_masked", "causal_and_mask", "masked_nonfinite"]
    report = flash_check.check_kernel(flash_triton.attention_with_lse,
                                      features=("mask", "causal", "lse"),
                                      dtypes=("float32", "float16"), cases=masked)
    assert report.ok, report.failures
    report = flash_check.check_kernel(flash_triton.attention, features=("causal",),
                                      dtypes=("float32",), cases=["late_max", "causal_tall"])
    assert report.ok, report.failures


def test_planted_missing_rescale_is_caught_and_diagnosed():
    report = flash_check.check_kernel(flash_triton.with_bug("missing_rescale"),
                                      features=("causal", "lse"), dtypes=("float32",),
                                      cases=["late_max", "random"])
    assert not report.ok
    assert {f.case for f in report.failures} == {"late_max", "random"}
    assert all("not rescaled by exp(m - m')" in f.diagnosis for f in report.failures)
    # and the flag is the only difference: with it on, the same cases pass
    assert flash_check.check_kernel(flash_triton.attention_with_lse, features=("causal", "lse"),
                                    dtypes=("float32",), cases=["late_max", "random"]).ok


def test_bad_inputs():
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, 8, 8)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        flash_triton.attention(q.astype(np.float64), k, v)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        flash_triton.attention(q, k.astype(np.float16), v)
    with pytest.raises(TypeError):
        flash_triton.attention(q.astype(np.int32), k, v)
    with pytest.raises(TypeError, match="boolean"):
        flash_triton.attention(q, k, v, mask=np.ones((8, 8)))
    with pytest.raises(TypeError, match="causal"):
        flash_triton.attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match="feature size"):
        flash_triton.attention(q, k[..., :8], v)
    with pytest.raises(ValueError, match="mask"):
        flash_triton.attention(q, k, v, mask=np.ones((8, 9), dtype=bool))
    # the scale by flash_lib's own rule (flash_lib.check_inputs): a positive normal number of
    # the compute dtype, float32 here, so 1e39 (inf in float32) is refused as flash_lib refuses it
    for scale in (-1.0, "1", 1e39, 1e-39):
        with pytest.raises(ValueError, match="scale") as raised:
            flash_triton.attention(q, k, v, scale=scale)
        with pytest.raises(ValueError) as by_flash_lib:
            flash_lib.flash_attention(q, k, v, scale=scale)
        assert str(raised.value) == str(by_flash_lib.value)
    out, lse = flash_triton.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="lse must have shape"):
        flash_triton.attention_backward(q, k, v, out, lse[:, :4], out)
    with pytest.raises(ValueError, match="bug must be one of"):
        flash_triton.with_bug("no_such_bug")


REFUSALS = """
import os
os.environ["TRITON_INTERPRET"] = "0"
try:
    import flash_triton
except RuntimeError as exc:
    print("refused:", exc)
del os.environ["TRITON_INTERPRET"]
import triton  # first, without the interpreter: refused at import, not at the first call
try:
    import flash_triton
except ImportError as exc:
    print("refused:", exc)
"""


@pytest.mark.skipif(flash_triton.HAS_CUDA, reason="the refusal is for machines without CUDA")
def test_refuses_without_cuda_or_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", REFUSALS], capture_output=True, text=True,
                         env=dict(env, PYTHONPATH=str(ROOT)), cwd=ROOT, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "refused: flash_triton: no CUDA GPU, and TRITON_INTERPRET is set to '0'" in run.stdout
    assert "triton was imported before flash_triton without TRITON_INTERPRET=1" in run.stdout


# --- The masked-key contract (issue 33, items 1, 2, 6, 14): garbage at a key a row may not
# attend never reaches that row, forward or backward, and no RuntimeWarning leaves a call.


def _same_non_finite_and_close(got, want):
    """Non-finite exactly where flash_lib's is, and close to it everywhere else."""
    for g, w in zip(got, want):
        assert np.array_equal(np.isfinite(g), np.isfinite(w))
        both = np.isfinite(w)
        assert np.max(np.abs(g[both] - w[both]), initial=0) <= 1e-5 * np.max(np.abs(w[both]), initial=1)


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("garbage", [np.nan, np.inf, -np.inf])
def test_padded_keys_never_reach_the_gradients(where, garbage):
    # the reproducer: keys 30-39 padded out, their v (or k) garbage
    rng = np.random.default_rng(11)
    q, k, v, do = (rng.standard_normal((1, 40, 8)).astype(np.float32) for _ in range(4))
    pad = np.ones((1, 1, 40), bool)
    pad[..., 30:] = False
    {"k": k, "v": v}[where][0, 30:] = garbage
    out, lse = flash_triton.attention(q, k, v, mask=pad, return_lse=True)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    dq, dk, dv = flash_triton.attention_backward(q, k, v, out, lse, do, mask=pad)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert not dk[0, 30:].any() and not dv[0, 30:].any()
    _same_non_finite_and_close((dq, dk, dv),
                               flash_lib.flash_attention_backward(q, k, v, out, lse, do, mask=pad))


@pytest.mark.parametrize("where", ["k", "v"])
def test_a_key_beyond_the_diagonal_reaches_only_the_rows_that_see_it(where):
    # key 20 is in the tile of rows 0-31, but under causal only rows 20-39 may see it
    rng = np.random.default_rng(12)
    q, k, v, do = (rng.standard_normal((1, 40, 8)).astype(np.float32) for _ in range(4))
    {"k": k, "v": v}[where][0, 20] = np.nan
    out, lse = flash_triton.attention(q, k, v, causal=True, return_lse=True)
    assert np.isfinite(out[0, :20]).all() and np.isnan(out[0, 20:]).all()
    _same_non_finite_and_close((out, lse),
                               flash_lib.flash_attention(q, k, v, causal=True, return_lse=True))
    _same_non_finite_and_close(
        flash_triton.attention_backward(q, k, v, out, lse, do, causal=True),
        flash_lib.flash_attention_backward(q, k, v, out, lse, do, causal=True))


def test_a_key_masked_for_some_rows_of_a_tile_reaches_only_the_others():
    rng = np.random.default_rng(13)
    q, k, v, do = (rng.standard_normal((2, 40, 8)).astype(np.float32) for _ in range(4))
    mask = rng.random((2, 40, 40)) < 0.7
    v[:, 5] = np.inf
    k[:, 7] = np.nan
    out, lse = flash_triton.attention(q, k, v, mask=mask, return_lse=True)
    want = flash_lib.flash_attention(q, k, v, mask=mask, return_lse=True)
    assert np.isfinite(want[0]).any(axis=-1).any() and not np.isfinite(want[0]).all()
    _same_non_finite_and_close((out, lse), want)
    _same_non_finite_and_close(
        flash_triton.attention_backward(q, k, v, out, lse, do, mask=mask),
        flash_lib.flash_attention_backward(q, k, v, out, lse, do, mask=mask))


@pytest.mark.parametrize("n_q, n_k", [(0, 5), (5, 0), (0, 0)])
def test_no_queries_or_no_keys_give_what_flash_lib_gives(n_q, n_k):
    q, k, v = (np.ones((2, n, w), np.float32) for n, w in ((n_q, 8), (n_k, 8), (n_k, 4)))
    out, lse = flash_triton.attention(q, k, v, return_lse=True)
    want_out, want_lse = flash_lib.flash_attention(q, k, v, return_lse=True)
    assert out.shape == want_out.shape and np.array_equal(out, want_out)
    assert lse.shape == want_lse.shape and np.array_equal(lse, want_lse)
    grads = flash_triton.attention_backward(q, k, v, out, lse, np.ones_like(out))
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and not g.any()


def test_a_scale_flash_lib_refuses_is_refused():
    x = np.ones((1, 4, 8), np.float32)
    with pytest.raises(ValueError, match="scale"):
        flash_triton.attention(x, x, x, scale=1e39)


def test_no_runtime_warning_leaves_a_call_on_garbage_inputs():
    # pyproject turns RuntimeWarning into an error, so a warning would fail here; say so anyway
    rng = np.random.default_rng(14)
    q, k, v = (rng.standard_normal((1, 40, 8)).astype(np.float32) for _ in range(3))
    q[0, 3] = np.nan
    k[0, 9] = np.inf
    v[0, 11] = -np.inf
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = flash_triton.attention(q, k, v, causal=True, return_lse=True)
        flash_triton.attention_backward(q, k, v, out, lse, np.ones_like(out), causal=True)


# --- bench/bench_gpu.py (issue 34 item 4): its --interpret --quick mode takes the CUDA run's
# code path on tiny shapes, so the script cannot rot unseen.


def _bench_gpu(*args, tmp_path=None, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gpu.py"), *args],
                          capture_output=True, text=True, env=env, cwd=tmp_path or ROOT,
                          timeout=timeout)


def test_bench_gpu_interpret_quick_runs_every_step(tmp_path):
    import json

    out = tmp_path / "gpu.json"
    run = _bench_gpu("--interpret", "--quick", "--json", str(out), tmp_path=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "checks PASS" in run.stdout
    results = json.loads(out.read_text())
    assert results["ok"] and results["interpreted"] and results["quick"]
    # flash_check with every declared feature, its backward and flash_lib's generator
    assert results["flash_check"]["ok"]
    assert results["flash_check"]["summary"].startswith("PASS: 11 of 11 case runs passed")
    # the grid: both 16-bit dtypes, causal or not, dropout off and on, each within its bound
    grid = results["grid"]
    assert {(r["dtype"], r["causal"], r["dropout"]) for r in grid} == {
        (t, c, p) for t in ("float16", "bfloat16") for c in (False, True) for p in (0.0, 0.1)}
    assert all(r["ok"] for r in grid)
    # the timings: both modes, causal or not, each agreeing with SDPA before it is timed
    timings = results["timings"]
    assert {(r["mode"], r["causal"]) for r in timings} == {
        (m, c) for m in ("fwd", "fwd+bwd") for c in (False, True)}
    assert all(r["ok"] and r["triton_ms"] > 0 and r["sdpa_ms"] > 0 for r in timings)


@pytest.mark.skipif(flash_triton.HAS_CUDA, reason="the message is for machines without CUDA")
def test_bench_gpu_without_cuda_says_so_and_exits_0(tmp_path):
    run = _bench_gpu("--json", str(tmp_path / "gpu.json"), tmp_path=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("\n") == 1 and run.stdout.startswith("bench_gpu: no CUDA GPU here")
    assert not (tmp_path / "gpu.json").exists()


# --- Sinks and dropout (issue 34 item 3): flash_lib's conventions, flash_lib's mask bit for bit.


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_sinks_match_flash_lib_forward_and_backward(causal, dtype):
    rng = np.random.default_rng([21, causal])
    q, k, v = qkv(rng, 50, 40, d=16, dv=8, dtype=dtype, batch=(2, 3))  # causal: 10 rows see no key
    mask = rng.random((2, 3, 50, 40)) < 0.7
    mask[:, :, [3, 30]] = False  # more rows with no key: out 0, lse = sink
    sinks = np.array([-1.0, 2.0, 5.0])  # one per head, broadcast over the batch
    out, lse = flash_triton.attention(q, k, v, causal=causal, mask=mask, sinks=sinks,
                                      return_lse=True)
    x64 = as64(q, k, v)
    ref, ref_lse = flash_lib.flash_attention(*x64, causal=causal, mask=mask, sinks=sinks,
                                             return_lse=True)
    empty = ~(mask & flash_lib.causal_mask(50, 40) if causal else mask).any(-1)
    assert empty.sum() >= 12
    assert np.all(out[empty] == 0)
    assert np.allclose(lse[empty], np.broadcast_to(sinks[:, None], empty.shape)[empty], atol=1e-6)
    bound = (20 if dtype == np.float32 else 2) * EPS[dtype]
    assert np.max(flash_lib.rowwise_relative_error(out[~empty], ref[~empty])) <= bound
    assert np.max(np.abs(lse - ref_lse) / (1 + np.abs(ref_lse))) <= 20 * EPS[np.float32]
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = flash_triton.attention_backward(q, k, v, out, lse, dout, causal=causal, mask=mask,
                                            sinks=sinks)
    refs = flash_lib.flash_attention_backward(*x64, out.astype(np.float64),
                                              lse.astype(np.float64), dout.astype(np.float64),
                                              causal=causal, mask=mask, sinks=sinks)
    assert len(grads) == 4 and grads[3].shape == sinks.shape
    g_bound = 1e-5 if dtype == np.float32 else 5e-3
    for name, g, ref in zip(("dq", "dk", "dv", "dsinks"), grads, refs):
        assert np.max(np.abs(g - ref)) <= g_bound * np.max(np.abs(ref)), name


def _mask_read_off(seed, p, batch, n_q, n_k, offset):
    """The keep mask flash_triton applies, read off its output and its dV: on q = 0 the
    weights are uniform, 1/Nk, so with v the identity out[i, j] = Z_ij / (Nk (1 - p)), and with
    dout the identity (padded) dV[j, i] is the same."""
    q = np.zeros(batch + (n_q, 16), np.float32)
    k = np.random.default_rng(0).standard_normal(batch + (n_k, 16)).astype(np.float32)
    eye_v = np.broadcast_to(np.eye(n_k, dtype=np.float32), batch + (n_k, n_k)).copy()
    drop = dict(dropout_p=p, dropout_seed=seed, dropout_offset=offset)
    out, lse = flash_triton.attention(q, k, eye_v, return_lse=True, **drop)
    eye_do = np.broadcast_to(np.eye(n_q, n_k, dtype=np.float32), batch + (n_q, n_k)).copy()
    # dout = [I | 0] (Nq x Nk): dV[j, c] = Σ_i P_ij Z_ij dO[i, c] / (1 - p) = P_cj Z_cj / (1 - p)
    # for the columns c < Nq
    dv = flash_triton.attention_backward(q, k, eye_v, out, lse, eye_do, **drop)[2]
    forward = np.rint(out * n_k * (1 - np.float32(p))).astype(int)
    backward = np.rint(np.swapaxes(dv[..., :n_q], -1, -2) * n_k * (1 - np.float32(p)))
    return forward, backward.astype(int)


# offsets: none; a row offset and a key offset on the 8-key counters (the kernels' packed path);
# a key offset off them (one counter per key). Seeds below 2^31, at 2^63 + 5 (a uint64).
@pytest.mark.parametrize("offset", [(0, 0), (7, 16), (3, 5)])
@pytest.mark.parametrize("seed", [12345, 2**63 + 5])
def test_dropout_mask_is_flash_lib_s_bit_for_bit_forward_and_backward(seed, offset):
    p, batch, n_q, n_k = 0.3, (2, 2), 40, 72
    forward, backward = _mask_read_off(seed, p, batch, n_q, n_k, offset)
    want = flash_lib.dropout_keep(seed, p, batch + (n_q, n_k), offset=offset)
    assert set(np.unique(forward)) == {0, 1}
    assert np.array_equal(forward.astype(bool), want)
    # the backward regenerates the same mask, pair for pair
    assert set(np.unique(backward)) == {0, 1}
    assert np.array_equal(backward.astype(bool), want)
    # and the mask is not one that ignores the batch, the seed or the offset
    assert not np.array_equal(want[0, 0], want[1, 1])
    assert not np.array_equal(want, flash_lib.dropout_keep(seed + 1, p, want.shape, offset))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_output_and_gradients_match_flash_lib(causal, dtype):
    rng = np.random.default_rng([22, causal])
    q, k, v = qkv(rng, 70, 90, d=16, dv=24, dtype=dtype)
    drop = dict(dropout_p=0.2, dropout_seed=99, dropout_offset=(4, 8))
    out, lse = flash_triton.attention(q, k, v, causal=causal, return_lse=True, **drop)
    x64 = as64(q, k, v)
    ref, ref_lse = flash_lib.flash_attention(*x64, causal=causal, return_lse=True, **drop)
    # the lse is the undropped one
    assert np.max(np.abs(lse - ref_lse) / (1 + np.abs(ref_lse))) <= 20 * EPS[np.float32]
    bound = (20 if dtype == np.float32 else 2) * EPS[dtype]
    assert np.max(np.abs(out - ref)) <= bound * np.max(np.abs(ref))
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = flash_triton.attention_backward(q, k, v, out, lse, dout, causal=causal, **drop)
    refs = flash_lib.flash_attention_backward(*x64, ref, ref_lse, dout.astype(np.float64),
                                              causal=causal, **drop)
    g_bound = 1e-5 if dtype == np.float32 else 5e-3
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        assert np.max(np.abs(g - r)) <= g_bound * np.max(np.abs(r)), name
    # without the seed's mask the answer is another one: dropout really is applied
    plain = flash_triton.attention(q, k, v, causal=causal)
    assert np.max(np.abs(plain - ref)) > 100 * bound * np.max(np.abs(ref))


def test_flash_check_passes_sinks_and_dropout_with_flash_lib_s_generator():
    report = flash_check.check_kernel(
        flash_triton.attention_with_lse, features=flash_triton.FEATURES, dtypes=("float32",),
        backward=flash_triton.attention_backward, dropout_generator="flash_lib",
        cases=["sinks", "sinks_empty_rows", "sinks_causal", "dropout"])
    assert report.ok, report.failures
    assert len(report.results) == 4
    notes = {r.case: r.note for r in report.results}
    assert "dsinks included" in notes["sinks"]
    assert "the mask is flash_lib.dropout_keep's at every pair" in notes["dropout"]
    assert "the backward's mask and gradients checked" in notes["dropout"]


def test_bfloat16_matches_flash_lib():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(23)
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in qkv(rng, 40, 56, d=16))
    out, lse = flash_triton.attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == ml_dtypes.bfloat16
    ref, ref_lse = flash_lib.flash_attention(*as64(q, k, v), causal=True, return_lse=True)
    eps = float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps)
    # out rounded to bfloat16 once, P once before P·V: measured 0.9 ulp of the largest entry
    assert np.max(np.abs(out.astype(np.float64) - ref)) <= 2 * eps * np.max(np.abs(ref))
    assert np.max(np.abs(lse - ref_lse) / (1 + np.abs(ref_lse))) <= 20 * EPS[np.float32]


# --- Autotuning (issue 34 item 3): the configurations a GPU tries, by head dimension.


def _tiles(configs):
    return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) for c in configs}


def test_gpu_configs_hold_tutorial_06_s_and_flash_attention_2_s_tiles():
    forward = _tiles(flash_triton.GPU_CONFIGS["forward"])
    # tutorial 06: 64 or 128 rows x 32 or 64 keys at 4 warps; FA2: 128 x 128 (d = 64), 4 warps
    assert {(m, n, 4) for m in (64, 128) for n in (32, 64)} | {(128, 128, 4)} <= forward
    # 8 warps only for tiles of 128 x 128 (the tutorial's keep())
    assert all(m * n >= 128 * 128 for m, n, w in forward if w == 8)
    assert (32, 128, 4) in _tiles(flash_triton.GPU_CONFIGS["dkdv"])  # the tutorial's backward
    assert (128, 128, 8) in _tiles(flash_triton.GPU_CONFIGS["dkdv"])  # FA2's at d = 64
    assert (64, 128, 8) in _tiles(flash_triton.GPU_CONFIGS["dkdv"])  # FA2's at d = 128
    assert (128, 32, 4) in _tiles(flash_triton.GPU_CONFIGS["dq"])


def test_prune_configs_by_head_dimension():
    configs = flash_triton.GPU_CONFIGS["forward"]
    d64, d128 = (_tiles(flash_triton.prune_configs(configs, d)) for d in (64, 128))
    # FA2: 128 x 128 at d = 64, not at d = 128 (S and acc: 256 registers a thread, over 255)
    assert (128, 128, 4) in d64 and not any(m * n >= 128 * 128 for m, n, _ in d128)
    assert (128, 64, 4) in d128  # FA2's tile at d = 128 stays
    # with dropout FA2 halves BLOCK_N at d = 64: no 128 x 128
    assert not any(m * n >= 128 * 128 for m, n, _ in
                   _tiles(flash_triton.prune_configs(configs, 64, dropout=True)))
    # past d = 128: nothing over 64 x 64, nor more than 3 stages
    d256 = flash_triton.prune_configs(configs, 256)
    assert d256 and all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64
                        and c.num_stages <= 3 for c in d256)
    # non-finite inputs: the one small tile of dot_allowed's (M, N, d) products
    assert flash_triton.prune_configs(configs, 64, nonfinite=True) == [
        flash_triton.NONFINITE_CONFIG]


def test_the_interpreter_runs_one_small_configuration():
    assert flash_triton.INTERPRETED
    config = flash_triton.INTERPRETER_CONFIG
    tile = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"])
    assert tile == (flash_triton.BLOCK_M, flash_triton.BLOCK_N) == (32, 32)


def test_short_sequences_get_flash_attention_2_s_tile_untimed():
    def tile(which, d, dropout=False):
        c = flash_triton.default_config(which, d, dropout)
        return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps

    # flash_fwd_launch_template.h on sm80/sm90: d = 64 128 x 128 (dropout 128 x 64), d = 128
    # 128 x 64 (dropout 128 x 32), 4 warps
    assert tile("forward", 64) == (128, 128, 4) and tile("forward", 64, True) == (128, 64, 4)
    assert tile("forward", 128) == (128, 64, 4) and tile("forward", 128, True) == (128, 32, 4)
    # the backward: the tutorial's 32 x 128 (dK, dV) and 128 x 32 (dQ), 4 warps
    assert tile("dkdv", 128) == (32, 128, 4) and tile("dq", 128) == (128, 32, 4)
    assert flash_triton.SEARCH_FROM == 1024

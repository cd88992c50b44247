"""Bad input is refused with an exception whose message names the argument, shows what was given
and says what was expected: ValueError for shapes and values, TypeError for types. Both kernels
(and the precise truth) share one validation, so each case runs against all three."""

import re

import numpy as np
import pytest

from flash_lib import (
    flash_attention,
    flash_attention_backward,
    naive_attention_backward,
    merge_attention,
    naive_attention,
    precise_attention,
    tile_schedule,
)

def flash_backward(q, k, v, **kwargs):
    """The tiled backward with placeholder out, lse, dout: q, k, v are checked first."""
    return flash_attention_backward(q, k, v, np.zeros(1), np.zeros(1), np.zeros(1), **kwargs)


def naive_backward(q, k, v, **kwargs):
    return naive_attention_backward(q, k, v, np.zeros(1), **kwargs)


KERNELS = [flash_attention, naive_attention, precise_attention, flash_backward, naive_backward]


def arrays(n_q=4, n_k=5, d=3, dv=2, batch=()):
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal(batch + (n_q, d)),
        rng.standard_normal(batch + (n_k, d)),
        rng.standard_normal(batch + (n_k, dv)),
    )


def assert_shapes_refused(kernel, q, k, v, message, *shapes):
    """``kernel(q, k, v)`` raises a ValueError with ``message`` that shows each of ``shapes``."""
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        kernel(q, k, v)
    for shape in shapes:
        assert shape in str(e.value)


@pytest.mark.parametrize("kernel", KERNELS)
def test_q_and_k_feature_sizes_must_agree(kernel):
    """q (..., Nq, d) and k (..., Nk, d) with different d: ValueError showing both shapes."""
    q, k, v = arrays()
    assert_shapes_refused(kernel, q, k[:, :2], v, "q and k must have the same feature size d",
                          "q.shape=(4, 3)", "k.shape=(5, 2)")


@pytest.mark.parametrize("kernel", KERNELS)
def test_k_and_v_key_counts_must_agree(kernel):
    """k (..., Nk, d) and v (..., Nk', dv) with Nk != Nk': ValueError showing both shapes."""
    q, k, v = arrays()
    assert_shapes_refused(kernel, q, k, v[:4], "k and v must have the same number of keys Nk",
                          "k.shape=(5, 3)", "v.shape=(4, 2)")


@pytest.mark.parametrize("kernel", KERNELS)
def test_batch_dimensions_must_broadcast(kernel):
    """Leading dims of q, k, v that do not broadcast (2 vs 3): ValueError naming the shapes."""
    q, _, _ = arrays(batch=(2,))
    _, k, v = arrays(batch=(3,))
    with pytest.raises(
        ValueError, match=r"leading \(batch\) dimensions .* must broadcast.*q.shape=\(2, 4, 3\)"
    ):
        kernel(q, k, v)


@pytest.mark.parametrize(
    "n_q, n_k, mask_shape",
    [
        (4, 5, (4, 6)),
        (4, 5, (5, 5)),
        (4, 5, (3, 4, 5)),
        (4, 5, (4, 5, 1)),
        (4, 1, (4, 3)),
        (1, 5, (2, 5)),
    ],
    ids=["Nk+1", "Nq+1", "batch 3 vs 2", "extra trailing axis", "widens Nk=1", "widens Nq=1"],
)
@pytest.mark.parametrize("kernel", KERNELS)
def test_mask_must_broadcast_to_nq_by_nk(kernel, n_q, n_k, mask_shape):
    """A mask that does not broadcast to (..., Nq, Nk), including one that would widen Nq = 1 or
    Nk = 1 (broadcastable with, but not to, that shape): ValueError with both shapes."""
    q, k, v = arrays(n_q, n_k, batch=(2,))
    expected = f"mask of shape {mask_shape} does not broadcast to (..., Nq, Nk) = (2, {n_q}, {n_k})"
    with pytest.raises(ValueError, match=re.escape(expected)):
        kernel(q, k, v, mask=np.ones(mask_shape, bool))


@pytest.mark.parametrize("dtype", [np.int64, np.float64, np.uint8])
@pytest.mark.parametrize("kernel", KERNELS)
def test_mask_must_be_boolean(kernel, dtype):
    """A 0/1 or additive (float) mask is refused with a TypeError, not silently reinterpreted."""
    q, k, v = arrays()
    with pytest.raises(
        TypeError, match=re.escape("mask must be a boolean array (True = may attend)")
    ):
        kernel(q, k, v, mask=np.ones((4, 5), dtype))


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_inputs_need_at_least_two_dimensions(kernel, which):
    """A 1-d q, k or v: ValueError naming the argument and its shape."""
    args = dict(zip("qkv", arrays()))
    args[which] = args[which][0]
    with pytest.raises(
        ValueError, match=rf"^{which} must have at least 2 dimensions .*got shape \(\d+,\)"
    ):
        kernel(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.complex128, object], ids=str)
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_non_float_dtypes_are_a_type_error_naming_the_argument(kernel, which, dtype):
    """int, bool, complex and object arrays: TypeError naming the argument and its dtype."""
    args = dict(zip("qkv", arrays()))
    args[which] = args[which].astype(dtype)
    name = np.dtype(dtype).name
    with pytest.raises(
        TypeError, match=rf"^{which} must be a float16, bfloat16, float32 or float64 array, got dtype {name}"
    ):
        kernel(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("scale", [0, 0.0, -1, -0.5, np.inf, -np.inf, np.nan, True, "1"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_scale_must_be_finite_and_positive(kernel, scale):
    """scale 0, negative, ±inf, NaN, a bool or a string: ValueError showing the value."""
    q, k, v = arrays()
    with pytest.raises(
        ValueError, match=re.escape(f"scale must be a finite positive number, got {scale!r}")
    ):
        kernel(q, k, v, scale=scale)


@pytest.mark.parametrize("kernel", KERNELS)
def test_causal_must_be_a_bool(kernel):
    """causal="yes" or 1 is a TypeError (a truthy string must not silently switch it on)."""
    q, k, v = arrays()
    for causal in ("yes", 1):
        with pytest.raises(TypeError, match=re.escape(f"causal must be a bool, got {causal!r}")):
            kernel(q, k, v, causal=causal)


@pytest.mark.parametrize("value", [0, -1, 1.5, 2.0, True, None, "8"])
@pytest.mark.parametrize("name", ["block_q", "block_k"])
def test_block_sizes_must_be_positive_integers(name, value):
    """block_q / block_k of 0, -1, 1.5, 2.0, True, None or "8": ValueError naming the argument."""
    q, k, v = arrays()
    with pytest.raises(
        ValueError, match=re.escape(f"{name} must be a positive integer, got {value!r}")
    ):
        flash_attention(q, k, v, **{name: value})


def test_numpy_integer_block_sizes_are_accepted():
    """np.int64 block sizes (e.g. from a sweep over np.arange) are integers and are accepted."""
    q, k, v = arrays()
    out = flash_attention(q, k, v, block_q=np.int64(2), block_k=np.int32(3))
    np.testing.assert_allclose(out, naive_attention(q, k, v), rtol=1e-13)


@pytest.mark.parametrize(
    "args, message",
    [
        ((-1, 4, 2, 2), "n_q must be a non-negative integer, got -1"),
        ((4, 2.5, 2, 2), "n_k must be a non-negative integer, got 2.5"),
        ((4, 4, 0, 2), "block_q must be a positive integer, got 0"),
        ((4, 4, 2, True), "block_k must be a positive integer, got True"),
        ((4, 4, 2, -3), "block_k must be a positive integer, got -3"),
    ],
)
def test_tile_schedule_rejects_bad_arguments(args, message):
    """tile_schedule validates its sizes like the kernel does: ValueError naming the argument."""
    with pytest.raises(ValueError, match=re.escape(message)):
        tile_schedule(*args)


OUT, LSE = np.zeros((2, 3, 4)), np.zeros((2, 3))


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((OUT, LSE, OUT[..., :3], LSE), ValueError, "out_a and out_b must have the same shape"),
        ((OUT, LSE[:, :2], OUT, LSE), ValueError, "lse_a must have shape out.shape[:-1] = (2, 3)"),
        ((OUT, LSE, OUT, LSE[0]), ValueError, "lse_b must have shape out.shape[:-1] = (2, 3)"),
        ((OUT, LSE, OUT, LSE.astype(int)), TypeError, "lse_b must be a float16, bfloat16, float32 or float64 (or longdouble) array, got dtype int64"),
        ((OUT.astype(int), LSE, OUT, LSE), TypeError, "out_a must be a float16, bfloat16, float32 or"),
        ((OUT[0, 0], LSE, OUT[0, 0], LSE), ValueError, "out_a must have at least 2 dimensions"),
    ],
    ids=["out shapes differ", "lse_a shape", "lse_b shape", "int lse", "int out", "1-d out"],
)
def test_merge_attention_rejects_mismatched_parts(args, error, message):
    """merge_attention: out shapes that differ, an lse not of shape out.shape[:-1], non-float
    arrays, and a 1-d out are refused, each naming the argument."""
    with pytest.raises(error, match=re.escape(message)):
        merge_attention(*args)


@pytest.mark.parametrize("which", ["lse_a", "lse_b"])
def test_merge_attention_refuses_flash_attentions_plus_inf_and_says_how_to_convert(which):
    """FlashAttention stores +inf as the lse of a row with no allowed key; merging it as a number
    gave NaN and a warning. Now it is a ValueError that explains the convention and the fix."""
    lse = {"lse_a": LSE.copy(), "lse_b": LSE.copy()}
    lse[which][1, 2] = np.inf
    with pytest.raises(ValueError) as e:
        merge_attention(OUT, lse["lse_a"], OUT, lse["lse_b"])
    message = str(e.value)
    assert message.startswith(f"{which} is +inf in 1 row(s). FlashAttention writes +inf")
    assert f"np.where({which} == np.inf, -np.inf, {which})" in message


@pytest.mark.parametrize("causal", ["False", "True", 0, None])
def test_tile_schedule_causal_must_be_a_bool(causal):
    """tile_schedule(causal="False") used to mean causal (a non-empty string is truthy)."""
    with pytest.raises(TypeError, match=re.escape(f"causal must be a bool, got {causal!r}")):
        tile_schedule(4, 4, 2, 2, causal=causal)


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", ""])
def test_flash_lib_threads_must_be_a_positive_integer(value):
    """FLASH_LIB_THREADS=0 or "two" is refused at import with a message naming the variable."""
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", "import flash_lib"], capture_output=True,
                         text=True, env=dict(os.environ, FLASH_LIB_THREADS=value))
    assert run.returncode == 1
    assert f"ValueError: FLASH_LIB_THREADS must be a positive integer, got {value!r}" in run.stderr


@pytest.mark.parametrize("shapes", [((), ()), ((), (3,)), ((3,), ())])
def test_rowwise_relative_error_needs_a_feature_axis(shapes):
    """0-d arrays have no row to measure: ValueError showing both shapes."""
    from flash_lib import rowwise_relative_error

    with pytest.raises(ValueError, match="out and ref must have at least 1 dimension"):
        rowwise_relative_error(np.zeros(shapes[0]), np.zeros(shapes[1]))


@pytest.mark.parametrize(
    "which, shape, expected",
    [("out", (2, 4, 3), "(2, 4, 2)"), ("lse", (2, 5), "(2, 4)"), ("dout", (4, 2), "(2, 4, 2)")],
)
def test_backward_checks_out_lse_and_dout_against_q_k_v(which, shape, expected):
    """out, lse and dout of the wrong shape for these q, k, v: ValueError naming the argument,
    the shape expected (the forward's) and the one given."""
    q, k, v = arrays(batch=(2,))
    saved = dict(out=np.zeros((2, 4, 2)), lse=np.zeros((2, 4)), dout=np.zeros((2, 4, 2)))
    saved[which] = np.zeros(shape)
    with pytest.raises(ValueError, match=re.escape(
            f"{which} must have shape {expected}, what the forward returns for these q, k, v "
            f"(and mask), got {shape}")):
        flash_attention_backward(q, k, v, saved["out"], saved["lse"], saved["dout"])
    if which == "dout":
        with pytest.raises(ValueError, match=re.escape(f"dout must have shape {expected}")):
            naive_attention_backward(q, k, v, saved["dout"])


def test_backward_refuses_non_float_saved_arrays():
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"^dout must be a float16, bfloat16, float32 or float64 "
                                        r"array, got dtype int64"):
        flash_attention_backward(q, k, v, np.zeros((4, 2)), np.zeros(4), np.zeros((4, 2), int))

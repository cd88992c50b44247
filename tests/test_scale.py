"""One placement of the scale τ in every kernel: τ = r·2^e applied as r·2^a on q and 2^b on k.

Why (the module docstring has it in full): a power of two scales exactly, so the scores round as
(τq)kᵀ does; neither q·τ nor q·kᵀ overflows before the other factor brings it back; and it costs
two passes over (block_q + block_k)·d numbers per tile instead of one over block_q·block_k.
"""

import math
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import _flash_inputs
import flash_lib
from flash_lib import flash_attention, naive_attention, precise_attention

KERNELS = [flash_attention, naive_attention]


def case_tau_q_overflows():
    """float64, q = 1e300 and τ = 1e10: τq overflows, although the scores are 1e10 and 2e10."""
    q = np.array([[1e300]])
    k = np.array([[1e-300], [2e-300]])
    v = np.array([[1.0, 0.0], [0.0, 1.0]])
    return (q, k, v), 1e10


def case_qk_overflows():
    """float32, q = k = 1e20 and τ = 1e-30: qkᵀ = 1e40 overflows float32 (3.4e38) before τ
    brings the scores back to 1e10 and 2e10."""
    q = np.array([[1e20]], np.float32)
    k = np.array([[1e20], [2e20]], np.float32)
    v = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    return (q, k, v), 1e-30


@pytest.mark.parametrize("case", [case_tau_q_overflows, case_qk_overflows])
def test_flash_and_naive_are_finite_and_bit_equal_where_one_placement_overflows(case):
    """Both cases of the hardening issue: each overflowed in one kernel (NaN) and not the other.
    Now both give softmax([1e10, 2e10]) = [0, 1] exactly, bit for bit, as the truth does."""
    (q, k, v), scale = case()
    flash, flash_lse = flash_attention(q, k, v, scale=scale, return_lse=True)
    naive, naive_lse = naive_attention(q, k, v, scale=scale, return_lse=True)
    truth, truth_lse = precise_attention(q, k, v, scale=scale, return_lse=True)
    assert np.isfinite(flash).all() and np.isfinite(flash_lse).all()
    np.testing.assert_array_equal(flash, naive)
    np.testing.assert_array_equal(flash_lse, naive_lse)
    np.testing.assert_array_equal(flash, [[0.0, 1.0]])
    np.testing.assert_array_equal(truth.astype(q.dtype), flash)
    np.testing.assert_allclose(flash_lse, truth_lse.astype(np.float64), rtol=1e-6)


@given(scale=st.floats(1e-300, 1e300))
def test_the_split_is_exact_and_balanced(scale):
    """scale_q · scale_k == τ exactly, scale_k is a power of two, and the two factors are
    within a factor 4 of √τ, so neither side carries more of τ's range than it must."""
    scale_q, scale_k = _flash_inputs.split_scale(scale)  # flash_lib's private helper, tested here
    assert scale_q * scale_k == scale
    assert math.frexp(scale_k)[0] == 0.5
    assert abs(math.log2(scale_q) - math.log2(math.sqrt(scale))) <= 2
    assert abs(math.log2(scale_k) - math.log2(math.sqrt(scale))) <= 2


@pytest.mark.parametrize("scale", [0.125, 1 / math.sqrt(48), 0.3, 7.0])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scores_round_exactly_as_pre_scaled_queries(dtype, scale):
    """The placement, pinned: naive's output is bit-for-bit a dense softmax of (τq)kᵀ written
    here, for powers of two and other scales (scaling k by a power of two is exact)."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((17, n)).astype(dtype) for n in (48, 48, 5))
    k = rng.standard_normal((23, 48)).astype(dtype)
    v = rng.standard_normal((23, 5)).astype(dtype)
    s = (q * dtype(scale)) @ k.T
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    expected = (p @ v) / p.sum(axis=-1, keepdims=True)
    np.testing.assert_array_equal(naive_attention(q, k, v, scale=scale), expected)


@pytest.mark.parametrize("scale", [2.0**-40, 1e-12, 3.7, 2.0**40])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_extreme_but_valid_scales_stay_close_to_the_truth(dtype, scale):
    """Scales far from 1/√d, with inputs sized so that the scores span about 20: flash and
    naive are within 64 eps (rowwise, relative) of precise_attention and of each other."""
    rng = np.random.default_rng(3)
    size = math.sqrt(20 / (scale * 16))
    q, k = (rng.standard_normal((40, 16)) * size for _ in range(2))
    v = rng.standard_normal((40, 3))
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    truth = precise_attention(q, k, v, scale=scale)
    bound = 64 * np.finfo(dtype).eps
    for out in (flash_attention(q, k, v, scale=scale, block_q=8, block_k=8),
                naive_attention(q, k, v, scale=scale)):
        assert flash_lib.rowwise_relative_error(out, truth).max() <= bound


@pytest.mark.parametrize(
    "dtype, scale, word",
    [
        (np.float32, 1e300, "overflows"),
        (np.float16, 1e300, "overflows"),
        (np.float32, 1e-45, "vanishes"),
        (np.float64, 10**400, "overflows"),
        (np.float64, np.longdouble("1e-4000"), "vanishes"),
        (np.float64, 1e-310, "vanishes"),
    ],
    ids=["1e300 f32", "1e300 f16", "1e-45 f32", "10**400", "longdouble 1e-4000", "subnormal f64"],
)
@pytest.mark.parametrize("kernel", KERNELS + [precise_attention])
def test_a_scale_outside_the_compute_dtype_is_refused(kernel, dtype, scale, word):
    """A scale the compute dtype cannot hold as a normal number (float32 for float16 inputs)
    is a ValueError naming scale, its value and the dtype's range, not a NaN output (1e300 in
    float32), a bare OverflowError (10**400) or a silent 0 (a longdouble 1e-4000)."""
    q = k = v = np.ones((2, 4), dtype)
    compute = "float32" if dtype == np.float16 else np.dtype(dtype).name
    pattern = (rf"^scale = {re.escape(repr(scale))} is outside the normal range of the compute "
               rf"dtype {compute} \[.*\]: in {compute} it {word}$")
    with pytest.raises(ValueError, match=pattern):
        kernel(q, k, v, scale=scale)

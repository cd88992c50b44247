"""Batch invariance: split-KV decoding whose split count follows the batch changes a sequence's
bits with the batch; a fixed split size never does; flash_lib's own kernels give a batch row the
bits it gets alone."""

import numpy as np
import pytest

import flash_lib
from flash_invariance import decode_in_batch, num_splits_heuristic, split_kv_attention
from flash_lib import flash_attention, naive_attention


def decode_problem(seed=0, heads=8, n_k=4000, d=64, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((heads, n, d)).astype(dtype) for n in (1, n_k, n_k))


def test_heuristic_is_flash_attentions():
    # flash_attn/cute/interface.py: min(num_SMs // total_mblocks, 128, n_blocks); 1 for <= 4 blocks
    assert num_splits_heuristic(8, 132, 32) == 16
    assert num_splits_heuristic(8, 132, 4) == 1
    assert num_splits_heuristic(1, 132, 1000) == 128
    assert num_splits_heuristic(8, 132, 10) == 10
    assert num_splits_heuristic(200, 132, 32) == 1


def test_split_count_from_the_batch_changes_the_bits():
    q, k, v = decode_problem()
    seen = {decode_in_batch(q, k, v, batch_size=b).tobytes() for b in range(1, 33)}
    assert len(seen) == 7  # 16, 8, 5, 4, 3, 2 and 1 splits of 32 blocks: seven roundings


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_fixed_split_size_is_bitwise_invariant(dtype):
    q, k, v = decode_problem(seed=1, dtype=dtype)
    first = decode_in_batch(q, k, v, batch_size=1, fixed_split_size=256)
    for b in range(2, 65):
        np.testing.assert_array_equal(decode_in_batch(q, k, v, batch_size=b,
                                                      fixed_split_size=256), first)


@pytest.mark.parametrize("split_size", [1, 7, 256, 4000, 5000])
def test_split_kv_is_attention(split_size):
    q, k, v = decode_problem(seed=2, n_k=600, dtype=np.float64)
    out, lse = split_kv_attention(q, k, v, split_size=split_size, return_lse=True)
    ref, ref_lse = naive_attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-14)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_split_size_refused(bad):
    q, k, v = decode_problem(n_k=10)
    with pytest.raises(ValueError, match="split_size"):
        split_kv_attention(q, k, v, split_size=bad)


def test_flash_lib_is_batch_invariant():
    """A batch row's output has the bits it gets alone, on any batch, slice or thread count:
    the kernel tiles query rows and never reduces across the batch."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((6, 2, n, 32)).astype(np.float32) for n in (300, 700, 700))
    for workers in (1, 2):
        with flash_lib.threads(workers):
            full = flash_attention(q, k, v, causal=True)
            for start, stop in ((0, 1), (2, 3), (1, 4), (5, 6)):
                part = flash_attention(q[start:stop], k[start:stop], v[start:stop], causal=True)
                np.testing.assert_array_equal(part, full[start:stop])

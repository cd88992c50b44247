"""Memory, measured from outside with tracemalloc (``measure_peak_bytes``).

scratch = peak bytes during the call - bytes of the returned arrays. The claims:
flash's scratch does not depend on N and is a few tiles per worker thread; naive's grows as N².
"""

import numpy as np
import pytest

import flash_lib
from flash_lib import flash_attention, measure_peak_bytes, naive_attention

D = DV = 16  # small features keep N = 16384 quick; the tiles, not d, dominate the scratch


def inputs(n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((n, width)).astype(dtype) for width in (D, D, DV))


def scratch_bytes(kernel, n, dtype, **kwargs):
    """Peak bytes allocated by one call, minus its returned out and lse."""
    q, k, v = inputs(n, dtype)
    (out, lse), peak = measure_peak_bytes(kernel, q, k, v, return_lse=True, **kwargs)
    return peak - out.nbytes - lse.nbytes


def test_flash_scratch_is_the_same_for_n_1024_4096_16384():
    """At fixed blocks (256 × 512) flash's scratch is the same within 5% for N = 1024, 4096 and
    16384, while the score matrix it never stores grows 256-fold (4 MiB to 1 GiB in float32).

    One worker thread: with several, the peak depends on whether the workers happen to hold
    their tiles at the same instant, which is timing, not memory use (the bound below covers
    the threaded case). Causal, to halve the time of the N = 16384 run.
    """
    blocks = dict(block_q=256, block_k=512, causal=True)
    with flash_lib.threads(1):
        scratch_bytes(flash_attention, 600, np.float32, **blocks)  # first-call allocations aside
        scratch = {
            n: scratch_bytes(flash_attention, n, np.float32, **blocks) for n in (1024, 4096, 16384)
        }
    assert max(scratch.values()) <= 1.05 * min(scratch.values()), scratch


# NumPy's ufuncs may buffer broadcast operands in chunks of np.getbufsize() elements (8192),
# up to 3 operands of up to 8 bytes: 192 KiB at most per worker, whatever the tile size.
UFUNC_BUFFERS = 3 * np.getbufsize() * 8


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_q, block_k", [(64, 128), (256, 512)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_flash_scratch_is_a_few_tiles_per_worker(dtype, block_q, block_k, causal):
    """scratch <= W · (2 · block_q · (block_k + dv) · itemsize + UFUNC_BUFFERS), W = thread_count().

    Why 2 tiles' worth per worker: each worker holds one scores tile (block_q × block_k,
    reused across key blocks and overwritten by p = exp(s - m)), for a causal diagonal tile up
    to two boolean tiles (the causal pattern and its negation, 1 byte per entry, so at most
    half a float32 tile), and per query block acc, p·v and the scaled queries (block_q ×
    (2·dv + d), d = dv here) plus a handful of block_q vectors (m, l, alpha, ...). For these
    block sizes that is at most 2 · block_q · (block_k + dv) elements of the working dtype.
    N = 2048 is large enough for the kernel to use its threads (>= 2**20 scores).
    """
    itemsize = np.dtype(dtype).itemsize
    per_worker = 2 * block_q * (block_k + DV) * itemsize + UFUNC_BUFFERS
    scratch = scratch_bytes(
        flash_attention, 2048, dtype, block_q=block_q, block_k=block_k, causal=causal
    )
    workers = flash_lib.thread_count()
    assert scratch <= workers * per_worker, (scratch, workers, per_worker)


def test_naive_scratch_grows_as_n_squared():
    """naive holds the Nq × Nk scores and their exponentials: its scratch is at least two
    N × N float64 matrices and grows about 4× each time N doubles (N = 256 → 512 → 1024)."""
    scratch = {n: scratch_bytes(naive_attention, n, np.float64) for n in (256, 512, 1024)}
    for n in scratch:
        assert scratch[n] >= 2 * n * n * 8
    for n in (256, 512):
        assert 3.8 <= scratch[2 * n] / scratch[n] <= 4.2, scratch

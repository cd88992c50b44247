"""Training features (issue 24): attention sinks and dropout, forward and backward.

The oracle is the tests' dense one, ``helpers.dense_attention``, written from the definitions
and sharing no code with flash_lib: the whole score matrix with the variants applied as
explicit arrays (a boolean matrix of allowed pairs, softcap's tanh, ALiBi's bias matrix), the
sink appended as one more column of the softmax and removed after, the keep mask applied as
``P ∘ Z / (1 - p)``, and the textbook chain rule for the gradients. The tiled kernel is checked
against it and against ``naive_attention`` with the same keywords over every combination of
the variants; the gradients against central differences.
"""

import math
import re

import numpy as np
import pytest
from helpers import (
    VARIANTS,
    VS_DENSE,
    alibi_bias,
    assert_close_to_naive,
    check_central_differences,
    check_flash_equals_naive,
    close,
    dense_attention,
    grads,
    random_qkv,
)
from hypothesis import given
from hypothesis import strategies as st

import flash_lib
from flash_lib import (
    causal_mask,
    flash_attention,
    flash_attention_backward,
    measure_peak_bytes,
    naive_attention,
    naive_attention_backward,
    precise_attention,
    precise_attention_backward,
)


def sum_to(x, shape):
    """x summed over the axes an array of ``shape`` was broadcast along."""
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead)))
    return x.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1), keepdims=True).reshape(shape)


def forward_backward(kernel, q, k, v, dout, block_q, block_k, **kw):
    """``(out, lse, gradients)`` of flash (at these blocks), naive or precise."""
    if kernel == "flash":
        out, lse = flash_attention(q, k, v, return_lse=True, block_q=block_q, block_k=block_k, **kw)
        return out, lse, flash_attention_backward(q, k, v, out, lse, dout, block_q=block_q,
                                                  block_k=block_k, **kw)
    forward, backward = {"naive": (naive_attention, naive_attention_backward),
                         "precise": (precise_attention, precise_attention_backward)}[kernel]
    return forward(q, k, v, return_lse=True, **kw) + (backward(q, k, v, dout, **kw),)


# ---------------------------------------------------------------------------------------------
# Sinks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["flash", "naive", "precise"])
@pytest.mark.parametrize("case", ["plain", "causal+softcap+alibi", "mask", "broadcast"])
def test_sinks_against_the_dense_oracle(kernel, case):
    """out, lse, dq, dk, dv, dsinks of each kernel against the dense oracle with the sink as an
    extra column: within VS_DENSE (1e-13) of the larger scale (float64 against float64 and
    longdouble).
    ``broadcast``: sinks (H,) over a batch (2, H), k and v shared by the batch (their gradients
    and dsinks summed over it)."""
    rng = np.random.default_rng(20)
    n_q, n_k, h = 7, 10, 3
    q = 2 * rng.standard_normal((2, h, n_q, 5))
    k, v = 2 * rng.standard_normal((2, h, n_k, 5)), rng.standard_normal((2, h, n_k, 4))
    sinks = rng.standard_normal(h) * 2
    kw, ref_kw = {}, {}
    if case == "causal+softcap+alibi":
        slopes = np.array([0.5, 0.25, 0.125])
        kw = dict(causal=True, softcap=1.5, alibi_slopes=slopes)
        ref_kw = dict(allowed=causal_mask(n_q, n_k), softcap=1.5,
                      bias=alibi_bias(slopes, n_q, n_k))
    elif case == "mask":
        mask = rng.random((2, h, n_q, n_k)) < 0.4
        mask[0, 1, 2] = False  # an empty row: out 0, lse = sink
        kw, ref_kw = dict(mask=mask), dict(allowed=mask)
    elif case == "broadcast":
        k, v = k[:1], v[:1]
        sinks = sinks.reshape(1, h)
    dout = rng.standard_normal((2, h, n_q, 4))
    ref = dense_attention(q, k, v, dout, scale=1 / np.sqrt(5), sinks=sinks, **ref_kw)
    kw["sinks"] = sinks
    out, lse, got = forward_backward(kernel, q, k, v, dout, block_q=3, block_k=4, **kw)
    assert len(got) == 4
    expected = (ref.out, ref.lse, sum_to(ref.dq, q.shape), sum_to(ref.dk, k.shape),
                sum_to(ref.dv, v.shape), sum_to(ref.dsinks, sinks.shape))
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], (out, lse) + tuple(got),
                          expected):
        assert a.shape == b.shape, name
        assert close(a, b, VS_DENSE), (name, np.abs(np.asarray(a, float) - b).max())
    if case == "mask":
        assert np.all(out[0, 1, 2] == 0) and lse[0, 1, 2] == sinks[1]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_a_row_with_no_allowed_key_gives_zero_and_the_sink(causal, dtype):
    """A sink means no row is empty: a row whose keys are all masked gets out = 0 exactly and
    lse = sink exactly (m = sink, l = 1 from the start, and nothing added), in every kernel and
    dtype; its dq row is 0, and its dsinks share 0 (D = dO · 0). With causal and Nq > Nk the
    first Nq - Nk rows have no key."""
    rng = np.random.default_rng(21)
    q, k, v = random_qkv(rng, 9, 5, 4, dv=3, dtype=dtype, batch=(2,))
    dout = rng.standard_normal((2, 9, 3)).astype(dtype)
    sinks = np.array([0.75, -1.5])
    mask = np.ones((9, 5), bool)
    mask[6] = False
    kw = dict(sinks=sinks, causal=causal, mask=mask)
    empty = [6] + (list(range(4)) if causal else [])
    acc = np.float32 if dtype == np.float16 else dtype
    for attend in (flash_attention, naive_attention):
        out, lse = attend(q, k, v, return_lse=True, **kw)
        assert np.all(out[:, empty] == 0)
        np.testing.assert_array_equal(lse[:, empty], np.broadcast_to(
            sinks.astype(acc)[:, None], (2, len(empty))))
    for kernel in ("flash", "naive"):
        dq, dk, dv, dsinks = grads(kernel, q, k, v, dout, **kw)
        assert np.all(dq[:, empty] == 0) and dsinks.shape == (2,) and dsinks.dtype == acc


def test_sinks_gradient_matches_central_differences():
    """dsinks (and dq, dk, dv) against central differences of the forward, float64, with GQA,
    a window and softcap on top: one sink per query head."""
    rng = np.random.default_rng(22)
    q = rng.standard_normal((4, 8, 6))
    k, v = rng.standard_normal((2, 11, 6)), rng.standard_normal((2, 11, 3))
    sinks = rng.standard_normal(4)
    dout = rng.standard_normal((4, 8, 3))
    kw = dict(enable_gqa=True, window=(3, 2), softcap=2.0, block_q=3, block_k=4)
    analytic = grads("flash", q, k, v, dout, sinks=sinks, **kw)

    def f(q, k, v, sinks):
        return float((dout * flash_attention(q, k, v, sinks=sinks, **kw)).sum())

    check_central_differences(f, (q, k, v, sinks), analytic, rng)


def test_sinks_backward_without_sinks_returns_three():
    rng = np.random.default_rng(23)
    q, k, v = random_qkv(rng, 5, 6, 4)
    assert len(grads("flash", q, k, v, q[:, :4].copy())) == 3


@pytest.mark.parametrize(
    "sinks, error, message",
    [
        (np.ones(3), ValueError, "sinks of shape (3,) does not broadcast"),
        (np.array([1.0, np.inf, 0, 0]), ValueError, "sinks must be finite numbers"),
        (np.array([1.0, np.nan, 0, 0]), ValueError, "sinks must be finite numbers"),
        (np.array(["a"] * 4), TypeError, "sinks must be an array of real numbers"),
        (np.ones(4, bool), TypeError, "sinks must be an array of real numbers"),
    ],
)
def test_sinks_are_checked(sinks, error, message):
    """Each bad ``sinks``: an error naming it, from every kernel, forward and backward."""
    q, k, v = np.zeros((2, 4, 3, 5)), np.zeros((2, 4, 6, 5)), np.zeros((2, 4, 6, 4))
    out, lse, dout = np.zeros((2, 4, 3, 4)), np.zeros((2, 4, 3)), np.zeros((2, 4, 3, 4))
    for call in (lambda: flash_attention(q, k, v, sinks=sinks),
                 lambda: naive_attention(q, k, v, sinks=sinks),
                 lambda: precise_attention(q, k, v, sinks=sinks),
                 lambda: flash_attention_backward(q, k, v, out, lse, dout, sinks=sinks),
                 lambda: naive_attention_backward(q, k, v, dout, sinks=sinks),
                 lambda: precise_attention_backward(q, k, v, dout, sinks=sinks)):
        with pytest.raises(error, match=re.escape(message)):
            call()


def test_a_sink_beyond_the_compute_dtype_is_refused():
    """float16 inputs compute in float32: a sink of 1e39 is finite in float64, inf there."""
    q = np.zeros((3, 4), np.float16)
    with pytest.raises(ValueError, match="sinks must be finite numbers in the compute dtype float32"):
        flash_attention(q, q, q, sinks=np.array(1e39))


# ---------------------------------------------------------------------------------------------
# The dropout mask: 16 bits of Philox4x32-7 keyed by position
# ---------------------------------------------------------------------------------------------

import _flash_dropout  # noqa: E402 - flash_lib's private generator, its known answers tested here

# Random123's kat_vectors for philox4x32_10 (10 rounds): (counter, key, output)
KNOWN_ANSWERS_10 = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
# Triton 3.9's tl.randint4x(seed, offset, n_rounds=7) under TRITON_INTERPRET=1 (2026-12-01):
# counter (offset mod 2³², offset // 2³², 0, 0), key (seed mod 2³², seed // 2³²)
KNOWN_ANSWERS_7 = [
    ((0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    ((1, 0, 0, 0), (0, 0), (0x983A586E, 0xB0CC9511, 0x5850FBB9, 0x9CF9ACD8)),
    ((0x243F6A88, 0x85A308D3, 0, 0), (0xA4093822, 0x299F31D0),
     (0x469A1815, 0xB11D0428, 0x78C15B7C, 0x0F092634)),
    ((0xFFFFFFFF, 0x7FFFFFFF, 0, 0), (0xFFFFFFFF, 0x7FFFFFFF),
     (0x901A508D, 0x279BCA9F, 0x2A648EEE, 0x76230C8B)),
]


@pytest.mark.parametrize("rounds, counter, key, expected",
                         [(10, *case) for case in KNOWN_ANSWERS_10]
                         + [(7, *case) for case in KNOWN_ANSWERS_7])
def test_philox_reproduces_the_known_answers(rounds, counter, key, expected):
    """The plain rounds, the in-place rounds the kernels run on their buffers, and their last
    round packed two words to a uint64 (what keep() compares), give Random123's 10-round
    outputs and Triton's 7-round ones: the same round function, key schedule and word order."""
    assert tuple(int(w) for w in _flash_dropout.philox4x32(counter, key, rounds=rounds)) == expected
    buffers = [np.empty((2, 1, 1), np.uint64) for _ in range(3)]
    state = tuple(np.full((1, 1), c, np.uint64) for c in counter)
    words = _flash_dropout._rounds(buffers, state, key[0] | key[1] << 32, rounds=rounds)
    assert tuple(int(w[0, 0]) for w in words) == expected
    packed = _flash_dropout._rounds(buffers, state, key[0] | key[1] << 32, rounds=rounds, packed=True)
    assert [int(x) for x in packed[0, 0]] == [expected[0] | expected[1] << 32,
                                              expected[2] | expected[3] << 32]


def test_the_generator_is_flashattention2s_seven_rounds():
    """flash_lib draws with 7 rounds (FlashAttention-2's philox.cuh): its words are the 7-round
    known answers', not the 10-round ones'."""
    assert _flash_dropout.ROUNDS == 7
    (counter, key, expected), = KNOWN_ANSWERS_7[:1]
    assert tuple(int(w) for w in _flash_dropout.philox4x32(counter, key)) == expected


def element_numbers(seed, n_batch, rows, keys):
    """The 16-bit number of every element (b, i, j), from the plain rounds: counter
    (j // 8, i, b mod 2³², b // 2³²), key (seed mod 2³², seed // 2³²), word (j % 8) // 2, its
    low 16 bits for even j and its high 16 bits for odd j."""
    b, i, j = np.meshgrid(np.arange(n_batch), np.arange(*rows), np.arange(*keys), indexing="ij")
    words = _flash_dropout.philox4x32((j // 8, i, b & 0xFFFFFFFF, b >> 32),
                                      (seed & 0xFFFFFFFF, seed >> 32))
    word = np.choose((j % 8) // 2, words)
    return np.where(j % 2 == 0, word & 0xFFFF, word >> 16)


@pytest.mark.parametrize("chunk", [1, 7, 1 << 15])
@pytest.mark.parametrize("rows, keys", [
    ((2**31 + 3, 2**31 + 12), (5, 27)),  # not aligned to 8 keys, at a large row offset
    ((0, 9), (16, 64)),  # aligned: the comparison writes the mask directly
    ((2**32 - 2, 2**32), (2**35 - 13, 2**35)),  # the last positions a counter word holds
])
def test_the_chunked_mask_is_the_plain_rounds_element_by_element(chunk, rows, keys, monkeypatch):
    """keep() in chunks of any size (one counter, 7 counters, the default) gives number >= t
    of each element, aligned or not to a counter's 8 keys, at a large seed and offsets."""
    monkeypatch.setattr(_flash_dropout, "CHUNK", chunk)
    seed, t = 2**64 - 12345, _flash_dropout.threshold(0.3)
    expected = element_numbers(seed, 3, rows, keys) >= t
    np.testing.assert_array_equal(_flash_dropout.keep(seed, t, 3, rows, keys), expected)


@pytest.mark.parametrize("p", [1e-6, 0.1, 0.3, 0.5, 0.9, 1 - 1e-6])
def test_the_keep_probability_is_within_2_to_the_minus_17_of_1_minus_p(p):
    """t = round(p·2¹⁶) of the 2¹⁶ numbers are dropped: probability 1 - t/2¹⁶, exactly, within
    2⁻¹⁷ of 1 - p; and an element whose number is t - 1 is dropped, t kept."""
    t = _flash_dropout.threshold(p)
    assert abs((1 - t / 2**16) - (1 - p)) <= 2**-17
    numbers = np.array([[max(t - 1, 0) | min(t, 0xFFFF) << 16, 0, 0, 0]], np.uint64)
    kept = numbers.view(np.uint16).reshape(1, 4, 4)[..., _flash_dropout.ORDER] >= t
    assert kept[0, 0, :2].tolist() == [t == 0, t <= 0xFFFF]


TRITON_SCRIPT = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"  # before importing triton: run on the CPU
import torch, triton
import triton.language as tl

@triton.jit
def words(seed, offsets, out, N: tl.constexpr):
    idx = tl.arange(0, N)
    r0, r1, r2, r3 = tl.randint4x(seed, tl.load(offsets + idx), n_rounds=7)
    tl.store(out + 4 * idx, r0); tl.store(out + 4 * idx + 1, r1)
    tl.store(out + 4 * idx + 2, r2); tl.store(out + 4 * idx + 3, r3)

seed, offsets = json.loads(sys.argv[1])
off = torch.tensor(offsets, dtype=torch.int64)
out = torch.empty(4 * len(offsets), dtype=torch.int32)
words[(1,)](seed, off, out, N=len(offsets))
print(json.dumps([int(x) & 0xFFFFFFFF for x in out.tolist()]))
"""


def test_the_mask_is_tritons_philox():
    """Triton's own ``tl.randint4x(seed, offset, n_rounds=7)`` (Philox4x32-7 at counter (offset
    mod 2³², offset // 2³², 0, 0)) in a tiny kernel under ``TRITON_INTERPRET=1``: element
    (0, i, j) of dropout_keep is the low (j even) or high (j odd) 16 bits of Triton's word
    (j % 8) // 2 at offset ``i·2³² + j // 8``, compared with t. A Triton dropout kernel keyed
    this way draws flash_lib's mask bit for bit."""
    import importlib.util
    import json
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("needs triton and torch, which `make setup` installs where Triton has wheels")
    seed, rows, n_k, p = 0x0123456789ABCDEF, (0, 1, 7, 2**31 - 5), 32, 0.5  # int64 offsets
    offsets = [i << 32 | c for i in rows for c in range(n_k // 8)]
    run = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, json.dumps([seed, offsets])],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    words = np.array(json.loads(run.stdout.splitlines()[-1]), np.uint64).reshape(len(rows), n_k // 2)
    theirs = np.stack([words & 0xFFFF, words >> 16], axis=-1).reshape(len(rows), n_k)
    ours = np.concatenate([element_numbers(seed, 1, (i, i + 1), (0, n_k))[0] for i in rows])
    np.testing.assert_array_equal(ours, theirs)
    t = _flash_dropout.threshold(p)
    for row, i in enumerate(rows):
        np.testing.assert_array_equal(flash_lib.dropout_keep(seed, p, (1, n_k), offset=(i, 0))[0],
                                      theirs[row] >= t)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_the_keep_rate_is_within_its_binomial_interval(p):
    """Over n = 4·512·512 elements (2 heads, 2 batch entries) the kept count K is Binomial(n,
    q) with q = 1 - round(p·2¹⁶)/2¹⁶ if the numbers are uniform and independent: |K - nq| <=
    5·sqrt(n·q·(1 - q)) fails with probability below 6e-7 (normal tail at 5 sigma), and a
    generator off by 1% of p (or rows sharing counters, which correlate neighbours) fails it.
    Also per row and per column blocks of 64: no block further than 5 sigma of its own."""
    shape = (2, 2, 512, 512)
    keep = flash_lib.dropout_keep(1234, p, shape)
    n = keep.size
    q = 1 - _flash_dropout.threshold(p) / 2**16
    assert abs(keep.sum() - n * q) <= 5 * np.sqrt(n * q * (1 - q))
    blocks = keep.reshape(-1, 8, 64, 8, 64).sum(axis=(2, 4))  # 64 x 64 blocks
    m = 64 * 64
    assert np.abs(blocks - m * q).max() <= 6 * np.sqrt(m * q * (1 - q))  # 256 blocks: 6 sigma
    # neighbours independent: the rate of "both kept" between adjacent keys and adjacent rows
    for a, b in ((keep[..., :-1], keep[..., 1:]), (keep[..., :-1, :], keep[..., 1:, :])):
        both, pairs = (a & b).sum(), a.size
        assert abs(both - pairs * q * q) <= 5 * np.sqrt(pairs * q * q * (1 - q * q))


def test_a_shards_mask_is_the_slice_of_the_whole():
    """dropout_keep at an offset is the slice of the whole mask: a shard of rows 100..300 and
    keys 37..290 (not a multiple of 4) with dropout_offset = (100, 37), for each batch entry."""
    whole = flash_lib.dropout_keep(99, 0.3, (3, 400, 300))
    shard = flash_lib.dropout_keep(99, 0.3, (3, 200, 253), offset=(100, 37))
    np.testing.assert_array_equal(shard, whole[:, 100:300, 37:290])
    assert flash_lib.dropout_keep(99, 0.0, (2, 3)).all()


def test_dropout_keep_is_checked():
    for args, error, message in [
        ((1, 0.1, (3,)), ValueError, "shape must be a tuple (..., Nq, Nk)"),
        ((1, 0.1, (3, -1)), ValueError, "shape must be a tuple (..., Nq, Nk)"),
        ((None, 0.1, (3, 3)), ValueError, "dropout_seed must be an integer in [0, 2**64)"),
        ((1, 1.0, (3, 3)), ValueError, "dropout_p must be in [0, 1)"),
        ((1, "0.1", (3, 3)), TypeError, "dropout_p must be a real number"),
    ]:
        with pytest.raises(error, match=re.escape(message)):
            flash_lib.dropout_keep(*args)
    with pytest.raises(TypeError, match=re.escape("dropout_offset must be a pair (row, key)")):
        flash_lib.dropout_keep(1, 0.1, (3, 3), offset=(1,))


@pytest.mark.parametrize("p", [0.5, 0.9, 0.99, 0.997, 1 - 2**-9])
def test_dropout_averages_to_p_v_up_to_its_stated_bound(p):
    """E[P∘Z/(1 - p)] = P within a relative 2⁻⁸ for every p accepted (flash_lib.flash_attention's
    docstring): the keep probability 1 - round(p·2¹⁶)/2¹⁶ is within 2⁻¹⁷ of 1 - p, which is
    2⁻¹⁷/(1 - p) <= 2⁻⁸ of it while p <= 1 - 2⁻⁹; and a 2²² mask keeps that fraction, within 6
    binomial standard deviations, so the kernels' mean weight is the softmax's."""
    keep_probability = 1 - round(p * 2**16) / 2**16
    assert abs(keep_probability / (1 - p) - 1) <= 2**-8
    mask = flash_lib.dropout_keep(SEED, p, (4, 1024, 1024))
    sigma = math.sqrt(keep_probability * (1 - keep_probability) / mask.size)
    assert abs(mask.mean() - keep_probability) <= 6 * sigma
    # the whole call: with q = 0 every weight is 1/Nk, so each row of out = (P∘Z/(1-p))·1 averages to 1
    n = 4096
    out = flash_lib.flash_attention(np.zeros((64, 1, 8)), np.zeros((64, n, 8)), np.ones((64, n, 1)),
                                    dropout_p=p, dropout_seed=SEED)
    mean, spread = float(out.mean()), math.sqrt(keep_probability * (1 - keep_probability)
                                                / (64 * n)) / (1 - p)
    assert abs(mean - keep_probability / (1 - p)) <= 6 * spread
    assert abs(mean - 1) <= 2**-8 + 6 * spread


@pytest.mark.parametrize("p", [0.999, 0.99999, 1 - 2**-17, 0.9999999])
def test_dropout_p_the_16_bit_threshold_cannot_keep_is_refused(p):
    """Above 1 - 2⁻⁹ the threshold misstates 1 - p by more than 2⁻⁸ of it (at p = 0.99999 the
    mask keeps 1.53e-5, not 1e-5; from 1 - 2⁻¹⁷ on, nothing): refused, naming dropout_p and the
    largest value accepted, by every kernel and by dropout_keep."""
    q = np.ones((1, 4, 8))
    for call in (lambda: flash_lib.flash_attention(q, q, q, dropout_p=p, dropout_seed=1),
                 lambda: flash_lib.naive_attention(q, q, q, dropout_p=p, dropout_seed=1),
                 lambda: flash_lib.dropout_keep(1, p, (4, 4))):
        with pytest.raises(ValueError, match=r"dropout_p = .* above the largest accepted, "
                                             r"1 - 2\*\*-9 = 0.998046875"):
            call()


# ---------------------------------------------------------------------------------------------
# Dropout in the kernels
# ---------------------------------------------------------------------------------------------

SEED = 0x5EED_0F_D20


@pytest.mark.parametrize("kernel", ["flash", "naive", "precise"])
@pytest.mark.parametrize("p", [0.1, 0.6])
@pytest.mark.parametrize("case", ["plain", "causal+softcap+alibi+sinks", "mask+sinks", "broadcast"])
def test_dropout_against_the_dense_oracle(kernel, p, case):
    """out, lse (undropped), dq, dk, dv (and dsinks) of each kernel against the dense oracle
    with Z = dropout_keep(seed, p, (B, H, Nq, Nk)): within VS_DENSE (1e-13) of the larger
    scale, float64."""
    rng = np.random.default_rng(30)
    n_q, n_k, h = 9, 13, 3
    q = 2 * rng.standard_normal((2, h, n_q, 5))
    k, v = 2 * rng.standard_normal((2, h, n_k, 5)), rng.standard_normal((2, h, n_k, 4))
    kw, ref_kw = dict(dropout_p=p, dropout_seed=SEED), {}
    if "sinks" in case:
        kw["sinks"] = ref_kw["sinks"] = rng.standard_normal(h)
    if "causal" in case:
        slopes = np.array([0.5, 0.25, 0.125])
        kw.update(causal=True, softcap=1.5, alibi_slopes=slopes)
        ref_kw.update(allowed=causal_mask(n_q, n_k), softcap=1.5,
                      bias=alibi_bias(slopes, n_q, n_k))
    elif "mask" in case:
        mask = rng.random((2, h, n_q, n_k)) < 0.6
        kw["mask"] = ref_kw["allowed"] = mask
    elif case == "broadcast":
        k, v = k[:1], v[:1]  # shared by the batch: the mask still differs per batch entry
    dout = rng.standard_normal((2, h, n_q, 4))
    keep = flash_lib.dropout_keep(SEED, p, (2, h, n_q, n_k))
    ref = dense_attention(q, k, v, dout, scale=1 / np.sqrt(5), keep=keep, p=p, **ref_kw)
    out, lse, got = forward_backward(kernel, q, k, v, dout, block_q=4, block_k=5, **kw)
    expected = (ref.out, ref.lse, sum_to(ref.dq, q.shape), sum_to(ref.dk, k.shape),
                sum_to(ref.dv, v.shape))
    if "sinks" in case:
        expected += (sum_to(ref.dsinks, (h,)),)
    assert len(got) == len(expected) - 2
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], (out, lse) + tuple(got),
                          expected):
        assert a.shape == b.shape, name
        assert close(a, b, VS_DENSE), (name, np.abs(np.asarray(a, float) - b).max())


def test_the_dense_oracle_is_not_blind_to_the_mask():
    """The oracle's dropout changes the output: against no dropout, and against another seed."""
    rng = np.random.default_rng(31)
    q, k, v = random_qkv(rng, 6, 8, 4, dv=3)
    dout = rng.standard_normal((6, 3))
    a = dense_attention(q, k, v, dout, scale=0.5, keep=flash_lib.dropout_keep(1, 0.5, (6, 8)),
                        p=0.5)
    b = dense_attention(q, k, v, dout, scale=0.5, keep=flash_lib.dropout_keep(2, 0.5, (6, 8)),
                        p=0.5)
    c = dense_attention(q, k, v, dout, scale=0.5)
    for x, y in ((a, b), (a, c)):
        assert not close(x.out, y.out, 1e-3) and not close(x.dq, y.dq, 1e-3)


@given(**VARIANTS, sinks=st.sampled_from([None, "per head", "per batch and head", "one"]),
       dropout_p=st.sampled_from([0.0, 0.2, 0.7]),
       offset=st.sampled_from([(0, 0), (3, 5), (2**20, 2**33)]))
def test_flash_equals_naive_for_every_combination(sinks, dropout_p, offset, **variants):
    """test_variants.py's combinations (``helpers.VARIANTS``: mask, mask_mod, causal, window,
    softcap, ALiBi, GQA, blocks) with sinks and dropout on top: forward (out, lse) and backward
    (dq, dk, dv, dsinks) of flash against naive, float64, within VARIANTS_VS_NAIVE (1e-12) of
    the larger scale; empty rows exact."""
    extra = dict(dropout_p=dropout_p, dropout_seed=SEED + variants["n_q"], dropout_offset=offset)
    if sinks is not None:
        extra["sinks"] = {"per head": np.array([0.3, -1.2, 2.0, 0.0]),
                          "per batch and head": np.arange(8.0).reshape(2, 4) / 4 - 1,
                          "one": np.array(0.5)}[sinks]
    check_flash_equals_naive(**variants, **extra)


def test_dropout_gradients_match_central_differences():
    """At a fixed seed the mask is a constant, so the forward is a smooth function of q, k, v
    and sinks: dq, dk, dv, dsinks against central differences (ε = 1e-5), float64, with
    dropout p = 0.3, a sink per head, causal, softcap and ALiBi, blocks that split the tiles."""
    rng = np.random.default_rng(32)
    q, k, v = random_qkv(rng, 12, 15, 6, dv=4, batch=(2,))
    sinks = np.array([0.3, -0.8])
    dout = rng.standard_normal((2, 12, 4))
    kw = dict(dropout_p=0.3, dropout_seed=SEED, causal=True, softcap=2.0,
              alibi_slopes=np.array([0.2, 0.1]), block_q=5, block_k=4)
    analytic = grads("flash", q, k, v, dout, sinks=sinks, **kw)

    def f(q, k, v, sinks):
        return float((dout * flash_attention(q, k, v, sinks=sinks, **kw)).sum())

    check_central_differences(f, (q, k, v, sinks), analytic, rng)


def kept_pairs_forward(n, p, seed, offset=(0, 0), **kw):
    """Which pairs the forward kept: with q = 0 every allowed pair weighs 1/Nk, and with v the
    identity out_ij = P_ij · Z_ij / (1 - p) is nonzero exactly where pair (i, j) was kept."""
    q = np.zeros((2, n, 4))
    k = np.random.default_rng(0).standard_normal((2, n, 4))
    out = flash_attention(q, k, np.eye(n), dropout_p=p, dropout_seed=seed, dropout_offset=offset,
                          **kw)
    return out != 0


def kept_pairs_backward(n, p, seed, offset=(0, 0), **kw):
    """Which pairs the backward's regenerated mask kept: with dout the identity,
    dv_jc = Σ_i P̃_ij dO_ic = P̃_cj, nonzero exactly where pair (c, j) was kept."""
    q = np.zeros((2, n, 4))
    k = np.random.default_rng(0).standard_normal((2, n, 4))
    v, dout = np.eye(n), np.broadcast_to(np.eye(n), (2, n, n))
    drop = dict(dropout_p=p, dropout_seed=seed, dropout_offset=offset)
    out, lse = flash_attention(q, k, v, return_lse=True, **drop, **kw)
    dv = flash_attention_backward(q, k, v, out, lse, dout, **drop, **kw)[2]
    return np.swapaxes(dv, -1, -2) != 0  # dv of v (n, n) summed over the batch: kept in either


@pytest.mark.parametrize("blocks", [(1, 1), (3, 7), (16, 16), (40, 9), (512, 512)])
def test_the_kept_pairs_are_dropout_keeps_whatever_the_blocks(blocks):
    """The forward keeps exactly dropout_keep's pairs and the backward regenerates exactly
    them, for block sizes that do and do not divide N = 40 (and one larger than N)."""
    n, p = 40, 0.4
    kw = dict(block_q=blocks[0], block_k=blocks[1])
    keep = flash_lib.dropout_keep(SEED, p, (2, n, n))
    np.testing.assert_array_equal(kept_pairs_forward(n, p, SEED, **kw), keep)
    np.testing.assert_array_equal(kept_pairs_backward(n, p, SEED, **kw), keep.any(axis=0))


def test_the_offset_moves_the_mask_as_a_shard_of_the_whole():
    """A kernel call with dropout_offset (r, c) keeps dropout_keep(..., offset=(r, c))'s pairs,
    forward and backward: the shard's slice of the whole problem's mask, so shards computed apart (flash_dask) drop
    the same pairs as one call. And the merge of two key shards of a query shard, each at its
    offset, is the whole call's rows (to rounding)."""
    n, p = 24, 0.5
    keep = flash_lib.dropout_keep(SEED, p, (2, 100, 200))
    np.testing.assert_array_equal(kept_pairs_forward(n, p, SEED, offset=(60, 130)),
                                  keep[:, 60:84, 130:154])
    np.testing.assert_array_equal(kept_pairs_backward(n, p, SEED, offset=(60, 130), block_q=7,
                                                      block_k=5),
                                  keep[:, 60:84, 130:154].any(axis=0))
    rng = np.random.default_rng(33)
    q, k, v = random_qkv(rng, 30, 50, 4, dv=3, batch=(2,))
    drop = dict(dropout_p=p, dropout_seed=SEED)
    whole = flash_attention(q, k, v, **drop)
    rows = slice(10, 30)
    a = flash_attention(q[:, rows], k[:, :21], v[:, :21], return_lse=True,
                        dropout_offset=(10, 0), **drop)
    b = flash_attention(q[:, rows], k[:, 21:], v[:, 21:], return_lse=True,
                        dropout_offset=(10, 21), **drop)
    merged, _ = flash_lib.merge_attention(*a, *b)
    assert close(merged, whole[:, rows])


def test_dropout_is_bit_identical_on_1_2_and_4_threads():
    """The mask is a function of position and the dQ shares are added in order: out, lse and
    every gradient bit for bit the same on 1, 2 and 4 threads (N large enough to use them)."""
    rng = np.random.default_rng(34)
    q, k, v = random_qkv(rng, 512, 512, 16, batch=(4,))
    dout = rng.standard_normal(q.shape)
    kw = dict(dropout_p=0.2, dropout_seed=SEED, sinks=np.array(0.5), causal=True, block_q=128,
              block_k=128)
    results = []
    for n in (1, 2, 4):
        with flash_lib.threads(n):
            out, lse = flash_attention(q, k, v, return_lse=True, **kw)
            results.append((out, lse) + flash_attention_backward(q, k, v, out, lse, dout, **kw))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_dropout_p_zero_is_bit_identical_to_no_dropout(dtype):
    """dropout_p = 0 (with or without a seed) runs no generator and no extra operation: the
    same bits as a call without dropout, forward and backward, flash and naive."""
    rng = np.random.default_rng(35)
    q, k, v = random_qkv(rng, 20, 23, 8, dtype=dtype, batch=(2,))
    dout = rng.standard_normal((2, 20, 8)).astype(dtype)
    kw = dict(causal=True, block_q=7, block_k=6)
    out, lse = flash_attention(q, k, v, return_lse=True, **kw)
    plain = (out, lse) + flash_attention_backward(q, k, v, out, lse, dout, **kw)
    for drop in (dict(dropout_p=0.0), dict(dropout_p=0, dropout_seed=3)):
        out, lse = flash_attention(q, k, v, return_lse=True, **kw, **drop)
        got = (out, lse) + flash_attention_backward(q, k, v, out, lse, dout, **kw, **drop)
        for a, b in zip(plain, got):
            np.testing.assert_array_equal(a, b)
    kw = dict(causal=True)
    np.testing.assert_array_equal(naive_attention(q, k, v, **kw),
                                  naive_attention(q, k, v, dropout_p=0.0, **kw))
    for a, b in zip(naive_attention_backward(q, k, v, dout, **kw),
                    naive_attention_backward(q, k, v, dout, dropout_p=0.0, **kw)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dropout_in_low_precision_against_naive(dtype):
    """float32 and float16 inputs with dropout and a sink: flash against naive within the
    suite's tolerances (both compute in float32 and apply the same mask)."""
    rng = np.random.default_rng(36)
    q, k, v = random_qkv(rng, 37, 41, 8, dtype=dtype, batch=(2,))
    kw = dict(dropout_p=0.25, dropout_seed=SEED, sinks=np.array([0.5, -1.0]), causal=True)
    out, lse = flash_attention(q, k, v, return_lse=True, block_q=8, block_k=16, **kw)
    ref, ref_lse = naive_attention(q, k, v, return_lse=True, **kw)
    assert_close_to_naive(out, lse, ref, ref_lse, v, dtype)


QKV = tuple(np.zeros(shape) for shape in ((2, 4, 3, 5), (2, 4, 6, 5), (2, 4, 6, 4)))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(dropout_p="0.1", dropout_seed=1), TypeError, "dropout_p must be a real number in [0, 1), got '0.1'"),
        (dict(dropout_p=True, dropout_seed=1), TypeError, "dropout_p must be a real number"),
        (dict(dropout_p=None), TypeError, "dropout_p must be a real number"),
        (dict(dropout_p=1.0, dropout_seed=1), ValueError, "dropout_p must be in [0, 1)"),
        (dict(dropout_p=-0.1, dropout_seed=1), ValueError, "dropout_p must be in [0, 1)"),
        (dict(dropout_p=float("nan"), dropout_seed=1), ValueError, "dropout_p must be in [0, 1)"),
        (dict(dropout_p=0.1), ValueError, "dropout_seed must be an integer in [0, 2**64) when dropout_p > 0"),
        (dict(dropout_p=0.1, dropout_seed=1.0), ValueError, "dropout_seed must be an integer"),
        (dict(dropout_p=0.1, dropout_seed=-1), ValueError, "dropout_seed must be an integer"),
        (dict(dropout_p=0.1, dropout_seed=2**64), ValueError, "dropout_seed must be an integer"),
        (dict(dropout_p=0.1, dropout_seed=True), ValueError, "dropout_seed must be an integer"),
        (dict(dropout_p=0.1, dropout_seed=1, dropout_offset=(1,)), TypeError,
         "dropout_offset must be a pair (row, key) of non-negative integers"),
        (dict(dropout_p=0.1, dropout_seed=1, dropout_offset=(1, 2.0)), TypeError,
         "dropout_offset must be a pair (row, key)"),
        (dict(dropout_p=0.1, dropout_seed=1, dropout_offset=5), TypeError,
         "dropout_offset must be a pair (row, key)"),
        (dict(dropout_p=0.1, dropout_seed=1, dropout_offset=(0, -1)), ValueError,
         "dropout_offset must be non-negative"),
        (dict(dropout_p=0.1, dropout_seed=1, dropout_offset=(2**32 - 2, 0)), ValueError,
         "dropout_offset (4294967294, 0) puts a position beyond the counter's 32-bit words"),
        (dict(dropout_p=0.1, dropout_seed=1, dropout_offset=(0, 2**35 - 5)), ValueError,
         "dropout_offset (0, 34359738363) puts a position beyond the counter's 32-bit words"),
    ],
)
def test_dropout_arguments_are_checked(kwargs, error, message):
    """Each bad dropout argument: an error naming it and what it got, from every kernel,
    forward and backward (and dropout_keep for the shared checks)."""
    q, k, v = QKV
    out, lse, dout = np.zeros((2, 4, 3, 4)), np.zeros((2, 4, 3)), np.zeros((2, 4, 3, 4))
    for call in (lambda: flash_attention(q, k, v, **kwargs),
                 lambda: naive_attention(q, k, v, **kwargs),
                 lambda: precise_attention(q, k, v, **kwargs),
                 lambda: flash_attention_backward(q, k, v, out, lse, dout, **kwargs),
                 lambda: naive_attention_backward(q, k, v, dout, **kwargs),
                 lambda: precise_attention_backward(q, k, v, dout, **kwargs)):
        with pytest.raises(error, match=re.escape(message)):
            call()


# ---------------------------------------------------------------------------------------------
# Memory: no N × N mask anywhere
# ---------------------------------------------------------------------------------------------


def scratch(n, backward, **kw):
    """Peak bytes of one call (forward, or backward given the forward's results) minus its
    results, float32, d = dv = 16, one thread."""
    rng = np.random.default_rng(37)
    q, k, v = (rng.standard_normal((n, 16)).astype(np.float32) for _ in range(3))
    out, lse = flash_attention(q, k, v, return_lse=True, **kw)
    if not backward:
        (out, lse), peak = measure_peak_bytes(flash_attention, q, k, v, return_lse=True, **kw)
        return peak - out.nbytes - lse.nbytes
    grads_, peak = measure_peak_bytes(flash_attention_backward, q, k, v, out, lse, out, **kw)
    return peak - sum(g.nbytes for g in grads_)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("feature", ["dropout", "sinks"])
def test_scratch_is_flat_in_n_with_dropout_and_sinks(feature, backward):
    """With dropout (or a sink), at fixed blocks 256 × 512, the scratch of the forward and of
    the backward grows by at most the O(N) vectors the plain kernel holds (the backward's D and
    lse, 8 bytes a row), from N = 1024 to 4096, while a stored N × N keep mask would grow
    16-fold (1 MiB to 16 MiB of booleans); and the mask adds at most a few tiles' worth over
    the plain kernel: the keep tile (1 byte per pair), in the backward its scaled copy and the
    dropped P (4 bytes per pair each), and Philox's buffers for one chunk of counters."""
    kw = dict(block_q=256, block_k=512, causal=True)
    extra = dict(dropout_p=0.1, dropout_seed=SEED) if feature == "dropout" else dict(sinks=np.array(0.5))
    with flash_lib.threads(1):
        scratch(600, backward, **kw, **extra)  # first-call allocations aside
        with_it = {n: scratch(n, backward, **kw, **extra) for n in (1024, 4096)}
        plain = scratch(4096, backward, **kw)
    assert with_it[4096] - with_it[1024] <= 0.05 * with_it[1024] + 8 * (4096 - 1024), with_it
    tile = 256 * 512
    # three buffers of two uint64 words, eight keys' bits a counter
    chunk_buffers = (3 * 2 * 8 + 8) * _flash_dropout.CHUNK
    ufunc_buffers = 3 * np.getbufsize() * 8  # bool -> float32 casts are buffered (test_memory)
    # the keep masks of one draw (bool), Z / (1 - p) and P ∘ Z / (1 - p) (float32, backward only)
    drawn = _flash_dropout.TILES_PER_DRAW * tile
    assert with_it[4096] - plain <= drawn + tile * (4 + 4) + chunk_buffers + ufunc_buffers, (with_it, plain)

"""The variants: sliding window, softcap, ALiBi, grouped-query attention, mask_mod.

Each is checked three ways. The oracle itself (naive) against an explicit dense construction:
a boolean mask for window and mask_mod, the tests' dense oracle (``helpers.dense_attention``)
with a bias matrix for ALiBi and its tanh for softcap, k and v repeated per query head for GQA
(and PyTorch SDPA's enable_gqa when torch is installed). The tiled kernel, forward and
backward, against naive with the same keywords, alone and combined, over random shapes and
blocks. And the tiles: what the band and mask_mod rule out is never computed.
"""

import numpy as np
import pytest
from helpers import (
    NAIVE_VS_DENSE,
    VARIANTS,
    alibi_bias,
    check_central_differences,
    check_flash_equals_naive,
    close,
    dense_attention,
    grads,
    random_qkv,
    window_mask,
)
from hypothesis import given

import flash_lib
from flash_lib import (
    causal_mask,
    flash_attention,
    flash_attention_backward,
    measure_peak_bytes,
    naive_attention,
    naive_attention_backward,
    tile_schedule,
)


# ---------------------------------------------------------------------------------------------
# The oracle against explicit constructions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [(3, 2), (0, 0), (None, 1), (4, None), (0, None)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q, n_k", [(9, 9), (6, 11), (11, 6)])
def test_naive_window_is_the_explicit_band_mask(window, causal, n_q, n_k):
    """naive(window=w) is bit-for-bit naive with the band written out as a boolean mask (ANDed
    with the bottom-right causal mask), forward and backward, for Nq = Nk, Nq < Nk, Nq > Nk."""
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, n_q, n_k, 4, dv=3)
    dout = rng.standard_normal((n_q, 3))
    mask = window_mask(n_q, n_k, *window)
    if causal:
        mask &= causal_mask(n_q, n_k)
    np.testing.assert_array_equal(naive_attention(q, k, v, window=window, causal=causal),
                                  naive_attention(q, k, v, mask=mask))
    for a, b in zip(naive_attention_backward(q, k, v, dout, window=window, causal=causal),
                    naive_attention_backward(q, k, v, dout, mask=mask)):
        np.testing.assert_array_equal(a, b)


def test_naive_mask_mod_is_the_mask_it_describes():
    """naive(mask_mod=f) is bit-for-bit naive(mask=f evaluated on every pair); f may return
    leading dims (here one document layout per sequence of the batch)."""
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 20, 20, 4, dv=3, batch=(2,))
    docs = np.array([np.repeat([0, 1, 2, 3], 5), np.repeat([0, 1], 10)])  # (batch, N)

    def same_document(q_idx, k_idx):
        return docs[:, q_idx] == docs[:, k_idx]  # (2, tile_q, tile_k)

    dense = same_document(np.arange(20)[:, None], np.arange(20)[None, :])
    np.testing.assert_array_equal(naive_attention(q, k, v, mask_mod=same_document),
                                  naive_attention(q, k, v, mask=dense))


@pytest.mark.parametrize("causal", [False, True])
def test_naive_alibi_is_the_explicit_bias_matrix(causal):
    """naive(alibi_slopes) against softmax(τ·q kᵀ + B) with B_hij = -slope_h·|i + (Nk - Nq) - j|
    written out (``alibi_bias``), per head, for Nq < Nk (the offset matters)."""
    rng = np.random.default_rng(3)
    n_q, n_k, heads = 7, 12, 3
    q, k, v = random_qkv(rng, n_q, n_k, 4, dv=3, batch=(2, heads))
    slopes = np.array([0.5, 0.25, 0.125])
    bias = alibi_bias(slopes, n_q, n_k)  # (heads, Nq, Nk)
    allowed = causal_mask(n_q, n_k) if causal else None
    got = naive_attention(q, k, v, alibi_slopes=slopes, causal=causal)
    want = dense_attention(q, k, v, scale=0.5, bias=bias, allowed=allowed).out
    assert close(got, want, NAIVE_VS_DENSE)


def test_alibi_written_as_attention_gyms_per_row_shift_is_the_same_under_causal():
    """attention-gym's mods/alibi.py adds slope·(kv_idx - q_idx) instead. Under causal, where
    j <= i + (Nk - Nq), that is -slope·|i + (Nk - Nq) - j| + slope·(Nk - Nq): the same bias
    plus a constant, which softmax ignores, so the outputs agree. Without causal they differ
    (|·| is not linear on both sides of the diagonal)."""
    rng = np.random.default_rng(4)
    n_q, n_k = 6, 10
    q, k, v = random_qkv(rng, n_q, n_k, 4, dv=3)
    slope = 0.3
    i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    gym = slope * (j - i)
    causal = causal_mask(n_q, n_k)
    ours = naive_attention(q, k, v, alibi_slopes=np.array(slope), causal=True)
    assert close(ours, dense_attention(q, k, v, scale=0.5, bias=gym, allowed=causal).out,
                 NAIVE_VS_DENSE)
    assert not close(naive_attention(q, k, v, alibi_slopes=np.array(slope)),
                     dense_attention(q, k, v, scale=0.5, bias=gym).out, 1e-3)


@pytest.mark.parametrize("cap", [0.5, 3.0, 50.0])
def test_naive_softcap_is_tanh_of_the_scaled_scores_before_bias_and_masks(cap):
    """s ← c·tanh(s/c) on τ·q kᵀ, then ALiBi's bias, then the mask: the oracle's order."""
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 8, 9, 4, dv=3)
    q, k = 3 * q, 3 * k  # scores of several units, where the cap bites
    slopes = np.array(0.2)
    mask = rng.random((8, 9)) < 0.7
    got = naive_attention(q, k, v, softcap=cap, alibi_slopes=slopes, mask=mask)
    want = dense_attention(q, k, v, scale=0.5, softcap=cap, bias=alibi_bias(0.2, 8, 9),
                           allowed=mask).out
    assert close(got, want, NAIVE_VS_DENSE)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_gqa_is_attention_with_k_and_v_repeated_per_query_head(groups):
    """enable_gqa with Hq = 4, Hkv = 4 / groups: query head h attends kv head h // groups,
    the same as k, v repeated (np.repeat, not tile) per query head; dk, dv are the sums of the
    repeated heads' gradients over each group. Forward and backward, flash and naive."""
    rng = np.random.default_rng(6)
    h_kv = 4 // groups
    q = rng.standard_normal((2, 4, 9, 8))
    k, v = rng.standard_normal((2, h_kv, 11, 8)), rng.standard_normal((2, h_kv, 11, 5))
    dout = rng.standard_normal((2, 4, 9, 5))
    k_rep, v_rep = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    for kernel in ("flash", "naive"):
        attend = flash_attention if kernel == "flash" else naive_attention
        np.testing.assert_array_equal(attend(q, k, v, enable_gqa=True, causal=True),
                                      attend(q, k_rep, v_rep, causal=True))
        dq, dk, dv = grads(kernel, q, k, v, dout, enable_gqa=True, causal=True)
        rq, rk, rv = grads(kernel, q, k_rep, v_rep, dout, causal=True)
        assert dk.shape == k.shape and dv.shape == v.shape
        assert close(dq, rq, 1e-14)
        assert close(dk, rk.reshape(2, h_kv, groups, 11, 8).sum(axis=2), 1e-13)
        assert close(dv, rv.reshape(2, h_kv, groups, 11, 5).sum(axis=2), 1e-13)


def test_gqa_against_pytorch_sdpa_enable_gqa():
    """The same grouping as PyTorch's scaled_dot_product_attention(enable_gqa=True), forward
    and backward, when torch is installed."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 6, 9, 8))
    k, v = rng.standard_normal((2, 2, 9, 8)), rng.standard_normal((2, 2, 9, 5))
    dout = rng.standard_normal((2, 6, 9, 5))
    qt, kt, vt = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                           enable_gqa=True)
    ref.backward(torch.from_numpy(dout))
    assert close(flash_attention(q, k, v, enable_gqa=True, causal=True), ref.detach().numpy())
    for ours, theirs in zip(grads("flash", q, k, v, dout, enable_gqa=True, causal=True),
                            (qt.grad, kt.grad, vt.grad)):
        assert close(ours, theirs.numpy(), 1e-11)


def test_gqa_never_copies_k_and_v_per_query_head():
    """With 16 query heads per kv head, flash's scratch holds no (16 × Nk × d) copy of k: it is
    below one such copy (and far below naive's score matrix), the memory of tiles only."""
    rng = np.random.default_rng(8)
    n = 2048
    q = rng.standard_normal((16, n, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, n, 16)).astype(np.float32) for _ in range(2))
    with flash_lib.threads(1):
        out, peak = measure_peak_bytes(flash_attention, q, k, v, enable_gqa=True,
                                       block_q=64, block_k=64)
    copy_of_k = 16 * n * 16 * 4
    assert peak - out.nbytes < copy_of_k, (peak - out.nbytes, copy_of_k)


# ---------------------------------------------------------------------------------------------
# The tiled kernel against the oracle, variants alone and combined
# ---------------------------------------------------------------------------------------------


@given(**VARIANTS)
def test_flash_equals_naive_for_every_combination(n_q, n_k, block_q, block_k, causal, window,
                                                 softcap, alibi, gqa, masking):
    """Forward (out, lse) and backward (dq, dk, dv) of flash against naive with the same
    keywords, float64: within VARIANTS_VS_NAIVE (1e-12) of the larger scale, the plain kernel's
    bound (``helpers.check_flash_equals_naive``)."""
    check_flash_equals_naive(n_q, n_k, block_q, block_k, causal, window, softcap, alibi, gqa,
                             masking)


@pytest.mark.parametrize("cap", [0.3, 2.0])
def test_softcaps_backward_matches_central_differences(cap):
    """The chain rule through softcap (×(1 - tanh²)) against central differences of the
    forward along random directions (ε = 1e-5, ``check_central_differences``), with ALiBi and a
    window on top."""
    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, 11, 13, 6, dv=4, batch=(2,))
    q, k = 2 * q, 2 * k
    dout = rng.standard_normal((2, 11, 4))
    kw = dict(softcap=cap, alibi_slopes=np.array([0.3, 0.1]), window=(4, 2), block_q=4,
              block_k=5)
    dq, dk, dv = grads("flash", q, k, v, dout, **kw)

    def f(q, k, v):
        return float((dout * flash_attention(q, k, v, **kw)).sum())

    check_central_differences(f, (q, k, v), (dq, dk, dv), rng)


@pytest.mark.parametrize("case", ["window", "mask_mod"])
def test_masked_keys_never_leak_through_a_window_or_mask_mod(case):
    """The hardening contract with the variants: NaN and inf in keys no query may attend,
    because they lie before every query's window (6 queries, 16 keys, window (2, 0): the
    queries see keys 8..15) or because mask_mod hides them (keys 12..15), leave the output and
    every gradient bit-for-bit what they are with those keys zeroed."""
    rng = np.random.default_rng(10)
    if case == "window":
        q, k, v = random_qkv(rng, 6, 16, 4, dv=3)
        kw, hidden = dict(window=(2, 0)), slice(0, 8)
    else:
        q, k, v = random_qkv(rng, 16, 16, 4, dv=3)
        kw, hidden = dict(mask_mod=lambda i, j: j < 12), slice(12, None)
    dout = rng.standard_normal((q.shape[0], 3))
    dirty_k, dirty_v, clean_k, clean_v = k.copy(), v.copy(), k.copy(), v.copy()
    dirty_k[hidden], dirty_v[hidden] = np.nan, np.inf
    clean_k[hidden], clean_v[hidden] = 0, 0
    kw.update(block_q=4, block_k=4)
    np.testing.assert_array_equal(flash_attention(q, dirty_k, dirty_v, **kw),
                                  flash_attention(q, clean_k, clean_v, **kw))
    for a, b in zip(grads("flash", q, dirty_k, dirty_v, dout, **kw),
                    grads("flash", q, clean_k, clean_v, dout, **kw)):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# Tiles never computed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [4096, 8192, 16384])
def test_a_sliding_window_visits_a_number_of_tiles_linear_in_n(n):
    """window (256, 0) with 512 × 512 tiles: each query block visits its diagonal tile and the
    one to its left (the band reaches 256 keys back), except the first: 2·(N/512) - 1 tiles,
    linear in N, against (N/512)(N/512 + 1)/2 for causal alone."""
    blocks = n // 512
    tiles = tile_schedule(n, n, 512, 512, causal=True, window=(256, 0))
    assert len(tiles) == 2 * blocks - 1
    assert len(tile_schedule(n, n, 512, 512, causal=True)) == blocks * (blocks + 1) // 2


def test_the_kernel_multiplies_exactly_the_tiles_the_schedule_lists():
    """Document masking (3 documents of uneven length) with mask_mod, a window and causal: the
    tiles the kernel multiplies are exactly tile_schedule's, in its order, which are exactly the
    tiles holding an allowed pair. Watched through the public ``online_softmax_update``, called
    once per tile multiplied: column 0 of ``v`` holds each key's index, so each tile's keys can
    be read off its values, and its rows are the tile's height (one worker: tiles come in order)."""
    n, block = 40, 8
    docs = np.repeat([0, 1, 2], [9, 20, 11])

    def same_doc(i, j):
        return docs[i] == docs[j]

    seen = []
    update = flash_lib.online_softmax_update

    def recording(m, l, acc, s, v, matmul, exp, threshold):
        seen.append((s.shape[-2], int(v[0, 0]), int(v[-1, 0]) + 1))
        return update(m, l, acc, s, v, matmul, exp, threshold)

    q, k, v = random_qkv(np.random.default_rng(11), n, n, 4)
    v[:, 0] = np.arange(n)
    kw = dict(causal=True, window=(12, None), mask_mod=same_doc)
    with pytest.MonkeyPatch.context() as patch, flash_lib.threads(1):
        patch.setattr(flash_lib, "online_softmax_update", recording)
        flash_attention(q, k, v, block_q=block, block_k=block, **kw)
    schedule = tile_schedule(n, n, block, block, **kw)
    assert seen == [(b - a, c, d) for a, b, c, d in schedule]
    allowed = (same_doc(np.arange(n)[:, None], np.arange(n)[None, :])
               & causal_mask(n, n) & window_mask(n, n, 12, None))
    holding = [(a, a + block, c, c + block) for a in range(0, n, block) for c in range(0, n, block)
               if allowed[a:a + block, c:c + block].any()]
    assert schedule == holding


def test_document_masks_skip_the_tiles_between_documents():
    """Four documents of 512 in N = 2048, 128 × 128 tiles: only the 4·4² = 64 tiles inside a
    document are visited, a quarter of the 256."""
    docs = np.repeat(np.arange(4), 512)
    tiles = tile_schedule(2048, 2048, 128, 128, mask_mod=lambda i, j: docs[i] == docs[j])
    assert len(tiles) == 64


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------

ARRAYS = tuple(np.zeros(shape) for shape in ((2, 4, 3, 5), (2, 2, 6, 5), (2, 2, 6, 4)))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(window=(-1, 2)), ValueError, "window's left must be a non-negative integer or None"),
        (dict(window=(1, 2.5)), ValueError, "window's right must be a non-negative integer"),
        (dict(window=(True, 2)), ValueError, "window's left must be a non-negative integer"),
        (dict(window=3), ValueError, "window must be None or a pair (left, right)"),
        (dict(window=(1, 2, 3)), ValueError, "window must be None or a pair (left, right)"),
        (dict(softcap=0), ValueError, "softcap must be a finite positive number (None turns it off), got 0"),
        (dict(softcap=-1.0), ValueError, "softcap must be a finite positive number"),
        (dict(softcap=np.inf), ValueError, "softcap must be a finite positive number"),
        (dict(alibi_slopes=np.ones(3)), ValueError, "alibi_slopes of shape (3,) does not broadcast"),
        (dict(alibi_slopes=np.array([1, np.nan, 1, 1])), ValueError, "alibi_slopes must be finite"),
        (dict(alibi_slopes=np.array(["a"] * 4)), TypeError, "alibi_slopes must be an array of real"),
        (dict(mask_mod="causal"), TypeError, "mask_mod must be a callable mask_mod(q_idx, k_idx)"),
        (dict(mask_mod=lambda i, j: i - j), TypeError, "mask_mod must return a boolean array"),
        (dict(mask_mod=lambda i, j: np.ones((3, 4, 4), bool)), ValueError,
         "mask_mod returned an array of shape (3, 4, 4), which does not broadcast"),
        (dict(enable_gqa="yes"), TypeError, "enable_gqa must be a bool"),
    ],
)
def test_variant_arguments_are_checked(kwargs, error, message):
    """Each bad variant argument: an error naming it, what it got and what was expected, from
    flash, naive and both backwards alike."""
    q, k, v = ARRAYS
    kwargs = dict(kwargs)
    if "alibi_slopes" in kwargs or "mask_mod" in kwargs or "softcap" in kwargs or "window" in kwargs:
        k, v = np.zeros((2, 4, 6, 5)), np.zeros((2, 4, 6, 4))
    out, lse, dout = np.zeros((2, 4, 3, 4)), np.zeros((2, 4, 3)), np.zeros((2, 4, 3, 4))
    calls = [
        lambda: flash_attention(q, k, v, **kwargs),
        lambda: naive_attention(q, k, v, **kwargs),
        lambda: flash_attention_backward(q, k, v, out, lse, dout, **kwargs),
        lambda: naive_attention_backward(q, k, v, dout, **kwargs),
    ]
    for call in calls:
        with pytest.raises(error, match=__import__("re").escape(message)):
            call()


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((4, 3, 5), (3, 6, 5), (3, 6, 4)), "needs k and v with the same number of heads Hkv"),
        (((3, 5), (6, 5), (6, 4)), "enable_gqa needs a head axis (-3)"),
        (((4, 3, 5), (2, 6, 5), (1, 6, 4)), "needs k and v with the same number of heads Hkv"),
    ],
    ids=["3 does not divide 4", "no head axis", "k and v heads differ"],
)
def test_gqa_head_counts_are_checked(shapes, message):
    q, k, v = (np.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=__import__("re").escape(message)):
        flash_attention(q, k, v, enable_gqa=True)


def test_tile_schedule_checks_its_variant_arguments():
    with pytest.raises(ValueError, match="window's right must be a non-negative integer"):
        tile_schedule(4, 4, 2, 2, window=(1, -1))
    with pytest.raises(TypeError, match="mask_mod must return a boolean array"):
        tile_schedule(4, 4, 2, 2, mask_mod=lambda i, j: i + j)

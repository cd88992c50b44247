"""flash_serving: packed variable-length batches (forward, backward) and the KV cache (contiguous,
paged), against flash_lib on each sequence alone and against dense attention on the valid keys."""

import functools
import pathlib
import re
import shlex

import numpy as np
import pytest
from helpers import (FLASH_VS_NAIVE, VARIANTS_VS_NAIVE, assert_within, close, dense_attention,
                     window_mask)
from hypothesis import given, settings
from hypothesis import strategies as st

import flash_lib
import flash_serving as fs

# Every keyword of the varlen API, alone and in the combinations that interact (causal with the
# window, softcap with ALiBi, GQA with all of them).
VARIANTS = [
    {},
    {"causal": True},
    {"window": (5, 2)},
    {"window": (3, None), "causal": True},
    {"softcap": 2.5},
    {"alibi_slopes": np.array([0.25, 0.0625])},
    {"alibi_slopes": np.array([0.25, 0.0625]), "causal": True, "softcap": 2.0},
    {"scale": 0.3},
    {"enable_gqa": True},
    {"enable_gqa": True, "causal": True, "window": (4, 1), "softcap": 3.0,
     "alibi_slopes": np.array([0.5, 0.125]), "scale": 0.2},
    {"block_q": 3, "block_k": 5, "causal": True},
]


def _close_grad(got, want):
    # Against the gradient's own scale: a single key's dq is 0 exactly but comes out as rounding
    # (1e-17), which a row-relative error calls infinite.
    assert np.abs(got - want).max(initial=0) <= 1e-11 * max(1.0, np.abs(want).max(initial=0))


def _ids(kw):
    return "-".join(k for k in kw) or "plain"


def _packed(rng, lens_q, lens_k, kw, d=8, dv=6):
    hq = 2
    hkv = 1 if kw.get("enable_gqa") else 2
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int64)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int64)
    q = rng.standard_normal((hq, cu_q[-1], d))
    k = rng.standard_normal((hkv, cu_k[-1], d))
    v = rng.standard_normal((hkv, cu_k[-1], dv))
    return q, k, v, cu_q, cu_k


def _dense_kw(kw):
    return {key: val for key, val in kw.items() if key not in ("block_q", "block_k")}


def _bottom_right(n_q, n_k, kw):
    """The pairs a sequence allows, built from the definition (not from flash_lib): its window,
    whose right edge causal moves to 0 at most."""
    left, right = kw.get("window") or (None, None)
    if kw.get("causal"):
        right = 0 if right is None else min(right, 0)
    return window_mask(n_q, n_k, left, right)


LENGTHS = [  # (queries, keys) per sequence: lengths 0 and 1, Nq > Nk, Nq < Nk
    ((5, 0, 1, 9, 3, 12), (7, 4, 1, 9, 0, 5)),
    ((1,), (1,)),
    ((0, 0), (3, 0)),
]


@pytest.mark.parametrize("kw", VARIANTS, ids=_ids)
@pytest.mark.parametrize("lens", LENGTHS)
def test_varlen_is_flash_attention_per_sequence(kw, lens):
    rng = np.random.default_rng(18)
    q, k, v, cu_q, cu_k = _packed(rng, *lens, kw)
    out, lse = fs.flash_attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    assert out.shape == q.shape[:-1] + (v.shape[-1],) and lse.shape == q.shape[:-1]
    dense = _dense_kw(kw)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        n_q, n_k = rows.stop - rows.start, keys.stop - keys.start
        if n_k == 0:  # no keys: zero rows, lse -inf
            assert (out[:, rows] == 0).all() and (lse[:, rows] == -np.inf).all()
            continue
        if n_q == 0:
            continue
        ref_o, ref_l = flash_lib.flash_attention(q[:, rows], k[:, keys], v[:, keys],
                                                 return_lse=True, **kw)
        # the same call on the same slices: the same bits
        np.testing.assert_array_equal(out[:, rows], ref_o)
        np.testing.assert_array_equal(lse[:, rows], ref_l)
        # and the definition: dense attention with this sequence's bottom-right mask
        nk = {key: val for key, val in dense.items() if key not in ("causal", "window")}
        mask = _bottom_right(n_q, n_k, kw)
        true_o, true_l = flash_lib.naive_attention(q[:, rows], k[:, keys], v[:, keys], mask=mask,
                                                   return_lse=True, **nk)
        assert flash_lib.rowwise_relative_error(out[:, rows], true_o).max() <= VARIANTS_VS_NAIVE
        np.testing.assert_array_equal(lse[:, rows] == -np.inf, true_l == -np.inf)


@pytest.mark.parametrize("kw", VARIANTS, ids=_ids)
def test_varlen_backward_is_flash_attention_backward_per_sequence(kw):
    rng = np.random.default_rng(81)
    q, k, v, cu_q, cu_k = _packed(rng, *LENGTHS[0], kw)
    out, lse = fs.flash_attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = fs.flash_attention_varlen_backward(q, k, v, out, lse, dout, cu_q, cu_k, **kw)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    dense = _dense_kw(kw)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start or keys.stop == keys.start:
            assert (dq[:, rows] == 0).all() and (dk[:, keys] == 0).all() and (dv[:, keys] == 0).all()
            continue
        g = flash_lib.flash_attention_backward(q[:, rows], k[:, keys], v[:, keys], out[:, rows],
                                               lse[:, rows], dout[:, rows], **kw)
        for got, want in zip((dq[:, rows], dk[:, keys], dv[:, keys]), g):
            np.testing.assert_array_equal(got, want)
        truth = flash_lib.naive_attention_backward(q[:, rows], k[:, keys], v[:, keys],
                                                   dout[:, rows], **dense)
        for got, want in zip((dq[:, rows], dk[:, keys], dv[:, keys]), truth):
            _close_grad(got, want)


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=5),
       causal=st.booleans(), left=st.one_of(st.none(), st.integers(0, 6)),
       block=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_varlen_matches_the_document_mask(lens, causal, left, block, seed):
    """Against one dense call over the whole packed batch with a per-sequence mask: cross-sequence
    pairs never attend, whatever the lengths (0 and 1 included) and tile sizes."""
    rng = np.random.default_rng(seed)
    lens_q, lens_k = zip(*lens)
    kw = {"causal": causal, "window": None if left is None else (left, None)}
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, {})
    out, lse = fs.flash_attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, block_q=block,
                                         block_k=block, **kw)
    mask = np.zeros((cu_q[-1], cu_k[-1]), bool)
    for b in range(len(lens)):
        mask[cu_q[b]:cu_q[b + 1], cu_k[b]:cu_k[b + 1]] = _bottom_right(lens_q[b], lens_k[b], kw)
    ref_o, ref_l = flash_lib.naive_attention(q, k, v, mask=mask, return_lse=True)
    assert flash_lib.rowwise_relative_error(out, ref_o).max(initial=0) <= VARIANTS_VS_NAIVE
    np.testing.assert_array_equal(lse == -np.inf, ref_l == -np.inf)
    dout = rng.standard_normal(out.shape)
    grads = fs.flash_attention_varlen_backward(q, k, v, out, lse, dout, cu_q, cu_k,
                                               block_q=block, block_k=block, **kw)
    for got, want in zip(grads, flash_lib.naive_attention_backward(q, k, v, dout, mask=mask)):
        _close_grad(got, want)


def test_varlen_half_precision_and_tiles():
    """float16 in tiles smaller than the sequences, causal: every sequence's rows (sequence 0,
    Nq = 30 > Nk = 20, whose first 10 rows have no key; sequence 1, no query; sequence 2,
    Nq = 7 < Nk = 40) are, bit for bit, flash_attention on that sequence alone, and within
    float16's rounding of the dense oracle in float64 (FLASH_VS_NAIVE's float16 row: computed
    in float32, out rounded once, so within half a float16 ulp of the truth); an empty row is
    exactly 0 with lse -inf; out is float16, lse float32."""
    rng = np.random.default_rng(3)
    lens_q, lens_k = (30, 0, 7), (20, 5, 40)
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, {})
    q, k, v = (x.astype(np.float16) for x in (q, k, v))
    blocks = dict(block_q=8, block_k=16)
    out, lse = fs.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True,
                                         **blocks)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        alone = flash_lib.flash_attention(q[:, rows], k[:, keys], v[:, keys], causal=True,
                                          return_lse=True, **blocks)
        np.testing.assert_array_equal(out[:, rows], alone[0])
        np.testing.assert_array_equal(lse[:, rows], alone[1])
        q64, k64, v64 = (x.astype(np.float64) for x in (q[:, rows], k[:, keys], v[:, keys]))
        truth = dense_attention(q64, k64, v64, scale=1 / np.sqrt(q.shape[-1]),
                                allowed=window_mask(n_q, n_k, None, 0))
        assert_within(out[:, rows], lse[:, rows], truth.out, truth.lse, v64,
                      FLASH_VS_NAIVE[np.float16])
    assert (lse[:, :10] == -np.inf).all() and np.isfinite(lse[:, 10:]).all()


def test_varlen_tiles_are_the_sequences_tiles():
    lens = (4096,) + (64,) * 16
    cu = np.concatenate([[0], np.cumsum(lens)])
    tiles = fs.varlen_tile_schedule(cu, cu, 512, 512, causal=True)
    alone = sum(len(flash_lib.tile_schedule(n, n, 512, 512, causal=True)) for n in lens)
    assert len(tiles) == alone == 36 + 16
    # every tile lies inside one sequence's square
    owner = np.repeat(np.arange(len(lens)), lens)
    for q0, q1, k0, k1 in tiles:
        assert owner[q0] == owner[q1 - 1] == owner[k0] == owner[k1 - 1]


@pytest.mark.parametrize("bad, match", [
    (np.array([0.0, 3.0, 5.0]), "cu_seqlens_q must hold integers"),
    (np.array([[0, 3, 5]]), "cu_seqlens_q must be a 1-D"),
    (np.array([1, 3, 5]), "cu_seqlens_q must start at 0"),
    (np.array([0, 4, 3, 5]), "cu_seqlens_q must be non-decreasing"),
    (np.array([0, 3, 6]), "cu_seqlens_q must end at the total"),
    (np.array([0, 5]), "same length"),
])
def test_varlen_rejects_bad_cu_seqlens(bad, match):
    q = k = v = np.zeros((1, 5, 4))
    with pytest.raises(ValueError, match=match):
        fs.flash_attention_varlen(q, k, v, bad, np.array([0, 2, 5]))
    with pytest.raises(ValueError, match=match.replace("_q", "_k") if "_q" in match else match):
        fs.flash_attention_varlen(q, k, v, np.array([0, 2, 5]), bad)


# Sinks and dropout (gpt-oss serves with sinks; training packs with dropout), alone and with the
# keywords they interact with. Sinks of shape (H,) = (2,).
TRAINING_VARIANTS = [
    {"sinks": np.array([0.5, 3.0])},
    {"sinks": np.array([0.5, 3.0]), "causal": True},
    {"dropout_p": 0.3, "dropout_seed": 7},
    {"dropout_p": 0.3, "dropout_seed": 2**40 + 5, "causal": True,
     "sinks": np.array([-1.0, 2.0]), "block_q": 3, "block_k": 4},
    {"dropout_p": 0.2, "dropout_seed": 11, "enable_gqa": True, "window": (4, 1), "softcap": 3.0,
     "alibi_slopes": np.array([0.5, 0.125]), "sinks": np.array([1.0, -2.0])},
]


@pytest.mark.parametrize("kw", TRAINING_VARIANTS, ids=_ids)
def test_varlen_sinks_and_dropout_are_flash_attention_per_sequence(kw):
    """Forward and backward, bit for bit, each sequence is flash_lib's call on it alone at its
    packed positions (dropout_offset = (cu_seqlens_q[b], cu_seqlens_k[b])); a sequence without
    keys gives out 0 and lse = its head's sink; dsinks is the sequences' dsinks summed in order."""
    rng = np.random.default_rng(33)
    q, k, v, cu_q, cu_k = _packed(rng, *LENGTHS[0], kw)
    out, lse = fs.flash_attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape)
    grads = fs.flash_attention_varlen_backward(q, k, v, out, lse, dout, cu_q, cu_k, **kw)
    sinks = kw.get("sinks")
    assert len(grads) == (3 if sinks is None else 4)
    dsinks = np.zeros(2)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start:
            assert (grads[1][:, keys] == 0).all() and (grads[2][:, keys] == 0).all()
            continue
        offset = {"dropout_offset": (int(cu_q[b]), int(cu_k[b]))}
        o, s = flash_lib.flash_attention(q[:, rows], k[:, keys], v[:, keys], return_lse=True,
                                         **kw, **offset)
        np.testing.assert_array_equal(out[:, rows], o)
        np.testing.assert_array_equal(lse[:, rows], s)
        if keys.stop == keys.start:  # no keys: zero rows, lse the sink (-inf without one)
            assert (o == 0).all()
            np.testing.assert_array_equal(
                s, np.broadcast_to(-np.inf if sinks is None else sinks[:, None], s.shape))
        g = flash_lib.flash_attention_backward(q[:, rows], k[:, keys], v[:, keys], o, s,
                                               dout[:, rows], **kw, **offset)
        for got, want in zip((grads[0][:, rows], grads[1][:, keys], grads[2][:, keys]), g):
            np.testing.assert_array_equal(got, want)
        if sinks is not None:
            dsinks += g[3]
    if sinks is not None:
        np.testing.assert_array_equal(grads[3], dsinks)


@pytest.mark.parametrize("kw", TRAINING_VARIANTS[2:4], ids=_ids)
def test_varlen_dropout_is_the_packed_problems_mask(kw):
    """The packed batch with dropout is the dense oracle on the whole packed problem with the
    document mask and the same seed, forward and gradients (dsinks included): one mask for the
    batch, so no two sequences share one, and the backward draws the forward's."""
    rng = np.random.default_rng(52)
    lens_q, lens_k = (6, 6, 0, 9, 4), (8, 8, 3, 5, 0)  # two sequences of the same lengths
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, kw)
    q[:, 6:12], k[:, 8:16], v[:, 8:16] = q[:, :6], k[:, :8], v[:, :8]  # sequence 1 = sequence 0
    out, lse = fs.flash_attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape)
    grads = fs.flash_attention_varlen_backward(q, k, v, out, lse, dout, cu_q, cu_k, **kw)
    mask = np.zeros((cu_q[-1], cu_k[-1]), bool)
    for b in range(len(lens_q)):
        mask[cu_q[b]:cu_q[b + 1], cu_k[b]:cu_k[b + 1]] = _bottom_right(lens_q[b], lens_k[b], kw)
    dense = {key: val for key, val in _dense_kw(kw).items() if key not in ("causal", "window")}
    ref_o, ref_l = flash_lib.naive_attention(q, k, v, mask=mask, return_lse=True, **dense)
    assert close(out, ref_o) and np.array_equal(lse == -np.inf, ref_l == -np.inf)
    assert close(lse[np.isfinite(ref_l)], ref_l[np.isfinite(ref_l)])
    ref_g = flash_lib.naive_attention_backward(q, k, v, dout, mask=mask, **dense)
    assert len(grads) == len(ref_g)
    for got, want in zip(grads, ref_g):
        assert close(got, want)
    # sequences 0 and 1 hold the same tokens: only their masks tell them apart
    np.testing.assert_array_equal(lse[:, :6], lse[:, 6:12])
    assert (out[:, :6] != out[:, 6:12]).any()


@pytest.mark.parametrize("bad, error, match", [
    ({"causal": "yes"}, TypeError, "causal must be a bool"),
    ({"block_q": 0}, ValueError, "block_q must be a positive integer"),
    ({"scale": -1}, ValueError, "scale must be a finite positive number"),
    ({"window": (-1, 0)}, ValueError, "window's left"),
    ({"alibi_slopes": np.ones(3)}, ValueError, r"alibi_slopes of shape \(3,\)"),
    ({"sinks": np.array([np.nan, 0.0])}, ValueError, "sinks must be finite"),
    ({"sinks": np.ones(3)}, ValueError, r"sinks of shape \(3,\) does not broadcast"),
    ({"dropout_p": 1.5}, ValueError, r"dropout_p must be in \[0, 1\)"),
    ({"dropout_p": 0.1}, ValueError, "dropout_seed must be an integer"),
])
@pytest.mark.parametrize("lens", [((0, 0), (0, 0)), ((3, 0), (2, 4))], ids=["empty", "ragged"])
def test_varlen_checks_every_argument_up_front_whatever_the_lengths(bad, error, match, lens):
    """Forward and backward, with flash_lib's rules and messages, even when no sequence has a
    query (nothing would reach flash_lib's kernels)."""
    q, k, v, cu_q, cu_k = _packed(np.random.default_rng(0), *lens, {})
    out, lse = fs.flash_attention_varlen(q, k, v, cu_q, cu_k, return_lse=True)
    with pytest.raises(error, match=match):
        fs.flash_attention_varlen(q, k, v, cu_q, cu_k, **bad)
    with pytest.raises(error, match=match):
        fs.flash_attention_varlen_backward(q, k, v, out, lse, out, cu_q, cu_k, **bad)


def test_varlen_takes_array_likes():
    """Lists and tuples, as flash_lib takes them: the arrays' bits."""
    rng = np.random.default_rng(1)
    q, k, v, cu_q, cu_k = _packed(rng, (3, 0, 2), (2, 4, 5), {})
    out, lse = fs.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    got = fs.flash_attention_varlen(q.tolist(), k.tolist(), v.tolist(), tuple(cu_q.tolist()),
                                    cu_k.tolist(), causal=True, return_lse=True)
    np.testing.assert_array_equal(got[0], out)
    np.testing.assert_array_equal(got[1], lse)
    dout = rng.standard_normal(out.shape)
    want = fs.flash_attention_varlen_backward(q, k, v, out, lse, dout, cu_q, cu_k, causal=True)
    got = fs.flash_attention_varlen_backward(*(x.tolist() for x in (q, k, v, out, lse, dout)),
                                             cu_q.tolist(), cu_k.tolist(), causal=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


# --------------------------------------------------------------------------------------------
# The KV cache
# --------------------------------------------------------------------------------------------

CACHE_VARIANTS = [
    {},
    {"causal": True},
    {"window": (700, 2)},
    {"window": (40, None), "causal": True},
    {"softcap": 3.0, "causal": True},
    {"alibi_slopes": np.array([0.0625, 0.125, 0.25, 0.5])},
    {"alibi_slopes": np.array([0.0625, 0.125, 0.25, 0.5]), "causal": True, "enable_gqa": True},
    {"enable_gqa": True, "scale": 0.3, "window": (600, 0)},
    {"sinks": np.array([0.5, 3.0, -1.0, 6.0]), "causal": True},
    {"sinks": np.array([2.0, -3.0, 4.0, 0.0]), "enable_gqa": True, "window": (600, 0),
     "alibi_slopes": np.array([0.0625, 0.125, 0.25, 0.5]), "softcap": 3.0},
]


def _cache_problem(rng, seqlens, n_q, n_new, max_len, kw, d=8, dv=5, garbage=np.nan):
    b = len(seqlens)
    hq, hkv = 4, (2 if kw.get("enable_gqa") else 4)
    k_cache = rng.standard_normal((b, hkv, max_len, d))
    v_cache = rng.standard_normal((b, hkv, max_len, dv))
    for i, n in enumerate(seqlens):  # unused slots: garbage that must never be read
        k_cache[i, :, n:] = garbage
        v_cache[i, :, n:] = garbage
    q = rng.standard_normal((b, hq, n_q, d))
    k_new = rng.standard_normal((b, hkv, n_new, d))
    v_new = rng.standard_normal((b, hkv, n_new, dv))
    return q, k_cache, v_cache, k_new, v_new


def _dense(q, k_cache, v_cache, seqlens, k_new, v_new, kw):
    outs, lses = [], []
    for b, n in enumerate(seqlens):
        k = np.concatenate([k_cache[b, :, :n], k_new[b]], axis=1)
        v = np.concatenate([v_cache[b, :, :n], v_new[b]], axis=1)
        slopes = kw.get("alibi_slopes")
        o, s = flash_lib.naive_attention(q[b], k, v, return_lse=True,
                                         **{**kw, "alibi_slopes": slopes})
        outs.append(o)
        lses.append(s)
    return np.stack(outs), np.stack(lses)


def _paged(k_cache, v_cache, page_size, rng, extra_pages=3, garbage=np.inf):
    """The same keys in a paged cache: pages shuffled, spare pages full of garbage."""
    b, hkv, max_len, _ = k_cache.shape
    per_seq = max_len // page_size
    n_pages = b * per_seq + extra_pages
    order = rng.permutation(n_pages)
    table = order[: b * per_seq].reshape(b, per_seq)
    k_pages = np.full((n_pages, hkv, page_size, k_cache.shape[3]), garbage)
    v_pages = np.full((n_pages, hkv, page_size, v_cache.shape[3]), garbage)
    for i in range(b):
        for p in range(per_seq):
            k_pages[table[i, p]] = k_cache[i, :, p * page_size:(p + 1) * page_size]
            v_pages[table[i, p]] = v_cache[i, :, p * page_size:(p + 1) * page_size]
    return k_pages, v_pages, table


SEQLENS = [0, 1, 517, 1100]  # empty, one key, across a chunk, over two chunks


@pytest.mark.parametrize("kw", CACHE_VARIANTS, ids=_ids)
@pytest.mark.parametrize("n_q, n_new", [(1, 1), (3, 2), (7, 0)])
def test_cache_is_dense_attention_on_the_valid_keys(kw, n_q, n_new):
    rng = np.random.default_rng(7)
    seqlens = np.array(SEQLENS)
    q, kc, vc, kn, vn = _cache_problem(rng, seqlens, n_q, n_new, 1280, kw)
    want_o, want_l = _dense(q, kc, vc, seqlens, kn, vn, kw)
    out, lse = fs.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k_new=kn,
                                               v_new=vn, return_lse=True, **kw)
    assert np.isfinite(out).all()  # the NaN in the unused slots was never read
    assert flash_lib.rowwise_relative_error(out, want_o).max() <= VARIANTS_VS_NAIVE
    finite = np.isfinite(want_l)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    assert (np.abs(lse[finite] - want_l[finite]).max()
            <= VARIANTS_VS_NAIVE * (1 + np.abs(want_l[finite]).max()))
    # k_new, v_new were written in place right after each sequence's valid keys
    for b, n in enumerate(seqlens):
        np.testing.assert_array_equal(kc[b, :, n:n + n_new], kn[b])
        np.testing.assert_array_equal(vc[b, :, n:n + n_new], vn[b])
        assert np.isnan(kc[b, :, n + n_new:]).all()  # and nothing else


@pytest.mark.parametrize("kw", CACHE_VARIANTS, ids=_ids)
@pytest.mark.parametrize("page_size", [1, 16, 96])
def test_paged_cache_is_the_contiguous_cache_bit_for_bit(kw, page_size):
    rng = np.random.default_rng(page_size)
    seqlens = np.array(SEQLENS)
    q, kc, vc, kn, vn = _cache_problem(rng, seqlens, 2, 1, 1152, kw)
    k_pages, v_pages, table = _paged(kc, vc, page_size, rng)
    want = fs.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k_new=kn, v_new=vn,
                                           return_lse=True, **kw)
    got = fs.flash_attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens, k_new=kn,
                                          v_new=vn, block_table=table, return_lse=True, **kw)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    # the new keys landed in the pages the table names, at slots cache_seqlens[b] % page_size
    for b, n in enumerate(seqlens):
        page, slot = table[b, n // page_size], n % page_size
        np.testing.assert_array_equal(k_pages[page, :, slot], kn[b, :, 0])


def test_paged_random_permutations_hypothesis():
    @settings(max_examples=15, deadline=None)
    @given(seed=st.integers(0, 2**16), page_size=st.sampled_from([1, 3, 8, 64]),
           lens=st.lists(st.integers(0, 700), min_size=1, max_size=3),
           causal=st.booleans())
    def check(seed, page_size, lens, causal):
        rng = np.random.default_rng(seed)
        seqlens = np.array(lens)
        q, kc, vc, kn, vn = _cache_problem(rng, seqlens, 1, 1, 768, {})
        k_pages, v_pages, table = _paged(kc, vc, page_size, rng)
        want = fs.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k_new=kn,
                                               v_new=vn, causal=causal)
        got = fs.flash_attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens,
                                              k_new=kn, v_new=vn, block_table=table,
                                              causal=causal)
        np.testing.assert_array_equal(got, want)
    check()


def test_shared_prefix_pages():
    """Two sequences share their first pages (one copy in memory); each then has its own."""
    rng = np.random.default_rng(5)
    page_size, hkv, d = 32, 2, 8
    pages_k = rng.standard_normal((12, hkv, page_size, d))
    pages_v = rng.standard_normal((12, hkv, page_size, d))
    pages_k[9:] = np.nan  # free pages: never read
    table = np.array([[4, 7, 2, 0, -1], [4, 7, 5, 8, -1]])  # -1: unused entries, never read
    seqlens = np.array([100, 128])
    q = rng.standard_normal((2, hkv, 1, d))
    out = fs.flash_attention_with_kvcache(q, pages_k, pages_v, cache_seqlens=seqlens,
                                          block_table=table, causal=True)
    for b in range(2):
        k = np.concatenate([pages_k[p] for p in table[b, :4]], axis=1)[:, :seqlens[b]]
        v = np.concatenate([pages_v[p] for p in table[b, :4]], axis=1)[:, :seqlens[b]]
        ref = flash_lib.naive_attention(q[b], k, v, causal=True)
        assert flash_lib.rowwise_relative_error(out[b], ref).max() <= VARIANTS_VS_NAIVE


def test_queries_longer_than_the_cache():
    rng = np.random.default_rng(11)
    seqlens = np.array([2, 0])
    q, kc, vc, kn, vn = _cache_problem(rng, seqlens, 6, 1, 8, {})
    out, lse = fs.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k_new=kn,
                                               v_new=vn, causal=True, return_lse=True)
    # L = 3 keys (sequence 0) and 1 key (sequence 1) for 6 queries: bottom-right leaves the
    # first 3 and 5 rows empty
    assert (lse[0, :, :3] == -np.inf).all() and np.isfinite(lse[0, :, 3:]).all()
    assert (lse[1, :, :5] == -np.inf).all() and np.isfinite(lse[1, :, 5:]).all()
    assert (out[lse == -np.inf] == 0).all()
    want_o, _ = _dense(q, kc, vc, seqlens, kn, vn, {"causal": True})
    assert flash_lib.rowwise_relative_error(out, want_o).max() <= VARIANTS_VS_NAIVE


def test_garbage_in_unused_slots_changes_nothing():
    rng = np.random.default_rng(2)
    seqlens = np.array([3, 600, 1030])
    outs = []
    for garbage in (0.0, np.nan, np.inf, -np.inf, 1e308):
        q, kc, vc, kn, vn = _cache_problem(np.random.default_rng(2), seqlens, 1, 1, 1100, {},
                                           garbage=garbage)
        outs.append(fs.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k_new=kn,
                                                    v_new=vn, causal=True, return_lse=True))
    for o, s in outs[1:]:
        np.testing.assert_array_equal(o, outs[0][0])
        np.testing.assert_array_equal(s, outs[0][1])


def test_cache_alibi_per_sequence_and_head():
    """ALiBi slopes of shape (B, H): each sequence's own, over a cache longer than a chunk."""
    rng = np.random.default_rng(9)
    seqlens = np.array([700, 1100])
    slopes = np.array([[0.01, 0.02, 0.04, 0.08], [0.5, 0.25, 0.125, 0.0625]])
    q, kc, vc, kn, vn = _cache_problem(rng, seqlens, 3, 1, 1200, {})
    out = fs.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k_new=kn, v_new=vn,
                                          alibi_slopes=slopes)
    for b, n in enumerate(seqlens):
        k = np.concatenate([kc[b, :, :n], kn[b]], axis=1)
        v = np.concatenate([vc[b, :, :n], vn[b]], axis=1)
        ref = flash_lib.naive_attention(q[b], k, v, alibi_slopes=slopes[b])
        assert flash_lib.rowwise_relative_error(out[b], ref).max() <= VARIANTS_VS_NAIVE


def test_cache_errors():
    rng = np.random.default_rng(0)
    q, kc, vc, kn, vn = _cache_problem(rng, [3, 4], 1, 2, 5, {})
    with pytest.raises(ValueError, match="overflow"):
        fs.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=np.array([3, 4]), k_new=kn,
                                        v_new=vn)
    assert np.isnan(kc[0, :, 3:]).all()  # nothing written
    with pytest.raises(ValueError, match="cache_seqlens must hold integers"):
        fs.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="window"):
        fs.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=np.array([1, 2]), window=(-1, 0))
    with pytest.raises(ValueError, match="given together"):
        fs.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=np.array([1, 2]), k_new=kn)
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = 9"):
        fs.flash_attention_with_kvcache(q, kc[:2], vc[:2], cache_seqlens=np.array([1, 1]),
                                        block_table=np.array([[9], [0]]))


def test_cache_sinks_are_merged_once_per_row():
    """Sinks of shape (B, H) over caches of 0 to 1100 keys (up to three split-KV parts): each
    sequence is dense attention with its own sinks, so the sink is counted once per row,
    not once per chunk; a row with no key gives out 0 and lse = sink exactly; and a cache
    shorter than Nq + KV_CHUNK keys is flash_attention on its valid keys, bit for bit."""
    rng = np.random.default_rng(21)
    seqlens = np.array(SEQLENS)
    sinks = rng.uniform(-2, 6, (len(seqlens), 4))
    q, kc, vc, kn, vn = _cache_problem(rng, seqlens, 3, 1, 1280, {})
    out, lse = fs.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k_new=kn,
                                               v_new=vn, causal=True, sinks=sinks,
                                               return_lse=True)
    for b, n in enumerate(seqlens):
        k = np.concatenate([kc[b, :, :n], kn[b]], axis=1)
        v = np.concatenate([vc[b, :, :n], vn[b]], axis=1)
        ref_o, ref_l = flash_lib.naive_attention(q[b], k, v, causal=True, sinks=sinks[b],
                                                 return_lse=True)
        assert close(out[b], ref_o) and close(lse[b], ref_l)
        if n + 1 < q.shape[2] + fs.KV_CHUNK:  # one call: flash_attention's bits
            alone = flash_lib.flash_attention(q[b], k, v, causal=True, sinks=sinks[b],
                                              return_lse=True)
            np.testing.assert_array_equal(out[b], alone[0])
            np.testing.assert_array_equal(lse[b], alone[1])
    # sequence 0 has one key for three queries: its first two rows see only the sink
    assert (out[0, :, :2] == 0).all()
    np.testing.assert_array_equal(lse[0, :, :2], np.repeat(sinks[0][:, None], 2, axis=1))


def _cache_arguments(rng, paged):
    """A call that writes: q (2, 4, 1, 8) over two sequences of 3 and 4 cached keys, the cache
    contiguous (2, 4, 6, ·) or in pages of 2 slots, unused slots NaN."""
    q, kc, vc, kn, vn = _cache_problem(rng, [3, 4], 1, 1, 6, {})
    args = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=np.array([3, 4]), k_new=kn, v_new=vn)
    if paged:
        args["k_cache"], args["v_cache"], args["block_table"] = _paged(kc, vc, 2, rng)
    return args


def _read_only(x):
    x = x.copy()
    x.flags.writeable = False
    return x


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("bad, error, match", [
    ({"softcap": 0.0}, ValueError, "softcap must be a finite positive number"),
    ({"scale": -1.0}, ValueError, "scale must be a finite positive number"),
    ({"causal": "yes"}, TypeError, "causal must be a bool"),
    ({"window": (2, -1)}, ValueError, "window's right"),
    ({"alibi_slopes": np.ones(3)}, ValueError,
     r"alibi_slopes of shape \(3,\) does not broadcast to the leading \(batch, head\) dims "
     r"\(2, 4\)"),
    ({"alibi_slopes": np.full(4, np.inf)}, ValueError, "alibi_slopes must be finite"),
    ({"sinks": np.ones((3, 4))}, ValueError, r"sinks of shape \(3, 4\) does not broadcast"),
    ({"sinks": np.array([0.0, np.nan, 0.0, 0.0])}, ValueError, "sinks must be finite"),
    ({"q": lambda q: q[:, :3], "enable_gqa": True}, ValueError, "enable_gqa needs"),
    ({"k_new": lambda x: x.astype(np.float32)}, TypeError, "k_new must have the dtype of the"),
    ({"v_new": lambda x: x.astype(np.float32)}, TypeError, "v_new must have the dtype of the"),
    ({"v_cache": _read_only}, ValueError, "v_cache is read-only"),
    ({"k_cache": lambda x: x.tolist()}, TypeError, "k_cache must be a NumPy array when k_new"),
    ({"cache_seqlens": np.array([3, 6])}, ValueError, "overflow"),
], ids=lambda x: "-".join(x) if isinstance(x, dict) else "")
def test_cache_call_that_raises_writes_nothing(bad, error, match, paged):
    """Every argument is checked before k_new is written: a call that raises leaves the
    caller's cache as it was, to the bit (NaN in the unused slots included). A value in
    ``bad`` that is a function makes the argument from the good one."""
    args = _cache_arguments(np.random.default_rng(4), paged)
    for key, val in bad.items():
        args[key] = val(args[key]) if callable(val) else val
    before = [np.array(args[key], copy=True) for key in ("k_cache", "v_cache")]
    with pytest.raises(error, match=match):
        fs.flash_attention_with_kvcache(**args)
    for key, was in zip(("k_cache", "v_cache"), before):
        np.testing.assert_array_equal(np.asarray(args[key]), was)


def test_cache_takes_array_likes_when_nothing_is_written():
    """Lists, as flash_lib takes them, when nothing is written into the cache: the arrays' bits."""
    rng = np.random.default_rng(8)
    args = _cache_arguments(rng, paged=True)
    del args["k_new"], args["v_new"]
    want = fs.flash_attention_with_kvcache(**args, causal=True, return_lse=True)
    got = fs.flash_attention_with_kvcache(**{key: val.tolist() for key, val in args.items()},
                                          causal=True, return_lse=True)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_decoding_scratch_is_flat_in_the_cache_length():
    """One query over 2,048 and over 32,768 cached keys: the same scratch, to within 64 KiB (a
    full gather of the larger cache alone is 2 x 16 MiB)."""
    rng = np.random.default_rng(0)
    scratch = {}
    for n in (2048, 32768):
        kc = rng.standard_normal((1, 1, n, 64))
        vc = rng.standard_normal((1, 1, n, 64))
        q = rng.standard_normal((1, 1, 1, 64))
        seqlens = np.array([n - 1])
        kn, vn = kc[:, :, -1:].copy(), vc[:, :, -1:].copy()
        out, peak = flash_lib.measure_peak_bytes(
            fs.flash_attention_with_kvcache, q, kc, vc, cache_seqlens=seqlens, k_new=kn,
            v_new=vn, causal=True)
        scratch[n] = peak - out.nbytes
    assert scratch[32768] <= scratch[2048] + 64 * 1024, scratch
    assert scratch[32768] < 2 * fs.KV_CHUNK * 64 * 8 * 4, scratch  # a few chunks, not the cache


def test_greedy_decoding_on_the_cache_matches_recomputation():
    """A one-layer toy model: decoding token by token on the cache gives the tokens, and the
    logits, of recomputing the whole prefix with flash_attention at every step."""
    rng = np.random.default_rng(4)
    vocab, d, h = 50, 16, 2
    emb = rng.standard_normal((vocab, h, d))
    wk, wv = rng.standard_normal((2, h, d, d)) / 4
    unemb = rng.standard_normal((h * d, vocab))

    def logits_of(out):
        return out.transpose(1, 0, 2).reshape(out.shape[1], -1) @ unemb

    prompt = [3, 14, 15, 9, 26]
    max_len = 40
    kc = np.full((1, h, max_len, d), np.nan)
    vc = np.full((1, h, max_len, d), np.nan)
    x = emb[prompt].transpose(1, 0, 2)[None]  # (1, h, n, d)
    out = fs.flash_attention_with_kvcache(x, kc, vc, cache_seqlens=np.array([0]),
                                          k_new=x @ wk, v_new=x @ wv, causal=True)
    tokens, n = list(prompt), len(prompt)
    for _ in range(20):
        tokens.append(int(np.argmax(logits_of(out[0])[-1])))
        x = emb[tokens[-1:]].transpose(1, 0, 2)[None]
        out = fs.flash_attention_with_kvcache(x, kc, vc, cache_seqlens=np.array([n]),
                                              k_new=x @ wk, v_new=x @ wv, causal=True)
        n += 1
    # recomputation: the whole sequence at once
    xs = emb[tokens].transpose(1, 0, 2)
    full = flash_lib.flash_attention(xs, xs @ wk, xs @ wv, causal=True)
    recomputed = [int(t) for t in np.argmax(logits_of(full), axis=-1)[len(prompt) - 1:-1]]
    assert tokens[len(prompt):] == recomputed


# --------------------------------------------------------------------------------------------
# flash_check's serving cases
# --------------------------------------------------------------------------------------------

SERVING_CASES = ["varlen", "varlen_causal", "kvcache_decode", "kvcache_prefill", "kvcache_paged",
                 "varlen_sinks", "kvcache_sinks", "varlen_dropout"]
SERVING_FEATURES = ("varlen", "kvcache", "paged", "causal", "lse", "sinks", "dropout")


def _serving_kernel(varlen, kvcache):
    """One kernel for both kinds of case: varlen calls carry cu_seqlens_q, cache calls do not."""
    def kernel(q, k, v, **kw):
        if "cu_seqlens_q" in kw:
            return varlen(q, k, v, **kw)
        return kvcache(q, k, v, **kw)
    return kernel


def _check(kernel, dtypes=("float64", "float32")):
    import flash_check

    return flash_check.check_kernel(kernel, features=SERVING_FEATURES, dtypes=dtypes,
                                    cases=SERVING_CASES)


def test_flash_check_serving_cases_pass_flash_serving():
    report = _check(_serving_kernel(
        lambda q, k, v, **kw: fs.flash_attention_varlen(q, k, v, return_lse=True, **kw),
        lambda q, kc, vc, **kw: fs.flash_attention_with_kvcache(q, kc, vc, return_lse=True, **kw)),
        dtypes=("float64", "float32", "float16"))
    assert report.ok, report
    assert len(report.results) == 7 * 3 + 1 and not report.skipped


def test_flash_check_serving_cases_are_skipped_unless_listed():
    import flash_check

    report = flash_check.check_kernel(flash_lib.flash_attention, dtypes=("float64",),
                                      cases=SERVING_CASES)
    assert [s.case for s in report.skipped] == SERVING_CASES and not report.results


def test_readme_checks_a_serving_kernel_as_written(capsys):
    """README's command for a serving kernel, run as written: it passes, the cases of its
    features run, and each dense case (which calls fn(q, k, v, ...) without cu_seqlens) is listed
    as not applying, where it used to fail (issue 33: "FAIL: 6 of 55")."""
    import flash_check

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    commands = [line for block in re.findall(r"```sh\n(.*?)```", readme, re.S)
                for line in block.splitlines() if "flash_serving:" in line]
    assert len(commands) == 2, commands
    for command in commands:
        argv = shlex.split(command)
        assert argv[:3] == ["python", "-m", "flash_check"], command
        assert flash_check.main(argv[3:]) == 0, capsys.readouterr().out
        report = capsys.readouterr().out
        assert report.splitlines()[-1].startswith("PASS: "), report
        ran = {line.split()[0] for line in report.splitlines()
               if line.endswith("  ok") or "  ok  (" in line}
        assert ran and all(name in SERVING_CASES for name in ran), ran
        assert "late_max: does not apply: the kernel requires " in report, report


def test_flash_check_runs_only_the_cases_a_signature_can_take():
    """A kernel's required keywords decide which cases apply, whatever the features: one that
    requires mask= runs the mask cases only; **kwargs or a default requires nothing."""
    import flash_check

    def needs_mask(q, k, v, mask, *, causal=False, scale=None):
        return flash_lib.flash_attention(q, k, v, mask=mask, causal=causal, scale=scale,
                                         return_lse=True)

    report = flash_check.check_kernel(needs_mask, dtypes=("float64",))
    assert report.ok, report
    assert {r.case for r in report.results} == {
        name for name, case in flash_check.CASES.items()
        if "mask" in case.needs and set(case.needs) <= {"mask", "causal", "lse"}}
    reasons = {s.case: s.reason for s in report.skipped}
    assert reasons["random"] == ("does not apply: the kernel requires mask=, which this case "
                                 "does not pass")
    for kernel in (lambda q, k, v, **kw: needs_mask(q, k, v, kw.pop("mask", None), **kw),
                   functools.partial(needs_mask, mask=None)):
        report = flash_check.check_kernel(kernel, dtypes=("float64",), cases=["random"])
        assert [r.case for r in report.results] == ["random"] and report.ok, report


def test_flash_check_layout_wrappers():
    """Kernels written in FlashAttention's layouts, (total, heads, d) and (batch, seqlen, heads,
    d), checked through the one-line wrappers of flash_check.adapters."""
    from flash_check import adapters

    def thd_varlen(q, k, v, **kw):  # a kernel in FlashAttention's varlen layout
        assert q.shape[1] == 2 and q.ndim == 3  # (total, H, d)
        out, lse = fs.flash_attention_varlen(*(np.swapaxes(x, 0, 1) for x in (q, k, v)),
                                             return_lse=True, **kw)
        return np.swapaxes(out, 0, 1), lse  # out (total, H, dv), lse (H, total)

    def bshd_cache(q, k_cache, v_cache, *, k_new, v_new, **kw):  # (B, S, H, d) throughout
        assert q.shape[2] == 2 and k_cache.shape[2] == 2
        out, lse = fs.flash_attention_with_kvcache(
            np.swapaxes(q, 1, 2), np.swapaxes(k_cache, 1, 2), np.swapaxes(v_cache, 1, 2),
            k_new=np.swapaxes(k_new, 1, 2), v_new=np.swapaxes(v_new, 1, 2), return_lse=True, **kw)
        return np.swapaxes(out, 1, 2), lse

    report = _check(_serving_kernel(adapters.varlen_from_thd(thd_varlen),
                                    adapters.from_bshd(bshd_cache)))
    assert report.ok, report


def _mutant(name):
    """flash_serving's kernels with one of the issues' mistakes."""
    def varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, causal=False, sinks=None, dropout_p=0.0,
               dropout_seed=None):
        outs, lses = [], []
        for b in range(len(cu_seqlens_q) - 1):
            q0, q1, k0, k1 = (int(x) for x in (cu_seqlens_q[b], cu_seqlens_q[b + 1],
                                               cu_seqlens_k[b], cu_seqlens_k[b + 1]))
            if name == "next_key":
                k1 = min(k1 + 1, k.shape[-2])
            kw = {"causal": causal, "sinks": None if name == "sinks_ignored" else sinks,
                  "dropout_p": dropout_p, "dropout_seed": dropout_seed,
                  "dropout_offset": (0, 0) if name == "dropout_within_sequence" else (q0, k0)}
            if name == "top_left" and causal:
                kw.update(causal=False, mask=np.tril(np.ones((q1 - q0, k1 - k0), bool)))
            o, s = flash_lib.flash_attention(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1],
                                             return_lse=True, **kw)
            if name == "no_key_lse" and k1 == k0:  # the old skip: lse -inf, not the sink
                s = np.full_like(s, -np.inf)
            outs.append(o)
            lses.append(s)
        return np.concatenate(outs, 1), np.concatenate(lses, 1)

    def cache(q, kc, vc, *, cache_seqlens, k_new, v_new, block_table=None, causal=False,
              sinks=None):
        seqlens = np.array(cache_seqlens)
        if name == "k_new_offset":
            seqlens = seqlens + 1
        kw = dict(block_table=block_table, causal=causal, return_lse=True,
                  sinks=None if name == "sinks_ignored" else sinks)
        out, lse = fs.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k_new=k_new,
                                                   v_new=v_new, **kw)
        if name == "past_seqlens":  # one slot past the valid keys
            return fs.flash_attention_with_kvcache(q, kc, vc,
                                                   cache_seqlens=seqlens + k_new.shape[2] + 1,
                                                   **kw)
        if name == "page_off_by_one" and block_table is not None:
            kw["block_table"] = np.roll(block_table, -1, axis=1)
            return fs.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, **kw)
        if name == "sinks_per_chunk" and sinks is not None:  # once more for the second part
            split = seqlens + k_new.shape[2] - q.shape[2] >= fs.KV_CHUNK
            again = np.where(split[:, None, None], np.asarray(sinks)[..., None], -np.inf)
            return flash_lib.merge_attention(out, lse, np.zeros_like(out),
                                             np.broadcast_to(again, lse.shape))
        return out, lse
    return _serving_kernel(varlen, cache)


@pytest.mark.parametrize("name, failing, diagnosis", [
    ("next_key", {"varlen", "varlen_causal", "varlen_sinks", "varlen_dropout"}, "packed batch"),
    ("top_left", {"varlen_causal", "varlen_sinks"}, "not top-left"),
    ("past_seqlens", {"kvcache_decode", "kvcache_prefill", "kvcache_paged", "kvcache_sinks"},
     "slots past cache_seqlens"),
    ("page_off_by_one", {"kvcache_paged"}, "block_table[b, t // page_size]"),
    ("k_new_offset", {"kvcache_decode", "kvcache_prefill", "kvcache_paged", "kvcache_sinks"},
     "not written into the cache in place"),
    ("sinks_ignored", {"varlen_sinks", "kvcache_sinks"}, "accepted and ignored"),
    ("sinks_per_chunk", {"kvcache_sinks"}, "counted once per chunk"),
    ("no_key_lse", {"varlen_sinks"}, "lse = sink, not -inf"),
    ("dropout_within_sequence", {"varlen_dropout"}, "sequences 0 and 1, of the same lengths, "
     "draw the same mask"),
])
def test_flash_check_serving_cases_catch_the_issues_mistakes(name, failing, diagnosis):
    report = _check(_mutant(name), dtypes=("float64",))
    assert set(report.failed_cases()) == failing, report
    assert diagnosis in " ".join(f.diagnosis for f in report.failures), report

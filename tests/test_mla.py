"""flash_mla.mla_attention: multi-head latent attention, absorbed and not, against a dense
per-head reference written here (and PyTorch SDPA); paged decoding on the latent cache through
flash_serving; the KV-cache sizes."""

import math

import numpy as np
import pytest
import torch

import flash_serving
from flash_mla import kv_cache_elements_per_token, mla_attention


def mla_problem(seed, batch=(2,), heads=4, n_q=5, n_k=23, d_nope=16, d_rope=8, r=32, dv=12,
                dtype=np.float64):
    rng = np.random.default_rng(seed)
    shapes = dict(q_nope=batch + (heads, n_q, d_nope), q_rope=batch + (heads, n_q, d_rope),
                  c_kv=batch + (n_k, r), k_rope=batch + (n_k, d_rope), w_uk=(heads, r, d_nope),
                  w_uv=(heads, r, dv))
    arrays = {name: rng.standard_normal(shape) for name, shape in shapes.items()}
    arrays["w_uk"] /= math.sqrt(r)
    arrays["w_uv"] /= math.sqrt(r)
    return {name: a.astype(dtype) for name, a in arrays.items()}


def dense_mla(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, causal=False):
    """Per head, in float64, from the definition: keys [c W_uk[h], k_rope], values c W_uv[h]."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    q_nope, q_rope, c_kv, k_rope, w_uk, w_uv = map(f, (q_nope, q_rope, c_kv, k_rope, w_uk, w_uv))
    scale = 1 / math.sqrt(q_nope.shape[-1] + q_rope.shape[-1])
    k_nope = np.einsum("...kr,hrd->...hkd", c_kv, w_uk)
    v = np.einsum("...kr,hre->...hke", c_kv, w_uv)
    s = (np.einsum("...hqd,...hkd->...hqk", q_nope, k_nope)
         + np.einsum("...hqd,...kd->...hqk", q_rope, k_rope)) * scale
    n_q, n_k = s.shape[-2:]
    if causal:
        allowed = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + (n_k - n_q)
        s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p @ v, (k_nope, v, scale)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("absorbed", [False, True])
def test_against_dense(absorbed, causal):
    args = mla_problem(int(absorbed) + 2 * int(causal))
    out = mla_attention(**args, causal=causal, absorbed=absorbed)
    ref, _ = dense_mla(**args, causal=causal)
    assert out.shape == (2, 4, 5, 12)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-13)


def test_against_torch_sdpa():
    args = mla_problem(7)
    ref, (k_nope, v, scale) = dense_mla(**args)
    q = np.concatenate([args["q_nope"], args["q_rope"]], -1)
    k = np.concatenate([k_nope, np.broadcast_to(args["k_rope"][:, None], k_nope.shape[:-1] + (8,))], -1)
    t = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, v)), scale=scale,
        is_causal=False).numpy()
    for absorbed in (False, True):
        np.testing.assert_allclose(mla_attention(**args, absorbed=absorbed), t, rtol=0, atol=1e-13)


def test_float32_absorbed_and_not_agree_within_rounding():
    args = mla_problem(3, dtype=np.float32, n_k=200, r=64)
    a = mla_attention(**args, absorbed=True)
    b = mla_attention(**args, absorbed=False)
    ref, _ = dense_mla(**args)
    assert a.dtype == b.dtype == np.float32
    assert np.max(np.abs(a - ref)) < 1e-5 and np.max(np.abs(b - ref)) < 1e-5
    assert not np.array_equal(a, b)  # two orders of operations, two roundings


def test_paged_decode_on_the_latent_cache():
    """FlashMLA's decode: the absorbed queries against a paged cache of [c_kv, k_rope], the
    values being its first r columns, through flash_serving's kvcache path."""
    rng = np.random.default_rng(5)
    heads, r, d_rope, d_nope, dv, page = 4, 32, 8, 16, 12, 8
    lengths = np.array([19, 5, 30])
    args = mla_problem(5, batch=(3,), heads=heads, n_q=1, n_k=30, d_nope=d_nope, d_rope=d_rope,
                       r=r, dv=dv)
    n_pages = 3 * 4
    cache = np.full((n_pages, 1, page, r + d_rope), np.nan)  # unused slots: never read
    table = rng.permutation(n_pages).reshape(3, 4)
    for b, length in enumerate(lengths):
        for t in range(length):
            cache[table[b, t // page], 0, t % page] = np.concatenate(
                [args["c_kv"][b, t], args["k_rope"][b, t]])
    q_lat = args["q_nope"] @ np.swapaxes(args["w_uk"], -1, -2)
    q = np.concatenate([q_lat, args["q_rope"]], -1)
    out_lat = flash_serving.flash_attention_with_kvcache(
        q, cache, cache[..., :r], cache_seqlens=lengths, block_table=table, enable_gqa=True,
        scale=1 / math.sqrt(d_nope + d_rope))
    out = out_lat @ args["w_uv"]
    for b, length in enumerate(lengths):
        one = {name: (a[b] if name not in ("w_uk", "w_uv") else a) for name, a in args.items()}
        one["c_kv"], one["k_rope"] = one["c_kv"][:length], one["k_rope"][:length]
        ref, _ = dense_mla(**one)
        np.testing.assert_allclose(out[b], ref, rtol=0, atol=1e-13)


def test_kv_cache_sizes():
    # DeepSeek-V3: 128 heads, d_nope 128 + d_rope 64 per key, dv 128; latent 512 + 64
    mha = kv_cache_elements_per_token("mha", heads=128, d_head=192, dv=128)
    gqa = kv_cache_elements_per_token("gqa", heads=128, kv_heads=8, d_head=192, dv=128)
    mla = kv_cache_elements_per_token("mla", heads=128, d_head=192)
    assert (mha, gqa, mla) == (40960, 2560, 576)
    with pytest.raises(ValueError, match="kv_heads"):
        kv_cache_elements_per_token("gqa", heads=128, kv_heads=7, d_head=128)


@pytest.mark.parametrize("name, change", [
    ("q_rope", lambda a: a["q_rope"][..., :3, :]),
    ("k_rope", lambda a: a["k_rope"][..., :-1, :]),
    ("w_uk", lambda a: a["w_uk"][:, :-1]),
    ("w_uv", lambda a: a["w_uv"][:-1]),
])
def test_shapes_refused(name, change):
    args = mla_problem(9)
    args[name] = change(args)
    with pytest.raises(ValueError, match=name):
        mla_attention(**args)

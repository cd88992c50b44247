# ---
# jupyter:
#   jupytext:
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 20. Latent attention (MLA) and top-k sparse attention
#
# Two ways DeepSeek's models shrink what decoding reads: **multi-head latent attention** caches
# one small latent vector per token instead of every head's keys and values, and **top-k sparse
# attention** lets each query attend only the keys an indexer picked. Both are exact
# rearrangements or restrictions of the attention of the earlier chapters, and both run here on
# `flash_lib`'s kernels.
#
# **Sources.** DeepSeek-V2 (arXiv 2405.04434, §2.1: MLA and the absorbed projections),
# DeepSeek-V3 (arXiv 2412.19437: $d_c = 512$, $d^R_h = 64$, 128 heads of $d_h = 128$),
# DeepSeek-V3.2-Exp's DeepSeek Sparse Attention (the lightning indexer,
# $I_{t,s} = \sum_j w_{t,j}\,\mathrm{ReLU}(q_{t,j}\cdot k_s)$, and top-k selection);
# FlashMLA (deepseek-ai/FlashMLA: `d_qk = 576`, `d_v = 512`), FlashAttention's
# `gather_kv_indices` (Dao-AILab/flash-attention at `0251105a`, `flash_attn/cute/`).

# %%
import math

import numpy as np

import flash_serving
from flash_bench import below
from flash_lib import measure_peak_bytes, naive_attention, sparse_attention
from flash_mla import kv_cache_elements_per_token, mla_attention

rng = np.random.default_rng(20)

# %% [markdown]
# ## 1. MLA: one latent per token
#
# Each token caches $c^{KV} \in \mathbb{R}^r$ and a RoPE key $k^R \in \mathbb{R}^{d_R}$ shared
# by all heads. Head $h$'s key is $[c^{KV} W^{UK}_h,\; k^R]$ and its value $c^{KV} W^{UV}_h$.
# Since $q^{C}_h \cdot (c W^{UK}_h) = (q^C_h W^{UK\top}_h) \cdot c$ and
# $\sum_j P_{ij}\, c_j W^{UV}_h = (\sum_j P_{ij} c_j) W^{UV}_h$, decoding can **absorb** the
# up-projections: one attention on the latent cache, $d_{qk} = r + d_R$, $d_v = r$, every head
# sharing one K/V (GQA with a single group), then a projection per head. Same real number,
# different rounding. `flash_mla.mla_attention(..., absorbed=True/False)` computes both:

# %%
H, d_nope, d_rope, r, dv = 8, 32, 16, 64, 32
n_q, n_k = 6, 300
q_nope = rng.standard_normal((2, H, n_q, d_nope))
q_rope = rng.standard_normal((2, H, n_q, d_rope))
c_kv = rng.standard_normal((2, n_k, r))
k_rope = rng.standard_normal((2, n_k, d_rope))
w_uk = rng.standard_normal((H, r, d_nope)) / math.sqrt(r)
w_uv = rng.standard_normal((H, r, dv)) / math.sqrt(r)
args = (q_nope, q_rope, c_kv, k_rope, w_uk, w_uv)
absorbed = mla_attention(*args, causal=True, absorbed=True)
per_head = mla_attention(*args, causal=True, absorbed=False)

# an independent dense reference, head by head, from the definition
k_nope = np.einsum("bkr,hrd->bhkd", c_kv, w_uk)
s = (np.einsum("bhqd,bhkd->bhqk", q_nope, k_nope)
     + np.einsum("bhqd,bkd->bhqk", q_rope, k_rope)) / math.sqrt(d_nope + d_rope)
allowed = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + (n_k - n_q)
s = np.where(allowed, s, -np.inf)
p = np.exp(s - s.max(-1, keepdims=True))
dense = (p / p.sum(-1, keepdims=True)) @ np.einsum("bkr,hre->bhke", c_kv, w_uv)
for name, out in (("absorbed", absorbed), ("per head", per_head)):
    err = np.abs(out - dense).max()
    print(f"{name}: max |out - dense| {below(err, 1e-13)}")
    assert err < 1e-13

# %% [markdown]
# **What the cache holds.** Numbers cached per token per layer, with DeepSeek-V3's sizes (128
# heads; a key of $128 + 64$, a value of 128), against multi-head attention and grouped-query
# attention with 8 KV heads of the same sizes:

# %%
table = {
    "MHA (128 heads)": kv_cache_elements_per_token("mha", heads=128, d_head=192, dv=128),
    "GQA (8 KV heads)": kv_cache_elements_per_token("gqa", heads=128, kv_heads=8, d_head=192,
                                                    dv=128),
    "MLA (r = 512, RoPE 64)": kv_cache_elements_per_token("mla", heads=128, d_head=192),
}
print(f"{'':24}{'numbers':>9}{'bytes, bf16':>13}{'vs MLA':>8}")
for name, n in table.items():
    print(f"{name:24}{n:9d}{2 * n:13d}{n / 576:8.1f}")
assert list(table.values()) == [40960, 2560, 576]

# %% [markdown]
# **Paged decode on the latent cache.** FlashMLA's decode is the absorbed form over a paged
# cache of $[c^{KV}, k^R]$ rows, the values being the first $r$ columns of the same rows. That is
# `flash_serving.flash_attention_with_kvcache` with one KV head, a page table and `v_cache` a
# view of `k_cache`:

# %%
page, lengths = 16, np.array([300, 123])
cache = np.full((2 * 19, 1, page, r + d_rope), np.nan)  # unused slots hold NaN, never read
table_ = rng.permutation(2 * 19).reshape(2, 19)
for b, length in enumerate(lengths):
    for t in range(length):
        cache[table_[b, t // page], 0, t % page] = np.concatenate([c_kv[b, t], k_rope[b, t]])
q_dec = np.concatenate([q_nope[:, :, -1:] @ np.swapaxes(w_uk, -1, -2), q_rope[:, :, -1:]], -1)
out = flash_serving.flash_attention_with_kvcache(
    q_dec, cache, cache[..., :r], cache_seqlens=lengths, block_table=table_, enable_gqa=True,
    scale=1 / math.sqrt(d_nope + d_rope)) @ w_uv
for b, length in enumerate(lengths):
    want = mla_attention(q_nope[b, :, -1:], q_rope[b, :, -1:], c_kv[b, :length],
                         k_rope[b, :length], w_uk, w_uv)
    assert np.abs(out[b] - want).max() < 1e-13
print("paged latent decode = mla_attention on each sequence's keys, to rounding")

# %% [markdown]
# ## 2. Top-k sparse attention
#
# A **lightning indexer** scores every (query, key) pair cheaply, with a few small heads and a
# ReLU, $I_{t,s} = \sum_j w_{t,j}\,\mathrm{ReLU}(q^I_{t,j}\cdot k^I_s)$; each query keeps its
# `topk` best keys (causal: only keys it may see; `-1` where it has fewer). The attention then
# gathers exactly those keys: `flash_lib.sparse_attention(q, k, v, indices)`.

# %%
n, d, topk, n_idx, d_idx = 512, 64, 32, 4, 16
q, k, v = (rng.standard_normal((4, n, d)) for _ in range(3))
q_i, k_i = rng.standard_normal((n, n_idx, d_idx)), rng.standard_normal((n, d_idx))
w_i = np.abs(rng.standard_normal((n, n_idx)))
index = np.einsum("tj,tjs->ts", w_i, np.maximum(np.einsum("tjd,sd->tjs", q_i, k_i), 0))
causal = np.arange(n)[None, :] <= np.arange(n)[:, None]
index = np.where(causal, index, -np.inf)
order = np.argsort(-index, axis=-1, kind="stable")[:, :topk]
indices = np.where(np.take_along_axis(causal, order, -1), order, -1)  # fewer than topk: -1
print("row 3's indices:", indices[3][:6], "...")
assert (indices[3] >= 0).sum() == 4 and (indices[100] >= 0).sum() == topk

out, lse = sparse_attention(q, k, v, indices, return_lse=True)
mask = np.zeros((n, n + 1), bool)
np.put_along_axis(mask, np.where(indices < 0, n, indices), True, -1)
ref, ref_lse = naive_attention(q, k, v, mask=mask[:, :n], return_lse=True)
err = max(np.abs(out - ref).max(), np.abs(lse - ref_lse).max())
print("sparse_attention against naive with the indices' mask:", below(err, 1e-13))
assert err < 1e-13

# %% [markdown]
# **Memory.** The gathered keys and values are `Nq · topk · (d + dv)` numbers, never `Nq × Nk`:
# measured by tracemalloc, doubling the sequence doubles the peak (an `N × N` buffer would
# quadruple it).

# %%
peaks = []
for n_ in (2048, 4096):
    q1, k1, v1 = (rng.standard_normal((n_, 32)) for _ in range(3))
    idx = (np.arange(n_)[:, None] * 7 + np.arange(16) * 13) % n_
    peaks.append(measure_peak_bytes(sparse_attention, q1, k1, v1, idx)[1])
print(f"peak at 4096 / peak at 2048: {peaks[1] / peaks[0]:.1f}")
assert 1.9 < peaks[1] / peaks[0] < 2.1 and peaks[1] < 4096 * 4096 * 8

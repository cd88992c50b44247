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
# # 14. Attention variants: window, softcap, ALiBi
#
# Production kernels take more than a boolean mask: a sliding window, a soft cap on the scores,
# ALiBi's distance penalty, grouped-query heads, masks written as functions. Each is one line in
# the score or the mask (for masks, plus a rule for skipping tiles). This chapter places each in
# the score and treats the first three, with the window's cost and softcap's gradient; chapter 15,
# the other two.
#
# **Sources.** FlashAttention's conventions are quoted from Dao-AILab/flash-attention at commit
# `0251105a`: `flash_attn_func`'s docstrings in `flash_attn/flash_attn_interface.py`, the test
# reference `attention_ref` in `tests/test_flash_attn.py` and the CUDA sources named below;
# FlexAttention's from `torch/nn/attention/flex_attention.py` and
# `torch/_higher_order_ops/flex_attention.py` of PyTorch 2.13.0; attention-gym's from
# meta-pytorch/attention-gym (`attn_gym/masks/`, `attn_gym/mods/`, commit `7fdb85d`).

# %% [markdown]
# ## One score, four steps
#
# For query $i$, key $j$ and head $h$, with $\tau$ the scale and $o = N_k - N_q$ the offset
# aligning the last query with the last key (chapter 6's bottom-right convention):
#
# $$
# \begin{aligned}
# s_{ij} &= \tau\, q_i \cdot k_{g(h), j}
#   && \text{GQA: query head } h \text{ reads kv head } g(h) = \lfloor h / (H_q / H_{kv}) \rfloor \\
# s_{ij} &\leftarrow c \tanh(s_{ij} / c) && \text{softcap } c \\
# s_{ij} &\leftarrow s_{ij} - \text{slope}_h \, |i + o - j| && \text{ALiBi} \\
# s_{ij} &\leftarrow -\infty \text{ unless } (i, j) \text{ is allowed}
#   && \text{mask} \wedge \text{causal} \wedge \text{window} \wedge \texttt{mask\_mod}
# \end{aligned}
# $$
#
# then the softmax over $j$ and $O = P V$. The order is FlashAttention's: its test
# reference `attention_ref` scales, caps, then masks; its CUDA forward
# (`csrc/flash_attn/src/flash_fwd_kernel.h`) calls `apply_softcap`, then `mask.apply_mask`, which
# adds the ALiBi bias and sets masked entries to $-\infty$ (`mask.h`). FlexAttention's reference
# (`_math_attention_inner`) too applies `score_mod` to scaled scores and the mask last.
#
# In flash_lib the first three steps make a tile's scores and the fourth its allowed pairs;
# chapter 5's online softmax runs on them unchanged. Every variant is checked twice,
# `flash_attention` against `naive_attention` and `naive_attention` against `dense_attention`
# (the four steps for the whole matrix, in another order of operations), pinning the oracle
# itself; `notebooks/_oracle.py`, printed below, holds oracle, checks and limit.

# %%
import inspect

import matplotlib.pyplot as plt
import numpy as np

import _oracle
from _oracle import ROUNDING, Checks, dense_attention, magnitude, worst
from flash_lib import (
    flash_attention,
    flash_attention_backward,
    naive_attention,
    naive_attention_backward,
    tile_schedule,
)

rng = np.random.default_rng(13)
checks = Checks()
print(inspect.getsource(_oracle))


# %% [markdown]
# ## The masks, as tile maps
#
# Three ways to say which keys a query may see, ANDed together: the boolean `mask` array,
# `causal` and `window=(left, right)` (chapter 15 adds `mask_mod`). The window is
# FlashAttention's `window_size`: "Query at position i will only attend to keys between
# [i + seqlen_k - seqlen_q - window_size[0], i + seqlen_k - seqlen_q + window_size[1]]
# inclusive" (`flash_attn_func`'s docstring), $-1$ for an unbounded side (flash_lib: `None`);
# causal is the window $(\infty, 0)$, as in FlashAttention's own reference.
#
# The band `causal` and `window` cut out is a diagonal strip, so a tile's two extreme corners
# decide whether it holds an allowed pair (chapter 6's argument, with a second edge), and the
# kernel skips the others unseen. The cell checks that `tile_schedule` lists exactly the
# tiles holding an allowed pair, and runs both checks, for two masks over $N = 64$ tokens,
# 8 × 8 tiles, each also written out densely: causal, $j \le i$, and the sliding window
# `window=(12, 0)`, $i - 12 \le j \le i$, attention-gym's `generate_sliding_window(12)`
# (`q_idx - kv_idx <= 12` ANDed with causal).

# %%
N, BLOCK = 64, 8
i_idx, j_idx = np.arange(N)[:, None], np.arange(N)[None, :]

masks = {
    "causal": (dict(causal=True), j_idx <= i_idx),
    "sliding window (12, 0)": (dict(window=(12, 0)), (i_idx - 12 <= j_idx) & (j_idx <= i_idx)),
}

every_tile = tile_schedule(N, N, BLOCK, BLOCK)
q, k, v = (rng.standard_normal((2, N, 16)) for _ in range(3))
schedules, holding = checks.run_masks(masks, N, BLOCK, q, k, v)


for name in masks:
    print(f"{name:<26} {len(schedules[name]):>2} of {len(every_tile)} tiles; tiles listed == "
          f"tiles holding an allowed pair: {schedules[name] == holding[name]}")

# %% [markdown]
# ### What a sliding window costs
#
# With $N_q = N_k = N$ and square tiles of $b$ = `block_q` = `block_k` dividing $N$, query block
# $r$ (rows $rb$ to $rb + b - 1$) needs, for the window (left, 0), keys $rb - \text{left}$ to
# $rb + b - 1$: key blocks $r - w$ to $r$, fewer near the start, with
# $w = \lceil \text{left} / b \rceil$. With $n = N / b$ blocks per side,
#
# $$
# \text{tiles} = \sum_{r=0}^{n-1} \big(\min(r, w) + 1\big) = n(w + 1) - \frac{w(w+1)}{2},
# $$
#
# linear in $N$, against chapter 6's $n(n+1)/2$ for causal attention and $n^2$ for none. At
# $b^2$ pairs a tile, the window computes, away from the start,
# $N b\,(\lceil \text{left}/b \rceil + 1)$ pairs where it needs about $N (\text{left} + 1)$:
# whole key blocks, plus one block of slack. At left = 256 and $b = 512$ that is
# $1024N$ pairs for $257N$, which is why narrow windows want narrow key blocks.

# %%
def window_tiles(n_blocks, left, block):
    """The formula above: sum over query blocks of min(r, ceil(left / block)) + 1."""
    w = -(-left // block)
    return sum(min(r, w) + 1 for r in range(n_blocks))


lengths = [4096, 8192, 16384, 32768, 65536]
tile_counts = {"full": [], "causal": [], "window (256, 0)": [], "window (1024, 0)": []}
for n in lengths:
    tile_counts["full"].append(len(tile_schedule(n, n, 512, 512)))
    tile_counts["causal"].append(len(tile_schedule(n, n, 512, 512, causal=True)))
    for left in (256, 1024):
        tile_counts[f"window ({left}, 0)"].append(
            len(tile_schedule(n, n, 512, 512, window=(left, 0))))

print("      N     full   causal   window (256, 0)   window (1024, 0)")
for row, n in enumerate(lengths):
    print(f"{n:>7} {tile_counts['full'][row]:>8} {tile_counts['causal'][row]:>8} "
          f"{tile_counts['window (256, 0)'][row]:>17} {tile_counts['window (1024, 0)'][row]:>18}")

# Pairs computed per pair needed, at N = 16384, for two tile sizes.
n_window, left = 16384, 256
needed = sum(min(i, left) + 1 for i in range(n_window))
slack = {b: len(tile_schedule(n_window, n_window, b, b, window=(left, 0))) * b * b / needed
         for b in (512, 128)}
# the estimate N·b·(ceil(left/b) + 1) / (N·(left + 1)), start-of-sequence edges aside
estimate = {b: b * (-(-left // b) + 1) / (left + 1) for b in (512, 128)}
print(f"\nwindow ({left}, 0) at N = {n_window}, pairs computed / pairs allowed:")
for b in (512, 128):
    print(f"  {b} x {b} tiles: {slack[b]:.2f}; b(ceil(left/b) + 1) / (left + 1) = {estimate[b]:.2f}")

lefts = [0, 256, 512, 1024, 2048, 4096, 8192]
by_left = [len(tile_schedule(n_window, n_window, 512, 512, window=(w, 0))) for w in lefts]

# %% tags=["hide-input"]
fig, (ax_n, ax_left) = plt.subplots(1, 2, figsize=(11, 4))
for (name, counts), marker in zip(tile_counts.items(), "os^v"):
    ax_n.plot(lengths, counts, marker=marker, label=name)
ax_n.set_xscale("log", base=2)
ax_n.set_yscale("log")
ax_n.set_xlabel("sequence length N (queries = keys, tokens)")
ax_n.set_ylabel("tiles multiplied (512 x 512)")
ax_n.set_title("Tiles against N: slope 2 without a window, 1 with one")
ax_n.legend()
ax_left.plot(lefts, by_left, marker="o", label="tile_schedule")
ax_left.plot(lefts, [window_tiles(n_window // 512, w, 512) for w in lefts], linestyle=":",
             color="k", label=r"$n(w+1) - w(w+1)/2$")
ax_left.axhline(len(tile_schedule(n_window, n_window, 512, 512, causal=True)), color="C1", linestyle="--",
                label="causal, no window")
ax_left.set_xlabel("window left (keys before the diagonal)")
ax_left.set_ylabel("tiles multiplied (512 x 512)")
ax_left.set_title(f"Tiles against the window's width, N = {n_window}")
ax_left.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Softcap
#
# Gemma 2 and Grok bound every score smoothly (FlashAttention supports it since 2.6, its
# `README.md`):
#
# $$
# s \leftarrow c \tanh(s / c), \qquad
# c \tanh(s/c) = s - \frac{s^3}{3c^2} + O\!\left(\frac{s^5}{c^4}\right) \text{ for } |s| \ll c,
# \qquad |c \tanh(s/c)| < c .
# $$
#
# Small scores pass almost unchanged; large ones are squashed into $(-c, c)$. With the derivative
#
# $$
# \frac{d}{ds}\, c \tanh(s/c) = 1 - \tanh^2(s/c),
# $$
#
# the backward multiplies $dS$ by $1 - \tanh^2(s/c)$ between the softmax's Jacobian and
# $dQ = \tau\, dS\, K$, $dK = \tau\, dS^\top Q$, taking $\tanh(s/c)$ from the recomputed tile, not
# from storage, as FlashAttention does (`calculate_dtanh` in
# `csrc/flash_attn/src/utils.h`); its forward too caps the *scaled* score (`flash_api.cpp`).
#
# The example: 64 queries over 256 keys, scores of spread about 4 (queries scaled up so the cap
# $c = 5$ bites).

# %%
n_q, n_k, d = 64, 256, 16
q_sc = 4 * rng.standard_normal((n_q, d))
k_sc, v_sc = rng.standard_normal((n_k, d)), rng.standard_normal((n_k, d))
dout_sc = rng.standard_normal((n_q, d))
tau, CAP = 1 / np.sqrt(d), 5.0
raw = tau * (q_sc @ k_sc.T)
capped = CAP * np.tanh(raw / CAP)

checks.run("softcap 5", q_sc, k_sc, v_sc,
           dense_attention(q_sc, k_sc, v_sc, scale=tau, softcap=CAP), softcap=CAP)
causal_sc = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + (n_k - n_q)
checks.run("softcap 5, causal", q_sc, k_sc, v_sc,
           dense_attention(q_sc, k_sc, v_sc, scale=tau, softcap=CAP, allowed=causal_sc),
           softcap=CAP, causal=True)


def row_peaks(s):
    """Each row's largest softmax weight."""
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)).max(axis=-1)


beyond = float(np.mean(np.abs(raw) > CAP))
peak_raw, peak_capped = np.median(row_peaks(raw)), np.median(row_peaks(capped))
damped = float(np.mean(1 - np.tanh(raw / CAP) ** 2 < 0.5))
print(f"\nscores beyond ±{CAP:g}: {beyond:.0%} before the cap, {np.mean(np.abs(capped) >= CAP):.0%} "
      f"after; spread (std) {raw.std():.1f} -> {capped.std():.1f}")
print(f"median over rows of the largest weight: {peak_raw:.2f} without the cap, "
      f"{peak_capped:.2f} with it")
print(f"scores whose gradient the cap damps below half (1 - tanh² < 0.5): {damped:.0%}")

# %% tags=["hide-input"]
s_axis = np.linspace(-25, 25, 501)
fig, (ax_map, ax_grad) = plt.subplots(1, 2, figsize=(11, 4))
ax_map.plot(s_axis, s_axis, color="grey", linestyle=":", label="no cap")
for c in (5, 10, 20):
    ax_map.plot(s_axis, c * np.tanh(s_axis / c), label=f"c = {c}")
    ax_grad.plot(s_axis, 1 - np.tanh(s_axis / c) ** 2, label=f"c = {c}")
ax_map.set_xlabel("scaled score s (before the cap)")
ax_map.set_ylabel("c·tanh(s / c) (after the cap)")
ax_map.set_title("The cap: identity near 0, bounded by ±c")
ax_map.legend()
ax_grad.set_xlabel("scaled score s (before the cap)")
ax_grad.set_ylabel("d(c·tanh(s/c)) / ds = 1 − tanh²(s/c)")
ax_grad.set_title("The factor the cap puts on the gradient")
ax_grad.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# Capped scores are flatter, so the softmax spreads its weight (the median row's largest weight
# above), and a score far past $c$ gets almost no gradient: the model cannot push it further.
#
# ### Before the mask, not after
#
# A masked score is $-\infty$, and $c \tanh(-\infty / c) = -c$: masking first and capping
# afterwards turns every masked score into the finite $-c$, giving masked keys weight
# $e^{-c - m}$ in every row, as the cell measures on causal attention of the example's 64 queries
# over its first 64 keys before checking the right order.

# %%
square = np.tril(np.ones((n_q, n_q), bool))
masked_first = np.where(square, raw[:, :n_q], -np.inf)
wrong = CAP * np.tanh(masked_first / CAP)  # -inf becomes -CAP
wrong_p = np.exp(wrong - wrong.max(axis=-1, keepdims=True))
wrong_p /= wrong_p.sum(axis=-1, keepdims=True)
leak_by_row = np.where(square, 0, wrong_p).sum(axis=-1)
leaked = float(leak_by_row.max())
print(f"capped after the mask: masked scores become {wrong[~square].max():g}, and up to "
      f"{leaked:.0%} of a row's weight (median row {np.median(leak_by_row):.1%}) goes to keys "
      f"it may not see")
checks.run("softcap 5, causal, Nq = Nk", q_sc, k_sc[:n_q], v_sc[:n_q],
           dense_attention(q_sc, k_sc[:n_q], v_sc[:n_q], scale=tau, softcap=CAP, allowed=square),
           softcap=CAP, causal=True)

# %% [markdown]
# ### The backward pass through the cap
#
# The chain rule, densely, for the causal example: chapter 12's $dS_c = P \circ (dP - D)$ on the
# capped, masked scores, then the cap's factor $dS = dS_c \circ (1 - \tanh^2(S / c))$,
# $dQ = \tau\, dS\, K$, $dK = \tau\, dS^\top Q$, $dV = P^\top dO$ (with $D$ from $O$, where naive
# takes it from $P$). `flash_attention_backward` must agree, and match central
# differences.

# %%
def dense_softcap_backward(q, k, v, dout, scale, cap, allowed):
    s = scale * (q @ k.T)
    t = np.tanh(s / cap)
    s_c = np.where(allowed, cap * t, -np.inf)
    p = np.exp(s_c - s_c.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    dp = dout @ v.T
    D = (dout * (p @ v)).sum(axis=-1, keepdims=True)  # rowsum(dO ∘ O), not rowsum(P ∘ dP)
    ds_c = p * (dp - D)
    ds = ds_c * (1 - t * t)  # the cap's derivative
    return scale * ds @ k, scale * ds.T @ q, p.T @ dout


out_sc, lse_sc = flash_attention(q_sc, k_sc, v_sc, softcap=CAP, causal=True, block_q=16,
                                 block_k=16, return_lse=True)
grads_flash = flash_attention_backward(q_sc, k_sc, v_sc, out_sc, lse_sc, dout_sc, softcap=CAP,
                                       causal=True, block_q=16, block_k=16)
grads_naive = naive_attention_backward(q_sc, k_sc, v_sc, dout_sc, softcap=CAP, causal=True)
grads_dense = dense_softcap_backward(q_sc, k_sc, v_sc, dout_sc, tau, CAP, causal_sc)
grad_errors = {name: (worst(f, n), worst(n, e)) for name, f, n, e in
               zip(("dq", "dk", "dv"), grads_flash, grads_naive, grads_dense)}
for name, (e_flash, e_naive) in grad_errors.items():
    print(f"{name}: flash vs naive {magnitude(e_flash)}, naive vs the dense chain rule "
          f"{magnitude(e_naive)}")

directions = [rng.standard_normal(x.shape) for x in (q_sc, k_sc, v_sc)]
eps = 1e-6


def loss(shift):
    moved = [x + shift * dx for x, dx in zip((q_sc, k_sc, v_sc), directions)]
    return float((dout_sc * flash_attention(*moved, softcap=CAP, causal=True)).sum())


numeric = (loss(eps) - loss(-eps)) / (2 * eps)
analytic = sum(float((g * dx).sum()) for g, dx in zip(grads_flash, directions))
fd_error = abs(numeric - analytic) / abs(analytic)
print(f"directional derivative: analytic {analytic:.6f}, central difference {numeric:.6f} "
      f"(relative difference {magnitude(fd_error, 1e-8)})")

# %% [markdown]
# ## ALiBi
#
# ALiBi (Press et al., arXiv 2108.12409) replaces position embeddings with a penalty on each score
# proportional to the query–key distance, one slope per head. FlashAttention's
# convention (`flash_attn_func`'s docstring): "A bias of (-alibi_slope * |i + seqlen_k - seqlen_q -
# j|) is added to the attention score of query i and key j", slopes of shape `(nheads,)` or
# `(batch_size, nheads)`: the distance from the query's own position $i + o$, bottom-right as
# causal. The usual slopes are $2^{-8(h+1)/H}$ for head $h$ of $H$ (attention-gym's
# `generate_alibi_bias`).
#
# attention-gym (`attn_gym/mods/alibi.py`) writes the bias as `score + (kv_idx - q_idx) * scale`,
# and FlashAttention's own CUDA kernel, when causal, adds only `alibi_slope * col_idx` ("Simpler,
# we add the same bias vector to all rows", `csrc/flash_attn/src/alibi.h`). Under causal masking
# all three agree: every allowed key has $j \le i + o$, where $|i + o - j| = i + o - j$, so
#
# $$
# -\text{slope}\,|i + o - j| = \text{slope}\,(j - i) - \text{slope}\cdot o
#                            = \text{slope}\cdot j - \text{slope}\,(i + o),
# $$
#
# which differ only by a constant per row ($\text{slope}\cdot o$ for attention-gym's form). A
# softmax ignores a constant added to a row, so the outputs agree, but the lse moves by it: a
# kernel adding $\text{slope}\cdot j$ returns an lse $\text{slope}\,(i + o)$ above the documented
# bias's (flash_lib's). Without the causal mask, $|\cdot|$ folds at $j = i + o$ and the
# forms give different attention.
#
# The picture: the three forms for head 0 of 8 (slope $2^{-1}$), $N_q = 12$, $N_k = 20$, and
# their differences along three rows' causal pairs.

# %%
HEADS = 8
slopes = 2.0 ** (-8 * (np.arange(HEADS) + 1) / HEADS)
n_qa, n_ka = 12, 20
offset = n_ka - n_qa
ia, ja = np.arange(n_qa)[:, None], np.arange(n_ka)[None, :]
causal_a = ja <= ia + offset
slope = 0.5
ours = -slope * np.abs(ia + offset - ja)
gym = slope * (ja - ia)
fa_causal = slope * ja + 0 * ia  # FlashAttention's causal CUDA path: the same vector per row
print("slopes of 8 heads:", ", ".join(f"1/{1 / s:g}" for s in slopes))
row_spread = [np.ptp((fa_causal - ours)[r][causal_a[r]]) for r in range(n_qa)]
row_value = np.array([(fa_causal - ours)[r][causal_a[r]][0] for r in range(n_qa)])
print(f"attention-gym − ours on the causal pairs: {np.unique((gym - ours)[causal_a])} "
      f"(slope·o = {slope * offset:g}) in every row")
print(f"FlashAttention's causal form − ours: spread within a row {max(row_spread):g}; the row "
      f"constants {', '.join(f'{x:g}' for x in row_value[:3])}, ..., {row_value[-1]:g} = "
      f"slope·(i + o)")

# %% tags=["hide-input"]
fig, axes = plt.subplots(2, 2, figsize=(11, 8))
axes = axes.ravel()
panels = [(ours, "ours / FlashAttention's docstring: −slope·|i + o − j|"),
          (gym, "attention-gym: slope·(j − i)"),
          (fa_causal, "FlashAttention's causal kernel: slope·j")]
for ax, (values, title) in zip(axes, panels):
    image = ax.imshow(values, cmap="viridis", interpolation="nearest")
    ax.axline((offset - 0.5, -0.5), slope=1, color="w", linewidth=0.8, linestyle="--")
    ax.set_title(title, fontsize=10)
    ax.set_xticks(range(0, n_ka, 4))
    ax.set_yticks(range(0, n_qa, 4))
    ax.set_xlabel("key index $j$")
    ax.set_ylabel("query index $i$")
    fig.colorbar(image, ax=ax, label="bias added to the score", shrink=0.8)
# The lesson is in the differences: constant along every row on the causal pairs (j <= i + o).
ax = axes[3]
for r, color in zip((0, 5, 11), ("C0", "C1", "C2")):
    keys = np.flatnonzero(causal_a[r])
    ax.plot(keys, (fa_causal - ours)[r, keys], "o-", ms=3, color=color,
            label=f"FlashAttention's causal form − ours, row i = {r}")
    ax.plot(keys, (gym - ours)[r, keys], "s:", ms=3, color=color,
            label=f"attention-gym − ours, row i = {r}")
ax.set_xticks(range(0, n_ka, 4))
ax.set_xlabel("key index $j$ (the causal pairs of the row)")
ax.set_ylabel("difference of the biases")
ax.set_title("The forms differ by a constant per row", fontsize=10)
ax.legend(fontsize=7, loc="lower right", bbox_to_anchor=(1, 0.08))
ax.grid(True, alpha=0.3)
fig.suptitle(f"ALiBi, slope {slope}, Nq = {n_qa}, Nk = {n_ka} (offset o = {offset}; dashed: j = i + o)")
fig.tight_layout()
plt.show()

# %% [markdown]
# The checks: naive with `alibi_slopes` against softmax with the explicit bias matrix, per head,
# with and without causal, for $N_q < N_k$ (where the offset matters); then the two other forms
# under causal (equal) and attention-gym's without it (not equal).

# %%
qa, ka, va = (rng.standard_normal((2, HEADS, n, 16)) for n in (n_qa, n_ka, n_ka))
bias = -slopes[:, None, None] * np.abs(ia + offset - ja)  # (heads, Nq, Nk)
checks.run("alibi", qa, ka, va, dense_attention(qa, ka, va, scale=0.25, bias=bias),
           alibi_slopes=slopes, block_q=5, block_k=7)
checks.run("alibi, causal", qa, ka, va,
           dense_attention(qa, ka, va, scale=0.25, bias=bias, allowed=causal_a),
           alibi_slopes=slopes, causal=True, block_q=5, block_k=7)
checks.run("alibi (B, H) slopes, causal", qa, ka, va,
           dense_attention(qa, ka, va, scale=0.25, allowed=causal_a,
                           bias=-np.stack([slopes, slopes[::-1]])[..., None, None]
                           * np.abs(ia + offset - ja)),
           alibi_slopes=np.stack([slopes, slopes[::-1]]), causal=True, block_q=5, block_k=7)

flash_alibi_causal, lse_alibi = flash_attention(qa, ka, va, alibi_slopes=slopes, causal=True,
                                                return_lse=True)
gym_bias = slopes[:, None, None] * (ja - ia)
fa_bias = slopes[:, None, None] * ja + 0 * ia
same_forms = {
    "attention-gym's form, causal": worst(flash_alibi_causal, dense_attention(
        qa, ka, va, scale=0.25, bias=gym_bias, allowed=causal_a)),
    "FlashAttention's causal kernel form": worst(flash_alibi_causal, dense_attention(
        qa, ka, va, scale=0.25, bias=fa_bias, allowed=causal_a)),
    "attention-gym's form, not causal": worst(flash_attention(qa, ka, va, alibi_slopes=slopes),
                                              dense_attention(qa, ka, va, scale=0.25,
                                                              bias=gym_bias)),
}
for name, err in same_forms.items():
    print(f"ours against {name}: {magnitude(err) if err < 1e-6 else f'{err:.1f}, different'}")

# The lse of attention-gym's form, written out: ours plus slope_h·o, head by head.
gym_scores = np.where(causal_a, 0.25 * (qa @ np.swapaxes(ka, -1, -2)) + gym_bias, -np.inf)
gym_max = gym_scores.max(axis=-1)
lse_gym = gym_max + np.log(np.exp(gym_scores - gym_max[..., None]).sum(axis=-1))
lse_shift = lse_gym - lse_alibi
print(f"lse of attention-gym's form minus ours, by head: "
      f"{', '.join(f'{x:.4g}' for x in lse_shift.mean(axis=(0, 2)))} (slope·o: "
      f"{', '.join(f'{x:.4g}' for x in slopes * offset)})")

# %% [markdown]
# ## What we showed
#
# - Each variant is one step of the score, in FlashAttention's order; flash equals naive, and
#   naive the dense construction, below $10^{-14}$
#   ({doc}`the appendix on how this tutorial is tested <28_how_chapters_7_to_23_are_tested>` draws
#   the differences).
# - A (left, 0) window computes 3.95 times the pairs needed at left = 256 with 512-wide tiles,
#   1.49 with 128-wide.
# - Softcap must precede the mask; its backward multiplies $dS$ by $1 - \tanh^2(s/c)$.
# - The three ALiBi forms differ by a constant per row on the causal pairs: the same output and a
#   shifted lse under causal masking, different attention without it.

# %%
# ROUNDING: see _oracle.py. naive and the dense construction normalise in different orders, so
# they agree to rounding, not bit for bit.
for name, (e_flash, e_dense) in checks.items():
    assert e_flash < ROUNDING and e_dense < ROUNDING, (name, e_flash, e_dense)
for name in masks:
    assert schedules[name] == holding[name], name
assert len(schedules["causal"]) == 8 * 9 // 2
assert len(schedules["sliding window (12, 0)"]) == window_tiles(N // BLOCK, 12, BLOCK) == 21
for row, n in enumerate(lengths):
    blocks = n // 512
    assert tile_counts["full"][row] == blocks**2
    assert tile_counts["causal"][row] == blocks * (blocks + 1) // 2
    assert tile_counts["window (256, 0)"][row] == 2 * blocks - 1 == window_tiles(blocks, 256, 512)
    assert tile_counts["window (1024, 0)"][row] == 3 * blocks - 3 == window_tiles(blocks, 1024, 512)
assert tile_counts["window (256, 0)"][0] == 15 and tile_counts["window (256, 0)"][-1] == 255
assert tile_counts["causal"][-1] == 8256
assert by_left == [window_tiles(n_window // 512, w, 512) for w in lefts]
# pairs computed / needed against N·b·(ceil(left/b) + 1) / (N·(left + 1)): the estimate drops
# the start-of-sequence edges, w·b/2N of the computed pairs (1.6% at b = 512, N = 16384) and
# left/2N of the needed ones (0.8%), so it is within 3%; (left + b)/(left + 1), 2.99 at b = 512,
# is not
for b in (512, 128):
    assert abs(slack[b] - estimate[b]) < 0.03 * estimate[b], (b, slack[b], estimate[b])
assert abs(slack[512] - (left + 512) / (left + 1)) > 0.5
assert np.abs(capped).max() < CAP and 0.2 < beyond < 0.5
assert peak_capped < peak_raw and capped.std() < raw.std()
assert leaked > 0.1 and wrong[~square].max() == -CAP
for e_flash, e_naive in grad_errors.values():
    assert e_flash < ROUNDING and e_naive < ROUNDING
assert fd_error < 1e-8  # central differences at eps = 1e-6: truncation and rounding near 1e-10
assert max(row_spread) == 0 and np.array_equal(row_value, slope * (np.arange(n_qa) + offset))
assert np.array_equal(np.unique((gym - ours)[causal_a]), [slope * offset])
assert same_forms["attention-gym's form, causal"] < ROUNDING
assert same_forms["FlashAttention's causal kernel form"] < ROUNDING
assert same_forms["attention-gym's form, not causal"] > 1e-2
assert np.allclose(lse_shift, slopes[:, None] * offset, rtol=0, atol=ROUNDING)  # measured: 9e-16

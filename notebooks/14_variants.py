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
# # 14. Attention variants in one kernel
#
# Production attention kernels take more than a boolean mask: a sliding window, a soft cap on
# the scores, ALiBi's distance penalty, grouped-query heads, and lately any mask written as a
# function. Each of them is one line in the score or in the mask, plus, for the masks, a rule
# for which tiles need not be computed at all. In this chapter:
#
# - where each variant sits in the computation of a score, in FlashAttention's order;
# - every mask as a tile map, causal, sliding window, document, prefix-LM and dilated, drawn from
#   `flash_lib.tile_schedule`, the list of tiles the kernel multiplies; and the cost of a
#   sliding window, which grows as $N \cdot$ `left`, not $N^2$;
# - softcap, $s \leftarrow c \tanh(s / c)$: its derivative, why it must come before the mask,
#   what it does to the scores and to their gradient;
# - ALiBi's bias as a picture, and why attention-gym's form of it is the same under causal
#   masking;
# - grouped-query attention: which kv head a query head reads, and the memory it saves;
# - how all this maps onto FlexAttention's `score_mod`, `mask_mod` and `BlockMask`, tested
#   against PyTorch when it is installed.
#
# Every variant is checked twice: `flash_attention` against `naive_attention` with the same
# keywords, and `naive_attention` against a dense construction written out in this chapter from
# the formulas, so that the oracle itself is pinned.
#
# **Sources.** FlashAttention's conventions are quoted from Dao-AILab/flash-attention, read at
# commit `0251105a`: the docstrings of `flash_attn_func` in `flash_attn/flash_attn_interface.py`,
# the test reference `attention_ref` in `tests/test_flash_attn.py` and the CUDA sources named
# below. FlexAttention's are from `torch/nn/attention/flex_attention.py` and
# `torch/_higher_order_ops/flex_attention.py` of PyTorch 2.13.0, and attention-gym's from
# meta-pytorch/attention-gym (`attn_gym/masks/`, `attn_gym/mods/`, read at commit `7fdb85d`).

# %% [markdown]
# ## One score, four steps
#
# For query $i$, key $j$ and head $h$, with $\tau$ the scale and $o = N_k - N_q$ the offset that
# aligns the last query with the last key (chapter 6's bottom-right convention):
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
# then the softmax over $j$ and $O = P V$ as before. The order is FlashAttention's: its test
# reference `attention_ref` scales, caps, then fills masked scores with $-\infty$; its CUDA
# forward (`csrc/flash_attn/src/flash_fwd_kernel.h`) calls `apply_softcap` on the scores and then
# `mask.apply_mask`, which adds the ALiBi bias and sets masked entries to $-\infty$
# (`csrc/flash_attn/src/mask.h`). FlexAttention's reference (`_math_attention_inner` in
# `torch/_higher_order_ops/flex_attention.py`) computes `scores * scale`, then
# `torch.where(mask_mod(...), score_mod(scores, ...), -inf)`: its `score_mod` too sees scaled
# scores, and the mask comes last.
#
# In flash_lib the first three steps are `_scores` (one matmul per tile, then the cap and the
# bias in place) and the fourth is `_allowed`; the online softmax of chapter 5 runs unchanged on
# what they produce. The dense construction below writes the four steps out for the whole matrix;
# every check of this chapter compares `naive_attention` with it and `flash_attention` with
# `naive_attention`.

# %%
import inspect
import warnings

import matplotlib.pyplot as plt
import numpy as np

import flash_lib
from flash_lib import (
    flash_attention,
    flash_attention_backward,
    measure_peak_bytes,
    naive_attention,
    naive_attention_backward,
    rowwise_relative_error,
    tile_schedule,
)

rng = np.random.default_rng(13)


def dense_attention(q, k, v, *, scale, allowed=None, bias=None, softcap=None):
    """The four steps for the whole score matrix: scale, cap, add the bias, mask; a softmax
    whose empty rows are 0. Written from the formulas, independently of flash_lib."""
    s = scale * (q @ np.swapaxes(k, -1, -2))
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = p.sum(axis=-1, keepdims=True)
    return (p @ v) / np.where(l == 0, 1, l)


def worst(a, b):
    """chapter 7's metric, the worst row"""
    return float(rowwise_relative_error(a, b).max())


# The limit for float64 agreements "to rounding" in this chapter: 1e-14, 45 machine epsilons.
# Every such difference below was at most 3e-15 at every NPY_DISABLE_CPU_FEATURES level
# (CONTRIBUTING.md), and any error of a variant (a window off by one, a wrong head, a missing
# cap, a kernel off by one part in a million) is far above it.
ROUNDING = 1e-14


def magnitude(x, limit=ROUNDING):
    """A stable way to print an error: exactly 0, or the stated limit it is under (its last
    digits are the CPU's rounding, so they are not printed), or, for a real error, the number."""
    if x == 0:
        return "0 (bit for bit)"
    return f"< {limit:.0e}" if x < limit else f"{x:.1e} (not < {limit:.0e})"


checks = {}  # variant -> (flash vs naive, naive vs the dense construction)


def check(name, q, k, v, dense_out, block_q=16, block_k=16, **keywords):
    """flash vs naive and naive vs dense for one variant; printed and kept for the asserts."""
    naive = naive_attention(q, k, v, **keywords)
    flash = flash_attention(q, k, v, block_q=block_q, block_k=block_k, **keywords)
    checks[name] = (worst(flash, naive), worst(naive, dense_out))
    print(f"{name:<34} flash vs naive {magnitude(checks[name][0]):<16} "
          f"naive vs dense {magnitude(checks[name][1])}")


# %% [markdown]
# ## The masks, as tile maps
#
# Four ways to say which keys a query may see, ANDed together: the boolean `mask` array,
# `causal`, `window=(left, right)` and `mask_mod`. The window is FlashAttention's
# `window_size`: "Query at position i will only attend to keys between
# [i + seqlen_k - seqlen_q - window_size[0], i + seqlen_k - seqlen_q + window_size[1]]
# inclusive" (the docstring of `flash_attn_func`), with $-1$ for an unbounded side, which
# flash_lib writes `None`. Causal is the window $(\infty, 0)$; FlashAttention's own reference
# turns `causal` into `window_size = (window_size[0], 0)`.
#
# The band that `causal` and `window` cut out is a diagonal strip, so a tile's two extreme
# corners decide whether it holds an allowed pair (chapter 6's argument, with a second edge): the
# kernel skips the tiles outside the strip without looking at them. `mask_mod(q_idx, k_idx)` is
# FlexAttention's `mask_mod` in NumPy form: it gets a tile's global positions as integer arrays
# of shapes `(tile_q, 1)` and `(1, tile_k)` and returns which pairs are allowed; a tile where it
# allows nothing is never multiplied. It can say what a band cannot, and OR what `causal` would
# AND. Five masks over $N = 64$ tokens with 8 × 8 tiles:
#
# - **causal**: $j \le i$;
# - **sliding window**, `window=(12, 0)`: $i - 12 \le j \le i$, attention-gym's
#   `generate_sliding_window(12)` (`q_idx - kv_idx <= 12` ANDed with causal);
# - **document** masking, causal within each of four packed documents: `mask_mod` is
#   `doc[q_idx] == doc[k_idx]` (attention-gym's `generate_doc_mask_mod`), with `causal=True`;
# - **prefix-LM**: the first 20 tokens see each other, the rest is causal, attention-gym's
#   `or_masks(kv_idx < prefix_length, causal_mask)`. An OR, so all of it is in `mask_mod`;
# - **dilated** window: $|i - j| \le 16$ and $|i - j|$ divisible by 4 (attention-gym's
#   `generate_dilated_sliding_window(16, 4)`): `window=(16, 16)` for the band and `mask_mod` for
#   the dilation.
#
# Each mask is also written out as a dense boolean matrix from its definition. The drawing
# shows that matrix (shaded pairs) under the tiles `tile_schedule` returns (outlined, numbered in
# visiting order); the tiles it leaves out are hatched. The cell checks, for each mask, that
# those tiles are exactly the ones holding an allowed pair, and that flash, naive and a dense
# softmax over the written-out mask agree.

# %%
N, BLOCK = 64, 8
i_idx, j_idx = np.arange(N)[:, None], np.arange(N)[None, :]
doc = np.repeat([0, 1, 2, 3], [10, 23, 6, 25])  # four packed documents
PREFIX = 20

masks = {
    "causal": (dict(causal=True), j_idx <= i_idx),
    "sliding window (12, 0)": (dict(window=(12, 0)), (i_idx - 12 <= j_idx) & (j_idx <= i_idx)),
    "document, causal": (dict(causal=True, mask_mod=lambda qi, ki: doc[qi] == doc[ki]),
                         (doc[i_idx] == doc[j_idx]) & (j_idx <= i_idx)),
    "prefix-LM (prefix 20)": (dict(mask_mod=lambda qi, ki: (ki < PREFIX) | (ki <= qi)),
                              (j_idx < PREFIX) | (j_idx <= i_idx)),
    "dilated (16, dilation 4)": (dict(window=(16, 16), mask_mod=lambda qi, ki: (qi - ki) % 4 == 0),
                                 (np.abs(i_idx - j_idx) <= 16) & ((i_idx - j_idx) % 4 == 0)),
}

every_tile = tile_schedule(N, N, BLOCK, BLOCK)
schedules, holding = {}, {}
q, k, v = (rng.standard_normal((2, N, 16)) for _ in range(3))
for name, (keywords, allowed) in masks.items():
    schedules[name] = tile_schedule(N, N, BLOCK, BLOCK, **keywords)
    holding[name] = [t for t in every_tile if allowed[t[0]:t[1], t[2]:t[3]].any()]
    check(name, q, k, v, dense_attention(q, k, v, scale=0.25, allowed=allowed), block_q=BLOCK,
          block_k=BLOCK, **keywords)


def draw_tile_map(ax, allowed, visited, title):
    ax.imshow(allowed, cmap=plt.matplotlib.colors.ListedColormap(["white", "#9ecae1"]),
              extent=(0, N, N, 0), interpolation="nearest", vmin=0, vmax=1)
    for t in every_tile:
        if t not in visited:
            ax.add_patch(plt.Rectangle((t[2], t[0]), t[3] - t[2], t[1] - t[0], facecolor="none",
                                       edgecolor="grey", hatch="xx", linewidth=0.4))
    for order, t in enumerate(visited):
        ax.add_patch(plt.Rectangle((t[2], t[0]), t[3] - t[2], t[1] - t[0], facecolor="none",
                                   edgecolor="black", linewidth=1.2))
        ax.text((t[2] + t[3]) / 2, (t[0] + t[1]) / 2, str(order), ha="center", va="center",
                fontsize=6)
    ax.set_xticks(range(0, N + 1, 16))
    ax.set_yticks(range(0, N + 1, 16))
    ax.set_xlabel("key index $j$")
    ax.set_title(f"{title}\n{len(visited)} of {len(every_tile)} tiles", fontsize=10)


# Two rows of three, the legend in the sixth place: five panels in one row would be drawn at
# half size in the page's column.
fig, axes = plt.subplots(2, 3, figsize=(11, 8.4))
for ax, (name, (keywords, allowed)) in zip(axes.flat, masks.items()):
    draw_tile_map(ax, allowed, schedules[name], name)
for ax in axes[:, 0]:
    ax.set_ylabel("query index $i$")
axes[1, 2].axis("off")
handles = [plt.Rectangle((0, 0), 1, 1, facecolor="#9ecae1"),
           plt.Rectangle((0, 0), 1, 1, facecolor="none", edgecolor="black"),
           plt.Rectangle((0, 0), 1, 1, facecolor="none", edgecolor="grey", hatch="xx")]
axes[1, 2].legend(handles, ["allowed pair", "tile multiplied\n(tile_schedule, in order)",
                            "tile skipped"], loc="center")
fig.suptitle(f"Five masks over N = {N}, {BLOCK} x {BLOCK} tiles: what flash_lib computes")
fig.tight_layout()
plt.show()

for name in masks:
    print(f"{name:<26} {len(schedules[name]):>2} of {len(every_tile)} tiles; tiles listed == "
          f"tiles holding an allowed pair: {schedules[name] == holding[name]}")

# %% [markdown]
# The dilated window skips no tile inside its band: every 8 × 8 tile there holds some pair at a
# distance divisible by 4. Skipping works on whole tiles, so a mask that is sparse *within*
# tiles saves nothing (FlexAttention's `BlockMask` says the same of its blocks, below).
#
# `mask_mod` is called per tile, and only inside the band: the kernel asks the band first and
# calls `mask_mod` only for the tiles the band lets through. Recording the calls of the document
# mask shows it: called on the tiles of the causal band, of which the kernel then multiplies the
# ones where some pair is in one document.

# %%
calls = []


def recorded_document_mask(q_idx, k_idx):
    calls.append((int(q_idx[0, 0]), int(q_idx[-1, 0]) + 1, int(k_idx[0, 0]), int(k_idx[0, -1]) + 1))
    return doc[q_idx] == doc[k_idx]


flash_attention(q, k, v, causal=True, mask_mod=recorded_document_mask, block_q=BLOCK,
                block_k=BLOCK)
causal_band = tile_schedule(N, N, BLOCK, BLOCK, causal=True)
print(f"mask_mod called on {len(calls)} tiles, the {len(causal_band)} of the causal band: "
      f"{sorted(calls) == causal_band}; multiplied: {len(schedules['document, causal'])}")

# %% [markdown]
# ### What a sliding window costs
#
# With $N_q = N_k = N$ and square tiles of $b$ = `block_q` = `block_k` dividing $N$, query block
# $r$ (rows $rb$ to $rb + b - 1$) needs the keys from $rb - \text{left}$ to $rb + b - 1$ for the
# window (left, 0): key blocks $r - \lceil \text{left}/b \rceil$ to $r$, fewer near the start.
# With $w = \lceil \text{left} / b \rceil$ and $n = N / b$ blocks per side,
#
# $$
# \text{tiles} = \sum_{r=0}^{n-1} \big(\min(r, w) + 1\big) = n(w + 1) - \frac{w(w+1)}{2},
# $$
#
# linear in $N$, against $n(n+1)/2$ for causal attention and $n^2$ for none. Each tile costs
# $b^2$ score pairs, so the window computes about $N (\text{left} + b)$ pairs where it needs
# $N (\text{left} + 1)$: the cost grows as $N \cdot \text{left}$, plus a tile's worth of slack
# per row, which is why narrow windows want narrow key blocks. The counts below are
# `tile_schedule`'s, for flash_lib's default 512 × 512 tiles.

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
print(f"\nwindow ({left}, 0) at N = {n_window}: pairs computed / pairs allowed = {slack[512]:.2f} with "
      f"512 x 512 tiles, {slack[128]:.2f} with 128 x 128")

lefts = [0, 256, 512, 1024, 2048, 4096, 8192]
by_left = [len(tile_schedule(n_window, n_window, 512, 512, window=(w, 0))) for w in lefts]

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
# Gemma 2 and Grok bound every score smoothly (FlashAttention added it in 2.6: "Support attention
# with softcapping, as used in Gemma-2 and Grok models", its `README.md`):
#
# $$
# s \leftarrow c \tanh(s / c), \qquad
# c \tanh(s/c) = s - \frac{s^3}{3c^2} + O\!\left(\frac{s^5}{c^4}\right) \text{ for } |s| \ll c,
# \qquad |c \tanh(s/c)| < c .
# $$
#
# Small scores pass almost unchanged, large ones are squashed into $(-c, c)$. The derivative is
#
# $$
# \frac{d}{ds}\, c \tanh(s/c) = 1 - \tanh^2(s/c),
# $$
#
# so the backward pass multiplies $dS$ by $1 - \tanh^2(s/c)$ after the softmax's Jacobian and
# before $dQ = \tau\, dS\, K$ and $dK = \tau\, dS^\top Q$. The kernel keeps $\tanh(s/c)$ from the
# recomputed tile (one more elementwise pass) rather than storing anything new. FlashAttention
# does the same: `calculate_dtanh` in `csrc/flash_attn/src/utils.h` computes
# `(1 - tanh²) * softcap` (the derivative, in its scaling of the scores), and its
# forward applies the cap to the *scaled* score (`flash_api.cpp` sets
# `params.softcap = softmax_scale / softcap` and then `scale_softmax = softcap`, so the kernel
# computes $c \tanh(\tau\, q \cdot k / c)$).
#
# The example: 64 queries over 256 keys with scores of spread about 4 (the queries are scaled up
# so that the cap $c = 5$ bites). The figure shows the map for three caps, the distribution of
# this example's scores before and after the cap $c = 5$, and the derivative.

# %%
n_q, n_k, d = 64, 256, 16
q_sc = 4 * rng.standard_normal((n_q, d))
k_sc, v_sc = rng.standard_normal((n_k, d)), rng.standard_normal((n_k, d))
dout_sc = rng.standard_normal((n_q, d))
tau, CAP = 1 / np.sqrt(d), 5.0
raw = tau * (q_sc @ k_sc.T)
capped = CAP * np.tanh(raw / CAP)

check("softcap 5", q_sc, k_sc, v_sc, dense_attention(q_sc, k_sc, v_sc, scale=tau, softcap=CAP),
      softcap=CAP)
causal_sc = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + (n_k - n_q)
check("softcap 5, causal", q_sc, k_sc, v_sc,
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

s_axis = np.linspace(-25, 25, 501)
fig, (ax_map, ax_hist, ax_grad) = plt.subplots(3, 1, figsize=(8, 11))
ax_map.plot(s_axis, s_axis, color="grey", linestyle=":", label="no cap")
for c in (5, 10, 20):
    ax_map.plot(s_axis, c * np.tanh(s_axis / c), label=f"c = {c}")
    ax_grad.plot(s_axis, 1 - np.tanh(s_axis / c) ** 2, label=f"c = {c}")
ax_map.set_xlabel("scaled score s (before the cap)")
ax_map.set_ylabel("c·tanh(s / c) (after the cap)")
ax_map.set_title("The cap: identity near 0, bounded by ±c")
ax_map.legend()
bins = np.linspace(-16, 16, 65)
ax_hist.hist(raw.ravel(), bins=bins, alpha=0.6, label="before the cap")
ax_hist.hist(capped.ravel(), bins=bins, alpha=0.6, label=f"after, c = {CAP:g}")
ax_hist.set_xlabel("scaled score (a logit: no unit)")
ax_hist.set_ylabel(f"count (of {raw.size} scores)")
ax_hist.set_title("This example's scores, squeezed into (−c, c)")
ax_hist.legend()
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
# The order is not cosmetic. A masked score is $-\infty$, and $c \tanh(-\infty / c) = -c$: a
# kernel that masks first and caps afterwards turns every masked score into the finite $-c$, and
# masked keys get weight $e^{-c - m}$ in every row. The cell computes causal attention of the
# example's 64 queries over its first 64 keys both ways with the dense construction, and
# measures the weight that lands on masked keys: row $i$ may see $i + 1$ keys and must not see
# $63 - i$.

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
check("softcap 5, causal, Nq = Nk", q_sc, k_sc[:n_q], v_sc[:n_q],
      dense_attention(q_sc, k_sc[:n_q], v_sc[:n_q], scale=tau, softcap=CAP, allowed=square),
      softcap=CAP, causal=True)

# %% [markdown]
# ### The backward pass through the cap
#
# The chain rule, written out densely for the causal example: $P = \operatorname{softmax}(S_c)$
# on the capped, masked scores $S_c$, $dP = dO\, V^\top$,
# $dS_c = P \circ (dP - \operatorname{rowsum}(P \circ dP))$, then the cap's factor
# $dS = dS_c \circ (1 - \tanh^2(S / c))$ and $dQ = \tau\, dS\, K$, $dK = \tau\, dS^\top Q$,
# $dV = P^\top dO$. `flash_attention_backward` must give the same, and both must match central
# differences of the forward along a random direction.

# %%
def dense_softcap_backward(q, k, v, dout, scale, cap, allowed):
    s = scale * (q @ k.T)
    t = np.tanh(s / cap)
    s_c = np.where(allowed, cap * t, -np.inf)
    p = np.exp(s_c - s_c.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    dp = dout @ v.T
    ds_c = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
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
# ALiBi (Press et al., arXiv 2108.12409) adds no position embedding; it penalises each score by
# the distance between query and key, with one slope per head. FlashAttention's convention
# (`flash_attn_func`'s docstring): "A bias of (-alibi_slope * |i + seqlen_k - seqlen_q - j|) is
# added to the attention score of query i and key j", slopes of shape `(nheads,)` or
# `(batch_size, nheads)`. The distance is measured from the query's own position $i + o$, the
# same bottom-right alignment as causal. The usual slopes form a geometric sequence,
# $2^{-8(h+1)/H}$ for head $h$ of $H$, which is what attention-gym's `generate_alibi_bias` computes
# (`torch.exp2(-((h + 1) * 8.0 / H))`).
#
# attention-gym (`attn_gym/mods/alibi.py`) writes the bias differently, as
# `score + (kv_idx - q_idx) * scale`, and FlashAttention's own CUDA kernel, when causal, adds
# only `alibi_slope * col_idx` ("Simpler, we add the same bias vector to all rows",
# `csrc/flash_attn/src/alibi.h`). Under causal masking all three agree. Every allowed key has
# $j \le i + o$, where $|i + o - j| = i + o - j$, so
#
# $$
# -\text{slope}\,|i + o - j| = \text{slope}\,(j - i) - \text{slope}\cdot o
#                            = \text{slope}\cdot j - \text{slope}\,(i + o),
# $$
#
# which differ only by terms that do not depend on $j$: a constant per row (for attention-gym's
# form the same constant $\text{slope}\cdot o$ in every row, 0 when $N_q = N_k$).
# FlashAttention's test reference uses a third such form under causal,
# `torch.arange(-seqlen_k + 1, 1) * slopes` ($\text{slope}\,(j - N_k + 1)$,
# `attn_bias_from_alibi_slopes` in `tests/test_flash_attn.py`). A softmax does not see a constant
# added to a whole row, $e^{s_j + c} / \sum_{j'} e^{s_{j'} + c} = e^{s_j} / \sum_{j'} e^{s_{j'}}$,
# and masked keys stay at $-\infty$, so the outputs agree. The lse does not: it moves by the
# constant, $\log \sum_j e^{s_j + c} = \text{lse} + c$. A kernel that adds $\text{slope}\cdot j$
# returns the right output and an lse that is $\text{slope}\,(i + o)$ above the lse of the
# documented bias; flash_lib's lse is that of $-\text{slope}\,|i + o - j|$. Without the causal
# mask, keys right of $i + o$ are allowed and $|\cdot|$ folds there: the forms then differ by more
# than a row constant and give different attention.
#
# The picture: the bias of head 0 of 8 (slope $2^{-1} = 1/2$) for $N_q = 12$ queries over
# $N_k = 20$ keys, so $o = 8$, in the three forms, and the differences on the causal pairs.

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

fig, axes = plt.subplots(2, 2, figsize=(11, 8))
axes = axes.ravel()
panels = [(ours, "ours / FlashAttention's docstring\n−slope·|i + o − j|"),
          (gym, "attention-gym: slope·(j − i)"),
          (np.where(causal_a, gym - ours, np.nan), "attention-gym − ours, causal pairs"),
          (np.where(causal_a, fa_causal - ours, np.nan),
           "FlashAttention causal kernel (slope·j)\n− ours, causal pairs")]
for ax, (values, title) in zip(axes, panels):
    image = ax.imshow(values, cmap="viridis", interpolation="nearest", aspect="auto")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("key index $j$")
    fig.colorbar(image, ax=ax, label="bias added to the score")
for ax in axes[::2]:
    ax.set_ylabel("query index $i$")
for ax in axes:
    ax.axline((offset - 0.5, -0.5), slope=1, color="w", linewidth=0.8, linestyle="--")
fig.suptitle(f"ALiBi, slope {slope}, Nq = {n_qa}, Nk = {n_ka} (offset o = {offset}; dashed: j = i + o)")
fig.tight_layout()
plt.show()

row_spread = [np.ptp((fa_causal - ours)[r][causal_a[r]]) for r in range(n_qa)]
row_value = np.array([(fa_causal - ours)[r][causal_a[r]][0] for r in range(n_qa)])
print(f"attention-gym − ours on the causal pairs: {np.unique((gym - ours)[causal_a])} "
      f"(slope·o = {slope * offset:g}) in every row")
print(f"FlashAttention's causal form − ours: spread within a row {max(row_spread):g}; the row "
      f"constants {', '.join(f'{x:g}' for x in row_value[:3])}, ..., {row_value[-1]:g} = "
      f"slope·(i + o)")

# %% [markdown]
# The checks: naive with `alibi_slopes` against softmax with the explicit bias matrix, per head,
# with and without causal, for $N_q < N_k$ (where the offset matters); then the two other forms
# under causal (equal) and attention-gym's without it (not equal).

# %%
qa, ka, va = (rng.standard_normal((2, HEADS, n, 16)) for n in (n_qa, n_ka, n_ka))
bias = -slopes[:, None, None] * np.abs(ia + offset - ja)  # (heads, Nq, Nk)
check("alibi", qa, ka, va, dense_attention(qa, ka, va, scale=0.25, bias=bias),
      alibi_slopes=slopes, block_q=5, block_k=7)
check("alibi, causal", qa, ka, va, dense_attention(qa, ka, va, scale=0.25, bias=bias,
                                                  allowed=causal_a),
      alibi_slopes=slopes, causal=True, block_q=5, block_k=7)
check("alibi (B, H) slopes, causal", qa, ka, va,
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
# ## Grouped-query attention
#
# Multi-query attention gives all query heads one key head and one value head; grouped-query
# attention, $H_{kv}$ of them, each shared by $H_q / H_{kv}$ consecutive query heads. Which heads
# share is a convention, and both FlashAttention and PyTorch fix it the same way:
# `flash_attn_func`'s docstring says "if Q has 6 heads and K, V have 2 heads, head 0, 1, 2 of Q
# will attention to head 0 of K, V, and head 3, 4, 5 of Q will attention to head 1 of K, V";
# PyTorch SDPA's `enable_gqa` (the reference code of `scaled_dot_product_attention` in
# `torch/nn/functional.py`) repeats with `key.repeat_interleave(query.size(-3)//key.size(-3), -3)`;
# FlashAttention's tests repeat with einops' `"b s h d -> b s (h g) d"`. Query head $h$ reads kv
# head $\lfloor h / (H_q/H_{kv}) \rfloor$. The other grouping, $h \bmod H_{kv}$ (`np.tile`,
# `Tensor.repeat`), is a real bug: ONNX's reference used `Tile` until onnx/onnx#7274 ("which gave
# us [head0, head1, head0, head1] combinations. However, in torch, it uses repeat interleave").
#
# flash_lib's `enable_gqa=True` splits q's head axis into $(H_{kv}, \text{groups})$ and gives k
# and v a groups axis of length 1, so NumPy broadcasting pairs each query head with its kv head;
# the gradients of k and v are summed over each group. The cell checks against k and v repeated
# per query head with `np.repeat` (the explicit construction), and that `np.tile`'s grouping gives
# something else.

# %%
h_q, h_kv = 6, 2
qg = rng.standard_normal((2, h_q, 24, 16))
kg, vg = rng.standard_normal((2, h_kv, 40, 16)), rng.standard_normal((2, h_kv, 40, 16))
k_rep, v_rep = np.repeat(kg, h_q // h_kv, axis=1), np.repeat(vg, h_q // h_kv, axis=1)
check("gqa 6 / 2, causal", qg, kg, vg, dense_attention(qg, k_rep, v_rep, scale=0.25,
                                                       allowed=np.tril(np.ones((24, 40), bool), 16)),
      enable_gqa=True, causal=True)
check("mqa 6 / 1", qg, kg[:, :1], vg[:, :1],
      dense_attention(qg, np.repeat(kg[:, :1], 6, axis=1), np.repeat(vg[:, :1], 6, axis=1),
                      scale=0.25), enable_gqa=True)
tiled_grouping = worst(flash_attention(qg, kg, vg, enable_gqa=True),
                       naive_attention(qg, np.tile(kg, (1, 3, 1, 1)), np.tile(vg, (1, 3, 1, 1))))
print(f"against the h mod Hkv grouping (np.tile): error {tiled_grouping:.1f}, a different answer")

dout_g = rng.standard_normal((2, h_q, 24, 16))
out_g, lse_g = flash_attention(qg, kg, vg, enable_gqa=True, causal=True, return_lse=True)
dq_g, dk_g, dv_g = flash_attention_backward(qg, kg, vg, out_g, lse_g, dout_g, enable_gqa=True,
                                            causal=True)
dq_r, dk_r, dv_r = naive_attention_backward(qg, k_rep, v_rep, dout_g, causal=True)
gqa_grad_error = max(worst(dq_g, dq_r), worst(dk_g, dk_r.reshape(2, h_kv, 3, 40, 16).sum(axis=2)),
                     worst(dv_g, dv_r.reshape(2, h_kv, 3, 40, 16).sum(axis=2)))
print(f"gradients: dk, dv of shape {dk_g.shape} (Hkv heads), against the repeated heads' gradients "
      f"summed over each group: {magnitude(gqa_grad_error)}")

# %% [markdown]
# ### What it saves
#
# The keys and values are what a decoder keeps for every past token (its KV cache) and what an
# attention kernel streams through its memory: $2 \cdot H_{kv} \cdot N \cdot d$ numbers per layer and
# sequence. For $H_q = 32$ query heads of $d = 128$ over $N = 8192$ tokens in bfloat16
# (2 bytes each), they take:

# %%
H_Q, D_HEAD, TOKENS, BYTES = 32, 128, 8192, 2
kv_heads = [32, 16, 8, 4, 2, 1]
kv_bytes = {h: 2 * h * TOKENS * D_HEAD * BYTES for h in kv_heads}
print("  Hkv   query heads per kv head   K and V per layer")
for h in kv_heads:
    kind = "  (multi-head)" if h == H_Q else "  (multi-query)" if h == 1 else ""
    print(f"{h:>5}   {H_Q // h:>23}   {kv_bytes[h] / 2**20:>10.0f} MiB{kind}")

fig, ax = plt.subplots(figsize=(6, 3.6))
ax.bar([str(h) for h in kv_heads], [kv_bytes[h] / 2**20 for h in kv_heads])
ax.set_xlabel("kv heads $H_{kv}$ (query heads $H_q$ = 32)")
ax.set_ylabel("K and V bytes per layer (MiB)")
ax.set_title(f"K/V memory, N = {TOKENS}, d = {D_HEAD}, bfloat16")
fig.tight_layout()
plt.show()

# %% [markdown]
# The saving is only real if the kernel never expands k and v to $H_q$ heads. Measured with
# `measure_peak_bytes` (tracemalloc): 16 query heads over one kv head, one block of 128 queries
# (so one worker thread and a reproducible peak) against 2048 and 8192 keys, float32. The
# kernel's scratch (its peak minus the returned output) stays flat as the keys grow; the copy
# that `np.repeat` would make grows with them.

# %%
scratch, copies, repeat_scratch = {}, {}, {}
for n_keys in (2048, 8192):
    qm = rng.standard_normal((16, 128, 64)).astype(np.float32)
    km, vm = (rng.standard_normal((1, n_keys, 64)).astype(np.float32) for _ in range(2))
    out, peak = measure_peak_bytes(flash_attention, qm, km, vm, enable_gqa=True, block_q=128,
                                   block_k=128)
    scratch[n_keys] = peak - out.nbytes
    copies[n_keys] = 16 * (km.nbytes + vm.nbytes)  # k and v repeated per query head
    out, peak = measure_peak_bytes(lambda: flash_attention(qm, np.repeat(km, 16, 0),
                                                           np.repeat(vm, 16, 0), block_q=128,
                                                           block_k=128))
    repeat_scratch[n_keys] = peak - out.nbytes
for n_keys in scratch:
    print(f"Nk = {n_keys}: scratch with enable_gqa {scratch[n_keys] / 2**20:.0f} MiB; "
          f"with k, v repeated first {repeat_scratch[n_keys] / 2**20:.0f} MiB "
          f"(the copy alone: {copies[n_keys] / 2**20:.0f} MiB)")

# %% [markdown]
# ## FlexAttention
#
# PyTorch's FlexAttention expresses variants as two functions and a block map
# (`torch/nn/attention/flex_attention.py`):
#
# | FlexAttention | flash_lib |
# |---|---|
# | `score_mod(score, b, h, q_idx, kv_idx)`, on the scaled score | two fixed score mods: `softcap=` (attention-gym's `generate_tanh_softcap`: `soft_cap * tanh(score / soft_cap)`) and `alibi_slopes=` (`generate_alibi_bias`) |
# | `mask_mod(b, h, q_idx, kv_idx)`, True = participates | `mask_mod(q_idx, k_idx)`, one call per tile with index arrays; batch and head enter as leading dims of its result |
# | `create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE=128)` → `BlockMask` | `tile_schedule(..., window=, mask_mod=)`; the band from its corners, `mask_mod` evaluated tile by tile as the kernel runs |
# | `BlockMask`'s `kv_num_blocks`/`kv_indices` (partial) and `full_kv_*` (full blocks) | a tile is skipped, masked (`_allowed` returns an array) or full (`_allowed` returns None) |
# | sliding window, causal: mask mods (`and_masks`, attention-gym) | `window=(left, right)` and `causal=` keywords |
# | `enable_gqa=True` | `enable_gqa=True` |
#
# `create_block_mask` evaluates `mask_mod` on every pair (`create_mask` builds the dense
# `B × H × Q_LEN × KV_LEN` boolean tensor), pads it to multiples of the block size and sums each
# block (`_convert_mask_to_block_mask`): sum 0 is an empty block, skipped; the full
# `Q_BLOCK_SIZE * KV_BLOCK_SIZE` a full block, computed without calling `mask_mod`; anything in
# between a partial block. Its default block is `_DEFAULT_SPARSE_BLOCK_SIZE = 128`. flash_lib
# never builds that dense mask: it calls `mask_mod` on one tile at a time, inside the kernel.
#
# When PyTorch is installed, the next cell tests the correspondence: for three masks over 1024
# tokens, the blocks of `create_block_mask(..., BLOCK_SIZE=128)` against `tile_schedule` with
# 128 × 128 tiles, and its full blocks against the tiles whose pairs are all allowed; then
# `flex_attention` (eager, which runs PyTorch's reference implementation) with a softcap and
# attention-gym's ALiBi as `score_mod` and a causal document `BlockMask`, against
# `flash_attention` with `softcap=`, `alibi_slopes=`, `causal=True` and the document
# `mask_mod`. Its output depends on what is installed, so the notebook's test does not compare
# it; the asserts at the end run where PyTorch is.

# %% tags=["nbval-ignore-output"]
try:
    import torch
    import torch.nn.attention.flex_attention as flex_module
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:
    torch = None
    print("PyTorch is not installed: the FlexAttention comparison is skipped.")

if torch is not None:
    NF, FB = 1024, 128
    docs_f = np.repeat(np.arange(5), [300, 124, 200, 257, 143])
    docs_t = torch.from_numpy(docs_f)
    flex_masks = {  # name: (FlexAttention mask_mod, flash_lib keywords, the dense mask)
        "document, causal": (lambda b, h, qi, ki: (docs_t[qi] == docs_t[ki]) & (qi >= ki),
                             dict(causal=True, mask_mod=lambda qi, ki: docs_f[qi] == docs_f[ki])),
        "prefix-LM (prefix 300)": (lambda b, h, qi, ki: (ki < 300) | (qi >= ki),
                                   dict(mask_mod=lambda qi, ki: (ki < 300) | (ki <= qi))),
        "sliding window (200, 0)": (lambda b, h, qi, ki: (qi - ki <= 200) & (qi >= ki),
                                    dict(window=(200, 0))),
    }
    qf, kf = np.arange(NF)[:, None], np.arange(NF)[None, :]
    dense_f = {"document, causal": (docs_f[qf] == docs_f[kf]) & (kf <= qf),
               "prefix-LM (prefix 300)": (kf < 300) | (kf <= qf),
               "sliding window (200, 0)": (qf - kf <= 200) & (kf <= qf)}
    block_agreement = {}
    for name, (mod, keywords) in flex_masks.items():
        block_mask = create_block_mask(mod, 1, 1, NF, NF, device="cpu", BLOCK_SIZE=FB)
        flex_blocks = block_mask.to_dense()[0, 0].numpy().astype(bool)
        full = torch.zeros(NF // FB, NF // FB, dtype=torch.int32)
        counts = block_mask.full_kv_num_blocks[0, 0]
        for r in range(NF // FB):
            full[r, block_mask.full_kv_indices[0, 0, r, : counts[r]]] = 1
        our_blocks = np.zeros_like(flex_blocks)
        for q0, _, k0, _ in tile_schedule(NF, NF, FB, FB, **keywords):
            our_blocks[q0 // FB, k0 // FB] = True
        tiles_all = dense_f[name].reshape(NF // FB, FB, NF // FB, FB).all(axis=(1, 3))
        block_agreement[name] = (np.array_equal(flex_blocks, our_blocks),
                                 np.array_equal(full.numpy().astype(bool), tiles_all))
        print(f"{name:<24} BlockMask's blocks == tile_schedule's tiles: "
              f"{block_agreement[name][0]} ({int(our_blocks.sum())} of {our_blocks.size}); "
              f"full blocks == all-allowed tiles: {block_agreement[name][1]} "
              f"({int(tiles_all.sum())})")

    NS, HF, SOFTCAP = 256, 4, 20.0
    docs_s = np.repeat([0, 1, 2], [100, 60, 96])
    docs_st = torch.from_numpy(docs_s)
    slopes_f = 2.0 ** (-8 * (np.arange(HF) + 1) / HF)
    slopes_t = torch.from_numpy(slopes_f)

    def score_mod(score, b, h, q_idx, kv_idx):  # attention-gym's softcap, then its ALiBi
        return SOFTCAP * torch.tanh(score / SOFTCAP) + (kv_idx - q_idx) * slopes_t[h]

    qs, ks, vs = (rng.standard_normal((1, HF, NS, 16)) for _ in range(3))
    doc_block_mask = create_block_mask(
        lambda b, h, qi, ki: (docs_st[qi] == docs_st[ki]) & (qi >= ki), None, None, NS, NS,
        device="cpu")
    with warnings.catch_warnings():  # eager FlexAttention warns that it is not compiled
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        flex_out = flex_attention(*(torch.from_numpy(x) for x in (qs, ks, vs)),
                                  score_mod=score_mod, block_mask=doc_block_mask).numpy()
    ours_out = flash_attention(qs, ks, vs, softcap=SOFTCAP, alibi_slopes=slopes_f, causal=True,
                               mask_mod=lambda qi, ki: docs_s[qi] == docs_s[ki], block_q=64,
                               block_k=64)
    flex_error = worst(ours_out, flex_out)
    default_block = (flex_module._DEFAULT_SPARSE_BLOCK_SIZE,
                     inspect.signature(create_block_mask).parameters["BLOCK_SIZE"].default)
    print(f"create_block_mask's default BLOCK_SIZE: {default_block[1]} "
          f"(_DEFAULT_SPARSE_BLOCK_SIZE = {default_block[0]})")
    print(f"flex_attention (softcap + attention-gym ALiBi, document BlockMask) against "
          f"flash_attention: {flex_error:.1e}")

# %% [markdown]
# ## All the checks
#
# Every variant's two comparisons from the sections above: flash_lib's tiled kernel against
# `naive_attention`, and `naive_attention` against the dense construction of this chapter. The
# table gives the limit each difference is under, the same on every machine; the figure, the
# differences this machine measured, backward ones included.

# %%
print(f"{'variant':<34} {'flash vs naive':<16} naive vs dense")
for name, (e_flash, e_dense) in checks.items():
    print(f"{name:<34} {magnitude(e_flash):<16} {magnitude(e_dense)}")

# The table prints the limit each difference is under; the figure shows the differences measured
# on the machine that built this page, in machine epsilons (their last digits are its rounding).
eps64 = np.finfo(np.float64).eps
measured = {name: e_flash for name, (e_flash, _) in checks.items()}
for name, (e_flash, _) in grad_errors.items():
    measured[f"softcap 5, causal: {name}"] = e_flash
measured["gqa 6 / 2, causal: dq, dk, dv"] = gqa_grad_error
fig, ax = plt.subplots(figsize=(8, 5.2))
rows = np.arange(len(measured))[::-1]
ax.plot(np.array(list(measured.values())) / eps64, rows, "o", color="C0",
        label="flash vs naive, this machine")
ax.axvline(ROUNDING / eps64, color="C3", ls="--", label=f"the limit asserted, {ROUNDING:.0e}")
ax.set_xscale("log")
ax.set_xlim(0.5, 100)
ax.set_yticks(rows, [n if ":" in n else f"{n}: out" for n in measured], fontsize=8)
ax.set_xlabel("largest error of a row, relative (machine epsilons, 2.2e-16)")
ax.set_title("flash_attention(_backward) against naive, every variant of this chapter")
ax.legend(fontsize=8, loc="lower right")
ax.grid(True, axis="x", which="major", alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What we showed
#
# - Each variant is a step in the computation of one score, in FlashAttention's order: scale,
#   cap, ALiBi bias, then every mask ANDed; GQA only chooses which k and v a head reads.
#   flash_attention equals naive_attention to rounding (below $10^{-14}$), and naive_attention
#   equals the dense construction written here from the formulas bit for bit, for every variant
#   and combination tried (table above), forward, and backward for softcap and GQA.
# - The tiles `tile_schedule` lists are exactly those holding an allowed pair, for causal,
#   sliding-window, document, prefix-LM and dilated masks; `mask_mod` is called only on the
#   tiles of the band. A dilated window saves no tile inside its band.
# - A (left, 0) window with 512 × 512 tiles visits $n(w+1) - w(w+1)/2$ tiles,
#   $w = \lceil \text{left}/512 \rceil$: $2n - 1$ for left = 256, linear in $N$ (15 tiles at
#   $N = 4096$, 255 at 65536, where causal needs 8256); its cost is about
#   $N(\text{left} + b)$ score pairs.
# - Softcap bounds the scores in $(-c, c)$, flattens the softmax and multiplies the gradient by
#   $1 - \tanh^2(s/c)$; flash_lib's backward equals the dense chain rule and central
#   differences. Capping after the mask would give masked keys real weight.
# - ALiBi's $-\text{slope}\,|i + o - j|$, attention-gym's $\text{slope}\,(j - i)$ and
#   FlashAttention's causal-kernel $\text{slope}\cdot j$ differ by a constant per row on the
#   causal pairs, so they give the same output under causal masking (not the same lse: it
#   moves by the constant), and not without it.
# - GQA pairs query head $h$ with kv head $\lfloor h / (H_q/H_{kv}) \rfloor$ (`np.repeat`, not
#   `np.tile`); K/V memory falls with $H_{kv}$ (128 MiB per layer for 32 heads at $N = 8192$,
#   4 MiB for one), and flash_lib's scratch stays flat in $N_k$ where a per-head copy grows.
# - FlexAttention's `BlockMask` at `BLOCK_SIZE = 128` marks the same blocks non-empty and full
#   as flash_lib's tiles, and `flex_attention` with a softcap-and-ALiBi `score_mod` gives
#   flash_lib's output (asserted where PyTorch is installed).

# %%
# ROUNDING = 1e-14 is 45 float64 epsilons: rounding over at most 256 keys stayed below 3e-15
# at every NPY_DISABLE_CPU_FEATURES level; any error of a variant (a window off by one, a wrong
# head, a missing cap) is far above. naive and the dense construction do the same operations
# in the same order (the scale 1/4 is a power of two, so where flash_lib applies it changes no
# bit): they agree exactly.
for name, (e_flash, e_dense) in checks.items():
    assert e_flash < ROUNDING and e_dense == 0, (name, e_flash, e_dense)
for name in masks:
    assert schedules[name] == holding[name], name
assert len(schedules["causal"]) == 8 * 9 // 2
assert len(schedules["sliding window (12, 0)"]) == window_tiles(N // BLOCK, 12, BLOCK) == 21
assert len(schedules["dilated (16, dilation 4)"]) == len(tile_schedule(N, N, BLOCK, BLOCK,
                                                                       window=(16, 16)))
assert len(schedules["document, causal"]) < len(schedules["causal"])
assert sorted(calls) == causal_band
for row, n in enumerate(lengths):
    blocks = n // 512
    assert tile_counts["full"][row] == blocks**2
    assert tile_counts["causal"][row] == blocks * (blocks + 1) // 2
    assert tile_counts["window (256, 0)"][row] == 2 * blocks - 1 == window_tiles(blocks, 256, 512)
    assert tile_counts["window (1024, 0)"][row] == 3 * blocks - 3 == window_tiles(blocks, 1024, 512)
assert tile_counts["window (256, 0)"][0] == 15 and tile_counts["window (256, 0)"][-1] == 255
assert tile_counts["causal"][-1] == 8256
assert by_left == [window_tiles(n_window // 512, w, 512) for w in lefts]
assert 3.5 < slack[512] < 4.5 and 1.3 < slack[128] < 1.7  # about (left + b) / (left + 1)
assert np.abs(capped).max() < CAP and 0.2 < beyond < 0.5
assert peak_capped < peak_raw and capped.std() < raw.std()
assert leaked > 0.1 and wrong[~square].max() == -CAP
for e_flash, e_naive in grad_errors.values():
    assert e_flash < ROUNDING and e_naive == 0
assert fd_error < 1e-8  # central differences at eps = 1e-6: truncation and rounding near 1e-10
assert max(row_spread) == 0 and np.array_equal(row_value, slope * (np.arange(n_qa) + offset))
assert np.array_equal(np.unique((gym - ours)[causal_a]), [slope * offset])
assert same_forms["attention-gym's form, causal"] < ROUNDING
assert same_forms["FlashAttention's causal kernel form"] < ROUNDING
assert same_forms["attention-gym's form, not causal"] > 1e-2
assert np.allclose(lse_shift, slopes[:, None] * offset, rtol=0, atol=ROUNDING)  # measured: 9e-16
assert tiled_grouping > 0.1 and gqa_grad_error < ROUNDING
assert kv_bytes[32] == 128 * 2**20 and kv_bytes[1] == 4 * 2**20
assert scratch[8192] < 1.25 * scratch[2048]  # flat in Nk
assert scratch[8192] < copies[8192] / 4  # no per-head copy of k and v
assert repeat_scratch[8192] >= copies[8192]  # the copy, measured
if torch is not None:
    assert all(blocks_ok and full_ok for blocks_ok, full_ok in block_agreement.values())
    assert flex_error < 1e-12
    assert default_block == (128, 128)

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
# # 6. Masks and empty rows
#
# Real attention rarely lets every query see every key: padding hides keys, causal models hide
# the future. This chapter sets masked scores to $-\infty$ (weight exactly 0), keeps an inf or NaN
# stored at a masked key out of every row that may not see it, aligns causal attention
# bottom-right and counts the tiles it skips, and guards the row with no allowed key, whose
# $e^{-\infty - (-\infty)}$ is NaN. Other libraries' choices for empty rows and the causal
# diagonal are compared in {doc}`chapter 25 <25_other_libraries>`.

# %% [markdown]
# ## Boolean masks
#
# `mask[..., i, j]` True means query $i$ may attend to key $j$ (PyTorch's and JAX's convention),
# broadcast against the scores' shape $(\dots, N_q, N_k)$. A masked score becomes $-\infty$, and
# whatever the row's max $m$, $e^{-\infty - m} = 0$ exactly: the key adds nothing to $l$ or
# $\text{acc}$. So masked attention *is* attention over each row's allowed keys, and the masked
# keys' (finite) contents cannot matter. The cell checks both on 6 queries and 50 keys, each
# comparison within $10^{-13}$ (about 450 float64 epsilons: far above rounding, far below a wrong
# weight or a missing key; the errors measured are drawn in the
# {doc}`appendix on how this tutorial is tested <27_how_chapters_1_to_6_are_tested>`).

# %%
import numpy as np
import matplotlib.pyplot as plt
import flash_lib
from flash_lib import rowwise_relative_error

TOL = 1e-13
rng = np.random.default_rng(6)
n_q, n_k, d, d_v = 6, 50, 8, 4
q = rng.standard_normal((n_q, d))
k = rng.standard_normal((n_k, d))
v = rng.standard_normal((n_k, d_v))
mask = rng.random((n_q, n_k)) < 0.6
mask[:, -5:] = False  # five keys no query may see


out_masked = flash_lib.flash_attention(q, k, v, mask=mask, block_q=4, block_k=16)
row_errors = [
    rowwise_relative_error(out_masked[i], flash_lib.naive_attention(q[i : i + 1], k[mask[i]],
                                                                    v[mask[i]])[0])
    for i in range(n_q)
]
print(f"each row against attention over that row's allowed keys only: within {TOL:.0e}: "
      f"{max(row_errors) < TOL}")

k_garbage, v_garbage = k.copy(), v.copy()
k_garbage[-5:], v_garbage[-5:] = 1e150, -1e150
out_garbage = flash_lib.flash_attention(q, k_garbage, v_garbage, mask=mask, block_q=4, block_k=16)
print("masked-out keys set to +-1e150: largest change of the output",
      np.abs(out_garbage - out_masked).max())

# %% [markdown]
# ### Masked keys never leak, not even inf or NaN
#
# A KV cache is allocated for the longest sequence; a shorter one leaves its unused slots holding
# whatever was there, possibly inf or NaN, behind a padding mask. Weight 0 is not enough:
# $0 \cdot \text{NaN} = 0 \cdot \infty = \text{NaN}$ in a plain $PV$ product. flash_lib's
# contract (its module docstring): **an inf or NaN in `k` or `v` at key $j$ reaches exactly the
# rows allowed to attend key $j$, for every block size**. (The kernel finds the few key blocks
# holding such numbers once per call and, for those only, leaves the disallowed pairs out of the
# product.) The cell: two sequences of 17 and 9 tokens in a 24-slot cache, every unused slot NaN
# or $\pm\infty$, against each sequence alone for three block sizes; then the plain product.

# %%
n_cache, lengths = 24, (17, 9)
q_kv = rng.standard_normal((2, 3, d))  # (sequence, query, feature)
k_kv = rng.standard_normal((2, n_cache, d))
v_kv = rng.standard_normal((2, n_cache, d_v))
padding = np.arange(n_cache)[None, :] < np.array(lengths)[:, None]  # (sequence, slot)
for b, length in enumerate(lengths):
    k_kv[b, length:] = np.nan
    v_kv[b, length:: 2] = np.nan
    v_kv[b, length + 1:: 2] = np.inf * rng.choice([-1, 1], size=(len(v_kv[b, length + 1:: 2]), d_v))
cache_mask = padding[:, None, :]  # the same slots hidden from every query of a sequence
alone = [flash_lib.naive_attention(q_kv[b], k_kv[b, :length], v_kv[b, :length])
         for b, length in enumerate(lengths)]
leak_checks = {}
for block_k in (1, 5, flash_lib.DEFAULT_BLOCK_K):
    out_kv = flash_lib.flash_attention(q_kv, k_kv, v_kv, mask=cache_mask, block_k=block_k)
    leak_checks[block_k] = (int(np.isnan(out_kv).sum() + np.isinf(out_kv).sum()),
                            max(rowwise_relative_error(out_kv[b], alone[b]).max() for b in range(2)))
    print(f"block_k = {block_k:>3}: non-finite outputs {leak_checks[block_k][0]}; against "
          f"each sequence alone within {TOL:.0e}: {leak_checks[block_k][1] < TOL}")

# The plain product: the weights of the padded slots are exactly 0, and still 0 · NaN = NaN.
with np.errstate(invalid="ignore"):
    s_kv = np.where(cache_mask, q_kv @ np.swapaxes(np.nan_to_num(k_kv), -1, -2) / np.sqrt(d), -np.inf)
    p_kv = np.exp(s_kv - s_kv.max(axis=-1, keepdims=True))
    plain = (p_kv / p_kv.sum(axis=-1, keepdims=True)) @ v_kv
print("weights on the padded slots:", np.unique(p_kv[~np.broadcast_to(cache_mask, p_kv.shape)]),
      "| plain P @ V: NaN in", int(np.isnan(plain).any(axis=-1).sum()), "of",
      plain.shape[0] * plain.shape[1], "rows")

# %% [markdown]
# ## Causal, aligned bottom-right
#
# In a causal model position $t$ attends to positions $\le t$. When the $N_q$ queries are the
# *last* $N_q$ of $N_k$ tokens, as in decoding ($N_q = 1$) or prefilling a prompt chunk by chunk,
# query $i$ sits at position $i + (N_k - N_q)$, so
#
# $$
# \text{key } j \text{ is allowed for query } i \iff j \le i + (N_k - N_q) .
# $$
#
# The diagonal ends in the bottom-right corner and the last query sees every key. For
# $N_q = N_k$ this is the lower triangle; for $N_q > N_k$ the first $N_q - N_k$ queries have no
# allowed key (empty rows, below). The cell checks the rule against `np.tril(..., k=Nk - Nq)` and
# `causal=True` against `mask=`, and prints a wide and a tall mask.


# %%
def causal_bottom_right(n_q, n_k):
    """mask[i, j] = j <= i + (n_k - n_q)."""
    return np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + (n_k - n_q)


causal_checks = []
for shape in ((6, 6), (2, 5), (5, 2), (1, 7), (16, 40)):
    n_qc, n_kc = shape
    allowed = causal_bottom_right(n_qc, n_kc)
    qc, kc, vc = (rng.standard_normal((n, w)) for n, w in ((n_qc, d), (n_kc, d), (n_kc, d_v)))
    out_causal = flash_lib.flash_attention(qc, kc, vc, causal=True, block_q=3, block_k=4)
    out_mask = flash_lib.naive_attention(qc, kc, vc, mask=allowed)
    same_as_tril = np.array_equal(allowed, np.tril(np.ones(shape, dtype=bool), k=n_kc - n_qc))
    err = rowwise_relative_error(out_causal, out_mask).max()
    causal_checks.append((shape, same_as_tril, err))
    print(f"Nq, Nk = {str(shape):<8}: rule vs tril(k=Nk-Nq): "
          f"{np.count_nonzero(allowed != np.tril(np.ones(shape, dtype=bool), k=n_kc - n_qc))} "
          f"pairs differ; causal=True vs mask= within {TOL:.0e}: {err < TOL}")

print("\nNq = 2, Nk = 5:")
print(causal_bottom_right(2, 5).astype(int))
print("Nq = 5, Nk = 2 (the first three rows are empty):")
print(causal_bottom_right(5, 2).astype(int))

# %% [markdown]
# ### Which tiles causal skips
#
# A tile holds the pairs $(i, j)$ with $q_{\text{start}} \le i < q_{\text{stop}}$ and
# $k_{\text{start}} \le j < k_{\text{stop}}$. The rule $j \le i + (N_k - N_q)$ is easiest to
# satisfy with $i$ large and $j$ small, so a tile contains an allowed pair **iff its bottom-left
# pair** (last query, first key) is allowed:
#
# $$\text{visit the tile} \iff k_{\text{start}} \le (q_{\text{stop}} - 1) + (N_k - N_q) .$$
#
# It is hardest to satisfy with $i$ small and $j$ large, so every pair of a tile is allowed iff
# its **top-right pair** (first query, last key) is, and the tile needs an explicit mask iff
#
# $$k_{\text{stop}} - 1 > q_{\text{start}} + (N_k - N_q) .$$
#
# These are flash_lib's two tests: tiles above the diagonal are never computed, those wholly below
# it run unmasked. **Counting them** (later chapters refer here): for $N_q = N_k = N$ and square
# blocks of size $b$ dividing $N$, $n = N / b$ per side, query block $r$ has bottom-left pairs
# $i = (r + 1) b - 1$, $j = c\,b$, allowed iff $c \le r$: it visits $r + 1$ key blocks, so
#
# $$\sum_{r=0}^{n-1} (r + 1) = \frac{n(n+1)}{2} \quad \text{of the } n^2 \text{ tiles}, $$
#
# a fraction $\tfrac12 + \tfrac1{2n}$. Its top-right pair $i = r b$, $j = (c + 1) b - 1$ is
# disallowed iff $c \ge r$, so of the visited tiles only the diagonal one, $c = r$, needs a
# mask: $n$ tiles in all.
#
# The cell checks both corner tests against the mask itself (a tile is visited exactly when some
# pair in it is allowed, needs a mask exactly when some pair is not) for 8-wide blocks and three
# shapes: $N_q = N_k = 40$; a prompt chunk, $N_q = 24$ against $N_k = 40$; and decoding,
# $N_q = 1$.

# %%
def tile_census(n_q, n_k, block_q, block_k):
    """Visited tiles, all tiles, and visited tiles that need a mask (contain a disallowed pair)."""
    allowed = causal_bottom_right(n_q, n_k)
    visited = flash_lib.tile_schedule(n_q, n_k, block_q, block_k, causal=True)
    every = flash_lib.tile_schedule(n_q, n_k, block_q, block_k)
    shift = n_k - n_q
    any_allowed = [t for t in every if allowed[t[0] : t[1], t[2] : t[3]].any()]
    bottom_left = [t for t in every if t[2] <= (t[1] - 1) + shift]
    assert visited == any_allowed == bottom_left  # visited iff the bottom-left pair is allowed
    needs_mask = [t for t in visited if not allowed[t[0] : t[1], t[2] : t[3]].all()]
    assert needs_mask == [t for t in visited if t[3] - 1 > t[0] + shift]  # top-right pair
    return allowed, visited, every, needs_mask


census = {}
for n_qc, n_kc in ((40, 40), (24, 40), (1, 40)):
    _, visited, every, needs_mask = tile_census(n_qc, n_kc, block_q=8, block_k=8)
    census[(n_qc, n_kc)] = (len(visited), len(every), len(needs_mask))
    print(f"Nq, Nk = {(n_qc, n_kc)}: visits {len(visited)} of {len(every)} tiles, "
          f"{len(needs_mask)} with a mask")

# %% [markdown]
# Shaded squares are allowed pairs, numbered tiles are visited (in that order), hatched ones are
# skipped.

# %% tags=["hide-input"]
def draw_causal(ax, n_q, n_k, block_q, block_k):
    allowed, visited, every, needs_mask = tile_census(n_q, n_k, block_q, block_k)
    ax.imshow(allowed, cmap=plt.matplotlib.colors.ListedColormap(["white", "#9ecae1"]),
              extent=(0, n_k, n_q, 0), aspect="equal", interpolation="nearest", vmin=0, vmax=1)
    for q_start, q_stop, k_start, k_stop in every:
        if (q_start, q_stop, k_start, k_stop) not in visited:
            ax.add_patch(plt.Rectangle((k_start, q_start), k_stop - k_start, q_stop - q_start,
                                       facecolor="none", edgecolor="grey", hatch="xx",
                                       linewidth=0.5))
    for order, (q_start, q_stop, k_start, k_stop) in enumerate(visited):
        ax.add_patch(plt.Rectangle((k_start, q_start), k_stop - k_start, q_stop - q_start,
                                   facecolor="none", edgecolor="black", linewidth=1.5))
        ax.text((k_start + k_stop) / 2, (q_start + q_stop) / 2, str(order),
                ha="center", va="center", fontsize=9)
    ax.set_xlim(0, n_k)
    ax.set_ylim(n_q, 0)
    ax.set_xticks(range(0, n_k + 1, block_k))
    ax.set_yticks(sorted({t[0] for t in every} | {n_q}))
    ax.set_xlabel("key index $j$")
    ax.set_ylabel("query index $i$")
    ax.set_title(f"$N_q$ = {n_q}, $N_k$ = {n_k}: {len(visited)} of {len(every)} tiles,\n"
                 f"{len(needs_mask)} need a mask")


# Equal scales on both axes, so a query row is as tall as a key column is wide; the one-query
# case is a strip of its own along the bottom, wide enough to read its tiles.
fig, axd = plt.subplot_mosaic([["full", "chunk"], ["decode", "decode"]], figsize=(10, 7.2),
                              gridspec_kw={"height_ratios": [40, 9]})
axes = [axd["full"], axd["chunk"], axd["decode"]]
for ax, shape in zip(axes, census):
    draw_causal(ax, *shape, block_q=8, block_k=8)
handles = [plt.Rectangle((0, 0), 1, 1, facecolor="#9ecae1"),
           plt.Rectangle((0, 0), 1, 1, facecolor="none", edgecolor="black", linewidth=1.5),
           plt.Rectangle((0, 0), 1, 1, facecolor="none", edgecolor="grey", hatch="xx")]
fig.legend(handles, ["allowed pair", "visited tile (visiting order)", "skipped tile"],
           loc="lower center", ncol=3)
fig.suptitle("Causal attention, bottom-right aligned, 8 x 8 tiles")
fig.tight_layout(rect=(0, 0.05, 1, 1))
plt.show()

# %% [markdown]
# ## The empty row
#
# A row with no allowed key has every score and its max $m$ at $-\infty$, and the safe softmax's
# $s_j - m$ is $-\infty - (-\infty)$: NaN in IEEE 754 (NumPy's warning is silenced so the NaN
# shows).

# %%
empty_row = np.full(4, -np.inf)  # the scores of a row with no allowed key
with np.errstate(invalid="ignore"):
    p_empty = np.exp(empty_row - empty_row.max())
print("m =", empty_row.max(), "  exp(s - m) =", p_empty)

# %% [markdown]
# ### Where the NaN enters a streaming loop
#
# Chapter 4's one-query stream with a mask and no guard: while every key a row has seen was
# masked, its running max stays $-\infty$, and both $\alpha$ and $p_j$ are
# $e^{-\infty - (-\infty)}$ = NaN, in $l$ and $\text{acc}$ for good. That hits fully masked rows
# and also rows whose *first* key block is masked (left padding), though their answer is well
# defined and the two-pass softmax gets it. Four queries over 12 keys in blocks of 4: row 0 sees
# every key, row 1 none, row 2 is left-padded (keys 0 to 4), row 3 has some allowed key in every
# block.

# %%
n_q, n_k, block_k = 4, 12, 4
q = rng.standard_normal((n_q, d))
k = rng.standard_normal((n_k, d))
v = rng.standard_normal((n_k, d_v))
mask = np.ones((n_q, n_k), dtype=bool)
mask[1, :] = False  # no key at all
mask[2, :5] = False  # left padding: the whole first block is masked
mask[3] = rng.random(n_k) < 0.5
mask[3, ::block_k] = True  # some allowed key in every block


def stream_masked(q_row, k, v, allowed, block_k, guard):
    """One query over key blocks, masked scores set to -inf.

    Returns out, lse and one row (first key, m', alpha, l) per block.
    """
    tau = 1 / np.sqrt(q_row.shape[-1])
    m, l, acc = -np.inf, 0.0, np.zeros(v.shape[-1])
    trace = []
    for start in range(0, len(k), block_k):
        stop = start + block_k
        s = np.where(allowed[start:stop], tau * (k[start:stop] @ q_row), -np.inf)
        m_new = max(m, s.max())
        # The guard: a finite reference for rows that have seen no allowed key yet.
        m_ref = 0.0 if (guard and m_new == -np.inf) else m_new
        alpha = np.exp(m - m_ref)
        p = np.exp(s - m_ref)
        l = alpha * l + p.sum()
        acc = alpha * acc + p @ v[start:stop]
        trace.append((start, m_new, alpha, l))
        m = m_new
    if guard and l == 0:  # no allowed key at all: the empty sum
        return np.zeros_like(acc), -np.inf, trace
    return acc / l, m + np.log(l), trace


with np.errstate(invalid="ignore"):
    unguarded = [stream_masked(q[i], k, v, mask[i], block_k, guard=False) for i in range(n_q)]

print("row 2 without the guard, state after each block:")
print("block  m'       alpha    l")
for b, (start, m_new, alpha, l) in enumerate(unguarded[2][2]):
    print(f"{b:>5}  {m_new:<7.3f}  {alpha:<7.3f}  {l:.3f}")

out_naive, lse_naive = flash_lib.naive_attention(q, k, v, mask=mask, return_lse=True)
print("\nrow  NaN in unguarded output   naive_attention's row is finite")
for i in range(n_q):
    print(f"{i:>3}  {bool(np.isnan(unguarded[i][0]).any())!s:>23}   "
          f"{bool(np.isfinite(out_naive[i]).all())!s:>31}")

# %% [markdown]
# ### The guard, and what an empty row returns
#
# One comparison per row and tile: exponentiate against
#
# $$
# m_{\text{ref}} =
# \begin{cases}
#   m' & \text{if } m' > -\infty, \\
#   0  & \text{if } m' = -\infty,
# \end{cases}
# \qquad
# \alpha = e^{m - m_{\text{ref}}}, \qquad p_j = e^{s_j - m_{\text{ref}}} .
# $$
#
# While a row has seen no allowed key, $p_j = e^{-\infty} = 0$ and $\alpha = 0$: no NaN, and rows
# with a finite max are unchanged. Any finite reference would do; 0 is FlashAttention's choice
# too (chapter 25). In flash_lib it is `m_ref` in the tile update (chapter 5), and
# `naive_attention` uses it for whole rows.
#
# At the end $l = 0$ exactly for a row with no allowed key (otherwise its largest score gives
# $e^0 = 1$, so $l \ge 1$). There `_finalize` returns output 0 and lse $= -\infty$, without
# $0/0$ or $\log 0$: the empty weighted sum and $\log \sum_{j \in \emptyset} e^{s_j}$. That lse
# composes: `merge_attention` (chapter 3) weights an empty part by $e^{-\infty} = 0$. Other
# libraries store other values ({doc}`chapter 25 <25_other_libraries>`). The cell runs the guarded
# stream, `flash_attention` (`block_k = 4`: row 2's first tile is fully masked) and
# `naive_attention` with invalid operations, division by zero and overflow raising exceptions,
# then merges the empty row with a non-empty one.

# %%
with np.errstate(invalid="raise", divide="raise", over="raise"):
    guarded = [stream_masked(q[i], k, v, mask[i], block_k, guard=True) for i in range(n_q)]
    out_flash, lse_flash = flash_lib.flash_attention(q, k, v, mask=mask, block_q=2, block_k=4,
                                                     return_lse=True)
    out_naive, lse_naive = flash_lib.naive_attention(q, k, v, mask=mask, return_lse=True)

out_guarded = np.array([g[0] for g in guarded])
lse_guarded = np.array([g[1] for g in guarded])
nonempty = [0, 2, 3]
print("empty row 1, largest |output| (flash, naive, stream):",
      *(np.abs(o[1]).max() for o in (out_flash, out_naive, out_guarded)))
print("empty row 1, lse (flash, naive, stream):", lse_flash[1], lse_naive[1], lse_guarded[1])
err_rows = {
    "flash vs naive": rowwise_relative_error(out_flash[nonempty], out_naive[nonempty]).max(),
    "stream vs naive": rowwise_relative_error(out_guarded[nonempty], out_naive[nonempty]).max(),
    "lse, flash vs naive": np.abs(lse_flash[nonempty] - lse_naive[nonempty]).max(),
    "lse, stream vs naive": np.abs(lse_guarded[nonempty] - lse_naive[nonempty]).max(),
}
print(f"rows 0, 2, 3, within {TOL:.0e}:", ", ".join(f"{name} {e < TOL}" for name, e in
                                                   list(err_rows.items())[:2]))
print("  ", ", ".join(f"{name} {e < TOL}" for name, e in list(err_rows.items())[2:]))

# An empty part merged with a non-empty one leaves the non-empty one unchanged.
out_merged, lse_merged = flash_lib.merge_attention(out_flash[1:2], lse_flash[1:2],
                                                   out_flash[0:1], lse_flash[0:1])
print("merge(empty row, row 0) - row 0: largest difference",
      np.abs(out_merged - out_flash[0:1]).max(), "in out,", np.abs(lse_merged - lse_flash[0:1]).max(),
      "in lse")

# %% [markdown]
# The rows causal attention empties when $N_q > N_k$ are the same: with $N_q = 5$, $N_k = 2$ the
# first three outputs are exactly 0, as the mask printed above predicts.

# %%
qc, kc, vc = rng.standard_normal((5, d)), rng.standard_normal((2, d)), rng.standard_normal((2, d_v))
with np.errstate(invalid="raise", divide="raise", over="raise"):
    out_c, lse_c = flash_lib.flash_attention(qc, kc, vc, causal=True, block_q=2, block_k=1,
                                             return_lse=True)
    out_cn, lse_cn = flash_lib.naive_attention(qc, kc, vc, causal=True, return_lse=True)
print("rows that are exactly 0:", [i for i in range(5) if np.all(out_c[i] == 0)])
print("lse:", lse_c[:3], "(flash)", lse_cn[:3], "(naive)")
err_causal_tall = rowwise_relative_error(out_c[3:], out_cn[3:]).max()
print(f"rows 3 and 4 against naive: within {TOL:.0e}:", err_causal_tall < TOL)

# %% [markdown]
# ## What we showed
#
# - A masked score's weight is exactly 0: masked attention is attention over each row's allowed
#   keys, and huge finite numbers at masked keys change nothing, bit for bit.
# - Masked keys never leak: NaN and $\pm\infty$ in a KV cache's padded slots reach no output at
#   any block size, where a plain $PV$ product with weights 0 turns every row NaN.
# - `causal=True` allows key $j$ for query $i$ iff $j \le i + (N_k - N_q)$, as
#   `np.tril(..., k=Nk - Nq)`. A tile is visited iff its bottom-left pair is allowed and needs a
#   mask iff its top-right pair is not: $n(n+1)/2$ of $n^2$ tiles, $n$ masked, for $n$ square
#   blocks per side; every tile, none masked, for decoding.
# - Without a guard, $e^{-\infty - (-\infty)}$ = NaN enters a stream at the first block where a
#   row has seen no allowed key, left-padded rows included. With $m_{\text{ref}} = 0$ there and
#   $l = 0$ detected at the end, an empty row gives output 0 and lse $= -\infty$ in all three
#   computations, with no invalid operation, and merges as nothing.

# %%
assert max(row_errors) < TOL
assert np.array_equal(out_masked, out_garbage)
for n_bad, err in leak_checks.values():
    assert n_bad == 0 and err < TOL, leak_checks
assert np.all(np.isnan(plain).any(axis=-1))  # without the contract, every row would be NaN
assert all(same and err < TOL for _, same, err in causal_checks)
assert census[(40, 40)] == (15, 25, 5)
n_blocks = 40 // 8
assert census[(40, 40)][:3:2] == (n_blocks * (n_blocks + 1) // 2, n_blocks)
assert census[(1, 40)] == (5, 5, 0)
assert census[(24, 40)][0] < census[(24, 40)][1]
assert empty_row.max() == -np.inf and np.all(np.isnan(p_empty))
assert all(np.isnan(unguarded[i][0]).all() for i in (1, 2))
assert not any(np.isnan(unguarded[i][0]).any() for i in (0, 3))
assert np.isnan(unguarded[2][2][0][2])  # alpha of row 2's first block is NaN
assert np.all(np.isfinite(out_naive[nonempty]))
assert np.all(out_flash[1] == 0) and np.all(out_naive[1] == 0) and np.all(out_guarded[1] == 0)
assert lse_flash[1] == -np.inf and lse_naive[1] == -np.inf and lse_guarded[1] == -np.inf
assert max(err_rows.values()) < TOL, err_rows
assert np.array_equal(out_merged, out_flash[0:1]) and np.array_equal(lse_merged, lse_flash[0:1])
assert [i for i in range(5) if np.all(out_c[i] == 0)] == [0, 1, 2]
assert np.all(lse_c[:3] == -np.inf) and np.all(lse_cn[:3] == -np.inf)
assert err_causal_tall < TOL

# %% [markdown]
# ## Your turn: the tiled forward
#
# Write `forward(q, k, v, *, causal=False, block_q=64, block_k=64) -> (out, lse)` for
# `q (Nq, d)`, `k (Nk, d)`, `v (Nk, dv)`: scale $1/\sqrt d$, tiles of `block_q` queries by
# `block_k` keys folded one at a time, causal aligned bottom-right (key $j$ allowed iff
# $j \le i + N_k - N_q$), and a row with no allowed key gives `out = 0`, `lse = -inf`. After its
# own small cases the grader runs `flash_check`'s cases in float32, and measures your scratch
# memory at two sizes: it must not grow as $N^2$.
#
# Replace the stub with your function and re-run the grade cell: it says `not implemented yet`,
# then what is wrong and where to look, until `passed`. The solution is hidden below it.

# %%
from flash_check.exercises import grade, show_solution, stub

# your turn: replace the stub with def forward(q, k, v, *, causal=False, block_q=64, block_k=64): ...
forward = stub("forward")

# %%
grade("forward", forward)

# %% jupyter={"outputs_hidden": true} mystnb={"code_prompt_hide": "Hide the solution", "code_prompt_show": "Show the solution"} tags=["remove-input", "hide-output"]
show_solution("forward")

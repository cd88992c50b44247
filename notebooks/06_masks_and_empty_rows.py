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
# Real attention rarely lets every query see every key: padding hides keys, causal language
# models hide the future. In this chapter:
#
# - a boolean mask (True = may attend) sets masked scores to $-\infty$, which gives them weight
#   exactly 0: masked attention is attention over each row's allowed keys;
# - flash_lib's contract for masked keys: an inf or NaN stored at a masked key (the unused slots
#   of a KV cache) never reaches a row that may not attend it, although $0 \cdot \text{NaN}$ is
#   NaN;
# - causal attention aligned bottom-right, key $j$ allowed for query $i$ iff
#   $j \le i + (N_k - N_q)$, why that alignment, and which tiles `flash_attention` then skips, for
#   $N_q = N_k$ and $N_q \ne N_k$;
# - the row with no allowed key: where its NaN, $e^{-\infty - (-\infty)}$, enters a streaming
#   loop (also in rows that do have allowed keys), the guard that keeps it out, and the result,
#   output 0 with lse $= -\infty$.
#
# Other libraries make other choices for empty rows and for the causal diagonal; the appendix
# (chapter 24) compares them, tested against PyTorch and JAX where they are installed.

# %% [markdown]
# ## Boolean masks
#
# `mask[..., i, j]` True means query $i$ may attend to key $j$, the convention of PyTorch's
# `scaled_dot_product_attention` and of JAX; flash_lib broadcasts the mask against the scores'
# shape $(\dots, N_q, N_k)$. A masked score is replaced by $s_{ij} = -\infty$ before the softmax.
# Whatever the row's max $m$ is, $e^{-\infty - m} = 0$ exactly, so the masked key adds exactly
# nothing to $l$ or to $\text{acc}$: for each row, masked attention *is* attention over that row's
# allowed keys, and the masked keys' (finite) contents cannot matter.
#
# The cell checks both statements with a random mask on 6 queries and 50 keys: each row of the
# masked `flash_attention` against `naive_attention` given only that row's allowed keys, and the
# masked output against the one computed after overwriting every masked-out key and value with
# huge numbers wherever no row may see them.
#
# Each such comparison in this chapter is printed against one bound, $10^{-13}$ (about 450
# float64 epsilons): rounding on rows of at most 50 keys, whose last bits are the CPU's, stays far
# below it, any error of the algorithm (a wrong weight, a missing key) far above. The measured
# differences are plotted at the end of the chapter.

# %%
import numpy as np
import matplotlib.pyplot as plt
import flash_lib
from flash_lib import rowwise_relative_error

# Measured on this machine at every NumPy CPU level (AVX-512, AVX2, baseline) and with OpenBLAS's
# Haswell kernel: every difference below is at most 2.2e-15, 45 times below TOL.
TOL = 1e-13
measured = {}  # each rounding-level difference of the chapter, for the figure at its end
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
measured["each row vs its allowed keys alone"] = max(row_errors)
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
# "The masked keys' contents cannot matter" needs more than weight 0 when they are not finite.
# A KV cache is allocated for the longest sequence; a shorter sequence leaves its unused slots
# holding whatever was there, possibly inf or NaN, behind a key-padding mask. But
# $0 \cdot \text{NaN} = 0 \cdot \infty = \text{NaN}$, so in a plain $PV$ product a weight of
# exactly 0 does not keep a NaN value out of a row. flash_lib's
# contract (its module docstring): **an inf or NaN in `k` or `v` at key $j$ reaches exactly the
# rows allowed to attend key $j$, for every block size**; a row that may not attend it is computed
# as if key $j$ did not exist. (The kernel finds the few key blocks whose values hold such numbers
# once per call and, for those blocks only, leaves the disallowed pairs out of the product.)
#
# The cell: a batch of two sequences in one cache of 24 slots, holding 17 and 9 tokens; every
# unused slot of `k` and `v` is NaN or $\pm\infty$; the mask allows each sequence's own tokens.
# It compares the output with attention over each sequence's tokens alone, for three block sizes,
# then shows the plain product that leaks.

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
    measured[f"KV cache, block_k = {block_k}, vs each sequence alone"] = leak_checks[block_k][1]
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
# In a causal model the token at position $t$ attends to positions $\le t$. When the $N_q$ queries
# are the *last* $N_q$ of the $N_k$ tokens, as in decoding with a key-value cache ($N_q = 1$) or
# prefilling a long prompt chunk by chunk ($N_q < N_k$), query $i$ sits at position
# $i + (N_k - N_q)$, so
#
# $$
# \text{key } j \text{ is allowed for query } i \iff j \le i + (N_k - N_q) .
# $$
#
# The diagonal runs into the bottom-right corner of the $N_q \times N_k$ score matrix, and the
# last query always sees every key. For $N_q = N_k$ this is the usual lower triangle; for
# $N_q > N_k$ the first $N_q - N_k$ queries have no allowed key at all: empty rows, the next
# section's subject. The cell builds the same mask with `np.tril(..., k=Nk - Nq)`, checks that
# `causal=True` and `mask=` agree, and prints it for a wide and a tall shape.


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
    measured[f"causal=True vs mask=, Nq, Nk = {shape}"] = err
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
# These are flash_lib's two tests (its `_Band`: `key_blocks` stops the key loop at the first tile
# that fails the first, `tile` builds the triangle only for tiles that pass the second): tiles
# above the diagonal are never computed, those wholly below it run unmasked. **Counting them.**
# For $N_q = N_k = N$ and square blocks of size $b$ dividing $N$, $n = N / b$ blocks per side,
# query block $r$ ($r = 0, \dots, n - 1$) has bottom-left pairs $i = (r + 1) b - 1$,
# $j = c\,b$, allowed iff $c \le r$: it visits $r + 1$ key blocks, and causal visits
#
# $$\sum_{r=0}^{n-1} (r + 1) = \frac{n(n+1)}{2} \quad \text{of the } n^2 \text{ tiles}, $$
#
# a fraction $\tfrac12 + \tfrac1{2n}$. Its top-right pair $i = r b$, $j = (c + 1) b - 1$ is
# disallowed iff $c \ge r$, so of the visited tiles only the diagonal one, $c = r$, needs a
# mask: $n$ tiles in all.
#
# The figure shows three cases with 8-wide blocks: $N_q = N_k = 40$; a prompt chunk of
# $N_q = 24$ queries against $N_k = 40$ keys; and decoding, $N_q = 1$, where every tile is
# visited and none needs a mask. Shaded squares are allowed pairs, numbered tiles are visited (in
# that order), hatched ones are skipped. The cell checks the two corner tests against the mask
# itself: a tile is visited exactly when some pair in it is allowed, and needs a mask exactly
# when some pair in it is not.

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
    return len(visited), len(every), len(needs_mask)


# Equal scales on both axes, so a query row is as tall as a key column is wide; the one-query
# case is a strip of its own along the bottom, wide enough to read its tiles.
fig, axd = plt.subplot_mosaic([["full", "chunk"], ["decode", "decode"]], figsize=(10, 7.2),
                              gridspec_kw={"height_ratios": [40, 9]})
axes = [axd["full"], axd["chunk"], axd["decode"]]
census = {}
for ax, (n_qc, n_kc) in zip(axes, ((40, 40), (24, 40), (1, 40))):
    census[(n_qc, n_kc)] = draw_causal(ax, n_qc, n_kc, block_q=8, block_k=8)
handles = [plt.Rectangle((0, 0), 1, 1, facecolor="#9ecae1"),
           plt.Rectangle((0, 0), 1, 1, facecolor="none", edgecolor="black", linewidth=1.5),
           plt.Rectangle((0, 0), 1, 1, facecolor="none", edgecolor="grey", hatch="xx")]
fig.legend(handles, ["allowed pair", "visited tile (visiting order)", "skipped tile"],
           loc="lower center", ncol=3)
fig.suptitle("Causal attention, bottom-right aligned, 8 x 8 tiles")
fig.tight_layout(rect=(0, 0.05, 1, 1))
plt.show()

for shape, (n_visited, n_all, n_masked) in census.items():
    print(f"Nq, Nk = {shape}: visits {n_visited} of {n_all} tiles, {n_masked} with a mask")

# %% [markdown]
# ## The empty row
#
# A row with no allowed key has every score $-\infty$, so its max is $m = -\infty$ and the safe
# softmax's $s_j - m$ is $-\infty - (-\infty)$, which IEEE 754 defines as NaN. NumPy would also warn
# "invalid value encountered in subtract"; here and below that warning is silenced with
# `np.errstate(invalid="ignore")` so that the NaN shows in the printed output instead.

# %%
empty_row = np.full(4, -np.inf)  # the scores of a row with no allowed key
with np.errstate(invalid="ignore"):
    p_empty = np.exp(empty_row - empty_row.max())
print("m =", empty_row.max(), "  exp(s - m) =", p_empty)

# %% [markdown]
# ### Where the NaN enters a streaming loop
#
# Here is chapter 4's one-query stream with a mask and without any guard. A row's running max
# stays $-\infty$ as long as every key it has seen was masked. In such a block both
# $\alpha = e^{m - m'}$ and $p_j = e^{s_j - m'}$ are $e^{-\infty - (-\infty)}$: NaN, which then
# stays in $l$ and $\text{acc}$ for good. That happens to fully masked rows, and also to any row
# whose *first* key block is fully masked (left padding), although it has allowed keys and a
# well-defined answer. The two-pass softmax, which subtracts the row's global max, gets that row
# right: the NaN is the stream's own doing.
#
# Four queries over 12 keys in blocks of 4: row 0 sees every key, row 1 no key (a padding
# query), row 2 is left-padded (keys 0 to 4 masked), row 3 has a random mask that allows some key
# in every block. The cell prints, for row 2, the state after each block, then every row's output.

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
# The fix costs one comparison per row and tile. Exponentiate against a reference
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
# While a row has seen no allowed key, every $s_j$ and $m$ are $-\infty$, so $p_j = e^{-\infty} = 0$
# and $\alpha = e^{-\infty} = 0$ (multiplying $l = 0$ and $\text{acc} = 0$): no NaN, and nothing
# changes for rows with a finite max. Any finite reference would do; 0 is also FlashAttention's
# choice (chapter 24). In flash_lib this is `m_ref` in `flash_attention`'s tile loop, and
# `naive_attention` uses the same reference for its whole rows.
#
# At the end, $l = 0$ exactly when the row had no allowed key: otherwise its largest allowed score
# contributes $e^{0} = 1$ and no term is negative, so $l \ge 1$. For those rows flash_lib's
# `_finalize` returns the output $0$ and $\text{lse} = -\infty$ without computing $0/0$ or
# $\log 0$: the exact values for an empty set of keys, the empty weighted sum and
# $\log \sum_{j \in \emptyset} e^{s_j} = \log 0$. That lse also composes: chapter 3's
# `merge_attention` weights a part by $e^{\text{lse}}$, so an empty part merges as weight 0 and
# changes nothing (the cell below merges this chapter's empty row with a non-empty one). Other
# libraries store other values, with consequences {doc}`chapter 24 <24_other_libraries>` shows.
#
# The cell runs the guarded stream, `flash_attention` (with `block_k = 4`, so that row 2's first
# tile is fully masked) and `naive_attention` under `np.errstate(invalid="raise", divide="raise",
# over="raise")`: an invalid operation, a division by zero or an overflow anywhere would raise an
# exception instead of a warning. It then merges the empty row with a non-empty part.

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
measured.update({f"rows 0, 2, 3: {name}": e for name, e in err_rows.items()})
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
# The same holds for the rows that causal attention empties when $N_q > N_k$: with $N_q = 5$,
# $N_k = 2$ the first three outputs are exactly 0, as the mask printed above predicts.

# %%
qc, kc, vc = rng.standard_normal((5, d)), rng.standard_normal((2, d)), rng.standard_normal((2, d_v))
with np.errstate(invalid="raise", divide="raise", over="raise"):
    out_c, lse_c = flash_lib.flash_attention(qc, kc, vc, causal=True, block_q=2, block_k=1,
                                             return_lse=True)
    out_cn, lse_cn = flash_lib.naive_attention(qc, kc, vc, causal=True, return_lse=True)
print("rows that are exactly 0:", [i for i in range(5) if np.all(out_c[i] == 0)])
print("lse:", lse_c[:3], "(flash)", lse_cn[:3], "(naive)")
measured["causal, Nq, Nk = (5, 2): rows 3, 4 vs naive"] = rowwise_relative_error(out_c[3:],
                                                                                 out_cn[3:]).max()
print(f"rows 3 and 4 against naive: within {TOL:.0e}:",
      measured["causal, Nq, Nk = (5, 2): rows 3, 4 vs naive"] < TOL)

# %% [markdown]
# ## The rounding, measured
#
# Each comparison above printed only whether it stayed within $10^{-13}$. Here is what each
# measured on the machine that built this page, in float64 epsilons ($2^{-52} \approx 2.2 \times
# 10^{-16}$), against that bound: a few epsilons at most. Another CPU rounds differently and
# draws other points in the same region; a difference of exactly 0 is drawn at the left edge.

# %%
eps = np.finfo(np.float64).eps
floor = 0.1  # where an exact 0 is drawn, in eps
names, values = list(measured), np.array([float(e) for e in measured.values()]) / eps
fig, ax = plt.subplots(figsize=(8, 4.5))
exact = values == 0
ax.semilogx(np.where(exact, floor, values), np.arange(len(names)), "o", color="C0",
            label="measured difference")
ax.semilogx(np.full(exact.sum(), floor), np.flatnonzero(exact), "o", mfc="white", color="C0",
            label="exactly 0 (drawn at the edge)")
ax.axvline(TOL / eps, color="C3", ls="--", label=f"bound {TOL:.0e} = {TOL / eps:.0f} eps")
ax.set_yticks(np.arange(len(names)), names, fontsize=8)
ax.invert_yaxis()
ax.set_xlim(floor / 2, 2 * TOL / eps)
ax.set_xlabel("largest difference of a row, relative (lse: absolute), in float64 epsilons")
ax.set_title("Rounding-level differences in this chapter, float64")
ax.legend(fontsize=8, loc="lower right")
ax.grid(True, which="major", axis="x", alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What we showed
#
# - A masked score becomes $-\infty$ and its weight exactly 0: each row of masked attention equals
#   attention over that row's allowed keys only, and overwriting masked-out keys and values with
#   huge finite numbers changes nothing, bit for bit.
# - Masked keys never leak: with NaN and $\pm\infty$ in every padded slot of a KV cache, the
#   output has no NaN or inf at any block size and equals attention over each sequence's own
#   tokens, where a plain $PV$ product with weights exactly 0 turns every row NaN.
# - `causal=True` allows key $j$ for query $i$ iff $j \le i + (N_k - N_q)$, the same as
#   `np.tril(..., k=Nk - Nq)` and as passing that mask, for square, wide and tall shapes.
# - A tile is visited iff its bottom-left pair is allowed and needs a mask iff its top-right pair
#   is not; for $n$ square blocks per side that is $n(n+1)/2$ of $n^2$ tiles, $n$ of them masked:
#   15 of 25, 5 masked, for $N_q = N_k = 40$ with 8-wide blocks, and every tile, none masked, for
#   decoding.
# - $e^{-\infty - (-\infty)}$ is NaN. In a streaming loop without a guard it enters at the first
#   block in which a row has seen no allowed key: fully masked rows, but also a left-padded row
#   whose answer is well defined and which `naive_attention` computes finitely.
# - With the reference $m_{\text{ref}} = 0$ for rows whose max is still $-\infty$, and $l = 0$
#   detected at the end, an empty row gives output exactly 0 and lse $= -\infty$ in the guarded
#   stream, `flash_attention` and `naive_attention`, with no invalid operation, division by zero or
#   overflow; the other rows are unaffected, and merging an empty part changes nothing.
# - Every comparison of two orders of computation differs by rounding only: within $10^{-13}$,
#   and measured at a few float64 epsilons.

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
assert max(measured.values()) < TOL, measured

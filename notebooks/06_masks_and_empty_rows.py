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
# - causal attention aligned bottom-right, key $j$ allowed for query $i$ iff
#   $j \le i + (N_k - N_q)$, why that alignment, and which tiles `flash_attention` then skips, for
#   $N_q = N_k$ and $N_q \ne N_k$;
# - the row with no allowed key: $e^{-\infty - (-\infty)}$ is NaN, where that NaN enters a naive
#   streaming loop (also in rows that do have allowed keys), the guard that keeps it out, and the
#   result, an output of 0 with lse $= -\infty$, in both `flash_attention` and `naive_attention`;
# - what PyTorch, FlashAttention and JAX do with such rows, and where their causal diagonals sit
#   when $N_q \ne N_k$, from their sources.

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

# %%
import numpy as np
import matplotlib.pyplot as plt
import flash_lib

rng = np.random.default_rng(6)
n_q, n_k, d, d_v = 6, 50, 8, 4
q = rng.standard_normal((n_q, d))
k = rng.standard_normal((n_k, d))
v = rng.standard_normal((n_k, d_v))
mask = rng.random((n_q, n_k)) < 0.6
mask[:, -5:] = False  # five keys no query may see


def rel_err(x, ref):
    """The largest row error, max_c |x_ic - ref_ic| / max_c |ref_ic| (flash_lib's metric)."""
    return flash_lib.rowwise_relative_error(x, ref).max()


out_masked = flash_lib.flash_attention(q, k, v, mask=mask, block_q=4, block_k=16)
row_errors = [
    rel_err(out_masked[i], flash_lib.naive_attention(q[i : i + 1], k[mask[i]], v[mask[i]])[0])
    for i in range(n_q)
]
print("each row = attention over that row's allowed keys only:", max(row_errors) < 1e-13)

k_garbage, v_garbage = k.copy(), v.copy()
k_garbage[-5:], v_garbage[-5:] = 1e150, -1e150
out_garbage = flash_lib.flash_attention(q, k_garbage, v_garbage, mask=mask, block_q=4, block_k=16)
print("masked-out keys and values do not matter:", bool(np.array_equal(out_masked, out_garbage)))

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
# last query always sees every key. For $N_q = N_k$ this is the usual lower triangle. For
# $N_q > N_k$ the first $N_q - N_k$ queries have no allowed key at all: empty rows, the subject of
# the next section. `flash_attention(..., causal=True)` uses this rule; the cell builds the same
# mask explicitly with `np.tril(..., k=Nk - Nq)`, checks that `causal=True` and `mask=` agree, and
# prints it for the two shapes FlashAttention's documentation uses as examples (quoted at the end of
# the chapter).


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
    close = np.allclose(out_causal, out_mask, rtol=1e-13, atol=1e-15)
    causal_checks.append((shape, same_as_tril, close))
    print(f"Nq, Nk = {shape}: rule = tril(k=Nk-Nq): {same_as_tril}, causal=True = mask=: {close}")

print("\nNq = 2, Nk = 5:")
print(causal_bottom_right(2, 5).astype(int))
print("Nq = 5, Nk = 2 (the first three rows are empty):")
print(causal_bottom_right(5, 2).astype(int))

# %% [markdown]
# ### Which tiles causal skips
#
# `tile_schedule(..., causal=True)` keeps a tile only if at least one of its pairs is allowed,
# that is if `k_start <= (q_stop - 1) + (Nk - Nq)`; the tiles above the diagonal are never
# computed. Of the tiles it keeps, only those the diagonal crosses need a mask (flash_lib's
# `_allowed` builds the triangle only for those); the ones wholly below the diagonal run unmasked.
# For $N_q = N_k = N$ with $n = N / b$ blocks of size $b$ in both directions, that is
# $n(n+1)/2$ of the $n^2$ tiles, a fraction $\tfrac12 + \tfrac1{2n}$, and $n$ of them crossed by the
# diagonal.
#
# The figure shows three cases with 8-wide blocks: $N_q = N_k = 40$; a prompt chunk of
# $N_q = 24$ queries against $N_k = 40$ keys; and decoding, $N_q = 1$, where the one query sees
# every key, so every tile is visited and none needs a mask. Shaded squares are allowed pairs,
# numbered tiles are visited (in that order), hatched ones are skipped. The cell also checks the
# rule against the mask: a tile is visited exactly when it contains an allowed pair.

# %%
def tile_census(n_q, n_k, block_q, block_k):
    """Visited tiles, all tiles, and visited tiles that need a mask (contain a disallowed pair)."""
    allowed = causal_bottom_right(n_q, n_k)
    visited = flash_lib.tile_schedule(n_q, n_k, block_q, block_k, causal=True)
    every = flash_lib.tile_schedule(n_q, n_k, block_q, block_k)
    any_allowed = [t for t in every if allowed[t[0] : t[1], t[2] : t[3]].any()]
    assert visited == any_allowed  # visited exactly when the tile has an allowed pair
    needs_mask = [t for t in visited if not allowed[t[0] : t[1], t[2] : t[3]].all()]
    return allowed, visited, every, needs_mask


def draw_causal(ax, n_q, n_k, block_q, block_k):
    allowed, visited, every, needs_mask = tile_census(n_q, n_k, block_q, block_k)
    ax.imshow(allowed, cmap=plt.matplotlib.colors.ListedColormap(["white", "#9ecae1"]),
              extent=(0, n_k, n_q, 0), aspect="auto", interpolation="nearest", vmin=0, vmax=1)
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


fig, axes = plt.subplots(1, 3, figsize=(11, 4.5), gridspec_kw={"width_ratios": [1.2, 1, 1]})
census = {}
for ax, (n_qc, n_kc) in zip(axes, ((40, 40), (24, 40), (1, 40))):
    census[(n_qc, n_kc)] = draw_causal(ax, n_qc, n_kc, block_q=8, block_k=8)
handles = [plt.Rectangle((0, 0), 1, 1, facecolor="#9ecae1"),
           plt.Rectangle((0, 0), 1, 1, facecolor="none", edgecolor="black", linewidth=1.5),
           plt.Rectangle((0, 0), 1, 1, facecolor="none", edgecolor="grey", hatch="xx")]
fig.legend(handles, ["allowed pair", "visited tile (visiting order)", "skipped tile"],
           loc="lower center", ncol=3)
fig.suptitle("Causal attention, bottom-right aligned, 8 x 8 tiles")
fig.tight_layout(rect=(0, 0.07, 1, 1))
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
# stays in $l$ and $\text{acc}$ for good. That happens to fully masked rows, but
# also to any row whose *first* key block happens to be fully masked, for example left padding,
# even though such a row has allowed keys and a well-defined answer. The textbook two-pass
# softmax gets that row right, because it subtracts the row's global max; the NaN is the stream's
# own doing.
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
# choice (quoted below). In flash_lib this is `m_ref` in `flash_attention`'s tile loop, and
# `naive_attention` uses the same reference for its whole rows.
#
# At the end, $l = 0$ exactly when the row had no allowed key: otherwise its largest allowed score
# contributes $e^{0} = 1$ and no term is negative, so $l \ge 1$. For those rows flash_lib's
# `_finalize` returns the output $0$ and $\text{lse} = -\infty$ without ever computing $0/0$ or
# $\log 0$. Both values are the exact ones for an empty set of keys: the empty weighted sum is $0$,
# and $\text{lse} = \log \sum_{j \in \emptyset} e^{s_j} = \log 0 = -\infty$. The lse convention also
# composes: chapter 3's `merge_attention` weights a part by $e^{\text{lse}}$, so an empty part
# merges as weight 0, which is what a split-KV kernel needs when one split of keys happens to be
# fully masked for some row.
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
print("empty row 1, output exactly 0 (flash, naive, stream):",
      *(bool(np.all(o[1] == 0)) for o in (out_flash, out_naive, out_guarded)))
print("empty row 1, lse (flash, naive, stream):", lse_flash[1], lse_naive[1], lse_guarded[1])
print("rows 0, 2, 3 agree, flash vs naive and guarded stream vs naive:",
      rel_err(out_flash[nonempty], out_naive[nonempty]) < 1e-13,
      rel_err(out_guarded[nonempty], out_naive[nonempty]) < 1e-13)
print("lse of rows 0, 2, 3 agree:", rel_err(lse_flash[nonempty], lse_naive[nonempty]) < 1e-13,
      rel_err(lse_guarded[nonempty], lse_naive[nonempty]) < 1e-13)

# An empty part merged with a non-empty one leaves the non-empty one unchanged.
out_merged, lse_merged = flash_lib.merge_attention(out_flash[1:2], lse_flash[1:2],
                                                   out_flash[0:1], lse_flash[0:1])
print("merge(empty row, row 0) = row 0:",
      bool(np.array_equal(out_merged, out_flash[0:1])
           and np.array_equal(lse_merged, lse_flash[0:1])))

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
print("rows 3 and 4 agree with naive:", rel_err(out_c[3:], out_cn[3:]) < 1e-13)

# %% [markdown]
# ## What other implementations do
#
# Stated from their sources (no PyTorch or JAX is imported here; the NumPy lines below only
# reproduce each convention's arithmetic).
#
# **PyTorch, `torch.nn.functional.scaled_dot_product_attention`.** Before 2.5.0, a fully masked
# row of a boolean `attn_mask` gave NaN: the masked scores became $-\infty$ and the softmax divided
# 0 by 0 (reported in pytorch/pytorch issues #103749 and #103963; #41508 is the same problem in
# `nn.MultiheadAttention`). Since 2.5.0 such rows give 0; the v2.5.0
# release notes: "Before this PR, fully masked rows in the attn_mask passed to
# nn.functional.scaled_dot_product_attention would yield NANs in the output, after this PR, fully
# masked rows yield 0s." The change is PR #131060 (a private `_safe_softmax`) and PR #133882
# (a re-land of #131863: the fused kernels updated and SDPA's math path calling
# `at::_safe_softmax`, in `aten/src/ATen/native/transformers/attention.cpp`), which takes the
# softmax and then writes 0 into every row whose scores are all $-\infty$. The public
# `torch.softmax` was left as it was: PR #131060's description shows it returning NaN for an all
# $-\infty$ row.
#
# **FlashAttention.** The docstring of `flash_attn_func` (`flash_attn/flash_attn_interface.py`):
# "If the row of the mask is all zero, the output will be zero." Its kernels use the same guard
# as flash_lib, in `csrc/flash_attn/src/softmax.h`: "If max is -inf, then all elements must have
# been -inf (possibly due to masking). We don't want (-inf - (-inf)) since that would give NaN.",
# followed by `max_scaled = max(mi) == -INFINITY ? 0.f : max(mi) * scale`. FlashAttention takes no
# arbitrary boolean mask; its rows become empty through causal masking with
# `seqlen_q > seqlen_k` (or a local window).
#
# **JAX, `jax.nn.dot_product_attention`.** The XLA implementation does not use $-\infty$: in
# `jax/_src/nn/functions.py`, `_apply_masks` replaces masked logits with
# `_get_large_negative(dtype)`, which is `-0.7 * jnp.finfo(dtype).max`, and then takes an ordinary
# softmax. In a row with some allowed key that is as good as $-\infty$ (the masked weights underflow
# to exactly 0). In a fully masked row every logit is the same finite number, so the softmax is
# uniform, $1/N_k$ for every key, and the output is the mean of *all* the value rows. (When
# `query_seq_lengths` and `key_value_seq_lengths` are passed, padded query rows are additionally
# multiplied by 0 at the end; a mask alone does not do that.)
#
# The cell reproduces the JAX convention's arithmetic in float64 and the PyTorch one
# (softmax, then 0 for all $-\infty$ rows) on the example above.

# %%
tau = 1 / np.sqrt(d)
scores = tau * (q @ k.T)

# JAX: masked logits become -0.7 * finfo.max, then a plain softmax.
logits = np.where(mask, scores, -0.7 * np.finfo(np.float64).max)
weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
out_jax_style = (weights / weights.sum(axis=-1, keepdims=True)) @ v

# PyTorch >= 2.5 (_safe_softmax): softmax of the -inf-masked scores, then 0 where a row is all -inf.
masked = np.where(mask, scores, -np.inf)
all_masked = np.all(masked == -np.inf, axis=-1, keepdims=True)
with np.errstate(invalid="ignore"):
    p_torch = np.exp(masked - masked.max(axis=-1, keepdims=True))
    p_torch = p_torch / p_torch.sum(axis=-1, keepdims=True)
print("plain softmax of the empty row:", p_torch[1, :3], "...")
out_torch_style = np.where(all_masked, 0.0, p_torch) @ v

print("JAX-style empty row = mean of all values:", np.allclose(out_jax_style[1], v.mean(axis=0)))
print("JAX-style rows 0, 2, 3 = flash_lib:",
      rel_err(out_jax_style[nonempty], out_flash[nonempty]) < 1e-13)
print("PyTorch-style (>= 2.5) = flash_lib on every row:",
      rel_err(out_torch_style, out_flash) < 1e-13)

# %% [markdown]
# ### Where the causal diagonal sits
#
# All of these agree when $N_q = N_k$. When $N_q \ne N_k$ they do not:
#
# | implementation | `causal` / `is_causal` when $N_q \ne N_k$ | source |
# |---|---|---|
# | flash_lib | bottom-right: $j \le i + (N_k - N_q)$ | `flash_lib.py` |
# | FlashAttention $\ge$ 2.1 | bottom-right (2.0 was top-left) | README, "2.1: Change behavior of causal flag"; `flash_attn_func` docstring |
# | PyTorch SDPA `is_causal=True` | top-left: `torch.ones(L, S, dtype=torch.bool).tril(diagonal=0)` | the reference implementation in the `scaled_dot_product_attention` documentation |
# | PyTorch `torch.nn.attention.bias.causal_lower_right` | bottom-right, opt-in: `tril(diagonal=S - L)` | documentation of `CausalVariant.LOWER_RIGHT` |
# | JAX `dot_product_attention(is_causal=True)` | top-left: `jnp.tril(jnp.ones((T, S)))` | `_get_causal_mask` in `jax/_src/nn/functions.py` |
#
# FlashAttention's docstring shows the bottom-right masks for `seqlen_q = 2, seqlen_k = 5` and
# `seqlen_q = 5, seqlen_k = 2`, as rows of 1 (keep) and 0 (masked out); the cell compares them with
# `causal_bottom_right`. With top-left alignment, a decoding step ($N_q = 1$) would let the new
# token see only key 0, the first token of the sequence, and no row is ever empty. To reproduce a
# top-left library with flash_lib, pass its mask explicitly:
# `mask=np.tril(np.ones((Nq, Nk), bool))`.

# %%
# Quoted from the flash_attn_func docstring (1 = keep, 0 = masked out).
flash_attn_doc_2x5 = np.array([[1, 1, 1, 1, 0],
                               [1, 1, 1, 1, 1]], dtype=bool)
flash_attn_doc_5x2 = np.array([[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]], dtype=bool)
print("flash_lib's rule = FlashAttention's documented masks:",
      bool(np.array_equal(causal_bottom_right(2, 5), flash_attn_doc_2x5)
           and np.array_equal(causal_bottom_right(5, 2), flash_attn_doc_5x2)))

top_left_decode = np.tril(np.ones((1, 40), dtype=bool))
print("decoding, Nq = 1, Nk = 40: keys seen, top-left:", int(top_left_decode.sum()),
      " bottom-right:", int(causal_bottom_right(1, 40).sum()))

top_left = np.tril(np.ones((16, 40), dtype=bool))
q16, k40, v40 = (rng.standard_normal(shape) for shape in ((16, d), (40, d), (40, d_v)))
out_tl = flash_lib.flash_attention(q16, k40, v40, mask=top_left, block_q=8, block_k=8)
out_tl_naive = flash_lib.naive_attention(q16, k40, v40, mask=top_left)
print("top-left via mask=, flash = naive:", rel_err(out_tl, out_tl_naive) < 1e-13)

# %% [markdown]
# ## What we showed
#
# - A masked score becomes $-\infty$ and its weight exactly 0: each row of masked attention equals
#   attention over that row's allowed keys only, and overwriting masked-out keys and values with
#   huge finite numbers changes nothing, bit for bit.
# - `causal=True` allows key $j$ for query $i$ iff $j \le i + (N_k - N_q)$, the same as
#   `np.tril(..., k=Nk - Nq)` and as passing that mask, for square, wide and tall shapes; it
#   matches FlashAttention's documented masks for $2 \times 5$ and $5 \times 2$.
# - `tile_schedule(..., causal=True)` visits a tile exactly when it contains an allowed pair: 15 of
#   25 tiles for $N_q = N_k = 40$ with 8-wide blocks ($n(n+1)/2$ of $n^2$, $n = 5$ of them masked),
#   and every tile, none masked, for decoding.
# - $e^{-\infty - (-\infty)}$ is NaN. In a streaming loop without a guard it enters at the first
#   block in which a row has seen no allowed key: fully masked rows, but also a left-padded row
#   whose answer is well defined and which `naive_attention` computes finitely.
# - With the reference $m_{\text{ref}} = 0$ for rows whose max is still $-\infty$, and $l = 0$
#   detected at the end, an empty row gives output exactly 0 and lse $= -\infty$ in the guarded
#   stream, `flash_attention` and `naive_attention`, with no invalid operation, division by zero or
#   overflow; the other rows are unaffected, and merging an empty part changes nothing.
# - PyTorch SDPA (since 2.5.0) and FlashAttention also return 0 for empty rows; JAX's finite mask
#   value gives them uniform weights, the mean of all values, while agreeing with flash_lib on every
#   other row. PyTorch's `is_causal` and JAX's `is_causal` align top-left, FlashAttention $\ge$ 2.1
#   and flash_lib bottom-right; with top-left alignment a decoding query would see 1 key of 40.

# %%
assert max(row_errors) < 1e-13
assert np.array_equal(out_masked, out_garbage)
assert all(same and close for _, same, close in causal_checks)
assert census[(40, 40)] == (15, 25, 5)
n_blocks = 40 // 8
assert census[(40, 40)][0] == n_blocks * (n_blocks + 1) // 2
assert census[(1, 40)] == (5, 5, 0)
assert census[(24, 40)][0] < census[(24, 40)][1]
assert empty_row.max() == -np.inf and np.all(np.isnan(p_empty))
assert all(np.isnan(unguarded[i][0]).all() for i in (1, 2))
assert not any(np.isnan(unguarded[i][0]).any() for i in (0, 3))
assert np.isnan(unguarded[2][2][0][2])  # alpha of row 2's first block is NaN
assert np.all(np.isfinite(out_naive[nonempty]))
assert np.all(out_flash[1] == 0) and np.all(out_naive[1] == 0) and np.all(out_guarded[1] == 0)
assert lse_flash[1] == -np.inf and lse_naive[1] == -np.inf and lse_guarded[1] == -np.inf
assert rel_err(out_flash[nonempty], out_naive[nonempty]) < 1e-13
assert rel_err(out_guarded[nonempty], out_naive[nonempty]) < 1e-13
assert rel_err(lse_flash[nonempty], lse_naive[nonempty]) < 1e-13
assert np.array_equal(out_merged, out_flash[0:1]) and np.array_equal(lse_merged, lse_flash[0:1])
assert [i for i in range(5) if np.all(out_c[i] == 0)] == [0, 1, 2]
assert np.all(lse_c[:3] == -np.inf) and np.all(lse_cn[:3] == -np.inf)
assert rel_err(out_c[3:], out_cn[3:]) < 1e-13
assert np.allclose(out_jax_style[1], v.mean(axis=0))
assert rel_err(out_jax_style[nonempty], out_flash[nonempty]) < 1e-13
assert np.all(np.isnan(p_torch[1]))
assert rel_err(out_torch_style, out_flash) < 1e-13
assert np.array_equal(causal_bottom_right(2, 5), flash_attn_doc_2x5)
assert np.array_equal(causal_bottom_right(5, 2), flash_attn_doc_5x2)
assert top_left_decode.sum() == 1 and causal_bottom_right(1, 40).sum() == 40
assert rel_err(out_tl, out_tl_naive) < 1e-13

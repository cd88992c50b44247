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
# # 3. States that merge
#
# Chapter 2 read the scores one at a time. Nothing forces that order: the state $(m, l)$ of any
# block of scores can be combined with that of any other block. This chapter derives the merge
# $\oplus$ of two states, checks that it is exact, commutative, associative and has an identity
# (so a row may be cut anywhere and merged in any order), writes the state as one number, the
# lse, merges partial *attention outputs* with `flash_lib.merge_attention`, and uses that one
# formula to divide a row's keys among workers. {doc}`Chapter 7 <07_exactness>` measures how the
# merge order changes the rounding; {doc}`chapter 22 <22_beyond_one_machine>` runs these schemes
# on a cluster.

# %%
import functools
import math

import numpy as np

import flash_lib
from flash_lib import rowwise_relative_error

rng = np.random.default_rng(3)

# %% [markdown]
# ## The merge of two states
#
# Let $A$ and $B$ be disjoint blocks of scores with states
# $m_a = \max_{A} x_j$, $l_a = \sum_{A} e^{x_j - m_a}$ and likewise $(m_b, l_b)$. The union has the
# maximum $M = \max(m_a, m_b)$, and its sum splits over the two blocks; each part is moved from its
# own maximum to $M$ by one factor, exactly as in chapter 2:
#
# $$\sum_{A \cup B} e^{x_j - M} = e^{m_a - M} \sum_{A} e^{x_j - m_a} + e^{m_b - M} \sum_{B} e^{x_j - m_b} ,$$
#
# $$(m_a, l_a) \oplus (m_b, l_b) = \left(M,\; l_a \, e^{m_a - M} + l_b \, e^{m_b - M}\right), \qquad M = \max(m_a, m_b) .$$
#
# Nothing is approximated, so the merged pair is exactly the state of $A \cup B$, and both factors
# are at most 1. Chapter 2's update is the case where $B$ is one score $x$, with state $(x, 1)$.
# The empty block has the state $(-\infty, 0)$; merging two of them would compute
# $e^{-\infty - (-\infty)}$ = NaN, so that case returns the empty state directly (chapter 6
# meets the same guard in the kernel).

# %%
EMPTY = (-math.inf, 0.0)


def merge(a, b):
    """(m_a, l_a) ⊕ (m_b, l_b): the state of the union of two disjoint blocks of scores."""
    (m_a, l_a), (m_b, l_b) = a, b
    m_ab = max(m_a, m_b)  # M
    if m_ab == -math.inf:  # both blocks empty
        return EMPTY
    # l = l_a · exp(m_a - M) + l_b · exp(m_b - M)
    return m_ab, l_a * math.exp(m_a - m_ab) + l_b * math.exp(m_b - m_ab)


def block_state(x):
    """(m, l) of one non-empty block, the two-pass way of chapter 1."""
    m = x.max()
    return float(m), float(np.exp(x - m).sum())


def rel_diff(a, b):
    return abs(a - b) / abs(b)


# Rounding bounds, in units of float64's machine epsilon. NumPy sums a block's terms in 8 running
# sums and then pairwise: at most about 12 eps of relative error for up to 4096 positive terms;
# with each exp within a couple of ulps, a block's l is within L_SUM of its exact value. Each merge
# a term goes through adds an exp, a product and a sum: MERGE.
eps = np.finfo(np.float64).eps
L_SUM, MERGE = 20 * eps, 3 * eps


# %% [markdown]
# A row of 4096 scores cut in two at a random place, merged, against the whole row's state:

# %%
n = 4096
x = rng.normal(0.0, 3.0, size=n)
cut = int(rng.integers(1, n))
merged = merge(block_state(x[:cut]), block_state(x[cut:]))
whole = block_state(x)
# two block sums, one merge, against the whole row's sum
cut_bound = 2 * L_SUM + MERGE
print(f"cut at {cut}: m merged - m whole = {merged[0] - whole[0]}; l relative difference within "
      f"{cut_bound / eps:.0f} eps: {rel_diff(merged[1], whole[1]) <= cut_bound}")

# %% [markdown]
# ## Commutative, with an identity, and associative
#
# - **Commutative**: the formula is symmetric in $a$ and $b$, and floating-point `max`, `*` and
#   `+` are commutative, so $a \oplus b$ and $b \oplus a$ are equal bit for bit.
# - **Identity**: $a \oplus (-\infty, 0) = (m_a, l_a \cdot e^{0} + 0 \cdot e^{-\infty}) = a$, also
#   bit for bit; so a worker that got no keys changes nothing.
# - **Associative**: both groupings are the state of $A \cup B \cup C$; in floating point the
#   maximum is still exact, and $l$ agrees to rounding.
#
# We check all three on 1000 random triples of blocks.

# %%
def random_state():
    """The state of a block of 1 to 49 scores, with a random centre and spread."""
    size = int(rng.integers(1, 50))
    return block_state(rng.normal(rng.normal(0, 50), rng.uniform(0.1, 10), size=size))


not_commuting, not_identity, assoc_m_differs, assoc_l = 0, 0, 0, 0.0
for _ in range(1000):
    a, b, c = random_state(), random_state(), random_state()
    not_commuting += merge(a, b) != merge(b, a)
    not_identity += merge(a, EMPTY) != a or merge(EMPTY, a) != a
    left, right = merge(merge(a, b), c), merge(a, merge(b, c))
    assoc_m_differs += left[0] != right[0]
    assoc_l = max(assoc_l, rel_diff(left[1], right[1]))
print(f"of 1000 triples: a ⊕ b != b ⊕ a in {not_commuting}, a ⊕ empty != a in {not_identity}")
# the same three l's on both sides, each through at most two merges
assoc_bound = 2 * 2 * MERGE
print(f"(a ⊕ b) ⊕ c vs a ⊕ (b ⊕ c): m differs in {assoc_m_differs}, l within "
      f"{assoc_bound / eps:.0f} eps: {assoc_l <= assoc_bound}")

# %% [markdown]
# ## Any cut, any order
#
# Together they let a row's blocks be merged in any order and grouping. We cut the row into
# $T = 2, 16, 256$ random blocks and merge their states left to right (chapter 2's online softmax,
# over blocks) and in **random order**: any two states of the pool, neighbours or not, until one
# is left.

# %%
def random_cuts(n, n_blocks, rng):
    """Split range(n) into n_blocks non-empty contiguous blocks at random places: slices."""
    edges = [0, *np.sort(rng.choice(np.arange(1, n), size=n_blocks - 1, replace=False)).tolist(), n]
    return [slice(lo, hi) for lo, hi in zip(edges[:-1], edges[1:])]


def merge_random(states, merge, rng):
    """Merge two states picked at random from the pool until one is left."""
    states = list(states)
    while len(states) > 1:
        i, j = sorted(rng.choice(len(states), size=2, replace=False))
        b, a = states.pop(j), states.pop(i)
        states.append(merge(a, b))
    return states[0]


any_order = []  # (T, order, m difference, l relative difference, its bound)
for n_blocks in (2, 16, 256):
    # T block sums and the whole row's, and a term through at most T - 1 merges
    order_bound = 2 * L_SUM + (n_blocks - 1) * MERGE
    states = [block_state(x[s]) for s in random_cuts(n, n_blocks, rng)]
    for order, (m, l) in (("left to right", functools.reduce(merge, states)),
                          ("random order", merge_random(states, merge, rng))):
        any_order.append((n_blocks, order, m - whole[0], rel_diff(l, whole[1]), order_bound))
        print(f"T = {n_blocks:>3} blocks, {order:<13}: m - m whole = {m - whole[0]}, "
              f"l relative difference within {order_bound / eps:.0f} eps: "
              f"{rel_diff(l, whole[1]) <= order_bound}")

# %% [markdown]
# ## One number instead of two: the log-sum-exp
#
# The pair $(m, l)$ carries more than it needs: $(m + c, \, l \, e^{-c})$ describes the same
# block for every $c$, since only $l \, e^{m} = \sum_j e^{x_j}$ matters. Its logarithm, chapter 1's
# log-sum-exp, is the compact state
#
# $$\mathrm{lse} = \log \sum_j e^{x_j} = m + \log l , \qquad m \le \mathrm{lse} \le m + \log n ,$$
#
# the bounds coming from $1 \le l \le n$. In terms of lse the merge reads
# $e^{\mathrm{lse}_{A \cup B}} = e^{\mathrm{lse}_a} + e^{\mathrm{lse}_b}$, that is
#
# $$\mathrm{lse}_{A \cup B} = \log\left(e^{\mathrm{lse}_a} + e^{\mathrm{lse}_b}\right) = M + \log\left(e^{\mathrm{lse}_a - M} + e^{\mathrm{lse}_b - M}\right), \qquad M = \max(\mathrm{lse}_a, \mathrm{lse}_b) ,$$
#
# which is $\oplus$ applied to $(\mathrm{lse}_a, 1)$ and $(\mathrm{lse}_b, 1)$: NumPy's
# overflow-safe `np.logaddexp`, with $\mathrm{lse} = -\infty$ for the empty block. It is the one
# number per row that FlashAttention-2 keeps from the forward for the backward (arXiv 2307.08691,
# section 3.1.1), and what `flash_attention(..., return_lse=True)` returns. The truth below is
# `flash_lib.precise_attention`'s lse in extended precision (chapter 1's device, with a column of
# zeros as values).

# %%
_, lse_true = flash_lib.precise_attention(
    np.ones((1, 1)), x[:, None], np.zeros((n, 1)), scale=1.0, return_lse=True
)
lse_true = float(lse_true[0])
blocks = random_cuts(n, 16, rng)
block_lse = [m + math.log(l) for m, l in (block_state(x[s]) for s in blocks)]
m_all, l_all = functools.reduce(merge, [block_state(x[s]) for s in blocks])
lse_by_logaddexp = functools.reduce(np.logaddexp, block_lse)
lse_by_merge = m_all + math.log(l_all)
# l's error (2 L_SUM + 15 MERGE = 85 eps relative, so 85 eps in its log) plus a rounding of |lse|
# (about 12) for each log, sum and logaddexp step (16): about 280 eps, 6e-14 nats
lse_bound = 1e-13
print(f"16 blocks: logaddexp of their lse's and (m + log l) of the merged state agree within "
      f"{lse_bound:.0e} nats: {abs(lse_by_logaddexp - lse_by_merge) <= lse_bound}")
print(f"both within {lse_bound:.0e} nats of the extended-precision lse: "
      f"{max(abs(lse_by_logaddexp - lse_true), abs(lse_by_merge - lse_true)) <= lse_bound}")
print(f"lse - m = {lse_by_merge - m_all:.3f}, between 0 and log n = {math.log(n):.3f}")
print("logaddexp(lse, -inf) - lse:", np.logaddexp(lse_by_merge, -np.inf) - lse_by_merge)

# %% [markdown]
# ## Merging partial attention outputs
#
# For attention, a query $q$ has the scores $s_j = \tau\, q \cdot k_j$ with the scale
# $\tau = 1/\sqrt{d}$. Its scores against the keys of a block $A$ give, besides
# $\mathrm{lse}_a = \log \sum_{j \in A} e^{s_j}$, the block's output
# $o_a = \sum_{j \in A} e^{s_j} v_j \big/ e^{\mathrm{lse}_a}$: attention restricted to $A$.
# Multiplying back, $\sum_{j \in A} e^{s_j} v_j = e^{\mathrm{lse}_a} o_a$, so for the union the
# numerator and denominator both split:
#
# $$o_{A \cup B} = \frac{e^{\mathrm{lse}_a} o_a + e^{\mathrm{lse}_b} o_b}{e^{\mathrm{lse}_a} + e^{\mathrm{lse}_b}} = e^{\mathrm{lse}_a - \mathrm{lse}}\, o_a + e^{\mathrm{lse}_b - \mathrm{lse}}\, o_b , \qquad \mathrm{lse} = \log\left(e^{\mathrm{lse}_a} + e^{\mathrm{lse}_b}\right).$$
#
# A convex combination of the partial outputs, each weighted by its block's share of the total.
# `flash_lib.merge_attention(out_a, lse_a, out_b, lse_b)` computes it against
# $M = \max(\mathrm{lse}_a, \mathrm{lse}_b)$, so nothing overflows; a part with no key
# ($\mathrm{lse} = -\infty$) weighs 0 (chapter 6). We attend to two halves of the keys, merge,
# and compare with all keys at once (the error metric, chapter 7's: each row's largest difference
# relative to its largest entry). The differences this chapter measures are drawn against their
# bounds in the {doc}`appendix on how this tutorial is tested <27_how_chapters_1_to_6_are_tested>`.

# %%
n_q, d = 64, 32
q = rng.normal(size=(n_q, d))
k = rng.normal(size=(n, d))
v = rng.normal(size=(n, d))
out_full, lse_full = flash_lib.flash_attention(q, k, v, return_lse=True)
out_a, lse_a = flash_lib.flash_attention(q, k[:cut], v[:cut], return_lse=True)
out_b, lse_b = flash_lib.flash_attention(q, k[cut:], v[cut:], return_lse=True)
out_ab, lse_ab = flash_lib.merge_attention(out_a, lse_a, out_b, lse_b)
out_ba, lse_ba = flash_lib.merge_attention(out_b, lse_b, out_a, lse_a)
merge_vs_full = rowwise_relative_error(out_ab, out_full).max()
lse_vs_full = np.abs(lse_ab - lse_full).max()
# 1e-14 (45 eps) and 1e-13 nats: a kernel off by 1e-6 misses them by 7 orders of magnitude
out_bound = 1e-14
print(f"merged halves vs all keys at once: output within {out_bound:.0e}: "
      f"{merge_vs_full <= out_bound}, lse within {lse_bound:.0e} nats: {lse_vs_full <= lse_bound}")
print("merge(a, b) vs merge(b, a): largest difference",
      np.abs(out_ab - out_ba).max(), "in out,", np.abs(lse_ab - lse_ba).max(), "in lse")

# %% [markdown]
# ## Dividing the keys among workers
#
# Since $\oplus$ is associative and commutative, a row's keys can be dealt out to any number of
# workers in any way, each returning only $(o, \mathrm{lse})$ for its share:
#
# - **Split-KV**: attend to chunks of the keys and values in parallel, keep each chunk's output
#   and lse, merge at the end.
# - **Flash-decoding** is split-KV on a GPU for text generation, where each step has one new query
#   per sequence and head against the kept keys and values of every earlier token (the **KV
#   cache**). FlashAttention's independent pieces of work are one per sequence, head and group of
#   queries, so with one query most of the GPU idles; flash-decoding attends to the chunks in
#   parallel and combines them in one final reduction, the $T$-way merge
#   $\mathrm{lse} = \log \sum_i e^{\mathrm{lse}_i}$, $o = \sum_i e^{\mathrm{lse}_i - \mathrm{lse}} o_i$
#   (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference", 2023,
#   <https://crfm.stanford.edu/2023/10/12/flashdecoding.html>; in the FlashAttention package
#   since version 2.2).
# - **Ring attention** (Liu, Zaharia, Abbeel, arXiv 2310.01889) keeps a block of queries on each
#   device of a ring while the blocks of keys and values travel around it; each device folds the
#   blocks in its own rotated order, harmless because $\oplus$ commutes.
#
# Rabe & Staats's chunked attention (arXiv 2112.05682) and FlashInfer's `merge_state` merge the
# same state. Below: flash-decoding with one query and 8 chunks reduced in one step, and ring
# attention on 4 "devices" of 16 queries each.

# %%
def combine_splits(outs, lses):
    """Flash-decoding's final reduction: the T-way merge of (o_i, lse_i) in one step.

    For non-empty chunks only (lse_i > -inf); flash_lib.merge_attention guards the empty case.
    """
    lses = np.stack(lses)  # (T, Nq)
    m = lses.max(axis=0)
    # lse = m + log Σ_i exp(lse_i - m)
    lse = m + np.log(np.exp(lses - m).sum(axis=0))
    # o = Σ_i exp(lse_i - lse) · o_i
    out = (np.exp(lses - lse)[..., None] * np.stack(outs)).sum(axis=0)
    return out, lse


# flash-decoding: one query, the keys in 8 chunks of random sizes, reduced in one step
q_one = q[:1]
partials = [flash_lib.flash_attention(q_one, k[s], v[s], return_lse=True)
            for s in random_cuts(n, 8, rng)]
out_dec, lse_dec = combine_splits(*zip(*partials))
decoding_vs_full = rowwise_relative_error(out_dec, out_full[:1]).max()
print(f"flash-decoding (8 chunks, one 8-way reduction) vs all keys, within {out_bound:.0e}: "
      f"{decoding_vs_full <= out_bound}")

# ring attention: 4 devices; device p holds queries block p and sees key blocks p, p+1, ... in turn
devices = 4
q_blocks = np.array_split(np.arange(n_q), devices)
kv_blocks = np.array_split(np.arange(n), devices)
ring_out = np.empty_like(out_full)
for p in range(devices):
    qp = q[q_blocks[p]]
    state = None
    for step in range(devices):
        kv = kv_blocks[(p + step) % devices]
        block = flash_lib.flash_attention(qp, k[kv], v[kv], return_lse=True)
        state = block if state is None else flash_lib.merge_attention(*state, *block)
    ring_out[q_blocks[p]] = state[0]
ring_vs_full = rowwise_relative_error(ring_out, out_full).max()
print(f"ring attention (4 devices, rotated orders) vs all keys, within {out_bound:.0e}: "
      f"{ring_vs_full <= out_bound}")

# %% [markdown]
# ## What we showed
#
# - $(m_a, l_a) \oplus (m_b, l_b) = (M, l_a e^{m_a - M} + l_b e^{m_b - M})$ is exactly the state of
#   the union; commutative and with identity $(-\infty, 0)$ bit for bit (empty blocks anywhere in
#   a chain change nothing), associative with $m$ exact and $l$ to 12 machine epsilons.
# - Up to 256 random blocks merged left to right or in random order give the exact maximum and $l$
#   within rounding of the two-pass result.
# - $\mathrm{lse} = m + \log l \in [m, m + \log n]$ merges with `np.logaddexp`; it agrees with
#   the merged $(m, l)$ and an extended-precision truth to $10^{-13}$ nats.
# - `merge_attention` of two halves equals attention over all keys to $10^{-14}$, symmetric bit for
#   bit; flash-decoding's 8-way reduction and ring attention over 4 devices do too.

# %%
# the merge is exact on a two-way cut
assert merged[0] == whole[0] and rel_diff(merged[1], whole[1]) <= cut_bound
# commutative and identity bit for bit, associative to rounding
assert not_commuting == 0 and not_identity == 0 and assoc_m_differs == 0 and assoc_l <= assoc_bound
# workers that got no keys: empty states anywhere in a chain (two in a row at its start) change
# the merged state of the others by not one bit
block_states = [block_state(x[s]) for s in random_cuts(n, 16, np.random.default_rng(0))]
with_empties = [EMPTY, EMPTY, *(st for b in block_states for st in (b, EMPTY))]
assert functools.reduce(merge, with_empties) == functools.reduce(merge, block_states)
assert functools.reduce(merge, [EMPTY] * 3) == EMPTY  # no keys at all: the empty sum, l = 0
# the online update of chapter 2 is ⊕ with one-score blocks (x, 1)
m_stream, l_stream = functools.reduce(merge, [(xi, 1.0) for xi in x[:100].tolist()], EMPTY)
m_2p, l_2p = block_state(x[:100])
# 100 one-score merges against one block sum
assert m_stream == m_2p and rel_diff(l_stream, l_2p) <= L_SUM + 99 * MERGE
# any cut, any order
assert all(dm == 0 and dl <= bound for _, _, dm, dl, bound in any_order)
# lse: bounds, logaddexp, identity
assert m_all <= lse_by_merge <= m_all + math.log(n)
assert abs(lse_by_logaddexp - lse_by_merge) <= lse_bound
assert max(abs(lse_by_logaddexp - lse_true), abs(lse_by_merge - lse_true)) <= lse_bound
assert np.logaddexp(lse_by_merge, -np.inf) == lse_by_merge
# attention outputs
assert merge_vs_full <= out_bound and lse_vs_full <= lse_bound
assert np.array_equal(out_ab, out_ba) and np.array_equal(lse_ab, lse_ba)
assert decoding_vs_full <= out_bound and ring_vs_full <= out_bound

# %% [markdown]
# ## Your turn: merge two partial results
#
# Write `merge(out_a, lse_a, out_b, lse_b) -> (out, lse)`: the attention of the same rows over
# two disjoint key sets, `out_a`, `out_b` of shape `(rows, dv)` with their `lse_a`, `lse_b` of
# shape `(rows,)`, combined into the attention over both, as `merge_attention` does. Nothing may
# overflow (the grader tries lse near 800); a part with `lse = -inf` (no key) adds nothing,
# whatever its `out` holds (NaN, inf); a row empty in both parts is `out = 0`, `lse = -inf`.
#
# Replace the stub with your function and re-run the grade cell: it says `not implemented yet`,
# then what is wrong and where to look, until `passed`. The solution is hidden below it.

# %%
from flash_check.exercises import grade, show_solution, stub

merge = stub("merge")  # your turn: replace with def merge(out_a, lse_a, out_b, lse_b): ...

# %%
grade("merge", merge)

# %% jupyter={"outputs_hidden": true} mystnb={"code_prompt_hide": "Hide the solution", "code_prompt_show": "Show the solution"} tags=["remove-input", "hide-output"]
show_solution("merge")

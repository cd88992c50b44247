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
# block of scores can be combined with the state of any other block. In this chapter:
#
# - we derive the merge $(m_a, l_a) \oplus (m_b, l_b)$ of the states of two disjoint blocks, and
#   check that it is exact, commutative (bit for bit), has $(-\infty, 0)$ as identity (bit for
#   bit) and is associative (to rounding);
# - hence a row may be cut into blocks anywhere and the blocks merged in any grouping: we check
#   random cuts into up to 256 blocks, merged left to right, as a balanced tree and in random order;
# - we write the state as one number, $\mathrm{lse} = m + \log l$, under which $\oplus$ becomes
#   `np.logaddexp`;
# - we merge two partial *attention outputs* with `flash_lib.merge_attention`, check it against
#   attending to all keys at once, and see why split-KV, flash-decoding and ring attention all
#   rest on this one formula.

# %%
import functools
import math

import numpy as np
import matplotlib.pyplot as plt

import flash_lib

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
# Nothing was approximated, so the merged pair is exactly the state of $A \cup B$. Both factors are
# at most 1, so nothing overflows. The online update of chapter 2 is the special case where $B$
# is a single score $x$, whose state is $(x, 1)$. The empty block has the state $(-\infty, 0)$;
# merging two empty blocks would compute $e^{-\infty - (-\infty)}$ = NaN, so that case returns the
# empty state directly (chapter 6 meets the same guard in the kernel).

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


# %% [markdown]
# A row of 4096 scores, cut in two at a random place: the merged state against the state of the
# whole row, computed in two passes.

# %%
n = 4096
x = rng.normal(0.0, 3.0, size=n)
cut = int(rng.integers(1, n))
merged = merge(block_state(x[:cut]), block_state(x[cut:]))
whole = block_state(x)
print("m identical:", merged[0] == whole[0],
      "| l relative difference < 1e-14:", abs(merged[1] - whole[1]) / whole[1] < 1e-14)

# %% [markdown]
# ## Commutative, with an identity, and associative
#
# - **Commutative**: the formula is symmetric in $a$ and $b$, and floating-point `max`, `*` and
#   `+` are commutative, so $a \oplus b$ and $b \oplus a$ are equal bit for bit.
# - **Identity**: $a \oplus (-\infty, 0) = (m_a, l_a \cdot e^{0} + 0 \cdot e^{-\infty}) = a$, also
#   bit for bit.
# - **Associative**: $(a \oplus b) \oplus c$ and $a \oplus (b \oplus c)$ are both the state of
#   $A \cup B \cup C$, so they are equal in exact arithmetic; in floating point the maximum is still
#   exact, and $l$ agrees to rounding.
#
# We check all three on 1000 random triples of blocks.

# %%
def random_state():
    """The state of a block of 1 to 49 scores, with a random centre and spread."""
    size = int(rng.integers(1, 50))
    return block_state(rng.normal(rng.normal(0, 50), rng.uniform(0.1, 10), size=size))


commutes, identity, assoc_m, assoc_l = True, True, True, 0.0
for _ in range(1000):
    a, b, c = random_state(), random_state(), random_state()
    commutes &= merge(a, b) == merge(b, a)
    identity &= merge(a, EMPTY) == a and merge(EMPTY, a) == a
    left, right = merge(merge(a, b), c), merge(a, merge(b, c))
    assoc_m &= left[0] == right[0]
    assoc_l = max(assoc_l, abs(left[1] - right[1]) / right[1])
print("a ⊕ b == b ⊕ a bit for bit:", commutes)
print("a ⊕ empty == a bit for bit:", identity)
print("(a ⊕ b) ⊕ c and a ⊕ (b ⊕ c): m identical:", assoc_m,
      "| l relative difference < 1e-15:", assoc_l < 1e-15)

# %% [markdown]
# ## Any cut, any grouping
#
# Commutativity and associativity together mean that the blocks of a row may be merged in any
# order and any grouping. Three groupings matter in practice:
#
# - **left to right**, one block after another: the online softmax over blocks, and what each
#   device does in ring attention;
# - **a balanced tree**, merging neighbours in $\lceil \log_2 k \rceil$ rounds: a parallel
#   reduction;
# - **random**: any two states from the pool, merged and put back, until one is left.
#
# The three are written once and reused below for attention states, with the merge passed in.

# %%
def merge_left_to_right(states, merge):
    """((s1 ⊕ s2) ⊕ s3) ⊕ ...: k - 1 merges in a chain."""
    return functools.reduce(merge, states)


def merge_tree(states, merge):
    """Merge neighbours pairwise, round after round: ceil(log2 k) rounds."""
    while len(states) > 1:
        pairs = [merge(a, b) for a, b in zip(states[0::2], states[1::2])]
        states = pairs + states[len(pairs) * 2:]  # an odd one out waits for the next round
    return states[0]


def merge_random(states, merge, rng):
    """Merge two states picked at random from the pool until one is left."""
    states = list(states)
    while len(states) > 1:
        i, j = sorted(rng.choice(len(states), size=2, replace=False))
        b = states.pop(j)
        a = states.pop(i)
        states.append(merge(a, b))
    return states[0]


def random_cuts(n, k, rng):
    """Split range(n) into k non-empty contiguous blocks at random places: a list of slices."""
    edges = [0, *np.sort(rng.choice(np.arange(1, n), size=k - 1, replace=False)).tolist(), n]
    return [slice(lo, hi) for lo, hi in zip(edges[:-1], edges[1:])]


groupings = {
    "left to right": merge_left_to_right,
    "balanced tree": merge_tree,
    "random order": lambda states, merge: merge_random(states, merge, rng),
}


# %% [markdown]
# What the first two groupings do to 8 blocks $B_1, \dots, B_8$, drawn by running the functions
# with a "merge" that just records the pair it was given. The depth (the longest chain of merges
# from a block to the result) is 7 for left to right and $\log_2 8 = 3$ for the balanced tree; it
# returns below, in the rounding error. (Random order pairs any two states, neighbours or not,
# which only commutativity allows.)

# %%
def tree_depth(tree):
    return 0 if isinstance(tree, int) else 1 + max(tree_depth(tree[0]), tree_depth(tree[1]))


def draw_merge_tree(ax, tree, title):
    """Leaves are block numbers, inner nodes are merges; each merge sits above its two inputs."""

    def place(node):
        if isinstance(node, int):
            ax.text(node, 0, f"$B_{{{node + 1}}}$", ha="center", va="center",
                    bbox=dict(boxstyle="round", fc="C0", alpha=0.25))
            return node, 0
        (xa, ya), (xb, yb) = place(node[0]), place(node[1])
        xm, ym = (xa + xb) / 2, max(ya, yb) + 1
        ax.plot([xa, xm, xb], [ya, ym, yb], color="grey", lw=1, zorder=0)
        ax.text(xm, ym, r"$\oplus$", ha="center", va="center",
                bbox=dict(boxstyle="circle", fc="white", ec="C1"))
        return xm, ym

    place(tree)
    ax.set_xlim(-0.6, 7.6)
    ax.set_ylim(-0.6, 7.6)
    ax.axis("off")
    ax.set_title(f"{title}: depth {tree_depth(tree)}")


def record(a, b):
    return (a, b)


trees = {name: groupings[name](list(range(8)), record)
         for name in ("left to right", "balanced tree")}
fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
for ax, (name, tree) in zip(axes, trees.items()):
    draw_merge_tree(ax, tree, name)
fig.suptitle("Two ways to merge the states of 8 blocks (both give the same state)")
fig.tight_layout()
plt.show()

# %% [markdown]
# To measure the error of $l$ after many merges we need a truth better than float64:
# `flash_lib.precise_attention` gives $\mathrm{lse}^\ast = \log \sum_j e^{x_j}$ in extended
# precision (softmax of a row is attention of a single query with scores $x$, as in chapter 1),
# and then $l^\ast = e^{\mathrm{lse}^\ast - m}$ with the exact maximum $m$. For block counts
# $k = 1, 2, 4, \dots, 256$ we cut the row at 5 random places and merge with each grouping.

# %%
_, lse_true = flash_lib.precise_attention(
    np.ones((1, 1)), x[:, None], np.zeros((n, 1)), scale=1.0, return_lse=True
)
l_true = np.exp(lse_true[0] - x.max())  # extended precision where available

block_counts = 2 ** np.arange(9)
trials = 5
l_errors = {name: np.zeros((len(block_counts), trials)) for name in groupings}
m_always_exact = True
for i, k_blocks in enumerate(block_counts):
    for trial in range(trials):
        states = [block_state(x[s]) for s in random_cuts(n, k_blocks, rng)]
        for name, group in groupings.items():
            m, l = group(states, merge)
            m_always_exact &= m == x.max()
            l_errors[name][i, trial] = float(abs(l - l_true) / l_true)

worst_l = max(e.max() for e in l_errors.values())
print("m exact for every cut and grouping:", m_always_exact)
print("l: worst relative error over every cut and grouping < 1e-14:", worst_l < 1e-14)

# %% [markdown]
# ## One number instead of two: the log-sum-exp
#
# The pair $(m, l)$ carries more than it needs to: $(m + c, \, l \, e^{-c})$ describes the same
# block for every $c$, because only $l \, e^{m} = \sum_j e^{x_j}$ matters. Its logarithm is the
# compact state
#
# $$\mathrm{lse} = \log \sum_j e^{x_j} = m + \log l , \qquad m \le \mathrm{lse} \le m + \log n ,$$
#
# the bounds coming from $1 \le l \le n$. In terms of lse the merge reads
# $e^{\mathrm{lse}_{A \cup B}} = e^{\mathrm{lse}_a} + e^{\mathrm{lse}_b}$, that is
#
# $$\mathrm{lse}_{A \cup B} = \log\left(e^{\mathrm{lse}_a} + e^{\mathrm{lse}_b}\right) = M + \log\left(e^{\mathrm{lse}_a - M} + e^{\mathrm{lse}_b - M}\right), \qquad M = \max(\mathrm{lse}_a, \mathrm{lse}_b) ,$$
#
# which is $\oplus$ applied to $(\mathrm{lse}_a, 1)$ and $(\mathrm{lse}_b, 1)$, and which NumPy
# provides, overflow-safe, as `np.logaddexp`; the empty block is $\mathrm{lse} = -\infty$. This is
# the one number per row that FlashAttention-2 keeps from the forward pass for the backward pass
# (arXiv 2307.08691, section 3.1.1), and what `flash_lib.flash_attention(..., return_lse=True)`
# returns.

# %%
blocks = random_cuts(n, 16, rng)
block_lse = [m + math.log(l) for m, l in (block_state(x[s]) for s in blocks)]
m_all, l_all = merge_left_to_right([block_state(x[s]) for s in blocks], merge)
lse_by_logaddexp = functools.reduce(np.logaddexp, block_lse)
lse_by_merge = m_all + math.log(l_all)
print("logaddexp over 16 block lse's == m + log l of the merged state (to 1e-13 nats):",
      abs(lse_by_logaddexp - lse_by_merge) < 1e-13)
lse_error = max(abs(lse_by_logaddexp - float(lse_true[0])), abs(lse_by_merge - float(lse_true[0])))
print("and both match the extended-precision lse (to 1e-13 nats):", lse_error < 1e-13)
print("m <= lse <= m + log n:", bool(m_all <= lse_by_merge <= m_all + math.log(n)))
print("logaddexp(lse, -inf) == lse:", np.logaddexp(lse_by_merge, -np.inf) == lse_by_merge)

# %% [markdown]
# ## Merging partial attention outputs
#
# For attention, a query $q$ has the scores $s_j = q \cdot k_j / \sqrt{d}$. Its scores against the
# keys of a block $A$ give, besides $\mathrm{lse}_a = \log \sum_{j \in A} e^{s_j}$, the block's output $o_a = \sum_{j \in A} e^{s_j} v_j \big/ e^{\mathrm{lse}_a}$: attention
# restricted to $A$. Multiplying back, $\sum_{j \in A} e^{s_j} v_j = e^{\mathrm{lse}_a} o_a$, so for
# the union the numerator and denominator both split:
#
# $$o_{A \cup B} = \frac{e^{\mathrm{lse}_a} o_a + e^{\mathrm{lse}_b} o_b}{e^{\mathrm{lse}_a} + e^{\mathrm{lse}_b}} = e^{\mathrm{lse}_a - \mathrm{lse}}\, o_a + e^{\mathrm{lse}_b - \mathrm{lse}}\, o_b , \qquad \mathrm{lse} = \log\left(e^{\mathrm{lse}_a} + e^{\mathrm{lse}_b}\right).$$
#
# The merged output is a convex combination of the two partial outputs, weighted by each block's
# share of the total. `flash_lib.merge_attention(out_a, lse_a, out_b, lse_b)` computes exactly this,
# against $M = \max(\mathrm{lse}_a, \mathrm{lse}_b)$ so that nothing overflows. We split the keys in
# two, attend to each part separately with `return_lse=True`, merge, and compare with attending to
# all keys at once.

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
merge_vs_full = np.abs(out_ab - out_full).max()
print("merged halves vs all keys at once: max |difference| < 1e-14:", merge_vs_full < 1e-14,
      "| lse to 1e-13:", np.abs(lse_ab - lse_full).max() < 1e-13)
print("merge(a, b) == merge(b, a) bit for bit:",
      np.array_equal(out_ab, out_ba) and np.array_equal(lse_ab, lse_ba))

# %% [markdown]
# A block whose keys are all masked has output 0 and $\mathrm{lse} = -\infty$ (chapter 6): its
# weight $e^{-\infty}$ is 0, so merging it changes nothing, bit for bit.

# %%
nothing_allowed = np.zeros((n_q, n - cut), dtype=bool)
out_masked, lse_masked = flash_lib.flash_attention(
    q, k[cut:], v[cut:], mask=nothing_allowed, return_lse=True
)
out_am, lse_am = flash_lib.merge_attention(out_a, lse_a, out_masked, lse_masked)
print("fully masked block: out 0, lse -inf:",
      bool((out_masked == 0).all() and (lse_masked == -np.inf).all()))
print("merging it leaves the other block's result unchanged bit for bit:",
      np.array_equal(out_am, out_a) and np.array_equal(lse_am, lse_a))

# %% [markdown]
# ## Why this is enough for split-KV, flash-decoding and ring attention
#
# Since $\oplus$ is associative and commutative, the keys of a row can be dealt out to any number
# of workers in any way, each worker returning only $(o, \mathrm{lse})$ for its share:
#
# - **Split-KV / flash-decoding.** When generating text, each step has one new query per sequence
#   and head against a long cache of keys. FlashAttention parallelises over batch, heads and
#   blocks of queries, so a single query would leave most of a GPU idle. Flash-decoding splits the keys and values into chunks,
#   attends to each chunk in parallel, writes one extra number per row and chunk (its lse), and
#   combines the chunks in a final reduction (Dao, Haziza, Massa, Sizov, "Flash-Decoding for
#   long-context inference", 2023, <https://crfm.stanford.edu/2023/10/12/flashdecoding.html>; in
#   the FlashAttention package since version 2.2, "with a separate kernel to combine results").
#   That reduction is the $k$-way form of the merge:
#   $\mathrm{lse} = \log \sum_i e^{\mathrm{lse}_i}$, $o = \sum_i e^{\mathrm{lse}_i - \mathrm{lse}} o_i$.
# - **Ring attention** (Liu, Zaharia, Abbeel, arXiv 2310.01889). The sequence is spread over
#   devices arranged in a ring; each keeps its block of queries while the blocks of keys and values
#   travel around the ring, and each device folds every block that arrives into its running state.
#   Device $p$ sees the blocks in the order $p, p + 1, \dots$ (modulo the ring size), a different
#   order on every device, which is harmless because $\oplus$ commutes.
# - The same summaries merged by the global maximum are how Rabe & Staats compute attention in
#   chunks without $O(n^2)$ memory (arXiv 2112.05682), and the same state is the "attention state"
#   that FlashInfer merges (its `merge_state` operator).
#
# Both patterns, on our inputs: flash-decoding with one query and 8 chunks reduced in one $k$-way
# step; ring attention on 4 "devices", each holding 16 queries and visiting the 4 key blocks in its
# own rotated order.

# %%
def combine_splits(outs, lses):
    """Flash-decoding's final reduction: the k-way merge of (o_i, lse_i) in one step.

    For non-empty chunks only (lse_i > -inf); flash_lib.merge_attention guards the empty case.
    """
    lses = np.stack(lses)  # (k, Nq)
    m = lses.max(axis=0)
    # lse = m + log Σ_i exp(lse_i - m)
    lse = m + np.log(np.exp(lses - m).sum(axis=0))
    # o = Σ_i exp(lse_i - lse) · o_i
    out = (np.exp(lses - lse)[..., None] * np.stack(outs)).sum(axis=0)
    return out, lse


# flash-decoding: one query, the keys in 8 chunks of random sizes, reduced in one step
q_one = q[:1]
chunks = random_cuts(n, 8, rng)
partials = [flash_lib.flash_attention(q_one, k[s], v[s], return_lse=True) for s in chunks]
out_dec, lse_dec = combine_splits(*zip(*partials))
out_one = flash_lib.flash_attention(q_one, k, v)
print("flash-decoding (8 chunks, k-way reduction) vs all keys: max |difference| < 1e-14:",
      np.abs(out_dec - out_one).max() < 1e-14)

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
ring_vs_full = np.abs(ring_out - out_full).max()
print("ring attention (4 devices, rotated orders) vs all keys: max |difference| < 1e-14:",
      ring_vs_full < 1e-14)

# %% [markdown]
# ## Where the grouping shows: rounding
#
# Every grouping gives the same state in exact arithmetic, so the only thing the grouping can
# change is rounding. The attention version of the experiment above: for
# $k = 1, 2, 4, \dots, 256$ blocks of keys at 5 random cuts each, we attend to every block with
# `flash_lib.flash_attention`, merge the partial results with `flash_lib.merge_attention` in each
# of the three groupings (and with the $k$-way reduction), and measure the largest error of the
# output against `flash_lib.precise_attention`.

# %%
out_true = flash_lib.precise_attention(q, k, v)
err_full = float(np.abs(out_full - out_true).max())
out_errors = {name: np.zeros((len(block_counts), trials))
              for name in [*groupings, "k-way reduction"]}


def merge_pair(a, b):
    return flash_lib.merge_attention(*a, *b)


for i, k_blocks in enumerate(block_counts):
    for trial in range(trials):
        parts = [flash_lib.flash_attention(q, k[s], v[s], return_lse=True)
                 for s in random_cuts(n, k_blocks, rng)]
        results = {name: group(parts, merge_pair)[0] for name, group in groupings.items()}
        results["k-way reduction"] = combine_splits(*zip(*parts))[0]
        for name, out in results.items():
            out_errors[name][i, trial] = float(np.abs(out - out_true).max())

eps = np.finfo(np.float64).eps
worst_out = max(e.max() for e in out_errors.values())
worst_treelike = max(out_errors[name].max()
                     for name in ("balanced tree", "random order", "k-way reduction"))
chain_vs_tree = out_errors["left to right"][-1].mean() / out_errors["balanced tree"][-1].mean()
print("worst error over every cut and grouping below 10 eps:", worst_out < 10 * eps)
print("tree, random order and k-way reduction: below 3 eps at every k:", worst_treelike < 3 * eps)
print(f"at {block_counts[-1]} blocks, left to right has over 3x the error of the balanced tree:",
      chain_vs_tree > 3)

# %%
fig, ax = plt.subplots(figsize=(7, 4))
markers = {"left to right": "o", "balanced tree": "s", "random order": "^", "k-way reduction": "D"}
# spread the groupings slightly along x so that their markers do not hide each other
offsets = dict(zip(markers, [0.9, 0.96, 1.04, 1.1]))
for i, (name, errs) in enumerate(out_errors.items()):
    ax.plot(np.repeat(block_counts * offsets[name], trials), errs.ravel() / eps, markers[name],
            color=f"C{i}", ms=4, alpha=0.5)
    ax.plot(block_counts * offsets[name], errs.mean(axis=1) / eps, "-", marker=markers[name],
            color=f"C{i}", label=f"{name} (line: mean of 5 cuts)")
ax.axhline(err_full / eps, color="k", ls=":", lw=1, label="all keys at once, one call")
ax.set_xscale("log", base=2)
ax.set_ylim(0, None)  # errors span less than a decade: a linear axis reads better
ax.set_title("Attention merged from k key blocks vs extended precision")
ax.set_xlabel("number of key blocks k")
ax.set_ylabel("max |out - out*| (machine epsilons)")
ax.legend(fontsize=8, loc="upper left")
fig.tight_layout()
plt.show()

# %% [markdown]
# Merging left to right, the error grows with the number of blocks, because each of the $k - 1$
# merges rounds the running result once more, as a left-to-right sum of $k$ numbers does. In a
# balanced tree every result passes through only $\log_2 k$ merges, and the error stays flat (the
# advantage of pairwise summation); random order and the $k$-way reduction stay close to the tree.
# Even 255 merges in a chain stay within a few machine epsilons. The scalar $l$ of the score row
# above showed the same, within $10^{-14}$ for every grouping.

# %% [markdown]
# ## What we showed
#
# - $(m_a, l_a) \oplus (m_b, l_b) = (M, l_a e^{m_a - M} + l_b e^{m_b - M})$ is exactly the state of
#   the union of two disjoint blocks; it is commutative and has the identity $(-\infty, 0)$ bit for
#   bit, and is associative with $m$ exact and $l$ equal to $10^{-15}$.
# - Cutting a row of 4096 scores into up to 256 random blocks and merging them left to right, as a
#   balanced tree or in random order always gives the exact maximum and $l$ within $10^{-14}$ of an
#   extended-precision truth.
# - The compact state $\mathrm{lse} = m + \log l$ lies in $[m, m + \log n]$ and merges with
#   `np.logaddexp`, with $-\infty$ as the empty block; it agrees with the merged $(m, l)$ and with the
#   truth to $10^{-13}$ nats.
# - `flash_lib.merge_attention` of two key halves equals attention over all keys to $10^{-14}$,
#   is symmetric bit for bit, and a fully masked block (out 0, lse $-\infty$) leaves the other
#   block's result unchanged bit for bit.
# - Flash-decoding's $k$-way reduction over 8 chunks and ring attention over 4 devices with rotated
#   orders both reproduce attention over all keys to $10^{-14}$.
# - Grouping changes only rounding: for every cut into up to 256 blocks the merged attention
#   output stays within 10 machine epsilons of the truth; a balanced tree, random order and the
#   $k$-way reduction stay within 3, while a left-to-right chain grows with $k$, to more than 3 times
#   the tree's error at 256 blocks.

# %%
# the merge is exact on a two-way cut
assert merged[0] == whole[0] and abs(merged[1] - whole[1]) / whole[1] < 1e-14
# commutative and identity bit for bit, associative to rounding
assert commutes and identity and assoc_m and assoc_l < 1e-15
assert merge(EMPTY, EMPTY) == EMPTY
# the online update of chapter 2 is ⊕ with one-score blocks (x, 1)
m_stream, l_stream = functools.reduce(merge, [(xi, 1.0) for xi in x[:100].tolist()], EMPTY)
m_2p, l_2p = block_state(x[:100])
assert m_stream == m_2p and abs(l_stream - l_2p) / l_2p < 1e-14
# any cut, any grouping
assert m_always_exact and worst_l < 1e-14
# lse: bounds, logaddexp, identity
assert m_all <= lse_by_merge <= m_all + math.log(n)
assert abs(lse_by_logaddexp - lse_by_merge) < 1e-13
assert lse_error < 1e-13
assert np.logaddexp(lse_by_merge, -np.inf) == lse_by_merge
# attention outputs
assert merge_vs_full < 1e-14 and np.abs(lse_ab - lse_full).max() < 1e-13
assert np.array_equal(out_ab, out_ba) and np.array_equal(lse_ab, lse_ba)
assert (out_masked == 0).all() and (lse_masked == -np.inf).all()
assert np.array_equal(out_am, out_a) and np.array_equal(lse_am, lse_a)
assert np.abs(out_dec - out_one).max() < 1e-14
assert ring_vs_full < 1e-14
assert worst_out < 10 * eps and worst_treelike < 3 * eps and chain_vs_tree > 3
assert tree_depth(trees["left to right"]) == 7 and tree_depth(trees["balanced tree"]) == 3

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
# # 5. Tiling in two dimensions
#
# Chapter 4 streamed one query over blocks of keys. FlashAttention streams a whole block of queries
# at once, so the work becomes matrix products over tiles of the score matrix. This chapter
# writes the per-tile update in matrix form and the whole forward from scratch (your reference
# implementation), draws the order of the tiles, counts what one tile holds, and checks every
# block size against `naive_attention`.

# %% [markdown]
# ## From one query to a block of queries
#
# Every query row has its own running max, sum and accumulator, and rows never interact. So
# $b_q = $ `block_q` queries can run chapter 4's update side by side: their states become vectors
# $m, l \in \mathbb R^{b_q}$ and a matrix $\text{acc} \in \mathbb R^{b_q \times d_v}$, and the
# matrix-vector products become matrix-matrix products. The gain is re-use: a block of $b_k$ =
# `block_k` keys and values, once loaded into fast memory, serves $b_q$ queries instead of one.
#
# On a GPU, "fast memory" has a precise meaning. A GPU's main memory is its **HBM**
# (high-bandwidth memory): tens of GB, where the inputs start and the output must end. Each of its
# streaming multiprocessors (SMs) has a small on-chip **SRAM**, a couple of hundred KB, an order of
# magnitude faster. A **thread block** is a group of threads that one SM runs together and that
# share that SM's SRAM. FlashAttention-2 gives each block of queries to one thread block, which
# loads its $Q_i$ from HBM into SRAM once and then each $K_j, V_j$ in turn; chapter 9 counts the
# bytes that cross between the two memories, and the re-use.
#
# For the query block $Q_i$ (rows `q_start:q_stop`) and the key block $K_j$, $V_j$ (rows
# `k_start:k_stop`), one tile does, with $\tau$ the scale and every $\max$, $\exp$ taken row by row:
#
# $$
# \begin{aligned}
# S &= \tau\, Q_i K_j^\top \in \mathbb R^{b_q \times b_k}, \\
# m' &= \max\big(m,\ \operatorname{rowmax} S\big), \\
# P &= \exp\big(S - m' \mathbf 1^\top\big), \\
# \alpha &= \exp(m - m'), \\
# l' &= \alpha \odot l + P \mathbf 1, \\
# \text{acc}' &= \operatorname{diag}(\alpha)\, \text{acc} + P V_j ,
# \end{aligned}
# $$
#
# and after the query block's last tile
#
# $$
# O_i = \operatorname{diag}(l)^{-1}\, \text{acc}, \qquad \text{lse}_i = m + \log l .
# $$
#
# ## The algorithm box
#
# FlashAttention-2's Algorithm 1 (arXiv 2307.08691) in this tutorial's symbols, with what crosses
# between HBM and SRAM marked. $Q$ is cut into $T_q = \lceil N_q / b_q \rceil$ blocks $Q_i$ of
# $b_q$ = `block_q` rows, $K$ and $V$ into $T_k = \lceil N_k / b_k \rceil$ blocks of $b_k$ =
# `block_k` rows.
#
# > **for** each query block $i = 1, \dots, T_q$ (one thread block each, in parallel):
# > - **load** $Q_i$ from HBM into SRAM; set $m = -\infty$, $l = 0$, $\text{acc} = 0$ in SRAM
# > - **for** each key block $j = 1, \dots, T_k$:
# >   - **load** $K_j, V_j$ from HBM into SRAM
# >   - $S = \tau Q_i K_j^\top$; $m' = \max(m, \operatorname{rowmax} S)$;
# >     $P = e^{S - m'}$; $\alpha = e^{m - m'}$
# >   - $l \leftarrow \alpha l + \operatorname{rowsum} P$;
# >     $\text{acc} \leftarrow \operatorname{diag}(\alpha)\,\text{acc} + P V_j$; $m \leftarrow m'$
# > - $O_i = \operatorname{diag}(l)^{-1} \text{acc}$, $\text{lse}_i = m + \log l$;
# >   **store** $O_i$ and $\text{lse}_i$ to HBM
#
# ## The recurrence in flash_lib
#
# The two inner lines of the box are one function of `flash_lib`, `online_softmax_update`. This is
# its source, read from the module itself:

# %%
import inspect

import numpy as np
import matplotlib.pyplot as plt
import flash_lib

print(inspect.getsource(flash_lib.online_softmax_update))

# %% [markdown]
# Line by line, for one tile whose scores `s` ($S$, shape `(rows, keys)`, $-\infty$ at pairs that
# are not allowed) the kernel has just computed:
#
# - `m_new = np.maximum(m, s.max(axis=-1))` is $m' = \max(m, \operatorname{rowmax} S)$.
# - `m_ref` is $m'$ except in a row that has seen no allowed key yet, where $m' = -\infty$ and
#   $s_j - m'$ would be $-\infty - (-\infty)$ = NaN; there it is 0. Chapter 6 is about those rows;
#   for every other row `m_ref` *is* $m'$.
# - `alpha = np.exp(m - m_ref)` is $\alpha = e^{m - m'}$: 1 in rows whose max did not rise, below
#   1 where it did, and $e^{-\infty} = 0$ at a row's first tile, where it multiplies the initial
#   zeros.
# - `p = np.exp(...)` is $P = e^{S - m'}$, computed in place in the scores' own buffer (`out=s`):
#   the tile never exists twice in memory.
# - `l *= alpha; l += p.sum(axis=-1)` is $l' = \alpha \odot l + P\mathbf 1$, in place.
# - `acc *= alpha[..., None]; acc += matmul(p, v)` is
#   $\text{acc}' = \operatorname{diag}(\alpha)\,\text{acc} + P V_j$: the tile's second matrix
#   product. `matmul` is `np.matmul` unless the kernel passes its own: one that writes into a
#   buffer reused from tile to tile, and, for the few key blocks whose values hold inf or NaN, one
#   that keeps masked keys out (chapter 6).
# - `m[...] = m_new` stores $m \leftarrow m'$ in place, so the caller's arrays carry the state to
#   the next tile.
# - `exp` is `np.exp`, or `np.exp2` when the kernel works in base 2, a choice the section
#   "In base 2" below explains; every line above holds in either base.
#
# ## The tile loop in flash_lib
#
# Everything else in `flash_attention` feeds this function. It checks its arguments into one
# `problem`, then runs `attention_forward_block` on its worker threads, one query block each:
# the box's outer loop body, whole.

# %%
print(inspect.getsource(flash_lib.attention_forward_block))

# %% [markdown]
# Against the box, line for line:
#
# - `q_i = problem.q_tile(q_start, q_stop)`: **load** $Q_i$, already multiplied by its share of
#   $\tau$ (flash_lib applies $\tau$ to the inputs rather than to the scores, its own choice
#   that appendix 25 explains). `m, l = problem.initial_state(...)` and `acc = np.zeros(...)`:
#   $m = -\infty$, $l = 0$, $\text{acc} = 0$ (a sink starts a row at $m = $ sink, $l = 1$:
#   chapter 18).
# - `for tile in problem.row(...)`: **for** each key block $j$, of those the band can reach
#   (causal and sliding window skip the others without computing them: chapters 6 and 14).
#   `tile` carries what the box does not show: which of the tile's pairs are allowed, the dropout
#   keep mask, the product that keeps a masked key's inf or NaN out.
# - `if cancelled.is_set(): return` stops a call interrupted with Ctrl-C before its next tile;
#   `if tile.allowed is False: continue` skips a tile where a `mask_mod` allows no pair (chapter 15).
# - `s = tile.scores(q_i, out=s_buf)`: **load** $K_j$ and compute $S = \tau Q_i K_j^\top$ into a
#   buffer reused from tile to tile, then the score variants when they are asked for (chapter 14).
# - `tile.mask(s)`: $-\infty$ at the pairs that are not allowed (chapter 6).
# - `online_softmax_update(m, l, acc, s, tile.v, tile.pv(out=pv), exp)`: the box's two inner
#   lines, above, with $V_j$ = `tile.v` and $PV_j$ computed by `tile.pv` into a reused buffer.
# - After the loop, `_finalize`: $O_i = \operatorname{diag}(l)^{-1}\text{acc}$ and
#   $\text{lse}_i = m + \log l$, once (and the empty rows of chapter 6); **store** them. The
#   dropout factor $1/(1 - p)$ and a sink's exact lse are chapters 17 and 18's.
#
# ## The forward from scratch
#
# The algorithm box is short enough to write out in full; keep this version as your reference:
# plain NumPy, nothing from `flash_lib`, one head, no mask (chapter 6 adds masks and empty rows;
# chapter 23 prints such a kernel, `flash_check.bugs.tiled_attention`). It is checked against
# `flash_attention` and `naive_attention`, output and lse, to the bound $10^{-13}$ justified in
# the block-size section below: written independently, it agrees to rounding, not bit for bit.

# %%
def attention_from_scratch(q, k, v, block_q=16, block_k=16, exp=np.exp):
    """FlashAttention-2's forward (arXiv 2307.08691, Algorithm 1) for one head: out, lse.
    exp=np.exp2 computes in base 2 (the section "In base 2" below)."""
    n_q, n_k = len(q), len(k)
    unit = 1 / np.log(2) if exp is np.exp2 else 1.0  # log2(e): scores in base-2 units
    tau = unit / np.sqrt(q.shape[1])
    out, lse = np.empty((n_q, v.shape[1])), np.empty(n_q)
    for q0 in range(0, n_q, block_q):  # query blocks outside: load Q_i, fresh state
        q1 = min(q0 + block_q, n_q)
        m = np.full(q1 - q0, -np.inf)  # running max
        l = np.zeros(q1 - q0)  # running sum of exp(s - m)
        acc = np.zeros((q1 - q0, v.shape[1]))  # running sum of exp(s - m) v
        for k0 in range(0, n_k, block_k):  # key blocks inside: load K_j, V_j
            k1 = min(k0 + block_k, n_k)
            s = tau * (q[q0:q1] @ k[k0:k1].T)  # S = τ Q_i K_jᵀ
            m_new = np.maximum(m, s.max(axis=1))
            p = exp(s - m_new[:, None])  # P = exp(S - m')
            alpha = exp(m - m_new)  # exp(-inf) = 0 at the first tile
            l = alpha * l + p.sum(axis=1)
            acc = alpha[:, None] * acc + p @ v[k0:k1]
            m = m_new
        out[q0:q1] = acc / l[:, None]  # divide once, after the last tile
        lse[q0:q1] = (m + np.log2(l)) * np.log(2) if exp is np.exp2 else m + np.log(l)
    return out, lse


rng = np.random.default_rng(5)
q, k, v = rng.standard_normal((100, 16)), rng.standard_normal((300, 16)), rng.standard_normal((300, 8))
mine, mine_lse = attention_from_scratch(q, k, v, block_q=32, block_k=48)
by_kernel, kernel_lse = flash_lib.flash_attention(q, k, v, block_q=32, block_k=48, return_lse=True)
by_naive, naive_lse = flash_lib.naive_attention(q, k, v, return_lse=True)
scratch_errors = {
    "flash_attention": (flash_lib.rowwise_relative_error(mine, by_kernel).max(),
                        np.abs(mine_lse - kernel_lse).max()),
    "naive_attention": (flash_lib.rowwise_relative_error(mine, by_naive).max(),
                        np.abs(mine_lse - naive_lse).max()),
}
for name, (e_out, e_lse) in scratch_errors.items():
    print(f"from scratch against {name}: output within 1e-13: {e_out <= 1e-13}, "
          f"lse within 1e-13: {e_lse <= 1e-13}")

# %% [markdown]
# ## In base 2
#
# Nothing in the recurrence needs the base $e$: with $\log_2 e$ written $L$,
#
# $$e^{s - m} = 2^{Ls - Lm},$$
#
# so a kernel may keep its scores, its running maximum and its lse in base-2 units ($Ls$, $Lm$)
# and call $2^x$ instead of $e^x$. Three lines change, the three marked by `exp` and `unit`
# above: the scale becomes $	au L$, every `np.exp` becomes `np.exp2`, and the lse, which callers
# expect in nats, comes back with one multiply per row,
# $	ext{lse} = (Lm + \log_2 l) \ln 2$. The sums $l$ and $	ext{acc}$ are the same numbers in
# either base, so the output needs nothing.
#
# Why bother: the hardware may compute one faster. A GPU's special function unit computes $2^x$
# (`ex2.approx`), so FlashAttention works in base 2 and folds $L$ into the scale it multiplies
# by anyway ({doc}`chapter 16 <16_on_a_gpu>`). On a CPU, NumPy computes `np.exp2` in float32
# with Intel's SVML where it has AVX-512, in less than half the time of its `np.exp`
# ({doc}`chapter 10 <10_speed>` measures it); elsewhere `exp2` is the slower one. So flash_lib
# chooses per machine and dtype, from the loops NumPy reports (never from a timing):
# `flash_lib.exponential(dtype)` says which, and `flash_lib.use_exponential("exp" or "exp2")`
# forces one. It folds $L$ into the keys' factor $	au_k$, a multiply it already does
# (appendix 25). Base 2 costs a rounding of $k \cdot L$ and one of the lse's conversion;
# {doc}`chapter 7 <07_exactness>` measures what that does to the error.
#
# The cell runs the from-scratch forward in base 2 against `flash_attention` in base 2 and in
# base e, to the same bound, and checks that the choice is NumPy's dispatch table read as the
# rule says (which way it went is this machine's, so it is not printed).

# %%
from numpy.lib.introspect import opt_func_info

mine2, mine2_lse = attention_from_scratch(q, k, v, block_q=32, block_k=48, exp=np.exp2)
base2_errors = {}
for name in ("exp2", "exp"):
    with flash_lib.use_exponential(name):
        out2, lse2 = flash_lib.flash_attention(q, k, v, block_q=32, block_k=48, return_lse=True)
    base2_errors[name] = (flash_lib.rowwise_relative_error(mine2, out2).max(),
                          np.abs(mine2_lse - lse2).max())
    print(f"from scratch in base 2 against flash_attention in {name}: output within 1e-13: "
          f"{base2_errors[name][0] <= 1e-13}, lse within 1e-13: {base2_errors[name][1] <= 1e-13}")

# the rule: exp2 for float32 where NumPy's exp2 loop is an AVX-512 one, exp otherwise
avx512_exp2 = opt_func_info(func_name="^exp2$")["exp2"]["ff"]["current"].startswith(
    ("X86_V4", "AVX512"))
rule_holds = (flash_lib.exponential(np.float32) is (np.exp2 if avx512_exp2 else np.exp)
              and flash_lib.exponential(np.float64) is np.exp)
print("flash_lib.exponential follows NumPy's dispatch table as the rule says:", rule_holds)

# %% [markdown]
# ## The tile schedule
#
# `flash_lib.tile_schedule(n_q, n_k, block_q, block_k)` lists the tiles
# `(q_start, q_stop, k_start, k_stop)` in the order `flash_attention` visits them; the kernel
# iterates exactly this list. Query blocks form the outer loop and key blocks the inner one, the
# order of FlashAttention-2 (arXiv 2307.08691, Algorithm 1 and Section 3.2): one query block's
# $m$, $l$ and $\text{acc}$ stay in fast memory through its inner loop and are written out once,
# and query blocks are independent, so they run in parallel (on a GPU, one thread block each;
# flash_lib runs them on a small thread pool). The original FlashAttention
# (arXiv 2205.14135, Algorithm 1) had the loops the other way round and read and wrote every query
# block's state once per key block.
#
# A small example with sizes that the blocks do not divide: $N_q = 10$, $N_k = 13$, `block_q = 4`,
# `block_k = 5`. The cell prints the schedule, checks that it covers every (query, key) pair
# exactly once, and draws the $N_q \times N_k$ score matrix, one small square per pair, with the
# tiles numbered and coloured in visiting order.

# %%
n_q, n_k, block_q, block_k = 10, 13, 4, 5
tiles = flash_lib.tile_schedule(n_q, n_k, block_q, block_k)
for order, tile in enumerate(tiles):
    print(order, tile)

# How many tiles cover each (query, key) pair.
coverage = np.zeros((n_q, n_k), dtype=int)
for q_start, q_stop, k_start, k_stop in tiles:
    coverage[q_start:q_stop, k_start:k_stop] += 1
n_tiles_expected = -(-n_q // block_q) * -(-n_k // block_k)  # ceil(Nq/bq) * ceil(Nk/bk)
print("tiles:", len(tiles), "; ceil(10/4) * ceil(13/5) =", n_tiles_expected)
print("times each (query, key) pair is covered: from", coverage.min(), "to", coverage.max())
print("query block of each tile, in visiting order:", [t[0] for t in tiles])


# %%
def draw_schedule(ax, n_q, n_k, tiles):
    """Draw the Nq x Nk score matrix, one square per pair, tiles coloured in visiting order."""
    cmap = plt.get_cmap("viridis")
    for order, (q_start, q_stop, k_start, k_stop) in enumerate(tiles):
        shade = order / max(len(tiles) - 1, 1)
        ax.add_patch(plt.Rectangle((k_start, q_start), k_stop - k_start, q_stop - q_start,
                                   facecolor=cmap(shade), edgecolor="black", linewidth=2))
        ax.text((k_start + k_stop) / 2, (q_start + q_stop) / 2, str(order), ha="center",
                va="center", fontsize=14, color="white" if shade < 0.6 else "black")
    ax.set_xticks(np.arange(n_k + 1), minor=True)
    ax.set_yticks(np.arange(n_q + 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.6)
    ax.tick_params(which="minor", length=0)
    ax.set_xlim(0, n_k)
    ax.set_ylim(n_q, 0)  # query 0 at the top, as in a matrix
    ax.set_aspect("equal")


fig, ax = plt.subplots(figsize=(7, 4.5))
draw_schedule(ax, n_q, n_k, tiles)
ax.set_xticks(sorted({t[2] for t in tiles} | {n_k}))
ax.set_yticks(sorted({t[0] for t in tiles} | {n_q}))
ax.set_title("tile_schedule(10, 13, block_q=4, block_k=5): visiting order")
ax.set_xlabel("key index $j$ (block boundaries marked)")
ax.set_ylabel("query index $i$")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What one tile holds
#
# Count the numbers the kernel needs at any moment while it works on one tile, for one
# (batch, head):
#
# | what | size |
# |---|---|
# | query block $Q_i$ | $b_q\, d$ |
# | key block $K_j$ and value block $V_j$ | $b_k\, d + b_k\, d_v$ |
# | scores $S$, then weights $P$ | $b_q\, b_k$ |
# | $m$, $l$, $\alpha$ | $3\, b_q$ |
# | accumulator $\text{acc}$ | $b_q\, d_v$ |
#
# In total $b_q (d + b_k + d_v + 3) + b_k (d + d_v)$, which for $b_k \approx b_q$ and $d_v = d$, as
# in practice, is $O\big(b_q (b_k + d)\big)$. Neither $N_q$ nor $N_k$ appears: the score matrix
# exists only one tile at a time. The textbook algorithm (`naive_attention`) holds all of
# $S \in \mathbb R^{N_q \times N_k}$, $N^2$ numbers for $N_q = N_k = N$. The table below uses
# $b_q = b_k = 128$ and $d = d_v = 64$, common FlashAttention-2 tile sizes.
#
# In NumPy the key and value blocks are views into `k` and `v` and cost nothing, while $S$ and $P$
# briefly coexist, so flash_lib's working set differs a little from the count, but is just as
# independent of $N$: {doc}`chapter 8 <08_memory>` measures it.

# %%
b_q, b_k, d, d_v = 128, 128, 64, 64
tile_elements = b_q * (d + b_k + d_v + 3) + b_k * (d + d_v)
print("      N   naive: N^2 scores   flash: one tile   ratio")
for n in (1024, 4096, 16384, 65536):
    print(f"{n:>7}   {n * n:>17,}   {tile_elements:>15,}   {n * n // tile_elements:>5,}")

# %% [markdown]
# ## Equal to the textbook algorithm for every block size
#
# The tile update is exact algebra, so any `block_q` and `block_k` must give the output of
# `naive_attention` up to rounding, and the same lse. The sizes below use $N_q = 37$ and
# $N_k = 53$ (primes, so no block size other than 1 and $N$ divides them) with two heads, and
# cover: block size 1 in either direction or both (chapter 2's scalar recurrence on every entry),
# sizes that do not divide $N$, sizes equal to $N$, and sizes larger than $N$ (a single, partial
# tile). The error is the largest absolute difference relative to the largest output entry. Its
# last digits depend on the CPU, so the table prints each against its bound and the figure below
# it draws the measured errors.

# %%
rng = np.random.default_rng(5)
n_q, n_k, d, d_v = 37, 53, 16, 8
q = rng.standard_normal((2, n_q, d))
k = rng.standard_normal((2, n_k, d))
v = rng.standard_normal((2, n_k, d_v))
out_naive, lse_naive = flash_lib.naive_attention(q, k, v, return_lse=True)

rel_err = lambda x, ref: flash_lib.rowwise_relative_error(x, ref).max()  # chapter 7's metric, worst row
# 1e-13 is about 450 eps: rounding over 53 keys stays far below it (measured at most 8.2 eps at
# every NumPy CPU level and OpenBLAS kernel tried), any real error far above (a kernel off by
# 1e-6 misses it by 7 orders). The last digits depend on the CPU: the errors are drawn, not printed.
BOUND = 1e-13
eps64 = np.finfo(np.float64).eps

cases = [(1, 1), (1, 53), (37, 1), (4, 5), (7, 11), (16, 16), (36, 52), (37, 53), (64, 64),
         (256, 512)]
print(f"block_q  block_k  tiles  within {BOUND:.0e} of naive: out  lse")
case_results = []
for bq, bk in cases:
    out, lse = flash_lib.flash_attention(q, k, v, block_q=bq, block_k=bk, return_lse=True)
    n_tiles = len(flash_lib.tile_schedule(n_q, n_k, bq, bk))
    err_out, err_lse = rel_err(out, out_naive), np.abs(lse - lse_naive).max()
    case_results.append((bq, bk, n_tiles, err_out, err_lse))
    print(f"{bq:>7}  {bk:>7}  {n_tiles:>5}  {str(err_out <= BOUND):>23}  {str(err_lse <= BOUND):>4}")

fig, ax = plt.subplots(figsize=(8, 3))
positions = np.arange(len(case_results))
for i, (what, column) in enumerate((("output", 3), ("lse (nats, absolute)", 4))):
    errs = np.array([r[column] for r in case_results]) / eps64
    ax.bar(positions + 0.4 * (i - 0.5), errs, width=0.4, label=what)
ax.set_xticks(positions, [f"{bq}x{bk}" for bq, bk, *_ in case_results], fontsize=8)
ax.set_xlabel("block_q x block_k")
ax.set_ylabel("error vs naive (machine epsilons)")
ax.set_title(f"Measured errors; the bound is {BOUND / eps64:.0f} eps")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# The same check over a grid of 121 block-size pairs, from 1 to beyond $N$ in both directions,
# asks whether more tiles mean more error, since every tile rescales by $\alpha$ once more. The
# picture plots each pair's error against its number of tiles: a few epsilons throughout, since
# $\alpha = 1$ exactly whenever a row's max did not move, which after a few tiles is most of them.

# %%
sizes_q = [1, 2, 3, 5, 8, 13, 21, 34, 37, 38, 64]
sizes_k = [1, 2, 3, 5, 8, 13, 21, 34, 53, 54, 64]
grid_err = np.array([
    [rel_err(flash_lib.flash_attention(q, k, v, block_q=bq, block_k=bk), out_naive)
     for bk in sizes_k]
    for bq in sizes_q
])

grid_tiles = np.array([[len(flash_lib.tile_schedule(n_q, n_k, bq, bk)) for bk in sizes_k]
                       for bq in sizes_q])
fig, ax = plt.subplots(figsize=(8, 4))
exact = grid_err == 0  # one key block does naive's own operations: 0, drawn at the bottom
ax.scatter(grid_tiles[~exact], grid_err[~exact] / eps64, s=18, label="measured on this machine")
ax.scatter(grid_tiles[exact], np.full(exact.sum(), 0.5), marker="v", s=30, color="C2",
           label="0: bit for bit (drawn at 0.5)")
ax.axhline(BOUND / eps64, color="C3", ls="--", label=f"the bound asserted, {BOUND:.0e}")
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_ylim(0.3, 1000)
ax.set_xlabel(f"tiles visited ($N_q$ = {n_q}, $N_k$ = {n_k})")
ax.set_ylabel("error vs naive (machine epsilons)")
ax.set_title("121 block-size pairs: the error does not grow with the number of tiles")
ax.legend(fontsize=8, loc="center left")
ax.grid(True, which="major", alpha=0.3)
fig.tight_layout()
plt.show()

print(f"{grid_err.size} block-size pairs, from {grid_tiles.min()} to {grid_tiles.max()} tiles; "
      f"every error within {BOUND:.0e} = {BOUND / eps64:.0f} eps: {grid_err.max() <= BOUND}")

# %% [markdown]
# ## What we showed
#
# - One tile's update is a handful of matrix operations on $S = \tau Q_i K_j^\top$
#   (`flash_lib.online_softmax_update`); the whole forward, written from scratch in twenty lines,
#   matches `flash_attention` and `naive_attention` to $10^{-13}$, in base $e$ and in base 2.
# - `tile_schedule` visits $\lceil N_q/b_q \rceil \lceil N_k/b_k \rceil$ tiles, query blocks
#   outer, covering every pair once.
# - One tile holds $b_q(d + b_k + d_v + 3) + b_k(d + d_v)$ numbers, independent of $N$.
# - Every block size tried agrees with `naive_attention` to $10^{-13}$, and the error does not
#   grow with the number of tiles.

# %%
for e_out, e_lse in (*scratch_errors.values(), *base2_errors.values()):  # BOUND: see below
    assert e_out <= BOUND and e_lse <= BOUND, (scratch_errors, base2_errors)
assert rule_holds
assert len(tiles) == n_tiles_expected == 9
assert np.all(coverage == 1)
assert [t[0] for t in flash_lib.tile_schedule(10, 13, 4, 5)] == [0, 0, 0, 4, 4, 4, 8, 8, 8]
assert tiles[-1] == (8, 10, 10, 13)  # partial in both directions
assert 1024 * 1024 // tile_elements == 21 and 65536 * 65536 // tile_elements // 100 == 867
for bq, bk, n_tiles, err_out, err_lse in case_results:  # BOUND: see its definition
    assert err_out <= BOUND and err_lse <= BOUND, (bq, bk, err_out, err_lse)
    assert n_tiles == -(-n_q // bq) * -(-n_k // bk)
assert np.all(grid_err <= BOUND)
assert grid_tiles.min() == 1 and grid_tiles.max() == n_q * n_k

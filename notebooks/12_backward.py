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
# # 12. The backward pass
#
# The textbook backward keeps the forward's softmax matrix $P$,
# $N_q \times N_k$ numbers per head per layer; FlashAttention keeps the output $O$ and one number
# per row, the lse, and recomputes $P$ tile by tile. This chapter derives the gradients from the
# output alone, rebuilds $P$ from the lse, reads FlashAttention-2's tile loop in `flash_lib`, and
# guards the empty row; {doc}`chapter 13 <13_backward_cost>` writes it from scratch and counts its
# cost.

# %%
import inspect
import warnings

import matplotlib.pyplot as plt
import numpy as np
from threadpoolctl import threadpool_limits

import flash_lib
from flash_bench import below, relative_difference, threads_seen
from flash_lib import rowwise_relative_error

rng = np.random.default_rng(12)

# The limit for float64 agreements "to rounding" in this chapter: 1e-14 is 45 machine epsilons;
# the differences measured below are at most 1e-15 on every CPU tried, and any real error (a
# kernel off by one part in a million) is far above it.
ROUNDING = 1e-14

# %% [markdown]
# ## What the backward pass computes
#
# One head's forward, with the scale $\tau$ ($1/\sqrt d$ by default):
#
# $$S = \tau\, Q K^\top, \qquad P = \operatorname{softmax}(S) \text{ row by row}, \qquad O = P V .$$
#
# Backpropagation hands the layer $dO = \partial L / \partial O$ for a scalar loss $L$ and asks
# for $dQ$, $dK$, $dV$ ($dX$ always means $\partial L / \partial X$, shaped like $X$). $L$ reaches
# $Q$, $K$, $V$ only through $O$, so these are the gradients of $\sum (dO \circ O)$ with $dO$ held
# fixed, which `flash_attention_backward(q, k, v, out, lse, dout)` returns.
#
# ## One row: the softmax's Jacobian-vector product
#
# For one query row: scores $s_j = \tau\, q \cdot k_j$, weights $P_j = e^{s_j} / \sum_k e^{s_k}$,
# output $o = \sum_j P_j v_j$, incoming gradient $dO$ (a $d_v$-vector).
#
# 1. $o$ is linear in each weight, so $dP_j = \partial L / \partial P_j = dO \cdot v_j$.
# 2. By the quotient rule the softmax's Jacobian is
#    $\partial P_j / \partial s_k = P_j\,(\delta_{jk} - P_k)$, the matrix
#    $J = \operatorname{diag}(P) - P P^\top$; by the chain rule
#    $dS_k = \sum_j dP_j\, \partial P_j / \partial s_k$, so
#
#    $$dS_k = P_k\, dP_k - P_k \sum_j P_j\, dP_j = P_k \Big(dP_k - \sum_j P_j\, dP_j\Big) .$$
#
# 3. The bracket's sum is one number per row and needs no $P$:
#
#    $$\sum_j P_j\, dP_j = \sum_j P_j\, (dO \cdot v_j) = dO \cdot \Big(\sum_j P_j v_j\Big) = dO \cdot o \;=:\; D .$$
#
# So $dS_j = P_j\,(dP_j - D)$ with $D = dO \cdot o$, the FlashAttention-2 paper's $D_i$
# (arXiv 2307.08691, Algorithm 2), computed once per row from the forward's output: a tile needs
# nothing else from its row. The cell checks this for one query and 10 keys against $J\, dP$ ($J$
# is symmetric), with $D$ computed both ways.

# %%
n_k, d, dv = 10, 8, 4
q1 = rng.standard_normal(d)
k1 = rng.standard_normal((n_k, d))
v1 = rng.standard_normal((n_k, dv))
do1 = rng.standard_normal(dv)
tau = 1 / np.sqrt(d)

s1 = tau * (k1 @ q1)
p1 = np.exp(s1 - s1.max()) / np.exp(s1 - s1.max()).sum()
o1 = p1 @ v1
# dP_j = dO · v_j
dp1 = v1 @ do1
# J = diag(P) - P Pᵀ, the softmax's Jacobian; dS = Jᵀ dP
jacobian = np.diag(p1) - np.outer(p1, p1)
ds_jacobian = jacobian.T @ dp1
# D = Σ_j P_j dP_j = dO · o
D_from_p, D_from_o = p1 @ dp1, do1 @ o1
# dS_j = P_j (dP_j - D)
ds_formula = p1 * (dp1 - D_from_o)

print(f"D = sum_j P_j dP_j = {D_from_p:.6f}; D = dO · o = {D_from_o:.6f}")
jacobian_diff = np.abs(ds_formula - ds_jacobian).max() / np.abs(ds_jacobian).max()
print(f"P ∘ (dP - D) against J dP: largest difference {below(jacobian_diff, ROUNDING)} (relative)")

# %% [markdown]
# ## From $dS$ to $dQ$, $dK$, $dV$
#
# The chain rule through $O = PV$ and $S = \tau\, Q K^\top$ gives, for all rows at once ($D$
# now a vector of $N_q$ numbers),
#
# $$
# \begin{aligned}
# dV &= P^\top dO, & dP &= dO\, V^\top, & D &= \operatorname{rowsum}(dO \circ O), \\
# dS &= P \circ (dP - D\, \mathbf 1^\top), & dQ &= \tau\, dS\, K, & dK &= \tau\, dS^\top Q .
# \end{aligned}
# $$
#
# Here $\tau$ is a power of two ($1/8$ for $d = 64$), so where flash_lib applies it (appendix 26)
# changes no bit. The cell evaluates the six formulas densely for two heads, $N_q = 37$,
# $N_k = 53$, $d = 64$, causal, and compares them, relative to each gradient's largest entry,
# with `naive_attention_backward` (which takes $\operatorname{rowsum}(P \circ dP)$ from $P$, not
# $D$ from $O$) and `flash_attention_backward`.

# %%
n_q, n_k, d, dv = 37, 53, 64, 16
q = rng.standard_normal((2, n_q, d))
k = rng.standard_normal((2, n_k, d))
v = rng.standard_normal((2, n_k, dv))
dout = rng.standard_normal((2, n_q, dv))
causal = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + (n_k - n_q)  # bottom-right
tau = 1 / np.sqrt(d)  # 1/8

S = tau * (q @ np.swapaxes(k, -1, -2))
S = np.where(causal, S, -np.inf)
P = np.exp(S - S.max(axis=-1, keepdims=True))
P /= P.sum(axis=-1, keepdims=True)
O = P @ v
# dV = Pᵀ dO
dV = np.swapaxes(P, -1, -2) @ dout
# dP = dO Vᵀ
dP = dout @ np.swapaxes(v, -1, -2)
# D = rowsum(dO ∘ O)
D = (dout * O).sum(axis=-1)
# dS = P ∘ (dP - D 1ᵀ)
dS = P * (dP - D[..., None])
# dQ = τ dS K,  dK = τ dSᵀ Q
dQ = tau * (dS @ k)
dK = tau * (np.swapaxes(dS, -1, -2) @ q)

naive = flash_lib.naive_attention_backward(q, k, v, dout, causal=True)
out, lse = flash_lib.flash_attention(q, k, v, causal=True, return_lse=True, block_q=16, block_k=16)
flash = flash_lib.flash_attention_backward(q, k, v, out, lse, dout, causal=True, block_q=16,
                                           block_k=16)
print("      the formulas vs naive   vs flash")
matrix_diffs = {}
for name, mine, n, f in zip(("dq", "dk", "dv"), (dQ, dK, dV), naive, flash):
    matrix_diffs[name] = (relative_difference(mine, n), relative_difference(mine, f))
    print(f"{name}:   {below(matrix_diffs[name][0], ROUNDING):>22}   "
          f"{below(matrix_diffs[name][1], ROUNDING)}")
print("dV, the formulas against naive, bit for bit (the same product of the same P):",
      matrix_diffs["dv"][0] == 0)

# %% [markdown]
# The three agree to rounding
# ({doc}`the appendix on how this tutorial is tested <28_how_chapters_7_to_23_are_tested>` draws
# the differences). The formulas needed the forward's $P$ as well as $O$; the next section drops
# $P$.
#
# ## Why the forward saves the lse
#
# Chapter 5's forward stores per row $\text{lse}_i = m + \log l$, the log of the softmax's
# denominator: all the backward needs to rebuild any weight of the row,
#
# $$P_{ij} = \frac{e^{S_{ij} - m_i}}{l_i} = e^{S_{ij} - m_i - \log l_i} = e^{S_{ij} - \text{lse}_i} .$$
#
# One exp per score, with no max, sum or division over the row. $P_{ij}$ comes out normalised,
# and no exponent is positive, since $S_{ij} \le m_i \le \text{lse}_i$. (FlashAttention stores
# the same natural-log lse, `softmax_lse`, in float32.)

# %%
# P_ij = exp(S_ij - lse_i)
P_from_lse = np.exp(S - lse[..., None])

err_p = rowwise_relative_error(P_from_lse, P).max()
row_sums = P_from_lse.sum(axis=-1)
largest_exponent = (S - lse[..., None]).max()
print(f"exp(S - lse) against the textbook softmax: largest row error {below(err_p, ROUNDING)}")
print(f"its rows' sums minus 1: {below(np.abs(row_sums - 1).max(), ROUNDING)}; largest exponent "
      f"{largest_exponent:.2f}")

# %% [markdown]
# ## The tile loop
#
# FlashAttention-2's backward (arXiv 2307.08691, Algorithm 2) in this tutorial's symbols, with
# the traffic between HBM and SRAM marked; $D$ is computed first, in a pass of its own.
#
# > **for** each key block $j = 1, \dots, T_k$ (one thread block each, in parallel):
# > - **load** $K_j, V_j$ from HBM into SRAM; set $dK_j = 0$, $dV_j = 0$ in SRAM
# > - **for** each query block $i = 1, \dots, T_q$ (causal: only those whose tile $(i, j)$ the
# >   forward visits):
# >   - **load** $Q_i$, $dO_i$, $\text{lse}_i$, $D_i$ from HBM into SRAM
# >   - $S_{ij} = \tau Q_i K_j^\top$; $P_{ij} = e^{S_{ij} - \text{lse}_i}$ (masked pairs: 0)
# >   - $dV_j \mathrel{+}= P_{ij}^\top dO_i$; $dP_{ij} = dO_i V_j^\top$;
# >     $dS_{ij} = P_{ij} \circ (dP_{ij} - D_i)$
# >   - $dK_j \mathrel{+}= \tau\, dS_{ij}^\top Q_i$
# >   - **load** $dQ_i$, $dQ_i \mathrel{+}= \tau\, dS_{ij} K_j$, **store** $dQ_i$ (on a GPU: an
# >     atomic add)
# > - **store** $dK_j$, $dV_j$ to HBM
#
# The loops are the forward's, swapped. $dK_j$ and $dV_j$ are sums over query blocks, so with key
# blocks outside they stay in fast memory, are written once, and key
# blocks run in parallel without sharing. $dQ_i$ is a sum over key blocks, each adding a share:
# FlashAttention-2 by atomic adds, in whatever order thread blocks finish; Triton's fused
# attention tutorial (`python/tutorials/06-fused-attention.py`) by a second loop, one query block
# against all key blocks, that recomputes $P$ once more.
#
# `flash_lib.attention_backward_tile` is one tile's math and nothing else:

# %%
print(inspect.getsource(flash_lib.attention_backward_tile))

# %% [markdown]
# `q` and `k` arrive already scaled (appendix 26), so `q @ kᵀ` is the forward's $S_{ij}$ bit for
# bit; the rest of $\tau$ is applied once per block afterwards. The `matmul` argument and the
# `np.copyto` lines keep an inf or NaN at a masked pair out of the sums (chapter 6); `scores`
# serves the score variants (chapter 14). `flash_attention_backward` computes $D$, then runs
# `attention_backward_block`, the box's outer loop body, on its worker threads, one key block
# each.

# %%
print(inspect.getsource(flash_lib.attention_backward_block))

# %% [markdown]
# Against the box: `k_j`, `v_j` are the **load** of $K_j, V_j$; `dk_j`, `dv_j` the zeroed $dK_j$,
# $dV_j$. The loop walks every query block in
# order; an unvisited tile (`tile.allowed is False`) computes nothing, but the worker still takes
# its turn at $dQ_i$. After the inner body, `attention_backward_tile(...)`, `with
# turns.turn(i, j, cancelled)` adds the box's $dQ_i \mathrel{+}= \tau\, dS_{ij} K_j$ ($\tau$
# applied once, at the end). The last lines **store** $dK_j$, $dV_j$ (summed over heads sharing a
# key: chapter 15).
#
# Floating-point addition is not associative, so atomic adds in finishing order would make $dQ$'s
# last bits depend on timing; added in key-block order, each worker waiting its turn on $dQ_i$,
# they do not. FlashAttention 3's
# deterministic mode does the same on a GPU, with a semaphore per query block (`store_dq` in
# `hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp`, commit `0105a8f`).
#
# The cell wraps the kernel's tile function to record which tiles it computes on a causal problem
# ($N = 16$, 4 × 4 tiles; a tile is known by the first row of its unscaled `dout` and `v`), and
# compares the record with the forward's `tile_schedule`; the picture shows the traffic of key
# block $j = 1$'s worker.

# %%
n_draw, b_draw, j_draw = 16, 4, 1
q, k, v, dout = (rng.standard_normal((n_draw, 8)) for _ in range(4))
out, lse = flash_lib.flash_attention(q, k, v, causal=True, return_lse=True)
computed = []
tile_function = flash_lib.attention_backward_tile


def recording_tile(q_t, k_t, v_t, *, dout, **kwargs):
    first_row = lambda x, rows: int(np.flatnonzero((rows == x[0]).all(axis=-1))[0])
    q0, k0 = first_row(dout, dout_all), first_row(v_t, v)
    computed.append((q0, q0 + len(dout), k0, k0 + len(v_t)))
    return tile_function(q_t, k_t, v_t, dout=dout, **kwargs)


dout_all = dout
try:
    flash_lib.attention_backward_tile = recording_tile  # the kernel looks it up at each call
    flash_lib.flash_attention_backward(q, k, v, out, lse, dout, causal=True, block_q=b_draw,
                                       block_k=b_draw)
finally:
    flash_lib.attention_backward_tile = tile_function
schedule = flash_lib.tile_schedule(n_draw, n_draw, b_draw, b_draw, causal=True)
visited_rows = [(q0, q1) for q0, q1, k0, _ in computed if k0 == j_draw * b_draw]
k_blk = (j_draw * b_draw, (j_draw + 1) * b_draw)
print(f"tiles the backward computed: {len(computed)} of {(n_draw // b_draw) ** 2}; "
      f"the forward's schedule, each once: {sorted(computed) == sorted(schedule)}")
print("query blocks key block 1 visits:", visited_rows)

# %% tags=["hide-input"]
read, write, both, compute = "#9ecae1", "#fc9272", "#bc80bd", "#fdd49e"
fig, ax = plt.subplots(figsize=(8, 8))
# the score matrix's tiles: computed by this worker, by other workers, or skipped (causal)
for q0, q1 in ((s, s + b_draw) for s in range(0, n_draw, b_draw)):
    for k0, k1 in ((s, s + b_draw) for s in range(0, n_draw, b_draw)):
        visited = (q0, q1, k0, k1) in computed
        mine = visited and (k0, k1) == k_blk
        ax.add_patch(plt.Rectangle((k0, q0), b_draw, b_draw, edgecolor="black", lw=1,
                                   facecolor=compute if mine else ("0.9" if visited else "white"),
                                   hatch=None if visited else "//"))
        if mine:
            ax.text(k0 + 2, q0 + 2, "$S, P,$\n$dP, dS$", ha="center", va="center", fontsize=9)
# strips over the key axis: K, V read once; dK, dV written once
for row, (name, color) in enumerate((("K", read), ("V", read), ("dK", write), ("dV", write))):
    y = -1.2 * (row + 1) - 0.4
    ax.add_patch(plt.Rectangle((0, y), n_draw, 1, facecolor="white", edgecolor="0.5"))
    ax.add_patch(plt.Rectangle((k_blk[0], y), b_draw, 1, facecolor=color, edgecolor="black"))
    ax.text(-0.4, y + 0.5, name, ha="right", va="center", fontsize=10)
# strips beside the query axis: Q, dO, lse, D read per visited query block; dQ read and written
for col, (name, color) in enumerate((("Q", read), ("dO", read), ("lse", read), ("D", read),
                                     ("dQ", both))):
    x = n_draw + 0.6 + 1.3 * col
    ax.add_patch(plt.Rectangle((x, 0), 1, n_draw, facecolor="white", edgecolor="0.5"))
    for q0, q1 in visited_rows:
        ax.add_patch(plt.Rectangle((x, q0), 1, q1 - q0, facecolor=color, edgecolor="black"))
    ax.text(x + 0.5, n_draw + 0.5, name, ha="center", va="top", fontsize=10)
legend = [plt.Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="black") for c in
          (read, write, both, compute, "0.9")]
legend.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", hatch="//"))
ax.legend(legend, ["read from HBM", "written to HBM once, at the end",
                   r"read and written: $dQ_i$ += $\tau\, dS_{ij} K_j$, in key-block order",
                   "computed in SRAM, never stored", "other key blocks' tiles (other workers)",
                   "skipped (causal)"],
          loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize=8)
ax.set_xlim(-2, n_draw + 7.2)
ax.set_ylim(n_draw + 1, -5.6)
ax.set_aspect("equal")
ax.set_xticks(range(0, n_draw + 1, b_draw))
ax.set_yticks(range(0, n_draw + 1, b_draw))
ax.set_xlabel("key index j (block boundaries marked)")
ax.set_ylabel("query index i")
ax.set_title(f"One worker of the backward: key block j = {j_draw}, causal, N = {n_draw}, "
             f"{b_draw}×{b_draw} tiles")
fig.tight_layout()
plt.show()

# %% [markdown]
# Without a mask the loop is short enough to write out around the real tile function, on one
# worker with BLAS on one thread (as `flash_lib` holds it). It is compared bit for bit with
# `flash_attention_backward`, then run with $dQ_i$'s shares added in reverse order.

# %%
def backward_loop(q, k, v, out, lse, dout, block_q, block_k, D=None, reverse_dq=False):
    """flash_attention_backward's loop for one head, no mask, one worker: key blocks outside."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    tau = 1 / np.sqrt(q.shape[-1])  # a power of two here: on q alone it gives flash_lib's bits
    if D is None:  # D_i = rowsum(dO_i ∘ O_i), once per row
        D = np.concatenate([np.sum(dout[i:i + block_q] * out[i:i + block_q], axis=-1)  # pairwise
                            for i in range(0, n_q, block_q)])
    lse = np.where(lse == -np.inf, np.inf, lse)  # the empty-row guard (below)
    shares = {}
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for j in range(0, n_k, block_k):  # key blocks outside: dK_j, dV_j resident
        dk_j, dv_j = np.zeros_like(k[j:j + block_k]), np.zeros_like(v[j:j + block_k])
        for i in range(0, n_q, block_q):  # query blocks inside
            rows = slice(i, i + block_q)
            shares[i, j] = flash_lib.attention_backward_tile(
                tau * q[rows], k[j:j + block_k], v[j:j + block_k], dout[rows],
                lse[rows], D[rows], dk_j, dv_j)
        dk[j:j + block_k], dv[j:j + block_k] = dk_j, dv_j
    dq = np.zeros_like(q)
    for (i, j) in sorted(shares, key=lambda ij: (ij[1] if not reverse_dq else -ij[1])):
        dq[i:i + block_q] += shares[i, j]  # dQ_i's shares in key-block order (or reversed)
    return tau * dq, dk, dv


q, k, v, dout = (rng.standard_normal((300, c)) for c in (64, 64, 32, 32))
out, lse = flash_lib.flash_attention(q, k, v, return_lse=True, block_q=64, block_k=48)
flash = flash_lib.flash_attention_backward(q, k, v, out, lse, dout, block_q=64, block_k=48)
with threadpool_limits(limits=1, user_api="blas"):
    mine = backward_loop(q, k, v, out, lse, dout, 64, 48)
    reversed_dq = backward_loop(q, k, v, out, lse, dout, 64, 48, reverse_dq=True)[0]
loop_identical = [np.array_equal(a, b) for a, b in zip(mine, flash)]
reversed_differs = int((reversed_dq != flash[0]).sum())
reversed_rel = relative_difference(reversed_dq, flash[0])
print("the loop above against flash_attention_backward, bit for bit (dq, dk, dv):", loop_identical)
print(f"dQ's shares added in reverse key-block order: bits differ in some entries: "
      f"{reversed_differs > 0}; largest difference {below(reversed_rel, ROUNDING)} (relative)")

# %% [markdown]
# `flash_attention_backward` adds in key-block order however many worker threads run; the cell
# checks this with 1, 2 and 4 (`flash_lib.threads(n)`) on a problem large enough for threads
# ($2^{20}$ scores and more), and counts the threads that called the tile function
# (`flash_bench.threads_seen`): equal bits from workers that never ran would prove nothing.

# %%
q, k, v, dout = (rng.standard_normal((1100, c)) for c in (16, 16, 16, 16))
out, lse = flash_lib.flash_attention(q, k, v, causal=True, return_lse=True)
by_workers, ran_on = {}, {}
for workers in (1, 2, 4):
    with flash_lib.threads(workers), threads_seen("attention_backward_tile") as seen:
        by_workers[workers] = flash_lib.flash_attention_backward(q, k, v, out, lse, dout,
                                                                 causal=True, block_q=128,
                                                                 block_k=96)
    ran_on[workers] = len(seen)
threads_identical = all(np.array_equal(a, b) for w in (2, 4)
                        for a, b in zip(by_workers[1], by_workers[w]))
print("threads that computed tiles with 1, 2, 4 workers:", ran_on)
print("dq, dk, dv bit-identical on 1, 2 and 4 workers:", threads_identical)

# %% [markdown]
# ## The empty row
#
# A row with no allowed key has, in the forward, $l = 0$, output 0,
# $\text{lse} = \log 0 = -\infty$ (chapter 6) and all its scores $-\infty$. Recomputing its
# weights gives
#
# $$P_{ij} = e^{S_{ij} - \text{lse}_i} = e^{-\infty - (-\infty)} = e^{\text{NaN}} = \text{NaN},$$
#
# and the NaN spreads through $dV_j \mathrel{+}= P_{ij}^\top dO_i$ into every key's $dv$ (and
# would through $dS_{ij}$ into $dQ_i$ and $dK_j$, but `attention_backward_tile` zeroes $dS$ at
# masked pairs; pytorch/pytorch#41508 reports such NaN gradients). `flash_attention_backward`'s
# guard turns an lse of $-\infty$ into $+\infty$ before the tile loop; then
# $e^{S_{ij} - \infty} = 0$ for every score the row could hold, so its weights, $dS$ and
# $dq$ row are exactly 0 and it adds nothing to $dk$, $dv$. The lse other libraries store for an
# empty row, and how their backwards cope: {doc}`chapter 25 <25_other_libraries>`.
#
# The cell shows the NaN; then, on a masked problem whose row 3 is empty, it runs the tile
# function with the raw and the guarded lse, and `flash_attention_backward` with floating-point
# warnings as errors.

# %%
with np.errstate(invalid="ignore"):  # the NaN is the point here
    print("exp(-inf - (-inf)) =", np.exp(np.float64(-np.inf) - np.float64(-np.inf)),
          "; exp(-inf - (+inf)) =", np.exp(np.float64(-np.inf) - np.float64(np.inf)))

n_q, n_k, d, dv = 8, 12, 8, 4
q, k, v, dout = (rng.standard_normal(shape) for shape in
                 ((n_q, d), (n_k, d), (n_k, dv), (n_q, dv)))
mask = rng.random((n_q, n_k)) < 0.6
mask[0] = True  # so that every key is seen by some row
mask[3] = False  # row 3 may attend to no key
out, lse = flash_lib.flash_attention(q, k, v, mask=mask, return_lse=True)
D = (dout * out).sum(axis=-1)
empty_forward = (out[3].copy(), lse[3])
print("forward, row 3: out", out[3], "lse", lse[3])

tile_nan = {}
for name, lse_used in (("raw lse (-inf)", lse),
                       ("guarded lse (+inf)", np.where(lse == -np.inf, np.inf, lse))):
    dk_t, dv_t = np.zeros_like(k), np.zeros_like(v)
    with np.errstate(invalid="ignore"):
        dq_t = flash_lib.attention_backward_tile(q / np.sqrt(d), k, v, dout, lse_used, D,
                                                 dk_t, dv_t, allowed=mask)
    tile_nan[name] = [int(np.isnan(g).sum()) for g in (dq_t, dk_t, dv_t)]
    tile_sizes = [dq_t.size, dk_t.size, dv_t.size]
    print(f"one tile, {name}: NaN entries in (dq, dk, dv): {tuple(tile_nan[name])} "
          f"of {tuple(tile_sizes)}")

with warnings.catch_warnings(), np.errstate(all="raise"):
    warnings.simplefilter("error")  # any floating-point warning would now be an error
    dq_e, dk_e, dv_e = flash_lib.flash_attention_backward(q, k, v, out, lse, dout, mask=mask,
                                                          block_q=4, block_k=4)
quiet = dout.copy()
quiet[3] = 0  # the empty row's incoming gradient silenced
_, dk_q, dv_q = flash_lib.flash_attention_backward(q, k, v, out, lse, quiet, mask=mask,
                                                   block_q=4, block_k=4)
empty_row_zero = bool(np.all(dq_e[3] == 0))
empty_row_adds_nothing = bool(np.array_equal(dk_e, dk_q) and np.array_equal(dv_e, dv_q))
print("flash_attention_backward: dq row 3 exactly 0:", empty_row_zero,
      "; dk, dv the same with row 3's dout set to 0:", empty_row_adds_nothing)


# %% [markdown]
# ## What we showed
#
# The output alone gives $dS = P \circ (dP - D)$, $D = \operatorname{rowsum}(dO \circ O)$, and
# $P_{ij} = e^{S_{ij} - \text{lse}_i}$ rebuilds the softmax in one exp per score; the dense
# formulas agree with naive and flash below $10^{-14}$. A key-blocks-outside loop around
# `attention_backward_tile` is `flash_attention_backward` bit for bit, and adding $dQ$'s shares in
# key-block order keeps threads from changing the bits. The $+\infty$ lse guard makes an empty
# row's gradient exactly 0, with no warning.

# %%
# one row: D from O equals D from P; P ∘ (dP - D) equals the explicit Jacobian's product
# (ROUNDING = 1e-14, 45 eps: every difference "to rounding" below was at most 1e-15 at every
# NPY_DISABLE_CPU_FEATURES level and with OpenBLAS's Haswell and Sandybridge kernels; the
# appendix, chapter 28, draws them)
assert abs(D_from_p - D_from_o) <= ROUNDING * abs(D_from_o)
assert jacobian_diff < ROUNDING
# the dense formulas, naive and flash agree to rounding; dV is naive's own product of the same P
assert all(a < ROUNDING and b < ROUNDING for a, b in matrix_diffs.values()), matrix_diffs
assert matrix_diffs["dv"][0] == 0
# P from the lse: the textbook softmax to rounding, normalised, no positive exponent
assert err_p < ROUNDING and np.abs(row_sums - 1).max() < ROUNDING
assert largest_exponent <= 0
# the tile loop: the real tile function in a key-blocks-outside loop is flash, bit for bit;
# another order of dQ's shares changes bits; 1, 2 and 4 worker threads, each seen to compute
# tiles, do not
assert sorted(computed) == sorted(schedule)  # the forward's tiles, each once
assert visited_rows == [(4, 8), (8, 12), (12, 16)]
assert all(loop_identical), loop_identical
assert reversed_differs > 0 and reversed_rel < ROUNDING
assert ran_on == {1: 1, 2: 2, 4: 4} and threads_identical, ran_on
# the empty row: NaN without the guard, exactly 0 with it, nothing added to dk, dv, no warning
assert tile_nan["raw lse (-inf)"][2] == tile_sizes[2] and tile_nan["guarded lse (+inf)"] == [0, 0, 0]
assert empty_forward[1] == -np.inf and np.all(empty_forward[0] == 0)
assert empty_row_zero and empty_row_adds_nothing
assert np.isfinite(dq_e).all() and np.isfinite(dk_e).all() and np.isfinite(dv_e).all()

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
# FlashAttention exists for training, and training needs gradients. The backward pass is half
# of the algorithm, and it is where the memory saving matters most: the textbook backward needs
# the softmax matrix $P$, $N_q \times N_k$ numbers per head per layer, kept from the forward
# pass until the backward pass uses it. FlashAttention keeps only the output $O$ and one number
# per row, the lse, and recomputes $P$ tile by tile. In this chapter:
#
# - for one row we derive the softmax's Jacobian-vector product
#   $dS_j = P_j\,(dP_j - \sum_k P_k\, dP_k)$ and show that $\sum_k P_k\, dP_k = dO \cdot O$: the
#   backward's $D$ needs only the output, never $P$; then $dV$, $dQ$, $dK$, with the scale;
# - why the forward saves the lse: $P_{ij} = e^{S_{ij} - \text{lse}_i}$ in one exp, with no max
#   and no sum, and a tile can do it without seeing the rest of its row;
# - what training keeps for the backward, $P$ against $O$ and lse, and what each backward holds
#   while it runs, measured against $N$;
# - FlashAttention-2's tile loop, from `flash_lib` itself: key blocks outside, $dK_j$ and $dV_j$
#   resident, $dQ$'s shares added in key-block order so that the bits do not depend on threads;
# - the empty row: $e^{-\infty - (-\infty)}$ is NaN, and the guard (FlashAttention 2's $+\infty$
#   lse) that makes its gradient exactly 0;
# - the gradient checked by finite differences: the error against the step $\varepsilon$ is a V
#   whose sides have the slopes the theory predicts, and the analytic gradient sits at its bottom;
# - a small training loop that learns, through `flash_attention_backward`, which key each query
#   should retrieve, its gradients checked against the dense ones at every step.

# %%
import inspect
import math
import os
import warnings

# One worker thread, as in chapter 8: T workers hold T tiles at once, and the memory measured
# below would depend on the machine's cores. Set before the import, which reads it.
os.environ["FLASH_LIB_THREADS"] = "1"

import matplotlib.pyplot as plt
import numpy as np
from threadpoolctl import threadpool_limits

import flash_lib
from flash_lib import rowwise_relative_error

assert flash_lib.thread_count() == 1, "flash_lib was imported before FLASH_LIB_THREADS was set: restart"
rng = np.random.default_rng(12)


def below(x, limit):
    """A rounding-level difference, printed so that no CPU changes the text: 0 when the two
    sides are equal bit for bit, else the stated limit it is under (each limit below was
    checked at every NPY_DISABLE_CPU_FEATURES level, CONTRIBUTING.md, with a margin of at
    least 5x), else, for a real error, the number itself."""
    if x == 0:
        return "0 (bit for bit)"
    return f"below {limit:.0e}" if x < limit else f"{x:.1e}, above {limit:.0e}"


# The limit for float64 agreements "to rounding" in this chapter: 1e-14 is 45 machine epsilons;
# the differences measured below are at most 1e-15 on every CPU tried, and any real error (a
# kernel off by one part in a million) is far above it.
ROUNDING = 1e-14

# %% [markdown]
# ## What the backward pass computes
#
# The forward pass of one head computes, with the scale $\tau$ ($1/\sqrt d$ by default),
#
# $$S = \tau\, Q K^\top, \qquad P = \operatorname{softmax}(S) \text{ row by row}, \qquad O = P V .$$
#
# Training computes a scalar loss $L$ from $O$ (through the rest of the network) and needs its
# gradients with respect to $Q$, $K$ and $V$. Backpropagation hands the attention layer
# $dO = \partial L / \partial O$, a matrix of the shape of $O$, and asks for $dQ$, $dK$, $dV$.
# Throughout, $dX$ means $\partial L / \partial X$, an array of the shape of $X$. The loss
# reaches $Q$, $K$, $V$ only through $O$, so these are also the gradients of the scalar
# $\sum (dO \circ O)$ with $dO$ held fixed: what `flash_attention_backward(q, k, v, out, lse,
# dout)` returns for `dout` $= dO$.
#
# ## One row: the softmax's Jacobian-vector product
#
# Take one query row: scores $s_j = \tau\, q \cdot k_j$, weights $P_j = e^{s_j} / \sum_k e^{s_k}$,
# output $o = \sum_j P_j v_j$, and its incoming gradient $dO$ (a $d_v$-vector). Three steps.
#
# 1. $o$ is linear in each weight, so $dP_j = \partial L / \partial P_j = dO \cdot v_j$.
# 2. The softmax's Jacobian: by the quotient rule,
#    $\partial P_j / \partial s_k = P_j\,(\delta_{jk} - P_k)$, the matrix
#    $J = \operatorname{diag}(P) - P P^\top$. The chain rule gives
#    $dS_k = \sum_j dP_j\, \partial P_j / \partial s_k$, so
#
#    $$dS_k = P_k\, dP_k - P_k \sum_j P_j\, dP_j = P_k \Big(dP_k - \sum_j P_j\, dP_j\Big) .$$
#
# 3. The sum in the bracket is one number per row, and it needs no $P$:
#
#    $$\sum_j P_j\, dP_j = \sum_j P_j\, (dO \cdot v_j) = dO \cdot \Big(\sum_j P_j v_j\Big) = dO \cdot o \;=:\; D .$$
#
# So $dS_j = P_j\,(dP_j - D)$ with $D = dO \cdot o$, the FlashAttention-2 paper's $D_i$
# (arXiv 2307.08691, Algorithm 2): computed once per row from the output the forward returned.
# That is what lets a tile of the backward compute its $dS$ without the rest of its row.
#
# The cell takes one query and 10 keys, builds the Jacobian $J$ as a matrix, and compares
# $J\, dP$ ($J$ is symmetric, so $J^\top dP = J\, dP$) with $P \circ (dP - D)$ for $D$ computed
# both ways.

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
# The rest is the chain rule through two matrix products. $O = PV$ gives $dV = P^\top dO$ and
# $dP = dO\, V^\top$; $S = \tau\, Q K^\top$ gives $dQ = \tau\, dS\, K$ and
# $dK = \tau\, dS^\top Q$. For all rows at once, with $D = \operatorname{rowsum}(dO \circ O)$ a
# vector of $N_q$ numbers:
#
# $$
# \begin{aligned}
# dV &= P^\top dO, & dP &= dO\, V^\top, & D &= \operatorname{rowsum}(dO \circ O), \\
# dS &= P \circ (dP - D\, \mathbf 1^\top), & dQ &= \tau\, dS\, K, & dK &= \tau\, dS^\top Q .
# \end{aligned}
# $$
#
# **The scale.** `flash_lib` applies $\tau = r \cdot 2^e$ ($0.5 \le r < 1$) to the inputs, not to
# the scores: $S = (\tau_q Q)(\tau_k K)^\top$ with $\tau_q = r \cdot 2^a$, $\tau_k = 2^b$,
# $a + b = e$, $b = \operatorname{trunc}(e/2)$ (chapter 5 and `flash_lib`'s docstring say why).
# The gradients follow the same placement, each side getting its own factor:
#
# $$dQ = \tau_q \cdot \big(dS\, (\tau_k K)\big), \qquad dK = \tau_k \cdot \big(dS^\top (\tau_q Q)\big),$$
#
# equal to $\tau\, dS\, K$ and $\tau\, dS^\top Q$ up to rounding (exactly, when $\tau$ is a power
# of two). The cell computes the six formulas above densely, for two heads with $N_q = 37$,
# $N_k = 53$, $d = 64$ ($\tau = 1/8$: $\tau_q = 1/4$, $\tau_k = 1/2$) and a causal mask, and
# compares them with `naive_attention_backward` (which builds the softmax Jacobian's product
# from $P$ as $\operatorname{rowsum}(P \circ dP)$, not from $O$) and `flash_attention_backward`.
# Gradients are compared relative to their largest entry.

# %%
def split_scale(tau):
    """τ = r·2^e → (τ_q, τ_k) = (r·2^a, 2^b), b = trunc(e/2), a = e - b: flash_lib's placement."""
    r, e = math.frexp(tau)
    b = int(e / 2)
    return math.ldexp(r, e - b), math.ldexp(1.0, b)


def rel_diff(x, ref):
    return float(np.abs(x - ref).max() / np.abs(ref).max())


n_q, n_k, d, dv = 37, 53, 64, 16
q = rng.standard_normal((2, n_q, d))
k = rng.standard_normal((2, n_k, d))
v = rng.standard_normal((2, n_k, dv))
dout = rng.standard_normal((2, n_q, dv))
causal = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + (n_k - n_q)  # bottom-right
tau = 1 / np.sqrt(d)
tau_q, tau_k = split_scale(tau)

S = (tau_q * q) @ np.swapaxes(tau_k * k, -1, -2)
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
# dQ = τ_q (dS (τ_k K)),  dK = τ_k (dSᵀ (τ_q Q))
dQ = tau_q * (dS @ (tau_k * k))
dK = tau_k * (np.swapaxes(dS, -1, -2) @ (tau_q * q))

naive = flash_lib.naive_attention_backward(q, k, v, dout, causal=True)
out, lse = flash_lib.flash_attention(q, k, v, causal=True, return_lse=True, block_q=16, block_k=16)
flash = flash_lib.flash_attention_backward(q, k, v, out, lse, dout, causal=True, block_q=16,
                                           block_k=16)
print(f"tau = {tau} = tau_q · tau_k = {tau_q} · {tau_k}")
print("      the formulas vs naive   vs flash")
matrix_diffs = {}
for name, mine, n, f in zip(("dq", "dk", "dv"), (dQ, dK, dV), naive, flash):
    matrix_diffs[name] = (rel_diff(mine, n), rel_diff(mine, f))
    print(f"{name}:   {below(matrix_diffs[name][0], ROUNDING):>22}   "
          f"{below(matrix_diffs[name][1], ROUNDING)}")

# %% [markdown]
# Differences below $10^{-14}$, a few tens of machine epsilons at most, are rounding: the three
# computations agree. $dV = P^\top dO$ is the same product of the same $P$ in `naive_attention_backward`,
# so there it agrees bit for bit. Notice what the
# formulas needed from the forward pass: $P$ (for $dV$ and $dS$) and $O$ (for $D$). The next
# section removes the need to keep $P$.
#
# ## Why the forward saves the lse
#
# The forward pass of chapter 5 ends each row with $m$ (its largest score) and $l$
# ($\sum_j e^{S_{ij} - m}$) and stores $\text{lse}_i = m + \log l$, the log of the softmax's
# denominator. That one number is all the backward needs to rebuild any weight of the row:
#
# $$P_{ij} = \frac{e^{S_{ij} - m_i}}{l_i} = e^{S_{ij} - m_i - \log l_i} = e^{S_{ij} - \text{lse}_i} .$$
#
# One exp per score; no max, no sum, no division. This matters for the tile loop below: the
# backward visits tile $(i, j)$ without the rest of row block $i$ (other key blocks are other
# workers' business), so a tile could neither find its rows' max nor their sum. With
# $\text{lse}_i$ from the forward it needs neither, and $P_{ij}$ is already normalised:
# $\sum_j e^{S_{ij} - \text{lse}_i} = 1$. No exponent is positive, since $S_{ij} \le m_i \le
# \text{lse}_i$, so nothing overflows either. (FlashAttention stores the same natural-log lse,
# `softmax_lse`, in float32.)
#
# The cell rebuilds $P$ from `flash_attention`'s lse and the scores, with one exp, and compares
# it with the textbook $P$ above (a max-subtracted softmax: a max, an exp, a sum and a division).
# The figure then shows the differences measured in this and the two cells before, in machine
# epsilons: the text above prints only the limit each is under, because their last digits are
# the CPU's (another machine's loops round differently).

# %%
# P_ij = exp(S_ij - lse_i)
P_from_lse = np.exp(S - lse[..., None])

err_p = rowwise_relative_error(P_from_lse, P).max()
row_sums = P_from_lse.sum(axis=-1)
largest_exponent = (S - lse[..., None]).max()
print(f"exp(S - lse) against the textbook softmax: largest row error {below(err_p, ROUNDING)}")
print(f"its rows' sums minus 1: {below(np.abs(row_sums - 1).max(), ROUNDING)}; largest exponent "
      f"{largest_exponent:.2f}")

eps64 = np.finfo(np.float64).eps
measured = {"one row: P ∘ (dP - D) vs J dP": jacobian_diff}
for name, (vs_naive, vs_flash) in matrix_diffs.items():
    measured[f"{name}: the formulas vs naive"] = vs_naive
    measured[f"{name}: the formulas vs flash"] = vs_flash
measured["exp(S - lse) vs the textbook P"] = err_p
measured["rows of exp(S - lse): sum - 1"] = np.abs(row_sums - 1).max()
fig, ax = plt.subplots(figsize=(8, 3.8))
rows = np.arange(len(measured))[::-1]
values = np.array(list(measured.values())) / eps64
ax.barh(rows, np.where(values > 0, values, np.nan), color="C0", height=0.6)
for row, value in zip(rows, values):
    ax.text(value * 1.1 if value > 0 else 0.06, row, f"{value:.1f} eps" if value > 0 else
            "0: bit for bit", va="center", fontsize=8)
ax.axvline(ROUNDING / eps64, color="C3", ls="--", label=f"the limit asserted, {ROUNDING:.0e}")
ax.set_xscale("log")
ax.set_xlim(0.05, 200)
ax.set_yticks(rows, list(measured), fontsize=8)
ax.set_xlabel("largest relative difference (machine epsilons, 2.2e-16), measured on this machine")
ax.set_title("Rounding-level differences of the three cells above")
ax.legend(fontsize=8, loc="lower right")
ax.grid(True, axis="x", which="major", alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What training keeps for the backward
#
# Between the forward and the backward pass, every layer keeps what its backward will need:
# the textbook attention keeps $P$, $N_q N_k$ numbers per head per layer, because $dV = P^\top dO$
# and $dS = P \circ (dP - D)$ use it; FlashAttention keeps $O$ (which the layer after
# attention usually keeps anyway, as its input) and the lse, $N_q$ numbers. During the backward pass
# itself, `naive_attention_backward` holds $P$, $dP$ and $dS$ whole, while
# `flash_attention_backward` holds one tile of each, plus $D$ and the lse (with the empty-row
# guard below applied), $N_q$ numbers each.
#
# The cell measures both, in float32 with $d = d_v = 16$, $N = N_q = N_k$:
#
# - kept: the bytes of the arrays each forward returns for its backward, `(O, P)` from a textbook
#   forward and `(O, lse)` from `flash_attention(..., return_lse=True)`;
# - held during the backward: `flash_lib.measure_peak_bytes` (tracemalloc, chapter 8) around each
#   backward call, minus the gradients it returns. Flash runs with 256 × 256 tiles on one worker
#   and BLAS on one thread (chapter 8 says why); the naive kernel stops at $N = 4096$ (its
#   $P$, $dP$, $dS$ then weigh 64 MiB each).

# %%
d = dv = 16
dtype = np.float32
block = 256


def problem(n):
    return [rng.standard_normal((n, c), dtype=dtype) for c in (d, d, dv, dv)]


def textbook_forward(q, k, v):
    """The forward a textbook backward needs: O and the whole P."""
    s = (q @ k.T) * dtype(1 / np.sqrt(d))
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return p @ v, p


def naive_backward_bytes(n):
    q, k, v, do = problem(n)
    kept = sum(x.nbytes for x in textbook_forward(q, k, v))
    grads, peak = flash_lib.measure_peak_bytes(flash_lib.naive_attention_backward, q, k, v, do)
    return kept, peak - sum(g.nbytes for g in grads)


def flash_backward_bytes(n):
    q, k, v, do = problem(n)
    out, lse = flash_lib.flash_attention(q, k, v, return_lse=True, block_q=block, block_k=block)
    grads, peak = flash_lib.measure_peak_bytes(flash_lib.flash_attention_backward, q, k, v, out,
                                               lse, do, block_q=block, block_k=block)
    return out.nbytes + lse.nbytes, peak - sum(g.nbytes for g in grads)


sizes_naive = [256, 512, 1024, 2048, 4096]
sizes_flash = [256, 512, 1024, 2048, 4096, 8192]
with threadpool_limits(limits=1, user_api="blas"):
    flash_backward_bytes(300)  # first-call allocations aside, as in chapter 8
    naive_kept, naive_held = np.array([naive_backward_bytes(n) for n in sizes_naive]).T
    flash_kept, flash_held = np.array([flash_backward_bytes(n) for n in sizes_flash]).T

itemsize = np.dtype(dtype).itemsize
kept_per_row = (dv + 1) * itemsize  # O and lse
slope_naive = np.polyfit(np.log(sizes_naive), np.log(naive_held), 1)[0]
# flash's held memory: one set of tiles, plus D and the guarded lse (2 numbers per row)
tiles_part = flash_held - 2 * itemsize * np.array(sizes_flash)
n_by_n = naive_held[-1] / (sizes_naive[-1] ** 2 * itemsize)
at_4096 = sizes_flash.index(4096)
print(f"kept for the backward at N = 4096: O and P {naive_kept[-1] / 2**20:.0f} MiB, "
      f"O and lse {flash_kept[at_4096] / 2**20:.2f} MiB, "
      f"{naive_kept[-1] / flash_kept[at_4096]:.0f} times less")
print(f"naive backward holds {n_by_n:.1f} N×N float32 arrays at N = 4096; "
      f"grows as N^{slope_naive:.1f}")
print(f"flash backward holds {flash_held[0] / 2**20:.2f} MiB at N = 256, "
      f"{flash_held[-1] / 2**20:.2f} MiB at N = 8192; without D and the lse (8 bytes per row), "
      f"largest / smallest = {tiles_part.max() / tiles_part.min():.2f}")
# the P a textbook backward would keep for one head of one layer, d = 128 and N = 8192, bfloat16
print(f"for scale: P at N = 8192 in bfloat16 is {8192**2 * 2 / 2**20:.0f} MiB per head per layer, "
      f"O and lse (d = 128, lse in float32) {8192 * (128 * 2 + 4) / 2**20:.1f} MiB")

# %%
fig, (ax_kept, ax_held) = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
ax_kept.loglog(sizes_naive, naive_kept, "s-", color="C3", label="textbook: O and P")
ax_kept.loglog(sizes_flash, flash_kept, "o-", color="C0", label="flash: O and lse")
ax_kept.set_title("Kept from the forward for the backward")
ax_kept.set_ylabel("bytes (float32, one head, d = dv = 16)")
ax_held.loglog(sizes_naive, naive_held, "s-", color="C3", label="naive_attention_backward")
ax_held.loglog(sizes_flash, flash_held, "o-", color="C0",
               label=f"flash_attention_backward, {block}×{block} tiles")
ax_held.set_title("Held while the backward runs (measured scratch)")
for ax in (ax_kept, ax_held):
    ax.set_xlabel("sequence length N = Nq = Nk")
    ax.set_xticks(sizes_flash, [str(n) for n in sizes_flash])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# Left: the textbook forward keeps $P$, one number per score, so its line has slope 2; flash keeps
# $O$ and the lse, $N (d_v + 1)$ numbers, a slope of 1. Right: the naive backward holds about
# four $N \times N$ arrays at its peak (the scores, $P$, $dP$, $dS$), a slope of 2; flash holds
# its tiles, flat in $N$, plus $D$ and the lse, 8 bytes per row, the only part that grows.
#
# ## The tile loop
#
# FlashAttention-2's backward (arXiv 2307.08691, Algorithm 2), in this tutorial's symbols, with
# what crosses between HBM and SRAM marked. $D$ is computed first, in a pass of its own.
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
# blocks outside they stay in fast memory for the whole inner loop and are written once, and
# different key blocks never touch the same $dK$, $dV$ rows: they run in parallel with no
# sharing. $dQ_i$ is a sum over key blocks, so every key block adds a share to it. FlashAttention-2
# adds those shares with atomic adds, in whatever order the thread blocks finish; Triton's fused
# attention tutorial (`python/tutorials/06-fused-attention.py`) instead runs a second loop, one
# query block against all key blocks, that recomputes $P$ once more for $dQ$.
#
# One tile's work is `flash_lib.attention_backward_tile`, the tile math and nothing else.
# Here is its source, straight from the module:

# %%
print(inspect.getsource(flash_lib.attention_backward_tile))

# %% [markdown]
# `q` and `k` arrive already scaled ($\tau_q Q_i$, $\tau_k K_j$), so `q @ kᵀ` is the forward's
# $S_{ij}$ bit for bit, and the two factors are applied once per block afterwards: `dk` lacks
# $\tau_k$ until its key block is done, and the returned share lacks $\tau_q$ until all of $dQ$
# is summed. The `matmul` argument and the `np.copyto` lines keep an inf or NaN at a masked
# pair out of the sums (the module docstring's "masked keys never leak" contract, chapter 6).
# `scores` is for the score variants (soft-capping, ALiBi: `flash_lib`'s docstring); without
# them $S_{ij}$ is `q @ kᵀ` and softcap's extra factor `slope` is None.
#
# Around it, `flash_attention_backward` runs key blocks on workers. Each worker keeps its
# $dK_j$, $dV_j$ and walks the query blocks in order; the shares of $dQ_i$ are added in
# key-block order, each worker waiting for its turn on $dQ_i$. Floating-point addition is not
# associative, so atomic adds in finishing order would make $dQ$'s last bits depend on timing;
# in key-block order they do not depend on how many threads ran or which finished first.
# FlashAttention's deterministic mode does the same on a GPU: in FlashAttention 3's
# `hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp` (`store_dq`, commit `0105a8f`), key block
# `n_block` waits on a per-query-block semaphore until it reads `n_block`
# (`Barrier::wait_eq`), adds its share, then increments it (`Barrier::arrive_inc`).
#
# The picture shows one worker's traffic, for key block $j = 1$ of a causal problem with
# $N = 16$ and 4 × 4 tiles: what it reads, what it writes, and the tiles it computes. Which
# tiles those are is taken from the kernel itself: the cell runs `flash_attention_backward`
# with its tile function wrapped in one that records each tile it is given (identified by the
# first row of its `dout` and `v`, which the kernel passes unscaled), and compares the record
# with the forward's `tile_schedule`.

# %%
n_draw, b_draw, j_draw = 16, 4, 1
q, k, v, dout = (rng.standard_normal((n_draw, 8)) for _ in range(4))
out, lse = flash_lib.flash_attention(q, k, v, causal=True, return_lse=True)
computed = []
tile_function = flash_lib.attention_backward_tile


def recording_tile(q_t, k_t, v_t, dout_t, *rest, **kwargs):
    first_row = lambda x, rows: int(np.flatnonzero((rows == x[0]).all(axis=-1))[0])
    q0, k0 = first_row(dout_t, dout), first_row(v_t, v)
    computed.append((q0, q0 + len(dout_t), k0, k0 + len(v_t)))
    return tile_function(q_t, k_t, v_t, dout_t, *rest, **kwargs)


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
print("query blocks key block 1 visits:", visited_rows)

# %% [markdown]
# The query block above the diagonal is skipped: no row of it may see key block 1. The backward
# computes exactly the forward's tiles, each once. With no mask, that loop is short enough to write out around the
# real tile function. The cell does so, single-threaded (BLAS on one thread too, as
# `flash_lib` holds it: a matmul split over more threads rounds differently), with $D$ from
# $O$ per query block, the shares of each $dQ_i$ added in key-block order, and the two scale
# factors applied last, and compares it bit for bit with `flash_attention_backward`. Then it
# adds the same shares in the reverse order, to see whether the order matters to the bits.

# %%
def backward_loop(q, k, v, out, lse, dout, block_q, block_k, D=None, reverse_dq=False):
    """flash_attention_backward's loop for one head, no mask, one worker: key blocks outside."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    tau_q, tau_k = split_scale(1 / np.sqrt(q.shape[-1]))
    if D is None:  # D_i = rowsum(dO_i ∘ O_i), once per row
        D = np.concatenate([np.einsum("...c,...c->...", dout[i:i + block_q], out[i:i + block_q])
                            for i in range(0, n_q, block_q)])
    lse = np.where(lse == -np.inf, np.inf, lse)  # the empty-row guard (below)
    shares = {}
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for j in range(0, n_k, block_k):  # key blocks outside: dK_j, dV_j resident
        dk_j, dv_j = np.zeros_like(k[j:j + block_k]), np.zeros_like(v[j:j + block_k])
        for i in range(0, n_q, block_q):  # query blocks inside
            rows = slice(i, i + block_q)
            shares[i, j] = flash_lib.attention_backward_tile(
                tau_q * q[rows], tau_k * k[j:j + block_k], v[j:j + block_k], dout[rows],
                lse[rows], D[rows], dk_j, dv_j)
        dk[j:j + block_k], dv[j:j + block_k] = tau_k * dk_j, dv_j
    dq = np.zeros_like(q)
    for (i, j) in sorted(shares, key=lambda ij: (ij[1] if not reverse_dq else -ij[1])):
        dq[i:i + block_q] += shares[i, j]  # dQ_i's shares in key-block order (or reversed)
    return tau_q * dq, dk, dv


q, k, v, dout = (rng.standard_normal((300, c)) for c in (64, 64, 32, 32))
out, lse = flash_lib.flash_attention(q, k, v, return_lse=True, block_q=64, block_k=48)
flash = flash_lib.flash_attention_backward(q, k, v, out, lse, dout, block_q=64, block_k=48)
with threadpool_limits(limits=1, user_api="blas"):
    mine = backward_loop(q, k, v, out, lse, dout, 64, 48)
    reversed_dq = backward_loop(q, k, v, out, lse, dout, 64, 48, reverse_dq=True)[0]
loop_identical = [np.array_equal(a, b) for a, b in zip(mine, flash)]
reversed_differs = int((reversed_dq != flash[0]).sum())
reversed_rel = rel_diff(reversed_dq, flash[0])
print("the loop above against flash_attention_backward, bit for bit (dq, dk, dv):", loop_identical)
print(f"dQ's shares added in reverse key-block order: bits differ in some entries: "
      f"{reversed_differs > 0}; largest difference {below(reversed_rel, ROUNDING)} (relative)")

# %% [markdown]
# Reordering changes nothing but the last bits, but it does change them: a sum in finishing
# order would differ from run to run. `flash_attention_backward` adds in key-block order
# whatever the number of worker threads. The cell checks that with 1, 2 and 4 workers on a
# problem large enough for threads to be used (`flash_lib` uses them from $2^{20}$ scores on);
# it sets the count with `flash_lib.threads(n)`, which holds for the calls made inside it.

# %%
q, k, v, dout = (rng.standard_normal((1100, c)) for c in (16, 16, 16, 16))
out, lse = flash_lib.flash_attention(q, k, v, causal=True, return_lse=True)
by_workers = {}
for workers in (1, 2, 4):
    with flash_lib.threads(workers):
        by_workers[workers] = flash_lib.flash_attention_backward(q, k, v, out, lse, dout,
                                                                 causal=True, block_q=128,
                                                                 block_k=96)
threads_identical = all(np.array_equal(a, b) for w in (2, 4)
                        for a, b in zip(by_workers[1], by_workers[w]))
print("dq, dk, dv bit-identical on 1, 2 and 4 workers:", threads_identical)

# %% [markdown]
# ## The empty row
#
# A query row with no allowed key (a fully masked row: padding, or a mask that excludes
# everything) has, in the forward, $l = 0$, output 0 and $\text{lse} = \log 0 = -\infty$
# (chapter 6). Its scores are all $-\infty$ too. Recomputing its weights then asks for
#
# $$P_{ij} = e^{S_{ij} - \text{lse}_i} = e^{-\infty - (-\infty)} = e^{\text{NaN}} = \text{NaN},$$
#
# and the NaN spreads through $dV_j \mathrel{+}= P_{ij}^\top dO_i$ into every key's $dv$, and
# through $dS_{ij} = P_{ij} \circ (dP_{ij} - D_i)$ into $dQ_i$ and every $dK_j$ (unless, as
# `attention_backward_tile` does for masked garbage, $dS$ is zeroed at masked pairs: then it is
# $dv$ that shows it). NaN gradients from fully masked rows are a long-standing bug report
# against textbook attention (pytorch/pytorch#41508, `nn.MultiheadAttention`, open since 2020). The guard in `flash_attention_backward`: replace an lse of $-\infty$ by $+\infty$ before
# the tile loop. Then $e^{S_{ij} - \infty} = 0$ for every score the row could hold, finite or
# $-\infty$: the row's weights are exactly 0, its $dS$ is 0, its $dq$ row is exactly 0, and it
# adds nothing to $dk$, $dv$. $+\infty$ is exactly what FlashAttention 2 stores as such a row's
# lse (`normalize_softmax_lse` in `csrc/flash_attn/src/softmax.h`: `Split ? -INFINITY :
# INFINITY`, $-\infty$ only for split-KV partials), so its backward needs no guard. FlashAttention
# 3 stores $-\infty$ (`finalize` in `hopper/softmax.h`, commit `2291ed1`) and maps it to 0 before
# its backward (`lse == -INFINITY ? 0.f : lse * float(M_LOG2E)` in
# `hopper/flash_bwd_preprocess_kernel.h`, commit `13a724d`): any finite value works there too,
# because every score of an empty row is $-\infty$.
#
# The cell shows the NaN (NumPy's "invalid value" warning silenced for these lines), then runs
# the real tile function on one tile covering a masked problem whose row 3 is empty, with the raw
# lse and with the guarded one, then `flash_attention_backward` on the same problem with every
# floating-point warning turned into an error.

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
tau_q, tau_k = split_scale(1 / np.sqrt(d))
empty_forward = (out[3].copy(), lse[3])
print("forward, row 3: out", out[3], "lse", lse[3])

tile_nan = {}
for name, lse_used in (("raw lse (-inf)", lse),
                       ("guarded lse (+inf)", np.where(lse == -np.inf, np.inf, lse))):
    dk_t, dv_t = np.zeros_like(k), np.zeros_like(v)
    with np.errstate(invalid="ignore"):
        dq_t = flash_lib.attention_backward_tile(tau_q * q, tau_k * k, v, dout, lse_used, D,
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
# ## Checking the gradient by finite differences
#
# All the checks so far compare one derivation with another. Finite differences check the
# gradient against the forward pass alone. Along a random direction $(\delta_q, \delta_k,
# \delta_v)$, let $f(\varepsilon) = \sum dO \circ \text{flash\_attention}(Q + \varepsilon
# \delta_q, K + \varepsilon \delta_k, V + \varepsilon \delta_v)$. Its derivative at 0 is the
# directional derivative
#
# $$f'(0) = \langle dQ, \delta_q \rangle + \langle dK, \delta_k \rangle + \langle dV, \delta_v \rangle$$
#
# with the analytic gradients, and the central difference
# $\big(f(\varepsilon) - f(-\varepsilon)\big) / 2\varepsilon$ estimates it with two errors:
#
# - **truncation**: Taylor's theorem gives $f'(0) + \varepsilon^2 f'''(0)/6 + O(\varepsilon^4)$,
#   an error $\propto \varepsilon^2$, a slope of 2 on log-log axes;
# - **rounding**: each $f(\pm\varepsilon)$ is computed with an error of a few $u\,|f|$ ($u =
#   2^{-53}$ in float64), and dividing by $2\varepsilon$ makes that $\propto u / \varepsilon$, a
#   slope of $-1$.
#
# With an error $A\varepsilon^2 + B/\varepsilon$, the sum is least at $\varepsilon^* =
# (B/2A)^{1/3}$; with $A$ of order 1 and $B$ of order $u$ that is near $u^{1/3} \approx 5
# \times 10^{-6}$, where the error is of order $u^{2/3} \approx 2 \times 10^{-11}$: the
# bottom of a V. A correct analytic gradient sits at that bottom; a wrong one flattens the V
# at its own error, whatever $\varepsilon$ is. To show that, the cell also runs the tile function
# on one tile covering the whole problem (the causal mask passed as `allowed`), once with the true
# $D$, which must give flash's gradients, and once with $D = 0$, the bug of forgetting $D$. The error is relative to $|f'(0)|$ and
# averaged (root mean square) over 8 random directions; the problem is causal, $N_q = 13$,
# $N_k = 17$, $d = 6$, $d_v = 4$, with 4 × 5 tiles.

# %%
n_q, n_k, d, dv = 13, 17, 6, 4
q, k, v, dout = (rng.standard_normal(shape) for shape in
                 ((n_q, d), (n_k, d), (n_k, dv), (n_q, dv)))
kw = dict(causal=True, block_q=4, block_k=5)
out, lse = flash_lib.flash_attention(q, k, v, return_lse=True, **kw)
grads = flash_lib.flash_attention_backward(q, k, v, out, lse, dout, **kw)
tau_q, tau_k = split_scale(1 / np.sqrt(d))
causal_mask = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + (n_k - n_q)


def one_tile_gradients(D):
    """The whole problem as one tile of attention_backward_tile, causal as `allowed`."""
    dk_t, dv_t = np.zeros_like(k), np.zeros_like(v)
    dq_t = flash_lib.attention_backward_tile(tau_q * q, tau_k * k, v, dout, lse, D, dk_t, dv_t,
                                             allowed=causal_mask)
    return tau_q * dq_t, tau_k * dk_t, dv_t


one_tile_vs_flash = max(rel_diff(a, b) for a, b in
                        zip(one_tile_gradients((dout * out).sum(axis=-1)), grads))
grads_without_D = one_tile_gradients(np.zeros(n_q))


def f(eps, dirs):
    moved = (x + eps * dx for x, dx in zip((q, k, v), dirs))
    return float((dout * flash_lib.flash_attention(*moved, **kw)).sum())


steps = np.logspace(-13, 0, 53)
errors = {"flash_attention_backward": [], "without D": []}
for _ in range(8):
    dirs = [rng.standard_normal(x.shape) for x in (q, k, v)]
    central = np.array([(f(eps, dirs) - f(-eps, dirs)) / (2 * eps) for eps in steps])
    for name, g in (("flash_attention_backward", grads), ("without D", grads_without_D)):
        analytic = sum(float((gx * dx).sum()) for gx, dx in zip(g, dirs))
        errors[name].append(np.abs(central - analytic) / abs(analytic))
errors = {name: np.sqrt(np.mean(np.square(e), axis=0)) for name, e in errors.items()}
err = errors["flash_attention_backward"]

u = np.finfo(np.float64).eps / 2
left, right = (steps >= 1e-12) & (steps <= 1e-8), (steps >= 1e-4) & (steps <= 1e-2)
slope_left, icpt_left = np.polyfit(np.log10(steps[left]), np.log10(err[left]), 1)
slope_right, icpt_right = np.polyfit(np.log10(steps[right]), np.log10(err[right]), 1)
# err ≈ A ε² + B/ε, with A and B read off each side (slopes taken as exactly 2 and -1):
# least at ε* = (B / 2A)^(1/3), where it is A ε*² + B/ε*
A, B = np.median(err[right] / steps[right] ** 2), np.median(err[left] * steps[left])
eps_star = (B / (2 * A)) ** (1 / 3)
err_star = A * eps_star**2 + B / eps_star
best = int(np.argmin(err))
# The fitted slopes are printed to the nearest integer and the bottom of the V against its
# limits: the measured values move with the CPU's rounding; the figure below shows them.
print(f"one tile with the true D against flash_attention_backward: "
      f"{below(one_tile_vs_flash, ROUNDING)}")
print(f"fitted slopes: {slope_left:.0f} for eps in [1e-12, 1e-8], "
      f"{slope_right:.0f} for eps in [1e-4, 1e-2] (to the nearest integer)")
print(f"smallest error {below(err[best], 1e-9)}, at most twice the two sides' prediction: "
      f"{err[best] < 2 * err_star}; at a step within 3x of theirs: "
      f"{eps_star / 3 < steps[best] < 3 * eps_star}, and within 10x of u^(1/3) = "
      f"{u ** (1 / 3):.0e}: {u ** (1 / 3) / 10 < steps[best] < 10 * u ** (1 / 3)}")
print(f"without D: smallest error {errors['without D'].min():.1f}")

# %%
fig, ax = plt.subplots(figsize=(8, 6))
ax.loglog(steps, err, "o-", ms=4, color="C0", label="flash_attention_backward")
ax.loglog(steps, errors["without D"], "s-", ms=3, color="C3", label="one tile with D = 0 (D forgotten)")
ax.loglog(steps[right], 10 ** icpt_right * steps[right] ** slope_right, "k--", lw=1.5,
          label=f"fit, slope {slope_right:.1f} (truncation, ∝ ε²)")
ax.loglog(steps[left], 10 ** icpt_left * steps[left] ** slope_left, "k:", lw=2,
          label=f"fit, slope {slope_left:.1f} (rounding, ∝ u/ε)")
ax.plot([eps_star], [err_star], "k*", ms=12,
        label=f"minimum predicted by the two fits: {err_star:.1e} at ε = {eps_star:.1e}")
ax.plot([steps[best]], [err[best]], "o", ms=11, mfc="none", mec="C1", mew=1.5,
        label=f"smallest measured: {err[best]:.1e} at ε = {steps[best]:.1e}")
ax.set_title("Central differences against the analytic gradient (float64)")
ax.set_xlabel("step ε (dimensionless; directions have standard-normal entries)")
ax.set_ylabel("relative error of the directional derivative\n(RMS over 8 directions)")
ax.grid(True, which="major", alpha=0.3)
ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Training with it
#
# Last, the backward doing its job: gradient descent through `flash_attention` and
# `flash_attention_backward`, on a task whose answer can be seen. Sixteen queries, sixteen keys,
# and a target permutation $\pi$: query $i$ should retrieve key $\pi(i)$. The values are the
# one-hot vectors $v_j = e_j$, so a row's output *is* its row of attention weights, and the loss
#
# $$L = \tfrac12 \sum_i \lVert o_i - e_{\pi(i)} \rVert^2, \qquad dO = O - V_\pi ,$$
#
# is zero exactly when every query puts all its weight on its target key. We learn $Q$ and $K$
# ($d = 8$, starting small, so that every row starts near uniform) by plain gradient descent
# with step 1.0 for 300 steps, with 4 × 4 tiles. At every step the gradients are also computed by
# `naive_attention_backward` and compared; the largest difference over the run is checked
# against $10^{-13}$.

# %%
n, d = 16, 8
target = rng.permutation(n)
v = np.eye(n)  # v_j = e_j: o_i is row i of P
want = v[target]
q = 0.1 * rng.standard_normal((n, d))
k = 0.1 * rng.standard_normal((n, d))
P_start = flash_lib.flash_attention(q, k, v, block_q=4, block_k=4)

losses, step_diffs, grad_norms = [], [], []
for step in range(300):
    out, lse = flash_lib.flash_attention(q, k, v, return_lse=True, block_q=4, block_k=4)
    # dO = O - V_pi, the gradient of L = ½ ||O - V_pi||²
    dout = out - want
    losses.append(0.5 * float((dout**2).sum()))
    dq, dk, dv = flash_lib.flash_attention_backward(q, k, v, out, lse, dout, block_q=4, block_k=4)
    reference = flash_lib.naive_attention_backward(q, k, v, dout)
    step_diffs.append(max(rel_diff(g, r) for g, r in zip((dq, dk, dv), reference)))
    grad_norms.append(float(np.sqrt((dq**2).sum() + (dk**2).sum())))
    q -= 1.0 * dq
    k -= 1.0 * dk

P_end = flash_lib.flash_attention(q, k, v, block_q=4, block_k=4)
retrieved = P_end.argmax(axis=-1)
print(f"loss {losses[0]:.1f} at the start, {losses[50]:.1f} after 50 steps, "
      f"{losses[-1]:.3f} after 300")
print(f"gradient norm at step 0: {grad_norms[0] / max(grad_norms):.2f} of its largest, "
      f"reached at step {int(np.argmax(grad_norms))}")
print(f"queries whose largest weight is on their target key: {int((retrieved == target).sum())} "
      f"of {n}; smallest such weight {P_end[np.arange(n), target].min():.2f}")
# 1e-13: the largest difference measured over the 300 steps is 2e-14 on every CPU tried.
print(f"flash's gradients against naive's, largest relative difference over all steps: "
      f"{below(max(step_diffs), 1e-13)}")

# %%
# The loss across the top, the two weight maps below it: three panels in one row would be drawn
# at two thirds of their size in the page's column.
fig, axd = plt.subplot_mosaic([["loss", "loss"], ["p0", "p1"]], figsize=(10, 9),
                              height_ratios=[1, 1.2], layout="constrained")
ax_loss, ax_p0, ax_p1 = axd["loss"], axd["p0"], axd["p1"]
ax_loss.semilogy(losses, color="C0")
ax_loss.set_title("Loss during training (flash's gradients against naive's, largest relative "
                  f"difference over the run: {max(step_diffs):.1e}, measured here)", fontsize=10)
ax_loss.set_xlabel("gradient-descent step")
ax_loss.set_ylabel(r"$L = \frac{1}{2}\sum_i \|o_i - e_{\pi(i)}\|^2$ (dimensionless)")
ax_loss.grid(True, which="major", alpha=0.3)
for ax, p, title in ((ax_p0, P_start, "Attention weights P, step 0"),
                     (ax_p1, P_end, "Attention weights P, step 300")):
    image = ax.imshow(p, vmin=0, vmax=1, cmap="viridis")
    ax.plot(target, np.arange(n), "r+", ms=7)
    ax.set_title(f"{title}\n(+: the target key π(i) of query i)", fontsize=10)
    ax.set_xticks(range(0, n, 3))
    ax.set_yticks(range(0, n, 3))
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
fig.colorbar(image, ax=[ax_p0, ax_p1], label="weight $P_{ij}$ (dimensionless)")
plt.show()

# %% [markdown]
# The loss sits on a plateau while every row is near uniform. The gradients are small there:
# with $Q$ and $K$ small, every score is near 0, $dQ = \tau\, dS\, K$ and $dK = \tau\,
# dS^\top Q$ carry a small factor each, and they grow as $Q$ and $K$ do. Once the rows start to
# commit, the loss falls more than a hundredfold, and every query ends with its weight on its
# target key.
#
# ## What we showed
#
# - For one row, the softmax's Jacobian-vector product is $dS_j = P_j(dP_j - D)$ with
#   $D = \sum_k P_k\, dP_k = dO \cdot o$: computed from the output alone, it matches the explicit
#   Jacobian to rounding. With $dV = P^\top dO$, $dP = dO\, V^\top$, $dQ = \tau_q\, dS\, (\tau_k
#   K)$ and $dK = \tau_k\, dS^\top (\tau_q Q)$, the dense formulas agree with
#   `naive_attention_backward` and `flash_attention_backward` to rounding, below $10^{-14}$
#   ($dV$ with naive's bit for bit).
# - $P_{ij} = e^{S_{ij} - \text{lse}_i}$, one exp with no max and no sum, reproduces the textbook
#   softmax to rounding; no exponent is positive.
# - Training keeps $O$ and the lse for flash, $N(d_v + 1)$ numbers, against $P$'s $N^2$ for the
#   textbook backward; measured during the backward, naive holds about four $N \times N$ arrays
#   (slope 2), flash one set of tiles, flat in $N$, plus 8 bytes per row.
# - `attention_backward_tile` is the tile math; a loop of key blocks outside, query blocks inside,
#   around it reproduces `flash_attention_backward` bit for bit. Adding $dQ$'s shares in another
#   order changes the last bits, which is why flash adds them in key-block order; its gradients
#   are bit-identical on 1, 2 and 4 workers.
# - An empty row's raw lse of $-\infty$ makes the tile's weights NaN; the guard ($+\infty$, as
#   FlashAttention 2 stores it) makes its $dq$ row exactly 0, adds nothing to $dk$, $dv$, and
#   raises no floating-point warning.
# - Central differences: the error against $\varepsilon$ is a V with fitted slopes $-1$
#   (rounding) and 2 (truncation), bottoming out near the step the two fitted sides predict
#   (and no higher than twice the minimum they predict), at
#   $\varepsilon \approx u^{1/3}$ and within a few times $u^{2/3}$ times this problem's constants;
#   the analytic gradient agrees there to $10^{-9}$ or better, while a gradient without $D$ never
#   gets below order 1.
# - Gradient descent through `flash_attention_backward` learns the retrieval task, every query
#   on its target key, with gradients equal to the dense oracle's to below $10^{-13}$ at every
#   step.

# %%
# one row: D from O equals D from P; P ∘ (dP - D) equals the explicit Jacobian's product
# (ROUNDING = 1e-14, 45 eps: every difference "to rounding" below was at most 1e-15 at every
# NPY_DISABLE_CPU_FEATURES level and with OpenBLAS's Haswell and Sandybridge kernels)
assert abs(D_from_p - D_from_o) <= ROUNDING * abs(D_from_o)
assert jacobian_diff < ROUNDING
# the dense formulas, naive and flash agree to rounding; dV is naive's own product of the same P
# split_scale above is flash_lib's rule: flash with scale τ computes exactly what it computes on
# τ_q·q and τ_k·k with scale 1, which it splits as (1, 1)
q_s, k_s, v_s = np.random.default_rng(12).standard_normal((3, 40, 48))
for t in (0.125, 1 / np.sqrt(48), 0.05, 3.0):
    t_q, t_k = split_scale(t)
    assert np.array_equal(flash_lib.flash_attention(q_s, k_s, v_s, scale=t),
                          flash_lib.flash_attention(q_s * t_q, k_s * t_k, v_s, scale=1.0)), t
assert all(a < ROUNDING and b < ROUNDING for a, b in matrix_diffs.values()), matrix_diffs
assert matrix_diffs["dv"][0] == 0
# P from the lse: the textbook softmax to rounding, normalised, no positive exponent
assert err_p < ROUNDING and np.abs(row_sums - 1).max() < ROUNDING
assert largest_exponent <= 0
# memory: naive's held scratch grows as N² (about 4 N×N arrays); flash's is flat in N once
# the tiles are full (N >= 256 here), apart from its 8 bytes per row of D and lse
assert 1.9 < slope_naive < 2.1 and 3 <= n_by_n <= 5
assert tiles_part.max() <= 1.02 * tiles_part.min(), tiles_part
assert flash_held[-1] <= 1.3 * flash_held[0]
assert naive_held[-1] > 100 * flash_held[sizes_flash.index(4096)]
assert np.all(naive_kept >= np.array(sizes_naive) ** 2 * itemsize)
assert np.array_equal(flash_kept, np.array(sizes_flash) * kept_per_row)
# the tile loop: the real tile function in a key-blocks-outside loop is flash, bit for bit;
# another order of dQ's shares changes bits; threads do not
assert sorted(computed) == sorted(schedule)  # the forward's tiles, each once
assert visited_rows == [(4, 8), (8, 12), (12, 16)]
assert all(loop_identical), loop_identical
assert reversed_differs > 0 and reversed_rel < ROUNDING
assert threads_identical
# the empty row: NaN without the guard, exactly 0 with it, nothing added to dk, dv, no warning
assert tile_nan["raw lse (-inf)"][2] == tile_sizes[2] and tile_nan["guarded lse (+inf)"] == [0, 0, 0]
assert empty_forward[1] == -np.inf and np.all(empty_forward[0] == 0)
assert empty_row_zero and empty_row_adds_nothing
assert np.isfinite(dq_e).all() and np.isfinite(dk_e).all() and np.isfinite(dv_e).all()
# finite differences: the one-tile harness is flash; slopes 2 ± 0.1 on the right, -1 ± 0.3 on
# the left (rounding is noisy; within these the printed integers cannot change); the minimum
# at most twice what the two sides predict (a wrong gradient would flatten the V far above it;
# rounding errors of random sign partly cancel, so the measured bottom sits below the model:
# 0.1x to 0.4x of it on the CPUs tried, too spread for a lower bound), at a step within 3x of
# theirs, and within 100x of u^(2/3) at a step within 10x of u^(1/3); the analytic gradient
# agrees there to 1e-9; without D the error never falls below 1e-2
assert one_tile_vs_flash < ROUNDING
assert abs(slope_right - 2) < 0.1 and abs(slope_left + 1) < 0.3, (slope_left, slope_right)
assert err[best] < 2 * err_star and eps_star / 3 < steps[best] < 3 * eps_star
assert err[best] < 100 * u ** (2 / 3) and u ** (1 / 3) / 10 < steps[best] < 10 * u ** (1 / 3)
assert err[best] < 1e-9 and errors["without D"].min() > 1e-2
# training: a plateau (the first 50 steps gain under 5%, the gradient starts under a tenth of
# its largest), then the loss falls 100-fold; every query retrieves its target; gradients
# match naive's at every step
assert losses[50] > 0.95 * losses[0] and grad_norms[0] < 0.1 * max(grad_norms)
assert losses[-1] < losses[0] / 100
assert np.array_equal(retrieved, target) and P_end[np.arange(n), target].min() > 0.9
assert max(step_diffs) < 1e-13, max(step_diffs)

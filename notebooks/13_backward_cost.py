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
# # 13. The backward's cost, and writing it yourself
#
# This chapter writes chapter 12's backward from scratch, checks it, counts its flops and bytes
# against the forward's, measures its memory, checks the gradient by finite differences, and
# trains with it.

# %%
import os

# One worker thread, as in chapter 8: T workers hold T tiles at once, and the memory measured
# below would depend on the machine's cores. Set before the import, which reads it.
os.environ["FLASH_LIB_THREADS"] = "1"

import matplotlib.pyplot as plt
import numpy as np
from threadpoolctl import threadpool_limits

import flash_lib
from flash_bench import below, relative_difference

assert flash_lib.thread_count() == 1, "flash_lib was imported before FLASH_LIB_THREADS was set: restart"
rng = np.random.default_rng(13)

# The limit for float64 agreements "to rounding" in this chapter: 1e-14 is 45 machine epsilons;
# the differences measured below are at most 2e-15 on every CPU tried, and any real error (a
# kernel off by one part in a million, a forgotten D) is far above it.
ROUNDING = 1e-14

# %% [markdown]
# ## The backward from scratch
#
# Chapter 12's algorithm box for one head, with `causal=True` skipping the tiles no row may see
# and masking the rest (bottom-right aligned, chapter 6). It takes the forward's $O$ and lse and
# applies chapter 12's empty-row guard; nothing in it comes from `flash_lib`, and `matmul` and
# `visit` are hooks for the counting below.

# %%
def backward_from_scratch(q, k, v, out, lse, dout, *, causal=False, block_q=16, block_k=16,
                          omit_D=False, matmul=np.matmul, visit=None):
    """FlashAttention-2's backward (arXiv 2307.08691, Algorithm 2) for one head: dq, dk, dv."""
    n_q, n_k = len(q), len(k)
    tau = 1 / np.sqrt(q.shape[1])
    offset = n_k - n_q  # query i sits at key position i + offset
    D = (dout * out).sum(axis=1)  # D_i = rowsum(dO_i ∘ O_i), once, before the loop
    if omit_D:  # the bug the check below must catch
        D = np.zeros(n_q)
    lse = np.where(lse == -np.inf, np.inf, lse)  # an empty row: P = exp(S - inf) = 0
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for k0 in range(0, n_k, block_k):  # key blocks outside: dK_j, dV_j stay resident
        k1 = min(k0 + block_k, n_k)
        k_j, v_j = k[k0:k1], v[k0:k1]
        dk_j, dv_j = np.zeros_like(k_j), np.zeros_like(v_j)
        for q0 in range(0, n_q, block_q):
            q1 = min(q0 + block_q, n_q)
            if causal and k0 > q1 - 1 + offset:
                continue  # no row of this block may see any of these keys
            if visit is not None:
                visit(q0, q1, k0, k1)
            q_i, do_i = q[q0:q1], dout[q0:q1]
            s = tau * matmul(q_i, k_j.T)  # S_ij = τ Q_i K_jᵀ, recomputed
            if causal:
                s = np.where(np.arange(k0, k1) <= np.arange(q0, q1)[:, None] + offset, s, -np.inf)
            p = np.exp(s - lse[q0:q1, None])  # P_ij = exp(S_ij - lse_i)
            dv_j += matmul(p.T, do_i)  # dV_j += P_ijᵀ dO_i
            dp = matmul(do_i, v_j.T)  # dP_ij = dO_i V_jᵀ
            ds = p * (dp - D[q0:q1, None])  # dS_ij = P_ij ∘ (dP_ij - D_i)
            dk_j += tau * matmul(ds.T, q_i)  # dK_j += τ dS_ijᵀ Q_i
            dq[q0:q1] += tau * matmul(ds, k_j)  # dQ_i += τ dS_ij K_j
        dk[k0:k1], dv[k0:k1] = dk_j, dv_j
    return dq, dk, dv


# %% [markdown]
# The check compares it with `flash_lib.flash_attention_backward` on a problem the blocks do not
# divide ($N_q = 150$, $N_k = 100$, $d = 24$, 32 × 48 tiles), without and with the causal mask,
# whose first 50 rows are empty, testing the guard. They agree to rounding, not bit for bit: the
# order of operations differs, and $\tau$, not a power of two here, is applied elsewhere
# (appendix 26). With $D$ omitted (the classic slip of a backward written from the Jacobian's
# first term alone) it must fail by a margin no rounding could close.

# %%
def check_backward(backward, q, k, v, dout, causal):
    """Largest relative difference of backward's dq, dk, dv from flash_lib's."""
    out, lse = flash_lib.flash_attention(q, k, v, causal=causal, return_lse=True)
    ref = flash_lib.flash_attention_backward(q, k, v, out, lse, dout, causal=causal)
    mine = backward(q, k, v, out, lse, dout, causal=causal, block_q=32, block_k=48)
    return float(np.max([relative_difference(a, b) for a, b in zip(mine, ref)]))


def backward_without_D(*args, **kwargs):
    return backward_from_scratch(*args, omit_D=True, **kwargs)


q, k, v, dout = (rng.standard_normal(shape) for shape in ((150, 24), (100, 24), (100, 16),
                                                          (150, 16)))
scratch_check, no_D_check = {}, {}
for causal in (False, True):
    scratch_check[causal] = check_backward(backward_from_scratch, q, k, v, dout, causal)
    no_D_check[causal] = check_backward(backward_without_D, q, k, v, dout, causal)
    print(f"causal={causal!s:<5}  from scratch vs flash_lib: {below(scratch_check[causal], ROUNDING)};"
          f"  with D omitted: passes the check: {no_D_check[causal] < ROUNDING}, "
          f"off by {no_D_check[causal]:.0e} of the largest gradient")

# %% [markdown]
# ## What the backward costs
#
# **Flops.** A matrix product of $(m \times n)$ by $(n \times p)$ costs $2mnp$ flops. Per tile of
# $b_q \times b_k$ the forward does two, $S = \tau Q_i K_j^\top$ and $P V_j$:
# $2 b_q b_k (d + d_v)$. The backward does five, $S$ again, $P^\top dO_i$, $dO_i V_j^\top$,
# $dS^\top Q_i$ and $dS\, K_j$: $2 b_q b_k (3d + 2d_v)$. With $d_v = d$ that is $10 b_q b_k d$
# against $4 b_q b_k d$, **2.5 times the forward** (the exp per score in each is of lower order).
# Both passes visit the same $n(n+1)/2$ tiles when causal (chapter 6), so the ratio stays 2.5.
# The cell counts the backward's flops through the loop's `matmul` hook, and the forward's from
# the tile shapes `flash_attention` hands its (wrapped) `online_softmax_update`.

# %%
def counted_flops(n, d, block, causal):
    flops, tiles = [0], []

    def matmul(a, b):
        flops[0] += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return a @ b

    q, k, v, dout = (rng.standard_normal((n, d)) for _ in range(4))
    out, lse = flash_lib.flash_attention(q, k, v, causal=causal, return_lse=True)
    backward_from_scratch(q, k, v, out, lse, dout, causal=causal, block_q=block, block_k=block,
                          matmul=matmul, visit=lambda *t: tiles.append(t))
    return flops[0], tiles


def forward_flops_of(n, d, block, causal):
    """The forward's flops, 2 (d + d_v) per score of each tile flash_attention folds in."""
    shapes, update = [], flash_lib.online_softmax_update

    def recording_update(m, l, acc, s, v, *args):
        shapes.append(s.shape[-2:])  # (rows, keys) of this tile
        return update(m, l, acc, s, v, *args)

    q, k, v = (rng.standard_normal((n, d)) for _ in range(3))
    try:
        flash_lib.online_softmax_update = recording_update  # the kernel looks it up per tile
        flash_lib.flash_attention(q, k, v, causal=causal, block_q=block, block_k=block)
    finally:
        flash_lib.online_softmax_update = update
    return sum(2 * rows * keys * (d + d) for rows, keys in shapes)


n_c, d_c, b_c = 1024, 64, 128
blocks = n_c // b_c
cost = {causal: counted_flops(n_c, d_c, b_c, causal) for causal in (False, True)}
forward_flops = {causal: forward_flops_of(n_c, d_c, b_c, causal) for causal in cost}
print(f"N = {n_c}, d = d_v = {d_c}, {b_c} x {b_c} tiles")
print(f"{'':>7} {'tiles':>7} {'backward flops':>15} {'forward flops':>14} {'ratio':>6}")
for causal, (flops, tiles) in cost.items():
    print(f"{'causal' if causal else 'full':>7} {len(tiles):>7} {flops:>15,} "
          f"{forward_flops[causal]:>14,} {flops / forward_flops[causal]:>6.2f}")

# %% [markdown]
# ## Recompute rather than read back
#
# The textbook backward reads $P$, $N^2$ numbers, back from slow memory; FlashAttention
# recomputes it, one more matrix product per tile, which arXiv 2205.14135 (Section 3.1) argues is
# cheaper. Per score, in {doc}`chapter 9 <09_memory_traffic>`'s A100 model (float16), that is
# $2d$ flops against 2 bytes read back, which the textbook's forward had to write too.
#
# **Bytes.** The backward's HBM traffic, in chapter 9's model:
#
# - textbook, each product its own kernel with its inputs read once (chapter 9's best case):
#   $dV$ reads $P$; $dP$ is written; $dS$ reads $P$, $dP$ and is written; $dQ$ and $dK$ each
#   read $dS$: $7N^2$ elements, plus $8Nd$ for the $N \times d$ inputs and outputs (and $D$);
# - flash: per key block, $K_j, V_j$ in and $dK_j, dV_j$ out once; per tile, $Q_i$, $dO_i$,
#   $\text{lse}_i$, $D_i$ in and $dQ_i$ in and out; plus the pass for $D$. About
#   $4 N^2 d / b_k$ elements, twice the forward's $2N^2 d / b_q$: $\Theta(N^2 d^2 / M)$, since
#   $b_k$ can grow as $M/d$.
#
# Theorem 5 of arXiv 2205.14135: for $d \le M \le Nd$, the standard backward requires
# $\Theta(Nd + N^2)$ HBM accesses and FlashAttention's $\Theta(N^2 d^2 M^{-1})$, like its forward
# (Theorem 2, chapter 9). The cell counts flash's bytes from what
# `flash_attention_backward` hands its (wrapped) tile function: float16, $d = 64$, 128 × 128
# tiles.

# %%
bandwidth, peak_rate = 2.039e12, 312e12  # chapter 9's A100: bytes/s, float16 flop/s
for d_head in (64, 128):
    recompute_s, read_s = 2 * d_head / peak_rate, 2 / bandwidth
    print(f"d = {d_head}: per score, recomputing S costs {recompute_s * 1e15:.2f} fs, reading P "
          f"back {read_s * 1e15:.2f} fs ({read_s / recompute_s:.1f}x), writing and reading it "
          f"{2 * read_s / recompute_s:.1f}x")

ITEM, ITEM_STATS = 2, 4  # float16 arrays; lse and D in float32


def flash_backward_traffic(n, d, block):
    """Chapter 9's model of flash_attention_backward's HBM bytes, from what it hands each tile."""
    per_tile, key_blocks, tile = [], {}, flash_lib.attention_backward_tile

    def recording_tile(q_t, k_t, v_t, *, dout, lse, D, **kwargs):
        share = tile(q_t, k_t, v_t, dout=dout, lse=lse, D=D, **kwargs)
        # Q_i, dO_i in; dQ_i's share read and written; lse_i, D_i in
        per_tile.append((q_t.size + dout.size + 2 * share.size) * ITEM
                        + (lse.size + D.size) * ITEM_STATS)
        key_blocks[v_t[0].tobytes()] = 2 * (k_t.size + v_t.size) * ITEM  # K_j, V_j in; dK_j, dV_j out
        return share

    q, k, v, dout = (rng.standard_normal((n, d)) for _ in range(4))
    out, lse = flash_lib.flash_attention(q, k, v, return_lse=True)
    try:
        flash_lib.attention_backward_tile = recording_tile  # the kernel looks it up per tile
        flash_lib.flash_attention_backward(q, k, v, out, lse, dout, block_q=block, block_k=block)
    finally:
        flash_lib.attention_backward_tile = tile
    d_pass = 2 * n * d * ITEM + n * ITEM_STATS  # O, dO in; D out
    return sum(per_tile) + sum(key_blocks.values()) + d_pass


def textbook_backward_traffic(n, d):
    return ITEM * (7 * n * n + 8 * n * d)


def flash_forward_bytes(n, d, b_q):  # chapter 9's formula
    return ITEM * (2 * n * d + -(-n // b_q) * 2 * n * d) + 4 * n


io_rows = {n: (flash_backward_traffic(n, 64, 128), textbook_backward_traffic(n, 64),
               flash_forward_bytes(n, 64, 128)) for n in (1024, 2048, 4096)}
print(f"\n{'N':>6} {'flash bwd bytes':>16} {'textbook bwd':>14} {'textbook/flash':>15} "
      f"{'flash bwd/fwd':>14}")
for n_io, (fb, tb, ff) in io_rows.items():
    print(f"{n_io:>6} {fb:>16,} {tb:>14,} {tb / fb:>15.2f} {fb / ff:>14.2f}")

# %% [markdown]
# Both grow as $N^2$ at a fixed tile: the textbook's $7N^2$ against flash's $4N^2 d/b_k \approx
# 2N^2$ ($b_k = 2d$ here) is 3.1 to 3.4 times more at these $N$, tending to 3.5, and larger tiles
# widen the gap. Twice the forward's bytes for 2.5 times its flops: about the forward's
# arithmetic intensity.


# %% [markdown]
# ## What training keeps for the backward
#
# Between the passes, the textbook attention keeps $P$, $N_q N_k$ numbers per head;
# FlashAttention keeps $O$ (usually kept anyway, as the next layer's input) and the lse, $N_q$
# numbers. The cell compares what each
# keeps (float32, $d = d_v = 16$) and measures each backward's scratch as
# {doc}`chapter 8 <08_memory>` measures the forward's (256 × 256 tiles, one worker), the naive
# kernel up to $N = 4096$.

# %%
d = dv = 16
dtype = np.float32
block = 256


def problem(n):
    return [rng.standard_normal((n, c), dtype=dtype) for c in (d, d, dv, dv)]


def naive_backward_bytes(n):
    q, k, v, do = problem(n)
    kept = (n * dv + n * n) * np.dtype(dtype).itemsize  # O and P: what a textbook forward keeps
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
# (the MiB themselves are this machine's, within a few hundredths; the figure draws them)
print(f"flash backward holds under 1 MiB at every N from 256 to 8192: {flash_held.max() < 2**20}; "
      f"without D and the lse (8 bytes per row), largest / smallest = "
      f"{tiles_part.max() / tiles_part.min():.2f}")
# the P a textbook backward would keep for one head of one layer, d = 128 and N = 8192, bfloat16
print(f"for scale: P at N = 8192 in bfloat16 is {8192**2 * 2 / 2**20:.0f} MiB per head per layer, "
      f"O and lse (d = 128, lse in float32) {8192 * (128 * 2 + 4) / 2**20:.1f} MiB")

# %% tags=["hide-input"]
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
# Left: the textbook keeps $P$ (slope 2), flash $O$ and the lse, $N (d_v + 1)$ numbers (slope
# 1). Right: the naive backward holds about four $N \times N$ arrays at its peak (the scores,
# $P$, $dP$, $dS$); flash its tiles, flat in $N$, plus $D$ and the lse, 8 bytes per row.

# %% [markdown]
# ## Checking the gradient by finite differences
#
# Finite differences check the gradient against the forward alone. Along a random direction
# $(\delta_q, \delta_k, \delta_v)$, let $f(\varepsilon) = \sum dO \circ \text{flash\_attention}(Q + \varepsilon
# \delta_q, K + \varepsilon \delta_k, V + \varepsilon \delta_v)$; with the analytic gradients,
#
# $$f'(0) = \langle dQ, \delta_q \rangle + \langle dK, \delta_k \rangle + \langle dV, \delta_v \rangle$$
#
# and the central difference $\big(f(\varepsilon) - f(-\varepsilon)\big) / 2\varepsilon$
# estimates it with two errors:
#
# - **truncation**: Taylor's theorem gives $f'(0) + \varepsilon^2 f'''(0)/6 + O(\varepsilon^4)$,
#   an error $\propto \varepsilon^2$, a slope of 2 on log-log axes;
# - **rounding**: each $f(\pm\varepsilon)$ carries an error of a few $u\,|f|$ ($u = 2^{-53}$ in
#   float64), which dividing by $2\varepsilon$ makes $\propto u / \varepsilon$, a slope of $-1$.
#
# Their sum $A\varepsilon^2 + B/\varepsilon$ is least at $\varepsilon^* = (B/2A)^{1/3}$; with
# $A$ of order 1 and $B$ of order $u$, near $u^{1/3} \approx 5 \times 10^{-6}$, where it is of
# order $u^{2/3} \approx 2 \times 10^{-11}$: the bottom of a V. A correct gradient reaches that
# bottom; a wrong one ($D$ omitted) flattens the V at its own error. The error is relative to
# $|f'(0)|$, root mean square over 8 random directions; causal, $N_q = 13$, $N_k = 17$, $d = 6$,
# $d_v = 4$, 4 × 5 tiles.

# %%
n_q, n_k, d, dv = 13, 17, 6, 4
q, k, v, dout = (rng.standard_normal(shape) for shape in
                 ((n_q, d), (n_k, d), (n_k, dv), (n_q, dv)))
kw = dict(causal=True, block_q=4, block_k=5)
out, lse = flash_lib.flash_attention(q, k, v, return_lse=True, **kw)
grads = flash_lib.flash_attention_backward(q, k, v, out, lse, dout, **kw)
grads_without_D = backward_from_scratch(q, k, v, out, lse, dout, omit_D=True, **kw)


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
print(f"fitted slopes: {slope_left:.0f} for eps in [1e-12, 1e-8], "
      f"{slope_right:.0f} for eps in [1e-4, 1e-2] (to the nearest integer)")
print(f"smallest error {below(err[best], 1e-9)}, at most twice the two sides' prediction: "
      f"{err[best] < 2 * err_star}; at a step within 3x of theirs: "
      f"{eps_star / 3 < steps[best] < 3 * eps_star}, and within 10x of u^(1/3) = "
      f"{u ** (1 / 3):.0e}: {u ** (1 / 3) / 10 < steps[best] < 10 * u ** (1 / 3)}")
print(f"without D: smallest error {errors['without D'].min():.1f}")

# %% tags=["hide-input"]
fig, ax = plt.subplots(figsize=(8, 6))
ax.loglog(steps, err, "o-", ms=4, color="C0", label="flash_attention_backward")
ax.loglog(steps, errors["without D"], "s-", ms=3, color="C3", label="backward_from_scratch, D omitted")
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
# Gradient descent with `flash_attention` and its backward, on a task whose
# answer can be seen: each of sixteen queries $i$ must retrieve key $\pi(i)$ of a permutation.
# With one-hot values $v_j = e_j$ a row's output *is* its row of weights, and
#
# $$L = \tfrac12 \sum_i \lVert o_i - e_{\pi(i)} \rVert^2, \qquad dO = O - V_\pi ,$$
#
# is zero exactly when every query puts all its weight on its target. We learn $Q$ and $K$
# ($d = 8$, small at first, so rows start near uniform) with step 1.0 for 300 steps, 4 × 4 tiles,
# checking the gradients against `naive_attention_backward`'s at every step.

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
    step_diffs.append(max(relative_difference(g, r) for g, r in zip((dq, dk, dv), reference)))
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

# %% tags=["hide-input"]
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
# The loss sits on a plateau while the rows are near uniform: $dQ = \tau\, dS\, K$ and
# $dK = \tau\, dS^\top Q$ carry the small $K$ and $Q$ as factors, and grow with them. Once the
# rows commit, the loss falls more than a hundredfold, every query on its target key.
#
# ## What we showed
#
# - The backward from scratch matches `flash_attention_backward` to rounding; without $D$ the
#   check fails by order 1.
# - It does 2.5 times the forward's flops, full or causal, and moves about $4N^2 d/b_k$ elements,
#   twice the forward's, against the textbook's $7N^2$: $\Theta(N^2 d^2/M)$, Theorem 5.
# - It keeps $N(d_v + 1)$ numbers against $N^2$, with scratch flat in $N$; central differences
#   confirm its gradient, and training with it learns the task.

# %%
# the loop from scratch: flash_lib's gradients to rounding (ROUNDING = 1e-14: at most 2e-15
# measured at every NPY_DISABLE_CPU_FEATURES level); without D, off by more than 1e-2
for causal in (False, True):
    assert scratch_check[causal] < ROUNDING, (causal, scratch_check[causal])
    assert no_D_check[causal] > 1e-2, (causal, no_D_check[causal])
# flops counted through the loop's matmul: 2 b² (3d + 2d) per visited tile, n² tiles in full,
# n(n+1)/2 causal (the loop skips exactly the tiles above the diagonal); against the forward's,
# counted from flash_attention's own tiles: 5/2, full and causal
assert len(cost[False][1]) == blocks**2 and len(cost[True][1]) == blocks * (blocks + 1) // 2
for causal, (flops, tiles) in cost.items():
    assert flops == 2 * b_c * b_c * (3 * d_c + 2 * d_c) * len(tiles)
    assert 2 * flops == 5 * forward_flops[causal], (causal, flops, forward_flops[causal])
# bytes from flash_attention_backward's own tiles: the closed form 8Nd + (N/b)(8Nd + 8N) + 4Nd + 4N;
# the textbook's 3 to 3.5 times more, the forward's about half
for n_io, (fb, tb, ff) in io_rows.items():
    assert fb == 8 * n_io * 64 + (n_io // 128) * (8 * n_io * 64 + 8 * n_io) + 4 * n_io * 64 + 4 * n_io
    assert 3 < tb / fb < 3.5 and 1.9 < fb / ff < 2.2
# memory: naive's held scratch grows as N² (about 4 N×N arrays); flash's is flat in N once
# the tiles are full (N >= 256 here), apart from its 8 bytes per row of D and lse
assert 1.9 < slope_naive < 2.1 and 3 <= n_by_n <= 5
assert tiles_part.max() <= 1.02 * tiles_part.min(), tiles_part
assert flash_held[-1] <= 1.3 * flash_held[0] and flash_held.max() < 2**20
assert naive_held[-1] > 100 * flash_held[sizes_flash.index(4096)]
# what flash_attention returns for its backward: O and a float32 lse, (dv + 1) numbers a row
assert np.array_equal(flash_kept, np.array(sizes_flash) * kept_per_row)
# finite differences: slopes 2 ± 0.1 on the right, -1 ± 0.3 on the left (rounding is noisy;
# within these the printed integers cannot change); the minimum at most twice what the two
# sides predict (a wrong gradient would flatten the V far above it; rounding errors of random
# sign partly cancel, so the measured bottom sits below the model: 0.1x to 0.4x of it on the
# CPUs tried, too spread for a lower bound), at a step within 3x of theirs, and within 100x of
# u^(2/3) at a step within 10x of u^(1/3); the analytic gradient agrees there to 1e-9; without
# D the error never falls below 1e-2
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

# %% [markdown]
# ## Your turn: the tiled backward
#
# Write `backward(q, k, v, out, lse, dout, *, causal=False, block_q=64, block_k=64)
# -> (dq, dk, dv)` for one head, `q (Nq, d)`, `k (Nk, d)`, `v (Nk, dv)`, scale $1/\sqrt d$:
# recompute $P = e^{S - \text{lse}}$ tile by tile, with $D = \text{rowsum}(dO \circ O)$, causal
# aligned bottom-right; a row with `lse = -inf` (no allowed key) adds nothing to any gradient.
#
# Replace the stub with your function and re-run the grade cell: it says `not implemented yet`,
# then what is wrong and where to look, until `passed`. The solution is hidden below it.

# %%
from flash_check.exercises import grade, show_solution, stub

# your turn: replace the stub with def backward(q, k, v, out, lse, dout, *, causal=False, block_q=64, block_k=64): ...
backward = stub("backward")

# %%
grade("backward", backward)

# %% jupyter={"outputs_hidden": true} mystnb={"code_prompt_hide": "Hide the solution", "code_prompt_show": "Show the solution"} tags=["remove-input", "hide-output"]
show_solution("backward")

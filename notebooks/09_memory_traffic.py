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
# # 9. Memory traffic: why FlashAttention is fast
#
# Chapter 8 measured how much memory the kernels *hold*; on a GPU the time depends on how many
# bytes they *move* between the large slow memory and the small fast one. This chapter counts
# them, **with instrumented code** that tallies every load and store: the textbook pipeline,
# which writes $S$ and $P$ out and reads them back, moves $\Theta(Nd + N^2)$, the tiled kernel
# $\Theta(N^2 d^2 / M)$ for $M$ bytes on chip (FlashAttention, arXiv 2205.14135, Theorem 2),
# because tiling's second dimension, a block of queries, shares each load of keys and values. A
# roofline for an NVIDIA A100 closes the chapter.
#
# Everything about the GPU here is a **model** that counts bytes; no GPU is timed (the machine
# that runs this notebook has none).

# %%
from collections import Counter

import numpy as np
import matplotlib.pyplot as plt

import flash_lib

rng = np.random.default_rng(10)

# %% [markdown]
# ## Two memories
#
# {doc}`Chapter 5 <05_tiling>` introduced them: a GPU's main memory, **HBM**, and the on-chip
# **SRAM** of each streaming multiprocessor (SM), shared by the threads of one **thread block**.
# On an NVIDIA A100 the HBM holds 40 or 80 GB and is read and written at about 2 TB/s; each of
# its 108 SMs has 192 KB of SRAM, an order of magnitude faster (FlashAttention, arXiv
# 2205.14135, Section 2.1; the 40 and 80 GB: NVIDIA A100 Tensor Core GPU datasheet): about 21 MB
# of SRAM in all, 2,000 to 4,000 times less than the HBM. The model:
#
# - the inputs $Q, K, V$ ($N \times d$ each, $N_q = N_k = N$, $d_v = d$) start in HBM and the
#   output $O$ must end there; every element moved between HBM and chip costs `itemsize` bytes
#   (2 for float16);
# - a thread block holds at most $M$ bytes on chip at once;
# - the time is at least the larger of $\text{bytes} / \text{bandwidth}$ and
#   $\text{flops} / \text{peak}$.
#
# The `HBM` class below tallies every element in or out; the arithmetic runs in float64 (checked
# against `flash_lib`), the bytes are counted at `itemsize`.

# %%
sram_total = 108 * 192e3  # bytes: an A100's 108 SMs of 192 KB each
sram_vs_hbm = (40e9 / sram_total, 80e9 / sram_total)
print(f"A100: {sram_total / 1e6:.1f} MB of SRAM in all; 40 or 80 GB of HBM is "
      f"{sram_vs_hbm[0]:,.0f} or {sram_vs_hbm[1]:,.0f} times as much")


class HBM:
    """Named arrays in slow memory; every load and store is tallied in bytes."""

    def __init__(self, itemsize, **arrays):
        self.itemsize = itemsize
        self.arrays = arrays
        self.loaded, self.stored = Counter(), Counter()

    def load(self, name, rows=slice(None)):
        x = self.arrays[name][rows]
        self.loaded[name] += x.size * self.itemsize
        return x.copy()  # now "in SRAM"

    def store(self, name, rows, value, itemsize=None):
        self.arrays[name][rows] = value
        self.stored[name] += np.size(value) * (itemsize or self.itemsize)

    def total(self):
        return sum(self.loaded.values()) + sum(self.stored.values())


# %% [markdown]
# ## The textbook pipeline
#
# Standard attention as a framework runs it is three kernels, each reading its inputs from HBM
# and writing its result back (FlashAttention's Algorithm 0):
#
# 1. load $Q, K$; compute $S = \tau QK^\top$; store $S$ ($N^2$ elements);
# 2. load $S$; compute $P = \operatorname{softmax}(S)$; store $P$;
# 3. load $P, V$; compute $O = PV$; store $O$.
#
# That is $4Nd + 4N^2$ elements: $\Theta(Nd + N^2)$, dominated by $S$ and $P$ going out and
# coming back. (Each matrix product is itself tiled inside its kernel; the model credits it with
# reading its inputs once, the best case.)

# %%
def naive_counted(hbm, tau):
    """Algorithm 0 of FlashAttention, with S and P in HBM."""
    q, k = hbm.load("Q"), hbm.load("K")
    hbm.store("S", slice(None), tau * q @ k.T)
    s = hbm.load("S")
    p = np.exp(s - s.max(axis=1, keepdims=True))
    hbm.store("P", slice(None), p / p.sum(axis=1, keepdims=True))
    p, v = hbm.load("P"), hbm.load("V")
    hbm.store("O", slice(None), p @ v)


def naive_bytes(n, d, itemsize):
    return itemsize * (4 * n * d + 4 * n * n)


# %% [markdown]
# ## The tiled kernel
#
# In chapter 5's algorithm box (FlashAttention-2's Algorithm 1) $S$ and $P$ never leave SRAM.
# For each query block $Q_i$ of $b_q$ rows, the loads are $b_q d$ for $Q_i$ and $2 N d$ for all
# key and value blocks $K_j, V_j$ ($b_k$ rows each); the stores are $b_q d$ for $O_i$ and $b_q$
# lse values (float32, 4 bytes, as FlashAttention stores them). In total
#
# $$\text{bytes}_{\text{flash}} = \text{itemsize}\,\bigl(2Nd + T_q \cdot 2Nd\bigr) + 4N
#   \;\approx\; \text{itemsize} \cdot \frac{2N^2 d}{b_q} \quad (N \gg b_q).$$
#
# On chip, one thread block holds $Q_i$, $K_j$, $V_j$ at `itemsize`, and the tile $S$ (then
# $P$), $\text{acc}$, $m$ and $l$ in float32, as FlashAttention-2 does (there in registers, the
# inputs in shared memory); the model counts both against one budget $M$:
# $\text{itemsize}\,(b_q d + 2 b_k d) + 4\,(b_q b_k + b_q d + 2 b_q) \le M$. The function below
# runs exactly the box and checks that capacity on every tile.

# %%
def sram_bytes(b_q, b_k, d, itemsize):
    """What one thread block holds while it works on a tile: Q_i, K_j, V_j at itemsize; S/P,
    acc, m, l in float32."""
    return itemsize * (b_q * d + 2 * b_k * d) + 4 * (b_q * b_k + b_q * d + 2 * b_q)


def flash_counted(hbm, tau, b_q, b_k, sram_limit):
    """FlashAttention-2's forward pass, every HBM transfer tallied, SRAM use checked per tile."""
    n, d = hbm.arrays["Q"].shape
    peak_sram = 0
    for q0 in range(0, n, b_q):
        rows = slice(q0, min(q0 + b_q, n))
        q_i = hbm.load("Q", rows)
        m = np.full(len(q_i), -np.inf)
        l = np.zeros(len(q_i))
        acc = np.zeros((len(q_i), d))
        for k0 in range(0, n, b_k):
            cols = slice(k0, min(k0 + b_k, n))
            k_j, v_j = hbm.load("K", cols), hbm.load("V", cols)
            s = tau * q_i @ k_j.T
            m_new = np.maximum(m, s.max(axis=1))
            p = np.exp(s - m_new[:, None])
            alpha = np.exp(m - m_new)
            l = alpha * l + p.sum(axis=1)
            acc = alpha[:, None] * acc + p @ v_j
            m = m_new
            in_sram = ((q_i.size + k_j.size + v_j.size) * hbm.itemsize
                       + (p.size + acc.size + m.size + l.size) * 4)  # float32
            peak_sram = max(peak_sram, in_sram)
        hbm.store("O", rows, acc / l[:, None])
        hbm.store("lse", rows, m + np.log(l), itemsize=4)
    assert peak_sram <= sram_limit, (peak_sram, sram_limit)
    return peak_sram


def flash_bytes(n, d, b_q, itemsize):
    t_q = -(-n // b_q)
    return itemsize * (2 * n * d + t_q * 2 * n * d) + 4 * n


# %% [markdown]
# ## Counted, and checked
#
# float16 in the model (`itemsize` = 2), $d = 64$, and $M$ = 163 KiB, the most shared memory one
# thread block may use on an A100: 164 KB per SM less the 1 KB that CUDA reserves per thread
# block (NVIDIA Ampere tuning guide; CUDA C++ Programming Guide, compute capability 8.x).
# $b_q = b_k = 128$ fit, FlashAttention-2's forward tile for $d = 64$; 144 does not, and in 100
# KiB, with $S$ in float32, 128 would not either. For $N$ = 256, 512 and 1000 (not a multiple of
# the tile) both pipelines run instrumented, each output checked against `flash_lib` and each
# tally against the formulas, to the byte. The error is printed against a limit: its last digits
# depend on the CPU, the bytes do not
# ({doc}`the appendix on testing <28_how_chapters_7_to_23_are_tested>` draws them).

# %%
d, itemsize = 64, 2
sram_limit = 163 * 1024
b = 128
print(f"on chip for a {b} x {b} tile: {sram_bytes(b, b, d, itemsize):,} bytes; fits in "
      f"{sram_limit // 1024} KiB: {sram_bytes(b, b, d, itemsize) <= sram_limit}, in 100 KiB: "
      f"{sram_bytes(b, b, d, itemsize) <= 100 * 1024}; {b + 16} x {b + 16} needs "
      f"{sram_bytes(b + 16, b + 16, d, itemsize):,}")
tau = 1 / np.sqrt(d)


def instrumented(n, b_q, b_k):
    q, k, v = (rng.standard_normal((n, d)) for _ in range(3))
    truth = flash_lib.flash_attention(q, k, v)
    naive = HBM(itemsize, Q=q, K=k, V=v, S=np.empty((n, n)), P=np.empty((n, n)),
                O=np.empty((n, d)))
    naive_counted(naive, tau)
    flash = HBM(itemsize, Q=q, K=k, V=v, O=np.empty((n, d)), lse=np.empty(n))
    peak = flash_counted(flash, tau, b_q, b_k, sram_limit)
    err = tuple(float(flash_lib.rowwise_relative_error(hbm.arrays["O"], truth).max())
                for hbm in (naive, flash))  # (naive's, flash's)
    return naive, flash, peak, err


counted = {}
print("bytes moved, counted by the instrumented loops, and formula - counted:")
print("     N        naive  formula - counted        flash  formula - counted  naive / flash")
for n in (256, 512, 1000):
    naive, flash, peak, err = instrumented(n, b, b)
    counted[n] = (naive.total(), flash.total(), peak, err)
    print(f"{n:>6} {naive.total():>12,} {naive_bytes(n, d, itemsize) - naive.total():>18}"
          f" {flash.total():>12,} {flash_bytes(n, d, b, itemsize) - flash.total():>18}"
          f" {naive.total() / flash.total():>14.2f}")
# Against a stated limit, not as a number: the error is rounding, and its last digits are the
# CPU's. 1e-14 is 45 machine epsilons (the appendix on testing draws the measured errors).
largest_err = max(max(c[3]) for c in counted.values())
print("largest error of either pipeline against flash_lib:",
      "below 1e-14" if largest_err < 1e-14 else f"{largest_err:.1e}, above 1e-14")
print(f"peak on-chip bytes of one thread block: {counted[1000][2]:,} of {sram_limit:,}")
print("flash at N = 1000, bytes by array: loaded", dict(flash.loaded))
print("   stored", dict(flash.stored))
# one tile more per side does not fit: the loop's own capacity check refuses it
try:
    instrumented(256, b + 16, b + 16)
    too_big = "fits"
except AssertionError:
    too_big = "refused by the capacity check"
print(f"{b + 16} x {b + 16} tiles in {sram_limit // 1024} KiB: {too_big}")

# %% [markdown]
# ## Re-use: what the second dimension of tiling is for
#
# Chapter 4 streamed *one* query over the keys, also in memory independent of $N$, but shared
# nothing. Each load of $K_j, V_j$ serves the $b_q$ queries of one block, so every key and value
# is loaded $T_q = N / b_q$ times: $2 N d \cdot N / b_q$ elements. With $b_q = 1$, chapter 4's
# stream, that is $2N^2 d$: at $d = 64$, $d/2 = 32$ times the textbook pipeline's $4N^2$. Only a
# query block wider than $d/2$ (up to lower-order terms) moves fewer bytes than writing $S$ and
# $P$ out. (At finite $N$ the textbook pipeline's $4Nd$ term makes $b_q = 1$'s ratio
# $N d / (2(N + d))$ rather than $d/2$.) Counted by the instrumented loop at $N = 512$, with
# $b_k = 128$ or, for $b_q = 256$, the largest $b_k$ that fits beside it ($b_k$ does not change
# the traffic).

# %%
n_reuse = 512
reuse = {}
print(" b_q   loads of each key and value   K,V bytes loaded   total bytes / naive's")
for b_q in (1, 16, 32, 64, 128, 256):
    b_k = next(bk for bk in (128, 64, 32, 16) if sram_bytes(b_q, bk, d, itemsize) <= sram_limit)
    _, flash, _, _ = instrumented(n_reuse, b_q, b_k)
    kv_loaded = flash.loaded["K"] + flash.loaded["V"]
    loads_per_key = kv_loaded // (2 * n_reuse * d * itemsize)
    reuse[b_q] = (loads_per_key, kv_loaded, flash.total() / naive_bytes(n_reuse, d, itemsize))
    print(f"{b_q:>4}   {loads_per_key:>27}   {kv_loaded:>16,}   {reuse[b_q][2]:>21.3f}")

# %% [markdown]
# ## $\Theta(N^2 d^2 / M)$
#
# How large can $b_q$ be? The tile $S$ is $b_q \times b_k$ and $Q_i, K_j, V_j, \text{acc}$ are
# $b \times d$ each, so an SRAM of $M$ bytes allows $b_q$ of order
# $M / (d \cdot \text{itemsize})$ (FlashAttention-1 takes $b_k = \lceil M / 4d \rceil$). Putting
# $b_q \propto M/d$ into $2N^2 d / b_q$ gives $\Theta(N^2 d^2 / M)$ bytes, FlashAttention's
# Theorem 2; the $\Theta(Nd)$ of reading the inputs and writing the output once is the floor,
# reached when one block holds all of $Q$. The textbook pipeline's $4N^2$ does not depend on
# $M$.
#
# The instrumented loop measures it at $N = 2048$ for $M$ from 16 KiB to 227 KiB, the most one
# thread block may use on an H100 (228 KB per SM less CUDA's 1 KB per block: NVIDIA Hopper
# tuning guide; CUDA C++ Programming Guide, compute capability 9.0), each with the largest
# square tile that fits; the figure's left side carries the formulas on to $N = 65536$.

# %%
def largest_tile(m_bytes, d, itemsize):
    """The largest b (a multiple of 16) with b_q = b_k = b fitting in m_bytes of SRAM."""
    b = 16
    while sram_bytes(b + 16, b + 16, d, itemsize) <= m_bytes:
        b += 16
    return b


n_fixed = 2048
sram_sizes = np.array([16, 32, 48, 64, 96, 128, 163, 192, 227]) * 1024  # each a different tile
tile_at = {int(m): largest_tile(m, d, itemsize) for m in sram_sizes}
q_m, k_m, v_m = (rng.standard_normal((n_fixed, d)) for _ in range(3))
flash_vs_m, formula_vs_m = [], []
for m in sram_sizes:  # counted by the instrumented loop, each M with its own capacity check
    hbm = HBM(itemsize, Q=q_m, K=k_m, V=v_m, O=np.empty((n_fixed, d)), lse=np.empty(n_fixed))
    flash_counted(hbm, tau, tile_at[int(m)], tile_at[int(m)], int(m))
    flash_vs_m.append(hbm.total())
    formula_vs_m.append(flash_bytes(n_fixed, d, tile_at[int(m)], itemsize))
flash_vs_m = np.array(flash_vs_m)
naive_m = HBM(itemsize, Q=q_m, K=k_m, V=v_m, S=np.empty((n_fixed, n_fixed)),
              P=np.empty((n_fixed, n_fixed)), O=np.empty((n_fixed, d)))
naive_counted(naive_m, tau)
ns = 2 ** np.arange(9, 17)
naive_vs_n = np.array([naive_bytes(n, d, itemsize) for n in ns], dtype=float)
flash_vs_n = np.array([flash_bytes(n, d, b, itemsize) for n in ns], dtype=float)
print("largest square tile (b_q = b_k) for each M:\n  ",
      ", ".join(f"{m // 1024} KiB: {t}" for m, t in list(tile_at.items())[:5]))
print("  ", ", ".join(f"{m // 1024} KiB: {t}" for m, t in list(tile_at.items())[5:]))
print(f"N = {n_fixed}, counted: bytes equal the formula at every M: "
      f"{flash_vs_m.tolist() == formula_vs_m}; bytes x M from {(flash_vs_m * sram_sizes).min():.3e} "
      f"to {(flash_vs_m * sram_sizes).max():.3e};\n   the textbook pipeline: "
      f"{naive_m.total():,} bytes, {naive_m.total() / flash_vs_m[-1]:.1f} times the tiled at "
      f"{sram_sizes[-1] // 1024} KiB")

# %% tags=["hide-input"]
fig, (ax_n, ax_m) = plt.subplots(1, 2, figsize=(11, 4.3))
ax_n.loglog(ns, naive_vs_n / 2**20, "s-", color="C3", label="textbook pipeline: $4Nd + 4N^2$")
ax_n.loglog(ns, flash_vs_n / 2**20, "o-", color="C0",
            label=f"tiled, $b_q = b_k$ = {b}: $2Nd + 2N^2d/b_q$")
ax_n.loglog(ns, itemsize * 4 * ns * d / 2**20, ":", color="0.4", label="floor: $4Nd$ (Q, K, V, O once)")
ax_n.set_xscale("log", base=2)
ax_n.set_xlabel("sequence length N (tokens)")
ax_n.set_ylabel("HBM traffic per head (MiB)")
ax_n.set_title(f"Formulas against N (float16, d = {d}, M = {sram_limit // 1024} KiB)")
ax_n.legend(fontsize=8)
ax_m.loglog(sram_sizes / 1024, flash_vs_m / 2**20, "o-", color="C0",
            label="tiled, largest tile that fits (counted)")
ax_m.axhline(naive_m.total() / 2**20, color="C3", ls="--",
             label="textbook pipeline (independent of M)")
ax_m.loglog(sram_sizes / 1024, flash_vs_m[0] * sram_sizes[0] / sram_sizes / 2**20, ":", color="0.4",
            label=r"$\propto 1/M$")
ax_m.set_xticks(sram_sizes / 1024, [str(m // 1024) for m in sram_sizes], fontsize=8)
ax_m.minorticks_off()
ax_m.set_yticks([4, 8, 16, 32, 64], ["4", "8", "16", "32", "64"])
ax_m.set_xlabel("on-chip memory per thread block, M (KiB)")
ax_m.set_ylabel("HBM traffic per head (MiB)")
ax_m.set_title(f"Bytes counted against M (N = {n_fixed}, d = {d})")
ax_m.legend(fontsize=8, loc="upper right")
for ax in (ax_n, ax_m):
    ax.grid(True, which="major", alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Arithmetic intensity and a roofline
#
# The **arithmetic intensity** of a kernel is its flops per byte moved. With the two matrix
# products' $4N^2 d$ flops (chapter 10's convention) the textbook pipeline has
# $4N^2 d / (2 \cdot 4N^2) = d/2$ flop/byte for large $N$ in float16; the tiled kernel has
# $4N^2 d / (2 \cdot 2 N^2 d / b_q) = b_q$ flop/byte. A **roofline** plots the rate a kernel can
# reach against its intensity: $\min(\text{peak},\ \text{intensity} \times \text{bandwidth})$.
# Below the ridge point $\text{peak} / \text{bandwidth}$ a kernel is memory-bound.
#
# One real GPU: the NVIDIA A100 SXM4 80 GB, with 2,039 GB/s of HBM2e bandwidth and 312 TFLOP/s
# of dense float16 throughput on its tensor cores, the units that multiply small matrices in one
# step (NVIDIA A100 Tensor Core GPU datasheet). Its ridge point is $312 / 2.039 = 153$
# flop/byte.

# %%
bandwidth, peak_rate = 2.039e12, 312e12  # A100 SXM4 80GB: bytes/s, dense float16 tensor-core flop/s
ridge = peak_rate / bandwidth
n_roof = 4096
flop = 4 * n_roof**2 * d
naive_roof, flash, _, _ = instrumented(n_roof, b, b)  # the two pipelines' bytes, counted
kernels = {
    "textbook": naive_roof.total(),
    f"tiled, b_q = {b}": flash.total(),
    # formula (counted at N = 512 above): the instrumented loop would take 4096 x 32 steps
    "chapter 4's stream, b_q = 1": flash_bytes(n_roof, d, 1, itemsize),
}
print(f"A100 ridge point: {ridge:.0f} flop/byte; N = {n_roof}, d = {d}, float16, one head")
print(f"{'kernel':<28} {'flop/byte':>9} {'bound':>7} {'model time (µs)':>16} {'at most TFLOP/s':>16}")
model = {}
for name, nbytes in kernels.items():
    intensity = flop / nbytes
    t = max(flop / peak_rate, nbytes / bandwidth)
    model[name] = (intensity, t)
    print(f"{name:<28} {intensity:>9.1f} {'memory' if intensity < ridge else 'compute':>7} "
          f"{t * 1e6:>16.1f} {flop / t / 1e12:>16.0f}")
print(f"matmul flops alone at peak: {flop / peak_rate * 1e6:.1f} µs")

# %% tags=["hide-input"]
x = np.logspace(-1, 3.3, 200)
fig, ax = plt.subplots(figsize=(8, 4.5))
ax.loglog(x, np.minimum(peak_rate, x * bandwidth) / 1e12, "k-", lw=1.5, label="A100 roofline")
ax.axvline(ridge, color="0.6", ls=":", lw=1)
ax.text(ridge * 1.08, 2, f"ridge {ridge:.0f} flop/byte", color="0.3", fontsize=9)
for (name, (intensity, t)), marker, color in zip(model.items(), "soD", ("C3", "C0", "C2")):
    ax.loglog(intensity, flop / t / 1e12, marker, color=color, ms=9,
              label=f"{name}: {intensity:.0f} flop/byte")
ax.set_xlabel("arithmetic intensity (flop per HBM byte)")
ax.set_ylabel("attainable rate (TFLOP/s)")
ax.set_title(f"Roofline model, A100 SXM4, float16, N = {n_roof}, d = {d}")
ax.legend(fontsize=9, loc="lower right")
ax.grid(True, which="major", alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# Far left of the ridge, the textbook pipeline could spend at most a fifth of its time
# computing, the rest waiting for $S$ and $P$. The tiled kernel's intensity is its $b_q$, which
# is why FlashAttention wants the widest query block its SRAM allows. The model leaves out the
# GPU's 40 MB L2 cache (which serves repeated loads of $K_j, V_j$), the work off the tensor
# cores and how many thread blocks an SM runs at once, but gets the order of things right: the
# textbook pipeline is bound by memory, and tiling in two dimensions removes that. (A CPU has
# the same hierarchy with far larger caches, so there the $N^2$ arrays cost mostly memory
# *capacity*, chapter 8; the {doc}`appendix on testing <28_how_chapters_7_to_23_are_tested>`
# times it.)
#
# ## What we showed
#
# - The textbook pipeline moves $4Nd + 4N^2$ elements, the tiled kernel $2Nd + 2N^2 d / b_q$
#   plus the lse: counted to the byte at $N$ = 256, 512 and 1000, with outputs matching
#   `flash_lib` to rounding.
# - At $d = 64$ and $b_q = 128$ (163 KiB on chip, $S$ in float32) the tiled kernel moves about a
#   quarter of the textbook pipeline's bytes, loading every key and value $N / b_q$ times.
# - Chapter 4's one-query stream ($b_q = 1$) needs no $N^2$ memory but moves about $d/2 = 32$
#   times the textbook pipeline's bytes; only query blocks wider than $d/2$ move fewer.
# - With the largest tile that $M$ bytes of SRAM allow, the counted traffic falls as $1/M$
#   (bytes × $M$ within a factor 2 from 16 to 227 KiB) toward the $\Theta(Nd)$ floor:
#   $\Theta(N^2 d^2 / M)$ against $\Theta(Nd + N^2)$.
# - An A100's SRAM, 108 × 192 KB, is 2,000 to 4,000 times smaller than its 40 or 80 GB of HBM.
# - Intensity: $d/2 = 32$ flop/byte for the textbook pipeline, about $b_q$ for the tiled kernel;
#   against the A100's ridge of 153 the first is memory-bound by a factor of about 5, the second
#   close to balanced.

# %%
for n, (naive_total, flash_total, peak, err) in counted.items():
    assert naive_total == naive_bytes(n, d, itemsize), n
    assert flash_total == flash_bytes(n, d, b, itemsize), n
    assert max(err) < 1e-14, (n, err)  # what the cell printed; rounding is below 3e-15
    assert peak <= sram_limit
# about a quarter of the bytes at b_q = 128 (exactly 4 = 4N^2 / (2N^2 d / b_q) in the limit)
assert 3 < counted[1000][0] / counted[1000][1] < 4
# each key and value is loaded once per query block
for b_q, (loads_per_key, kv_loaded, vs_naive) in reuse.items():
    assert loads_per_key == -(-n_reuse // b_q)
    assert kv_loaded == 2 * n_reuse * d * itemsize * loads_per_key
# chapter 4's stream moves more than the textbook pipeline; wide query blocks move less
assert reuse[1][2] > 0.99 * n_reuse * d / (2 * (n_reuse + d))  # d/2 as N grows
assert reuse[16][2] > 1 and reuse[64][2] < 1 and reuse[128][2] < 0.3
# Θ(N² d² / M), counted by the instrumented loop at N = 2048: the formula to the byte at every M,
# bytes × M within a factor 2 over a 14× range of M, fewer bytes for every larger M
products = flash_vs_m * sram_sizes
assert flash_vs_m.tolist() == formula_vs_m
assert products.max() / products.min() < 2, products
assert np.all(np.diff(flash_vs_m) < 0), flash_vs_m
# counted: naive grows as N² (N = 512 to 2048: 16 times, 14.7 with the 4Nd term), the tiled
# kernel at b_q = 128 moves about 2d / (4 b_q) = 1/4 of it
assert 14 < naive_m.total() / counted[512][0] < 16, naive_m.total() / counted[512][0]
assert abs(flash_vs_m[sram_sizes.tolist().index(163 * 1024)] / naive_m.total() - 0.25) < 0.02
# intensities from the counted bytes: d/2 for the textbook pipeline, about b_q for the tiled kernel
assert abs(model["textbook"][0] - d / 2) / (d / 2) < 0.02
assert abs(model[f"tiled, b_q = {b}"][0] - b) / b < 0.05
assert 0.15 < (flop / peak_rate) / model["textbook"][1] < 0.25  # "at most a fifth of its time"
assert model["textbook"][0] < ridge / 4 and model[f"tiled, b_q = {b}"][0] > ridge / 2
# the capacity: the loop's measured peak for 128 × 128 fits 163 KiB but not 100 KiB; 144 is refused
assert 100 * 1024 < counted[1000][2] <= sram_limit and too_big == "refused by the capacity check"
# an A100's SRAM against its HBM: 2,000 to 4,000 times smaller
assert 1500 < sram_vs_hbm[0] < sram_vs_hbm[1] < 4500, sram_vs_hbm

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
# # 24. Fusion on a CPU: the tile in cache
#
# Chapter 9's argument is that FlashAttention is fast because it never writes the score tile back
# to slow memory between operations. `flash_lib`'s own NumPy kernel cannot follow it: between the
# two matmuls of a tile, each NumPy call (row max, subtract, exponential, row sum) reads the whole
# tile, and some write it back. On a CPU the "slow memory" is one level down: the tile
# (`512 × 512` float64 scores, 2 MiB) lives in L2 or L3, and each pass streams it through L1.
#
# `flash_cpu` keeps the two matmuls as BLAS calls and does everything between them in
# **one** compiled pass per tile (Numba), row by row while a row (`block_k` scores, 4 KiB in
# float64 at 512) sits in L1: mask, running max, exponential, row sum, rescale. This chapter
# counts the bytes each moves between L1 and the tile's level, checks that the fused kernel
# computes what `flash_lib` does, and plots the speed of both against $N$ beside PyTorch's.

# %%
import numpy as np

import flash_cpu
import flash_lib

# %% [markdown]
# ## The bytes a tile moves
#
# Count, for one tile of $b_q \times b_k$ scores of $w$ bytes each, the tile-sized transfers
# between L1 and the level that holds the tile (a pass that reads the tile moves its bytes in
# once; one that writes it, out once). `flash_lib`'s per-tile recurrence
# (`online_softmax_update`, chapter 5) with no mask:
#
# | step | NumPy call | reads | writes |
# | --- | --- | --- | --- |
# | $S = \tau Q_i K_j^\top$ | `matmul` | | 1 |
# | $\max_j S$ | `s.max(axis=-1)` | 1 | |
# | $S - m'$ | `subtract(..., out=s)` | 1 | 1 |
# | $P = e^{S - m'}$ | `exp(..., out=s)` | 1 | 1 |
# | $\sum_j P$ | `p.sum(axis=-1)` | 1 | |
# | $P V_j$ | `matmul` | 1 | |
#
# The fused kernel: BLAS writes $S$ (1), the one pass reads each row into L1 once and writes $P$
# back once (1 + 1), and $P V_j$ reads it (1).

# %%
NUMPY_PASSES = {"S = τQKᵀ": (0, 1), "row max": (1, 0), "subtract": (1, 1), "exp": (1, 1),
                "row sum": (1, 0), "P·V": (1, 0)}
FUSED_PASSES = {"S = τQKᵀ": (0, 1), "fused pass": (1, 1), "P·V": (1, 0)}


def tile_bytes(passes, block_q, block_k, itemsize):
    """Bytes moved between L1 and the tile's level for one tile: the transfers × the tile."""
    return sum(r + w for r, w in passes.values()) * block_q * block_k * itemsize


# a model, counted from the tables above (nothing here is measured, so nothing is asserted)
numpy_bytes = tile_bytes(NUMPY_PASSES, 512, 512, 8)  # flash_lib's default tile, float64
fused_bytes = tile_bytes(FUSED_PASSES, 512, 512, 8)
flops_per_score = 4 * 64  # two matmuls, d = 64
print(f"one 512 × 512 float64 tile: NumPy's passes move {numpy_bytes / 2**20:.0f} MiB, "
      f"the fused kernel's {fused_bytes / 2**20:.0f} MiB")
print(f"flops per byte at the tile's level: {flops_per_score * 512**2 / numpy_bytes:.0f} against "
      f"{flops_per_score * 512**2 / fused_bytes:.0f}")

# %% [markdown]
# Half the bytes, twice the arithmetic intensity at that level: the same $\Theta$ argument as
# chapter 9's HBM count, one level down, with one difference. On a GPU the tile never leaves
# SRAM at all; here even the fused kernel hands the tile to BLAS and back twice, because the
# matmuls are a library's. The count is a model (it ignores the rows' state and what the
# hardware prefetches); what it predicts is that the NumPy kernel's passes cost in proportion to
# the tile's bytes and the fused pass in proportion to its arithmetic, which the timings below
# (and `make bench`'s floor, `bench/bench_cpu.py`) measure.
#
# ## The same attention
#
# `flash_cpu.flash_attention` takes `flash_lib`'s arguments for its subset (`mask`, `causal`,
# `scale`, `return_lse`, `block_q`, `block_k`), validates them with `flash_lib.check_inputs`, and
# keeps its contracts (empty rows, masked keys, bottom-right causal). Its exponential is its own:
# Cody–Waite range reduction, a minimax polynomial by FMAs, $2^n$ added to the exponent bits, so
# that the compiler vectorises it (FlashAttention-4's software exponential, chapter 19, here on
# SIMD lanes).

# %%
rng = np.random.default_rng(24)
q, k, v = (rng.standard_normal((2, 300, 64)) for _ in range(3))
mask = rng.random((300, 300)) < 0.8
mask[17] = False  # an empty row
out, lse = flash_cpu.flash_attention(q, k, v, mask=mask, causal=True, return_lse=True)
ref, ref_lse = flash_lib.flash_attention(q, k, v, mask=mask, causal=True, return_lse=True)
eps = np.finfo(np.float64).eps
assert np.abs(out - ref).max() <= 16 * eps * np.abs(ref).max()
assert np.all(out[:, 17] == 0) and np.all(lse[:, 17] == -np.inf)
x = np.linspace(-708, 0, 100_001)
exact = np.exp(x.astype(np.longdouble))
ulps = np.abs(flash_cpu.exp(x) - exact) / np.spacing(exact.astype(np.float64))
assert ulps.max() <= 1
print("flash_cpu against flash_lib (float64, mask and causal): within 16 eps of the output's "
      f"scale: {np.abs(out - ref).max() <= 16 * eps * np.abs(ref).max()}")
print(f"its exponential on [-708, 0] against long double: within 1 ulp: {ulps.max() <= 1}")

# %% [markdown]
# ## Speed against $N$
#
# Both kernels and PyTorch's SDPA (when installed), float32, $d = 64$, timed in turn round after
# round on this machine (`flash_bench.best_times`), so these figures are this build's, not a
# fact: the page shows them, no cell asserts them. `make bench` measures larger $N$ in both dtypes
# with the per-tile floor (`bench/RESULTS.md` has one run: on a loaded 2-core Xeon, the fused
# kernel took 0.85-0.94 × `flash_lib`'s time and 1.36-1.69 × torch's forward).

# %% tags=["nbval-ignore-output"]
from flash_bench import best_times

try:
    import torch
    torch.set_num_threads(flash_lib.thread_count())
except ImportError:
    torch = None
sizes = [512, 1024, 2048]
seconds = {"flash_lib": [], "flash_cpu": []} | ({"torch SDPA": []} if torch is not None else {})
for n in sizes:
    qn, kn, vn = (np.random.default_rng(n).standard_normal((n, 64)).astype(np.float32)
                  for _ in range(3))
    fns = {"flash_lib": lambda: flash_lib.flash_attention(qn, kn, vn),
           "flash_cpu": lambda: flash_cpu.flash_attention(qn, kn, vn)}
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(a)[None, None] for a in (qn, kn, vn))
        fns["torch SDPA"] = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
    best, _ = best_times(fns, 1.5)
    for name in seconds:
        seconds[name].append(best[name])
print("best time (ms):", "; ".join(f"{name} " + ", ".join(f"{1e3 * t:.1f}" for t in ts)
                                   for name, ts in seconds.items()), f"at N = {sizes}")

# %% tags=["hide-input"]
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6.5, 4))
for i, (name, ts) in enumerate(seconds.items()):
    ax.loglog(sizes, 1e3 * np.array(ts), "o-", color=f"C{i}", label=name)
ax.set_xscale("log", base=2)
ax.set_xticks(sizes, [str(n) for n in sizes])
ax.set_xlabel("N = Nq = Nk (tokens)")
ax.set_ylabel("best time (ms)")
ax.set_title("Forward, float32, d = 64: NumPy passes, one fused pass, PyTorch")
ax.grid(True, which="major", alpha=0.3)
ax.legend()
plt.show()

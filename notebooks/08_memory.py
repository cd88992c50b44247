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
# # 8. Memory: working memory against N
#
# The textbook kernel stores the $N_q \times N_k$ score matrix; the tiled one never holds more
# than one tile of it. (Streaming over the keys is what bounds the memory: chapter 4's single
# query already did. The second dimension of tiling, blocks of queries, exists to cut the bytes
# *moved*, which chapter 9 counts.) This chapter measures the memory from the outside, by
# counting allocations, rather than taking the kernel's word for it. In this chapter:
#
# - we measure the scratch memory of both kernels (the peak allocated during a call, minus the
#   arrays it returns) for $N = N_q = N_k$ from 256 to 4096;
# - `naive_attention`'s scratch grows as $N^2$: a slope of 2 on log-log axes, about three
#   $N \times N$ arrays at its peak;
# - `flash_attention`'s scratch does not depend on $N$ once $N$ fills a tile, at each of three
#   tile sizes, and sits between 1 and 2 times
#   $\text{block\_q} \cdot (\text{block\_k} + d + d_v)$ numbers;
# - at $N = 4096$ the naive kernel already needs over 100 times the scratch of the tiled one.

# %%
import os

# One worker: flash_lib runs query blocks on a thread pool, and T workers hold T blocks' tiles
# at once. Set before the import, which reads it. What we measure is then one worker's memory.
os.environ["FLASH_LIB_THREADS"] = "1"

import numpy as np
import matplotlib.pyplot as plt
from threadpoolctl import threadpool_limits

import flash_lib

assert flash_lib.thread_count() == 1, "flash_lib was imported before FLASH_LIB_THREADS was set: restart"
rng = np.random.default_rng(8)

# %% [markdown]
# ## What is measured
#
# `flash_lib.measure_peak_bytes(fn, *args)` runs `fn` under Python's `tracemalloc`, which sees
# every allocation Python makes, NumPy's array buffers included, and returns the peak of the
# traced total during the call above its value at the start. That peak includes the returned
# arrays, so we subtract them:
#
# $$\text{scratch} = \text{peak} - \texttt{out.nbytes} - \texttt{lse.nbytes} .$$
#
# Both kernels return `lse` too (FlashAttention's forward keeps it for the backward), so the
# $N$ row statistics count as output. Inputs are float32 with $d = d_v = 32$.
#
# `FLASH_LIB_THREADS=1` (above) makes flash process its query blocks one after another: one
# worker's memory ($T$ workers hold up to $T$ times as much, still independent of $N$). BLAS
# runs single-threaded, which changes no allocation `tracemalloc` sees.

# %%
d = dv = 32
dtype = np.float32
itemsize = np.dtype(dtype).itemsize


def scratch_bytes(kernel, n, **kwargs):
    """Peak bytes allocated while `kernel` runs on N = Nq = Nk, minus what it returns."""
    q = rng.standard_normal((n, d), dtype=dtype)
    k = rng.standard_normal((n, d), dtype=dtype)
    v = rng.standard_normal((n, dv), dtype=dtype)
    (out, lse), peak = flash_lib.measure_peak_bytes(kernel, q, k, v, return_lse=True, **kwargs)
    return peak - out.nbytes - lse.nbytes


# %% [markdown]
# ## The textbook kernel
#
# `naive_attention` builds $S = \text{scale} \cdot q k^\top$, then $S - m$, then
# $e^{S - m}$: three $N \times N$ arrays are alive together at its peak. We stop at $N = 4096$
# (three 64 MiB arrays); beyond that we extrapolate. A straight line fitted to
# $\log(\text{scratch})$ against $\log N$ gives the growth exponent.

# %%
sizes_naive = [256, 512, 1024, 2048, 4096]
with threadpool_limits(limits=1, user_api="blas"):
    naive_scratch = np.array([scratch_bytes(flash_lib.naive_attention, n) for n in sizes_naive])

slope_naive, intercept_naive = np.polyfit(np.log(sizes_naive), np.log(naive_scratch), 1)
n_by_n_arrays = naive_scratch[-1] / (sizes_naive[-1] ** 2 * itemsize)
print(f"naive: scratch grows as N^{slope_naive:.1f} on log-log axes")
print(f"naive at N = 4096: {n_by_n_arrays:.0f} N×N float32 arrays at its peak")

# %% [markdown]
# ## The tiled kernel
#
# `flash_attention` holds, per query block, the scores tile ($\text{block\_q} \times
# \text{block\_k}$), the scaled query block ($\text{block\_q} \times d$) and the accumulator
# ($\text{block\_q} \times d_v$), plus a few numbers per row ($m$, $l$) and short-lived
# temporaries. So its scratch should be independent of $N$, near
#
# $$\text{block\_q} \cdot (\text{block\_k} + d + d_v) \cdot \text{itemsize} .$$
#
# We measure three square tile sizes, 128, 256 and 512, over $N$ from 256 to 4096. One small
# call first, unmeasured, so that one-time allocations (NumPy's caches filling up) are not
# counted against the first size.

# %%
sizes_flash = [256, 512, 1024, 2048, 4096]
blocks = [128, 256, 512]
with threadpool_limits(limits=1, user_api="blas"):
    scratch_bytes(flash_lib.flash_attention, 256, block_q=128, block_k=128)  # warm-up
    flash_scratch = {
        b: np.array([scratch_bytes(flash_lib.flash_attention, n, block_q=b, block_k=b)
                     for n in sizes_flash])
        for b in blocks
    }

# For N below the tile size the tile is cut to N rows and columns: compare from N = tile size on.
full_tiles = {b: np.array(sizes_flash) >= b for b in blocks}
tile_bound = {b: b * (b + d + dv) * itemsize for b in blocks}
flatness = {b: flash_scratch[b][full_tiles[b]].max() / flash_scratch[b][full_tiles[b]].min()
            for b in blocks}
to_bound = {b: flash_scratch[b][full_tiles[b]] / tile_bound[b] for b in blocks}
for b in blocks:
    print(f"flash, {b}×{b} tiles, N = {max(b, sizes_flash[0])}..{sizes_flash[-1]}: largest / "
          f"smallest scratch {flatness[b]:.1f};\n   scratch / (block_q·(block_k + d + dv)·"
          f"itemsize): median over N {np.median(to_bound[b]):.1f}")

# %% [markdown]
# ## The picture
#
# Log-log axes. The dashed grey line is $N^2$ through naive's points, carried on to 16384 (where
# naive would need gigabytes; both kernels are measured up to 4096); each
# dotted line is the tile bound of the flash curve of the same colour.

# %% tags=["hide-input"]
naive_fit = lambda n: np.exp(intercept_naive) * np.asarray(n, dtype=float) ** slope_naive

fig, ax = plt.subplots(figsize=(8, 4.5))
ax.loglog(sizes_naive, naive_scratch, "s-", color="C3", label="naive_attention")
sizes_fit = sizes_flash + [8192, 16384]
ax.loglog(sizes_fit, naive_fit(sizes_fit), "--", color="0.4", lw=1,
          label=r"$\propto N^{2}$ (fit to naive, extended)")
for i, b in enumerate(blocks):
    ax.loglog(sizes_flash, flash_scratch[b], "o-", color=f"C{i}",
              label=f"flash_attention, block_q = block_k = {b}")
    ax.axhline(tile_bound[b], ls=":", color=f"C{i}", lw=1)
ax.plot([], [], ":", color="0.4", lw=1, label=r"$O(1)$: block_q·(block_k + d + d$_v$)·itemsize")
ax.set_xscale("log", base=2)
ax.set_xticks(sizes_fit, [str(n) for n in sizes_fit])
ax.set_title("Scratch memory per call, float32, d = dv = 32, one worker")
ax.set_xlabel("N = Nq = Nk (tokens)")
ax.set_ylabel("peak allocated beyond the outputs (bytes)")
byte_ticks = [2**16, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28, 2**30, 2**32]
ax.set_yticks(byte_ticks, ["64 KiB", "256 KiB", "1 MiB", "4 MiB", "16 MiB", "64 MiB", "256 MiB",
                           "1 GiB", "4 GiB"])
ax.minorticks_off()
ax.grid(True, which="major", alpha=0.3)
ax.legend(fontsize=8, loc="upper left")
fig.tight_layout()
plt.show()

# %% [markdown]
# Below $N = $ the tile size, flash's tile is cut down to $N$, hence the rise of the 512 line at
# the left; from the tile size on, every doubling of $N$ multiplies naive's memory by 4 and
# leaves flash's where it was.

# %%
ratio_4096 = {b: naive_scratch[-1] / flash_scratch[b][sizes_flash.index(4096)] for b in blocks}
print("at N = 4096, naive's scratch / flash's, to 2 digits:",
      ", ".join(f"{float(f'{r:.2g}'):g} ({b}×{b})" for b, r in ratio_4096.items()))
extrapolated_gib = np.exp(intercept_naive) * 16384.0**slope_naive / 2**30
print(f"naive at N = 16384, extrapolated: about {extrapolated_gib:.0f} GiB "
      f"(flash with 512×512 tiles: under 2 MiB)")
# what a kernel that kept something per tile would pay: the number of 128 × 128 tiles over this
# range of N, counted by the schedule flash_attention runs
tiles_128 = [len(flash_lib.tile_schedule(n, n, 128, 128)) for n in (sizes_flash[0], sizes_flash[-1])]
print(f"128 × 128 tiles: {tiles_128[0]} at N = {sizes_flash[0]}, {tiles_128[1]} at "
      f"N = {sizes_flash[-1]}: {tiles_128[1] // tiles_128[0]}-fold")

# %% [markdown]
# On a GPU the tile lives in one thread block's on-chip memory, so the same bound limits
# `block_q` and `block_k` there ({doc}`chapter 9 <09_memory_traffic>`). What never appears in
# memory, on any device, is the $N \times N$ matrix.

# %% [markdown]
# ## What we showed
#
# - `naive_attention`'s scratch grows as $N^2$ (fitted log-log slope 1.9 to 2.1): about three
#   $N \times N$ float32 arrays at $N = 4096$ (2.5 to 3.5).
# - `flash_attention`'s scratch is flat in $N$: for each of the tile sizes 128, 256 and 512, the
#   largest and smallest values over $N$ from the tile size to 4096 differ by less than 10%
#   (below the tile size the tile shrinks with $N$, and so does the scratch). The margin is for
#   the few KiB of Python objects that come and go during a call, a few percent of the 128 × 128
#   tiles' scratch; anything kept per tile would grow with the number of tiles, 256-fold over
#   this range at 128 × 128 (4 tiles at $N = 256$, 1024 at 4096).
# - It lies between 1 and 2 times $\text{block\_q} \cdot (\text{block\_k} + d + d_v) \cdot
#   \text{itemsize}$, for one worker.
# - At $N = 4096$ naive needs over 100 times the scratch of flash at every tile size; at
#   $N = 16384$ it would need about 3 GiB, flash under 2 MiB.

# %%
assert 1.9 <= slope_naive <= 2.1, slope_naive
assert 2.5 <= n_by_n_arrays <= 3.5, n_by_n_arrays
for b in blocks:
    assert flatness[b] < 1.1, (
        f"flash scratch with {b}×{b} tiles varies with N: {flash_scratch[b]}. Is something "
        "stored per tile or per block (a list of tiles, one future per block)?")
    assert np.all((to_bound[b] >= 1) & (to_bound[b] <= 2)), (b, to_bound[b])
    assert ratio_4096[b] > 100, (b, ratio_4096[b])
assert tiles_128 == [4, 1024], tiles_128  # "256-fold": the tiles the kernel's schedule visits
assert round(extrapolated_gib) == 3, extrapolated_gib
assert flash_scratch[512].max() < 2 * 2**20

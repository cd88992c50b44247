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
# # 10. Speed: time and GFLOP/s against N and tile size
#
# FlashAttention on a GPU is fast because it never writes the score matrix to slow memory. A
# NumPy kernel has other costs: every NumPy call pays a fixed Python overhead, and `exp` runs on
# one core. This chapter measures `flash_lib` on whatever machine runs it, against the machine's
# matrix-product rate in GFLOP/s ($10^9$ floating-point operations per second) on a large GEMM
# (BLAS's general matrix-matrix multiply), against `naive_attention` (and PyTorch's
# `scaled_dot_product_attention` when installed) for $N$ from 512 to 2048, and against the floor
# of its own tiles; then it times the tiles causal attention skips.
#
# Timings depend on the machine and its load, so they appear only in the plots and in cells
# whose output the notebook's test (nbval) ignores; nothing *asserts* a speed (on a shared
# machine a timing can be off by a factor of two), only what timing cannot change: every
# kernel's output, and the tile counts. `make bench` runs the full benchmark
# (`bench/bench_flash.py`).

# %%
import os

import numpy as np
import matplotlib.pyplot as plt
from threadpoolctl import threadpool_limits

import flash_bench
import flash_lib

rng = np.random.default_rng(9)

# %% [markdown]
# ## How we time
#
# The best wall-clock time of several runs (the least disturbed), the kernels timed in turn,
# round after round, so that a busy moment slows them alike, each after some untimed runs
# (`flash_bench.best_times`). Rates count the two matrix products only, the usual convention for
# attention (`exp`, the maxima and the sums come on top):
#
# $$\text{FLOP} = \underbrace{2 N_q N_k d}_{q k^\top} + \underbrace{2 N_q N_k d_v}_{P v}
#   = 4 N^2 d \quad (N_q = N_k = N,\ d_v = d) .$$
#
# Inputs are float32 with $d = d_v = 64$, a common head size.

# %%
d = 64
dtype = np.float32


def attention_flop(n, d=d):
    """4·N²·d: the flops of q kᵀ and of P v for N = Nq = Nk and dv = d."""
    return 4 * n * n * d


def best_times(fns, settle=0.15):
    """Best wall time of each callable in `fns` (a dict), timed in turn, round after round: at
    least 2 rounds, more (up to 20) until 0.25 s have passed, each call after `settle` seconds
    of untimed runs, so that threads left spinning by the previous kernel have gone idle. The
    project's one timing loop (`flash_bench.best_times`, which `make bench` uses too)."""
    return flash_bench.best_times(fns, seconds=0.25, min_rounds=2, max_rounds=20, settle=settle)[0]


def random_inputs(n):
    return tuple(rng.standard_normal((n, d), dtype=dtype) for _ in range(3))


# %% [markdown]
# ## The ceiling: this machine's GEMM rate
#
# A $1024 \times 1024$ float32 matrix product, $2 \cdot 1024^3$ flops, through the BLAS that
# NumPy uses for the kernels' `@`. Attention's counted flops are matrix-product flops, so a
# kernel doing nothing else would at best reach this rate; the extra passes (`exp`, max, sum,
# rescaling) only lower it. We keep the larger of the all-core rate and the one-thread rate
# times the number of cores (on a busy machine a multi-threaded product waits for its slowest
# thread).

# %%
try:
    cores = len(os.sched_getaffinity(0))  # the cores this process may run on
except AttributeError:  # macOS, Windows
    cores = os.cpu_count() or 1
gemm_a, gemm_b = (rng.standard_normal((1024, 1024), dtype=dtype) for _ in range(2))
gemm_a @ gemm_b  # warm-up: BLAS threads start, output pages are touched


def gemm_gflops():
    """max(all-core GEMM rate, one-core GEMM rate · cores), in GFLOP/s, best of a few runs."""
    flop = 2 * 1024**3
    all_cores = best_times({"gemm": lambda: gemm_a @ gemm_b})["gemm"]
    with threadpool_limits(limits=1, user_api="blas"):
        one_core = best_times({"gemm": lambda: gemm_a @ gemm_b})["gemm"]
    return max(flop / all_cores, cores * flop / one_core) / 1e9


gemm_rate = gemm_gflops()

# %% [markdown]
# ## Flash against naive, as $N$ grows
#
# Both kernels compute the same flops. `naive_attention` does each matrix product as one large
# BLAS call and its softmax as a few NumPy passes over $N^2$ numbers, through main memory once
# they outgrow the caches. `flash_attention` (default tiles `block_q` × `block_k` =
# `DEFAULT_BLOCK_Q` × `DEFAULT_BLOCK_K`) does a dozen or so NumPy calls per tile on data that
# stays in cache and, once the problem is large enough to pay for it, runs its query blocks on a
# thread pool, so that the single-threaded passes (`exp` above all) use every core. Each output
# is checked against naive's before timing.

# %%
sizes = [512, 1024, 2048]
print(f"flash_attention's default tiles: block_q = {flash_lib.DEFAULT_BLOCK_Q}, "
      f"block_k = {flash_lib.DEFAULT_BLOCK_K}")

kernels = {"flash": flash_lib.flash_attention, "naive": flash_lib.naive_attention}

# %% [markdown]
# PyTorch joins where installed: its CPU `scaled_dot_product_attention`, a compiled kernel, is a
# yardstick for the same algorithm without Python in the loop; it brings its own matrix-product
# library, so NumPy's GEMM rate is not its ceiling.

# %%
try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = None  # the comparison is flash against naive
else:
    # SDPA takes (batch, heads, N, d): a 4-d view of the same float32 numbers, no copy.
    kernels["torch SDPA"] = lambda q, k, v: F.scaled_dot_product_attention(
        *(torch.from_numpy(x)[None, None] for x in (q, k, v)))[0, 0].numpy()

# %%
errors = {name: 0.0 for name in kernels}  # each kernel's largest error against naive's output
seconds = {name: [] for name in kernels}
for n in sizes:
    q, k, v = random_inputs(n)
    reference = flash_lib.naive_attention(q, k, v)
    for name, kernel in kernels.items():
        out = np.asarray(kernel(q, k, v))  # untimed first run, also the check
        errors[name] = max(errors[name], float(np.abs(out - reference).max() / np.abs(reference).max()))
    numpy_kernels = [name for name in kernels if name != "torch SDPA"]
    best = best_times({name: (lambda f=kernels[name]: f(q, k, v)) for name in numpy_kernels})
    if "torch SDPA" in kernels:
        # In rounds of its own: PyTorch's OpenMP threads keep spinning for a moment after each
        # call, and a multi-threaded BLAS call right after it would pay for that.
        best.update(best_times({"torch SDPA": lambda: kernels["torch SDPA"](q, k, v)}))
    for name in kernels:
        seconds[name].append(best[name])

gflops = {name: np.array([attention_flop(n) for n in sizes]) / np.array(t) / 1e9
          for name, t in seconds.items()}
max_error = max(errors.values())
# The same check in float64, where rounding is 1e-16 and a kernel off by one part in a million
# shows: the float32 check above could not tell (its rounding is about 1e-6). N = 1024 is 2 × 2
# default tiles, so flash's online softmax is exercised (at N = 512 it is naive's computation).
n64 = 1024
check_rng = np.random.default_rng(90)
q64, k64, v64 = (check_rng.standard_normal((n64, d)) for _ in range(3))
reference64 = flash_lib.naive_attention(q64, k64, v64)
error64 = float(np.abs(flash_lib.flash_attention(q64, k64, v64) - reference64).max()
                / np.abs(reference64).max())
print(f"every kernel's output against naive's, relative to the output's scale (float32, "
      f"N = {sizes[0]} to {sizes[-1]}):\n   within 1e-4: {max_error < 1e-4}")
print(f"flash's in float64, N = {n64}: within 1e-12: {error64 < 1e-12}")

# %% tags=["nbval-ignore-output"]
print(f"on the machine that built this page: GEMM ceiling {gemm_rate:.0f} GFLOP/s (float32, "
      f"{cores} cores);\nflash_lib runs up to {flash_lib.thread_count()} worker threads")
print(f"PyTorch {torch.__version__}: timing its SDPA too, with {torch.get_num_threads()} threads"
      if torch is not None else
      "PyTorch is not installed here: the comparison is flash against naive.")
print("errors against naive's output:", ", ".join(f"{name} {e:.0e}" for name, e in errors.items()),
      f"(float32); flash in float64 {error64:.0e}")
print("best time (ms) | GFLOP/s | % of the GEMM ceiling")
print(f"{'N':>5}" + "".join(f"{name:>25}" for name in kernels))
for i, n in enumerate(sizes):
    print(f"{n:>5}" + "".join(
        f"{1e3 * seconds[name][i]:>11.2f} | {gflops[name][i]:5.1f} | "
        f"{100 * gflops[name][i] / gemm_rate:2.0f}%"
        for name in kernels))
print(f"flash time / naive time at N = {sizes[-1]}: "
      f"{seconds['flash'][-1] / seconds['naive'][-1]:.2f}")
# The N² growth, as measured (an observation, not an assert: see the top of the chapter).
i_small, i_large = sizes.index(512), sizes.index(2048)
print("time at N = 2048 / time at N = 512 (N² predicts 16 once fixed costs are negligible):\n   "
      + ", ".join(f"{name} {seconds[name][i_large] / seconds[name][i_small]:.1f}"
                  for name in kernels))

# %% [markdown]
# Left, the time: the work grows as $N^2$ ($4N^2d$ flops), so once the arithmetic outweighs a
# call's fixed costs the time should too; the dashed line is $N^2$ through naive's largest point
# (the ratio printed above is this build's measurement). Right, the rate, with the GEMM ceiling.

# %% tags=["hide-input"]
fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4.5))
for i, name in enumerate(kernels):
    ax_t.loglog(sizes, seconds[name], "o-", color=f"C{i}", label=name)
    ax_r.semilogx(sizes, gflops[name], "o-", color=f"C{i}", label=name)
n_line = np.array([sizes[0], sizes[-1]])
ax_t.loglog(n_line, seconds["naive"][-1] * (n_line / sizes[-1]) ** 2, "--", color="0.5", lw=1,
            label=r"$\propto N^2$")
ax_r.axhline(gemm_rate, ls="--", color="k", lw=1,
             label=f"GEMM ceiling, {gemm_rate:.0f} GFLOP/s (float32)")
for ax in (ax_t, ax_r):
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_xlabel("N = Nq = Nk (tokens)")
    ax.grid(True, which="major", alpha=0.3)
ax_t.legend(fontsize=8, loc="upper left")
# between the data and the ceiling line, which sits near the top of the axes
ax_r.legend(fontsize=8, loc="center right")
ax_t.set_ylabel("best wall time (s)")
ax_t.set_title(f"Time, float32, d = {d}")
ax_r.set_ylim(0, 1.15 * max(gemm_rate, *(r.max() for r in gflops.values())))
ax_r.set_ylabel("GFLOP/s (4·N²·d flops / time)")
ax_r.set_title("Rate against the machine's GEMM rate")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The floor: what one tile cannot avoid
#
# A tile of `flash_attention` is a fixed list of NumPy calls (`online_softmax_update`): the
# product $q k^\top$, the row maximum, a few updates of the row vectors $m$, $\alpha$ and $l$,
# the subtraction of $m$, the exponential (`np.exp`, or `np.exp2` in base 2,
# {doc}`chapter 5 <05_tiling>`), the row sum, the product $P v$ and the rescale of `acc`. No
# kernel computing the tile with these calls can take less than the sum of their times.
# `flash_bench` times them one by one on one thread, in the kernel's order and on buffers laid
# out as the kernel's, each keeping its best time. Their sum is the tile's *floor*; the floor
# model of a whole call is
#
# $$T_\text{floor}(N) = \text{floor of one tile} \times
#   \frac{\text{tiles visited}}{\text{worker threads}} ,$$
#
# with the tiles counted by `tile_schedule` and the workers those `flash_attention` runs on (one
# for a call of fewer than $2^{20}$ scores, else up to one per query block). Assuming the
# threads share the tiles evenly and never slow each other, the model can only undershoot: the
# kernel also spends Python between the calls, and its threads wait and contend.

# %%
tile_q, tile_k = flash_lib.DEFAULT_BLOCK_Q, flash_lib.DEFAULT_BLOCK_K
# float32, the dtype timed above, and float64, for the breakdown below
floor_ops = {name: flash_bench.forward_floor(t, tile_q, tile_k, d, seconds=0.4)
             for name, t in (("float32", np.float32), ("float64", np.float64))}
per_tile = {name: sum(ops.values()) for name, ops in floor_ops.items()}
matmul_per_tile = sum(s for op, s in floor_ops["float32"].items() if op in flash_bench.MATMULS)
floor_model = np.array([flash_bench.floor_seconds(per_tile["float32"], n) for n in sizes])
matmul_model = np.array([flash_bench.floor_seconds(matmul_per_tile, n) for n in sizes])
print(f"one {tile_q} × {tile_k} tile, each call timed: "
      + ", ".join("exp or exp2" if op in flash_bench.EXPONENTIALS else op
                  for op in floor_ops["float32"]))
print("tiles visited: " + ", ".join(
    f"{len(flash_lib.tile_schedule(n, n, tile_q, tile_k))} at N = {n}" for n in sizes))

# %%
floor_bars = [(name, flash_bench.kernel_exponential(name), ops) for name, ops in floor_ops.items()]

# %% tags=["nbval-ignore-output"]
print(f"on the machine that built this page ({flash_bench.cpu_name()}), the floor of one tile, "
      "µs, one thread:")
for name, exp_name, ops in floor_bars:
    total = sum(ops.values())
    print(f"  {name}, {exp_name}: {1e6 * total:.0f} = "
          + " + ".join(f"{op} {1e6 * s:.0f}" for op, s in ops.items())
          + f"; {exp_name} {100 * ops[exp_name] / total:.0f}%")
print("float32 kernel / floor model: " + ", ".join(
    f"N = {n}: {t / f:.2f}" for n, t, f in zip(sizes, seconds["flash"], floor_model)))

# %% [markdown]
# Left: the kernel's measured time against the floor model, each point labelled kernel / floor;
# dotted, the model's two matmuls alone. Right: the floor of one tile, op by op, per dtype.

# %% tags=["hide-input"]
groups = [("matmuls q·kᵀ, P·v", "C0", lambda op: op in flash_bench.MATMULS),
          ("exp or exp2", "C3", lambda op: op in flash_bench.EXPONENTIALS),
          ("max, subtract, sum, rescale, row state", "C7",
           lambda op: op not in flash_bench.MATMULS and op not in flash_bench.EXPONENTIALS)]
fig, (ax_m, ax_b) = plt.subplots(1, 2, figsize=(12.5, 4.8), gridspec_kw={"width_ratios": [1, 1.25]})
ax_m.loglog(sizes, seconds["flash"], "o-", color="C0", label="flash_attention, measured")
ax_m.loglog(sizes, floor_model, "s--", color="C1", label="floor model: tile floor × tiles / workers")
ax_m.loglog(sizes, matmul_model, ":", color="0.4", label="the model's two matmuls alone")
for n, t, f in zip(sizes, seconds["flash"], floor_model):
    ax_m.annotate(f"{t / f:.2f}×", (n, t), textcoords="offset points", xytext=(-8, 8), fontsize=8)
ax_m.set_xscale("log", base=2)
ax_m.set_xticks(sizes, [str(n) for n in sizes])
ax_m.set_xlabel("N = Nq = Nk (tokens)")
ax_m.set_ylabel("time (s)")
ax_m.set_title(f"flash_attention against its floor, float32, d = {d}", fontsize=10)
ax_m.grid(True, which="major", alpha=0.3)
ax_m.margins(y=0.2)  # room for the ratios above the points
ax_m.legend(fontsize=8, loc="upper left")
labels = [f"{name}\n(np.{exp_name})" for name, exp_name, _ in floor_bars]
for i, (name, exp_name, ops) in enumerate(floor_bars):
    left, total = 0.0, sum(ops.values())
    for g, (group, color, member) in enumerate(groups):
        width = 1e6 * sum(s for op, s in ops.items() if member(op))
        ax_b.barh(i, width, left=left, color=color, label=group if i == 0 else None)
        if group == "exp or exp2":
            ax_b.text(left + width / 2, i, f"{100 * width / (1e6 * total):.0f}%", ha="center",
                      va="center", color="w", fontsize=8)
        left += width
    ax_b.text(left, i, f" {left:.0f} µs", va="center", fontsize=8)
ax_b.set_yticks(range(len(floor_bars)), labels, fontsize=8)
ax_b.invert_yaxis()
ax_b.set_xlim(0, 1.6e6 * max(sum(ops.values()) for *_, ops in floor_bars))  # room: legend
ax_b.set_xlabel(f"µs per {tile_q} × {tile_k} tile, one thread (best of repetitions)")
ax_b.set_title("The floor of one tile, op by op (the exponential: its share)", fontsize=10)
ax_b.legend(fontsize=8, loc="upper right")
try:
    load = f", load average {os.getloadavg()[0]:.1f}"
except (AttributeError, OSError):  # Windows
    load = ""
fig.suptitle(f"measured on {flash_bench.cpu_name()} ({cores} cores{load})", fontsize=9)
fig.tight_layout()
plt.show()

# %% [markdown]
# The matmuls are most of the floor; the rest splits between the exponential and four cheap
# passes. The exponential's share, and whether the kernel uses `exp` or `exp2`, depend on which
# vector loops NumPy runs on the CPU (the
# {doc}`appendix on testing <28_how_chapters_7_to_23_are_tested>` measures the floor again with
# NumPy's AVX-512 loops off).
#
# ## Tile size: the floor per score
#
# A tile costs a fixed number of NumPy calls, each a few microseconds of Python whatever its
# size, plus arithmetic in proportion to its area, so the floor *per score* falls as the tile
# grows, until the arithmetic outweighs the calls. The cell times square tiles from 16 to 256.
# On a GPU no such per-call cost exists; the tile is bounded instead by on-chip memory
# ({doc}`chapter 9 <09_memory_traffic>`).

# %%
tile_sides = [16, 64, 256]
floor_by_side = {b: sum(flash_bench.forward_floor(np.float32, b, b, d, seconds=0.3).values())
                 for b in tile_sides}

# %% tags=["nbval-ignore-output"]
print("on the machine that built this page, float32, one thread:")
for b_side, t in floor_by_side.items():
    print(f"  {b_side:>3} × {b_side:<3} tile: floor {1e6 * t:8.1f} µs, {1e9 * t / b_side**2:6.2f} ns "
          f"per score")

# %% [markdown]
# ## Causal attention: the tiles it skips
#
# With `causal=True`, `flash_attention` skips the tiles above the diagonal
# ({doc}`chapter 6 <06_masks_and_empty_rows>` counts them). Time follows tiles only roughly: the
# diagonal tiles carry extra masking work, and the query blocks no longer cost the same, so the
# thread pool's last blocks may finish unevenly. Both are timed at $N = 2048$ with the default
# tiles, the speed-up set against the ratio of tiles.

# %%
n_causal = 2048
bq, bk = flash_lib.DEFAULT_BLOCK_Q, flash_lib.DEFAULT_BLOCK_K
tile_ratio = (len(flash_lib.tile_schedule(n_causal, n_causal, bq, bk))
              / len(flash_lib.tile_schedule(n_causal, n_causal, bq, bk, causal=True)))
print(f"N = {n_causal}, default {bq} × {bk} tiles: causal visits {tile_ratio:.2f}× fewer tiles")
q, k, v = random_inputs(n_causal)
causal_best = best_times({
    "full": lambda: flash_lib.flash_attention(q, k, v),
    "causal": lambda: flash_lib.flash_attention(q, k, v, causal=True),
}, settle=0.01)
causal_speedup = causal_best["full"] / causal_best["causal"]

# %% tags=["nbval-ignore-output"]
print(f"on the machine that built this page, N = {n_causal}: causal is {causal_speedup:.2f}× "
      f"faster\nthan full attention, for {tile_ratio:.2f}× fewer tiles")

# %% [markdown]
# ## What we showed
#
# - Every timed kernel matched `naive_attention` (within $10^{-4}$ in float32, relative to the
#   output's scale); flash's float64 result is within $10^{-12}$ of naive's.
# - Causal attention visits chapter 6's count of tiles, 1.60 times fewer at $N = 2048$.
# - The floor model, a tile's NumPy calls timed alone × tiles / worker threads, is what the
#   kernel cannot beat; the matmuls are most of it. Small tiles pay for their calls: per score,
#   a 16 × 16 tile's floor was about 15 times a 256 × 256 tile's on the 2-core Intel Xeon this
#   chapter was last revised on (a timing, not asserted).
# - The rates, the kernel against its floor and the causal speed-up are observations of this
#   build, not claims: compare a kernel with its own machine's matrix-product rate, measured in
#   the same run, not with another machine's numbers.

# %%
# 1e-4: float32 attention over up to 2048 keys errs by about 1e-6 (chapter 7); a wrong kernel by 0.1
assert max_error < 1e-4, max_error
# 1e-12: float64 rounding is about 1e-15 here (chapter 7), a kernel off by 1e-6 fails
assert error64 < 1e-12, error64
# the causal tile count, derived: n(n+1)/2 of n^2 square tiles (timings are never asserted)
n_tiles = n_causal // bq
assert bq == bk and tile_ratio == n_tiles**2 / (n_tiles * (n_tiles + 1) / 2), tile_ratio

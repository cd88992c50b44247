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
# # 16. On a GPU: the Triton kernel
#
# Fifteen chapters derived FlashAttention and wrote it in NumPy. This one shows it as a GPU
# kernel, in [Triton](https://triton-lang.org), a Python dialect in which one writes the program
# of one *thread block* and the compiler maps it onto the GPU's threads. The kernel lives in
# `flash_triton.py`, beside `flash_lib.py`. There is no GPU on the machine that runs this
# notebook, and there need not be one on yours: Triton's **interpreter** (`TRITON_INTERPRET=1`)
# runs the same `@triton.jit` functions on the CPU, one thread block after another, with NumPy
# doing the arithmetic. It is slow, but it is the kernel, line for line, and so
# chapter 23's conformance suite can check it. In this chapter:
#
# - the GPU's execution model (grid, thread blocks on streaming multiprocessors, warps,
#   registers, shared memory, HBM, tensor cores) and where each piece of flash_lib's tile loop
#   goes;
# - the forward kernel shown whole and read line by line against chapter 5's algorithm box, and
#   the backward against chapter 12's loop;
# - `exp2`, and why the scale is folded into the change of base;
# - causal tiles skipped and the diagonal masked, counted;
# - FlashAttention-2's work partitioning: why cutting non-matmul flops mattered when an A100
#   does 312 TFLOP/s of matmul and 19.5 TFLOP/s of everything else;
# - the bytes and flops of one tile on an A100 and an H100, against chapter 9's roofline;
# - FlashAttention-3 on Hopper: warp specialisation, TMA, ping-pong, intra-warpgroup overlap,
#   FP8, with the figures its paper reports;
# - a planted bug (a missing rescale) in the Triton kernel, caught by `flash_check` with its
#   diagnosis.
#
# Every GPU figure below is quoted from a datasheet or a paper, named beside it. **Nothing about
# GPU speed is measured here**: the only times in this chapter are the interpreter's, on a CPU.

# %%
import inspect
import math
import time

import matplotlib.pyplot as plt
import numpy as np

import flash_check
import flash_lib

rng = np.random.default_rng(16)

# %% tags=["needs-triton"]
# flash_triton before triton: on a machine without CUDA it sets TRITON_INTERPRET=1, which Triton
# reads when it is first imported (its own helpers, tl.zeros, tl.max, ..., are @triton.jit functions).
import flash_triton
import triton

print(f"triton {triton.__version__}; interpreted: {flash_triton.INTERPRETED}; "
      f"tensors on: {flash_triton.DEVICE}")

# %% [markdown]
# ## The execution model
#
# A GPU kernel is launched over a **grid** of **programs** (CUDA calls them thread blocks, or
# CTAs). The hardware hands each program to one **streaming multiprocessor** (SM); an A100 has 108
# of them, an H100 SXM5 132. A program runs as a few **warps**, groups of 32 threads that execute
# one instruction together; Triton's `num_warps` (4 by default) says how many, and the compiler
# decides which thread holds which element of a tile. Three memories matter:
#
# | where | size (A100 / H100 SXM5) | what lives there in FlashAttention |
# |---|---|---|
# | **registers**, private to each thread | 256 KB per SM on both | $S$, $P$, the accumulator `acc`, $m$, $\ell$: fp32 |
# | **shared memory** (SRAM), per SM, shared by one program's warps | up to 164 KB / 228 KB per SM, 163 KB / 227 KB per program | the $K_j$, $V_j$ tiles being multiplied |
# | **HBM**, the GPU's main memory | 40–80 GB at 1.6–2.0 TB/s / 80 GB at 3.35 TB/s | $Q, K, V$, the output, the lse |
#
# (NVIDIA A100 Tensor Core GPU datasheet and Ampere architecture whitepaper; NVIDIA H100 Tensor
# Core GPU datasheet and Hopper architecture whitepaper; the shared memory per program from the
# CUDA C++ Programming Guide, compute capabilities 8.0 and 9.0, and NVIDIA's Ampere and Hopper
# tuning guides: "CUDA reserves 1 KB of shared memory per thread block".) The **tensor cores** multiply small
# matrix tiles in a few instructions; they are where nearly all of an A100's 312 TFLOP/s of
# float16 arithmetic comes from. Everything else, the max, the exponentials, the sums, runs on
# the ordinary fp32 units, and the exponential on the **special function units** (MUFU), which
# compute $2^x$ and not $e^x$.
#
# flash_lib's tile loop (chapter 5's algorithm box), and where each piece runs on the GPU:
#
# | flash_lib (chapter 5) | the Triton kernel | where |
# |---|---|---|
# | `for q_start, q_stop in blocks:` (the outer loop) | the grid's axis 0: one program per query block | across SMs, in parallel |
# | the batch and head loop (`...` dims) | the grid's axis 1: one program per (batch, head) | across SMs, in parallel |
# | `q = Q[rows]` once per query block | `q = tl.load(...)` before the key loop | HBM → registers |
# | `for k_start, k_stop in ...:` (the inner loop) | `for start_n in range(0, hi, BLOCK_N):` | sequential, inside one program |
# | `s = scale * q @ k.T` | `tl.dot(q, tl.trans(k)) * qk_scale` | tensor cores, fp32 accumulate |
# | `online_softmax_update(m, l, acc, s, v)` | `m_new`, `p = exp2(...)`, `alpha`, `l`, `acc` | fp32 units and MUFU, registers |
# | `acc += p @ v` | `tl.dot(p.to(v.dtype), v, acc)` | tensor cores |
# | `out = acc / l`, `lse = m + log(l)` | the epilogue, once per row | registers → HBM |
#
# On the CPU, flash_lib runs the outer loop on a few threads and the inner one in NumPy; the
# GPU runs thousands of programs at once, each an inner loop of its own.

# %% [markdown]
# ## The forward kernel, whole
#
# Here it is, as `flash_triton.py` holds it (`.fn` is the Python function under `@triton.jit`). `Q + offsets` is pointer arithmetic: `tl.load` reads
# a whole tile at once, `mask=` guards the rows and columns past the array's end (loaded as
# `other=0.0`), and the `tl.constexpr` arguments are compile-time constants: each combination of
# `CAUSAL`, `HAS_MASK`, the block sizes and `RESCALE` compiles to its own specialised kernel on a
# GPU, so an `if CAUSAL:` costs nothing at run time.

# %% tags=["needs-triton"]
print(inspect.getsource(flash_triton.where_allowed.fn))
print(inspect.getsource(flash_triton.forward_kernel.fn))

# %% [markdown]
# ### Read line by line against chapter 5
#
# Chapter 5's algorithm box, for one query block $Q_i$ and key blocks $K_j, V_j$, is
# $S = \tau Q_i K_j^\top$; $m' = \max(m, \operatorname{rowmax} S)$; $P = e^{S - m'}$;
# $\alpha = e^{m - m'}$; $\ell \leftarrow \alpha \ell + \operatorname{rowsum} P$;
# $\mathrm{acc} \leftarrow \alpha\, \mathrm{acc} + P V_j$; at the end $O_i = \mathrm{acc} / \ell$ and
# $\mathrm{lse} = m + \log \ell$. flash_lib's step is `online_softmax_update`:

# %%
print(inspect.getsource(flash_lib.online_softmax_update))

# %% [markdown]
# The Triton kernel, in order:
#
# 1. `start_m = tl.program_id(0) * BLOCK_M`, `bh = tl.program_id(1)`: this program's query block
#    and (batch, head). There is no loop over query blocks: the grid *is* that loop.
# 2. `q = tl.load(...)`; `m = -inf`, `l = 0`, `acc = 0`: chapter 5's initial state, in fp32,
#    held in registers for the whole key loop. Only $K_j$ and $V_j$ travel from HBM.
# 3. `hi` and `full`: the causal tile skipping (below). flash_lib computes the same set of tiles
#    with `tile_schedule`.
# 4. `s = tl.dot(q, tl.trans(k)) * qk_scale`: $S$, but in **base 2**: `qk_scale` is
#    $\tau \log_2 e$, so `s` holds $\tau\, q k^\top \log_2 e$ and every exponential after it is an
#    `exp2`.
# 5. `where_allowed` and the `HAS_MASK` block: chapter 6's masks, as $-\infty$ scores. Only the
#    tiles that can hold a disallowed pair pay for it.
# 6. `m_new`, `m_use`, `p`, `alpha`: the online softmax of chapter 2, with chapter 6's guard for a
#    row that has seen no allowed key yet (`m_use = 0` where `m_new = -inf`, so that
#    $2^{-\infty - 0} = 0$ rather than $2^{-\infty + \infty} = $ NaN).
# 7. `if RESCALE: l = l * alpha; acc = acc * alpha[:, None]`: the rescale. It is always on in
#    `flash_triton.attention`; the flag exists so that the last section can plant the classic bug
#    without a second copy of the kernel.
# 8. `acc = tl.dot(p.to(v.dtype), v, acc)`: $P V_j$ added into the accumulator by the tensor
#    cores. With float16 inputs `p` is rounded to float16 first, as FlashAttention does: the
#    tensor cores take float16 operands and accumulate in fp32.
# 9. The epilogue: `out = acc / l` (an empty row has $\ell = 0$ and `acc` $= 0$, so it divides by 1
#    and stays 0), and `m + log2(l)`, the lse in base 2, stored for the backward. The wrapper
#    multiplies it by $\ln 2$ once to return flash_lib's natural lse.
#
# An empty row gets `out = 0` and `lse = -inf`, flash_lib's contract (the true $\log 0$, what
# `merge_attention` and chapter 23's checks expect). FlashAttention-2 stores $+\infty$ instead,
# so that its backward's $e^{S - \mathrm{lse}}$ is 0 on such a row with no test; `flash_triton`
# makes that substitution inside the backward kernels, where it serves (`load_row_stats` below).
#
# It computes what flash_lib computes. Against flash_lib's extended-precision reference on the
# same inputs, causal with $N_q \ne N_k$ and a key-padding mask:

# %% tags=["needs-triton"]
EPS32, EPS16 = float(np.finfo(np.float32).eps), float(np.finfo(np.float16).eps)
# Bounds in eps of the input dtype, each about 4x (float32) or 2x (float16) the largest error
# measured at NumPy's native, AVX2 and baseline levels over tests/test_triton.py's shapes.
FWD_BOUND = {"float32": 20, "float16": 2}

# Nq > Nk: under causal, bottom-right, the first Nq - Nk = 100 rows of each sequence see no key
n_q, n_k, d = 300, 200, 64
padding = np.ones((2, 1, n_k), dtype=bool)  # one row per sequence: read with a query stride of 0
padding[1, :, 150:] = False
measured = {}
for dtype in (np.float32, np.float16):
    q, k, v = (rng.standard_normal((2, n, d)).astype(dtype) for n in (n_q, n_k, n_k))
    out, lse = flash_triton.attention(q, k, v, causal=True, mask=padding, return_lse=True)
    ref, ref_lse = flash_lib.precise_attention(
        *(x.astype(np.float64) for x in (q, k, v)), causal=True, mask=padding, return_lse=True)
    name = np.dtype(dtype).name
    error = np.max(flash_lib.rowwise_relative_error(out, ref)) / np.finfo(dtype).eps
    empty = np.isneginf(ref_lse)
    measured[f"forward {name}"] = error
    print(f"{name}: out {out.dtype}, lse {lse.dtype}; error within {FWD_BOUND[name]} eps: "
          f"{error <= FWD_BOUND[name]}; {int(empty.sum())} empty rows, out exactly 0 on them: "
          f"{bool(np.all(out[empty] == 0))}, lse -inf: {bool(np.all(np.isneginf(lse[empty])))}")
    assert error <= FWD_BOUND[name]
    assert np.all(out[empty] == 0) and np.array_equal(np.isneginf(lse), empty)

# %% [markdown]
# ## exp2, and the folded scale
#
# The special function unit computes $2^x$ (the PTX instruction `ex2.approx`); $e^x$ costs a
# multiply by $\log_2 e$ first. The scores are multiplied by the softmax scale $\tau$ anyway, so
# the kernel multiplies once by $\tau \log_2 e$ and works in base 2 from there: $m$, $\alpha$, the
# lse are all in base 2, and the identity $e^{\tau x - \tau m} = 2^{\tau x \log_2 e - \tau m \log_2 e}$
# makes it exact mathematics, not an approximation. Per tile that removes one multiply per
# score, and the lse costs one multiply by $\ln 2$ per *row* at the very end. Chapter 23's
# `lse_base2` bug is what happens when that last multiply is forgotten.
#
# flash_lib does the same on a CPU where it pays ({doc}`chapter 5 <05_tiling>`): NumPy's float32
# `exp2` runs in less than half the time of its `exp` where it has AVX-512 loops, so there
# `flash_lib.exponential(np.float32)` is `np.exp2`, $\log_2 e$ rides on the keys' factor
# $\tau_k$ (a multiply flash_lib does anyway, where this kernel puts it on `qk_scale`), and the lse
# is converted back with the same one multiply per row. It is the same `online_softmax_update`
# printed above, given `exp=np.exp2`.
#
# The counts per tile, and per forward pass at $N = 4096$, $d = 64$, one head:

# %% tags=["needs-triton"]
BM, BN = flash_triton.BLOCK_M, flash_triton.BLOCK_N
n = 4096
scores = n * n
print(f"tile {BM} x {BN}: {BM * BN} scores, so {BM * BN} multiplies by log2(e) saved per tile")
print(f"one head, N = {n}: {scores:,} multiplies saved; the lse conversion costs {n:,} "
      "(one per row)")
assert math.isclose(flash_triton.LOG2E * math.log(2), 1.0, rel_tol=1e-15)

# %% [markdown]
# ## Causal: tiles skipped, the diagonal masked
#
# Causal attention aligned bottom-right (chapter 6) lets query $i$ see key $j$ iff
# $j \le i + N_k - N_q$. For a query block starting at row `start_m`, the kernel computes two
# bounds: `hi`, past which every key is above the diagonal for every row of the block (those tiles
# are never loaded), and `full`, before which every key is allowed for every row (those tiles need
# no mask). Only the tiles between, on the diagonal, pay for `where_allowed`. Counting them with
# the kernel's own formulas, against flash_lib's `tile_schedule`:

# %% tags=["needs-triton"]
def triton_tiles(n_q, n_k, causal):
    """(visited, masked) tiles of forward_kernel's grid, by the kernel's own hi and full."""
    visited = masked = 0
    shift = n_k - n_q
    for start_m in range(0, n_q, BM):
        hi = min(n_k, start_m + BM + shift) if causal else n_k
        full = min(n_k, start_m + shift + 1) if causal else n_k
        for start_n in range(0, max(hi, 0), BN):
            visited += 1
            masked += start_n + BN > full
    return visited, masked


for n_q, n_k in ((1024, 1024), (512, 1024), (1000, 1000)):
    visited, masked = triton_tiles(n_q, n_k, causal=True)
    total = math.ceil(n_q / BM) * math.ceil(n_k / BN)
    schedule = flash_lib.tile_schedule(n_q, n_k, BM, BN, causal=True)
    print(f"Nq = {n_q}, Nk = {n_k}: {total} tiles, {visited} computed ({masked} of them masked), "
          f"{total - visited} skipped; flash_lib's tile_schedule visits the same "
          f"{len(schedule)}: {len(schedule) == visited}")
    assert len(schedule) == visited

# %% [markdown]
# At $N = 1024$, 528 of the 1024 tiles are computed and only the 32 on the diagonal are masked:
# causal attention costs about half the flops, and the mask costs almost nothing. At
# $N = 1000$ the last, partial key tile (keys 992 to 999) is visited only by the last query
# block, where it is the diagonal tile anyway: the same counts.
#
# ## FlashAttention-2's work partitioning
#
# FlashAttention (arXiv 2205.14135) reached 25–40% of an A100's peak and FlashAttention-2
# (Dao 2023, arXiv 2307.08691) 50–73% of it, with the same algorithm, by changing where the
# work goes: both ranges are FlashAttention-2's abstract. Its Section 4.1 measures them on an
# A100 80GB SXM4 (Fig. 4 forward and backward, Fig. 5 forward, Fig. 6 backward): "up to 230
# TFLOPs/s, 73% of the theoretical maximum", and up to 63% in the backward pass (Section 1).
# Three changes, each visible in the kernel above.
#
# **Fewer non-matmul flops.** An A100 does 312 TFLOP/s of float16 matmul on its tensor cores but
# 19.5 TFLOP/s of fp32 arithmetic elsewhere: FlashAttention-2, Section 3.1 ("the A100 GPU has a
# max theoretical throughput of 312 TFLOPs/s of FP16/BF16 matmul, but only 19.5 TFLOPs/s of
# non-matmul FP32"), from the NVIDIA A100 datasheet (FP16 Tensor Core 312 TFLOPS dense, 624
# with sparsity; FP32 19.5 TFLOPS): a non-matmul flop costs 16 matmul flops. FlashAttention-2 keeps `acc` *unnormalised* through the
# loop and divides by $\ell$ once at the end (the epilogue above), where FlashAttention-1
# rescaled the output by $\ell_{\text{old}}/\ell_{\text{new}}$ at every tile; and it stores only
# the lse for the backward, not both $m$ and $\ell$. What the exp and the rest weigh, per score,
# against the two matmuls' $4d$ flops per score:

# %%
A100 = dict(name="A100 SXM4 80GB", matmul=312e12, other=19.5e12, hbm=2.039e12, sms=108,
            smem=164 * 1024, regs=256 * 1024,
            source="NVIDIA A100 Tensor Core GPU datasheet; Ampere architecture whitepaper")
H100 = dict(name="H100 SXM5", matmul=989e12, other=67e12, hbm=3.35e12, sms=132,
            smem=228 * 1024, regs=256 * 1024,
            source="NVIDIA H100 Tensor Core GPU datasheet; Hopper architecture whitepaper")
d = 64
matmul_per_score = 4 * d  # q·k (2d) and p·v (2d) flops per score
# per score, outside the matmuls: the scale multiply, the max, the subtraction, the exp2, the sum
other_per_score = 5
for gpu in (A100, H100):
    t_matmul = matmul_per_score / gpu["matmul"]
    t_other = other_per_score / gpu["other"]
    print(f"{gpu['name']}: {gpu['matmul'] / gpu['other']:.0f}x; per score, d = {d}: "
          f"{matmul_per_score} matmul flops and {other_per_score} others, which take "
          f"{t_other / t_matmul:.0%} of the matmuls' time at peak rates ({gpu['source']})")
# FlashAttention-1's per-tile rescale of the output by l_old / l_new: bq·d extra multiplies
# (and bq divisions) per tile, against the bq·bk·other_per_score of the softmax itself.
bq = bk = 128  # FlashAttention-2's usual tile
extra = bq * d + bq
print(f"FlashAttention-1's per-tile output rescale, tile {bq} x {bk}, d = {d}: {extra:,} more "
      f"non-matmul flops per tile, {extra / (bq * bk * other_per_score):.0%} more than the "
      "softmax's")

# %% [markdown]
# Two percent of the flops, a third of the time: on a GPU the softmax is not free, and every
# non-matmul flop removed from the inner loop counts sixteen times.
#
# **Parallel over query blocks.** FlashAttention-1 launched one program per (batch, head) and
# looped over the query blocks inside it; with a small batch and long sequences that leaves SMs
# idle. FlashAttention-2 adds the query blocks as a grid axis, which is `tl.program_id(0)` above.
# Counting programs against the A100's 108 SMs, for one sequence of 16 heads, $b_q = 128$:

# %%
heads, block = 16, 128
for n in (1024, 8192):
    fa1, fa2 = heads, heads * math.ceil(n / block)
    print(f"N = {n}: FlashAttention-1 launches {fa1} programs ({fa1 / A100['sms']:.0%} of the "
          f"SMs busy); FlashAttention-2 {fa2} ({fa2 / A100['sms']:.1f} waves of 108)")

# %% [markdown]
# **Split the queries across warps, not the keys.** Inside one program, FlashAttention-1 gave each
# warp a slice of the keys ("split-K"): every warp then held a partial $m$, $\ell$ and `acc` for
# the *same* rows, which had to be merged through shared memory (chapter 3's merge) at each step.
# FlashAttention-2 gives each warp a slice of the query rows: a warp owns its rows' whole softmax
# and no warp ever waits for another's partial state. In Triton this choice is the compiler's
# (`num_warps` says how many); the kernel's row statistics `m`, `l` being per-row vectors is
# what lets it split by rows.

# %% [markdown]
# ## One tile on an A100 and an H100
#
# One step of the inner loop, with FlashAttention-2's typical tile $b_q = b_k = 128$ and
# $d = 128$ in float16: it loads $K_j$ and $V_j$ ($2 b_k d$ elements) and does $4 b_q b_k d$
# flops. Its arithmetic intensity from HBM is therefore $b_q$ flop/byte, chapter 9's result for
# the whole kernel. Against each GPU's ridge point (peak / bandwidth), and what the tile holds
# on chip:

# %%
bq = bk = 128
d, itemsize = 128, 2  # float16
tile_bytes = 2 * bk * d * itemsize  # K_j and V_j
tile_flops = 4 * bq * bk * d
q_bytes = bq * d * itemsize
s_bytes = bq * bk * 4  # S (then P) in fp32 registers
acc_bytes = bq * d * 4
print(f"tile {bq} x {bk}, d = {d}, float16: loads {tile_bytes // 1024} KiB (K_j, V_j), "
      f"does {tile_flops / 1e6:.1f} MFLOP: {tile_flops / tile_bytes:.0f} flop/byte")
for gpu in (A100, H100):
    ridge = gpu["matmul"] / gpu["hbm"]
    per_sm_load = tile_bytes / (gpu["hbm"] / gpu["sms"])
    per_sm_math = tile_flops / (gpu["matmul"] / gpu["sms"])
    print(f"{gpu['name']}: ridge {ridge:.0f} flop/byte -> the tile is "
          f"{'memory' if tile_flops / tile_bytes < ridge else 'compute'}-bound if every load "
          f"came from HBM; with all {gpu['sms']} SMs busy, loading it takes "
          f"{per_sm_load * 1e6:.2f} us and its matmuls {per_sm_math * 1e6:.2f} us at peak")
    print(f"  on chip: q, K_j, V_j {(q_bytes + tile_bytes) // 1024} KiB of "
          f"{gpu['smem'] // 1024} KiB shared memory; S and acc in fp32 "
          f"{(s_bytes + acc_bytes) // 1024} KiB of the {gpu['regs'] // 1024} KiB register file")

# %% [markdown]
# On both GPUs one tile sits below the ridge if its $K_j, V_j$ come from HBM each time; in
# practice the programs of one head read the same $K_j, V_j$ at about the same time and most of
# those reads are served by the L2 cache (40 MB on an A100, 50 MB on an H100, same datasheets),
# which this count does not model. The H100's ridge is twice the A100's: its tensor cores grew
# faster than its memory, and a kernel that only waits for loads leaves them idle. That is the
# problem FlashAttention-3 attacks.
#
# ## FlashAttention-3 on Hopper
#
# FlashAttention-2 reaches only 35% of an H100's peak (FlashAttention-3, Shah et al. 2024,
# arXiv 2407.08608, abstract). FlashAttention-3 rewrites the kernel for what Hopper added, in
# CUDA (CUTLASS), not Triton:
#
# - **WGMMA**: the tensor-core instruction of Hopper is issued by a *warpgroup* (4 warps) and is
#   **asynchronous**: a warpgroup starts a matmul and may do other work until it waits for it.
# - **TMA** (the Tensor Memory Accelerator): a copy engine that moves a whole tile between HBM and
#   shared memory on one instruction, without the threads computing addresses.
# - **Warp specialisation**: the warps of one program are split into a *producer* warpgroup that
#   only issues TMA loads of $K_j, V_j$ into a circular buffer of shared memory, and *consumer*
#   warpgroups that only compute; registers are moved from the producers to the consumers
#   (Hopper's `setmaxnreg`). Loads and compute overlap by construction.
# - **Ping-pong scheduling**: two consumer warpgroups are synchronised so that one does its
#   softmax (the exp, on the slow units) while the other does its matmuls (on the tensor cores),
#   and then they swap: the exponentials hide behind the other group's GEMMs.
# - **Intra-warpgroup overlap**: within one warpgroup, the $S = Q K_{j+1}^\top$ of the next tile
#   is issued before the softmax of the current tile, so the tensor cores and the exp units work
#   at once even inside one warpgroup, at the cost of more registers.
# - **FP8**: Hopper's tensor cores run float8 at twice the float16 rate (1,979 vs 989 dense
#   TFLOP/s, NVIDIA H100 datasheet). The paper quantises per block, with one descale factor per
#   block of $Q$, $K$, $V$ (Section 3.3; the released kernel takes one per batch entry and head),
#   rounds $P$ to e4m3 before $PV$, and uses **incoherent processing**: multiplying $Q$ and $K$
#   by the same random orthogonal matrix (a Hadamard transform with random signs) leaves
#   $Q K^\top$ unchanged but spreads outlier features across all of them, so the float8 rounding
#   error shrinks.
#
# Its reported results (arXiv 2407.08608, abstract; none measured here): 1.5–2.0× faster than
# FlashAttention-2 on an H100 in float16, up to 740 TFLOP/s (75% of peak); close to 1.2 PFLOP/s
# in FP8; and FP8 FlashAttention-3 with 2.6× lower numerical error than a baseline FP8 attention.
# None of the three tricks changes the mathematics: they change when each tile's loads, matmuls
# and exponentials happen, which is why flash_lib, a NumPy program, computes the same thing.
# Chapter 11 computes the FP8 numerics: this forward in NumPy, its error, and the rotation's effect.

# %% [markdown]
# ## The backward kernels
#
# Chapter 12's backward loop: $D = \operatorname{rowsum}(dO \circ O)$ once; then for each key
# block $j$ (outside), each query block $i$ (inside): $P = e^{S - \mathrm{lse}}$,
# $dV_j \mathrel{+}= P^\top dO_i$, $dP = dO_i V_j^\top$, $dS = P \circ (dP - D_i)$,
# $dK_j \mathrel{+}= \tau\, dS^\top Q_i$, $dQ_i \mathrel{+}= \tau\, dS K_j$. In Triton, three
# kernels: `backward_preprocess_kernel` for $D$, `backward_dkdv_kernel` with the key blocks on the
# grid (each program owns one $dK_j$, $dV_j$ in registers and walks the query blocks, so no two
# programs write the same row), and `backward_dq_kernel` with the query blocks on the grid for
# $dQ$. FlashAttention-2 adds the $dQ$ shares with atomic adds from the key-block programs; a
# second pass recomputes $P$ once more but needs no atomics and gives the same bits on every run.
# `load_row_stats` is where an empty row's $-\infty$ lse becomes FlashAttention's $+\infty$:

# %% tags=["needs-triton"]
print(inspect.getsource(flash_triton.load_row_stats.fn))
print(inspect.getsource(flash_triton.backward_dkdv_kernel.fn))

# %% [markdown]
# Line by line against chapter 12: `p = tl.math.exp2(s - lse2[:, None])` is
# $P = e^{S - \mathrm{lse}}$ in base 2 (one exponential per score, no max, no sum: the forward's
# lse carries both); `dv_acc += tl.dot(tl.trans(p), do)` is $dV_j \mathrel{+}= P^\top dO_i$;
# `ds = p * (dp - delta[:, None])` is $dS = P \circ (dP - D_i)$; the factor $\tau$ of $dK_j$ is
# applied once, at the store. Against `flash_lib.flash_attention_backward` (float64, the same
# inputs; itself checked against `precise_attention_backward`), causal with $N_q \ne N_k$:

# %% tags=["needs-triton"]
# float32: <= 6.5e-7 of each gradient's largest entry, float16 <= 5.1e-4, measured at the three
# NumPy levels over tests/test_triton.py's cases; bounds ~15x and ~10x that.
BWD_BOUND = {"float32": 1e-5, "float16": 5e-3}
n_q, n_k, d = 96, 160, 64
for dtype in (np.float32, np.float16):
    q, k, v = (rng.standard_normal((2, n, d)).astype(dtype) for n in (n_q, n_k, n_k))
    out, lse = flash_triton.attention(q, k, v, causal=True, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = flash_triton.attention_backward(q, k, v, out, lse, dout, causal=True)
    q64, k64, v64, dout64 = (x.astype(np.float64) for x in (q, k, v, dout))
    out64, lse64 = flash_lib.flash_attention(q64, k64, v64, causal=True, return_lse=True)
    refs = flash_lib.flash_attention_backward(q64, k64, v64, out64, lse64, dout64, causal=True)
    # the reference itself: flash_lib's float64 backward against the extended-precision truth,
    # <= 11 float64 eps of the largest entry measured at the three NumPy levels; bound 100 eps
    truth = flash_lib.precise_attention_backward(q64, k64, v64, dout64, causal=True)
    ref_error = max(np.max(np.abs(r - t)) / np.max(np.abs(t)) for r, t in zip(refs, truth))
    assert ref_error <= 100 * np.finfo(np.float64).eps
    name = np.dtype(dtype).name
    errors = [np.max(np.abs(g - r)) / np.max(np.abs(r)) for g, r in zip(grads, refs)]
    measured[f"backward {name}"] = max(errors) / np.finfo(dtype).eps
    print(f"{name}: dq, dk, dv within {BWD_BOUND[name]:.0e} of their largest entry: "
          f"{all(e <= BWD_BOUND[name] for e in errors)} (flash_lib's float64 reference within "
          f"100 float64 eps of the truth: {ref_error <= 100 * np.finfo(np.float64).eps})")
    assert all(e <= BWD_BOUND[name] for e in errors)

# %% [markdown]
# ## Checked by flash_check
#
# Chapter 23's conformance suite runs a kernel through cases built to expose the classic bugs
# (a late-rising maximum, empty rows, $N_q \ne N_k$ under causal, float16 overflow, scales far
# from $1/\sqrt d$) and bounds its error by twice the textbook computation's in the same dtype.
# Its `lse` feature calls the kernel without `return_lse` and wants `(out, lse)` back, so it is
# given `flash_triton.attention_with_lse`; from a shell this is
# `python -m flash_check flash_triton:attention --features causal lse --dtypes float32 float16`
# (the command line passes `return_lse=True` to a kernel that takes it).

# %% tags=["needs-triton"]
report = flash_check.check_kernel(flash_triton.attention_with_lse, features=("causal", "lse"),
                                  dtypes=("float32", "float16"))
print(str(report).splitlines()[-1])  # the table above it holds rounding-level errors
assert report.ok, report.failures

# %% [markdown]
# And its mask cases (key padding, empty rows, a fully masked matrix, causal with a mask, NaN
# and inf in padded keys) and $d_v \ne d$, in float32:

# %% tags=["needs-triton"]
masked_cases = ["key_padding", "empty_rows", "all_masked", "causal_and_mask", "masked_nonfinite",
                "dv"]
report = flash_check.check_kernel(flash_triton.attention_with_lse, cases=masked_cases,
                                  features=("mask", "causal", "lse", "dv"), dtypes=("float32",))
print(str(report).splitlines()[-1])
assert report.ok, report.failures

# %% [markdown]
# ## A planted bug: the missing rescale
#
# `flash_triton.with_bug("missing_rescale")` is the same kernel launched with `RESCALE=False`:
# when a later key tile raises a row's maximum, `l` and `acc` keep terms measured against the
# old maximum. On random inputs the rows' maxima rise often, and chapter 23's diagnosis finds the
# cause by shuffling the keys (attention does not depend on their order; this bug does):

# %% tags=["needs-triton"]
buggy = flash_check.check_kernel(flash_triton.with_bug("missing_rescale"),
                                 features=("causal", "lse"), dtypes=("float32",),
                                 cases=["late_max", "random"])
print(str(buggy).splitlines()[-1])
for r in buggy.results:
    # the errors are O(1) (the mathematics of the bug), the bounds ~1e-6 (float32 rounding)
    print(f"{r.case} [{r.dtype}]: out error > 1000x its bound: {r.out_error > 1000 * r.out_bound}; "
          f"lse error > 1000x its bound: {r.lse_error > 1000 * r.lse_bound}")
    assert r.out_error > 1000 * r.out_bound and r.lse_error > 1000 * r.lse_bound
# each diagnosis quotes two measured errors (with the row's largest score first, and last);
# the cause after them is exact text
causes = {f.diagnosis.split(" last: ")[-1] for f in buggy.failures}
print(f"{len(buggy.failures)} failures, one cause: {causes.pop()}")
assert not causes
assert {f.case for f in buggy.failures} == {"late_max", "random"}
assert all("not rescaled by exp(m - m')" in f.diagnosis for f in buggy.failures)

# %% [markdown]
# ## What the interpreter is, and is not
#
# The measured errors of the checks above, and the interpreter's run time for the forward pass
# at growing $N$ ($d = 64$, float32, one head, on this CPU, shared with other jobs):

# %% tags=["needs-triton"]
sizes, seconds = (64, 128, 256), []
flash_triton.attention(*(rng.standard_normal((1, 64, 64)).astype(np.float32) for _ in range(3)))
for n in sizes:  # after one warm-up call, which pays the interpreter's first-use costs
    q, k, v = (rng.standard_normal((1, n, 64)).astype(np.float32) for _ in range(3))
    start = time.perf_counter()
    flash_triton.attention(q, k, v)
    seconds.append(time.perf_counter() - start)

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
names = list(measured)
bounds = [FWD_BOUND[n.split()[1]] if n.startswith("forward")
          else BWD_BOUND[n.split()[1]] / np.finfo(n.split()[1]).eps for n in names]
x = np.arange(len(names))
ax1.bar(x - 0.2, [measured[n] for n in names], 0.4, label="measured")
ax1.bar(x + 0.2, bounds, 0.4, label="bound asserted", color="0.75")
ax1.set_xticks(x, names, rotation=15)
ax1.set_yscale("log")
ax1.set_ylabel("error, in eps of the input dtype")
ax1.set_title("flash_triton against flash_lib")
ax1.legend()
ax2.plot(sizes, seconds, "o-")
ax2.set_xscale("log", base=2)
ax2.set_xticks(sizes, [str(s) for s in sizes])
ax2.set_ylim(bottom=0)
ax2.set_xlabel("N (= Nq = Nk), d = 64")
ax2.set_ylabel("seconds (interpreter, CPU)")
ax2.set_title("forward under TRITON_INTERPRET=1")
fig.tight_layout()
plt.show()

# %% [markdown]
# The interpreter runs the programs of the grid one after another, in Python, and each `tl`
# operation as a NumPy call on the whole tile, so its time grows with the number of tiles,
# $N^2 / (b_q b_k)$, and says nothing about a GPU's. What it does and does not reproduce:
#
# - **dtypes**: float32 and float16 loads, stores and casts are exact NumPy conversions; `tl.dot`
#   is `np.matmul` at the accumulator's dtype (fp32 here), so float16 operands are multiplied
#   exactly and summed in fp32, in NumPy's order, not the tensor cores'. float8 operands are
#   converted to float16 before `tl.dot`.
# - **`tl.dot` precision**: on an NVIDIA GPU Triton rounds fp32 operands to TF32 (10-bit
#   mantissa) unless told otherwise; the kernel asks for `input_precision="ieee"` so that its
#   float32 results mean the same compiled as interpreted. The interpreter ignores the setting.
# - **exp2** is NumPy's `np.exp2`, correctly rounded to about an ulp, not the GPU's `ex2.approx`.
# - **Not modelled**: `num_warps`, `num_stages`, shared memory and registers (nothing is
#   allocated on chip; a tile too large for a real SM still runs), timing, and the order in which
#   a GPU runs its programs (the kernels here do not depend on it: no atomics).
#
# So a pass under the interpreter says the kernel's *logic* is right (indexing, masks, the
# online softmax, the skipped tiles, the lse, the backward's algebra) in float32 and float16;
# compiled on a GPU the same code adds the hardware's own rounding (TF32 if allowed, `ex2.approx`,
# the tensor cores' summation order), which chapter 23's bound, twice the textbook error, leaves
# room for. `tests/test_triton.py` runs all of this in CI.

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
# Fifteen chapters derived FlashAttention in NumPy; this one writes it as a GPU kernel in
# [Triton](https://triton-lang.org), a Python dialect for the program of one *thread block*, which
# the compiler maps onto the GPU's threads (`flash_triton.py`, beside `flash_lib.py`). No GPU is
# needed: Triton's **interpreter** (`TRITON_INTERPRET=1`) runs the same `@triton.jit` functions on
# the CPU, one thread block after another, with NumPy doing the arithmetic: slow, but the kernel
# line for line, which chapter 23's conformance suite can check. The softmax's exponential runs on a
# unit far slower than the tensor cores, the fact behind FlashAttention-2's, -3's and -4's designs;
# FlashAttention-2's tiles follow from the 255 registers a thread can hold. Every GPU figure comes
# from one sourced table of datasheet and paper figures. **Nothing about GPU speed is measured
# here.**

# %%
import inspect
import math

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

import flash_check
import flash_lib

rng = np.random.default_rng(16)

# %% tags=["needs-triton"]
# flash_triton before triton: on a machine without CUDA it sets TRITON_INTERPRET=1, which Triton
# reads when it is first imported (its helpers tl.zeros, tl.max, ... are @triton.jit functions).
import flash_triton
import triton

print(f"triton {triton.__version__}; interpreted: {flash_triton.INTERPRETED}; "
      f"tensors on: {flash_triton.DEVICE}")

# %% [markdown]
# ## The execution model
#
# The two GPUs this chapter reasons about:

# %%
# A100 SXM4 80GB: NVIDIA A100 datasheet (tensor-core and FP32 peaks, HBM) and Ampere whitepaper
# (108 SMs, 1410 MHz boost clock, 1024 dense FP16 FMA = 2048 flops per clock per SM, 40 MB L2).
# H100 SXM5: NVIDIA H100 datasheet and Hopper whitepaper (132 SMs, twice the A100's tensor-core
# flops per SM per clock, 50 MB L2); 1830 MHz is the clock of FlashAttention-3's footnote 5
# (arXiv 2407.08608), at which 132 SMs x 4096 flops per clock is 989 TFLOP/s. CUDA C++
# Programming Guide: 64K 32-bit registers per SM, at most 255 per thread, shared memory per SM
# and per program (compute capabilities 8.0, 9.0); 32 banks of 32 bits per clock (2.3.4.2); 16
# exp2 per clock per SM (its instruction-throughput table, as FlashAttention-3's footnote quotes).
GPUS = {
    "A100": dict(name="A100 SXM4 80GB", sms=108, clock=1.41e9, tensor_per_clk=2048,
                 matmul=312e12, fp32=19.5e12, hbm=2.039e12, hbm_gb=80, l2_mb=40,
                 smem=164 * 1024, smem_program=163 * 1024),
    "H100": dict(name="H100 SXM5", sms=132, clock=1.83e9, tensor_per_clk=4096,
                 matmul=989e12, fp32=67e12, hbm=3.35e12, hbm_gb=80, l2_mb=50,
                 smem=228 * 1024, smem_program=227 * 1024),
}
REGS_PER_SM, MAX_REGS_PER_THREAD, EXP2_PER_CLK, SMEM_BYTES_PER_CLK = 65536, 255, 16, 32 * 4
A100, H100 = GPUS["A100"], GPUS["H100"]
for gpu in GPUS.values():
    # the datasheet's float16 tensor-core peak is SMs x flops per clock per SM x clock
    assert math.isclose(gpu["matmul"], gpu["sms"] * gpu["tensor_per_clk"] * gpu["clock"],
                        rel_tol=1e-3)
    gpu["sfu"] = gpu["sms"] * EXP2_PER_CLK * gpu["clock"]  # exp2 per second
    gpu["smem_bw"] = gpu["sms"] * SMEM_BYTES_PER_CLK * gpu["clock"]  # bytes per second
    print(f"{gpu['name']}: {gpu['sms']} SMs at {gpu['clock'] / 1e9:.2f} GHz; tensor cores "
          f"{gpu['matmul'] / 1e12:.0f} TFLOP/s, FP32 units {gpu['fp32'] / 1e12:.1f} TFLOP/s, "
          f"exp2 {gpu['sfu'] / 1e12:.2f} T/s; shared memory {gpu['smem_bw'] / 1e12:.1f} TB/s")
# FlashAttention-3, footnote 5: 16 x 132 SMs x 1830 MHz, "3.9 TFLOPS of special functions"
assert round(H100["sfu"] / 1e12, 1) == 3.9

# %% tags=["hide-input"]
def both(key, unit, fmt):  # one table entry for both GPUs, "A100 / H100"
    return " / ".join(format(gpu[key] / unit, fmt) for gpu in (A100, H100))


def box(x, y, w, h, text="", color="#e3dcf2", size=7.5):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="0.3"))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)


fig, ax = plt.subplots(figsize=(12, 5.4))
ax.set(xlim=(0, 12.2), ylim=(0.3, 6.3), aspect="equal")
ax.axis("off")
ax.set_title(f"The execution model, figures for {A100['name']} / {H100['name']}", fontsize=10)
for i, bh in np.ndindex(8, 4):  # the grid: program_id(0) = query block, (1) = batch * head
    box(0.3 + 0.42 * i, 2.4 + 0.42 * bh, 0.38, 0.38, color="C1" if (i, bh) == (5, 2) else "w")
box(4.3, 0.5, 4.3, 5.5, color="0.96")  # the SM
for x, y, text, size in [
        (2.0, 4.45, "the grid: one program per\n(query block, batch · head)", 10),
        (2.0, 2.1, "program_id(0): query block $i$ →", 8),
        (2.0, 1.25, f"the SMs ({both('sms', 1, '.0f')}) take the\nprograms a wave at a time", 8),
        (6.45, 5.65, "one SM running one program\n(FlashAttention-2, d = 128: 4 warps × 32)", 9),
        (6.45, 2.3, f"registers: {REGS_PER_SM * 4 // 1024} KiB per SM, at most "
                    f"{MAX_REGS_PER_THREAD} per thread", 8)]:
    ax.text(x, y, text, ha="center", va="center", fontsize=size)
ax.text(0.1, 3.2, "program_id(1): batch · head →", rotation=90, ha="center", va="center",
        fontsize=8)
for w in range(4):  # FlashAttention-2: each warp owns a quarter of the query block's rows
    box(4.45, 4.75 - 0.62 * w, 2.15, 0.52, f"warp {w}: 32 of the 128 rows of $Q_i$\n"
        "$S$, $P$, acc, $m$, $\\ell$ in fp32", "#fde9c9")
box(6.75, 4.6, 1.7, 0.75, f"tensor cores\n$QK^\\top$, $PV$\n{both('matmul', 1e12, '.0f')} TFLOP/s",
    "#d5ecd4")
box(6.75, 3.7, 1.7, 0.75, f"FP32 units\nmax, sum, scale\n{both('fp32', 1e12, '.1f')} TFLOP/s",
    "#d5ecd4")
box(6.75, 2.8, 1.7, 0.75, f"MUFU\nexp2\n{both('sfu', 1e12, '.2f')} T/s", "#f6cfcf")
box(4.45, 0.7, 4.0, 1.15, f"shared memory: $K_j$, $V_j$ tiles\n{both('smem', 1024, '.0f')} KiB "
    f"per SM ({both('smem_program', 1024, '.0f')} per program)\n{SMEM_BYTES_PER_CLK} B per clock "
    f"per SM: {both('smem_bw', 1e12, '.1f')} TB/s in all")
box(9.3, 3.3, 2.7, 1.0, f"L2 cache, all SMs\n{both('l2_mb', 1, '.0f')} MB", size=8)
box(9.3, 0.9, 2.7, 1.2, f"HBM: $Q, K, V$, out, lse\n{both('hbm_gb', 1, '.0f')} GB\n"
    f"{both('hbm', 1e12, '.2f')} TB/s", size=8)
for start, end in [((2.8, 3.43), (4.3, 4.0)), ((10.65, 2.1), (10.65, 3.3)),
                   ((9.3, 3.8), (8.45, 1.5))]:
    ax.annotate("", end, start, arrowprops=dict(arrowstyle="-|>", color="0.3"))
ax.text(8.95, 2.6, "$K_j$, $V_j$", fontsize=7.5)
fig.tight_layout()
plt.show()

# %% [markdown]
# A kernel is launched over a **grid** of **programs** (CUDA: thread blocks, or CTAs), here one
# per (query block, batch · head), so chapter 5's query-block, batch and head loops run in
# parallel. Each program goes to a **streaming multiprocessor** (SM), as many at once as its
# registers and shared memory hold, the rest in later waves. A program runs as a few **warps**,
# 32 threads that issue one instruction together; Triton's `num_warps` (4 by default) says how
# many, and the compiler decides which thread holds which element of a tile. $S$, $P$, `acc`,
# $m$ and $\ell$ sit in fp32 in the owning threads' **registers**; $K_j$, $V_j$ are staged in
# **shared memory**; $Q, K, V$, the output and the lse live in **HBM**, behind the **L2** cache
# (the datasheets give no L2 bandwidth). The **tensor cores** multiply tiles, the **FP32 units**
# do the maxima, sums and scaling, and the **special function unit** (MUFU) computes the
# exponential, as $2^x$, not $e^x$.
#
# flash_lib's tile loop (chapter 5's algorithm box), and where each piece runs on the GPU:
#
# | flash_lib (chapter 5) | the Triton kernel | where |
# |---|---|---|
# | `for q_start, q_stop in blocks:` (the outer loop) | the grid's axis 0: one program per query block | across SMs, in parallel |
# | the batch and head loop (`...` dims) | the grid's axis 1: one program per (batch, head) | across SMs, in parallel |
# | `q = Q[rows]` once per query block | `q = tl.load(...)` before the key loop | HBM → registers |
# | `for k_start, k_stop in ...:` (the inner loop) | `for start_n in range(0, hi, BLOCK_N):` | sequential, inside one program |
# | `s = scale * q @ k.T` | `mm(q, tl.trans(k), UPCAST) * qk_scale` (`mm` is `tl.dot`) | tensor cores, fp32 accumulate |
# | `online_softmax_update(m, l, acc, s, v)` | `m_new`, `p = exp2(...)`, `alpha`, `l`, `acc` | FP32 units, `exp2` on the MUFU; registers |
# | `acc += p @ v` | `acc += mm(p.to(v.dtype), v, UPCAST)` | tensor cores |
# | `out = acc / l`, `lse = m + log(l)` | the epilogue, once per row | registers → HBM |
#
# ## The forward kernel, whole
#
# As `flash_triton.py` holds it (`.fn` is the Python function under `@triton.jit`). `Q + offsets` is
# pointer arithmetic: `tl.load` reads a whole tile, `mask=` guards the rows and columns past the
# array's end (loaded as `other=0.0`), and `tl.constexpr` arguments are compile-time constants: each
# combination of `CAUSAL`, `HAS_MASK`, `HAS_SINKS`, `DROPOUT`, `NONFINITE`, the block sizes and
# `RESCALE` compiles to its own GPU kernel, so `if CAUSAL:` is free. (`UPCAST` widens bfloat16 for
# the interpreter, whose `tl.dot` errs on it.)

# %% tags=["needs-triton"]
for fn in (flash_triton.allowed_pairs, flash_triton.dot_allowed, flash_triton.mm,
           flash_triton.dropout_keep, flash_triton.forward_kernel):
    print(inspect.getsource(fn.fn))

# %% [markdown]
# ### Read line by line against chapter 5
#
# Chapter 5's algorithm box, for one query block $Q_i$ and key blocks $K_j, V_j$, is
# $S = \tau Q_i K_j^\top$; $m' = \max(m, \operatorname{rowmax} S)$; $P = e^{S - m'}$;
# $\alpha = e^{m - m'}$; $\ell \leftarrow \alpha \ell + \operatorname{rowsum} P$;
# $\mathrm{acc} \leftarrow \alpha\, \mathrm{acc} + P V_j$; at the end $O_i = \mathrm{acc} / \ell$
# and $\mathrm{lse} = m + \log \ell$ (flash_lib's `online_softmax_update`). The Triton kernel:
#
# 1. `start_m = tl.program_id(0) * BLOCK_M`, `bh = tl.program_id(1)`: this program's query block
#    and (batch, head): the grid replaces flash_lib's outer loops, while the key loop,
#    `for start_n in range(0, hi, BLOCK_N)`, runs in order inside one program.
# 2. `q = tl.load(...)`; `m = -inf`, `l = 0`, `acc = 0`: chapter 5's initial state, fp32, in
#    registers for the whole key loop (with chapter 18's sink: as if the sink had been seen,
#    `m = sink`, `l = 1`). Only $K_j$ and $V_j$ travel from HBM.
# 3. `hi` and `full`: causal tile skipping (below), flash_lib's `tile_schedule`.
# 4. `s = mm(q, tl.trans(k), UPCAST) * qk_scale` (`mm` is `tl.dot`, on the tensor cores): $S$,
#    but in **base 2**: `qk_scale` is $\tau \log_2 e$, so `s` holds $\tau\, q k^\top \log_2 e$
#    and every exponential after it is an `exp2`.
# 5. `allowed_pairs`, `HAS_MASK`: chapter 6's masks as $-\infty$ scores, paid for only in tiles
#    that can hold a disallowed pair. With inf or NaN in `k` or `v` (`NONFINITE`), `dot_allowed`
#    keeps masked pairs out of $P V_j$ (weight 0 times inf is NaN).
# 6. `m_new`, `m_use`, `p`, `alpha`: chapter 2's online softmax (FP32 units and MUFU), with
#    chapter 6's guard for a row that has seen no allowed key yet (`m_use = 0` where
#    `m_new = -inf`, so that $2^{-\infty - 0} = 0$, not $2^{-\infty + \infty} = $ NaN).
# 7. `if RESCALE: l = l * alpha; acc = acc * alpha[:, None]`: the rescale, always on in
#    `flash_triton.attention`; the flag lets a later section plant the classic bug.
# 8. `acc += mm(p.to(v.dtype), v, UPCAST)`: $P V_j$ on the tensor cores, which take float16
#    operands (`p` is rounded to float16, as in FlashAttention) and accumulate in fp32. With
#    `DROPOUT`, after $\ell$ took the undropped `p`, `dropout_keep` zeroes the dropped weights:
#    chapter 17's mask, flash_lib's Philox4x32-7 bit for bit, from the seed and $(b, i, j)$ alone.
# 9. The epilogue: `out = acc / l` (an empty row has $\ell = 0$ and `acc` $= 0$, so it divides by 1
#    and stays 0), times $1/(1-p)$ with dropout, and `m + log2(l)`, the lse in base 2, stored
#    to HBM.
#
# An empty row gets `out = 0` and `lse = -inf` (the true $\log 0$), flash_lib's contract.
# FlashAttention-2 stores $+\infty$, so that its backward's $e^{S - \mathrm{lse}}$ is 0 with no
# test; `flash_triton` substitutes it inside the backward (`load_row_stats`). Against flash_lib's
# extended-precision reference, causal with $N_q \ne N_k$ and a key-padding mask:

# %% tags=["needs-triton"]
# Bounds in eps of the input dtype, about 4x (float32) or 2x (float16) the largest error
# measured (how: appendix 28, on testing); the lse, fp32 for both, in float32 eps, about 4x
FWD_BOUND, LSE_BOUND, EPS32 = {"float32": 20, "float16": 2}, 25, float(np.finfo(np.float32).eps)

# Nq > Nk: under causal, bottom-right, the first Nq - Nk = 100 rows of each sequence see no key
n_q, n_k, d = 300, 200, 64
padding = np.ones((2, 1, n_k), dtype=bool)  # one row per sequence: read with a query stride of 0
padding[1, :, 150:] = False
for dtype in (np.float32, np.float16):
    q, k, v = (rng.standard_normal((2, n, d)).astype(dtype) for n in (n_q, n_k, n_k))
    out, lse = flash_triton.attention(q, k, v, causal=True, mask=padding, return_lse=True)
    ref, ref_lse = flash_lib.precise_attention(
        *(x.astype(np.float64) for x in (q, k, v)), causal=True, mask=padding, return_lse=True)
    name = np.dtype(dtype).name
    error = np.max(flash_lib.rowwise_relative_error(out, ref)) / np.finfo(dtype).eps
    empty = np.isneginf(ref_lse)
    lse_error = np.max(np.abs(lse[~empty] - ref_lse[~empty])) / EPS32
    print(f"{name}: out {out.dtype}, lse {lse.dtype}; error within {FWD_BOUND[name]} eps: "
          f"{error <= FWD_BOUND[name]}, lse within {LSE_BOUND}: {lse_error <= LSE_BOUND}; "
          f"{int(empty.sum())} empty rows, out exactly 0 on them: "
          f"{bool(np.all(out[empty] == 0))}, lse -inf: {bool(np.all(np.isneginf(lse[empty])))}")
    assert error <= FWD_BOUND[name] and lse_error <= LSE_BOUND
    assert np.all(out[empty] == 0) and np.array_equal(np.isneginf(lse), empty)

# %% [markdown]
# ## exp2, and the folded scale
#
# The special function unit computes $2^x$ (PTX `ex2.approx`), so $e^x$ costs a multiply by
# $\log_2 e$ first. The scores are multiplied by $\tau$ anyway, so the kernel multiplies once by
# $\tau \log_2 e$ and works in base 2 from there ($m$, $\alpha$, the lse); as
# $e^{\tau x - \tau m} = 2^{\tau x \log_2 e - \tau m \log_2 e}$, this is exact, not an
# approximation. It saves one multiply per score; the lse costs one multiply by $\ln 2$ per *row*,
# at the end. Forgetting that (chapter 23's `lse_base2` bug) returns every lse times $1 / \ln 2$,
# which the lse check above fails by far. flash_lib uses `exp2` where NumPy's is faster, but
# multiplies each exponent $s - m$ by $\log_2 e$ instead, which costs less precision
# ({doc}`chapter 5 <05_tiling>`).
#
# ## Causal: tiles skipped, the diagonal masked
#
# Aligned bottom-right (chapter 6), causal attention lets query $i$ see key $j$ iff
# $j \le i + N_k - N_q$. For a query block starting at row `start_m` the kernel computes `hi`,
# past which every key is above the diagonal for every row of the block (never loaded), and
# `full`, before which every key is allowed for every row (no mask). Only the tiles between pay
# for the mask. Counted with the kernel's formulas, against `tile_schedule` and chapter 6:

# %% tags=["needs-triton"]
BM, BN = flash_triton.BLOCK_M, flash_triton.BLOCK_N


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
# chapter 6: with n = N / b square tiles per side, causal visits n(n + 1) / 2 and masks the n on
# the diagonal; N = 1000 has as many tiles per side as N = 1024, its last one partial
n = 1024 // BM
assert BM == BN and triton_tiles(1024, 1024, True) == (n * (n + 1) // 2, n)
assert triton_tiles(1000, 1000, True) == triton_tiles(1024, 1024, True)

# %% [markdown]
# The kernel visits chapter 6's $n(n+1)/2$ of $n^2$ tiles and masks only the $n$ on the diagonal:
# causal attention costs about half the flops, and the mask almost nothing.
#
# ## What the softmax costs beside the matmuls
#
# FlashAttention (arXiv 2205.14135) reached 25–40% of an A100's peak and FlashAttention-2
# (Dao 2023, arXiv 2307.08691) 50–73% (its abstract), with the same algorithm, by moving work
# in three ways, each visible in the kernel above.
#
# **Fewer non-matmul flops.** "The A100 GPU has a max theoretical throughput of 312 TFLOPs/s of
# FP16/BF16 matmul, but only 19.5 TFLOPs/s of non-matmul FP32" (FlashAttention-2, Section 3.1).
# So FlashAttention-2 keeps `acc` *unnormalised* and divides by $\ell$ once, in the epilogue,
# where FlashAttention-1 rescaled the output by $\ell_{\text{old}}/\ell_{\text{new}}$ at every
# tile. The exponential is no FP32 flop: it runs on the MUFU, 16 per clock per SM, against the
# tensor cores' thousands of flops per clock per SM. Per score the matmuls do $4d$ flops and the
# softmax one `exp2` and four other flops (scale, max, subtract, sum). At peak rates the
# exponential takes
#
# $$\frac{t_{\exp}}{t_{\text{matmul}}} = \frac{\text{tensor-core flops per clock per SM}}{16 \cdot 4d}$$
#
# of the matmuls' time, whatever the clock: half as much when $d$ doubles, twice as much when the
# tensor cores' rate does. The other four count at the FP32 peak, as in FlashAttention-2:

# %%
FA2_FWD = {  # d -> (b_q, b_k, warps): FlashAttention-2's forward on an A100 (sm80), no dropout,
    # csrc/flash_attn/src/flash_fwd_launch_template.h at commit 01afd16 (Dao-AILab/flash-attention)
    32: (128, 128, 4), 64: (128, 128, 4), 96: (128, 64, 4), 128: (128, 64, 4),
    192: (128, 64, 8), 256: (128, 64, 8)}


def softmax_over_matmul(gpu, d, other_flops=4):
    """The times at peak rates of one score's exp2 (MUFU) and other softmax flops (FP32 units),
    each over the time of its 4d matmul flops (tensor cores)."""
    t_matmul = 4 * d / gpu["matmul"]
    return 1 / gpu["sfu"] / t_matmul, other_flops / gpu["fp32"] / t_matmul


for gpu, d in ((A100, 64), (A100, 128), (H100, 64), (H100, 128)):
    exp, other = softmax_over_matmul(gpu, d)
    print(f"{gpu['name']}, d = {d}: exp2 {exp:.2f} and other flops {other:.2f} of the matmuls' "
          f"time, {exp + other:.2f} in all; run one after the other, the tensor cores are busy "
          f"{1 / (1 + exp + other):.0%} of the time at most")
# FlashAttention-3, Section 3.1, H100 SXM5, d = 128: the exponential has "256x lower
# throughput" than the matmuls, "so exponential can take 50% of the cycle compared to matmul"
assert math.isclose(H100["matmul"] / H100["sfu"], 256, rel_tol=0.01)
assert math.isclose(softmax_over_matmul(H100, 128)[0], 0.50, abs_tol=0.01)
# Hopper doubled the tensor cores' flops per clock per SM and kept 16 exp2 per clock per SM
assert math.isclose(softmax_over_matmul(H100, 64)[0] / softmax_over_matmul(A100, 64)[0], 2,
                    rel_tol=0.01)

# %% [markdown]
# A sliver of the flops, the softmax takes at peak rates a large part of the matmuls' time; the
# exponential's share doubled from Ampere to Hopper, and FlashAttention-3's "50%" is this model.
# Counting the other four as flops at the FP32 peak is generous: FlashAttention-3's listing of its
# compiled loop (Appendix B.2) shows an `FFMA` (scale and subtract), an `FMNMX` and an `FADD` per
# score and a conversion of $P$ to 16 bits per pair, and a max or an add is one instruction for
# one flop, an FMA for two. Either way, one `exp2` per score is the minimum: it can only be
# hidden behind the matmuls (FlashAttention-3) or computed faster (FlashAttention-4).
#
# **Parallel over query blocks.** FlashAttention-1 launched one program per (batch, head) and
# looped over the query blocks inside it, leaving SMs idle with a small batch of long sequences;
# FlashAttention-2 makes the query blocks a grid axis, `tl.program_id(0)` above. Programs against
# the A100's SMs, for one sequence of 16 heads, $b_q = 128$:

# %%
heads, block = 16, 128
for n in (1024, 8192):
    fa1, fa2 = heads, heads * math.ceil(n / block)
    print(f"N = {n}: FlashAttention-1 launches {fa1} programs ({fa1 / A100['sms']:.0%} of the "
          f"SMs busy); FlashAttention-2 {fa2} ({fa2 / A100['sms']:.1f} waves of {A100['sms']})")

# %% [markdown]
# **Split the queries across warps, not the keys.** FlashAttention-1 gave each warp of a program
# a slice of the keys, so every warp held a partial $m$, $\ell$ and `acc` for the *same* rows,
# merged through shared memory (chapter 3's merge) at each step. FlashAttention-2 gives each warp
# a slice of the query rows, whose whole softmax it owns (in Triton the compiler chooses, as
# per-row `m`, `l` allow). A warp holds its rows of $S$ and `acc` in fp32 registers:
# $b_q (b_k + d) / (32 w)$ per thread with $w$ warps, of the 255 a thread can address. That
# per-thread limit, not the register file per SM, decides FlashAttention-2's tiles:

# %%
def regs_per_thread(b_q, b_k, d, warps):
    """fp32 registers per thread for S (b_q x b_k) and acc (b_q x d), shared by the warps."""
    return b_q * (b_k + d) // (32 * warps)


for d, (b_q, b_k, warps) in FA2_FWD.items():
    print(f"d = {d:3}: tile {b_q} x {b_k}, {warps} warps: S and acc take "
          f"{regs_per_thread(b_q, b_k, d, warps)} registers per thread")
assert max(regs_per_thread(b_q, b_k, d, w) for d, (b_q, b_k, w) in FA2_FWD.items()) <= 192
# not used: 128 x 128 at d = 128, and 256 x 64 at d = 64 ("85% slower for seqlen=2k, because
# of register spilling", the launch template's comment), both on 4 warps
for b_q, b_k, d in ((128, 128, 128), (256, 64, 64)):
    need = regs_per_thread(b_q, b_k, d, 4)
    print(f"d = {d:3}: tile {b_q} x {b_k}, 4 warps would need {need} > {MAX_REGS_PER_THREAD}")
    assert need > MAX_REGS_PER_THREAD

# %% [markdown]
# Each tile leaves at least 63 registers per thread for the rest (addresses, $P$ in 16
# bits, fragments of $K_j$ and $V_j$). At $d = 128$ a $128 \times 128$ tile would not fit, so
# $b_k$ is halved; on 8 warps it would, but ran 28% slower, its comment says. (At $d = 256$ an
# H100 runs $64 \times 64$ on 4 warps, so that two programs fit in one SM's shared memory.)
# `flash_triton` hard-wires no tile: compiled, `@triton.autotune` times the `GPU_CONFIGS`
# candidates (tutorial 06's, FlashAttention-2's) that `prune_configs` leaves for the head
# dimension and keeps the fastest, likely FlashAttention-2's, its authors' fastest (below
# N = 1024 that one, untimed). The interpreter runs one $32 \times 32$ tile. A GPU tries:

# %% tags=["needs-triton"]
for d in (64, 128):  # (b_q, b_k, warps) of each configuration left, its stage counts aside
    tried = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps)
             for c in flash_triton.prune_configs(flash_triton.GPU_CONFIGS["forward"], d)}
    most = max(regs_per_thread(b_q, b_k, d, w) for b_q, b_k, w in tried)
    print(f"d = {d}: tiles {sorted(tried)}; FlashAttention-2's {FA2_FWD[d]} among them: "
          f"{FA2_FWD[d] in tried}; S and acc take at most {most} registers per thread")
    assert FA2_FWD[d] in tried and most <= MAX_REGS_PER_THREAD

# %% [markdown]
# ## One tile on an A100 and an H100
#
# One step of the inner loop, FlashAttention-2's tile at $d = 128$ in float16, loads $K_j$ and
# $V_j$ ($2 b_k d$ elements) and does $4 b_q b_k d$ flops: $b_q$ flop/byte, chapter 9's intensity
# for the whole kernel. Against each GPU's ridge point (peak / bandwidth):

# %%
d, itemsize = 128, 2  # float16
bq, bk, warps = FA2_FWD[d]
tile_bytes, tile_flops, q_bytes = 2 * bk * d * itemsize, 4 * bq * bk * d, bq * d * itemsize
print(f"tile {bq} x {bk}, d = {d}, float16: loads {tile_bytes // 1024} KiB (K_j, V_j), "
      f"does {tile_flops / 1e6:.1f} MFLOP: {tile_flops / tile_bytes:.0f} flop/byte; on chip, "
      f"q, K_j, V_j take {(q_bytes + tile_bytes) // 1024} KiB of shared memory and S, acc "
      f"{regs_per_thread(bq, bk, d, warps)} registers per thread")
for gpu in (A100, H100):  # each SM gets 1 / sms of the HBM bandwidth and of the peak
    ridge = gpu["matmul"] / gpu["hbm"]
    print(f"{gpu['name']}: ridge {ridge:.0f} flop/byte -> the tile is "
          f"{'memory' if tile_flops / tile_bytes < ridge else 'compute'}-bound if every load "
          f"came from HBM; with all {gpu['sms']} SMs busy, loading it takes "
          f"{tile_bytes * gpu['sms'] / gpu['hbm'] * 1e6:.2f} us and its matmuls "
          f"{tile_flops * gpu['sms'] / gpu['matmul'] * 1e6:.2f} us at peak")

# %% [markdown]
# The tile is below both ridges if $K_j, V_j$ come from HBM each time; in practice one head's
# programs read them at about the same time and the L2 cache, not modelled here, serves most of
# those reads. The H100's ridge is the higher: its tensor cores grew faster than its memory, and a
# kernel waiting for its loads leaves them idle, which FlashAttention-3 attacks.
#
# ## FlashAttention-3 on Hopper
#
# FlashAttention-2 reaches only 35% of an H100's peak (FlashAttention-3, Shah et al. 2024,
# arXiv 2407.08608, abstract). FlashAttention-3, in CUDA (CUTLASS), uses what Hopper added:
# **WGMMA** (a matmul issued asynchronously by a *warpgroup* of 4 warps), the **TMA** (a tile
# copied from HBM to shared memory in one instruction) and **warp specialisation** (a *producer*
# warpgroup only issues loads, *consumer* warpgroups only compute). Two schedules hide the
# exponential's cost. **Ping-pong** (Section 3.1): while one consumer warpgroup does its softmax
# on the MUFU, barriers make the other do its GEMMs, then they swap (570 to 620–640 TFLOP/s,
# float16, $d = 128$, $N = 8192$). **Intra-warpgroup overlap** (Section 3.2):
# $S = Q K_{j+1}^\top$ is issued before tile $j$'s softmax, at the cost of a second $S$ in
# registers (Table 2, $d = 128$, $N = 8448$: 570 TFLOP/s without warp specialisation, 582
# without this overlap, 661 with both). **FP8** doubles the matmul rate, not the exponential's,
# so the exponential's share doubles again; per-block scales and a random rotation of $Q$ and
# $K$ (*incoherent processing*) keep its error small, as chapter 11 computes. Reported: 1.5–2.0×
# FlashAttention-2 in float16, up to 740 TFLOP/s; close to 1.2 PFLOP/s in FP8. Only the timing
# of the loads, matmuls and exponentials changes, not the mathematics.
#
# ### FlashAttention-4: part of the exponentials in software
#
# On Blackwell "tensor core throughput doubles while other functional units (shared memory
# bandwidth, exponential units) scale more slowly or remain unchanged" (FlashAttention-4, Zadouri
# et al. 2026, arXiv 2603.05451, abstract): doubled per SM and clock, the law above puts the
# exponentials alone at the matmuls' time for $d = 128$. The FP32 units, which the softmax
# keeps far from busy, are not the MUFU, so FlashAttention-4 computes some exponentials there
# with a degree-3 polynomial, interleaved with the MUFU's (`ex2_emu_freq` in
# `flash_attn/cute/softmax.py`); {doc}`chapter 19 <19_fa4_numerics>` emulates it bit for bit.

# %%
print(f"tensor cores twice an H100's per clock, 16 exp2 per clock, d = 128: the exponentials "
      f"take {2 * softmax_over_matmul(H100, 128)[0]:.2f} of the matmuls' time")

# %% [markdown]
# ## The backward kernels
#
# Chapter 12's backward loop: $D = \operatorname{rowsum}(dO \circ O)$ once; then for each key
# block $j$ (outside), each query block $i$ (inside): $P = e^{S - \mathrm{lse}}$,
# $dV_j \mathrel{+}= P^\top dO_i$, $dP = dO_i V_j^\top$, $dS = P \circ (dP - D_i)$,
# $dK_j \mathrel{+}= \tau\, dS^\top Q_i$, $dQ_i \mathrel{+}= \tau\, dS K_j$. In Triton:
# `backward_preprocess_kernel` for $D$; `backward_dkdv_kernel`, one program per key block, owning
# its $dK_j$, $dV_j$ in registers and walking the query blocks; `backward_dq_kernel`, one per
# query block. FlashAttention-2 adds the $dQ$ shares with atomics from the key-block programs;
# this second pass recomputes $P$ but gives the same bits every run. `load_row_stats` makes the
# $+\infty$ substitution:

# %% tags=["needs-triton"]
print(inspect.getsource(flash_triton.load_row_stats.fn))
print(inspect.getsource(flash_triton.backward_dkdv_kernel.fn))

# %% [markdown]
# Line by line against chapter 12: `p = tl.math.exp2(s - lse2[:, None])` is
# $P = e^{S - \mathrm{lse}}$ in base 2 (one exponential per score, no max, no sum: the forward's
# lse carries both); `dv_acc += tl.dot(tl.trans(p), do)` is $dV_j \mathrel{+}= P^\top dO_i$;
# `ds = p * (dp - delta[:, None])` is $dS = P \circ (dP - D_i)$; the factor $\tau$ of $dK_j$ is
# applied once, at the store. Against `flash_lib.flash_attention_backward` (float64; itself
# checked against `precise_attention_backward`), causal with $N_q \ne N_k$:

# %% tags=["needs-triton"]
# of each gradient's largest entry; about 15x (float32) and 10x (float16) the largest measured
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
    # the reference itself against the extended-precision truth: <= 11 float64 eps measured
    truth = flash_lib.precise_attention_backward(q64, k64, v64, dout64, causal=True)
    ref_error = max(np.max(np.abs(r - t)) / np.max(np.abs(t)) for r, t in zip(refs, truth))
    assert ref_error <= 100 * np.finfo(np.float64).eps
    name = np.dtype(dtype).name
    errors = [np.max(np.abs(g - r)) / np.max(np.abs(r)) for g, r in zip(grads, refs)]
    print(f"{name}: dq, dk, dv within {BWD_BOUND[name]:.0e} of their largest entry: "
          f"{all(e <= BWD_BOUND[name] for e in errors)} (flash_lib's float64 reference within "
          f"100 float64 eps of the truth: {ref_error <= 100 * np.finfo(np.float64).eps})")
    assert all(e <= BWD_BOUND[name] for e in errors)

# %% [markdown]
# ## Checked by flash_check
#
# Chapter 23's conformance suite runs a kernel through cases built to expose the classic bugs,
# bounding its error by twice the textbook computation's in the same dtype. Its `lse` feature
# wants `(out, lse)`, hence `flash_triton.attention_with_lse` (from a shell,
# `python -m flash_check flash_triton:attention --features causal lse`); a second run adds the
# mask cases (key padding, empty rows, all masked, causal with a mask, NaN and inf in padded
# keys), $d_v \ne d$, sinks and dropout (with the backward, the mask claimed to be flash_lib's):

# %% tags=["needs-triton"]
masked_cases = ["key_padding", "empty_rows", "all_masked", "causal_and_mask", "masked_nonfinite",
                "dv", "sinks", "sinks_empty_rows", "dropout"]
for options in (dict(features=("causal", "lse"), dtypes=("float32", "float16")),
                dict(features=flash_triton.FEATURES, dtypes=("float32",), cases=masked_cases,
                     backward=flash_triton.attention_backward, dropout_generator="flash_lib")):
    report = flash_check.check_kernel(flash_triton.attention_with_lse, **options)
    print(str(report).splitlines()[-1])  # the table above it holds rounding-level errors
    assert report.ok, report.failures

# %% [markdown]
# ## A planted bug: the missing rescale
#
# `flash_triton.with_bug("missing_rescale")` is the same kernel launched with `RESCALE=False`:
# when a later key tile raises a row's maximum, `l` and `acc` keep terms measured against the
# old one. Random inputs raise the maxima often; chapter 23's diagnosis finds the cause by
# shuffling the keys (attention does not depend on their order; this bug does):

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
# each diagnosis: two measured errors (largest score first, then last), then the cause
causes = {f.diagnosis.split(" last: ")[-1] for f in buggy.failures}
print(f"{len(buggy.failures)} failures, one cause: {causes.pop()}")
assert not causes
assert {f.case for f in buggy.failures} == {"late_max", "random"}
assert all("not rescaled by exp(m - m')" in f.diagnosis for f in buggy.failures)

# %% [markdown]
# ## What the interpreter is, and is not
#
# The interpreter runs the programs one after another, each `tl` operation a NumPy call on the
# whole tile. `tl.dot` is `np.matmul` in fp32, float16 operands multiplied exactly and
# summed in NumPy's order; `input_precision="ieee"` keeps a GPU from rounding fp32 operands to
# TF32, so float32 means the same compiled. `exp2` is NumPy's, not `ex2.approx`. Not modelled:
# warps, shared memory, registers, timing (so no autotuning), the programs' order (no atomics).
# A pass here says the kernel's *logic* is right; compiled, the hardware's rounding is added,
# within chapter 23's bound. `bench/bench_gpu.py` (`make bench-gpu`) checks and times it on a
# CUDA GPU, against PyTorch's SDPA; the README says what to expect.

# %% [markdown]
# ## Your turn: the Triton kernel's inner loop
#
# Write `forward_kernel`'s key loop as `@triton.jit attend_tile(m, l, acc, s, v) -> (m, l, acc)`:
# `s (BLOCK_M, BLOCK_N)` base-2 scores (`-inf` where masked), `v (BLOCK_N, BLOCK_DV)`, the float32
# state `m`, `l (BLOCK_M,)`, `acc (BLOCK_M, BLOCK_DV)`. The grader folds tiles through it under
# the interpreter from `m = -inf`, `l = 0`, `acc = 0`; a row masked throughout keeps that state.
# Re-run the grade cell until it says `passed`; the solution is hidden below.

# %% tags=["needs-triton"]
import triton.language as tl  # for your @triton.jit attend_tile (triton is imported above)
from flash_check.exercises import grade, show_solution, stub

attend_tile = stub("attend_tile")  # yours: @triton.jit def attend_tile(m, l, acc, s, v): ...

# %% tags=["needs-triton"]
grade("attend_tile", attend_tile)

# %% jupyter={"outputs_hidden": true} mystnb={"code_prompt_hide": "Hide the solution", "code_prompt_show": "Show the solution"} tags=["remove-input", "hide-output", "needs-triton"]
show_solution("attend_tile")

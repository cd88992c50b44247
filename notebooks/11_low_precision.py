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
# # 11. Low precision: float16 and bfloat16
#
# GPUs run attention in 16-bit formats: float16 and bfloat16 inputs, matrix products on tensor
# cores that accumulate in float32. This chapter measures what those formats cost, with the
# tools of chapter 7. In this chapter:
#
# - the two formats, and the NumPy facts we rely on for bfloat16 (which comes from the
#   `ml_dtypes` package), each checked against the installed package;
# - the error of each kernel against the truth, per dtype;
# - FlashAttention's own accuracy rule, reproduced on our kernels: the kernel's error at most
#   twice that of a reference computed in the same low precision, both against a float32
#   reference; and a kernel that fails it;
# - what rounding $P$ to the input dtype before the $PV$ product costs (GPU kernels do it to feed
#   the tensor cores);
# - float16 scores past 65504, and why scores are computed in float32.

# %%
import time

import ml_dtypes
import numpy as np
import matplotlib.pyplot as plt

import flash_lib

bfloat16 = ml_dtypes.bfloat16
rng = np.random.default_rng(11)

# %% [markdown]
# ## Two 16-bit formats
#
# float16 (IEEE half precision) has 10 fraction bits and 5 exponent bits; bfloat16 ("brain
# float") has 7 fraction bits and float32's 8 exponent bits. So float16 is eight times finer
# (its machine epsilon is $2^{-10}$, bfloat16's $2^{-7}$: three fraction bits more) while bfloat16 reaches as far as
# float32. `ml_dtypes.finfo` describes each of ml_dtypes' formats. NumPy's own `np.finfo` knows
# bfloat16 only because ml_dtypes 0.7, on import, writes its entries into NumPy's private
# `np.finfo._finfo_cache` (`ml_dtypes/_finfo.py`); with ml_dtypes 0.5 and 0.6,
# `np.finfo(bfloat16)` raises `ValueError`. `ml_dtypes.finfo` works with all three, so it is the
# one this chapter uses.

# %%
formats = {"float16": np.float16, "bfloat16": bfloat16, "float32": np.float32}
info = {name: ml_dtypes.finfo(dt) for name, dt in formats.items()}
print(f"{'dtype':<9} {'fraction bits':>13} {'eps':>10} {'u = eps/2':>10} {'max':>11}")
for name, fi in info.items():
    print(f"{name:<9} {fi.nmant:>13} {float(fi.eps):>10.3e} {float(fi.eps) / 2:>10.3e} "
          f"{float(fi.max):>11.4e}")
np_info = np.finfo(bfloat16)
np_agrees = all(getattr(np_info, f) == getattr(info["bfloat16"], f)
                for f in ("eps", "max", "tiny", "nmant", "maxexp"))
print("np.finfo(bfloat16) agrees with ml_dtypes.finfo on eps, max, tiny, nmant, maxexp:",
      np_agrees)

# %% [markdown]
# One more version difference touches every bfloat16 input this chapter makes. Rounding float64
# to bfloat16 by way of float32 rounds twice, and twice is not once: a float64 just above the
# midpoint of two bfloat16 neighbours can land, in float32, exactly on that midpoint, and the tie
# then goes to the even neighbour, which is the farther one. $1 + 2^{-8} + 2^{-40}$ lies between
# 1 and $1 + 2^{-7}$, nearer the second; float32 drops the $2^{-40}$. ml_dtypes 0.6 converted
# through float32; 0.7 rounds once, the fix of its pull request #401 ("Fix double rounding in
# conversions to the custom float types"), as the cell below measures.

# %%
x64 = np.random.default_rng(1).standard_normal(1_000_000)
once, twice = x64.astype(bfloat16), x64.astype(np.float32).astype(bfloat16)
differ = once != twice
err_once = np.abs(once.astype(np.float64) - x64)[differ]
err_twice = np.abs(twice.astype(np.float64) - x64)[differ]
midpoint_plus = np.float64(1 + 2**-8 + 2**-40)
print(f"float64 -> bfloat16 directly vs by way of float32: {differ.sum()} of {x64.size:,} "
      f"differ; the direct one is the nearer in all of them: {bool((err_once < err_twice).all())}")
print(f"1 + 2^-8 + 2^-40 -> {float(midpoint_plus.astype(bfloat16))} directly, "
      f"{float(midpoint_plus.astype(np.float32).astype(bfloat16))} by way of float32")

# %% [markdown]
# ## What NumPy does with bfloat16
#
# `ml_dtypes` registers bfloat16 as a NumPy dtype, but NumPy's own machinery treats it unevenly.
# What this chapter relies on, each checked below on the installed versions:
#
# - `np.matmul` (the `@` operator) of two bfloat16 arrays returns **float32**;
# - `np.dot` of the same arrays returns **bfloat16**, through a plain loop (timed below);
# - `np.einsum` rejects bfloat16 with a `TypeError`;
# - elementwise functions (`np.exp`) and reductions stay in bfloat16, and a reduction
#   **accumulates** in bfloat16 unless given `dtype=np.float32`: the sum of 1000 ones is 256,
#   because $256 + 1$ rounds back to 256 with 8 significant bits.
#
# This is why `flash_lib` converts 16-bit inputs to float32 tile by tile and computes everything
# in float32, returning the output in the input's dtype (and the lse in float32, as FlashAttention
# stores it).

# %%
a = rng.standard_normal((256, 256)).astype(bfloat16)
b = rng.standard_normal((256, 256)).astype(bfloat16)
matmul_dtype, dot_dtype = (a @ b).dtype, np.dot(a, b).dtype
try:
    np.einsum("ij,jk->ik", a, b)
    einsum_error = None
except TypeError:  # the message's wording is NumPy's and may change between releases
    einsum_error = "raises TypeError"
ones = np.ones(1000, dtype=bfloat16)
sum_bf16, sum_f32 = ones.sum(), ones.sum(dtype=np.float32)
print("a @ b:", matmul_dtype, "| np.dot(a, b):", dot_dtype)
print("np.einsum:", einsum_error)
print("np.exp(a).dtype:", np.exp(a).dtype, "| a.max().dtype:", a.max().dtype)
print(f"1000 ones summed in bfloat16: {float(sum_bf16):g} ({sum_bf16.dtype}); "
      f"with dtype=np.float32: {float(sum_f32):g}")
# np.dot rounds each entry to bfloat16, changing it by at most u = 2^-8 of itself; the two float32
# sums differ by far less. The measured difference is printed with the timing below.
matmul_vs_dot = np.abs((a @ b) - np.dot(a, b).astype(np.float32)).max() / np.abs(a @ b).max()
u_bf16 = float(ml_dtypes.finfo(bfloat16).eps) / 2
print(f"a @ b vs np.dot(a, b), relative to the largest entry: within bfloat16's u = {u_bf16:.2e} "
      f"(its rounding): {matmul_vs_dot <= 1.01 * u_bf16}")


# %% tags=["nbval-ignore-output"]
def best_of(fn, repeats=7):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


t_matmul, t_dot = best_of(lambda: a @ b), best_of(lambda: np.dot(a, b))
print(f"on the machine that built this page, 256 x 256 bfloat16: np.dot takes "
      f"{t_dot / t_matmul:.0f}x\nas long as np.matmul; their results differ by {matmul_vs_dot:.1e} "
      f"of the largest entry")

# %% [markdown]
# ## Each kernel's error, per dtype
#
# As in chapter 7: one set of inputs ($N_q = 64$ queries, $N_k = 2048$ keys, $d = 64$, standard
# normal), rounded to each dtype, and for each the truth computed by
# `flash_lib.precise_attention` from *the rounded inputs*, so that only the kernels' own
# arithmetic is measured, with chapter 7's metric, `flash_lib.rowwise_relative_error`. Every
# function of flash_lib takes float16 and bfloat16 arrays as they are: the kernels and the
# truth widen them exactly, and the error metric compares them in the wider dtype.
#
# Both of our kernels compute in float32 for 16-bit inputs and round once, at the end. Rounding
# a number to a format with unit roundoff $u = \text{eps}/2$ changes it by at most $u$ times its
# size, so each entry's rounding adds at most $u \cdot \max_c |o_{ic}|$ to the row's error: the
# 16-bit kernels' error is bounded by $u_{16}$ (relative to the row's largest entry) plus the
# float32 computation's own error. The cell checks that bound, and the stronger statement behind
# it: the 16-bit output *is* the float32 output on the widened inputs, rounded. In float32 and
# float64 nothing is rounded at the end, and the error is the computation's own: about ten $u$
# here (the picture at the end of the chapter shows each measured error), below $100u$ at every
# NumPy CPU level and BLAS kernel tried. Which of flash and naive comes out smaller depends on
# the CPU (chapter 7); FlashAttention's bar, flash's error at most twice naive's, holds in every
# dtype.

# %%
n_q, n_k, d = 64, 2048, 64
q64, k64, v64 = (rng.standard_normal((n, d)) for n in (n_q, n_k, n_k))
dtypes = {"float16": np.float16, "bfloat16": bfloat16, "float32": np.float32, "float64": np.float64}
inputs = {name: tuple(x.astype(dt) for x in (q64, k64, v64)) for name, dt in dtypes.items()}
truth = {name: flash_lib.precise_attention(*qkv) for name, qkv in inputs.items()}


def row_error(out, name):
    return float(flash_lib.rowwise_relative_error(out, truth[name]).max())


outputs = {name: {"flash": flash_lib.flash_attention(*qkv), "naive": flash_lib.naive_attention(*qkv)}
           for name, qkv in inputs.items()}
kernel_error = {name: {kernel: row_error(out, name) for kernel, out in outs.items()}
                for name, outs in outputs.items()}
# The float32 computation's own error on the widened 16-bit inputs, for the 16-bit bound
err32 = {name: {"flash": row_error(flash_lib.flash_attention(*(x.astype(np.float32)
                                                               for x in inputs[name])), name),
                "naive": row_error(flash_lib.naive_attention(*(x.astype(np.float32)
                                                               for x in inputs[name])), name)}
         for name in ("float16", "bfloat16")}
kernel_bound, bound_text = {}, {}
for name in dtypes:
    u = float(ml_dtypes.finfo(dtypes[name]).eps) / 2
    if name in err32:  # |round(o32) - o*| <= u |o32| + |o32 - o*|, relative to the row's max |o*|
        kernel_bound[name] = {kr: u * (1 + e) + e for kr, e in err32[name].items()}
        bound_text[name] = "u + the float32 computation's error"
    else:  # measured: 10 to 17 u at every CPU level and BLAS kernel tried
        kernel_bound[name] = {"flash": 100 * u, "naive": 100 * u}
        bound_text[name] = "100 u"
within_bound = {name: {kr: kernel_error[name][kr] <= kernel_bound[name][kr] for kr in ("flash", "naive")}
                for name in dtypes}
twice_naive = {name: errs["flash"] <= 2 * errs["naive"] for name, errs in kernel_error.items()}
print(f"{'dtype':<9} {'out dtype':>9} {'u':>9}   flash, naive within   bound")
for name in dtypes:
    u = float(ml_dtypes.finfo(dtypes[name]).eps) / 2
    print(f"{name:<9} {str(outputs[name]['flash'].dtype):>9} {u:>9.2e}   "
          f"{within_bound[name]['flash']!s:>5}  {within_bound[name]['naive']!s:>5}          "
          f"{bound_text[name]}")
print("flash's error at most twice naive's, in every dtype:", all(twice_naive.values()))

widened_then_rounded = {
    name: np.array_equal(
        outputs[name]["flash"],
        flash_lib.flash_attention(*(x.astype(np.float32) for x in inputs[name])).astype(dtypes[name]))
    for name in ("float16", "bfloat16")
}
print("16-bit output == float32 output on the widened inputs, rounded:")
print("  ", widened_then_rounded)

# %% [markdown]
# ## FlashAttention's accuracy rule
#
# FlashAttention does not test its kernels against a fixed tolerance. Its test suite
# (`tests/test_flash_attn.py` in Dao-AILab/flash-attention) computes, from the same 16-bit
# inputs, a reference in float32 (`attention_ref(..., upcast=True)`) and "PyTorch in the same
# dtype" (`attention_ref(..., upcast=False, reorder_ops=True)`), and requires
#
# $$\max |O - O_{\text{ref}}| \;\le\; 2 \max |O_{\text{pt}} - O_{\text{ref}}| :$$
#
# the kernel may err at most twice as much as a straightforward implementation in the same
# precision. Its comment: "Check that FlashAttention's numerical error is at most twice the
# numerical error of a Pytorch implementation."
#
# We reproduce it with NumPy. $O_{\text{ref}}$ is `naive_attention` on the inputs widened to
# float32. $O_{\text{pt}}$ follows `attention_ref(upcast=False, reorder_ops=True)` step by step,
# each step rounded to the input dtype as a GPU framework's 16-bit tensors are (its matrix
# products accumulate in float32 and round the result, its softmax computes in float32 and
# rounds the weights): $k / \sqrt d$, the scores, the weights $P$ and the output each rounded.
#
# Two kernels of our own face the rule besides `flash_attention`: one that rounds $P$ to the
# input dtype before $PV$ (next section), and one that keeps its accumulator $\text{acc}$ in the
# input dtype, rounding it after each of 128 key blocks of 16, a mistake a rule of this kind
# exists to catch.

# %%
def attention_same_dtype(q, k, v):
    """attention_ref(upcast=False, reorder_ops=True), every tensor rounded to the input dtype."""
    dt, f32 = q.dtype, np.float32
    k_scaled = (k.astype(f32) / np.sqrt(q.shape[-1])).astype(dt)
    s = (q.astype(f32) @ k_scaled.astype(f32).T).astype(dt)  # float32 accumulation, rounded
    s32 = s.astype(f32)
    p = np.exp(s32 - s32.max(axis=-1, keepdims=True))
    p = (p / p.sum(axis=-1, keepdims=True)).astype(dt)  # softmax in float32, rounded
    return (p.astype(f32) @ v.astype(f32)).astype(dt)


def unnormalised_weights(q, k):
    """P = exp(S - m) in float32 and its row sum l, as a tiled kernel holds them."""
    f32 = np.float32
    s = (q.astype(f32) @ k.astype(f32).T) * f32(1 / np.sqrt(q.shape[-1]))
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p, p.sum(axis=-1, keepdims=True)


def p_rounded(q, k, v):
    """P rounded to the input dtype before P·V (float32 accumulation), l from the float32 P."""
    p, l = unnormalised_weights(q, k)
    return ((p.astype(q.dtype).astype(np.float32) @ v.astype(np.float32)) / l).astype(q.dtype)


def acc_in_input_dtype(q, k, v, block_k=16):
    """A defective kernel: acc rounded to the input dtype after every key block."""
    p, l = unnormalised_weights(q, k)
    acc = np.zeros((q.shape[0], v.shape[1]), dtype=q.dtype)
    for j in range(0, k.shape[0], block_k):
        tile = p[:, j : j + block_k] @ v[j : j + block_k].astype(np.float32)
        acc = (acc.astype(np.float32) + tile).astype(q.dtype)
    return (acc.astype(np.float32) / l).astype(q.dtype)


candidates = {"flash_attention": flash_lib.flash_attention, "naive_attention": flash_lib.naive_attention,
              "P rounded before PV": p_rounded, "acc in the input dtype": acc_in_input_dtype}
rule = {}
for name in ("float16", "bfloat16"):
    q, k, v = inputs[name]
    o_ref = flash_lib.naive_attention(*(x.astype(np.float32) for x in (q, k, v)))
    err_pt = float(np.abs(attention_same_dtype(q, k, v).astype(np.float32) - o_ref).max())
    rule[name] = {"same-dtype reference": (err_pt, 1.0)}
    for kernel, fn in candidates.items():
        err = float(np.abs(fn(q, k, v).astype(np.float32) - o_ref).max())
        rule[name][kernel] = (err, err / err_pt)
    print(f"{name}: max |O - O_ref| over the same-dtype reference's (rule: <= 2)")
    for kernel, (err, ratio) in rule[name].items():
        size = "1 (itself)" if kernel == "same-dtype reference" else (
            "below 1" if ratio < 1 else "1 to 2" if ratio <= 2 else "above 2")
        print(f"   {kernel:<24} {size:>10}   {'passes' if ratio <= 2 else 'FAILS'}")

# %% [markdown]
# The ratios printed as "below 1" were about 0.4 to 0.6 on the machine that built this page, the
# failing ones 3 to 5: far from the bar of 2, so no CPU's rounding moves a verdict (the errors
# themselves, against the truth, are in the picture at the end). Both of our kernels pass with
# room to spare: they round once, where the same-dtype reference rounds the scores, the weights
# and the output. Keeping the accumulator in 16 bits fails in
# both dtypes: each of the 128 block additions rounds the running sum to the format's 11 or 8
# significant bits, and those errors add up.
#
# ## Rounding $P$ before $PV$
#
# A GPU kernel computes $P = e^{S - m'}$ in float32 registers and then converts it to the input
# dtype, because the tensor cores multiply 16-bit operands (accumulating in float32). The row sum
# $l$ is taken from the float32 $P$. Rounding changes each weight $p_j \in [0, 1]$ by at most
# $u\,p_j$, so the output row moves by at most $u \sum_j p_j |v_j| / l \le u \max_j |v_j|$, and by
# much less when the weights are spread and their rounding errors partly cancel. The table above
# has it ("P rounded before PV"); here it is as a rowwise error against the truth, next to the
# error of the output rounding alone (the picture at the end shows the three errors).

# %%
p_cost = {}
for name in ("float16", "bfloat16"):
    q, k, v = inputs[name]
    u = float(ml_dtypes.finfo(dtypes[name]).eps) / 2
    p_cost[name] = (kernel_error[name]["flash"], row_error(p_rounded(q, k, v), name),
                    row_error(attention_same_dtype(q, k, v), name), u)
    print(f"{name} (u = {u:.2e}), rowwise error against the truth, P rounded too:\n   within "
          f"twice the output rounding alone: {p_cost[name][1] <= 2 * p_cost[name][0]}, below the "
          f"same-dtype reference's: {p_cost[name][1] < p_cost[name][2]}")

# %% [markdown]
# ## Scores past 65504
#
# float16's largest number is 65504. A score is a dot product of $d$ products, so two float16
# vectors with entries of a few dozen already have a dot product beyond it: with $q_c = k_c = 40$
# and $d = 64$, $q \cdot k = 102400$. Computed in float16 it is $\infty$, and the softmax of a row
# holding $\infty$ is NaN. Scaling $q$ by $\tau = 1/8$ first helps only until the *scaled* score
# passes 65504 ($q_c = k_c = 100$: $\tau\, q \cdot k = 80000$). `flash_lib` computes scores in
# float32, whose range (about $3.4 \times 10^{38}$) a product of two float16 numbers summed $d$
# times cannot leave, so it returns the right answer; bfloat16 has float32's range and no such
# limit.
#
# Range is not the only reason. A score in float16 carries an absolute error of about
# $u_{16} |s|$ with $u_{16} = 2^{-11}$ (chapter 7: that error becomes a relative error of the
# weight): at $|s| = 1000$ float16's spacing is 0.5, so a score is off by up to 0.25 and its weight
# by up to $e^{0.25}$, about 28%. The cell computes one row of 256 competing scores near 1000
# (built as in chapter 7) with float16 scores and with flash_lib.

# %%
def scores_then_softmax_in(dt, q, k, v, prescale):
    """Scores as a dt tensor (float32 accumulation, rounded), then softmax and P·V in float32."""
    tau = np.float32(1 / np.sqrt(q.shape[-1]))
    qs = (q.astype(np.float32) * tau).astype(dt) if prescale else q
    with np.errstate(over="ignore", invalid="ignore"):
        s = (qs.astype(np.float32) @ k.astype(np.float32).T).astype(dt).astype(np.float32)
        if not prescale:
            s = s * tau
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        return (p / p.sum(axis=-1, keepdims=True)) @ v.astype(np.float32)


overflow_cases = {}
v_small = rng.standard_normal((2, 4)).astype(np.float16)
for entry in (40.0, 100.0):
    qk = np.full((1, 64), entry, dtype=np.float16)
    kk = np.vstack([qk, qk * np.float16(0.5)])  # two keys: scores s and s/2
    exact = flash_lib.precise_attention(qk, kk, v_small)
    overflow_cases[entry] = {
        "float16 scores": scores_then_softmax_in(np.float16, qk, kk, v_small, prescale=False),
        "float16 scores of tau·q": scores_then_softmax_in(np.float16, qk, kk, v_small, prescale=True),
        "flash_lib": flash_lib.flash_attention(qk, kk, v_small),
    }
    print(f"q_c = k_c = {entry:g}: q·k = {64 * entry**2:g}, tau·q·k = {8 * entry**2:g}")
    for name, out in overflow_cases[entry].items():
        print(f"   {name:<24} {np.array2string(np.asarray(out, np.float64)[0], precision=4)}")
    overflow_cases[entry]["truth"] = exact

# Competing keys (chapter 7): every key shares a first feature 1, the query's first feature is
# 8000, so every score is 1000 plus a standard-normal-sized term that decides the weights.
u16 = 2.0**-11
q_big = rng.standard_normal((1, d)).astype(np.float16)
k_big = rng.standard_normal((256, d)).astype(np.float16)
q_big[0, 0], k_big[:, 0] = 8000, 1
v_big = rng.standard_normal((256, 4)).astype(np.float16)
truth_big = flash_lib.precise_attention(q_big, k_big, v_big)
err_f16_scores = float(flash_lib.rowwise_relative_error(
    scores_then_softmax_in(np.float16, q_big, k_big, v_big, prescale=True), truth_big).max())
err_flash_big = float(flash_lib.rowwise_relative_error(
    flash_lib.flash_attention(q_big, k_big, v_big), truth_big).max())
s_big = (q_big.astype(np.float32) @ k_big.astype(np.float32).T) / 8
print(f"a row of scores from {s_big.min():.0f} to {s_big.max():.0f}: error with float16 scores "
      f"above 0.05: {err_f16_scores > 0.05},\n   flash_lib's within float16's u: "
      f"{err_flash_big <= u16 * 1.01} (both errors are in the picture below)")

# %% [markdown]
# ## The picture
#
# The errors of this chapter against the truth, per dtype, on a log axis, with each dtype's unit
# roundoff $u$ drawn as a line (left); and each kernel's error in units of its output dtype's
# $u$, for all four dtypes and for the row of scores near 1000 (right). These are the measured
# numbers the cells above checked against their bounds; another CPU draws slightly different
# points.

# %%
fig, (ax, ax_u) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1.2, 1]})
names16 = ["float16", "bfloat16"]
series = {
    "flash_attention": [kernel_error[n]["flash"] for n in names16],
    "naive_attention": [kernel_error[n]["naive"] for n in names16],
    "P rounded before PV": [p_cost[n][1] for n in names16],
    "same-dtype reference": [p_cost[n][2] for n in names16],
    "acc in the input dtype": [row_error(acc_in_input_dtype(*inputs[n]), n) for n in names16],
}
# points, not bars: on a log axis a bar's length would be measured from an arbitrary floor
width = 0.16
for i, (label, values) in enumerate(series.items()):
    ax.plot(np.arange(2) + (i - 2) * width, values, "osD^v"[i], ms=8, ls="none", label=label,
            color=f"C{i}")
for j, n in enumerate(names16):
    u = float(ml_dtypes.finfo(dtypes[n]).eps) / 2
    ax.hlines(u, j - 2.6 * width, j + 2.6 * width, color="k", ls="--", lw=1,
              label="unit roundoff u of the dtype" if j == 0 else None)
ax.set_yscale("log")
ax.set_xticks(range(2), [f"{n} inputs" for n in names16])
ax.set_ylabel("max rowwise relative error vs truth (dimensionless)")
ax.set_title(f"Error against the truth, $N_q$ = {n_q}, $N_k$ = {n_k}, $d$ = {d}")
ax.legend(fontsize=8, loc="upper left")
ax.set_ylim(1e-4, 1)
ax.set_xlim(-0.6, 1.6)
ax.grid(True, axis="y", which="major", alpha=0.3)
names_all = list(dtypes)
for i, kernel in enumerate(("flash", "naive")):
    ax_u.plot(np.arange(len(names_all)) + (i - 0.5) * 0.3,
              [kernel_error[n][kernel] / (float(ml_dtypes.finfo(dtypes[n]).eps) / 2)
               for n in names_all], "os"[i], ms=8, ls="none", color=f"C{i}",
              label=f"{kernel}_attention")
x_big = len(names_all) + 0.3
ax_u.plot(x_big - 0.15, err_flash_big / u16, "o", ms=8, color="C0")
ax_u.plot(x_big + 0.15, err_f16_scores / u16, "X", ms=9, color="C5", label="float16 scores")
ax_u.axhline(1, color="k", ls="--", lw=1, label="u")
ax_u.axhline(100, color="k", ls=":", lw=1, label="100 u, the float32 and float64 bound")
ax_u.set_yscale("log")
ax_u.set_xticks(list(range(len(names_all))) + [x_big], names_all + ["float16,\nscores ≈ 1000"])
ax_u.set_ylabel("error / u of the output's dtype")
ax_u.set_title("The same errors in units of u")
ax_u.legend(fontsize=8, loc="upper left")
ax_u.set_ylim(0.1, 3e3)
ax_u.grid(True, axis="y", which="major", alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What we showed
#
# - float16 has $u = 2^{-11} \approx 4.9 \times 10^{-4}$ and overflows past 65504; bfloat16 has
#   $u = 2^{-7}/2 \approx 3.9 \times 10^{-3}$ and float32's range. `ml_dtypes.finfo` describes
#   both; `np.finfo` agrees with it for bfloat16 only since ml_dtypes 0.7, which also rounds
#   float64 to bfloat16 once instead of twice (through float32).
# - With ml_dtypes' bfloat16, `@` returns float32, `np.dot` returns bfloat16 (and is much slower
#   on the machine that built this page), `np.einsum` raises `TypeError`, and a plain `sum`
#   accumulates in bfloat16: 1000 ones sum to 256.
# - `flash_attention` and `naive_attention` on 16-bit inputs return exactly the float32 result on
#   the widened inputs, rounded: their error is at most the dtype's $u$ plus the float32
#   computation's error. In float32 and float64 their error is the computation's own, about ten
#   $u$ (below $100u$), and flash's is at most twice naive's.
# - FlashAttention's rule, error $\le 2\times$ that of the same-dtype reference against a float32
#   reference, holds for both our kernels (ratios below 1: they err less than the same-dtype
#   reference) and for rounding $P$ before $PV$, and fails for a kernel that keeps its
#   accumulator in the 16-bit input dtype.
# - Rounding $P$ to the input dtype adds little to the output's own rounding.
# - float16 scores overflow to $\infty$ past 65504 (and give NaN), even after scaling; scores near
#   1000 in float16 carry errors above 5% (about 15% on the machine that built this page).
#   flash_lib, scoring in float32, is exact to the output's rounding in both cases.

# %%
assert np_agrees
assert differ.sum() > 0 and (err_once < err_twice).all()
assert float(midpoint_plus.astype(bfloat16)) == 1 + 2**-7
assert float(midpoint_plus.astype(np.float32).astype(bfloat16)) == 1.0
assert float(info["float16"].eps) == 2.0**-10 and float(info["bfloat16"].eps) == 2.0**-7
assert float(info["float16"].max) == 65504 and float(info["bfloat16"].max) > 3e38
assert matmul_dtype == np.float32 and dot_dtype == bfloat16 and einsum_error is not None
assert float(sum_bf16) == 256 and float(sum_f32) == 1000 and sum_bf16.dtype == bfloat16
assert np.exp(a).dtype == bfloat16
assert matmul_vs_dot <= 1.01 * u_bf16, matmul_vs_dot
for name in ("float16", "bfloat16"):
    assert outputs[name]["flash"].dtype == dtypes[name] and outputs[name]["naive"].dtype == dtypes[name]
    assert widened_then_rounded[name]
    # the rule: ours pass, the 16-bit accumulator fails in bfloat16
    for kernel in ("flash_attention", "naive_attention", "P rounded before PV"):
        assert rule[name][kernel][1] <= 2, (name, kernel, rule[name][kernel])
    assert rule[name]["flash_attention"][1] < 1
    # rounding P costs less than the same-dtype reference's rounding of everything
    assert p_cost[name][1] < p_cost[name][2]
    assert rule[name]["acc in the input dtype"][1] > 2, (name, rule[name])
# each kernel within its bound in every dtype (16-bit: derived; float32, float64: 100 u, measured
# 10 to 17 u at every CPU level), and FlashAttention's bar, flash at most twice naive (measured
# 0.65 to 0.91)
assert all(all(w.values()) for w in within_bound.values()), (kernel_error, kernel_bound)
assert all(twice_naive.values()), kernel_error
# overflow: float16 scores give NaN, flash_lib matches the truth to float16 rounding
for entry, outs in overflow_cases.items():
    assert np.isnan(outs["float16 scores"]).all(), entry
    assert flash_lib.rowwise_relative_error(outs["flash_lib"], outs["truth"]).max() <= u16 * 1.01
assert np.isfinite(overflow_cases[40.0]["float16 scores of tau·q"]).all()
assert np.isnan(overflow_cases[100.0]["float16 scores of tau·q"]).all()
assert err_f16_scores > 0.05 and err_flash_big <= u16 * 1.01

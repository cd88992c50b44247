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
# # 19. After FlashAttention-3: FA4's numerics and batch invariance
#
# FlashAttention-4 (Blackwell) changes two things in the softmax, both pure arithmetic that a
# CPU reproduces exactly: part of each tile's $2^x$ is computed by a polynomial on the FMA units
# instead of the special function unit, and the running maximum moves only when it must. This
# chapter emulates the first bit for bit, derives why the second leaves the result exact, shows
# how it breaks FP8 (and FA4's fix), and ends with split-KV decoding's *batch invariance*.
#
# **Sources.** Dao-AILab/flash-attention at commit `0251105a`: `flash_attn/cute/utils.py`
# (`POLY_EX2`, `ex2_emulation`, `ex2_emulation_2`, `add_round_down`, `combine_int_frac_ex2`),
# `flash_attn/cute/softmax.py` (`update_row_max`, `apply_exp2_convert`),
# `flash_attn/cute/flash_fwd_sm100.py` (Note [Low Precision Scaling], `rescale_threshold = 8.0`
# for 16-bit inputs, `max_offset = 8` for FP8), `flash_attn/cute/interface.py`
# (`num_splits_heuristic`). FA issue #2716 and PR #2717 (FP8 saturation); Thinking Machines,
# "Defeating Nondeterminism in LLM Inference" (2025), FA issue #1897 / PR #2450 and FlashInfer
# PR #1675 (batch invariance).

# %%
import matplotlib.pyplot as plt
import ml_dtypes
import numpy as np

from flash_bench import below
from flash_fa4 import POLY_EX2, exp2_poly, rescale_count, ulp_error
from flash_invariance import decode_in_batch, num_splits_heuristic
from flash_lib import (flash_attention, flash_attention_backward, naive_attention,
                       precise_attention, rowwise_relative_error)

rng = np.random.default_rng(19)
F32, BF16, E4M3 = np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn

# %% [markdown]
# ## 1. FA4's `exp2`, emulated bit for bit
#
# For $x \le 127$, `ex2_emulation` computes $2^x = 2^{\lfloor x\rfloor}\cdot 2^{f}$ with five
# float32 operations, each rounding as PTX says:
#
# 1. `fmax(x, -127)`: below $2^{-127}$ nothing survives anyway;
# 2. `add.rm(x, 1.5·2^23)`: rounding **down** puts $\lfloor x\rfloor$ in the low mantissa bits
#    (between $2^{23}$ and $2^{24}$ float32's spacing is 1);
# 3. two round-to-nearest subtractions give the fraction $f = x - \lfloor x\rfloor \in [0, 1]$;
# 4. Horner's rule with one FMA per coefficient: $p(f) = c_0 + f(c_1 + f(c_2 + f c_3))$, the
#    coefficients a sollya `fpminimax` fit of $2^f$ on $[0, 1]$, each a float32;
# 5. the integer bits of step 2, shifted left by 23, added to the bits of $p$: that adds
#    $\lfloor x\rfloor$ to the exponent field.
#
# `flash_fa4.exp2_poly` does these in NumPy: the FMA rounds once (the float64 sum rounded to
# odd, then to float32, `flash_fa4.fma32`), the rounding down is explicit. `tests/test_fa4.py`
# checks it bit for bit against the same steps done in exact rational arithmetic.

# %%
for degree, coeffs in POLY_EX2.items():
    assert all(float(F32(c)) == c for c in coeffs) and coeffs[0] == 1.0
print("degree 3:", POLY_EX2[3])
x = np.array([0.0, -1.0, -0.5, -2**-30, -10.25, 3.0], F32)
y = exp2_poly(x)
for xi, yi in zip(x, y):
    print(f"x = {xi:>12.9g}   exp2_poly = {yi!r:>14}   exact 2^x = {np.exp2(np.float64(xi)):.9g}")
assert y[0] == 1 and y[1] == 0.5 and y[5] == 8  # exact at integers: p(0) = c_0 = 1

# %% [markdown]
# At $x = -2^{-30}$ the fraction rounds to $1$ (step 3 cannot hold $1 - 2^{-30}$), and the
# result is $p(1)/2$ rather than $p(0)$: still within the polynomial's error, as every other point.
#
# **The error, in float32 ulps** of the exact $2^x$, over the range softmax uses ($x = s - m \le
# 0$; with a lagging maximum, section 2, up to the threshold):

# %% tags=["hide-input"]
xs = np.linspace(-20, 8, 56_001, dtype=F32)
errors = {d: ulp_error(exp2_poly(xs, d), xs) for d in POLY_EX2}
fig, ax = plt.subplots(figsize=(8, 4.4))
for d in (2, 3, 4, 5):
    ax.semilogy(xs, np.maximum(errors[d], 1e-3), lw=0.6, label=f"degree {d}")
ax.set_xlabel("x (the exponent, base-2 units)")
ax.set_ylabel("|exp2_poly(x) - 2^x|  (float32 ulps of 2^x)")
ax.set_title("FA4's software exp2: error in float32 ulps by polynomial degree")
ax.legend()
plt.show()

# %%
relative = {d: float(np.max(np.abs(exp2_poly(xs, d) / np.exp2(xs.astype(float)) - 1)))
            for d in POLY_EX2}
for d in POLY_EX2:
    print(f"degree {d}: worst {errors[d].max():9.0f} ulps, relative 2^{np.log2(relative[d]):.1f}")
# The error is the polynomial's alone (periodic in x): the same worst case in every unit interval
assert all(errors[d].max() > errors[d + 1].max() for d in range(1, 5))

# %% [markdown]
# **Which degree a format needs.** $P$ is rounded to the MMA's input format right after the
# exponential, with relative error up to the unit roundoff $u$ ($2^{-8}$ for bfloat16,
# $2^{-11}$ for float16, $2^{-4}$ for e4m3, $2^{-24}$ for float32). The polynomial is harmless
# when its error is a small part of that rounding, say at most $u/4$:

# %%
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "e4m3": 2.0**-4, "float32": 2.0**-24}
needed = {fmt: next((d for d in POLY_EX2 if relative[d] <= u / 4), None)
          for fmt, u in UNIT_ROUNDOFF.items()}
print(needed)
assert needed == {"bfloat16": 3, "float16": 3, "e4m3": 2, "float32": None}

# %% [markdown]
# Degree 3 is FA4's choice for 16-bit $P$; FP8 would do with degree 2, and float32 needs more
# than degree 5 (the hardware `MUFU.EX2` is itself not correctly rounded, but within 2 ulps).
#
# **In attention.** FA4 sends a fraction of each fragment's exponentials to the polynomial
# (`ex2_emu_freq`, `ex2_emu_res` in `apply_exp2_convert`). Here: every other exponential, then
# $P$ rounded to bfloat16 before $PV$, against the same with float32's `exp2` throughout.

# %%
def attention_bf16_p(q, k, v, emulate):
    """Dense attention in float32 with P rounded to bfloat16 before P·V, l from the float32 P;
    with ``emulate``, every other column's exp2 by exp2_poly."""
    s = (q @ k.T).astype(F32) * F32(np.log2(np.e) / np.sqrt(q.shape[-1]))
    x = s - s.max(-1, keepdims=True)
    p = np.exp2(x)
    if emulate:
        p[:, ::2] = exp2_poly(x[:, ::2])
    p16 = p.astype(BF16).astype(F32)
    return (p16 @ v) / p.sum(-1, keepdims=True)


q, k, v = (rng.standard_normal((256, 64)).astype(F32) for _ in range(3))
truth = precise_attention(q.astype(float), k.astype(float), v.astype(float))
err_hw = rowwise_relative_error(attention_bf16_p(q, k, v, False), truth).max()
err_emu = rowwise_relative_error(attention_bf16_p(q, k, v, True), truth).max()
print(f"worst row error with bf16 P, half the exponentials emulated / none: {err_emu / err_hw:.1f}")
assert err_emu < 1.2 * err_hw  # the bf16 rounding of P dominates; the polynomial adds little

# %% [markdown]
# ## 2. Conditional rescaling
#
# The online softmax rescales `acc` and `l` by $2^{m - m'}$ whenever a tile raises the row's
# maximum. FA4 keeps the old $m$ unless the tile's maximum $\hat m$ exceeds it by more than a
# threshold $t$ (`update_row_max`: keep when $(m - \hat m)\cdot\log_2 e \cdot \tau \ge -t$).
# Nothing about exactness depends on *which* reference $m$ is used: with any $m$,
#
# $$\frac{\sum_j 2^{s_j - m} v_j}{\sum_j 2^{s_j - m}} = \frac{\sum_j 2^{s_j} v_j}{\sum_j 2^{s_j}},
# \qquad \log_2 \sum_j 2^{s_j} = m + \log_2 \sum_j 2^{s_j - m},$$
#
# so `out = acc / l` and `lse = m + log l` are unchanged in exact arithmetic. What changes is
# the range: the kept $m$ is at most $t$ below any score seen, so $p = 2^{s - m} \le 2^t$ and
# `acc` may reach $2^t \cdot N_k \cdot \max|v|$. In float32 that is harmless for any $t$ up to
# about 64; in the MMA's input format, $P$ itself must stay finite and unsaturated:
# $t < \log_2(\text{max})$: 15.99 for float16, 8.81 for e4m3. FA4 uses $t = 8$ for 16-bit
# inputs and $t = 0$ for FP8, and asserts `max_offset + rescale_threshold < log2(dtype max)`.
#
# `flash_lib.flash_attention(..., rescale_threshold=t)` is that rule (in base-2 units whatever
# exponential the machine uses). The result agrees with the dense reference for every $t$:

# %%
q, k, v = (rng.standard_normal((2, 300, 64)).astype(F32) for _ in range(3))
k[..., :, :] += np.linspace(0, 2, 300, dtype=F32)[:, None] * np.sign(q.sum((0, 1)))  # rising
reference = naive_attention(q, k, v, causal=True)
truth = precise_attention(*(a.astype(float) for a in (q, k, v)), causal=True)
naive_err = rowwise_relative_error(reference, truth).max()
for t in (None, 0, 4, 8, 16, 32, 64):
    out = flash_attention(q, k, v, causal=True, block_k=32, rescale_threshold=t)
    err = rowwise_relative_error(out, truth).max()
    assert err <= 2 * naive_err + 1e-6, (t, err)
print("every threshold within FlashAttention's rule: error <= 2 x naive's + 1e-6")

# %% [markdown]
# **How many rescales it saves.** `flash_fa4.rescale_count` replays a row's tile maxima (128
# keys a tile, base-2 units) and counts the moves of its maximum: on random scores, and on
# scores that rise along the keys (a growing maximum, the adversarial case for the plain rule).

# %%
def tile_maxima(s, block=128):
    return s.reshape(s.shape[0], -1, block).max(-1)


n, d = 4096, 64
q, k = (rng.standard_normal((64, n, d))[0] for _ in range(2))
random_s = (q @ k.T) / np.sqrt(d) * np.log2(np.e)
rising_s = random_s + np.linspace(0, 64, n)[None, :]  # a max that grows by 2 per tile
counts = {}
for name, s in (("random", random_s), ("rising", rising_s)):
    for t in (None, 8):
        counts[name, t] = rescale_count(tile_maxima(s), t)[0].mean()
        print(f"{name:>6}, threshold {t}: {counts[name, t]:5.2f} rescales per row of 31 "
              f"tile steps")
assert counts["rising", None] >= 30 and counts["rising", 8] <= 8 and counts["random", 8] == 0
assert counts["random", None] >= 1

# %% [markdown]
# With $t = 8$ a random row never rescales after its first tile, and a steadily rising one
# rescales once per 8 units of growth instead of every tile.
#
# **The backward is unchanged**: it recomputes $P = \exp(S - \mathrm{lse})$ from the final lse,
# which the threshold does not change (in exact arithmetic), so neither kernel's backward needs
# to know about it:

# %%
q, k, v, dout = (rng.standard_normal((200, 32)) for _ in range(4))
grads = {}
for t in (None, 8):
    out, lse = flash_attention(q, k, v, block_k=16, return_lse=True, rescale_threshold=t)
    grads[t] = flash_attention_backward(q, k, v, out, lse, dout, block_k=16)
diff = max(np.abs(a - b).max() for a, b in zip(grads[None], grads[8]))
print("gradients with and without the threshold differ by", below(diff, 1e-12))
assert diff < 1e-12

# %% [markdown]
# ## 3. FP8: a lagging maximum saturates $P$ (#2716)
#
# With FP8 inputs FA4 computes $P = 2^{s - m + \text{max\_offset}}$, `max_offset = 8`, so that
# $P \in (0, 256]$ uses e4m3's upper code points (its largest is 448). With a threshold as well,
# $P$ can reach $2^{8 + t}$; converted with saturation (`cvt.satfinite`) the top weights are
# clipped to 448 while the float32 `l` counts them in full, and the output shrinks (#2716; PR
# #2717 is FA4's guard above). A tile loop with e4m3 $P$ shows it:

# %%
def fp8_forward(q, k, v, threshold, max_offset, block=64):
    """Tiled forward in float32, P = 2^(s - m + max_offset) saturated to e4m3 before P·V."""
    tau = F32(np.log2(np.e) / np.sqrt(q.shape[-1]))
    m = np.full(q.shape[0], -np.inf, F32)
    l, acc = np.zeros(q.shape[0], F32), np.zeros((q.shape[0], v.shape[1]), F32)
    for j in range(0, k.shape[0], block):
        s = (q @ k[j:j + block].T).astype(F32) * tau
        tile = s.max(1)
        move = ~np.isfinite(m) | (tile - m > threshold)
        m_new = np.where(move, np.maximum(m, tile), m)
        alpha = np.exp2(np.where(np.isfinite(m), m - m_new, 0)).astype(F32)
        p = np.exp2(s - m_new[:, None] + max_offset).astype(F32)
        l = l * alpha + p.sum(1)
        p8 = np.minimum(p, 448).astype(E4M3).astype(F32)  # saturate, then round to e4m3
        acc = acc * alpha[:, None] + p8 @ v[j:j + block]
        m = m_new
    return acc / l[:, None]


n = 1024
q = rng.standard_normal((64, 64)).astype(F32)
k = (rng.standard_normal((n, 64)) * 0.3
     + np.linspace(0, 3, n)[:, None] * np.sign(q.sum(0))[None]).astype(F32)
v = rng.standard_normal((n, 64)).astype(F32)
truth = precise_attention(q.astype(float), k.astype(float), v.astype(float))
fp8 = {}
for t, offset in ((0, 8), (8, 8), (8, 0)):
    out = fp8_forward(q, k, v, t, offset)
    fp8[t, offset] = (rowwise_relative_error(out, truth).max(),
                      np.median(np.linalg.norm(out, axis=1) / np.linalg.norm(truth, axis=1)))
    print(f"threshold {t}, max_offset {offset}: worst row error {fp8[t, offset][0]:.1f}, "
          f"median |out| / |truth| {fp8[t, offset][1]:.2f}")
assert fp8[8, 8][1] < 0.8 and fp8[8, 8][0] > 10 * fp8[0, 8][0]  # saturated: the output shrinks
assert fp8[0, 8][1] > 0.99 and fp8[8, 0][1] > 0.99  # either alone: 2^8 < 448

# %% [markdown]
# ## 4. Batch invariance of split-KV decoding
#
# A decoding step attends one query per sequence over a long cache. To fill the GPU, a kernel
# splits the keys into parts, attends each part on its own SMs and merges the parts exactly
# (chapter 3). FlashAttention picks the **number** of splits from the batch:
# `min(num_SMs // (batch · heads · m_blocks), 128, n_blocks)` (`num_splits_heuristic`). The
# merge is exact in real numbers but not in float32, so a sequence's output changes in its last
# bits with the batch size around it. A fixed split **size** gives the same parts, hence the
# same bits, whatever the batch. `flash_invariance.decode_in_batch` computes one sequence's
# attention both ways, on `flash_lib.merge_attention`:

# %%
H, N = 8, 4000
q, k, v = (rng.standard_normal((H, n_, 64)).astype(F32) for n_ in (1, N, N))
by_batch, fixed = {}, {}
for b in range(1, 65):
    by_batch.setdefault(decode_in_batch(q, k, v, batch_size=b).tobytes(), []).append(b)
    fixed.setdefault(decode_in_batch(q, k, v, batch_size=b, fixed_split_size=256).tobytes(),
                     []).append(b)
splits = {b: num_splits_heuristic(b * H, 132, -(-N // 128)) for b in (1, 2, 4, 8, 16, 17)}
print("splits by batch size:", splits)
print(f"split count from the batch: {len(by_batch)} different outputs over batch sizes 1-64")
print(f"fixed split size 256:       {len(fixed)} output over batch sizes 1-64")
assert len(fixed) == 1 and len(by_batch) == 7

# %% [markdown]
# **What it does to greedy generation.** The next token is `argmax(out · W)`. Over 200 random
# decoding steps (8 heads, bfloat16 output, a 32000-word projection), count the steps whose
# logits differ between batch sizes 1, 4, 16 and 64, and those whose argmax differs (the
# "by batch" counts depend on the CPU's rounding, so nbval does not compare this output; the
# assert holds everywhere):

# %% tags=["nbval-ignore-output"]
W = rng.standard_normal((H * 64, 32000)).astype(F32)
changed = {"by batch": 0, "fixed": 0}
flipped = {"by batch": 0, "fixed": 0}
for _ in range(200):
    q, k, v = (rng.standard_normal((H, n_, 64)).astype(F32) for n_ in (1, 2000, 2000))
    for kind, size in (("by batch", None), ("fixed", 256)):
        logits = [decode_in_batch(q, k, v, batch_size=b, fixed_split_size=size)
                  .astype(BF16).astype(F32).reshape(-1) @ W for b in (1, 4, 16, 64)]
        changed[kind] += any(not np.array_equal(x, logits[0]) for x in logits)
        flipped[kind] += len({int(np.argmax(x)) for x in logits}) > 1
print("steps whose logits changed with the batch:", changed)
print("steps whose greedy token changed:", flipped)
assert changed["fixed"] == flipped["fixed"] == 0 and changed["by batch"] > 0

# %% [markdown]
# The bfloat16 rounding of the output hides most last-bit differences, so a changed token is
# rare per step; but once one step's token differs, the whole continuation differs, and a
# server that must give the same answer for the same prompt cannot let the batch pick the
# splits.
#
# **flash_lib's own kernels are batch-invariant**: they tile query rows and never reduce across
# the batch, so a row gets the same bits alone or among others (`tests/test_invariance.py`
# checks slices on 1 and 2 threads):

# %%
q, k, v = (rng.standard_normal((6, 2, n_, 32)).astype(F32) for n_ in (300, 700, 700))
full = flash_attention(q, k, v, causal=True)
assert all(np.array_equal(flash_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], causal=True),
                          full[b:b + 1]) for b in range(6))
print("each batch row alone: the same bits as in the batch of 6")

# %% [markdown]
# ## 5. What is not run here
#
# The rest of FA4's pipeline is about moving the same arithmetic through Blackwell's hardware,
# and is described, not emulated: **warp specialisation** with separate softmax and
# *correction* warps (the correction warps do the `acc` rescale that section 2 makes rare;
# register counts `num_regs_softmax`, `num_regs_correction` in `flash_fwd_sm100.py`), the
# accumulators in **tensor memory** (TMEM, read with `tcgen05.ld`; SM103 reduces the row max
# during that load, `update_row_max_precomputed` in `softmax.py`) and the **2-CTA** MMA for
# head dimension 256 (`sm100_hd256_2cta_fmha_forward.py`, which calls `ex2_emulation_2`). None
# of these change a bit of the result; the two numerical changes are the ones above.

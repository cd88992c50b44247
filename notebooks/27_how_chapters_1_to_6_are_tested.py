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
# # 27. Appendix A: how chapters 1–6 are tested
#
# Chapters 1–6 hold each rounding-level difference they meet to a bound they derive, and print
# only whether it holds: `make test` runs every chapter under nbval, which compares each cell's
# output with the stored one, and a difference's last bits are the CPU's. This appendix gathers
# the evidence behind those bounds, measured on the machine that built this page, and the rule by
# which `flash_lib` picks base e or base 2 on a CPU. What depends on the machine is in the
# figures; the printed outputs say only whether each bound holds.
# {doc}`Appendix B <28_how_chapters_7_to_23_are_tested>` does the same for chapters 7–23, and says
# what on a machine decides those last bits.

# %% [markdown]
# ## Rounding against the derived bounds: the online state and the merges (chapters 2 and 3)
#
# Chapters 2 and 3 derive a bound for each rounding-level difference they meet (the online $l$
# against its definition and against two passes, within $4t$ machine epsilons after $t$ scores;
# a merged $l$ within the block sums' 20 epsilons each plus 3 per merge; `flash_lib`'s weights and
# lse against the online state; merged partial outputs within $10^{-14}$, their lse within
# $10^{-13}$ nats) and print only whether each difference is under it, because its last bits are
# the CPU's: which exp and sum loops NumPy picked, which matrix kernel OpenBLAS did, and the
# platform's `math.exp`. This is the evidence: the differences measured on the machine that built
# this page, a dot each, with the chapter's bound. An exact 0 is an open circle at the left edge.

# %%
import math

import matplotlib.pyplot as plt
import numpy as np

import flash_lib
from flash_lib import rowwise_relative_error

eps = np.finfo(np.float64).eps
rng = np.random.default_rng(2)


def online_state(stream):
    """Chapter 2's loop: (m_t, l_t) after each score."""
    m, l, states = -math.inf, 0.0, []
    for x in stream:
        m_new = max(m, x)
        l, m = l * math.exp(m - m_new) + math.exp(x - m_new), m_new
        states.append((m, l))
    return states


def state(x):
    """(m, l) of a non-empty block, two passes."""
    m = x.max()
    return float(m), float(np.exp(x - m).sum())


def merge(a, b):
    """Chapter 3's merge of two states."""
    (m_a, l_a), (m_b, l_b) = a, b
    m = max(m_a, m_b)
    return (m, l_a * math.exp(m_a - m) + l_b * math.exp(m_b - m)) if m > -math.inf else a


measured = []  # (what, difference, the bound the chapter derived for it)
# chapter 2: the online l against its definition and the two-pass l, within 4t eps
stream = [1.0, 3.0, 0.5, 3.0, 6.0, 2.0, -4.0, 7.0]
states = online_state(stream)
ratios = [(abs(l - sum(math.exp(x - m) for x in stream[:t])) / l, 4 * t * eps)
          for t, (m, l) in enumerate(states, start=1)]
worst_step = max(ratios, key=lambda r: r[0] / r[1])
measured.append(("ch 2: l_t vs its definition, worst step", *worst_step))
long_stream = rng.normal(1000.0, 1.0, size=10_000)
for name, s in (("8 scores", np.array(stream)), ("10,000 scores", long_stream)):
    (m, l), (m2, l2) = online_state(s.tolist())[-1], state(s)
    measured.append((f"ch 2: l online vs two-pass, {name}", abs(l - l2) / l2, 4 * len(s) * eps))
# chapter 2: flash_attention's weights and lse against the online state, block_k = 1 and default
n = len(stream)
m, l = states[-1]
weights, lse = np.exp(np.array(stream) - m) / l, m + math.log(l)
for block_k in (1, flash_lib.DEFAULT_BLOCK_K):
    out, lse_fl = flash_lib.flash_attention(np.ones((1, 1)), np.array(stream)[:, None], np.eye(n),
                                            scale=1.0, block_k=block_k, return_lse=True)
    measured.append((f"ch 2: flash_lib weights, block_k={block_k}",
                     np.abs(out[0] - weights).max(), (8 * n + 4) * eps))
    measured.append((f"ch 2: flash_lib lse (nats), block_k={block_k}", abs(lse_fl[0] - lse),
                     (4 * n + 4 * abs(lse)) * eps))
# chapter 3: a row of 4096 scores cut into T random blocks, merged left to right
x = np.random.default_rng(3).normal(0.0, 3.0, size=4096)
whole = state(x)
for T in (2, 16, 256):
    edges = [0, *np.sort(rng.choice(np.arange(1, 4096), T - 1, replace=False)).tolist(), 4096]
    parts = [state(x[lo:hi]) for lo, hi in zip(edges[:-1], edges[1:])]
    m_T, l_T = parts[0]
    for p in parts[1:]:
        m_T, l_T = merge((m_T, l_T), p)
    measured.append((f"ch 3: T = {T} blocks merged: l", abs(l_T - whole[1]) / whole[1],
                     40 * eps + (T - 1) * 3 * eps))
# chapter 3: merge_attention of two key halves against all keys at once
q, k, v = rng.normal(size=(64, 32)), rng.normal(size=(4096, 32)), rng.normal(size=(4096, 32))
out_full, lse_full = flash_lib.flash_attention(q, k, v, return_lse=True)
half_a = flash_lib.flash_attention(q, k[:1000], v[:1000], return_lse=True)
half_b = flash_lib.flash_attention(q, k[1000:], v[1000:], return_lse=True)
out_ab, lse_ab = flash_lib.merge_attention(*half_a, *half_b)
measured += [("ch 3: merged halves vs all keys: output",
              rowwise_relative_error(out_ab, out_full).max(), 1e-14),
             ("ch 3: merged halves vs all keys: lse (nats)",
              np.abs(lse_ab - lse_full).max(), 1e-13)]
print(f"{len(measured)} differences, each within the bound its chapter derived:",
      all(d <= b for _, d, b in measured))
assert all(d <= b for _, d, b in measured), measured

# %% tags=["hide-input"]
fig, ax = plt.subplots(figsize=(8.5, 4.8))
rows = np.arange(len(measured))[::-1]
floor = 0.01  # eps: where an exact 0 is drawn
diffs = np.array([diff for _, diff, _ in measured]) / eps
ax.plot(diffs[diffs > 0], rows[diffs > 0], "o", color="C0", label="measured, this machine")
ax.plot(np.full((diffs == 0).sum(), floor), rows[diffs == 0], "o", mfc="white", color="C0",
        label="exactly 0 (drawn at 0.01 eps)")
ax.plot([bound / eps for *_, bound in measured], rows, "k|", ms=12, mew=2,
        label="the bound the chapter derived")
ax.set_xscale("log")
ax.set_xlim(floor / 2, 2e4)
ax.set_yticks(rows, [label for label, *_ in measured], fontsize=7)
ax.set_xlabel("difference, in machine epsilons of float64 (2.2e-16; relative for l and outputs)")
ax.set_title("Chapters 2 and 3: rounding against the derived bounds")
ax.legend(loc="lower right", fontsize=8)
ax.grid(True, axis="x", alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Every block size against naive_attention (chapter 5)
#
# Chapter 5 checks ten block-size pairs for $N_q = 37$, $N_k = 53$ (primes: no block size but 1 and
# $N$ divides them), output and lse, against `naive_attention` within $10^{-13}$, about 450 machine
# epsilons, and states that more tiles do not mean more error, although each tile rescales once
# more: $\alpha = 1$ exactly wherever a row's maximum did not move, which after a few tiles is most
# rows. Left: the ten pairs; right: a grid of 121 pairs from 1 to 1961 tiles, each pair's error
# against its number of tiles. A pair with a single key block does `naive_attention`'s own
# operations and agrees bit for bit: its error, exactly 0, is an open circle at 0.1 epsilons, not a
# missing bar. Every error is a few epsilons, two orders of magnitude under the bound (the dashed
# line).

# %%
import matplotlib.pyplot as plt
import numpy as np

import flash_lib

BOUND = 1e-13  # the bound chapters 4, 5 and 6 assert: about 450 machine epsilons
eps = np.finfo(np.float64).eps
rel_err = lambda x, ref: flash_lib.rowwise_relative_error(x, ref).max()
rng = np.random.default_rng(5)
n_q, n_k, d, d_v = 37, 53, 16, 8
q, k, v = (rng.standard_normal((2, n, w)) for n, w in ((n_q, d), (n_k, d), (n_k, d_v)))
out_naive, lse_naive = flash_lib.naive_attention(q, k, v, return_lse=True)
# chapter 5's ten block sizes: output and lse
cases = [(1, 1), (1, 53), (37, 1), (4, 5), (7, 11), (16, 16), (36, 52), (37, 53), (64, 64),
         (256, 512)]
case_errors = []
for bq, bk in cases:
    out, lse = flash_lib.flash_attention(q, k, v, block_q=bq, block_k=bk, return_lse=True)
    case_errors.append((rel_err(out, out_naive), np.abs(lse - lse_naive).max()))
# chapter 5's grid of 121 block-size pairs, against the number of tiles
sizes_q = [1, 2, 3, 5, 8, 13, 21, 34, 37, 38, 64]
sizes_k = [1, 2, 3, 5, 8, 13, 21, 34, 53, 54, 64]
grid = [(len(flash_lib.tile_schedule(n_q, n_k, bq, bk)),
         rel_err(flash_lib.flash_attention(q, k, v, block_q=bq, block_k=bk), out_naive))
        for bq in sizes_q for bk in sizes_k]
grid_tiles, grid_err = np.array(grid).T
print(f"{len(cases)} block sizes and {len(grid)} grid pairs ({grid_tiles.min():.0f} to "
      f"{grid_tiles.max():.0f} tiles), every error within {BOUND:.0e}:",
      max(max(map(max, case_errors)), grid_err.max()) <= BOUND)
assert max(max(map(max, case_errors)), grid_err.max()) <= BOUND

# %% tags=["hide-input"]
floor = 0.1  # eps: where an exact 0 is drawn, as an open marker, not a missing bar
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.2))
positions = np.arange(len(cases))
for i, what in enumerate(("output", "lse (nats, absolute)")):
    errs = np.array([e[i] for e in case_errors]) / eps
    x = positions + 0.4 * (i - 0.5)
    ax0.bar(x[errs > 0], errs[errs > 0], width=0.4, color=f"C{i}", label=what)
    ax0.plot(x[errs == 0], np.full((errs == 0).sum(), floor), "o", mfc="white", color=f"C{i}")
ax0.plot([], [], "o", mfc="white", color="0.3", label="exactly 0 (drawn at 0.1 eps)")
ax0.axhline(BOUND / eps, color="C3", ls="--", label=f"the bound asserted, {BOUND:.0e}")
ax0.set_yscale("log")
ax0.set_ylim(floor / 2, 2 * BOUND / eps)
ax0.set_xticks(positions, [f"{bq}x{bk}" for bq, bk in cases], fontsize=8, rotation=45)
ax0.set_xlabel("block_q x block_k")
ax0.set_ylabel("error vs naive (machine epsilons, 2.2e-16)")
ax0.set_title("Chapter 5's block sizes, this machine")
ax0.legend(fontsize=7, loc="upper left")
exact = grid_err == 0  # one key block does naive's own operations
ax1.scatter(grid_tiles[~exact], grid_err[~exact] / eps, s=18, label="measured, this machine")
ax1.scatter(grid_tiles[exact], np.full(exact.sum(), floor), marker="o", facecolors="white",
            edgecolors="C2", s=30, label="exactly 0 (drawn at 0.1 eps)")
ax1.axhline(BOUND / eps, color="C3", ls="--", label=f"the bound asserted, {BOUND:.0e}")
ax1.set_xscale("log")
ax1.set_yscale("log")
ax1.set_ylim(floor / 2, 2 * BOUND / eps)
ax1.set_xlabel(f"tiles visited ($N_q$ = {n_q}, $N_k$ = {n_k})")
ax1.set_ylabel("error vs naive (machine epsilons, 2.2e-16)")
ax1.set_title("121 block-size pairs: no growth with the tiles")
ax1.legend(fontsize=7, loc="center left")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Correct computations against $10^{-13}$ (chapters 4 and 6)
#
# Chapters 4 and 6 compare every correct computation (chapter 4's one-query stream at every
# `block_k` and score spread; chapter 6's masked rows against their allowed keys alone, a KV cache
# with NaN and inf in its unused slots against its tokens alone, `causal=True` against the
# bottom-right mask) with `naive_attention`, and print only whether the largest row error is within
# $10^{-13}$. Their measured errors, on the machine that built this page:

# %%
import matplotlib.pyplot as plt
import numpy as np

import flash_lib

BOUND = 1e-13  # the bound chapters 4 and 6 assert: about 450 machine epsilons
eps = np.finfo(np.float64).eps
rel_err = lambda x, ref: flash_lib.rowwise_relative_error(x, ref).max()
measured = {}
# chapter 4: one query over 1000 keys, streamed block_k at a time, against naive_attention
rng = np.random.default_rng(4)
q, k, v = rng.standard_normal(64), rng.standard_normal((1000, 64)), rng.standard_normal((1000, 16))


def stream_one_query(q, k, v, block_k):
    """Chapter 4's update, one block of keys at a time, one division at the end."""
    m, l, acc = -np.inf, 0.0, np.zeros(v.shape[-1])
    for start in range(0, len(k), block_k):
        s = (k[start : start + block_k] @ q) / np.sqrt(len(q))
        m_new = max(m, s.max())
        alpha, p = np.exp(m - m_new), np.exp(s - m_new)
        l, acc, m = alpha * l + p.sum(), alpha * acc + p @ v[start : start + block_k], m_new
    return acc / l


reference = flash_lib.naive_attention(q[None], k, v)[0]
for block_k in (1, 7, 64, 100, 999, 1000, 4096):
    measured[f"ch 4: streamed, block_k={block_k}, vs naive"] = rel_err(
        stream_one_query(q, k, v, block_k), reference)
for c in (0.01, 1.0, 100.0):  # the scores' standard deviation
    q_c = q * (c * np.sqrt(len(q)) / np.linalg.norm(q))
    measured[f"ch 4: streamed, score spread {c:g}, vs naive"] = rel_err(
        stream_one_query(q_c, k, v, 100), flash_lib.naive_attention(q_c[None], k, v)[0])
# chapter 6: a random mask, each row against its allowed keys alone
rng = np.random.default_rng(6)
q, k, v = rng.standard_normal((6, 8)), rng.standard_normal((50, 8)), rng.standard_normal((50, 4))
mask = rng.random((6, 50)) < 0.6
out = flash_lib.flash_attention(q, k, v, mask=mask, block_q=4, block_k=16)
measured["ch 6: masked rows vs their allowed keys alone"] = max(
    rel_err(out[i], flash_lib.naive_attention(q[i : i + 1], k[mask[i]], v[mask[i]])[0])
    for i in range(6))
# chapter 6: NaN and inf in a KV cache's unused slots, behind a padding mask
k_kv, v_kv = k[:24].copy(), v[:24].copy()
k_kv[17:], v_kv[17:] = np.nan, np.inf
for block_k in (1, 5, flash_lib.DEFAULT_BLOCK_K):
    out = flash_lib.flash_attention(q, k_kv, v_kv, mask=np.arange(24) < 17, block_k=block_k)
    measured[f"ch 6: KV cache, block_k={block_k}, vs the 17 tokens alone"] = rel_err(
        out, flash_lib.naive_attention(q, k_kv[:17], v_kv[:17]))
# chapter 6: causal=True against the bottom-right mask, square, wide and tall
for n_qc, n_kc in ((6, 6), (2, 5), (5, 2), (16, 40)):
    qc, kc, vc = (rng.standard_normal((n, w)) for n, w in ((n_qc, 8), (n_kc, 8), (n_kc, 4)))
    allowed = np.tril(np.ones((n_qc, n_kc), dtype=bool), k=n_kc - n_qc)
    out = flash_lib.flash_attention(qc, kc, vc, causal=True, block_q=3, block_k=4)
    keep = allowed.any(axis=1)  # the empty rows are exactly 0 in both
    measured[f"ch 6: causal=True vs mask=, {n_qc} x {n_kc}"] = rel_err(
        out[keep], flash_lib.naive_attention(qc, kc, vc, mask=allowed)[keep])
print(f"{len(measured)} errors, every one within {BOUND:.0e}:", max(measured.values()) <= BOUND)
assert max(measured.values()) <= BOUND, measured

# %% tags=["hide-input"]
floor = 0.01  # eps: where an exact 0 is drawn
names = list(measured)
values = np.array([measured[name] for name in names]) / eps
rows = np.arange(len(names))[::-1]
fig, ax = plt.subplots(figsize=(8.5, 5.5))
ax.plot(values[values > 0], rows[values > 0], "o", color="C0", label="measured, this machine")
ax.plot(np.full((values == 0).sum(), floor), rows[values == 0], "o", mfc="white", color="C0",
        label="exactly 0 (drawn at 0.01 eps)")
ax.axvline(BOUND / eps, color="C3", ls="--", label=f"the bound asserted, {BOUND:.0e}")
ax.set_xscale("log")
ax.set_xlim(floor / 2, 2 * BOUND / eps)
ax.set_yticks(rows, names, fontsize=7)
ax.set_xlabel("largest error of a row, relative, in machine epsilons of float64 (2.2e-16)")
ax.set_title("Chapters 4 and 6: correct computations against the bound")
ax.legend(loc="lower right", fontsize=8)
ax.grid(True, axis="x", alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Base e or base 2 on a CPU: NumPy's exp and exp2 (chapter 5)
#
# Chapter 5 derives the forward in base 2 ($e^{s - m} = 2^{Ls - Lm}$, $L = \log_2 e$), as
# FlashAttention computes on a GPU, and checks it against `flash_attention` in either base, forced
# with `flash_lib.use_exponential`. Which one `flash_lib` picks by itself is a CPU matter. NumPy
# computes `np.exp2` in float32 with Intel's SVML where the CPU has AVX-512, in less than half the
# time of its `np.exp` (chapter 10 measures it); elsewhere `exp2` is the slower one. So flash_lib
# chooses per machine and dtype from the loops NumPy reports (`numpy.lib.introspect.opt_func_info`),
# never from a timing: base 2 for float32 where NumPy's float32 `exp2` loop is an AVX-512 one,
# base e otherwise and always for float64. `flash_lib.exponential(dtype)` says which. In base 2 it
# keeps the scores, $m$ and the lse in nats and computes each $e^x$, $x = s - m$, as $2^{Lx}$
# (`flash_lib.exp_as_exp2`, chapter 5). The cell checks the rule against this machine's dispatch
# table; which way it went is the machine's, so it is not printed.

# %%
import numpy as np
from numpy.lib.introspect import opt_func_info

import flash_lib

# the rule: exp2 for float32 where NumPy's exp2 loop is an AVX-512 one, exp otherwise
avx512_exp2 = opt_func_info(func_name="^exp2$")["exp2"]["ff"]["current"].startswith(
    ("X86_V4", "AVX512"))
rule_holds = (flash_lib.exponential(np.float32) is (np.exp2 if avx512_exp2 else np.exp)
              and flash_lib.exponential(np.float64) is np.exp)
with flash_lib.use_exponential("exp2"):
    forced = all(flash_lib.exponential(dt) is np.exp2 for dt in (np.float32, np.float64))
print("flash_lib.exponential follows NumPy's dispatch table as the rule says:", rule_holds)
print("use_exponential('exp2') forces base 2 for both dtypes:", forced)
assert rule_holds and forced
for dt in (np.float32, np.float64):  # e^x as 2^(x log2 e), log2 e rounded to the dtype
    x = np.linspace(-80, 0, 101, dtype=dt)
    assert np.array_equal(flash_lib.exp_as_exp2(x), np.exp2(x * dt(flash_lib.LOG2E))), dt

# %% [markdown]
# ## Where chapters 1–6's bounds were checked
#
# Each bound in chapters 1–6 was set against measurements at every `NPY_DISABLE_CPU_FEATURES` level
# (AVX-512, AVX2, baseline; CONTRIBUTING.md) and with OpenBLAS's Haswell kernel, recorded when the
# bound was chosen: chapter 1's 4 machine epsilons for the softmax against its higher-precision
# truth, measured at most 1.84 (a margin of 2.2; a softmax off by $10^{-6}$ relative misses it by
# nine orders of magnitude); chapter 3's $10^{-14}$ for merged outputs and $10^{-13}$ nats for the
# lse, measured at most $1.6 \times 10^{-15}$ and $1.8 \times 10^{-15}$ (margins 6 and 55), and
# ring attention's at most $2.2 \times 10^{-15}$ (margin 4.5); chapter 4's $10^{-13}$ over 1000
# keys, at most $2.5 \times 10^{-15}$ (11 epsilons, margin 40); chapter 5's $10^{-13}$ over 53
# keys, at most 8.2 epsilons; chapter 6's $10^{-13}$, at most $2.2 \times 10^{-15}$ (margin 45).

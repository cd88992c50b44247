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
# # 17. Dropout
#
# FlashAttention-2's `dropout_p` zeroes each attention weight with probability $p$; the backward
# needs the very same zeros, yet no $N_q \times N_k$ mask is stored. This chapter makes dropout a
# function of a counter, writes out its generator, and checks its keep rate, memory and gradient.
# {doc}`Chapter 18 <18_attention_sinks>` adds attention sinks.
#
# **Sources.** FlashAttention is quoted from Dao-AILab/flash-attention at commit `0251105a`
# (`csrc/flash_attn/src/dropout.h`, `philox.cuh`, `softmax.h`, `csrc/flash_attn/flash_api.cpp`),
# Triton from its 3.9.0 release. Philox is Salmon, Moraes, Dror and Shaw, "Parallel random
# numbers: as easy as 1, 2, 3" (SC 2011).

# %%
import matplotlib.pyplot as plt
import numpy as np
from threadpoolctl import threadpool_limits

import flash_lib
from _oracle import worst  # chapter 7's metric, the worst row (chapters 14 and 15's module)
from flash_bench import below, threads_seen
from flash_lib import (
    dropout_keep,
    flash_attention,
    flash_attention_backward,
    measure_peak_bytes,
    naive_attention,
    naive_attention_backward,
    tile_schedule,
)

rng = np.random.default_rng(17)
SEED = 20240917  # the dropout seed of every example below

# The limit for float64 agreements "to rounding" in this chapter: 1e-14, 45 machine epsilons.
# Every such difference below was at most 2.3e-15 at every NPY_DISABLE_CPU_FEATURES level and
# with OpenBLAS's Haswell kernel (CONTRIBUTING.md); a kernel off by one part in a million or a
# missing 1/(1 - p) is far above it.
ROUNDING = 1e-14


def swap(x):
    return np.swapaxes(x, -1, -2)


def dense(q, k, v, *, allowed=None, keep=None, p=0.0):
    """Attention written from this chapter's formulas for the whole score matrix, dropout
    applied to the normalised weights. Returns the output, the (undropped) lse and P."""
    s = (q @ swap(k)) / np.sqrt(q.shape[-1])
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    P = e / l
    dropped = P if keep is None else P * keep / (1 - p)
    return dropped @ v, (m + np.log(l))[..., 0], P


# %% [markdown]
# ## Dropout on the attention weights
#
# With $P$ the softmax of chapter 5 and a keep mask $Z$ of independent Bernoulli$(1 - p)$ entries,
#
# $$
# O = \Big(P \circ \frac{Z}{1 - p}\Big)\, V, \qquad \mathbb E\Big[\frac{Z_{ij}}{1 - p}\Big] = 1
# \ \Rightarrow\ \mathbb E[O] = P V ,
# $$
#
# so training sees the undropped attention on average. The lse stays undropped (dropout follows
# normalisation), so the backward rebuilds $P = e^{S - \text{lse}}$ as in
# chapter 12; FlashAttention likewise (`rp_dropout` $= 1/(1-p)$ in `normalize_softmax_lse`,
# `softmax.h`). `flash_lib` takes `dropout_p` and `dropout_seed`, and
# `dropout_keep(seed, p, shape)` materialises the kernels' $Z$, against which the cell checks
# them by the dense construction, and `dropout_p=0` against no dropout.

# %%
B, H, n_q, n_k, d = 2, 2, 40, 56, 16
q, k, v = (rng.standard_normal((B, H, n, d)) for n in (n_q, n_k, n_k))
causal = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + (n_k - n_q)
P_DROP = 0.3
keep = dropout_keep(SEED, P_DROP, (B, H, n_q, n_k))
dense_out, dense_lse, P = dense(q, k, v, allowed=causal, keep=keep, p=P_DROP)
flash_out, flash_lse = flash_attention(q, k, v, causal=True, dropout_p=P_DROP, dropout_seed=SEED,
                                       return_lse=True, block_q=16, block_k=16)
naive_out = naive_attention(q, k, v, causal=True, dropout_p=P_DROP, dropout_seed=SEED)
_, undropped_lse = flash_attention(q, k, v, causal=True, return_lse=True, block_q=16, block_k=16)
forward_checks = {"flash vs dense": worst(flash_out, dense_out),
                  "naive vs dense": worst(naive_out, dense_out)}
for name, err in forward_checks.items():
    print(f"dropout {P_DROP}, causal: {name}: {below(err, ROUNDING)}")
kept = int(keep[np.broadcast_to(causal, keep.shape)].sum())
print(f"pairs kept of the causal pairs: {kept} of {B * H * int(causal.sum())}")
lse_undropped = np.array_equal(flash_lse, undropped_lse)  # the same operations: Z enters P·V only
lse_vs_dense = float(np.abs(flash_lse - dense_lse).max())
print(f"lse with dropout equals the lse without, bit for bit: {lse_undropped}; against the "
      f"dense lse: {below(lse_vs_dense, ROUNDING)}")
p_zero_identical = np.array_equal(
    flash_attention(q, k, v, causal=True, dropout_p=0.0, dropout_seed=SEED),
    flash_attention(q, k, v, causal=True))
print("dropout_p=0 against no dropout, bit for bit:", p_zero_identical)

# %% [markdown]
# ## Why not a stateful generator
#
# The textbook mask, `rng.random(shape) >= p`, comes from one generator whose state advances
# with each number drawn. In a tiled kernel, **a generator per tile**, seeded with the tile's index,
# makes the mask change with `block_q` and `block_k` (a speed setting), and **one generator for
# the call** ties it to the visiting order, which threads change, and the backward (key blocks
# outside, chapter 12) certainly. A counter-based generator has no state: element $(b, i, j)$'s
# number is a function of the seed and $(b, i, j)$ alone.
#
# The cell reads the kernel's mask off its output (with $V = I$, $O = P \circ Z / (1 - p)$ and
# $P > 0$, so the kept pairs are $O$'s nonzero entries) for four tilings of one head
# ($N_q = 64$, $N_k = 128$), and compares it with the per-tile generator's masks and one
# generator's in the forward's and the backward's tile order.

# %%
n_q1, n_k1, P_FIG = 64, 128, 0.25
q1, k1 = 0.5 * rng.standard_normal((n_q1, 8)), rng.standard_normal((n_k1, 8))
tilings = [(16, 16), (32, 32), (64, 128), (13, 40)]


def kernel_keep(block_q, block_k):
    """The kept pairs of flash_attention's own mask, read off its output with V = I."""
    out = flash_attention(q1, k1, np.eye(n_k1), dropout_p=P_FIG, dropout_seed=SEED,
                          block_q=block_q, block_k=block_k)
    return out != 0


def per_tile_generator_keep(block_q, block_k):
    """The first attempt: one np.random generator per tile, seeded with (seed, tile index)."""
    z = np.empty((n_q1, n_k1), dtype=bool)
    for r0, r1, c0, c1 in tile_schedule(n_q1, n_k1, block_q, block_k):
        tile_rng = np.random.default_rng([SEED, r0 // block_q, c0 // block_k])
        z[r0:r1, c0:c1] = tile_rng.random((r1 - r0, c1 - c0)) >= P_FIG
    return z


def one_generator_keep(tiles):
    """The second attempt: one generator for the call, consumed in the order of `tiles`."""
    stream, z = np.random.default_rng(SEED), np.empty((n_q1, n_k1), dtype=bool)
    for r0, r1, c0, c1 in tiles:
        z[r0:r1, c0:c1] = stream.random((r1 - r0, c1 - c0)) >= P_FIG
    return z


reference_keep = dropout_keep(SEED, P_FIG, (n_q1, n_k1))
read_off = {t: kernel_keep(*t) for t in tilings}
per_tile = {t: per_tile_generator_keep(*t) for t in tilings}
# what the figure draws: each tiling's mask XOR the 16 x 16 tiling's, pairs that changed
changed = {name: {t: masks[t] ^ masks[tilings[0]] for t in tilings[1:]}
           for name, masks in (("counter (flash_lib)", read_off),
                               ("a generator per tile", per_tile))}
print("the kernel's mask is dropout_keep's for every tiling:",
      all(np.array_equal(read_off[t], reference_keep) for t in tilings))
for name, xors in changed.items():
    print(f"{name:<22} pairs that change against 16 x 16: " +
          ", ".join(f"{t[0]} x {t[1]}: {int(x.sum())}" for t, x in xors.items()),
          f"(of {n_q1 * n_k1})")
tiles = tile_schedule(n_q1, n_k1, 16, 16)
forward_order = sorted(tiles, key=lambda t: (t[0], t[2]))  # query blocks outside
backward_order = sorted(tiles, key=lambda t: (t[2], t[0]))  # key blocks outside (chapter 12)
order_differs = int((one_generator_keep(forward_order) != one_generator_keep(backward_order)).sum())
print(f"one generator, forward's tile order against backward's: {order_differs} of "
      f"{n_q1 * n_k1} pairs differ")

# %% tags=["hide-input"]
fig, axes = plt.subplots(2, 3, figsize=(12, 5.6), sharex=True, sharey=True, layout="constrained")
for row, (name, xors) in enumerate(changed.items()):
    for column, (t, xor) in enumerate(xors.items()):
        ax = axes[row, column]
        ax.imshow(xor, cmap=plt.matplotlib.colors.ListedColormap(["white", "tab:red"]), vmin=0,
                  vmax=1, interpolation="nearest",
                  extent=(-0.5, n_k1 - 0.5, n_q1 - 0.5, -0.5))
        for edge in range(t[1], n_k1, t[1]):  # this tiling's block boundaries
            ax.axvline(edge - 0.5, color="0.3", lw=0.8, ls="--")
        for edge in range(t[0], n_q1, t[0]):
            ax.axhline(edge - 0.5, color="0.3", lw=0.8, ls="--")
        ax.set_title(f"{name}\n{t[0]} × {t[1]} tiles: {int(xor.sum())} of {xor.size} pairs change",
                     fontsize=10)
        if row == 1:
            ax.set_xlabel("key position j")
        if column == 0:
            ax.set_ylabel("query position i")
fig.suptitle(f"The keep mask of another tiling XOR that of 16 × 16 tiles (p = {P_FIG})\nred: a pair "
             "kept in one and dropped in the other; dashed: the other tiling's blocks")
plt.show()

# %% [markdown]
# The top row is empty: the kernel's mask does not see the tiles. Below, about
# $2p(1-p) = 37.5\%$ of the pairs change. With the same mask, tilings differ only by the rounding
# of their merge orders (chapter 5), and the worker count changes no bit; the cell checks both,
# forward and backward, on a problem large enough for threads, counting (as chapter 12 does) the
# threads that ran tiles.

# %%
q2, k2, v2, dout2 = (rng.standard_normal((n, 16)) for n in (1100, 1000, 1000, 1100))
drop = dict(dropout_p=0.1, dropout_seed=SEED, causal=True)
runs, ran_on = {}, {}
for workers in (1, 2, 4):
    with flash_lib.threads(workers):
        with threads_seen("online_softmax_update") as forward_threads:
            out2, lse2 = flash_attention(q2, k2, v2, return_lse=True, block_q=128, block_k=96,
                                         **drop)
        with threads_seen("attention_backward_tile") as backward_threads:
            grads2 = flash_attention_backward(q2, k2, v2, out2, lse2, dout2, block_q=128,
                                              block_k=96, **drop)
    runs[workers] = (out2, *grads2)
    ran_on[workers] = (len(forward_threads), len(backward_threads))
threads_identical = all(np.array_equal(a, b) for w in (2, 4) for a, b in zip(runs[1], runs[w]))
other_tiles = flash_attention(q2, k2, v2, block_q=256, block_k=200, **drop)
tiling_diff = worst(other_tiles, runs[1][0])
print("threads that ran tiles (forward, backward) with 1, 2, 4 workers:", ran_on)
print("out, dq, dk, dv with dropout on 1, 2 and 4 workers, bit for bit:", threads_identical)
print(f"out with 256 x 200 tiles against 128 x 96: {below(tiling_diff, ROUNDING)}")

# %% [markdown]
# ## Philox, written out
#
# `flash_lib` uses Philox4x32 (Salmon et al. 2011; cuRAND's `Philox4_32_10`, Triton's
# `tl.randint`) with the seven rounds FlashAttention-2 runs (`philox.cuh`: six in a loop, one
# after). It maps a 128-bit counter $(c_0, c_1, c_2, c_3)$ and a 64-bit key $(k_0, k_1)$ to four
# 32-bit words by rounds of
#
# $$
# (c_0, c_1, c_2, c_3) \leftarrow \big(\mathrm{hi}(M_1 c_2) \oplus c_1 \oplus k_0,\ \mathrm{lo}(M_1 c_2),\
# \mathrm{hi}(M_0 c_0) \oplus c_3 \oplus k_1,\ \mathrm{lo}(M_0 c_0)\big),
# $$
#
# with $M_0$ = `0xD2511F53`, $M_1$ = `0xCD9E8D57`, hi and lo the halves of a 64-bit product, and
# the key bumped by (`0x9E3779B9`, `0xBB67AE85`) between rounds. cuRAND, Random123 and Triton
# (`N_ROUNDS_DEFAULT = 10` in `triton/language/random.py`) run ten by default; Random123's
# authors list Philox4x32-7 as "Crush-resistant with *NO* safety margin" (Random123-Boost,
# `libs/random/performance/prf_speed.cpp`), the ten being the margin.
#
# For element $(b, i, j)$ ($b$ the flat index over the batch and head axes, $i$ and $j$ the
# global query and key positions) the key is the seed's two halves, the counter is
# $(\lfloor j/8 \rfloor, i, b \bmod 2^{32}, \lfloor b / 2^{32} \rfloor)$, and the element takes
# word $\lfloor (j \bmod 8)/2 \rfloor$, its low 16 bits for even $j$, high for odd:
# eight neighbouring keys share one evaluation, and no two elements share bits. It is kept iff
# that number is at least $t = \mathrm{round}(p \cdot 2^{16})$, with probability exactly
# $1 - t/2^{16}$, within $2^{-17}$ of $1 - p$ since $|t - p\,2^{16}| \le 1/2$.
#
# FlashAttention-2 compares one *byte* of the output with `p_dropout_in_uint8_t =
# floor((1 - p) * 255)` (`dropout.h`, `flash_api.cpp`): 16 elements per evaluation, keep
# probability $(\lfloor 255(1-p) \rfloor + 1)/256$; at $p = 0.1$ that is
# 0.8984375, $1/640$ below $0.9$, which the keep-rate test below detects. Its masks differ
# from `flash_lib`'s (its counters are laid out by thread), but the construction is the same.
#
# The cell writes Philox from the formula and checks ten rounds against Random123's known answers
# (`tests/kat_vectors` in DEShawResearch/random123) and seven against Triton 3.9's
# `tl.randint4x(seed, offset, n_rounds=7)` (run by `tests/test_training.py`); the keep mask from
# seven rounds must be `dropout_keep`'s bit for bit, for a batch of heads and a shard at
# row 5, key 9 (as `flash_dask` calls it), which gets that window of the whole mask.

# %%
M0, M1, W0, W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85


def philox4x32(c0, c1, c2, c3, k0, k1, rounds=7):
    """``rounds`` Philox rounds on arrays of uint32 counters; returns the four output words."""
    c = [np.asarray(x, dtype=np.uint64) for x in (c0, c1, c2, c3)]
    low = np.uint64(0xFFFFFFFF)
    for _ in range(rounds):
        p0, p1 = np.uint64(M0) * c[0], np.uint64(M1) * c[2]  # exact: 32 x 32 bits fit in 64
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & low,
             (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1), p0 & low]
        k0, k1 = (k0 + W0) & 0xFFFFFFFF, (k1 + W1) & 0xFFFFFFFF
    return [x.astype(np.uint32) for x in c]


known_answers = [  # (rounds, counter, key, words): Random123's for 10, Triton's for 7
    (10, (0, 0, 0, 0), (0, 0), "6627e8d5 e169c58d bc57ac4c 9b00dbd8"),
    (10, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, "408f276d 41c83b0e a20bc7c6 6d5451fd"),
    (10, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     "d16cfe09 94fdcceb 5001e420 24126ea1"),
    (7, (0, 0, 0, 0), (0, 0), "5f6fb709 0d893f64 4f121f81 4f730a48"),
    (7, (0x243F6A88, 0x85A308D3, 0, 0), (0xA4093822, 0x299F31D0),
     "469a1815 b11d0428 78c15b7c 0f092634"),
]
kat_ok = []
for rounds, counter, key, expected in known_answers:
    got = " ".join(f"{int(w):08x}" for w in philox4x32(*counter, *key, rounds=rounds))
    kat_ok.append(got == expected)
    source = "Random123's" if rounds == 10 else "Triton's"
    print(f"philox4x32, {rounds:>2} rounds (ctr={counter[0]:08x}..., key={key[0]:08x}...) = "
          f"{got}: {source} answer {got == expected}")


def my_keep(seed, p, shape, offset=(0, 0)):
    """The keep mask from 7 rounds of philox4x32 and the counter above, 16 bits an element."""
    *batch, rows, keys = shape
    b = np.arange(int(np.prod(batch))).reshape(*batch, 1, 1)
    i = offset[0] + np.arange(rows)[:, None]
    j = offset[1] + np.arange(keys)[None, :]
    b, i, j = np.broadcast_arrays(b, i, j)
    words = philox4x32(j // 8, i, b & 0xFFFFFFFF, b >> 32, seed & 0xFFFFFFFF, seed >> 32)
    word = np.choose(j % 8 // 2, words)
    number = np.where(j % 2 == 0, word & 0xFFFF, word >> 16)  # low half for even j, high for odd
    return number >= round(p * 2**16)


mine_vs_flash = {
    "(2, 3, 40, 56), p = 0.3": np.array_equal(my_keep(SEED, 0.3, (2, 3, 40, 56)),
                                              dropout_keep(SEED, 0.3, (2, 3, 40, 56))),
    "(37, 61), offset (5, 9), p = 0.1": np.array_equal(
        my_keep(SEED, 0.1, (37, 61), offset=(5, 9)),
        dropout_keep(SEED, 0.1, (37, 61), offset=(5, 9))),
}
window_of_whole = np.array_equal(dropout_keep(SEED, 0.1, (37, 61), offset=(5, 9)),
                                 dropout_keep(SEED, 0.1, (50, 80))[5:42, 9:70])
for name, same in mine_vs_flash.items():
    print(f"mask {name}: written out == dropout_keep: {same}")
print("the offset mask is the window [5:42, 9:70] of the whole one:", window_of_whole)

# %% [markdown]
# **A trap: one stream per row.** NumPy's `Philox` (Philox4x64) advances its counter's first word
# by one per block of four words, so streams started at `counter=[i, 0, 0, 0]`, one per row,
# overlap: row $i$'s second block is row $i+1$'s first, and each row's mask is its predecessor's
# shifted by four keys. Over 32 rows and 256 keys the cell counts how often
# $Z_{i+1, j} = Z_{i, j+4}$: always for the streams, about $(1-p)^2 + p^2 = 0.625$ of the time
# for independent entries at $p = 1/4$.

# %%
trap = np.stack([np.random.Philox(key=SEED, counter=[i, 0, 0, 0]).random_raw(256) for i in range(32)])
trap_keep = (trap >> np.uint64(32)) >= round(P_FIG * 2**32)  # the high word against t
counter_keep = dropout_keep(SEED, P_FIG, (32, 256))
shift_agree = {name: (int((z[1:, :-4] == z[:-1, 4:]).sum()), z[1:, :-4].size)
               for name, z in (("one stream per row", trap_keep), ("dropout_keep", counter_keep))}
for name, (same, total) in shift_agree.items():
    print(f"{name:<20} Z[i+1, j] == Z[i, j+4] in {same} of {total} pairs ({same / total:.3f})")

# %% [markdown]
# ## The keep rate and its binomial interval
#
# For independent entries with keep probability $q = 1 - t/2^{16}$, the number kept among $n$
# is binomial with standard deviation $\sqrt{n q (1-q)}$: the measured rate lies within
# $q \pm 4\sqrt{q(1-q)/n}$ except with probability about $6 \cdot 10^{-5}$ (normal
# approximation, excellent here). Each $p$ below uses $n = 2^{22}$ elements of one
# $(16, 512, 512)$ mask; the counts are integers, the same on every machine. The last column
# places FlashAttention-2's byte-threshold keep probability in half-widths of the interval.

# %%
rate_rows = []
for p in (0.1, 0.25, 0.5, 0.9):
    z = dropout_keep(SEED, p, (16, 512, 512))
    n, kept_p = z.size, int(z.sum())
    q_keep = 1 - round(p * 2**16) / 2**16
    sigma = (q_keep * (1 - q_keep) / n) ** 0.5
    z_score = (kept_p / n - q_keep) / sigma
    # flash_api.cpp: p_dropout = 1.f - p (float32); floor(p_dropout * 255.0); keep iff byte <= it
    fa2_keep = (int(np.floor(float(np.float32(1) - np.float32(p)) * 255.0)) + 1) / 256
    rate_rows.append((p, kept_p, n, q_keep, sigma, z_score, fa2_keep, (fa2_keep - q_keep) / sigma))
print("   p       kept of n          rate     1 - p ± 4σ             z    FA-2's keep rate, in σ")
for p, kept_p, n, q_keep, sigma, z_score, fa2_keep, fa2_z in rate_rows:
    print(f"{p:>4}  {kept_p:>8} of {n}  {kept_p / n:.6f}  {q_keep:.4f} ± {4 * sigma:.6f}  "
          f"{z_score:>+5.2f}   {fa2_keep:.7f} ({fa2_z:+.1f})")

# %% [markdown]
# ## The memory a stored mask would take
#
# A stateful generator's mask must be kept for the backward, a byte per element: for 32 layers
# of 32 heads at $N = 4096$, one sequence's masks are $32 \cdot 32 \cdot 4096^2$ bytes = 16 GiB,
# four times the 4 GiB of the same layers' $Q$, $K$, $V$ and $O$ in bfloat16
# ($4 \cdot 32 \cdot 4096^2 \cdot 2$ bytes at $d_{\text{model}} = 4096$). A counter-based kernel
# stores 16 bytes, the seed and the offset: FlashAttention's `rng_state` (two int64,
# `flash_attn/flash_attn_interface.py`).
#
# The cell measures (on one worker, chapter 8's setting) the scratch of the forward without and
# with dropout, of the backward with it (float32, $d = 32$, 512 × 512 tiles), and the mask
# `dropout_keep` materialises. The kernels draw two adjoining tiles' masks per call, so
# their scratch holds two tiles' Philox buffers whatever $N$.

# %% tags=["nbval-ignore-output"]
sizes = [512, 1024, 2048, 4096]
scratch = {"no dropout": [], "forward": [], "backward": [], "stored mask": [], "keep peak": []}
with flash_lib.threads(1), threadpool_limits(limits=1, user_api="blas"):
    for n in [256] + sizes:  # the first, unmeasured, fills NumPy's caches
        qm, km, vm, dm = (rng.standard_normal((n, 32), dtype=np.float32) for _ in range(4))
        (o0, l0), peak0 = measure_peak_bytes(flash_attention, qm, km, vm, return_lse=True)
        (om, lm), peak = measure_peak_bytes(flash_attention, qm, km, vm, return_lse=True,
                                            dropout_p=0.1, dropout_seed=SEED)
        grads, peak_back = measure_peak_bytes(flash_attention_backward, qm, km, vm, om, lm, dm,
                                              dropout_p=0.1, dropout_seed=SEED)
        mask_n, peak_mask = measure_peak_bytes(dropout_keep, SEED, 0.1, (n, n))
        if n == 256:
            continue
        scratch["no dropout"].append(peak0 - o0.nbytes - l0.nbytes)
        scratch["forward"].append(peak - om.nbytes - lm.nbytes)
        scratch["backward"].append(peak_back - sum(g.nbytes for g in grads))
        scratch["stored mask"].append(mask_n.nbytes)
        scratch["keep peak"].append(peak_mask)
print("scratch in MiB, this machine:")
print("     N   forward, no dropout   forward   backward   stored mask   dropout_keep's peak")
for row, n in enumerate(sizes):
    print(f"{n:>6} {scratch['no dropout'][row] / 2**20:>21.2f} {scratch['forward'][row] / 2**20:>9.2f}"
          f" {scratch['backward'][row] / 2**20:>10.2f} {scratch['stored mask'][row] / 2**20:>13.2f}"
          f" {scratch['keep peak'][row] / 2**20:>21.2f}")

# %%
flat = {name: max(scratch[name]) / min(scratch[name]) for name in ("forward", "backward")}
print("dropout_keep's mask bytes == N²:", [b == n * n for b, n in zip(scratch["stored mask"], sizes)])
for name, ratio in flat.items():
    print(f"{name} scratch with dropout, largest / smallest over N = 512..4096 under 1.25: "
          f"{ratio < 1.25}")
print("at N = 4096 the stored mask alone is larger than either kernel's whole scratch:",
      all(scratch[name][-1] < scratch["stored mask"][-1] for name in flat))

# %% [markdown]
# ## The gradient through dropout
#
# At a fixed seed $Z$ is constant, and the backward must return the exact gradient of
# $O(Q, K, V)$ with that $Z$. Chapter 12's chain rule, with
# $\tilde P = P \circ Z/(1-p)$ for $P$ in $O = \tilde P V$:
#
# $$
# dV = \tilde P^\top dO, \qquad d\tilde P = dO\, V^\top, \qquad
# dP = d\tilde P \circ \frac{Z}{1 - p}, \qquad dS = P \circ (dP - D\,\mathbf 1^\top),
# $$
#
# and $dQ = \tau\, dS\, K$, $dK = \tau\, dS^\top Q$ as before. The softmax's Jacobian sees the
# undropped $P$; its row term is still chapter 12's one number from the output:
#
# $$
# D_i = \sum_j P_{ij}\, dP_{ij} = \sum_j P_{ij} \frac{Z_{ij}}{1-p}\, dO_i \cdot v_j
#     = dO_i \cdot \sum_j \tilde P_{ij} v_j = dO_i \cdot O_i ,
# $$
#
# with $O$ the dropped output. The tile loop is chapter 12's with two multiplications by the
# tile's $Z/(1-p)$, regenerated from the counter. The cell compares flash's and naive's backward
# with these formulas, then central differences at the same seed check the right backward, one
# using another seed's mask and one forgetting $1/(1-p)$.

# %%
dout = rng.standard_normal(q.shape)
Z = keep / (1 - P_DROP)
dV = swap(P * Z) @ dout
dP = (dout @ swap(v)) * Z
D = (dout * dense_out).sum(axis=-1)
dS = P * (dP - D[..., None])
dQ, dK = (dS @ k) / np.sqrt(d), (swap(dS) @ q) / np.sqrt(d)
D_from_P = float(np.abs((P * dP).sum(axis=-1) - D).max() / np.abs(D).max())
flash_grads = flash_attention_backward(q, k, v, flash_out, flash_lse, dout, causal=True,
                                       dropout_p=P_DROP, dropout_seed=SEED, block_q=16, block_k=8)
naive_grads = naive_attention_backward(q, k, v, dout, causal=True, dropout_p=P_DROP,
                                       dropout_seed=SEED)
grad_checks = {}
for name, mine, f, nv in zip(("dq", "dk", "dv"), (dQ, dK, dV), flash_grads, naive_grads):
    grad_checks[name] = (worst(f, mine), worst(nv, mine))
    print(f"{name}: flash vs the formulas {below(grad_checks[name][0], ROUNDING)}, naive vs "
          f"them {below(grad_checks[name][1], ROUNDING)}")
print(f"D = rowsum(P ∘ dP) against rowsum(dO ∘ O): {below(D_from_P, ROUNDING)} (relative)")

directions = [rng.standard_normal(x.shape) for x in (q, k, v)]


def loss(shift):
    moved = [x + shift * dx for x, dx in zip((q, k, v), directions)]
    return float((dout * flash_attention(*moved, causal=True, dropout_p=P_DROP,
                                         dropout_seed=SEED)).sum())


EPS = 1e-6
numeric = (loss(EPS) - loss(-EPS)) / (2 * EPS)
other_seed = flash_attention_backward(q, k, v, flash_out, flash_lse, dout, causal=True,
                                      dropout_p=P_DROP, dropout_seed=SEED + 1)
no_rescale = ((dout @ swap(v)) * keep, swap(P * keep) @ dout)  # dP and dV without 1/(1 - p)
dS_bad = P * (no_rescale[0] - D[..., None])
no_rescale_grads = ((dS_bad @ k) / np.sqrt(d), (swap(dS_bad) @ q) / np.sqrt(d), no_rescale[1])
fd_checks = {}
for name, grads in (("the backward", flash_grads), ("mask from another seed", other_seed),
                    ("no 1/(1 - p)", no_rescale_grads)):
    analytic = sum(float((g * dx).sum()) for g, dx in zip(grads, directions))
    fd_checks[name] = abs(analytic - numeric) / abs(numeric)
    print(f"{name:<24} against central differences: relative difference "
          f"{below(fd_checks[name], 1e-8) if fd_checks[name] < 1e-8 else f'{fd_checks[name]:.2f}'}")

# %% [markdown]
# ## What we showed
#
# - A counter (seven Philox rounds of $(\lfloor j/8 \rfloor, i, b)$ under the seed) makes the
#   kernel's mask `dropout_keep`'s whatever the tiles, threads or loop order; a generator per
#   tile, one per call, or a NumPy stream per row does not.
# - The keep rate is within $4\sigma$ of $1 - t/2^{16}$ for every $p$ tried; FlashAttention-2's
#   byte threshold is not, at $p = 0.1$ and $0.9$.
# - Scratch with dropout is flat in $N$, below the $N^2$ bytes of a stored mask.
# - The backward is chapter 12's with $Z/(1-p)$ twice; central differences at the fixed seed
#   confirm it and catch another seed's mask and a missing $1/(1-p)$.

# %%
# ROUNDING = 1e-14 (45 eps): every rounding-level difference below was at most 2.3e-15 at every
# NPY_DISABLE_CPU_FEATURES level; a kernel off by 1e-6 relative fails them.
assert all(err < ROUNDING for err in forward_checks.values()), forward_checks
assert lse_undropped and lse_vs_dense < ROUNDING and p_zero_identical
# the kernel's mask is dropout_keep's for every tiling; the stateful attempts are not
assert all(np.array_equal(read_off[t], reference_keep) for t in tilings)
assert all(not x.any() for x in changed["counter (flash_lib)"].values())
assert all(x.sum() > 0.2 * n_q1 * n_k1 for x in changed["a generator per tile"].values())
assert order_differs > 0.2 * n_q1 * n_k1  # about 2p(1 - p) = 37.5% of the pairs
# the same bits on 1, 2 and 4 workers, and that many workers ran, forward and backward
assert ran_on == {1: (1, 1), 2: (2, 2), 4: (4, 4)}, ran_on
assert threads_identical and tiling_diff < ROUNDING
# Philox: Random123's answers (10 rounds), Triton's (7); the written-out mask is dropout_keep's;
# offsets are windows
assert all(kat_ok) and all(mine_vs_flash.values()) and window_of_whole
assert shift_agree["one stream per row"][0] == shift_agree["one stream per row"][1]
same, total = shift_agree["dropout_keep"]
assert abs(same / total - 0.625) < 4 * (0.625 * 0.375 / total) ** 0.5
# keep rates within 4 sigma of 1 - t / 2**16; FlashAttention-2's byte threshold outside at p = 0.1
for p, kept_p, n, q_keep, sigma, z_score, fa2_keep, fa2_z in rate_rows:
    assert abs(z_score) < 4, (p, z_score)
assert abs(rate_rows[0][-1]) > 4 and abs(rate_rows[3][-1]) > 4
# memory: dropout_keep's mask is N² bytes; the kernels' scratch is flat in N and, at N = 4096
# (measured 5.4 and 6.4 MiB), below the mask's 16 MiB
assert all(b == n * n for b, n in zip(scratch["stored mask"], sizes))
assert all(ratio < 1.25 for ratio in flat.values()), flat
assert all(scratch[name][-1] < scratch["stored mask"][-1] for name in flat)
# the gradient through dropout: the formulas, naive and flash agree; differences confirm it
assert all(a < ROUNDING and b < ROUNDING for a, b in grad_checks.values()), grad_checks
assert D_from_P < ROUNDING
# central differences at EPS = 1e-6: truncation and rounding, measured at most 5e-10 (every level)
assert fd_checks["the backward"] < 1e-8
assert fd_checks["mask from another seed"] > 1e-2 and fd_checks["no 1/(1 - p)"] > 1e-2

# %% [markdown]
# ## Your turn: the keep mask from a counter
#
# Write `keep_mask(seed, p, shape, offset=(0, 0))`, the bool keep mask of
# `shape = (..., rows, keys)`, equal to `dropout_keep(seed, p, shape, offset)` bit for bit, from
# `philox4x32` and the Philox section's counter, word and half (not from `my_keep`). The grader
# tries one counter, odd and even keys, an offset, batch and head axes, and a seed above $2^{32}$.
#
# Replace the stub with your function and re-run the grade cell: it says `not implemented yet`,
# then what is wrong and where to look, until `passed`. The solution is hidden below it.

# %%
from flash_check.exercises import grade, show_solution, stub

# your turn: replace the stub with def keep_mask(seed, p, shape, offset=(0, 0)): ...
keep_mask = stub("keep_mask")

# %%
grade("keep_mask", keep_mask)

# %% jupyter={"outputs_hidden": true} mystnb={"code_prompt_hide": "Hide the solution", "code_prompt_show": "Show the solution"} tags=["remove-input", "hide-output"]
show_solution("keep_mask")

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
# # 17. Training features: dropout, attention sinks
#
# Two things a training kernel does that chapters 5 to 15 left out. **Dropout** on the attention
# weights: FlashAttention-2's `dropout_p` zeroes each weight with probability $p$, and the
# backward needs the very same zeros, yet no $N_q \times N_k$ mask is ever stored. **Attention
# sinks**: one learned logit per head that joins every row's softmax denominator and carries no
# value (gpt-oss), so that a row can give its weight to nothing. This chapter derives both
# (dropout as a function of a counter, its memory, keep rate and gradient; the sink's effect on
# empty rows, the lse and merging, and its gradient) and checks `flash_lib`'s kernels against
# dense constructions written out here.
#
# **Sources.** FlashAttention is quoted from Dao-AILab/flash-attention at commit `0251105a`:
# the CUDA dropout in `csrc/flash_attn/src/` (`dropout.h`, `philox.cuh`, `softmax.h`) and
# `csrc/flash_attn/flash_api.cpp`, and the learnable sink of its CuTe kernels in
# `flash_attn/cute/` (`interface.py`, `flash_fwd_sm100.py`, `flash_bwd_postprocess.py`). gpt-oss
# is quoted from openai/gpt-oss at commit `7b58334` (`gpt_oss/torch/model.py`,
# `gpt_oss/triton/attention.py`), Triton from its 3.9.0 release. Philox is Salmon, Moraes,
# Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3" (SC 2011); StreamingLLM is Xiao
# et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453.

# %%
import matplotlib.pyplot as plt
import numpy as np
from threadpoolctl import threadpool_limits

import flash_lib
from flash_lib import (
    dropout_keep,
    flash_attention,
    flash_attention_backward,
    measure_peak_bytes,
    merge_attention,
    naive_attention,
    naive_attention_backward,
    rowwise_relative_error,
    tile_schedule,
)

rng = np.random.default_rng(17)
SEED = 20240917  # the dropout seed of every example below

# The limit for float64 agreements "to rounding" in this chapter: 1e-14, 45 machine epsilons.
# Every such difference below was at most 2.3e-15 at every NPY_DISABLE_CPU_FEATURES level and
# with OpenBLAS's Haswell kernel (CONTRIBUTING.md); a kernel off by one part in a million, a
# missing 1/(1 - p) or a sink counted twice is far above it.
ROUNDING = 1e-14


def below(x, limit=ROUNDING):
    """A rounding-level difference, printed so that no CPU changes the text: the limit it is
    under (exactly 0 included: whether it is 0 is the CPU's rounding), or, for a real error, the
    number. Equalities that hold bit for bit by construction are printed as such, separately."""
    return f"below {limit:.0e}" if x < limit else f"{x:.1e}, above {limit:.0e}"


def worst(a, b):
    """chapter 7's metric, the worst row"""
    return float(rowwise_relative_error(a, b).max())


def swap(x):
    return np.swapaxes(x, -1, -2)


def dense(q, k, v, *, allowed=None, softcap=None, sinks=None, keep=None, p=0.0):
    """Attention written from the formulas of this chapter for the whole score matrix, in
    gpt-oss's way for the sink (`sdpa` in gpt_oss/torch/model.py: the sink as one more column
    of scores, a softmax, the column dropped; gpt-oss appends it last, here it comes first) and
    with dropout applied to the normalised weights. Returns the output, the lse (sink included,
    dropout not) and P."""
    s = (q @ swap(k)) / np.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)  # the cap applies to the scores, not to the sink
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    if sinks is not None:
        column = np.broadcast_to(np.asarray(sinks)[..., None, None], s.shape[:-1] + (1,))
        s = np.concatenate([column, s], axis=-1)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):  # an empty row's lse is log 0 = -inf
        lse = (np.where(np.isfinite(m), m, 0) + np.log(l))[..., 0]
    P = (e / np.where(l == 0, 1, l))[..., 1:] if sinks is not None else e / np.where(l == 0, 1, l)
    dropped = P if keep is None else P * keep / (1 - p)
    return dropped @ v, lse, P


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
# so training sees the undropped attention on average. The lse stays that of the undropped
# scores: dropout acts after the normalisation, and the backward rebuilds $P = e^{S - \text{lse}}$
# from it as in chapter 12. FlashAttention does the same: its forward multiplies the normalised
# output by `rp_dropout` $= 1/(1-p)$ (`normalize_softmax_lse` in `csrc/flash_attn/src/softmax.h`)
# and returns the undropped `softmax_lse`.
#
# In `flash_lib` the keywords are `dropout_p` and `dropout_seed`; `dropout_keep(seed, p, shape)`
# materialises the mask $Z$ the kernels use. The cell checks `flash_attention` and
# `naive_attention` against the dense construction built with that mask (two batches of two
# heads, bottom-right causal), and that `dropout_p=0` is the kernel without dropout, bit for bit.

# %%
B, H, n_q, n_k, d = 2, 2, 40, 56, 16
q, k, v = (rng.standard_normal((B, H, n, d)) for n in (n_q, n_k, n_k))
causal = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + (n_k - n_q)
P_DROP = 0.3
keep = dropout_keep(SEED, P_DROP, (B, H, n_q, n_k))
dense_out, dense_lse, _ = dense(q, k, v, allowed=causal, keep=keep, p=P_DROP)
flash_out, flash_lse = flash_attention(q, k, v, causal=True, dropout_p=P_DROP, dropout_seed=SEED,
                                       return_lse=True, block_q=16, block_k=16)
naive_out = naive_attention(q, k, v, causal=True, dropout_p=P_DROP, dropout_seed=SEED)
_, undropped_lse = flash_attention(q, k, v, causal=True, return_lse=True, block_q=16, block_k=16)
forward_checks = {"flash vs dense": worst(flash_out, dense_out),
                  "naive vs dense": worst(naive_out, dense_out)}
for name, err in forward_checks.items():
    print(f"dropout {P_DROP}, causal: {name}: {below(err)}")
kept = int(keep[np.broadcast_to(causal, keep.shape)].sum())
print(f"pairs kept of the causal pairs: {kept} of {B * H * int(causal.sum())}")
lse_undropped = np.array_equal(flash_lse, undropped_lse)  # the same operations: Z enters P·V only
lse_vs_dense = float(np.abs(flash_lse - dense_lse).max())
print(f"lse with dropout equals the lse without, bit for bit: {lse_undropped}; against the "
      f"dense lse: {below(lse_vs_dense)}")
p_zero_identical = np.array_equal(
    flash_attention(q, k, v, causal=True, dropout_p=0.0, dropout_seed=SEED),
    flash_attention(q, k, v, causal=True))
print("dropout_p=0 against no dropout, bit for bit:", p_zero_identical)

# %% [markdown]
# ## Why not a stateful generator
#
# The textbook way to draw $Z$ is `rng.random(shape) >= p` from one generator whose state
# advances with each number drawn. A tiled kernel cannot do that. Two natural attempts:
#
# - **a generator per tile**, seeded with the seed and the tile's index: tiles are independent
#   of one another and of the visiting order, but a tile's numbers depend on where the tile
#   starts, so the mask changes with `block_q` and `block_k` (a speed setting);
# - **one generator for the call**, consumed tile after tile: the mask then depends on the order
#   in which tiles are visited, which threads change, and which the backward changes for certain,
#   since it visits key blocks in the outer loop where the forward visits query blocks
#   (chapter 12).
#
# A counter-based generator removes the state: the random number of element $(b, i, j)$ is a
# fixed function of the seed and of $(b, i, j)$ alone, so every tile, thread and loop order
# computes the same one. The cell reads the mask the kernel actually applied from its output:
# with $V = I$ (the $N_k \times N_k$ identity), $O = P \circ Z / (1 - p)$, and $P > 0$ on every
# pair here, so the kept pairs are exactly the nonzero entries of $O$. It does that for four
# tilings of one head, $N_q = 64$, $N_k = 128$, and draws the first attempt's masks with the same
# tilings; then it consumes one generator in the forward's and in the backward's tile order.

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
for t in tilings:
    moved = int((per_tile[t] != per_tile[tilings[0]]).sum())
    print(f"block {t[0]:>2} x {t[1]:<3}: the kernel's mask is dropout_keep's: "
          f"{np.array_equal(read_off[t], reference_keep)}; a generator per tile: "
          + (f"{moved} of {n_q1 * n_k1} pairs differ from 16 x 16" if t != tilings[0] else "-"))
tiles = tile_schedule(n_q1, n_k1, 16, 16)
forward_order = sorted(tiles, key=lambda t: (t[0], t[2]))  # query blocks outside
backward_order = sorted(tiles, key=lambda t: (t[2], t[0]))  # key blocks outside (chapter 12)
order_differs = int((one_generator_keep(forward_order) != one_generator_keep(backward_order)).sum())
print(f"one generator, forward's tile order against backward's: {order_differs} of "
      f"{n_q1 * n_k1} pairs differ")

# Figure: the mask of one 32 x 32 tile (rows 32-63, keys 64-95), for each tiling.
rows, cols = slice(32, 64), slice(64, 96)
fig, axes = plt.subplots(2, len(tilings), figsize=(12, 7), sharex=True, sharey=True,
                         layout="constrained")
for column, t in enumerate(tilings):
    for row, (masks, name) in enumerate(((read_off, "counter (flash_lib)"),
                                         (per_tile, "generator per tile"))):
        ax = axes[row, column]
        ax.imshow(masks[t][rows, cols], cmap="gray_r", interpolation="nearest",
                  extent=(63.5, 95.5, 63.5, 31.5))
        for edge in range(0, n_k1 + 1, t[1]):  # the tiling's block boundaries
            if 64 < edge < 96:
                ax.axvline(edge - 0.5, color="C3", lw=1.5)
        for edge in range(0, n_q1 + 1, t[0]):
            if 32 < edge < 64:
                ax.axhline(edge - 0.5, color="C3", lw=1.5)
        ax.set_title(f"{name}\nblock {t[0]} × {t[1]}", fontsize=10)
        if row == 1:
            ax.set_xlabel("key position j")
        if column == 0:
            ax.set_ylabel("query position i")
fig.suptitle(f"The keep mask of one tile (rows 32–63, keys 64–95), p = {P_FIG}; black: kept, "
             "white: dropped, red: the tiling's block boundaries")
plt.show()

# %% [markdown]
# The top row is the same picture four times: the kernel's mask does not see the tiles. Below,
# each tiling restarts its generators at its own boundaries and draws another mask. With bit
# for bit the same mask, the outputs of different tilings differ only by the rounding of their
# different merge orders, as without dropout (chapter 5); and because every thread computes the
# same numbers for the same elements, the number of threads changes no bit at all. The cell
# checks both on a problem large enough for `flash_lib` to use threads ($2^{20}$ scores and
# more), forward and backward.

# %%
q2, k2, v2, dout2 = (rng.standard_normal((n, 16)) for n in (1100, 1000, 1000, 1100))
drop = dict(dropout_p=0.1, dropout_seed=SEED, causal=True)
runs = {}
for workers in (1, 2, 4):
    with flash_lib.threads(workers):
        out2, lse2 = flash_attention(q2, k2, v2, return_lse=True, block_q=128, block_k=96, **drop)
        runs[workers] = (out2, *flash_attention_backward(q2, k2, v2, out2, lse2, dout2,
                                                         block_q=128, block_k=96, **drop))
threads_identical = all(np.array_equal(a, b) for w in (2, 4) for a, b in zip(runs[1], runs[w]))
other_tiles = flash_attention(q2, k2, v2, block_q=256, block_k=200, **drop)
tiling_diff = worst(other_tiles, runs[1][0])
print("out, dq, dk, dv with dropout on 1, 2 and 4 workers, bit for bit:", threads_identical)
print(f"out with 256 x 200 tiles against 128 x 96: {below(tiling_diff)}")

# %% [markdown]
# ## Philox, written out
#
# `flash_lib` uses Philox4x32 (Salmon et al. 2011), the generator of cuRAND's `Philox4_32_10`
# and Triton's `tl.randint`, with the seven rounds FlashAttention-2 runs: its `philox`
# (`philox.cuh`) applies `philox_single_round` six times in a loop and once after it. It maps a
# 128-bit counter $(c_0, c_1, c_2, c_3)$ and a 64-bit key $(k_0, k_1)$ to four 32-bit words by
# rounds of
#
# $$
# (c_0, c_1, c_2, c_3) \leftarrow \big(\mathrm{hi}(M_1 c_2) \oplus c_1 \oplus k_0,\ \mathrm{lo}(M_1 c_2),\
# \mathrm{hi}(M_0 c_0) \oplus c_3 \oplus k_1,\ \mathrm{lo}(M_0 c_0)\big),
# $$
#
# with $M_0$ = `0xD2511F53`, $M_1$ = `0xCD9E8D57`, hi and lo the halves of a 64-bit product, and
# the key bumped by (`0x9E3779B9`, `0xBB67AE85`) between rounds. cuRAND, Random123 and Triton
# (`triton/language/random.py`: `N_ROUNDS_DEFAULT = 10`) run ten by default; the Random123
# authors' own benchmark lists Philox4x32-7 as "Crush-resistant with *NO* safety margin"
# (Random123-Boost, `libs/random/performance/prf_speed.cpp`), the ten being the margin. In
# NumPy the rounds are most of the mask's cost.
#
# For element $(b, i, j)$ ($b$ the flat index over the batch and head axes, $i$ and $j$ the
# global query and key positions) the key is the seed's two halves, the counter is
# $(\lfloor j/8 \rfloor, i, b \bmod 2^{32}, \lfloor b / 2^{32} \rfloor)$, and the element takes
# word $\lfloor (j \bmod 8)/2 \rfloor$, its low 16 bits for even $j$ and its high 16 bits for
# odd $j$: eight neighbouring keys share one evaluation, and no two elements share bits. It is
# kept iff that 16-bit number is at least $t = \mathrm{round}(p \cdot 2^{16})$, so with
# probability exactly $1 - t/2^{16}$, within $2^{-17}$ of $1 - p$.
#
# FlashAttention-2 takes 8 bits instead, 16 elements per evaluation: its dropout compares one
# *byte* of the output with `p_dropout_in_uint8_t = floor((1 - p) * 255)` (`dropout.h`,
# `flash_api.cpp`), keeping with probability $(\lfloor 255(1-p) \rfloor + 1)/256$, a multiple of
# $1/256$: at $p = 0.1$ that is 0.8984375, $1/640$ below $0.9$, which the keep-rate test below
# sees. Sixteen bits bound the error by $2^{-17}$ and still take half the evaluations of 32. Its
# counters are laid out by thread, so its masks are not `flash_lib`'s; the construction is the
# same.
#
# The cell writes Philox in NumPy from the formula above, checks that ten rounds give Random123's
# known answers (`tests/kat_vectors` in DEShawResearch/random123) and seven give Triton 3.9's
# `tl.randint4x(seed, offset, n_rounds=7)` (run under `TRITON_INTERPRET=1` by
# `tests/test_training.py`; counter `(offset mod 2³², offset // 2³², 0, 0)`, key the seed's
# halves), and builds the keep mask from seven, which must be `dropout_keep`'s bit for bit: for
# a batch of heads, and with an offset (a shard whose first query is row 5 and first key is key
# 9 of the whole, as `flash_dask` calls it, gets the window of the whole mask).

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
# **A trap: one stream per row.** NumPy's own `Philox` (Philox4x64) is a stream whose counter's
# first word advances by one per block of four words. Giving row $i$ the stream that starts at
# `counter=[i, 0, 0, 0]` looks like one stream per row, but row $i$'s second block is drawn at
# counter $i + 1$, row $i+1$'s first: each row's mask is its predecessor's shifted by four keys,
# and a count of kept pairs is no longer binomial. The cell counts, over 32 rows and 256 keys,
# how often $Z_{i+1, j} = Z_{i, j+4}$: always for the streams, about $(1-p)^2 + p^2 = 0.625$ of
# the time for independent entries at $p = 1/4$.

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
# If the entries are independent with keep probability $q = 1 - t/2^{16}$, the number kept
# among $n$ is binomial, with mean $nq$ and standard deviation $\sqrt{n q (1-q)}$: the measured
# rate lies within $q \pm 4\sqrt{q(1-q)/n}$ except with probability about $6 \cdot 10^{-5}$ (a
# normal approximation, excellent at these $n$). For each $p$ below, $n = 2^{22}$ elements of
# one mask of shape $(16, 512, 512)$; the counts are integers, the same on every machine. The
# last column asks the same question of FlashAttention-2's byte threshold: its keep probability
# $(\lfloor 255(1-p) \rfloor + 1)/256$, in units of the same interval's half-width.

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
# A framework that draws the mask with a stateful generator must keep it for the backward: one
# byte per element for a boolean array, $B \cdot H \cdot N_q \cdot N_k$ bytes per layer. For a
# model of 32 layers and 32 heads at $N = 4096$, one sequence's masks alone are
# $32 \cdot 32 \cdot 4096^2$ bytes = 16 GiB, four times the 4 GiB that the same layers' $Q$,
# $K$, $V$ and $O$ take in bfloat16 ($4 \cdot 32 \cdot 4096 \cdot 4096 \cdot 2$ bytes at
# $d_{\text{model}} = 4096$). A counter-based kernel stores the seed and the offset: 16 bytes,
# FlashAttention's `rng_state` (two int64, `flash_attn/flash_attn_interface.py`).
#
# The cell measures, with `measure_peak_bytes` on one worker (chapter 8's setting), the scratch
# (peak bytes minus the returned arrays) of `flash_attention` without and with dropout and of
# `flash_attention_backward` with dropout against $N$, in float32 with $d = 32$ and the default
# 512 × 512 tiles, and the mask `dropout_keep` materialises. The kernels draw the masks of two
# adjoining tiles of a worker's walk in one call (half the NumPy calls per tile, which on two
# threads are as many hand-overs of the GIL: `_flash_dropout.py`), so their scratch holds two
# tiles' Philox buffers, whatever $N$. Its output is this machine's measurement; the next cell
# states what it shows.

# %% tags=["nbval-ignore-output"]
mask_model_bytes = 32 * 32 * 4096**2
activations_bytes = 4 * 32 * 4096 * 4096 * 2
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
print(f"one sequence's masks, 32 layers x 32 heads at N = 4096: {mask_model_bytes / 2**30:g} GiB;"
      f" Q, K, V, O in bfloat16: {activations_bytes / 2**30:g} GiB")
print("stored mask bytes == N²:", [b == n * n for b, n in zip(scratch["stored mask"], sizes)])
for name, ratio in flat.items():
    print(f"{name} scratch with dropout, largest / smallest over N = 512..4096 under 1.25: "
          f"{ratio < 1.25}")
print("at N = 4096 the stored mask alone is larger than either kernel's whole scratch:",
      all(scratch[name][-1] < scratch["stored mask"][-1] for name in flat))

# %% [markdown]
# ## The gradient through dropout
#
# At a fixed seed, $Z$ is a constant and $O$ a smooth function of $Q$, $K$, $V$; the backward
# must return the exact gradient of that function, with the same $Z$. Chapter 12's chain rule
# with $\tilde P = P \circ Z/(1-p)$ in place of $P$ in $O = \tilde P V$:
#
# $$
# dV = \tilde P^\top dO, \qquad d\tilde P = dO\, V^\top, \qquad
# dP = d\tilde P \circ \frac{Z}{1 - p}, \qquad dS = P \circ (dP - D\,\mathbf 1^\top),
# $$
#
# and $dQ = \tau\, dS\, K$, $dK = \tau\, dS^\top Q$ as before. The softmax's Jacobian sees the
# undropped $P$, and its row term is still the one number chapter 12 computed from the output:
#
# $$
# D_i = \sum_j P_{ij}\, dP_{ij} = \sum_j P_{ij} \frac{Z_{ij}}{1-p}\, dO_i \cdot v_j
#     = dO_i \cdot \sum_j \tilde P_{ij} v_j = dO_i \cdot O_i ,
# $$
#
# with $O$ the dropped output the forward returned. So the tile loop is chapter 12's with two
# multiplications by the tile's $Z/(1-p)$, regenerated from the counter. The cell compares
# flash's and naive's backward with these formulas, then central differences of the forward
# at the same seed along a random direction with what three backwards predict: the right one,
# one that regenerates the mask from another seed, and one that forgets $1/(1-p)$.

# %%
dout = rng.standard_normal(q.shape)
Z = keep / (1 - P_DROP)
_, _, P = dense(q, k, v, allowed=causal)
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
    print(f"{name}: flash vs the formulas {below(grad_checks[name][0])}, naive vs them "
          f"{below(grad_checks[name][1])}")
print(f"D = rowsum(P ∘ dP) against rowsum(dO ∘ O): {below(D_from_P)} (relative)")

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
# ## Attention sinks
#
# A sink is one more logit per head, $\sigma_h$, in every row's denominator, with no value:
#
# $$
# \text{lse}_i = \log\Big(e^{\sigma} + \sum_j e^{s_{ij}}\Big), \qquad
# P_{ij} = e^{s_{ij} - \text{lse}_i}, \qquad O_i = \sum_j P_{ij} v_j ,
# \qquad \sum_j P_{ij} = 1 - e^{\sigma - \text{lse}_i} .
# $$
#
# The weights no longer sum to one: $e^{\sigma - \text{lse}_i}$ is the row's mass on the sink,
# and a row can give most of its weight to nothing. That is the use: StreamingLLM observed that
# models without one make the first tokens of a sequence sinks for attention they must place
# somewhere, and proposed a dedicated sink token; gpt-oss learns one logit per head
# (`self.sinks` in `gpt_oss/torch/model.py`, shape `(num_attention_heads,)`), and its `sdpa`
# appends it to the scores as one more column, takes the softmax and drops the column, which is
# `dense` above. The sink is neither scaled nor softcapped: the cap acts on the scores.
#
# Since $P_{ij}$ is the sinkless softmax times $1 - e^{\sigma - \text{lse}_i}$, a sink only
# scales each row's output: $O^{\text{sink}}_i = (1 - e^{\sigma - \text{lse}_i})\, O_i$, and
# $\text{lse}^{\text{sink}}_i = \log(e^{\sigma} + e^{\text{lse}_i})$, NumPy's `logaddexp`.
# In the tile loop it is one more key of score $\sigma$ and value 0, visited first: each row
# starts at $m = \sigma$, $\ell = 1$, $\text{acc} = 0$ instead of $-\infty$, 0, 0 (gpt-oss's
# Triton kernel, `gpt_oss/triton/attention.py`, starts `m_i` at the sink too, and adds
# $e^{\sigma - m}$ to the denominator after its loop). The cell checks
# `flash_attention(..., sinks=...)` against the dense construction, with causal masking, with
# softcap, with sinks of shape $(H,)$ and $(B, H)$, with dropout too, and the two identities.

# %%
sinks = np.array([-1.0, 2.5])  # one logit per head, shape (H,)
sinks_bh = np.array([[0.5, 3.0], [-2.0, 1.0]])  # (B, H)
sink_cases = {
    "sinks (H,), causal": (dict(sinks=sinks, causal=True), dict(sinks=sinks, allowed=causal)),
    "sinks (B, H)": (dict(sinks=sinks_bh), dict(sinks=sinks_bh)),
    "sinks (H,), softcap 2": (dict(sinks=sinks, softcap=2.0), dict(sinks=sinks, softcap=2.0)),
    "sinks (H,), causal, dropout 0.3": (
        dict(sinks=sinks, causal=True, dropout_p=P_DROP, dropout_seed=SEED),
        dict(sinks=sinks, allowed=causal, keep=keep, p=P_DROP)),
}
sink_checks = {}
for name, (keywords, dense_keywords) in sink_cases.items():
    reference, reference_lse, _ = dense(q, k, v, **dense_keywords)
    out_s, lse_s = flash_attention(q, k, v, return_lse=True, block_q=16, block_k=16, **keywords)
    sink_checks[name] = (worst(out_s, reference), worst(naive_attention(q, k, v, **keywords),
                                                        reference),
                         float(np.abs(lse_s - reference_lse).max()))
    print(f"{name:<32} flash vs dense {below(sink_checks[name][0]):<16} naive vs dense "
          f"{below(sink_checks[name][1]):<16} lse {below(sink_checks[name][2])}")

out_ns, lse_ns = flash_attention(q, k, v, causal=True, return_lse=True)
out_s, lse_s = flash_attention(q, k, v, causal=True, return_lse=True, sinks=sinks)
sink_mass = np.exp(sinks[:, None] - lse_s)  # (B, H, Nq): each row's weight on the sink
identities = {"out = (1 - mass) · out without sink": worst(out_s, (1 - sink_mass)[..., None] * out_ns),
              "lse = logaddexp(sink, lse without sink)":
                  float(np.abs(lse_s - np.logaddexp(sinks[:, None], lse_ns)).max())}
for name, err in identities.items():
    print(f"{name}: {below(err)}")

# %% [markdown]
# ### No row is empty any more
#
# Chapter 6's empty row, a query with no allowed key, had $\ell = 0$: output 0 by a guard, and
# $\text{lse} = \log 0 = -\infty$, which chapter 12's backward had to guard again. With a sink
# the row still holds one term, $e^{\sigma}$: $\ell = 1$ against $m = \sigma$, so the output is
# $\text{acc}/\ell = 0$ and $\text{lse} = \sigma + \log 1 = \sigma$, both exactly, with no
# guard: all of the row's weight is on the sink. FlashAttention's CuTe interface fills the lse
# with `learnable_sink` when there are no keys at all (`flash_attn/cute/interface.py`). In the
# backward, $P_{ij} = e^{-\infty - \sigma} = 0$ on every pair of the row and $D_i = dO_i \cdot 0
# = 0$. The cell masks row 3 of every head entirely and runs the forward and backward with every
# floating-point warning turned into an error.

# %%
mask = rng.random((n_q, n_k)) < 0.7
mask[3] = False
with np.errstate(all="raise"):
    out_e, lse_e = flash_attention(q, k, v, mask=mask, sinks=sinks, return_lse=True,
                                   block_q=16, block_k=16)
    grads_e = flash_attention_backward(q, k, v, out_e, lse_e, dout, mask=mask, sinks=sinks,
                                       block_q=16, block_k=16)
_, lse_no_sink = flash_attention(q, k, v, mask=mask, return_lse=True)
empty_row = {
    "out exactly 0": bool(np.all(out_e[..., 3, :] == 0)),
    "lse exactly the sink": bool(np.array_equal(lse_e[..., 3], np.broadcast_to(sinks, (B, H)))),
    "mass on the sink exactly 1": bool(np.all(np.exp(sinks - lse_e[..., 3]) == 1)),
    "dq row exactly 0": bool(np.all(grads_e[0][..., 3, :] == 0)),
    "every gradient finite": all(bool(np.isfinite(g).all()) for g in grads_e),
}
print("row 3 without a sink: lse", np.unique(lse_no_sink[..., 3]))
for name, holds in empty_row.items():
    print(f"row 3 with the sink: {name}: {holds}")

# %% [markdown]
# ### Merging: the sink is a partial result, counted once
#
# Chapter 3 merges the attention of one query over disjoint key sets from their
# $(\text{out}, \text{lse})$ pairs. The sink is a key set of its own: one key of score $\sigma$
# and value 0, whose attention is $(\text{out}, \text{lse}) = (0, \sigma)$. So split-KV with
# sinks runs every key shard *without* the sink and merges the partial $(0, \sigma)$ into the
# result exactly once. Merged twice, it is a sink of $\log(2 e^{\sigma}) = \sigma + \log 2$;
# computing each of two shards with the sink does the same. FlashAttention's CuTe kernels add
# the sink to the denominator in the first split only (`not self.is_split_kv or split_idx == 0`
# in `flash_attn/cute/flash_fwd_sm100.py`).
# The cell splits the keys in two at 21 (with causal masking, some rows see no key of the second
# shard: its lse is $-\infty$ and `merge_attention` gives it no weight).

# %%
def shard(keys, **keywords):
    """flash_attention over a slice of the keys, causal on the whole sequence's positions."""
    allowed = causal[:, keys]
    return flash_attention(q, k[..., keys, :], v[..., keys, :], mask=allowed, return_lse=True,
                           **keywords)


sink_partial = (np.zeros_like(out_s), np.broadcast_to(sinks[:, None], lse_s.shape))
left, right = shard(slice(0, 21)), shard(slice(21, n_k))
merged = merge_attention(*left, *right)
once = merge_attention(*merged, *sink_partial)
twice = merge_attention(*once, *sink_partial)
each_with_sink = merge_attention(*shard(slice(0, 21), sinks=sinks), *shard(slice(21, n_k), sinks=sinks))
sink_log2 = flash_attention(q, k, v, causal=True, sinks=sinks + np.log(2))
merge_checks = {
    "shards merged, then the sink once": (worst(once[0], out_s), float(np.abs(once[1] - lse_s).max())),
    "the sink merged twice": (worst(twice[0], out_s), float(np.abs(twice[1] - lse_s).max())),
    "each shard with the sink": (worst(each_with_sink[0], out_s),
                                 float(np.abs(each_with_sink[1] - lse_s).max())),
}
for name, (err_out, err_lse) in merge_checks.items():
    print(f"{name:<34} vs flash with sinks: out {below(err_out) if err_out < 1e-6 else f'{err_out:.2f}'}"
          f", lse {below(err_lse) if err_lse < 1e-6 else f'{err_lse:.2f}'}")
twice_is_log2 = worst(twice[0], sink_log2)
each_is_twice = worst(each_with_sink[0], twice[0])
print(f"the sink merged twice against flash with the sink + log 2: {below(twice_is_log2)}; "
      f"each shard with the sink against the sink merged twice: {below(each_is_twice)}")
empty_merge = merge_attention(np.zeros((1, d)), np.array([-np.inf]), np.zeros((1, d)),
                              np.array([1.5]))
print("an empty row merged with its sink (0, 1.5):", empty_merge[0].max(), empty_merge[1][0])

# %% [markdown]
# ### How much weight goes to the sink
#
# The mass on the sink, $e^{\sigma - \text{lse}_i}$, depends on how the sink compares with the
# row's scores. With all scores equal to 0 it is $e^{\sigma}/(e^{\sigma} + N_k)$; as the scores
# spread, their largest terms dominate $\text{lse}_i$ and the mass falls towards
# $e^{\sigma - \max_j s_{ij}}$, never above it (since $\text{lse}_i \ge \max_j s_{ij}$). The
# figure multiplies the scores of 64 random queries over 256 keys by a factor $\alpha$ (a
# sharper or flatter attention) for four sinks, and plots the median mass over the rows with
# its 10–90% band, from `flash_attention`'s lse; the dotted lines are the all-zero limit.

# %%
q3, k3, v3 = (rng.standard_normal((n, 16)) for n in (64, 256, 256))
raw_std = float(((q3 @ k3.T) / 4).std())  # the scores' standard deviation at α = 1
alphas = np.logspace(-2, 1.2, 20)
sink_values = [-2.0, 0.0, 2.0, 5.0]
mass = np.empty((len(sink_values), len(alphas), 64))
heads = np.broadcast_to(q3, (len(sink_values), 64, 16))  # one head per sink value
for a, alpha in enumerate(alphas):
    _, lse3 = flash_attention(alpha * heads, k3, v3, return_lse=True, block_q=32, block_k=64,
                              sinks=np.array(sink_values))
    mass[:, a] = np.exp(np.array(sink_values)[:, None] - lse3)
fig, ax = plt.subplots(figsize=(8, 4.6))
for s_idx, (sigma, color) in enumerate(zip(sink_values, ("C0", "C1", "C2", "C3"))):
    low, mid, high = np.percentile(mass[s_idx], [10, 50, 90], axis=-1)
    ax.plot(alphas * raw_std, mid, marker="o", ms=3, color=color, label=f"sink σ = {sigma:g}")
    ax.fill_between(alphas * raw_std, low, high, color=color, alpha=0.2)
    ax.axhline(np.exp(sigma) / (np.exp(sigma) + 256), color=color, ls=":", lw=1)
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_ylim(1e-12, 1.5)
ax.set_xlabel("standard deviation of the scores $s_{ij}$ (nats)")
ax.plot([], [], ":", color="0.3", lw=1, label=r"all scores 0: $e^\sigma / (e^\sigma + N_k)$")
ax.set_ylabel(r"mass on the sink, $e^{\sigma - \mathrm{lse}_i}$")
ax.set_title("Attention mass on the sink against the scores' scale (Nk = 256; median, 10–90%)")
ax.legend(loc="lower left", fontsize=9)
ax.grid(True, which="major", alpha=0.3)
fig.tight_layout()
plt.show()
flat_limit = np.exp(np.array(sink_values)) / (np.exp(np.array(sink_values)) + 256)
near_zero = float(np.abs(np.median(mass[:, 0], axis=-1) / flat_limit - 1).max())
sharp_mass = float(np.median(mass[:, -1], axis=-1).max())
# at the largest scale: the mass against e^(σ - max_j s_ij), its limit
to_limit = mass[:, -1] / np.exp(np.array(sink_values)[:, None] - (alphas[-1] * q3 @ k3.T / 4).max(-1))
print(f"at the smallest scale the median mass is the all-zero limit to within 1%: {near_zero < 0.01}")
print(f"at the largest (std {alphas[-1] * raw_std:.0f}) every median is below 1e-6: {sharp_mass < 1e-6};"
      f" mass / exp(σ - max_j s_ij) at most 1: {to_limit.max() <= 1 + 1e-9}, its median above 0.9: "
      f"{np.median(to_limit) > 0.9}")

# %% [markdown]
# ### The sink's gradient
#
# Take one row and put the sink in front as key 0: scores $\hat s = (\sigma, s_1, \dots, s_n)$,
# values $\hat v = (0, v_1, \dots, v_n)$, weights $\hat P = \operatorname{softmax}(\hat s)$,
# $O = \sum_k \hat P_k \hat v_k$. Chapter 12's three steps, unchanged:
#
# 1. $d\hat P_k = dO \cdot \hat v_k$, so $d\hat P_0 = dO \cdot 0 = 0$ and
#    $d\hat P_j = dP_j$ for the keys.
# 2. The softmax's Jacobian $J = \operatorname{diag}(\hat P) - \hat P \hat P^\top$ gives
#    $d\hat s_k = \hat P_k \big(d\hat P_k - \sum_l \hat P_l\, d\hat P_l\big)$.
# 3. The sum is $\sum_l \hat P_l\, d\hat P_l = 0 + \sum_j P_j\, dP_j = dO \cdot O = D$, the same
#    $D$ as without the sink (the sink adds nothing to $O$).
#
# So the keys' $dS_j = P_j (dP_j - D)$ is chapter 12's formula with the sink-inclusive $P$,
# which the tile loop already rebuilds from the sink-inclusive lse: the loop does not change.
# The sink's own entry is
#
# $$
# d\hat s_0 = \hat P_0\, (0 - D) = -e^{\sigma - \text{lse}_i}\, D_i, \qquad
# \frac{\partial L}{\partial \sigma_h} = -\sum_{\text{rows } i \text{ of head } h}
# e^{\sigma_h - \text{lse}_i}\, D_i ,
# $$
#
# summed over every row the sink enters: all queries of head $h$ and, for sinks of shape
# $(H,)$, every batch element (FlashAttention's `flash_bwd_postprocess.py` accumulates exactly
# `sink_sum += -sink_prob * dpsum_val`). With dropout, $D_i = dO_i \cdot O_i$ still holds by the
# derivation of the dropout section, so nothing else changes. The cell checks step 2 on one row
# with the explicit Jacobian, then `flash_attention_backward`'s `dsinks` against the sum,
# against `naive_attention_backward`, and against central differences in each sink, with and
# without dropout; and a flipped sign against the differences.

# %%
s_row = np.concatenate([[sinks[1]], (q[0, 1, 5] @ k[0, 1].T) / np.sqrt(d)])
p_row = np.exp(s_row - s_row.max()) / np.exp(s_row - s_row.max()).sum()
dp_row = np.concatenate([[0.0], v[0, 1] @ dout[0, 1, 5]])  # dP̂_0 = dO · 0
jacobian = np.diag(p_row) - np.outer(p_row, p_row)
D_row = p_row @ dp_row
jacobian_diff = abs((jacobian @ dp_row)[0] - (-p_row[0] * D_row)) / abs(p_row[0] * D_row)
print(f"one row: (J dP̂)_0 against -P̂_0 D: {below(jacobian_diff)} (relative)")

dsink_checks, fd_sinks = {}, {}
for name, extra in (("no dropout", {}), ("dropout 0.3", dict(dropout_p=P_DROP, dropout_seed=SEED))):
    out_g, lse_g = flash_attention(q, k, v, causal=True, sinks=sinks, return_lse=True, **extra)
    *_, dsinks = flash_attention_backward(q, k, v, out_g, lse_g, dout, causal=True, sinks=sinks,
                                          block_q=16, block_k=8, **extra)
    *_, dsinks_naive = naive_attention_backward(q, k, v, dout, causal=True, sinks=sinks, **extra)
    formula = -(np.exp(sinks[:, None] - lse_g) * (dout * out_g).sum(axis=-1)).sum(axis=(0, 2))
    numeric_s = np.empty_like(sinks)
    for h in range(H):
        bump = np.eye(H)[h] * EPS
        plus, minus = (float((dout * flash_attention(q, k, v, causal=True, sinks=sinks + sign * bump,
                                                      **extra)).sum()) for sign in (1, -1))
        numeric_s[h] = (plus - minus) / (2 * EPS)
    dsink_checks[name] = (float(np.abs(dsinks - formula).max() / np.abs(formula).max()),
                          float(np.abs(dsinks_naive - formula).max() / np.abs(formula).max()))
    fd_sinks[name] = (float(np.abs(dsinks - numeric_s).max() / np.abs(numeric_s).max()),
                      float(np.abs(-dsinks - numeric_s).max() / np.abs(numeric_s).max()))
    print(f"{name}: dsinks shape {dsinks.shape}; flash vs the sum {below(dsink_checks[name][0])}, "
          f"naive vs it {below(dsink_checks[name][1])}")
    print(f"   against central differences: {below(fd_sinks[name][0], 1e-7)}; "
          f"with the sign flipped: {fd_sinks[name][1]:.1f}")

# %% [markdown]
# ## What we showed
#
# - Dropout draws $Z$ from a counter: the random number of element $(b, i, j)$ is 16 bits of
#   seven Philox rounds of $(\lfloor j/8 \rfloor, i, b)$ under the seed (FlashAttention-2's
#   rounds, twice its bits), so the kernel's mask is `dropout_keep`'s
#   whatever the tiles, threads or loop order; a generator per tile changes with the block
#   sizes, one generator for the call with the visiting order, and one NumPy stream per row
#   repeats the previous row shifted by four keys.
# - The keep rate is within $4\sigma$ of $1 - t/2^{16}$ (itself within $2^{-17}$ of $1 - p$) at
#   $n = 2^{22}$ for every $p$ tried; a byte threshold such as FlashAttention-2's lies outside
#   that interval at $p = 0.1$ and $0.9$.
# - Nothing of size $N^2$ is stored: forward and backward scratch with dropout is flat in $N$,
#   where a stored mask takes $N^2$ bytes per head and layer, at $N = 4096$ already more than
#   either kernel's whole scratch.
# - The backward is chapter 12's with $Z/(1-p)$ twice, and $D = \operatorname{rowsum}(dO \circ O)$
#   still; central differences at the fixed seed agree, and catch a backward with another seed
#   and one without $1/(1-p)$.
# - A sink is a key of score $\sigma$ and value 0: it scales each row by
#   $1 - e^{\sigma - \text{lse}}$, turns an empty row into out 0 and lse $\sigma$ exactly, and
#   is the partial $(0, \sigma)$ of a merge, to be merged once.
# - $\partial L / \partial \sigma_h = -\sum_i e^{\sigma_h - \text{lse}_i} D_i$, from the softmax's
#   Jacobian; checked against central differences, which a flipped sign fails.

# %%
# ROUNDING = 1e-14 (45 eps): every rounding-level difference below was at most 2.3e-15 at every
# NPY_DISABLE_CPU_FEATURES level; a kernel off by 1e-6 relative fails them.
assert all(err < ROUNDING for err in forward_checks.values()), forward_checks
assert lse_undropped and lse_vs_dense < ROUNDING and p_zero_identical
# the kernel's mask is dropout_keep's for every tiling; the stateful attempts are not
assert all(np.array_equal(read_off[t], reference_keep) for t in tilings)
assert all((per_tile[t] != per_tile[tilings[0]]).sum() > 0.2 * n_q1 * n_k1 for t in tilings[1:])
assert order_differs > 0.2 * n_q1 * n_k1  # about 2p(1 - p) = 37.5% of the pairs
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
    assert abs(q_keep - (1 - p)) <= 2.0**-17
assert abs(rate_rows[0][-1]) > 4 and abs(rate_rows[3][-1]) > 4
# memory: the stored mask is N² bytes, the kernels' scratch flat in N and far below it
assert mask_model_bytes == 16 * 2**30 and activations_bytes == 4 * 2**30
assert all(b == n * n for b, n in zip(scratch["stored mask"], sizes))
assert all(ratio < 1.25 for ratio in flat.values()), flat
# measured at N = 4096: 5.4 and 6.4 MiB of scratch against the mask's 16 MiB
assert all(scratch[name][-1] < scratch["stored mask"][-1] for name in flat)
# the gradient through dropout: the formulas, naive and flash agree; differences confirm it
assert all(a < ROUNDING and b < ROUNDING for a, b in grad_checks.values()), grad_checks
assert D_from_P < ROUNDING
# central differences at EPS = 1e-6: truncation and rounding, measured at most 5e-10 (every level)
assert fd_checks["the backward"] < 1e-8
assert fd_checks["mask from another seed"] > 1e-2 and fd_checks["no 1/(1 - p)"] > 1e-2
# sinks: the dense construction, the two identities, the empty row, the merge
assert all(max(errs) < ROUNDING for errs in sink_checks.values()), sink_checks
assert all(err < ROUNDING for err in identities.values()), identities
assert all(empty_row.values()), empty_row
assert np.isneginf(right[1]).any()  # rows with no key in the second shard (i + 16 < 21)
assert max(merge_checks["shards merged, then the sink once"]) < ROUNDING
assert merge_checks["the sink merged twice"][1] > 0.01 and merge_checks["each shard with the sink"][1] > 0.01
assert twice_is_log2 < ROUNDING and each_is_twice < ROUNDING
assert empty_merge[0].max() == 0 and empty_merge[1][0] == 1.5
assert near_zero < 0.01 and sharp_mass < 1e-6  # measured: 1.6e-4, 1e-13
assert to_limit.max() <= 1 + 1e-9 and np.median(to_limit) > 0.9  # median measured 0.95
# dsinks: the Jacobian's entry, the sum, naive, central differences (EPS = 1e-6; measured at most
# 3e-9 at every level), a flipped sign (2, relative)
assert jacobian_diff < ROUNDING
assert all(a < ROUNDING and b < ROUNDING for a, b in dsink_checks.values()), dsink_checks
assert all(right < 1e-7 and wrong > 1 for right, wrong in fd_sinks.values()), fd_sinks
assert dsinks.shape == sinks.shape  # (H,): summed over the batch and the rows

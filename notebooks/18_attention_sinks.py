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
# # 18. Attention sinks
#
# A sink is one learned logit per head that joins every row's softmax denominator and carries
# no value (gpt-oss), so that a row can give its weight to nothing. This chapter derives what
# it does to the output, the lse, empty rows and merging, and its gradient, and checks
# `flash_lib`'s kernels against gpt-oss's dense construction written out here.
#
# **Sources.** gpt-oss is quoted from openai/gpt-oss at commit `7b58334` (`gpt_oss/torch/model.py`,
# `gpt_oss/triton/attention.py`); FlashAttention's learnable sink from its CuTe kernels,
# Dao-AILab/flash-attention at commit `0251105a` (`flash_attn/cute/interface.py`,
# `flash_fwd_sm100.py`, `flash_bwd_postprocess.py`); StreamingLLM is Xiao et al., "Efficient
# Streaming Language Models with Attention Sinks", arXiv 2309.17453.

# %%
import matplotlib.pyplot as plt
import numpy as np

from _oracle import worst  # chapter 7's metric, the worst row (chapters 14 and 15's module)
from flash_bench import below
from flash_lib import (
    dropout_keep,
    flash_attention,
    flash_attention_backward,
    merge_attention,
    naive_attention,
    naive_attention_backward,
)

rng = np.random.default_rng(18)
SEED, P_DROP = 20240917, 0.3  # chapter 17's dropout, for the case that combines both

# The limit for float64 agreements "to rounding" in this chapter: 1e-14, 45 machine epsilons.
# Every such difference below was at most 2.3e-15 at every NPY_DISABLE_CPU_FEATURES level
# (CONTRIBUTING.md); a kernel off by one part in a million or a sink counted twice is far above.
ROUNDING = 1e-14


def dense(q, k, v, *, allowed=None, softcap=None, sinks=None, keep=None, p=0.0):
    """Attention for the whole score matrix, the sink as gpt-oss writes it (`sdpa` in
    gpt_oss/torch/model.py: one more column of scores, a softmax, the column dropped; gpt-oss
    appends it last, here it comes first), dropout (chapter 17) on the normalised weights.
    Returns the output, the lse (sink included, dropout not) and P."""
    s = (q @ np.swapaxes(k, -1, -2)) / np.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)  # the cap applies to the scores, not to the sink
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    if sinks is not None:
        column = np.broadcast_to(np.asarray(sinks)[..., None, None], s.shape[:-1] + (1,))
        s = np.concatenate([column, s], axis=-1)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    P = (e / l)[..., 1:] if sinks is not None else e / l
    dropped = P if keep is None else P * keep / (1 - p)
    return dropped @ v, (m + np.log(l))[..., 0], P


B, H, n_q, n_k, d = 2, 2, 40, 56, 16
q, k, v = (rng.standard_normal((B, H, n, d)) for n in (n_q, n_k, n_k))
dout = rng.standard_normal(q.shape)
causal = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + (n_k - n_q)  # bottom-right
keep = dropout_keep(SEED, P_DROP, (B, H, n_q, n_k))
EPS = 1e-6

# %% [markdown]
# ## One more logit in the denominator
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
    print(f"{name:<32} flash vs dense {below(sink_checks[name][0], ROUNDING):<16} naive vs dense "
          f"{below(sink_checks[name][1], ROUNDING):<16} lse {below(sink_checks[name][2], ROUNDING)}")

out_ns, lse_ns = flash_attention(q, k, v, causal=True, return_lse=True)
out_s, lse_s = flash_attention(q, k, v, causal=True, return_lse=True, sinks=sinks)
sink_mass = np.exp(sinks[:, None] - lse_s)  # (B, H, Nq): each row's weight on the sink
identities = {"out = (1 - mass) · out without sink": worst(out_s, (1 - sink_mass)[..., None] * out_ns),
              "lse = logaddexp(sink, lse without sink)":
                  float(np.abs(lse_s - np.logaddexp(sinks[:, None], lse_ns)).max())}
for name, err in identities.items():
    print(f"{name}: {below(err, ROUNDING)}")

# %% [markdown]
# ## No row is empty any more
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
# ## Merging: the sink is a partial result, counted once
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
    print(f"{name:<34} vs flash with sinks: out {below(err_out, ROUNDING) if err_out < 1e-6 else f'{err_out:.2f}'}"
          f", lse {below(err_lse, ROUNDING) if err_lse < 1e-6 else f'{err_lse:.2f}'}")
twice_is_log2 = worst(twice[0], sink_log2)
each_is_twice = worst(each_with_sink[0], twice[0])
print(f"the sink merged twice against flash with the sink + log 2: {below(twice_is_log2, ROUNDING)}; "
      f"each shard with the sink against the sink merged twice: {below(each_is_twice, ROUNDING)}")
empty_merge = merge_attention(np.zeros((1, d)), np.array([-np.inf]), np.zeros((1, d)),
                              np.array([1.5]))
print("an empty row merged with its sink (0, 1.5):", empty_merge[0].max(), empty_merge[1][0])

# %% [markdown]
# ## How much weight goes to the sink
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
flat_limit = np.exp(np.array(sink_values)) / (np.exp(np.array(sink_values)) + 256)
near_zero = float(np.abs(np.median(mass[:, 0], axis=-1) / flat_limit - 1).max())
sharp_mass = float(np.median(mass[:, -1], axis=-1).max())
# at the largest scale: the mass against e^(σ - max_j s_ij), its limit
to_limit = mass[:, -1] / np.exp(np.array(sink_values)[:, None] - (alphas[-1] * q3 @ k3.T / 4).max(-1))
print(f"at the smallest scale the median mass is the all-zero limit to within 1%: {near_zero < 0.01}")
print(f"at the largest (std {alphas[-1] * raw_std:.0f}) every median is below 1e-6: {sharp_mass < 1e-6};"
      f" mass / exp(σ - max_j s_ij) at most 1: {to_limit.max() <= 1 + 1e-9}, its median above 0.9: "
      f"{np.median(to_limit) > 0.9}")

# %% tags=["hide-input"]
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
ax.set_ylabel(r"mass on the sink, $e^{\sigma - \mathrm{lse}_i}$ (share of the row)")
ax.set_title("Attention mass on the sink against the scores' scale (Nk = 256; median, 10–90%)")
ax.legend(loc="lower left", fontsize=9)
ax.grid(True, which="major", alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The sink's gradient
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
# `sink_sum += -sink_prob * dpsum_val`). With dropout, $D_i = dO_i \cdot O_i$ still holds
# ({doc}`chapter 17 <17_dropout>`), so nothing else changes. The cell checks step 2 on one row
# with the explicit Jacobian, then `dsinks` against the sum, against `naive_attention_backward`
# and against central differences in each sink, with and without dropout, and a flipped sign.

# %%
s_row = np.concatenate([[sinks[1]], (q[0, 1, 5] @ k[0, 1].T) / np.sqrt(d)])
p_row = np.exp(s_row - s_row.max()) / np.exp(s_row - s_row.max()).sum()
dp_row = np.concatenate([[0.0], v[0, 1] @ dout[0, 1, 5]])  # dP̂_0 = dO · 0
jacobian = np.diag(p_row) - np.outer(p_row, p_row)
D_row = p_row @ dp_row
jacobian_diff = abs((jacobian @ dp_row)[0] - (-p_row[0] * D_row)) / abs(p_row[0] * D_row)
print(f"one row: (J dP̂)_0 against -P̂_0 D: {below(jacobian_diff, ROUNDING)} (relative)")

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
    print(f"{name}: dsinks shape {dsinks.shape}; flash vs the sum {below(dsink_checks[name][0], ROUNDING)}, "
          f"naive vs it {below(dsink_checks[name][1], ROUNDING)}")
    print(f"   against central differences: {below(fd_sinks[name][0], 1e-7)}; "
          f"with the sign flipped: {fd_sinks[name][1]:.1f}")

# %% [markdown]
# ## What we showed
#
# - A sink is a key of score $\sigma$ and value 0: it scales each row by
#   $1 - e^{\sigma - \text{lse}}$, turns an empty row into out 0 and lse $\sigma$ exactly, and
#   is the partial $(0, \sigma)$ of a merge, to be merged once.
# - The mass on the sink falls from $e^{\sigma}/(e^{\sigma} + N_k)$ for flat scores towards
#   $e^{\sigma - \max_j s_{ij}}$, never above it, as the scores spread.
# - $\partial L / \partial \sigma_h = -\sum_i e^{\sigma_h - \text{lse}_i} D_i$, from the softmax's
#   Jacobian; checked against central differences, which a flipped sign fails.

# %%
# ROUNDING = 1e-14 (45 eps): every rounding-level difference below was at most 2.3e-15 at every
# NPY_DISABLE_CPU_FEATURES level; a kernel off by 1e-6 relative fails them.
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

# %% [markdown]
# ## Your turn: attention with sinks
#
# Write `attention_with_sinks(q, k, v, sinks, *, causal=False) -> (out, lse)`
# for `q (H, Nq, d)`, `k (H, Nk, d)`, `v (H, Nk, dv)` and `sinks (H,)`, one unscaled logit per
# head: $\text{lse}_i = \log(e^{\text{sink}} + \sum_j e^{s_{ij}})$, out normalised by the same
# sum, the sink carrying no value; causal aligned bottom-right; a row with no allowed key gives
# `out = 0` and `lse = sink`.
#
# Replace the stub with your function and re-run the grade cell: it says `not implemented yet`,
# then what is wrong and where to look, until `passed`. The solution is hidden below it.

# %%
from flash_check.exercises import grade, show_solution, stub

# your turn: replace the stub with def attention_with_sinks(q, k, v, sinks, *, causal=False): ...
attention_with_sinks = stub("attention_with_sinks")

# %%
grade("attention_with_sinks", attention_with_sinks)

# %% jupyter={"outputs_hidden": true} mystnb={"code_prompt_hide": "Hide the solution", "code_prompt_show": "Show the solution"} tags=["remove-input", "hide-output"]
show_solution("attention_with_sinks")

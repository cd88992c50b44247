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
# # 26. Appendix: where flash_lib applies the scale
#
# FlashAttention computes $S = \tau\, Q K^\top$; where the multiplication by $\tau$ happens is an
# implementation's choice (FlashAttention-2 scales the scores in registers; Triton's tutorial
# folds $\tau \log_2 e$ into an `exp2`). This appendix describes `flash_lib`'s choice, which
# chapters 5, 12 and 13 refer to, and checks it.
#
# `flash_lib` does not multiply each tile's scores by $\tau$. It writes $\tau = r \cdot 2^e$ with
# $\tfrac12 \le r < 1$ and multiplies the query block by $\tau_q = r \cdot 2^a$ (once per query
# block) and each key block by $\tau_k = 2^b$, with $a + b = e$ and $b = \operatorname{trunc}(e/2)$:
#
# - *accuracy*: multiplying by a power of two is exact, so the scores round exactly as
#   $(\tau q)k^\top$ does, which carries the same error bound as $\tau(qk^\top)$: one rounding of
#   the scale against the $d$ roundings of the dot product;
# - *range*: with half of the power of two on each side, neither factor overflows before the other
#   brings it back: $\tau q$ alone overflows for $q = 10^{300}$, $\tau = 10^{10}$, although every
#   score is finite (the cell below);
# - *cost*: $b_k d$ multiplications per tile for the key block (none when $2^b = 1$) and
#   $b_q d$ per query block, where scaling the scores would be $b_q b_k$ per tile, one more pass
#   over the whole tile.
#
# The backward follows the same placement, each side getting its own factor:
#
# $$dQ = \tau_q \cdot \big(dS\, (\tau_k K)\big), \qquad dK = \tau_k \cdot \big(dS^\top (\tau_q Q)\big),$$
#
# equal to $\tau\, dS\, K$ and $\tau\, dS^\top Q$ up to rounding, and exactly when $\tau$ is a
# power of two: then every placement gives the same bits, which is why chapters 5 and 12 can
# compare loops of their own with `flash_lib` bit for bit at $d = 16$ or $64$.

# %%
import math

import numpy as np

import flash_lib


def split_scale(tau):
    """τ = r·2^e → (τ_q, τ_k) = (r·2^a, 2^b), b = trunc(e/2), a = e - b: flash_lib's placement."""
    r, e = math.frexp(tau)
    b = int(e / 2)
    return math.ldexp(r, e - b), math.ldexp(1.0, b)


for tau in (1 / 8, 1 / np.sqrt(48), 0.05, 3.0, 1e10):
    print(f"tau = {tau:.6g}: tau_q = {split_scale(tau)[0]:.6g}, tau_k = {split_scale(tau)[1]:.6g}")

# %% [markdown]
# The rule is flash_lib's: `flash_attention` with scale $\tau$ computes, bit for bit, what it
# computes on $\tau_q Q$ and $\tau_k K$ with scale 1 (which it splits as $(1, 1)$), forward and
# backward. And the range argument: $q = 10^{300}$, $k = 10^{-300}$, $\tau = 10^{10}$.

# %%
rng = np.random.default_rng(22)
q, k, v, dout = rng.standard_normal((4, 40, 48))
same_forward, same_backward = [], []
for tau in (0.125, 1 / np.sqrt(48), 0.05, 3.0):
    t_q, t_k = split_scale(tau)
    out, lse = flash_lib.flash_attention(q, k, v, scale=tau, return_lse=True)
    out_1, lse_1 = flash_lib.flash_attention(q * t_q, k * t_k, v, scale=1.0, return_lse=True)
    same_forward.append(np.array_equal(out, out_1) and np.array_equal(lse, lse_1))
    dq, dk, dv = flash_lib.flash_attention_backward(q, k, v, out, lse, dout, scale=tau)
    dq_1, dk_1, dv_1 = flash_lib.flash_attention_backward(q * t_q, k * t_k, v, out_1, lse_1, dout,
                                                          scale=1.0)
    # the chain rule through τ_q q and τ_k k: dq = τ_q dq_1, dk = τ_k dk_1
    same_backward.append(np.array_equal(dq, t_q * dq_1) and np.array_equal(dk, t_k * dk_1)
                         and np.array_equal(dv, dv_1))
print("forward, bit for bit, for the four scales:", same_forward)
print("backward, bit for bit, for the four scales:", same_backward)

q_huge, k_tiny = np.full((1, 4), 1e300), np.full((2, 4), 1e-300)
with np.errstate(over="ignore"):
    tau_q_first = 1e10 * q_huge
scores_q_first = tau_q_first @ k_tiny.T  # (τq)kᵀ with τq formed first
print("τq:", tau_q_first, "| (τq)kᵀ:", scores_q_first)
out_huge = flash_lib.flash_attention(q_huge, k_tiny, np.eye(2), scale=1e10)
print("flash_attention with q = 1e300, k = 1e-300, τ = 1e10 (scores 4e10, equal):", out_huge)

# %%
assert all(same_forward) and all(same_backward)
assert np.isinf(tau_q_first).all() and np.isinf(scores_q_first).all()
assert np.array_equal(out_huge, [[0.5, 0.5]])

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
# # 25. Appendix: what other libraries do
#
# `flash_lib` fixes three conventions that real libraries do not share: the output and lse of a
# row with no allowed key, and where the causal diagonal sits when $N_q \ne N_k$. Here is what
# FlashAttention, PyTorch (SDPA, its CPU flash kernel, FlexAttention) and JAX do, with sources,
# and why it matters when results are merged
# ({doc}`chapter 3 <03_merging_states>`) or fed to a backward pass
# ({doc}`chapter 12 <12_backward>`).
#
# **How the statements are checked.** FlashAttention needs a CUDA GPU, so it is quoted from its
# source (Dao-AILab/flash-attention, commit `0251105a`). PyTorch and JAX are tested whenever
# importable (`make` installs PyTorch; JAX is the optional `jax` extra): their cells' `assert`s
# fail if the library disagrees with this page, and their install-dependent output is exempt from
# the notebook's test.

# %%
import math
import textwrap
import warnings

import numpy as np

import flash_lib

rng = np.random.default_rng(16)

# %%
# Whether they are installed differs from install to install, so this cell prints nothing: the
# cells that test them say which version they tested, or that they were skipped.
try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = None  # its statements below stand on the cited sources only
try:
    import jax
except ImportError:
    jax = None

# %% [markdown]
# ## The inputs
#
# Five queries over six keys, float32: query 1 has no allowed key (an empty row), the others at
# least one under a random mask. flash_lib gives an empty row output 0 and lse
# $-\infty$ (chapter 6). The other rows, compared across libraries too, are checked against
# `naive_attention` in float64.

# %%
n_q, n_k, d = 5, 6, 8
q, k, v = (rng.standard_normal((n, d)).astype(np.float32) for n in (n_q, n_k, n_k))
mask = rng.random((n_q, n_k)) < 0.6
mask[:, 0] = True
mask[1] = False  # the empty row
out_ours, lse_ours = flash_lib.flash_attention(q, k, v, mask=mask, return_lse=True)
print("flash_lib, empty row 1: out =", out_ours[1, :3], "... lse =", lse_ours[1])
print("lse of the other rows:", np.round(lse_ours[[0, 2, 3, 4]], 4))
q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
error64 = flash_lib.rowwise_relative_error(
    flash_lib.flash_attention(q64, k64, v64, mask=mask)[[0, 2, 3, 4]],
    flash_lib.naive_attention(q64, k64, v64, mask=mask)[[0, 2, 3, 4]]).max()
print("the other rows in float64, flash_lib against naive_attention: within 1e-12:",
      error64 < 1e-12)

# %% [markdown]
# ## FlashAttention
#
# **Output.** "If the row of the mask is all zero, the output will be zero." (docstrings of
# `flash_attn_func` and its variants, `flash_attn/flash_attn_interface.py`). FlashAttention takes
# no boolean mask; rows become empty by causal masking with `seqlen_q > seqlen_k` or a local
# window. Its kernels guard $-\infty - (-\infty)$ as flash_lib does, with a reference of 0
# for a row whose max is still $-\infty$ (`csrc/flash_attn/src/softmax.h`:
# `max_scaled = max(mi) == -INFINITY ? 0.f : max(mi) * scale`).
#
# **lse.** FlashAttention-2's CUDA kernels finish a row in `normalize_softmax_lse`
# (`csrc/flash_attn/src/softmax.h`):
#
# ```
# lse(mi) = (sum == 0.f || sum != sum) ? (Split ? -INFINITY : INFINITY)
#                                      : row_max(mi) * softmax_scale + __logf(sum);
# ```
#
# so an empty row's lse is $+\infty$, except in split-KV (flash-decoding) partial results, which
# are $-\infty$ so that the combine step gives them weight $e^{-\infty} = 0$. Its test reference
# sets such an lse to inf on purpose, "so that when we do torch.exp(m - lse), we get 0.0 instead
# of NaN" (`tests/test_flash_attn.py`). Newer kernels chose the other sign: FlashAttention-3's
# `hopper/softmax.h` and FlashAttention-4's `flash_attn/cute/softmax.py` write $-\infty$, and
# FlashAttention-3's backward maps it to 0 before use (`hopper/flash_bwd_preprocess_kernel.h`:
# `lse == -INFINITY ? 0.f : lse * float(M_LOG2E)`).
#
# **Why the sign matters: the backward pass.** The backward recomputes the weights from the
# stored lse, $P_{ij} = e^{s_{ij} - \text{lse}_i}$, and an empty row has $s_{ij} = -\infty$:

# %%
s_empty = np.full(4, -np.inf, dtype=np.float32)  # an empty row's masked scores
with np.errstate(invalid="ignore"):
    p_from = {name: np.exp(s_empty - np.float32(lse))
              for name, lse in (("+inf (FlashAttention-2)", np.inf),
                                ("-inf (flash_lib, FA-3/4, FlexAttention)", -np.inf),
                                ("0.0 (PyTorch's CPU flash kernel)", 0.0))}
for name, p in p_from.items():
    print(f"lse = {name:<42} P = exp(s - lse) = {p}")
p_guarded = np.exp(s_empty - np.float32(0.0))  # the -inf convention with FA-3's guard: lse -> 0
print(f"lse = -inf, mapped to 0 before use (FlashAttention-3's backward):   P = {p_guarded}")

# %% [markdown]
# With $+\infty$ or 0 the recomputed weights are 0 without a branch; with $-\infty$, NaN unless the
# backward guards, as flash_lib's (chapter 12), FlashAttention-3's and FlexAttention's do. flash_lib
# keeps $-\infty$: it is the exact value, $\log 0$, and the only one that merges correctly.
#
# **Why the sign matters: merging.** Chapter 3's merge weights each part by $e^{\text{lse}}$. A
# part with lse $-\infty$ weighs nothing. A part with lse $+\infty$ claims infinite weight (lse
# $+\infty$, a NaN output), so `flash_lib.merge_attention` refuses it, with a `ValueError` saying
# how to convert. A part with lse 0 weighs $e^0 = 1$, a real part with output 0: **silently
# wrong**. Row 0, merged with an "empty" part under each convention:

# %%
out_part, lse_part = out_ours[:1], lse_ours[:1]  # row 0: a real part
zero_out = np.zeros_like(out_part)
merged = {}
for name, lse_empty in (("-inf", -np.inf), ("+inf", np.inf), ("0.0", 0.0)):
    try:
        merged[name] = flash_lib.merge_attention(out_part, lse_part, zero_out,
                                                 np.full(1, lse_empty, np.float32))
    except ValueError as e:  # flash_lib refuses +inf
        merged[name] = e
for name, result in merged.items():
    if isinstance(result, ValueError):
        print(textwrap.fill(f"empty part with lse {name}: ValueError: {result}", width=86,
                            subsequent_indent="   "))
    else:
        err = flash_lib.rowwise_relative_error(result[0], out_part)[0]
        print(f"empty part with lse {name}: merged lse {result[1][0]:.4f} "
              f"(true {lse_part[0]:.4f}), output error {err:.3g}")

# Converting FlashAttention-2's convention first makes the merge exact.
lse_fa2 = np.full(1, np.inf, np.float32)
converted = np.where(lse_fa2 == np.inf, -np.inf, lse_fa2)
merged_converted = flash_lib.merge_attention(out_part, lse_part, zero_out, converted)
print("lse +inf converted to -inf, then merged: largest change of row 0:",
      np.abs(merged_converted[0] - out_part).max(), "in out,\n  ",
      np.abs(merged_converted[1] - lse_part).max(), "in lse")

# %% [markdown]
# **Causal alignment.** Since version 2.1, "If seqlen_q != seqlen_k and causal=True, the causal
# mask is aligned to the bottom right corner of the attention matrix, instead of the top-left
# corner" (README, "2.1: Change behavior of causal flag"; the same in the `flash_attn_func`
# docstring), which shows the masks for `seqlen_q = 2, seqlen_k = 5` and `seqlen_q = 5,
# seqlen_k = 2` as rows of 1 (keep) and 0 (masked out). The cell compares them with flash_lib's
# rule $j \le i + (N_k - N_q)$, read off `naive_attention`: with identity values the output row
# is the weights (chapter 1's device), nonzero exactly at the allowed keys.

# %%
def allowed_by(kernel, n_q, n_k, **kwargs):
    """Which keys each query may attend, read off a kernel's output with identity values."""
    qq = rng.standard_normal((n_q, 4))
    kk = rng.standard_normal((n_k, 4))
    return kernel(qq, kk, np.eye(n_k), **kwargs) != 0


# Quoted from the flash_attn_func docstring (1 = keep, 0 = masked out).
flash_attn_doc = {(2, 5): np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=bool),
                  (5, 2): np.array([[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]], dtype=bool)}
for shape, documented in flash_attn_doc.items():
    ours = allowed_by(flash_lib.naive_attention, *shape, causal=True)
    print(f"seqlen_q, seqlen_k = {shape}: pairs where flash_lib's causal mask and\n"
          f"   FlashAttention's documented one differ: {np.count_nonzero(ours != documented)}")

# %% [markdown]
# ## PyTorch
#
# **SDPA, empty rows.** Before 2.5.0, a fully masked row of `attn_mask` gave NaN (pytorch/pytorch
# issues #103749 and #103963; #41508 for `nn.MultiheadAttention`); from then on, 0 (v2.5.0 release
# notes: "fully masked rows yield 0s"). The changes are PR #131060 (a private `_safe_softmax`) and
# PR #133882 (a re-land of #131863, "Update fused kernels and call _safe_softmax from SDPA"): the
# math path calls `at::_safe_softmax`, which writes 0 into every row whose scores are all $-\infty$
# (`aten/src/ATen/native/transformers/attention.cpp`). The public `torch.softmax` still returns NaN
# for such a row.
#
# The guarantee holds per backend and code path, not for every attention in PyTorch:
#
# - `nn.MultiheadAttention(..., need_weights=True)` uses a plain softmax and returns NaN for fully
#   masked rows (issue #160064, 2025; #41508 is still open), on CUDA with dropout too
#   (issue #152028, reproduced on an A100 with torch 2.11 and a 2.12 nightly in May 2026);
# - all-NaN rows from SDPA with fully $-\infty$ rows of a float mask were reported against 2.8.0
#   (issue #163997, a build without CUDA on macOS arm64);
# - a cuDNN backward (the default SDPA backend on H100/H200 since 2.11) returned NaN in the
#   query gradient when a row's lse fell below $-88.7$ with an explicit mask (issue #196678, a
#   regression, closed): the padded part of a key tile was scored 0 instead of $-\infty$, and
#   $e^{0 - \text{lse}}$ overflowed float32.

# %% tags=["nbval-ignore-output"]
def to_torch(*arrays):
    return [torch.from_numpy(np.ascontiguousarray(x))[None, None] for x in arrays]  # (1, 1, N, d)


if torch is None:
    print("PyTorch not installed: skipped (its statements stand on the cited sources only)")
else:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    print(f"PyTorch {torch.__version__}:")

    tq, tk, tv = to_torch(q, k, v)
    bool_mask = torch.from_numpy(mask)
    float_mask = torch.zeros(n_q, n_k).masked_fill(~bool_mask, -math.inf)
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
        for mask_name, m in (("bool", bool_mask), ("float -inf", float_mask)):
            with sdpa_kernel(backend):
                out_t = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=m)[0, 0].numpy()
            err = flash_lib.rowwise_relative_error(out_t, out_ours)
            print(f"SDPA {backend.name:<15} {mask_name:<10} mask: empty row {out_t[1, :3]}...;\n"
                  f"   other rows vs flash_lib: {err.max():.1e}")
            assert np.all(out_t[1] == 0) and err.max() < 1e-5
    softmax_row = torch.softmax(torch.full((4,), -math.inf), dim=-1)
    print("torch.softmax of an all -inf row:", softmax_row)
    assert torch.isnan(softmax_row).all()

    mha = torch.nn.MultiheadAttention(d, 1, batch_first=True)
    x = torch.from_numpy(q)[None]
    not_allowed = torch.zeros(n_q, n_q, dtype=torch.bool)
    not_allowed[1] = True  # nn.MultiheadAttention's bool mask: True = may NOT attend
    with torch.no_grad():
        y_fast, _ = mha(x, x, x, attn_mask=not_allowed, need_weights=False)
        y_weights, weights = mha(x, x, x, attn_mask=not_allowed, need_weights=True)
    print("MultiheadAttention, empty row, need_weights=False:", y_fast[0, 1, :3].numpy(), "...")
    print("MultiheadAttention, empty row, need_weights=True: ", y_weights[0, 1, :3].numpy(), "...")
    assert torch.all(y_fast[0, 1] == 0) and torch.isnan(y_weights[0, 1]).all()

# %% [markdown]
# **The CPU flash kernel's lse.** SDPA returns no lse, but the private op behind its CPU flash
# backend, `torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`, returns
# `(output, logsumexp)`. An empty row's lse is 0.0, which merges as weight 1.

# %% tags=["nbval-ignore-output"]
if torch is None:
    print("PyTorch not installed: skipped")
else:
    out_cpu, lse_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        tq, tk, tv, 0.0, False, attn_mask=float_mask[None, None])
    out_cpu, lse_cpu = out_cpu[0, 0].numpy(), lse_cpu[0, 0].numpy()
    print("CPU flash op, empty row: out", out_cpu[1, :3], "... lse", lse_cpu[1])
    print(f"other rows: lse vs flash_lib {np.abs(lse_cpu[[0, 2, 3, 4]] - lse_ours[[0, 2, 3, 4]]).max():.1e}")
    assert np.all(out_cpu[1] == 0) and lse_cpu[1] == 0.0
    assert np.allclose(lse_cpu[[0, 2, 3, 4]], lse_ours[[0, 2, 3, 4]], atol=1e-5)
    # Merged as chapter 3 merges, that lse gives row 0 a weight it does not have.
    wrong = flash_lib.merge_attention(out_part, lse_part, out_cpu[1:2], lse_cpu[1:2])
    print(f"row 0 merged with this empty part: output error {flash_lib.rowwise_relative_error(wrong[0], out_part)[0]:.3g}")
    assert flash_lib.rowwise_relative_error(wrong[0], out_part)[0] > 0.01
    # its causal flag is top-left, like SDPA's is_causal
    qc, kc, vc = (rng.standard_normal((n, d)).astype(np.float32) for n in (5, 2, 2))
    out_c = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *to_torch(qc, kc, vc), 0.0, True)[0][0, 0].numpy()
    err_c = flash_lib.rowwise_relative_error(
        out_c, flash_lib.naive_attention(qc, kc, vc, mask=np.tril(np.ones((5, 2), bool)))).max()
    print(f"CPU flash op, is_causal=True, Nq = 5, Nk = 2, vs flash_lib with a top-left mask:\n"
          f"   {err_c:.1e}")
    assert err_c < 1e-5

# %% [markdown]
# **FlexAttention.** Its math reference (`torch/_higher_order_ops/flex_attention.py`) sets the
# lse of a fully masked row to $-\infty$ (`torch.where(masked_rows, -float("inf"), logsumexp)`)
# and, in its backward, zeroes the weights where lse is $-\infty$
# (`torch.where(masked_out_rows.unsqueeze(-1), 0, softmax_scores)`), the guard the $-\infty$
# convention needs. Without `torch.compile`, `flex_attention` runs that reference (and warns that
# it is slow; the cell silences the warning).

# %% tags=["nbval-ignore-output"]
if torch is None:
    print("PyTorch not installed: skipped")
else:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask_t = torch.from_numpy(mask)
    block_mask = create_block_mask(lambda b, h, qi, ki: mask_t[qi, ki], 1, 1, n_q, n_k, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out_flex, lse_flex = flex_attention(tq, tk, tv, block_mask=block_mask, return_lse=True)
    out_flex, lse_flex = out_flex[0, 0].numpy(), lse_flex[0, 0].numpy()
    print("FlexAttention (eager), empty row: out", out_flex[1, :3], "... lse", lse_flex[1])
    print(f"other rows vs flash_lib: out {flash_lib.rowwise_relative_error(out_flex, out_ours).max():.1e}, "
          f"lse {np.abs(lse_flex[[0, 2, 3, 4]] - lse_ours[[0, 2, 3, 4]]).max():.1e}")
    assert np.all(out_flex[1] == 0) and lse_flex[1] == -np.inf
    assert np.allclose(lse_flex[[0, 2, 3, 4]], lse_ours[[0, 2, 3, 4]], atol=1e-5)

# %% [markdown]
# **Causal alignment.** `is_causal=True` is top-left: the documentation of
# `scaled_dot_product_attention` gives its reference implementation as
# `torch.ones(L, S, dtype=torch.bool).tril(diagonal=0)`. Bottom-right is opt-in, through
# `torch.nn.attention.bias.causal_lower_right` (`CausalVariant.LOWER_RIGHT`:
# `tril(diagonal=S - L)`). Such a bias with more queries than keys warns "Lower right
# causal bias will produce NaNs in the output when seq_len_q > seq_len_kv!"; the cell checks what
# SDPA returns for those empty rows here. Each is compared with flash_lib, top-left through an
# explicit `mask=np.tril(...)`.

# %% tags=["nbval-ignore-output"]
if torch is None:
    print("PyTorch not installed: skipped")
else:
    from torch.nn.attention.bias import causal_lower_right

    for n_qc, n_kc in ((5, 2), (3, 7)):
        qc, kc, vc = (rng.standard_normal((n, d)).astype(np.float32) for n in (n_qc, n_kc, n_kc))
        tqc, tkc, tvc = to_torch(qc, kc, vc)
        top_left = F.scaled_dot_product_attention(tqc, tkc, tvc, is_causal=True)[0, 0].numpy()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            bias = causal_lower_right(n_qc, n_kc)
        bottom_right = F.scaled_dot_product_attention(tqc, tkc, tvc, attn_mask=bias)[0, 0].numpy()
        ours_tl = flash_lib.naive_attention(qc, kc, vc, mask=np.tril(np.ones((n_qc, n_kc), bool)))
        ours_br = flash_lib.naive_attention(qc, kc, vc, causal=True)
        err_tl = flash_lib.rowwise_relative_error(top_left, ours_tl).max()
        err_br = flash_lib.rowwise_relative_error(bottom_right, ours_br).max()
        print(f"Nq, Nk = {n_qc}, {n_kc}: is_causal=True vs flash_lib with a top-left mask "
              f"{err_tl:.1e};\n   causal_lower_right vs flash_lib causal=True {err_br:.1e}; "
              f"warnings: {len(caught)}")
        for w in caught:
            print(textwrap.fill(f"   warning: {w.message}", width=86, subsequent_indent="   "))
        assert err_tl < 1e-5 and err_br < 1e-5
        if n_qc > n_kc:
            print("   rows of causal_lower_right's output that are exactly 0:",
                  [i for i in range(n_qc) if np.all(bottom_right[i] == 0)])
            assert np.all(bottom_right[: n_qc - n_kc] == 0) and len(caught) == 1

# %% [markdown]
# ## JAX
#
# `jax.nn.dot_product_attention` (its XLA implementation, `jax/_src/nn/functions.py`) does not
# use $-\infty$: `_apply_masks` replaces masked logits with `_get_large_negative(dtype)`,
# `-0.7` times the dtype's largest value (capped at float32's range), then takes an ordinary
# softmax. In a row with an allowed key that is as good as $-\infty$ (masked weights underflow
# to exactly 0). In a fully masked row every logit is the same finite number, so the
# weights are uniform, $1/N_k$, and the output is the mean of *all* the value rows. Its
# causal mask is top-left: `_get_causal_mask` is `jnp.tril(jnp.ones((T, S), dtype=bool))`. JAX
# orders axes (batch, sequence, heads, features).

# %% tags=["nbval-ignore-output"]
if jax is None:
    print("JAX not installed: skipped (its statements stand on the cited sources only)")
else:
    print(f"JAX {jax.__version__}:")

    def to_jax(*arrays):
        return [x[None, :, None, :] for x in arrays]  # (1, N, 1, d)

    out_jax = np.asarray(jax.nn.dot_product_attention(*to_jax(q, k, v), mask=mask[None, None]))[0, :, 0]
    err_rows = flash_lib.rowwise_relative_error(out_jax[[0, 2, 3, 4]], out_ours[[0, 2, 3, 4]]).max()
    err_mean = flash_lib.rowwise_relative_error(out_jax[1], v.mean(axis=0))
    print(f"JAX, empty row vs the mean of all values: {err_mean:.1e}; other rows vs flash_lib: "
          f"{err_rows:.1e}")
    assert err_mean < 1e-5 and err_rows < 1e-5
    qc, kc, vc = (rng.standard_normal((n, d)).astype(np.float32) for n in (5, 2, 2))
    out_causal = np.asarray(jax.nn.dot_product_attention(*to_jax(qc, kc, vc), is_causal=True))[0, :, 0]
    ours_tl = flash_lib.naive_attention(qc, kc, vc, mask=np.tril(np.ones((5, 2), bool)))
    err_tl = flash_lib.rowwise_relative_error(out_causal, ours_tl).max()
    print(f"JAX is_causal=True, Nq = 5, Nk = 2, vs flash_lib with a top-left mask: {err_tl:.1e}")
    assert err_tl < 1e-5

# %% [markdown]
# ## Summary
#
# | | empty row: output | empty row: lse | causal with $N_q \ne N_k$ |
# |---|---|---|---|
# | flash_lib | 0 | $-\infty$ | bottom-right |
# | FlashAttention-2 (CUDA) | 0 | $+\infty$ ($-\infty$ in split-KV partials) | bottom-right since 2.1 (top-left in 2.0) |
# | FlashAttention-3, -4 | 0 | $-\infty$ | bottom-right |
# | PyTorch SDPA | 0 since 2.5 (NaN before; per backend and path, see above) | not returned | `is_causal`: top-left; `causal_lower_right`: bottom-right |
# | PyTorch CPU flash op (private) | 0 | 0.0 | top-left (its `is_causal`) |
# | PyTorch FlexAttention | 0 | $-\infty$ (its backward guards it) | whatever `mask_mod` says |
# | JAX `dot_product_attention` | mean of all values | not returned | top-left |
#
# To reproduce a top-left library with flash_lib, pass `mask=np.tril(np.ones((Nq, Nk), bool))`.
# To merge FlashAttention-2's results with `merge_attention`, convert an lse of $+\infty$ to
# $-\infty$ first; never merge the 0.0 lse of an empty row from PyTorch's CPU op.

# %%
# the conventions' arithmetic, checked without any library
assert np.all(p_from["+inf (FlashAttention-2)"] == 0)
assert np.all(np.isnan(p_from["-inf (flash_lib, FA-3/4, FlexAttention)"]))
assert np.all(p_from["0.0 (PyTorch's CPU flash kernel)"] == 0) and np.all(p_guarded == 0)
assert np.array_equal(merged["-inf"][0], out_part) and np.array_equal(merged["-inf"][1], lse_part)
# +inf: refused, with the conversion in the message
assert isinstance(merged["+inf"], ValueError), merged["+inf"]
assert "np.where(lse_b == np.inf, -np.inf, lse_b)" in str(merged["+inf"])
# 0.0: finite and wrong
assert np.all(np.isfinite(merged["0.0"][0]))
assert flash_lib.rowwise_relative_error(merged["0.0"][0], out_part)[0] > 0.01
assert np.array_equal(merged_converted[0], out_part)
for shape, documented in flash_attn_doc.items():
    assert np.array_equal(allowed_by(flash_lib.naive_attention, *shape, causal=True), documented)
    assert np.array_equal(allowed_by(flash_lib.flash_attention, *shape, causal=True, block_q=2,
                                     block_k=1), documented)
assert np.all(out_ours[1] == 0) and lse_ours[1] == -np.inf
# float64 rounding of these rows is about 1e-16; a kernel off by one part in a million fails
assert error64 < 1e-12, error64

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
# # 15. Attention variants: grouped heads and masks as functions
#
# {doc}`Chapter 14 <14_variants>` put the window, the soft cap and ALiBi into one kernel. This
# chapter adds masks written as functions (`mask_mod`) and grouped-query heads, then
# FlexAttention, tested against PyTorch when it is installed. Every variant goes through chapter
# 14's two checks against its oracle, `notebooks/_oracle.py`.
#
# Sources as in chapter 14: attention-gym (`attn_gym/masks/`, commit `7fdb85d`), FlashAttention's
# `flash_attn_interface.py` (commit `0251105a`), PyTorch 2.13.0's
# `torch/nn/attention/flex_attention.py`.

# %%
import inspect
import warnings

import matplotlib.pyplot as plt
import numpy as np

from _oracle import ROUNDING, Checks, dense_attention, magnitude, worst
from flash_lib import (
    flash_attention,
    flash_attention_backward,
    measure_peak_bytes,
    naive_attention,
    naive_attention_backward,
    tile_schedule,
)

rng = np.random.default_rng(15)
checks = Checks()


# %% [markdown]
# ## Masks as functions
#
# `mask_mod(q_idx, k_idx)` is FlexAttention's `mask_mod` in NumPy form: it gets a tile's global
# positions as integer arrays of shapes `(tile_q, 1)` and `(1, tile_k)` and returns which pairs
# are allowed, ANDed with `mask`, `causal` and `window` (chapter 14); a tile where it allows
# nothing is never multiplied. It can say what a band cannot, and OR what `causal` would AND.
# Three masks over $N = 64$ tokens with 8 × 8 tiles, each also written out as a dense boolean
# matrix from its definition:
#
# - **document** masking, causal within each of four packed documents: `mask_mod` is
#   `doc[q_idx] == doc[k_idx]` (attention-gym's `generate_doc_mask_mod`), with `causal=True`;
# - **prefix-LM**: the first 20 tokens see each other, the rest is causal, attention-gym's
#   `or_masks(kv_idx < prefix_length, causal_mask)`. An OR, so all of it is in `mask_mod`;
# - **dilated** window: $|i - j| \le 16$ and $|i - j|$ divisible by 4 (attention-gym's
#   `generate_dilated_sliding_window(16, 4)`): `window=(16, 16)` for the band and `mask_mod` for
#   the dilation.
#
# With them, chapter 14's sliding window, `window=(12, 0)`. The cell checks that the tiles
# `tile_schedule` returns are exactly those holding an allowed pair; the drawing shades the
# allowed pairs under those tiles (outlined, numbered in visiting order) and hatches the rest.

# %%
N, BLOCK = 64, 8
i_idx, j_idx = np.arange(N)[:, None], np.arange(N)[None, :]
doc = np.repeat([0, 1, 2, 3], [10, 23, 6, 25])  # four packed documents
PREFIX = 20

masks = {
    "sliding window (12, 0)": (dict(window=(12, 0)), (i_idx - 12 <= j_idx) & (j_idx <= i_idx)),
    "document, causal": (dict(causal=True, mask_mod=lambda qi, ki: doc[qi] == doc[ki]),
                         (doc[i_idx] == doc[j_idx]) & (j_idx <= i_idx)),
    "prefix-LM (prefix 20)": (dict(mask_mod=lambda qi, ki: (ki < PREFIX) | (ki <= qi)),
                              (j_idx < PREFIX) | (j_idx <= i_idx)),
    "dilated (16, dilation 4)": (dict(window=(16, 16), mask_mod=lambda qi, ki: (qi - ki) % 4 == 0),
                                 (np.abs(i_idx - j_idx) <= 16) & ((i_idx - j_idx) % 4 == 0)),
}
every_tile = tile_schedule(N, N, BLOCK, BLOCK)
q, k, v = (rng.standard_normal((2, N, 16)) for _ in range(3))
schedules, holding = checks.run_masks(masks, N, BLOCK, q, k, v)
for name in masks:
    print(f"{name:<26} {len(schedules[name]):>2} of {len(every_tile)} tiles; tiles listed == "
          f"tiles holding an allowed pair: {schedules[name] == holding[name]}")


# %% tags=["hide-input"]
def draw_tile_map(ax, allowed, visited, title):
    ax.imshow(allowed, cmap=plt.matplotlib.colors.ListedColormap(["white", "#9ecae1"]),
              extent=(0, N, N, 0), interpolation="nearest", vmin=0, vmax=1)
    for t in every_tile:
        if t not in visited:
            ax.add_patch(plt.Rectangle((t[2], t[0]), t[3] - t[2], t[1] - t[0], facecolor="none",
                                       edgecolor="grey", hatch="xx", linewidth=0.4))
    for order, t in enumerate(visited):
        ax.add_patch(plt.Rectangle((t[2], t[0]), t[3] - t[2], t[1] - t[0], facecolor="none",
                                   edgecolor="black", linewidth=1.2))
        ax.text((t[2] + t[3]) / 2, (t[0] + t[1]) / 2, str(order), ha="center", va="center",
                fontsize=6)
    ax.set_xticks(range(0, N + 1, 16))
    ax.set_yticks(range(0, N + 1, 16))
    ax.set_xlabel("key index $j$")
    ax.set_title(f"{title}\n{len(visited)} of {len(every_tile)} tiles", fontsize=10)


# Two rows of three, the legend in the fifth place: four panels in one row would be drawn small
# in the page's column.
fig, axes = plt.subplots(2, 3, figsize=(11, 8.4))
for ax, (name, (keywords, allowed)) in zip(axes.flat, masks.items()):
    draw_tile_map(ax, allowed, schedules[name], name)
for ax in axes[:, 0]:
    ax.set_ylabel("query index $i$")
axes[1, 1].axis("off")
axes[1, 2].axis("off")
handles = [plt.Rectangle((0, 0), 1, 1, facecolor="#9ecae1"),
           plt.Rectangle((0, 0), 1, 1, facecolor="none", edgecolor="black"),
           plt.Rectangle((0, 0), 1, 1, facecolor="none", edgecolor="grey", hatch="xx")]
axes[1, 1].legend(handles, ["allowed pair", "tile multiplied\n(tile_schedule, in order)",
                            "tile skipped"], loc="center")
fig.suptitle(f"Four masks over N = {N}, {BLOCK} x {BLOCK} tiles: what flash_lib computes")
fig.tight_layout()
plt.show()

# %% [markdown]
# The dilated window skips no tile inside its band: every 8 × 8 tile there holds some pair at a
# distance divisible by 4. Skipping works on whole tiles, so a mask that is sparse *within*
# tiles saves nothing (FlexAttention's `BlockMask` says the same of its blocks, below).
#
# `mask_mod` is called per tile, and only for the tiles the band lets through. Recording the
# document mask's calls shows it: called on the tiles of the causal band, of which the kernel
# multiplies those where some pair is in one document.

# %%
calls = []


def recorded_document_mask(q_idx, k_idx):
    calls.append((int(q_idx[0, 0]), int(q_idx[-1, 0]) + 1, int(k_idx[0, 0]), int(k_idx[0, -1]) + 1))
    return doc[q_idx] == doc[k_idx]


flash_attention(q, k, v, causal=True, mask_mod=recorded_document_mask, block_q=BLOCK,
                block_k=BLOCK)
causal_band = tile_schedule(N, N, BLOCK, BLOCK, causal=True)
print(f"mask_mod called on {len(calls)} tiles, the {len(causal_band)} of the causal band: "
      f"{sorted(calls) == causal_band}; multiplied: {len(schedules['document, causal'])}")

# %% [markdown]
# ## Grouped-query attention
#
# Multi-query attention gives all query heads one key head and one value head; grouped-query
# attention, $H_{kv}$ of them, each shared by $H_q / H_{kv}$ consecutive query heads. Which heads
# share is a convention, and FlashAttention and PyTorch fix it the same way: "head 0, 1, 2 of Q
# will attention to head 0 of K, V, and head 3, 4, 5 of Q will attention to head 1 of K, V"
# (`flash_attn_func`'s docstring, for 6 and 2 heads); SDPA's `enable_gqa` repeats k and v with
# `repeat_interleave` (`torch/nn/functional.py`). Query head $h$ reads kv head
# $\lfloor h / (H_q/H_{kv}) \rfloor$. The other grouping, $h \bmod H_{kv}$ (`np.tile`,
# `Tensor.repeat`), is a real bug: ONNX's reference used `Tile` until onnx/onnx#7274.
#
# flash_lib's `enable_gqa=True` splits q's head axis into $(H_{kv}, \text{groups})$ and gives k
# and v a groups axis of length 1, so broadcasting pairs each query head with its kv head; the
# gradients of k and v are summed over each group. The cell checks against k and v repeated per
# query head with `np.repeat`, and that `np.tile`'s grouping gives something else.

# %%
h_q, h_kv = 6, 2
qg = rng.standard_normal((2, h_q, 24, 16))
kg, vg = rng.standard_normal((2, h_kv, 40, 16)), rng.standard_normal((2, h_kv, 40, 16))
k_rep, v_rep = np.repeat(kg, h_q // h_kv, axis=1), np.repeat(vg, h_q // h_kv, axis=1)
checks.run("gqa 6 / 2, causal", qg, kg, vg,
           dense_attention(qg, k_rep, v_rep, scale=0.25,
                           allowed=np.tril(np.ones((24, 40), bool), 16)),
           enable_gqa=True, causal=True)
checks.run("mqa 6 / 1", qg, kg[:, :1], vg[:, :1],
           dense_attention(qg, np.repeat(kg[:, :1], 6, axis=1), np.repeat(vg[:, :1], 6, axis=1),
                           scale=0.25), enable_gqa=True)
tiled_grouping = worst(flash_attention(qg, kg, vg, enable_gqa=True),
                       naive_attention(qg, np.tile(kg, (1, 3, 1, 1)), np.tile(vg, (1, 3, 1, 1))))
print(f"against the h mod Hkv grouping (np.tile): error {tiled_grouping:.1f}, a different answer")

dout_g = rng.standard_normal((2, h_q, 24, 16))
out_g, lse_g = flash_attention(qg, kg, vg, enable_gqa=True, causal=True, return_lse=True)
dq_g, dk_g, dv_g = flash_attention_backward(qg, kg, vg, out_g, lse_g, dout_g, enable_gqa=True,
                                            causal=True)
dq_r, dk_r, dv_r = naive_attention_backward(qg, k_rep, v_rep, dout_g, causal=True)
gqa_grad_error = max(worst(dq_g, dq_r), worst(dk_g, dk_r.reshape(2, h_kv, 3, 40, 16).sum(axis=2)),
                     worst(dv_g, dv_r.reshape(2, h_kv, 3, 40, 16).sum(axis=2)))
print(f"gradients: dk, dv of shape {dk_g.shape} (Hkv heads), against the repeated heads' gradients "
      f"summed over each group: {magnitude(gqa_grad_error)}")

# %% [markdown]
# ### What it saves
#
# The keys and values are what a decoder keeps for every past token (its KV cache) and what an
# attention kernel streams through its memory: $2 \cdot H_{kv} \cdot N \cdot d$ numbers per layer and
# sequence. For $H_q = 32$ query heads of $d = 128$ over $N = 8192$ tokens in bfloat16
# (2 bytes each), they take:

# %%
H_Q, D_HEAD, TOKENS, BYTES = 32, 128, 8192, 2
kv_heads = [32, 16, 8, 4, 2, 1]
kv_bytes = {h: 2 * h * TOKENS * D_HEAD * BYTES for h in kv_heads}
print("  Hkv   query heads per kv head   K and V per layer")
for h in kv_heads:
    kind = "  (multi-head)" if h == H_Q else "  (multi-query)" if h == 1 else ""
    print(f"{h:>5}   {H_Q // h:>23}   {kv_bytes[h] / 2**20:>10.0f} MiB{kind}")

# %% tags=["hide-input"]
fig, ax = plt.subplots(figsize=(6, 3.6))
ax.bar([str(h) for h in kv_heads], [kv_bytes[h] / 2**20 for h in kv_heads])
ax.set_xlabel("kv heads $H_{kv}$ (query heads $H_q$ = 32)")
ax.set_ylabel("K and V bytes per layer (MiB)")
ax.set_title(f"K/V memory, N = {TOKENS}, d = {D_HEAD}, bfloat16")
fig.tight_layout()
plt.show()

# %% [markdown]
# The saving is only real if the kernel never expands k and v to $H_q$ heads. Measured with
# `measure_peak_bytes` (tracemalloc): 16 query heads over one kv head, one block of 128 queries
# (so one worker thread and a reproducible peak) against 2048 and 8192 keys, float32. The
# kernel's scratch (its peak minus the returned output) stays flat as the keys grow; the copy
# that `np.repeat` would make grows with them.

# %%
scratch, copies, repeat_scratch = {}, {}, {}
for n_keys in (2048, 8192):
    qm = rng.standard_normal((16, 128, 64)).astype(np.float32)
    km, vm = (rng.standard_normal((1, n_keys, 64)).astype(np.float32) for _ in range(2))
    out, peak = measure_peak_bytes(flash_attention, qm, km, vm, enable_gqa=True, block_q=128,
                                   block_k=128)
    scratch[n_keys] = peak - out.nbytes
    copies[n_keys] = 16 * (km.nbytes + vm.nbytes)  # k and v repeated per query head
    out, peak = measure_peak_bytes(lambda: flash_attention(qm, np.repeat(km, 16, 0),
                                                           np.repeat(vm, 16, 0), block_q=128,
                                                           block_k=128))
    repeat_scratch[n_keys] = peak - out.nbytes
for n_keys in scratch:
    print(f"Nk = {n_keys}: scratch with enable_gqa {scratch[n_keys] / 2**20:.0f} MiB; "
          f"with k, v repeated first {repeat_scratch[n_keys] / 2**20:.0f} MiB "
          f"(the copy alone: {copies[n_keys] / 2**20:.0f} MiB)")

# %% [markdown]
# ## FlexAttention
#
# PyTorch's FlexAttention expresses variants as two functions and a block map
# (`torch/nn/attention/flex_attention.py`):
#
# | FlexAttention | flash_lib |
# |---|---|
# | `score_mod(score, b, h, q_idx, kv_idx)`, on the scaled score | two fixed score mods: `softcap=` (attention-gym's `generate_tanh_softcap`: `soft_cap * tanh(score / soft_cap)`) and `alibi_slopes=` (`generate_alibi_bias`) |
# | `mask_mod(b, h, q_idx, kv_idx)`, True = participates | `mask_mod(q_idx, k_idx)`, one call per tile with index arrays; batch and head enter as leading dims of its result |
# | `create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE=128)` → `BlockMask` | `tile_schedule(..., window=, mask_mod=)`; the band from its corners, `mask_mod` evaluated tile by tile as the kernel runs |
# | `BlockMask`'s `kv_num_blocks`/`kv_indices` (partial) and `full_kv_*` (full blocks) | a tile is skipped, masked (`_allowed` returns an array) or full (`_allowed` returns None) |
# | sliding window, causal: mask mods (`and_masks`, attention-gym) | `window=(left, right)` and `causal=` keywords |
# | `enable_gqa=True` | `enable_gqa=True` |
#
# `create_block_mask` evaluates `mask_mod` on every pair (`create_mask` builds the dense
# `B × H × Q_LEN × KV_LEN` boolean tensor), pads it to multiples of the block size and sums each
# block (`_convert_mask_to_block_mask`): sum 0 is an empty block, skipped; the full
# `Q_BLOCK_SIZE * KV_BLOCK_SIZE` a full block, computed without calling `mask_mod`; anything in
# between a partial block. Its default block is `_DEFAULT_SPARSE_BLOCK_SIZE = 128`. flash_lib
# never builds that dense mask: it calls `mask_mod` on one tile at a time, inside the kernel.
#
# The next cell compares, for three masks over 1024 tokens, `create_block_mask(...,
# BLOCK_SIZE=128)`'s blocks and full blocks with `tile_schedule`'s tiles and the all-allowed
# tiles, and eager `flex_attention` (PyTorch's reference) with a softcap-and-ALiBi `score_mod`
# and a document `BlockMask` with `flash_attention`. It prints flash_lib's side, the same on
# every machine, and where PyTorch is installed asserts the agreement, so that a disagreement
# fails the notebook's test; the cell after it shows what was measured.

# %%
try:
    import torch
    import torch.nn.attention.flex_attention as flex_module
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:
    torch = None

NF, FB = 1024, 128
docs_f = np.repeat(np.arange(5), [300, 124, 200, 257, 143])
qf, kf = np.arange(NF)[:, None], np.arange(NF)[None, :]
flex_masks = {  # name: (FlexAttention mask_mod, flash_lib keywords, the dense mask)
    "document, causal": (lambda b, h, qi, ki: (docs_t[qi] == docs_t[ki]) & (qi >= ki),
                         dict(causal=True, mask_mod=lambda qi, ki: docs_f[qi] == docs_f[ki]),
                         (docs_f[qf] == docs_f[kf]) & (kf <= qf)),
    "prefix-LM (prefix 300)": (lambda b, h, qi, ki: (ki < 300) | (qi >= ki),
                               dict(mask_mod=lambda qi, ki: (ki < 300) | (ki <= qi)),
                               (kf < 300) | (kf <= qf)),
    "sliding window (200, 0)": (lambda b, h, qi, ki: (qi - ki <= 200) & (qi >= ki),
                                dict(window=(200, 0)), (qf - kf <= 200) & (kf <= qf)),
}
block_agreement = {}
for name, (mod, keywords, dense) in flex_masks.items():
    our_blocks = np.zeros((NF // FB, NF // FB), bool)
    for q0, _, k0, _ in tile_schedule(NF, NF, FB, FB, **keywords):
        our_blocks[q0 // FB, k0 // FB] = True
    tiles_all = dense.reshape(NF // FB, FB, NF // FB, FB).all(axis=(1, 3))
    print(f"{name:<24} tile_schedule: {int(our_blocks.sum())} of {our_blocks.size} tiles, "
          f"{int(tiles_all.sum())} of them with every pair allowed")
    if torch is not None:
        docs_t = torch.from_numpy(docs_f)
        block_mask = create_block_mask(mod, 1, 1, NF, NF, device="cpu", BLOCK_SIZE=FB)
        flex_blocks = block_mask.to_dense()[0, 0].numpy().astype(bool)
        full = np.zeros_like(our_blocks)
        counts = block_mask.full_kv_num_blocks[0, 0]
        for r in range(NF // FB):
            full[r, block_mask.full_kv_indices[0, 0, r, : counts[r]].numpy()] = True
        block_agreement[name] = (np.array_equal(flex_blocks, our_blocks),
                                 np.array_equal(full, tiles_all))
        assert all(block_agreement[name]), (name, block_agreement[name])

NS, HF, SOFTCAP = 256, 4, 20.0
docs_s = np.repeat([0, 1, 2], [100, 60, 96])
slopes_f = 2.0 ** (-8 * (np.arange(HF) + 1) / HF)
qs, ks, vs = (rng.standard_normal((1, HF, NS, 16)) for _ in range(3))
ours_out = flash_attention(qs, ks, vs, softcap=SOFTCAP, alibi_slopes=slopes_f, causal=True,
                           mask_mod=lambda qi, ki: docs_s[qi] == docs_s[ki], block_q=64, block_k=64)
if torch is not None:
    docs_st, slopes_t = torch.from_numpy(docs_s), torch.from_numpy(slopes_f)

    def score_mod(score, b, h, q_idx, kv_idx):  # attention-gym's softcap, then its ALiBi
        return SOFTCAP * torch.tanh(score / SOFTCAP) + (kv_idx - q_idx) * slopes_t[h]

    doc_block_mask = create_block_mask(
        lambda b, h, qi, ki: (docs_st[qi] == docs_st[ki]) & (qi >= ki), None, None, NS, NS,
        device="cpu")
    with warnings.catch_warnings():  # eager FlexAttention warns that it is not compiled
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        flex_out = flex_attention(*(torch.from_numpy(x) for x in (qs, ks, vs)),
                                  score_mod=score_mod, block_mask=doc_block_mask).numpy()
    flex_error = worst(ours_out, flex_out)
    default_block = (flex_module._DEFAULT_SPARSE_BLOCK_SIZE,
                     inspect.signature(create_block_mask).parameters["BLOCK_SIZE"].default)
    # the same operations in float64 in another order: rounding over 256 keys, far below 1e-12;
    # a kernel off by one part in a million is far above
    assert flex_error < 1e-12 and default_block == (128, 128), (flex_error, default_block)

# %% tags=["nbval-ignore-output"]
if torch is None:
    print("PyTorch is not installed: the FlexAttention comparison above was skipped.")
else:
    print(f"PyTorch {torch.__version__}: BlockMask's blocks == tile_schedule's tiles and full "
          f"blocks == all-allowed tiles, for each mask: {block_agreement}")
    print(f"create_block_mask's default BLOCK_SIZE: {default_block[1]} "
          f"(_DEFAULT_SPARSE_BLOCK_SIZE = {default_block[0]})")
    print(f"flex_attention (softcap + attention-gym ALiBi, document BlockMask) against "
          f"flash_attention: {flex_error:.1e}")

# %% [markdown]
# ## What we showed
#
# - `tile_schedule` lists exactly the tiles holding an allowed pair for masks written as
#   `mask_mod`, which is called only inside the band.
# - GQA pairs query head $h$ with kv head $\lfloor h / (H_q/H_{kv}) \rfloor$ (`np.repeat`, not
#   `np.tile`), forward and backward, without copying k and v; every check to below $10^{-14}$
#   (drawn in
#   {doc}`the appendix on how this tutorial is tested <28_how_chapters_7_to_23_are_tested>`).
# - FlexAttention's `BlockMask` marks the same tiles as flash_lib, and `flex_attention` gives
#   flash_lib's output to below $10^{-12}$ (asserted where PyTorch is installed).

# %%
# ROUNDING: see _oracle.py. naive and the dense construction normalise in different orders, so
# they agree to rounding, not bit for bit.
for name, (e_flash, e_dense) in checks.items():
    assert e_flash < ROUNDING and e_dense < ROUNDING, (name, e_flash, e_dense)
for name in masks:
    assert schedules[name] == holding[name], name
assert len(schedules["dilated (16, dilation 4)"]) == len(tile_schedule(N, N, BLOCK, BLOCK,
                                                                       window=(16, 16)))
assert len(schedules["document, causal"]) < len(causal_band)
assert sorted(calls) == causal_band
assert tiled_grouping > 0.1 and gqa_grad_error < ROUNDING
assert scratch[8192] < 1.25 * scratch[2048]  # flat in Nk
assert scratch[8192] < copies[8192] / 4  # no per-head copy of k and v
assert repeat_scratch[8192] >= copies[8192]  # the copy, measured

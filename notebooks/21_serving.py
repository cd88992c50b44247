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
# # 21. Serving: ragged batches and the KV cache
#
# Training sees batches of sequences cut to one length. Serving does not: requests arrive with
# prompts of every length, and each is then extended one token at a time. Two interfaces of
# FlashAttention exist for this, and `flash_serving` (a module beside `flash_lib`, built only on
# its public kernels) implements both exactly:
#
# - `flash_attention_varlen`, FlashAttention's `flash_attn_varlen_func`: the sequences of a batch
#   are packed end to end, and `cu_seqlens` says where each begins. We measure what packing saves
#   over padding (tiles and time), and draw the tiles of a packed batch;
# - `flash_attention_with_kvcache`, FlashAttention's `flash_attn_with_kvcache`: the new queries
#   attend over a cache of every earlier key and value. Decoding one token is attention with
#   $N_q = 1$, which flash-decoding computes by splitting the keys and merging the parts with
#   chapter 3's formula. The cache may be paged, as in vLLM; we draw a page table, share a prompt's
#   pages between two requests, and weigh a cache's memory against its fragmentation;
# - a small greedy generation loop on the cache, which must produce exactly the tokens of
#   recomputing the whole sequence at every step.

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

import flash_lib
import flash_serving
from flash_lib import rowwise_relative_error

rng = np.random.default_rng(18)
EPS = np.finfo(np.float64).eps


def within_rule(out, q, k, v, **kw):
    """Chapter 23's rule: error <= 2 x naive's error (both against precise) + 8 eps."""
    truth = flash_lib.precise_attention(q, k, v, **kw)
    naive = flash_lib.naive_attention(q, k, v, **kw)
    err = rowwise_relative_error(out, truth).max(initial=0)
    bound = 2 * rowwise_relative_error(naive, truth).max(initial=0) + 8 * EPS
    return bool(err <= bound)


# %% [markdown]
# ## Padding against packing
#
# A batch of one long sequence and sixteen short ones, lengths $(1024, 32 \times 16)$. The padded
# batch makes every sequence as long as the longest, $17 \times 1024$ tokens, and masks the padding
# keys; the packed one lays the 1536 real tokens end to end and gives their boundaries,
# `cu_seqlens = [0, 1024, 1056, …, 1536]`. Each sequence attends only itself in both.

# %%
lengths = (1024,) + (32,) * 16
d, block = 64, 128
cu = np.concatenate([[0], np.cumsum(lengths)])
total, n_max = int(cu[-1]), max(lengths)
q, k, v = (rng.standard_normal((total, d)) for _ in range(3))
padded = np.zeros((3, len(lengths), n_max, d))
for b, (start, n) in enumerate(zip(cu[:-1], lengths)):
    for x, src in zip(padded, (q, k, v)):
        x[b, :n] = src[start:start + n]
key_mask = np.arange(n_max)[None, None, :] < np.array(lengths)[:, None, None]  # (B, 1, N)


def run_packed():
    return flash_serving.flash_attention_varlen(q, k, v, cu, cu, block_q=block, block_k=block)


def run_padded():
    return flash_lib.flash_attention(*padded, mask=key_mask, block_q=block, block_k=block)


out_packed, out_padded = run_packed(), run_padded()
same = np.concatenate([out_padded[b, :n] for b, n in enumerate(lengths)])
tiles_packed = len(flash_serving.varlen_tile_schedule(cu, cu, block, block))
tiles_alone = sum(len(flash_lib.tile_schedule(n, n, block, block)) for n in lengths)
tiles_padded = len(lengths) * len(flash_lib.tile_schedule(n_max, n_max, block, block))
print(f"tokens: packed {total}, padded {len(lengths) * n_max}")
print(f"tiles of {block} x {block}: packed {tiles_packed} (the sequences one by one: "
      f"{tiles_alone}), padded {tiles_padded}: {tiles_padded / tiles_packed:.1f}x as many")
print("packed and padded agree on the real rows (chapter 23's rule):",
      within_rule(out_packed[:n_max], q[:n_max], k[:n_max], v[:n_max])
      and bool(rowwise_relative_error(out_packed, same).max() <= 16 * EPS))

# %% [markdown]
# The tiles are counted, not measured: $8^2 = 64$ tiles for the long sequence and one for each
# short one, against 64 for every row of the padded batch. The time is measured, side by side
# on this machine, and drawn rather than printed: it changes from run to run.

# %%
def best_of(fn, rounds=3):
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


t_packed, t_padded = best_of(run_packed), best_of(run_padded)
fig, (ax_tiles, ax_time) = plt.subplots(1, 2, figsize=(9, 3.6))
for ax, values, label, fmt in ((ax_tiles, (tiles_packed, tiles_padded), "tiles computed", "{:.0f}"),
                               (ax_time, (1e3 * t_packed, 1e3 * t_padded), "time (ms, best of 3)",
                                "{:.0f} ms")):
    bars = ax.bar(["packed (varlen)", "padded + key mask"], values, color=["tab:blue", "tab:gray"])
    ax.bar_label(bars, [fmt.format(x) for x in values])
    ax.set(ylabel=label, title=label)
fig.suptitle(f"Lengths (1024, 32 x 16), d = 64, float64, 128 x 128 tiles: padding costs "
             f"{tiles_padded / tiles_packed:.1f}x the tiles and {t_padded / t_packed:.1f}x the "
             f"time here", fontsize=10)
plt.tight_layout()
plt.show()

# %% [markdown]
# The time follows the tiles, and then some: a padded tile holds masked keys, so it takes the
# masked path (chapter 6), where a packed tile never needs a mask. `bench/bench_flash.py` measures
# the same comparison at lengths $(4096, 64 \times 16)$ with 512-wide tiles; its targets ask for
# at most 1.1x the tiles of the sequences alone and at least 3x the speed of the padded batch.
#
# ## The tile map of a packed batch
#
# A document mask over the packed tokens (chapter 15's `mask_mod`) gives the same answer, but its
# tiles are cut from the packed $N \times N$ square, so a tile that straddles a boundary is
# computed with a mask, and every tile of the square is at least asked whether it holds a pair.
# Varlen cuts each sequence's own square into tiles, starting at the sequence's first token: no
# tile is shared by two sequences, and nothing outside the squares is looked at.

# %%
small = (90, 30, 140, 12, 60)
cu_small = np.concatenate([[0], np.cumsum(small)])
n_small, bs = int(cu_small[-1]), 32
doc = np.repeat(np.arange(len(small)), small)


def same_document(q_idx, k_idx):
    return doc[q_idx] == doc[k_idx]


varlen_tiles = flash_serving.varlen_tile_schedule(cu_small, cu_small, bs, bs, causal=True)
doc_tiles = flash_lib.tile_schedule(n_small, n_small, bs, bs, True, mask_mod=same_document)
straddling = sum(doc[t[0]] != doc[t[1] - 1] or doc[t[2]] != doc[t[3] - 1] for t in doc_tiles)
n_blocks = -(-n_small // bs)
print(f"{len(small)} sequences, {n_small} tokens, tiles of {bs}, causal")
print(f"document mask: {len(doc_tiles)} tiles of the {n_blocks}x{n_blocks} square, "
      f"{straddling} of them across a boundary")
print(f"varlen: {len(varlen_tiles)} tiles, each inside one sequence")

fig, axes = plt.subplots(1, 2, figsize=(11, 5.2), sharey=True)
colors = plt.cm.tab10(np.arange(len(small)))
for ax, tiles, title in ((axes[0], doc_tiles, "document mask (mask_mod): tiles of the packed square"),
                         (axes[1], varlen_tiles, "varlen: tiles of each sequence's square")):
    for q0, q1, k0, k1 in tiles:
        owner = doc[q0] if doc[q0] == doc[q1 - 1] == doc[k0] == doc[k1 - 1] else None
        ax.add_patch(Rectangle((k0, q0), k1 - k0, q1 - q0, edgecolor="black", linewidth=0.6,
                               facecolor="lightgray" if owner is None else colors[owner],
                               alpha=0.8))
    for start, stop in zip(cu_small[:-1], cu_small[1:]):  # the squares that may attend
        ax.add_patch(Rectangle((start, start), stop - start, stop - start, fill=False,
                               edgecolor="red", linewidth=1.5))
    ax.set(xlim=(0, n_small), ylim=(n_small, 0), aspect="equal", title=title,
           xlabel="key position in the packed batch")
axes[0].set_ylabel("query position in the packed batch")
fig.suptitle("Tiles computed for 5 packed sequences (causal, 32 x 32 tiles; red: each sequence's "
             "square; gray: a tile across a boundary)", fontsize=10)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Decoding: split-KV with one query
#
# At each step of generation the model has one new token per sequence: one query against every
# key so far, a single query block, so a kernel that parallelises over query blocks runs on one
# worker. Flash-decoding splits the *keys* instead, into chunks attended independently and
# merged exactly ({doc}`chapter 3 <03_merging_states>`). `flash_attention_with_kvcache` walks the
# valid keys in chunks of `KV_CHUNK` this way, each gathered into a buffer of its own: the
# scratch is a chunk, whatever the cache's length. The last chunk goes with the queries, where
# flash_lib's own bottom-right alignment is the cache's.
# Below, one query over caches of 2,048 to 32,768 keys, against gathering the whole valid cache
# first and calling `flash_attention` once (the natural first version, which FlashAttention's
# paged kernels avoid).

# %%
def gather_then_attend(q, k_cache, v_cache, n):
    return flash_lib.flash_attention(q[0], k_cache[0, :, :n].copy(), v_cache[0, :, :n].copy(),
                                     causal=True)


sizes = (2048, 8192, 32768)
scratch, scratch_gather, checks = {}, {}, []
for n in sizes:
    kc, vc = rng.standard_normal((2, 1, 2, n, d))  # (B = 1, Hkv = 2, max_len = n, d)
    qd = rng.standard_normal((1, 2, 1, d))
    out, peak = flash_lib.measure_peak_bytes(flash_serving.flash_attention_with_kvcache, qd, kc,
                                             vc, cache_seqlens=np.array([n]), causal=True)
    scratch[n] = peak - out.nbytes
    ref, peak = flash_lib.measure_peak_bytes(gather_then_attend, qd, kc, vc, n)
    scratch_gather[n] = peak - ref.nbytes
    checks.append(within_rule(out[0], qd[0], kc[0], vc[0], causal=True))
chunk_bytes = 2 * 2 * flash_serving.KV_CHUNK * d * 8  # keys and values of one chunk, 2 heads
print(f"KV_CHUNK = {flash_serving.KV_CHUNK} keys: {32768 // flash_serving.KV_CHUNK} chunks at "
      f"L = 32768, against 1 query block")
print("every size within chapter 23's rule of dense attention:", all(checks))
print(f"split-KV scratch below 3 chunks ({3 * chunk_bytes // 1024} KiB) at every L:",
      all(s < 3 * chunk_bytes for s in scratch.values()))
print(f"gathering first holds the valid cache: {2 * 2 * 32768 * d * 8 // 2**20} MiB at "
      f"L = 32768, and measured above it:", scratch_gather[32768] >= 2 * 2 * 32768 * d * 8)

fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(sizes, [scratch[n] / 2**20 for n in sizes], "o-", label="flash_attention_with_kvcache "
        "(split-KV chunks)")
ax.plot(sizes, [scratch_gather[n] / 2**20 for n in sizes], "s--",
        label="gather the whole cache, then flash_attention")
ax.set(xscale="log", yscale="log", xlabel="valid keys in the cache L", ylabel="scratch (MiB)",
       title="Decoding one query (2 heads, d = 64, float64): scratch, measured by tracemalloc")
ax.minorticks_off()
ax.set_xticks(sizes, [str(n) for n in sizes])
ax.set_yticks([1, 2, 4, 8, 16, 32, 64], ["1", "2", "4", "8", "16", "32", "64"])
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## A paged cache
#
# A contiguous cache reserves `max_len` slots for every sequence, used or not. vLLM's paged
# cache (Kwon et al., 2023) cuts the memory into pages of a few slots; each sequence has a page
# table, `block_table[b]`, listing its pages in order, and logical key $t$ of sequence $b$ lives
# in slot $t \bmod P$ of page `block_table[b, t // P]`. Pages are handed out as sequences grow, so
# they end up anywhere. Below, three sequences in a pool of 14 pages of $P = 16$ slots; the first
# two began with the same 40-token prompt, whose two full pages they share (one copy in
# memory); the third page of the prompt is partly theirs and partly each one's own, so each has
# its own copy of it.

# %%
P, n_pages, h = 16, 14, 2
seq_lens = np.array([71, 52, 30])
pool_k = np.full((n_pages, h, P, d), np.nan)  # unused slots and pages hold NaN: never read
pool_v = np.full((n_pages, h, P, d), np.nan)
order = rng.permutation(n_pages)
table = np.full((3, 5), -1)  # -1: no page yet (never read)
table[0, :5] = order[:5]
table[1, :2] = table[0, :2]  # the shared prompt's two full pages
table[1, 2:4] = order[5:7]
table[2, :2] = order[7:9]
prompt_k, prompt_v = rng.standard_normal((2, h, 40, d))
contiguous = np.full((2, 3, h, 80, d), np.nan)  # the same keys in a contiguous cache
for b, n in enumerate(seq_lens):
    keys, values = rng.standard_normal((2, h, n, d))
    if b < 2:
        keys[:, :40], values[:, :40] = prompt_k, prompt_v
    contiguous[0, b, :, :n], contiguous[1, b, :, :n] = keys, values
    for t0 in range(0, n, P):
        page = table[b, t0 // P]
        pool_k[page, :, :min(P, n - t0)] = keys[:, t0:t0 + P]
        pool_v[page, :, :min(P, n - t0)] = values[:, t0:t0 + P]

q_step = rng.standard_normal((3, h, 1, d))
paged_out = flash_serving.flash_attention_with_kvcache(
    q_step, pool_k, pool_v, cache_seqlens=seq_lens, block_table=table, causal=True)
flat_out = flash_serving.flash_attention_with_kvcache(
    q_step, contiguous[0], contiguous[1], cache_seqlens=seq_lens, causal=True)
used = len(np.unique(table[table >= 0]))
print(f"pages in use: {used} of {n_pages}, for {seq_lens.sum()} keys of which 2 x 32 are the "
      f"shared pages' (unshared: {sum(-(-n // P) for n in seq_lens)} pages)")
print("paged equals contiguous, bit for bit:", np.array_equal(paged_out, flat_out))
print("finite although NaN fills every unused slot and page:", bool(np.isfinite(paged_out).all()))
print("each within chapter 23's rule of dense attention on its keys:",
      all(within_rule(paged_out[b], q_step[b], contiguous[0, b, :, :n], contiguous[1, b, :, :n],
                      causal=True) for b, n in enumerate(seq_lens)))

fig, (ax_t, ax_p) = plt.subplots(2, 1, figsize=(10, 4.8), gridspec_kw={"height_ratios": [3, 1.3]})
owner = {}
for b in range(3):
    for i in range(table.shape[1]):
        page = table[b, i]
        if page < 0:
            continue
        owner.setdefault(int(page), set()).add(b)
        filled = min(P, seq_lens[b] - i * P)
        shared = b < 2 and i < 2
        ax_t.add_patch(Rectangle((i, b), 1, 1, facecolor="gold" if shared else colors[b],
                                 alpha=0.35 + 0.5 * filled / P, edgecolor="black",
                                 hatch="//" if shared else None))
        ax_t.text(i + 0.5, b + 0.5, f"page {page}\n{filled}/{P} slots", ha="center", va="center",
                  fontsize=8)
ax_t.set(xlim=(0, table.shape[1]), ylim=(3, 0), xlabel="logical page t // 16",
         yticks=[0.5, 1.5, 2.5], yticklabels=[f"sequence {b} (L = {n})" for b, n in
                                              enumerate(seq_lens)],
         title="block_table: each sequence's pages in logical order (logical pages 0-1 of sequences 0 "
               "and 1 are the same physical pages)")
for page in range(n_pages):
    users = owner.get(page, set())
    face = ("white" if not users else "gold" if len(users) > 1 else colors[min(users)])
    ax_p.add_patch(Rectangle((page, 0), 1, 1, facecolor=face, edgecolor="black",
                             hatch="//" if len(users) > 1 else None))
    ax_p.text(page + 0.5, 0.5, str(page), ha="center", va="center", fontsize=8)
ax_p.set(xlim=(0, n_pages), ylim=(0, 1), yticks=[], xticks=[],
         title="the pool of physical pages (white: free; gold, hatched: shared by sequences 0 "
               "and 1)")
plt.tight_layout()
plt.show()

# %% [markdown]
# Paged and contiguous give the same bits because the same buffers reach the same calls: each
# chunk of keys is copied into a buffer of its own from wherever its slots lie, and the arithmetic
# never sees the layout. The page order, the shared pages and the NaN in the free pages change
# nothing, because nothing past `cache_seqlens` is read.
#
# ## Memory against fragmentation
#
# A contiguous cache must reserve the longest length it will allow for every sequence; a paged
# one loses only the unused end of each sequence's last page. For a batch of 64 requests of
# random lengths up to 4096 tokens (one layer, 8 kv heads, d = 128, float16: 4 KiB per token for
# keys and values), the reserved memory against what the tokens use:

# %%
req = rng.integers(1, 4097, size=64)
per_token = 2 * 8 * 128 * 2  # keys and values, 8 heads, d = 128, 2 bytes
used_bytes = int(req.sum()) * per_token
print(f"{len(req)} requests, {int(req.sum())} tokens: {used_bytes / 2**20:.1f} MiB of keys "
      f"and values")
print(f"{'cache':>22} {'reserved MiB':>13} {'wasted':>8}")
rows = [("contiguous, 4096 each", 64 * 4096 * per_token)]
for page in (16, 64, 256, 1024):
    rows.append((f"paged, {page}-slot pages", int(sum(-(-n // page) * page for n in req)) * per_token))
for name, reserved in rows:
    print(f"{name:>22} {reserved / 2**20:>13.1f} {100 * (reserved - used_bytes) / reserved:>7.1f}%")

# %% [markdown]
# Small pages waste little (less than a page per sequence) but make the table long and each
# gather short; FlashAttention's paged kernels take pages of a multiple of 256 slots, vLLM's
# default is 16. Sharing a prompt's pages between requests, as above, saves more than the
# fragmentation costs whenever many requests begin alike.
#
# ## Generating with the cache
#
# A toy model, one attention layer with two heads between an embedding and an unembedding, and
# greedy decoding: the prompt is written into the cache and attended in one call (prefill, causal
# over $N_q = N_{\mathrm{new}}$ new keys), then each step feeds the chosen token, appends its key
# and value (`k_new`, `v_new`, written in place into a paged cache whose pages are handed out
# in a shuffled order), and attends over the cache. The check is recomputation: at every step,
# the whole sequence so far through `flash_attention` with causal, no cache.

# %%
vocab, h, dm, P = 64, 2, 16, 8
emb = rng.standard_normal((vocab, h, dm))
w_k, w_v = rng.standard_normal((2, h, dm, dm)) / 4
unemb = rng.standard_normal((h * dm, vocab))


def logits_of(attn):  # attn (h, n, dm) -> (n, vocab)
    return attn.transpose(1, 0, 2).reshape(attn.shape[1], -1) @ unemb


prompt = [5, 17, 42, 8, 33, 1, 29]
steps = 24
pages = rng.permutation(8)  # 8 pages of 8 slots: 64 positions
cache_k = np.full((8, h, P, dm), np.nan)
cache_v = np.full((8, h, P, dm), np.nan)
block_table = pages[None, :]
x = emb[prompt].transpose(1, 0, 2)[None]  # (B = 1, h, n, dm)
attn = flash_serving.flash_attention_with_kvcache(
    x, cache_k, cache_v, cache_seqlens=np.array([0]), k_new=x @ w_k, v_new=x @ w_v,
    block_table=block_table, causal=True)
tokens, length, gaps, errors, agree = list(prompt), len(prompt), [], [], []
for _ in range(steps):
    logit = logits_of(attn[0])[-1]
    top2 = np.sort(logit)[-2:]
    gaps.append(top2[1] - top2[0])
    tokens.append(int(np.argmax(logit)))
    # recomputation: the whole sequence so far, no cache
    xs = emb[tokens[:-1]].transpose(1, 0, 2)
    full = flash_lib.flash_attention(xs, xs @ w_k, xs @ w_v, causal=True)
    errors.append(rowwise_relative_error(attn[0][:, -1], full[:, -1]).max())
    agree.append(int(np.argmax(logits_of(full)[-1])) == tokens[-1])
    x = emb[tokens[-1:]].transpose(1, 0, 2)[None]
    attn = flash_serving.flash_attention_with_kvcache(
        x, cache_k, cache_v, cache_seqlens=np.array([length]), k_new=x @ w_k, v_new=x @ w_v,
        block_table=block_table, causal=True)
    length += 1
print("generated:", tokens[len(prompt):])
print(f"{steps} tokens, each the argmax of recomputation too:", all(agree))
print("cache and recomputation agree within 64 eps at every step:", max(errors) <= 64 * EPS)
print(f"smallest gap between the two best logits: {min(gaps):.2f} (a difference of 64 eps in "
      f"the attention cannot close it)")

# %% [markdown]
# The tokens are exactly those of recomputation; the attention outputs agree to rounding (the
# cache merges its chunks where recomputation runs one tiled pass), which the smallest gap between
# the two best logits, orders of magnitude wider, cannot notice. The cache turns the
# $O(n^2)$ work of recomputing every step into $O(n)$ per step.
#
# ## What to take away
#
# - Packing a ragged batch end to end costs exactly the tiles of its sequences; padding costs
#   the tiles of the longest, for every sequence, and masks them.
# - Decoding is split-KV with one query: chunks of keys attended independently and merged with
#   chapter 3's formula, so the scratch stays a chunk however long the cache grows.
# - A paged cache is a page table in front of a pool: any order, shared prefixes, unused slots
#   never read, and, done as here, the bits of the contiguous cache.

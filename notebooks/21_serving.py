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
# Training sees batches cut to one length. Serving does not: prompts come in every length, and
# each sequence then grows one token at a time. `flash_serving` (beside `flash_lib`, built on its
# public kernels only) implements FlashAttention's two interfaces for this, exactly:
#
# - `flash_attention_varlen` (FlashAttention's `flash_attn_varlen_func`): the sequences packed end
#   to end, `cu_seqlens` saying where each begins;
# - `flash_attention_with_kvcache` (`flash_attn_with_kvcache`): new queries against a cache of
#   every earlier key and value, contiguous or paged as in vLLM; decoding one token is split-KV
#   with $N_q = 1$.
#
# Both take chapter 18's attention sinks (`sinks=`; a split decode merges the sink into each row
# once, not once per chunk), and the packed batch chapter 17's dropout (`dropout_p=`,
# `dropout_seed=`, each sequence's mask drawn at its packed positions).

# %%
import inspect

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

import flash_lib
import flash_serving
from flash_bench import best_times
from flash_lib import rowwise_relative_error

rng = np.random.default_rng(18)
EPS = np.finfo(np.float64).eps


def within_rule(out, q, k, v, **kw):
    """Chapter 23's bound (chapter 7's rule): error <= 2 x naive's error, both against
    precise_attention, + 8 eps."""
    truth = flash_lib.precise_attention(q, k, v, **kw)
    naive = flash_lib.naive_attention(q, k, v, **kw)
    err = rowwise_relative_error(out, truth).max(initial=0)
    return bool(err <= 2 * rowwise_relative_error(naive, truth).max(initial=0) + 8 * EPS)


# %% [markdown]
# ## Padding against packing
#
# One long sequence and sixteen short ones, lengths $(1024, 32 \times 16)$. Padded, every
# sequence is as long as the longest, $17 \times 1024$ tokens, the padding keys masked; packed,
# the 1536 real tokens lie end to end, `cu_seqlens = [0, 1024, 1056, …, 1536]`. With 128 × 128
# tiles the packed batch costs its sequences' tiles, $8^2$ for the long one and one for each
# short one, 80; the padded batch $8^2$ for each of its 17 rows, 1088. Packed, each sequence is
# one `flash_attention` call on its own slices, its rows that call's bit for bit.

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
alone = [flash_lib.flash_attention(q[a:b], k[a:b], v[a:b], block_q=block, block_k=block)
         for a, b in zip(cu[:-1], cu[1:])]
packed_is_alone = all(np.array_equal(out_packed[a:b], o) for a, b, o in zip(cu[:-1], cu[1:], alone))
padded_rows = np.concatenate([out_padded[b, :n] for b, n in enumerate(lengths)])
tiles_packed = len(flash_serving.varlen_tile_schedule(cu, cu, block, block))
tiles_alone = sum(len(flash_lib.tile_schedule(n, n, block, block)) for n in lengths)
tiles_padded = len(lengths) * len(flash_lib.tile_schedule(n_max, n_max, block, block))
print(f"tokens: packed {total}, padded {len(lengths) * n_max}")
print(f"tiles of {block} x {block}: packed {tiles_packed} (the sequences one by one: "
      f"{tiles_alone}), padded {tiles_padded}")
print("each packed sequence is flash_attention on it alone, bit for bit:", packed_is_alone)
print("packed and padded agree on the real rows (within 16 eps; the long one within chapter "
      "23's bound):", bool(rowwise_relative_error(out_packed, padded_rows).max() <= 16 * EPS)
      and within_rule(out_packed[:n_max], q[:n_max], k[:n_max], v[:n_max]))

# %% [markdown]
# The time follows the tiles, and more: a padded tile holds masked keys and takes chapter 6's
# masked path, which a packed tile never needs. Measured here (`flash_bench.best_times`), the
# times change from run to run; `bench/bench_flash.py` asks for at least 3x the padded batch's
# speed at lengths $(4096, 64 \times 16)$.

# %% tags=["hide-input", "nbval-ignore-output"]
best, _ = best_times({"packed (varlen)": run_packed, "padded + key mask": run_padded},
                     min_rounds=3, settle=None)
fig, (ax_tiles, ax_time) = plt.subplots(1, 2, figsize=(9, 3.6))
for ax, values, ylabel, title, fmt in (
        (ax_tiles, (tiles_packed, tiles_padded), f"tiles ({block} × {block})",
         "Tiles: counted, the same everywhere", "{:.0f}"),
        (ax_time, [1e3 * t for t in best.values()], "time per call (ms)",
         "Time: measured on this machine, best of 3", "{:.0f} ms")):
    bars = ax.bar(["packed (varlen)", "padded + key mask"], values, color=["tab:blue", "tab:gray"])
    ax.bar_label(bars, [fmt.format(x) for x in values])
    ax.set(ylabel=ylabel, title=title)
    ax.margins(y=0.12)
fig.suptitle("Lengths (1024, 32 × 16), d = 64, float64: packing against padding", fontsize=10)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## The varlen schedule
#
# A document mask over the packed tokens (chapter 15's `mask_mod`) gives the same answer, but
# its tiles are cut from the packed $N \times N$ square: a tile straddling a boundary is computed
# with a mask, and every tile of the square is at least asked whether it holds a pair. Varlen's
# schedule is each sequence's own, shifted to where it starts:

# %%
print(inspect.getsource(flash_serving.varlen_tile_schedule))

# %% [markdown]
# `_sequences` checks `cu_seqlens` and pairs each sequence's query and key ranges; the list is
# `flash_lib.tile_schedule` of each sequence's $N_q \times N_k$ square, plus its start. No tile is
# shared by two sequences, nothing outside the squares looked at. Five sequences, causal,
# 32 × 32 tiles:

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
inside_one = all(doc[q0] == doc[q1 - 1] == doc[k0] == doc[k1 - 1] for q0, q1, k0, k1 in varlen_tiles)
n_blocks = -(-n_small // bs)
print(f"{len(small)} sequences, {n_small} tokens, tiles of {bs}, causal")
print(f"document mask: {len(doc_tiles)} tiles of the {n_blocks}x{n_blocks} square, "
      f"{straddling} of them across a boundary")
print(f"varlen: {len(varlen_tiles)} tiles, each inside one sequence: {inside_one}")

# %% tags=["hide-input"]
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
           xlabel="key position in the packed batch (token)")
axes[0].set_ylabel("query position in the packed batch (token)")
fig.suptitle("Tiles computed for 5 packed sequences (causal, 32 x 32 tiles; red: each sequence's "
             "square; gray: a tile across a boundary)", fontsize=10)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Decoding: split-KV with one query
#
# Each generation step gives a sequence one new token: one query against every key so far, a
# single query block, too little work for a kernel that parallelises over query blocks.
# Flash-decoding splits the *keys* instead, into chunks attended independently and merged
# exactly ({doc}`chapter 3 <03_merging_states>`). `flash_attention_with_kvcache` does this in
# three steps, written out here for one sequence of a paged cache (explained below: logical key
# $t$ lives in slot $t \bmod P$ of page `block_table[t // P]`):
#
# 1. **gather**: keys `start:stop` are copied, page by page, into buffers of their own; slots
#    past the valid length are never touched;
# 2. **chunks**: the keys before every query's position, in whole chunks of `KV_CHUNK` (512),
#    each attended with no mask (every query sees them); the last keys, fewer than
#    `KV_CHUNK` + $N_q$, go with the queries in one causal call, flash_lib's bottom-right
#    alignment being the cache's;
# 3. **merge**: the parts folded in key order by `merge_attention`, so only one partial
#    $(o, \text{lse})$ is alive: the scratch is a chunk, however long the cache.
#
# The queries come as (kv heads, query heads per kv head, $N_q$, $d$); the next section says why.

# %%
CHUNK = flash_serving.KV_CHUNK


def decode_from_scratch(q, k_pages, v_pages, table, length):
    """One sequence's attention over its `length` cached keys: q (Hkv, G, Nq, d) against pages
    (num_pages, Hkv, P, d) listed, in logical order, by `table`. Returns (out, lse)."""
    page_size = k_pages.shape[2]

    def gather(start, stop):  # 1. keys start:stop, page by page, into buffers of their own
        k = np.empty((k_pages.shape[1], stop - start, k_pages.shape[3]))
        v = np.empty((v_pages.shape[1], stop - start, v_pages.shape[3]))
        t = start
        while t < stop:
            index, slot = divmod(t, page_size)
            n = min(page_size - slot, stop - t)
            k[:, t - start:t - start + n] = k_pages[table[index], :, slot:slot + n]
            v[:, t - start:t - start + n] = v_pages[table[index], :, slot:slot + n]
            t += n
        return k[:, None], v[:, None]  # a kv head's chunk, shared by its G query heads

    n_q = q.shape[-2]
    split = CHUNK * ((length - n_q) // CHUNK)  # 2. whole chunks before every query's position
    out = lse = None
    for start in range(0, split, CHUNK):
        o, s = flash_lib.flash_attention(q, *gather(start, start + CHUNK), return_lse=True)
        out, lse = (o, s) if out is None else flash_lib.merge_attention(out, lse, o, s)  # 3.
    o, s = flash_lib.flash_attention(q, *gather(split, length), causal=True, return_lse=True)
    return (o, s) if out is None else flash_lib.merge_attention(out, lse, o, s)


# a paged cache: 4 heads, pages of 16 slots in a shuffled pool, 1300 valid keys, NaN elsewhere
heads, page, L = 4, 16, 1300
pool = np.full((2, 100, heads, page, d), np.nan)  # keys and values, (num_pages, Hkv, P, d)
table = rng.permutation(100)[:-(-L // page)]
kv = rng.standard_normal((2, heads, L, d))
for i, p in enumerate(table):
    pool[:, p, :, :min(page, L - i * page)] = kv[:, :, i * page:(i + 1) * page]
q1 = rng.standard_normal((heads, 1, d))
mine = decode_from_scratch(q1[:, None], pool[0], pool[1], table, L)
module = flash_serving.flash_attention_with_kvcache(
    q1[None], pool[0], pool[1], cache_seqlens=np.array([L]), block_table=table[None],
    causal=True, return_lse=True)
decode_identical = (np.array_equal(mine[0][:, 0], module[0][0])
                    and np.array_equal(mine[1][:, 0], module[1][0]))
print(f"L = {L}: {L // CHUNK} chunks of {CHUNK} keys and {L - CHUNK * ((L - 1) // CHUNK)} keys "
      f"with the query")
print("decode_from_scratch == flash_attention_with_kvcache, out and lse bit for bit:",
      decode_identical)

# %% [markdown]
# The scratch (`measure_peak_bytes`) for one query over 2,048 to 32,768 keys, against gathering
# the whole valid cache first and calling `flash_attention` once (the natural first version,
# which FlashAttention's paged kernels avoid):

# %%
def gather_then_attend(q, k_cache, v_cache, n):
    return flash_lib.flash_attention(q[0], k_cache[0, :, :n].copy(), v_cache[0, :, :n].copy(),
                                     causal=True)


sizes = (2048, 8192, 32768)
scratch, scratch_gather, within = {}, {}, []
for n in sizes:
    kc, vc = rng.standard_normal((2, 1, 2, n, d))  # (B = 1, Hkv = 2, max_len = n, d)
    qd = rng.standard_normal((1, 2, 1, d))
    out, peak = flash_lib.measure_peak_bytes(flash_serving.flash_attention_with_kvcache, qd, kc,
                                             vc, cache_seqlens=np.array([n]), causal=True)
    scratch[n] = peak - out.nbytes
    ref, peak = flash_lib.measure_peak_bytes(gather_then_attend, qd, kc, vc, n)
    scratch_gather[n] = peak - ref.nbytes
    within.append(within_rule(out[0], qd[0], kc[0], vc[0], causal=True))
chunk_bytes = 2 * 2 * CHUNK * d * 8  # keys and values of one chunk, 2 heads, float64
cache_bytes = {n: 2 * 2 * n * d * 8 for n in sizes}
print("every size within chapter 23's bound of dense attention:", all(within))
print(f"split-KV scratch below 3 chunks ({3 * chunk_bytes // 1024} KiB) at every L:",
      all(s < 3 * chunk_bytes for s in scratch.values()))
print("gathering first holds at least the valid cache (", ", ".join(
      f"{cache_bytes[n] // 2**20} MiB" for n in sizes), "):",
      all(scratch_gather[n] >= cache_bytes[n] for n in sizes))

# %% tags=["hide-input"]
fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(sizes, [scratch[n] / 2**20 for n in sizes], "o-", label="flash_attention_with_kvcache "
        "(split-KV chunks)")
ax.plot(sizes, [scratch_gather[n] / 2**20 for n in sizes], "s--",
        label="gather the whole cache, then flash_attention")
ax.set(xscale="log", yscale="log", xlabel="valid keys in the cache L (keys)", ylabel="scratch (MiB)",
       title="Decoding one query (2 heads, d = 64, float64), measured by tracemalloc")
ax.minorticks_off()
ax.set_xticks(sizes, [str(n) for n in sizes])
ax.set_yticks([1, 2, 4, 8, 16, 32, 64], ["1", "2", "4", "8", "16", "32", "64"])
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Grouped-query decoding: a group's heads against one K/V head
#
# With grouped-query attention (chapter 15) the $G = H_q / H_{kv}$ query heads of a group read
# the same K/V head. Decoding one token, a kernel that treats each query head as its own problem has
# tiles of one query row and reads each chunk of K and V once per *query* head: $G$ times the bytes,
# for no more arithmetic. Packed, the group's $G$ query heads are the rows of one tile against their
# K/V head, each chunk read once per *kv* head. FlashAttention-3 does this (`PackGQA`): its
# `should_pack_gqa` (`hopper/heuristics.h`, commit `13d0fd9c`) weighs the share of a tile's
# `kBlockM` query rows that hold a query, `seqlen_q / round_up(seqlen_q, kBlockM)` against
# `seqlen_q·G / round_up(seqlen_q·G, kBlockM)`: at `seqlen_q = 1`, $1/128$ against $G/128$ for
# 128-row tiles. So does `flash_attention_with_kvcache` (`decode_from_scratch` above, q shaped
# $(H_{kv}, G, N_q, d)$), broadcasting each gathered chunk to the group's $G$ query rows. Checked
# bit for bit against the module with `enable_gqa=True` ($H_q = 8$ over one K/V head) and against
# the cache with its K/V head copied 8 times (the same arithmetic, so the same bits); the copied
# cache's gathers are 8 heads wide, as the two calls' measured scratch shows.

# %%
G = 8
pool1 = pool[:, :, :1].copy()  # one kv head
pool8 = np.repeat(pool1, G, axis=2)  # the same head, copied for each query head
qg = rng.standard_normal((G, 1, d))
gqa_mine = decode_from_scratch(qg[None], pool1[0], pool1[1], table, L)
calls = {"enable_gqa, one kv head": (pool1, True), "the kv head copied 8 times": (pool8, False)}
gqa_out, gqa_scratch = {}, {}
for name, (cache, gqa) in calls.items():
    gqa_out[name], peak = flash_lib.measure_peak_bytes(
        flash_serving.flash_attention_with_kvcache, qg[None], cache[0], cache[1],
        cache_seqlens=np.array([L]), block_table=table[None], causal=True, enable_gqa=gqa)
    gqa_scratch[name] = peak - gqa_out[name].nbytes
gqa_identical = np.array_equal(gqa_mine[0].reshape(G, 1, d), gqa_out["enable_gqa, one kv head"][0])
copies_identical = np.array_equal(*gqa_out.values())
print("packed decode_from_scratch == flash_attention_with_kvcache(enable_gqa=True), bit for bit:",
      gqa_identical)
print("== the cache with its kv head copied per query head, bit for bit:", copies_identical)
ratio = gqa_scratch["the kv head copied 8 times"] / gqa_scratch["enable_gqa, one kv head"]
print(f"scratch, copied heads over packed: more than 4x: {ratio > 4}")

# %% [markdown]
# ## A paged cache
#
# A contiguous cache reserves `max_len` slots for every sequence, used or not. vLLM's paged
# cache (Kwon et al., 2023) cuts the memory into pages of $P$ slots, handed out as a sequence
# grows, so they end up anywhere; the sequence's page table, `block_table[b]`, lists them in
# order. Below, three sequences in a pool of 14 pages of 16 slots; the first two began with the
# same 40-token prompt, whose two full pages they share (one copy in memory); the prompt's third
# page, partly each one's own, is copied in each. Free slots and pages hold NaN, which would
# make any output that read them NaN.

# %%
P, n_pages, h = 16, 14, 2
seq_lens = np.array([71, 52, 30])
pool_k = np.full((n_pages, h, P, d), np.nan)
pool_v = np.full((n_pages, h, P, d), np.nan)
order = rng.permutation(n_pages)
block_table = np.full((3, 5), -1)  # -1: no page yet (never read)
block_table[0, :5] = order[:5]
block_table[1, :2] = block_table[0, :2]  # the shared prompt's two full pages
block_table[1, 2:4] = order[5:7]
block_table[2, :2] = order[7:9]
prompt_k, prompt_v = rng.standard_normal((2, h, 40, d))
contiguous = np.full((2, 3, h, 80, d), np.nan)  # the same keys in a contiguous cache
for b, n in enumerate(seq_lens):
    keys, values = rng.standard_normal((2, h, n, d))
    if b < 2:
        keys[:, :40], values[:, :40] = prompt_k, prompt_v
    contiguous[0, b, :, :n], contiguous[1, b, :, :n] = keys, values
    for t0 in range(0, n, P):
        page = block_table[b, t0 // P]
        pool_k[page, :, :min(P, n - t0)] = keys[:, t0:t0 + P]
        pool_v[page, :, :min(P, n - t0)] = values[:, t0:t0 + P]

q_step = rng.standard_normal((3, h, 1, d))
paged_out = flash_serving.flash_attention_with_kvcache(
    q_step, pool_k, pool_v, cache_seqlens=seq_lens, block_table=block_table, causal=True)
flat_out = flash_serving.flash_attention_with_kvcache(
    q_step, contiguous[0], contiguous[1], cache_seqlens=seq_lens, causal=True)
paged_identical = np.array_equal(paged_out, flat_out)
used = len(np.unique(block_table[block_table >= 0]))
print(f"pages in use: {used} of {n_pages}, for {seq_lens.sum()} keys of which 2 x 32 are the "
      f"shared pages' (unshared: {sum(-(-n // P) for n in seq_lens)} pages)")
print("paged equals contiguous, bit for bit:", paged_identical)
print("finite although NaN fills every free slot and page:", bool(np.isfinite(paged_out).all()))
print("each within chapter 23's bound of dense attention on its keys:",
      all(within_rule(paged_out[b], q_step[b], contiguous[0, b, :, :n], contiguous[1, b, :, :n],
                      causal=True) for b, n in enumerate(seq_lens)))

# %% tags=["hide-input"]
fig, (ax_t, ax_p) = plt.subplots(2, 1, figsize=(10, 4.8), gridspec_kw={"height_ratios": [3, 1.3]})
owner = {}
for b in range(3):
    for i in range(block_table.shape[1]):
        page = block_table[b, i]
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
ax_t.set(xlim=(0, block_table.shape[1]), ylim=(3, 0), xlabel="logical page t // 16",
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
# Paged and contiguous give the same bits: the gather copies each chunk, wherever its slots lie,
# into the same buffers for the same calls. The NaN in free slots changes nothing, as nothing past
# `cache_seqlens` is read.
#
# ## Memory against fragmentation
#
# Where a contiguous cache reserves `max_len` slots per sequence, a paged one loses only the
# unused end of each sequence's last page. For 64 requests of random lengths up to 4096 tokens
# (one layer, 8 kv heads, d = 128, float16: 4 KiB per token for keys and values), in arithmetic:

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
# Small pages waste little but make the table long and each gather short; FlashAttention's paged
# kernels take pages of a multiple of 256 slots, vLLM's default is 16. Sharing a prompt's pages,
# as above, saves more than fragmentation costs whenever many requests begin alike.
#
# ## Generating with the cache
#
# A toy model, one two-head attention layer between an embedding and an unembedding, decoding
# greedily: the prompt is written into the cache and attended in one call (prefill, causal over its
# $N_{\mathrm{new}}$ new keys); then each step feeds the chosen token, appends its key and value
# (`k_new`, `v_new`, written in place into a paged cache of 8 shuffled pages of 8 slots) and attends
# over the cache. Each step is checked by recomputation: the whole sequence so far through causal
# `flash_attention`, no cache. At the end the cache must hold the $L$ keys in its first
# $\lceil L/8 \rceil$ pages and nothing elsewhere: the waste is the last page's
# $8 \lceil L/8 \rceil - L$ slots.

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
x = emb[prompt].transpose(1, 0, 2)[None]  # (B = 1, h, n, dm)
attn = flash_serving.flash_attention_with_kvcache(
    x, cache_k, cache_v, cache_seqlens=np.array([0]), k_new=x @ w_k, v_new=x @ w_v,
    block_table=pages[None], causal=True)
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
        block_table=pages[None], causal=True)
    length += 1
written = [int(np.isfinite(cache_k[p, 0, :, 0]).sum()) for p in pages]  # slots filled, in order
print("generated:", tokens[len(prompt):])
print(f"{steps} tokens, each the argmax of recomputation too:", all(agree))
print("cache and recomputation agree within 64 eps at every step:", max(errors) <= 64 * EPS)
print(f"smallest gap between the two best logits: {min(gaps):.2f} (a difference of 64 eps in "
      f"the attention cannot close it)")
print(f"L = {length} keys: slots filled in the pages, in table order: {written}")

# %% [markdown]
# The tokens are exactly those of recomputation; the attention outputs agree to rounding (the
# cache merges chunks where recomputation runs one tiled pass), far below the gap between the
# two best logits. The cache turns the $O(n^2)$ work of recomputing every step into $O(n)$ per
# step.
#
# ## What to take away
#
# - Packing a ragged batch costs exactly its sequences' tiles; padding costs the longest one's
#   tiles for every sequence, masked.
# - Decoding is split-KV with one query, its scratch one chunk however long the cache; with GQA
#   a group's query heads share each gathered chunk.
# - A paged cache is a page table in front of a pool: pages in any order, shared prefixes, free
#   slots never read, the contiguous cache's bits, under a page wasted per sequence.

# %%
# packing: the tiles of the sequences, 8² + 16 = 80; padding 17 × 8² = 1088; each sequence's
# rows are flash_attention on it alone, bit for bit, and the padded batch's to rounding
assert tiles_packed == tiles_alone == 8**2 + 16 and tiles_padded == 17 * 8**2
assert packed_is_alone
assert rowwise_relative_error(out_packed, padded_rows).max() <= 16 * EPS
assert within_rule(out_packed[:n_max], q[:n_max], k[:n_max], v[:n_max])
# the varlen schedule: every tile inside one sequence; the document mask's straddle boundaries
assert inside_one and straddling > 0
# decoding: the loop written out is the module's, bit for bit, paged, with and without GQA
assert decode_identical and gqa_identical and copies_identical
# split-KV scratch: under 3 chunks at every length; gathering first: the whole valid cache
assert all(within)
assert all(s < 3 * chunk_bytes for s in scratch.values()), scratch
assert all(scratch_gather[n] >= cache_bytes[n] for n in sizes)
# GQA: the copied heads' scratch is 7.9 times the packed call's here (their gathers 8 heads wide)
assert ratio > 4, ratio
# paged = contiguous bit for bit, NaN in free slots never read, each within the bound
assert paged_identical
assert np.isfinite(paged_out).all()
assert all(within_rule(paged_out[b], q_step[b], contiguous[0, b, :, :n], contiguous[1, b, :, :n],
                       causal=True) for b, n in enumerate(seq_lens))
# generation: the tokens of recomputation, the attention to 64 eps; the cache filled its first
# ceil(L/8) pages in order and nothing else: 8 ceil(L/8) - L = 1 slot wasted
assert all(agree) and max(errors) <= 64 * EPS
assert written == [8, 8, 8, 7, 0, 0, 0, 0] and length == len(prompt) + steps == 31

# %% [markdown]
# ## Your turn: decoding from a paged cache
#
# Write `paged_decode(q, k_cache, v_cache, block_table, cache_seqlens) -> out`: one
# query per sequence, `q (B, H, d)`, against its `cache_seqlens[b]` keys, stored in pages:
# `k_cache (num_pages, H, page_size, d)`, `v_cache (num_pages, H, page_size, dv)`, logical page
# `t` of sequence `b` being `block_table[b, t]`; `out (B, H, dv)`, scale $1/\sqrt d$. A sequence
# of length 0 gives zeros; slots past a sequence's length hold garbage (NaN) and must not be read.
#
# Replace the stub and re-run the grade cell until it says `passed`; the solution is hidden below
# it.

# %%
from flash_check.exercises import grade, show_solution, stub

# your turn: replace the stub with def paged_decode(q, k_cache, v_cache, block_table, cache_seqlens): ...
paged_decode = stub("paged_decode")

# %%
grade("paged_decode", paged_decode)

# %% jupyter={"outputs_hidden": true} mystnb={"code_prompt_hide": "Hide the solution", "code_prompt_show": "Show the solution"} tags=["remove-input", "hide-output"]
show_solution("paged_decode")

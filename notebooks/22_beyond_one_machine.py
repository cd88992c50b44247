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
# # 22. Beyond one machine: attention over a Dask cluster
#
# `flash_attention` keeps one tile of scores at a time, so its memory no longer limits the
# sequence length; its time still grows as $N_q N_k$, and its inputs must still fit on one
# machine. The way out is the one {doc}`chapter 3 <03_merging_states>` prepared: attention over
# disjoint sets of keys merges exactly through $(\mathrm{out}, \mathrm{lse})$, so the work can
# be cut into pieces that run anywhere. In this chapter:
#
# - the cluster as a bigger tile: `flash_dask.dask_attention` cuts queries and keys into
#   *shards*, runs one `flash_attention` task per (query shard, key shard) pair and folds each
#   query shard's partial results with `merge_attention` in a few chains, ring attention's data
#   flow: `tile_schedule` one level up;
# - we run it on a `distributed.LocalCluster` of two worker processes, check it against
#   `flash_attention` to $10^{-12}$, and draw which worker computed which shard pair, and when;
# - flash-decoding ($N_q = 1$) and ring attention (query shards stay, key shards travel) on the
#   same cluster;
# - training: the gradients over the same shard pairs (`dask_attention_backward`), one training
#   step of a small attention layer on the cluster, and ring attention's backward;
# - what changes on GPUs: collectives, and hiding the transfers behind the arithmetic.
#
# An appendix covers operating the cluster: the workers' environment, a worker killed with
# `SIGKILL` mid-computation, and the time. The cluster runs on this machine (processes talking
# over TCP on 127.0.0.1); the same graph runs unchanged on many machines.

# %%
import collections
import logging
import os
import time

import dask
import dask.array as da
import matplotlib.pyplot as plt
import numpy as np
from distributed import Client, LocalCluster, get_task_stream

import flash_dask
import flash_lib

rng = np.random.default_rng(14)
d = 64

# %% [markdown]
# ## A cluster of two processes
#
# Two worker processes with one thread each, on 127.0.0.1. A `flash_attention` call already
# spreads over the cores with its own threads, so more Dask threads in one process would add no
# parallelism: shards run side by side in separate processes. Each worker runs `flash_lib` on
# one thread (`FLASH_LIB_THREADS=1`, set in the workers' environment before they start), so a
# worker is one core. The scheduler runs in this notebook's process. The other two settings
# are explained in the appendix.

# %%
logging.getLogger("distributed").setLevel(logging.ERROR)
worker_environment = {
    "distributed.nanny.pre-spawn-environ.FLASH_LIB_THREADS": "1",
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,  # appendix
    "distributed.nanny.pre-spawn-environ.DASK_LOGGING__DISTRIBUTED": "critical",  # appendix
}
with dask.config.set(worker_environment):
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                           dashboard_address=None,
                           scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
                           silence_logs=logging.ERROR)
client = Client(cluster)
client.wait_for_workers(2, timeout=60)
workers = sorted(client.scheduler_info()["workers"])
worker_threads = client.run(lambda: __import__("flash_lib").thread_count())
print(f"{len(workers)} worker processes, flash_lib threads in each:",
      sorted(worker_threads.values()))

# %% [markdown]
# ## The cluster as a bigger tile
#
# `dask_attention(q, k, v, causal=...)` takes Dask arrays cut along the sequence axis (their
# chunks are the shards; NumPy arrays are wrapped with shards of `flash_dask.DEFAULT_SHARD` rows)
# and builds, without computing anything:
#
# - one **pair task** for each (query shard $i$, key shard $j$) that holds at least one allowed
#   (query, key) pair: `flash_attention(q_i, k_j, v_j, return_lse=True)`, attention over that
#   key shard alone;
# - the pair tasks of a query shard folded in **chains**: the query shard visits its key shards
#   in ring attention's order ($i, i - 1, \dots$, from the diagonal down when causal), cut into
#   `split_every` (default 4, as in Dask's own reductions) runs of consecutive ones, and in a run
#   each pair task takes the running state $(o, \mathrm{lse})$ of the one before and merges its
#   own partial into it with `merge_attention`:
#   $\mathrm{lse} = \log (e^{\mathrm{lse}_a} + e^{\mathrm{lse}_b})$,
#   $o = e^{\mathrm{lse}_a - \mathrm{lse}}\, o_a + e^{\mathrm{lse}_b - \mathrm{lse}}\, o_b$;
# - per query shard one **merge task** that folds the ends of its chains.
#
# Dask runs a task on the worker that holds most of its input bytes, and a chain's running state
# is one of them: it stays where it is, and the key and value shards come to it (each fetched
# once by a worker, then kept). An earlier version of this graph merged each query shard's pair
# results by a tree; those partial results then travelled to wherever their merge ran, and on
# two workers that cost more than the merges (the appendix's last section).
#
# That is the kernel's loop of chapter 5, with a shard for a tile and the same running update
# (in a few chains rather than one): with shards of equal size the pair tasks are the tiles of
# `tile_schedule(N, N, shard, shard, causal)`, for causal attention $n(n+1)/2$ of the $n^2$
# pairs for $n$ shards per side. Queries $N = 8192$ in 8 shards of 1024, keys the same:

# %%
n, shard = 8192, 1024
inputs_rng = da.random.default_rng(2014)
q, k, v = (inputs_rng.standard_normal((n, d), chunks=(shard, d)) for _ in range(3))
causal_out, causal_lse = flash_dask.dask_attention(q, k, v, causal=True, return_lse=True)
full_out = flash_dask.dask_attention(q, k, v)
n_shards = n // shard
causal_pairs = flash_dask.attention_task_count(causal_out)
full_pairs = flash_dask.attention_task_count(full_out)
schedule_tiles = len(flash_lib.tile_schedule(n, n, shard, shard, causal=True))
print(f"{n_shards} × {n_shards} shards: full attention {full_pairs} pair tasks, causal "
      f"{causal_pairs} = n(n+1)/2 = {n_shards * (n_shards + 1) // 2}; "
      f"tile_schedule with {shard}-row tiles: {schedule_tiles} tiles")
causal_graph = dict(causal_out.__dask_graph__())
pair_keys = [key for key in causal_graph if str(key[0]).startswith("flash-attention-pair-")]
merge_tasks = sum(1 for key in causal_graph if str(key[0]).startswith("flash-attention-merge-"))
# a chain's step: a pair task that reads another pair task's result, its running state
fold_steps = sum(1 for key in pair_keys
                 if set(pair_keys) & dask.core.get_dependencies(causal_graph, key))
chains = [min(4, i) for i in range(1, n_shards + 1)]  # query shard i (from 1) has i pairs
expected_folds = sum(i - c for i, c in zip(range(1, n_shards + 1), chains))
expected_merges = sum(1 for c in chains if c > 1)
print(f"pair tasks that fold into the running state of the one before: {fold_steps} (from "
      f"the chains: {expected_folds}); merge tasks: {merge_tasks} (one per query shard of two "
      f"chains or more: {expected_merges})")

# %% [markdown]
# Both counts follow from the chains: query shard $i$ (counting from 1) has $i$ pair tasks in
# $\min(4, i)$ chains. Shard 1 is one pair and needs no merge; shards 2 to 4 have chains of one
# pair each and one merge; shards 5 to 8 have 4 chains, of which $i - 4$ steps take a running
# state: $1 + 2 + 3 + 4 = 10$ such steps, and 7 merges in all.
#
# Now the computation, on the cluster, recording every task Dask ran (`get_task_stream`: which
# worker, from when to when). The inputs are made on the workers (`dask.array.random`, from a
# fixed seed), as data that lives on a cluster would be; to check the result we also bring them
# into this process and run `flash_attention` here.

# %%
with get_task_stream(client=client) as stream:
    t_start = time.perf_counter()
    got_out, got_lse = client.compute([causal_out, causal_lse], sync=True)
    t_cluster = time.perf_counter() - t_start
q_np, k_np, v_np = client.compute([q, k, v], sync=True)
t_start = time.perf_counter()
ref_out, ref_lse = flash_lib.flash_attention(q_np, k_np, v_np, causal=True, return_lse=True)
t_process = time.perf_counter() - t_start
err_out = float(flash_lib.rowwise_relative_error(got_out, ref_out).max())
err_lse = float((np.abs(got_lse - ref_lse) / (1 + np.abs(ref_lse))).max())
print("the cluster's out equals flash_attention's (rowwise relative error <= 1e-12):",
      err_out <= 1e-12)
print("and so does its lse (relative to 1 + |lse|, <= 1e-12):", err_lse <= 1e-12)

# %% [markdown]
# On the left, the shard pairs: the 28 above the diagonal were never computed; on the 8 on the
# diagonal `flash_attention` applies its causal mask inside the pair; the 28 below are full.
# Each computed pair is labelled with the worker that Dask chose to run it. On the right, the
# same tasks in time, one row per worker, coloured by query shard: a chain's steps follow one
# another on one worker; merges are the thin grey bars.

# %%
def task_record(task):
    """(name, indices, worker, start, stop) of one task of the stream."""
    key = task["key"]
    key = key if isinstance(key, tuple) else (key,)
    compute = [s for s in task["startstops"] if s["action"] == "compute"][0]
    return str(key[0]), key[1:], task["worker"], compute["start"], compute["stop"]


records = [task_record(t) for t in stream.data
           if any(s["action"] == "compute" for s in t["startstops"])]
t0 = min(r[3] for r in records)
label = {w: chr(ord("A") + i) for i, w in enumerate(workers)}
pair_worker = {idx: w for name, idx, w, _, _ in records if name.startswith("flash-attention-pair")}

fig, (ax_grid, ax_time) = plt.subplots(1, 2, figsize=(12, 4.8),
                                       gridspec_kw={"width_ratios": [1, 1.5]})
offset = 0  # Nk - Nq: the diagonal is bottom-right aligned
kinds = collections.Counter()
for i in range(n_shards):
    for j in range(n_shards):
        q_lo, q_hi, k_lo, k_hi = i * shard, (i + 1) * shard - 1, j * shard, (j + 1) * shard - 1
        if k_lo > q_hi + offset:
            color = "0.92"  # no allowed pair: not in the graph
        elif k_hi > q_lo + offset:
            color = "C1"  # crossing the diagonal
        else:
            color = "C0"  # every pair allowed
        kinds[color] += 1
        ax_grid.add_patch(plt.Rectangle((j, i), 1, 1, color=color, ec="white", lw=1.5))
        if (i, j) in pair_worker:
            ax_grid.text(j + 0.5, i + 0.5, label[pair_worker[i, j]], ha="center", va="center",
                         color="white", fontsize=10, fontweight="bold")
ax_grid.set_xlim(0, n_shards)
ax_grid.set_ylim(n_shards, 0)
ax_grid.set_aspect("equal")
ax_grid.set_xticks(np.arange(n_shards) + 0.5, range(n_shards))
ax_grid.set_yticks(np.arange(n_shards) + 0.5, range(n_shards))
ax_grid.set_xlabel(f"key shard j ({shard} keys each)")
ax_grid.set_ylabel(f"query shard i ({shard} queries each)")
ax_grid.set_title("Causal shard pairs,\nand the worker that ran each", fontsize=11)
ax_grid.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in ("C0", "C1", "0.92")],
               labels=["all pairs allowed", "crosses the diagonal", "skipped"],
               loc="upper right", fontsize=8)

for name, idx, w, start, stop in records:
    row = workers.index(w)
    if name.startswith("flash-attention-pair"):
        ax_time.barh(row, stop - start, left=start - t0, height=0.6,
                     color=plt.cm.viridis(idx[0] / (n_shards - 1)), ec="white", lw=0.5)
    elif name.startswith("flash-attention-merge"):
        ax_time.barh(row, stop - start, left=start - t0, height=0.25, color="0.4")
ax_time.set_yticks(range(len(workers)), [f"worker {label[w]}" for w in workers])
ax_time.set_xlabel("time since the first task started (s)")
ax_time.set_title("The same tasks in time:\npair tasks, and merges (thin, grey)", fontsize=11)
ax_time.invert_yaxis()
fig.colorbar(plt.cm.ScalarMappable(plt.Normalize(0, n_shards - 1), "viridis"), ax=ax_time,
             label="query shard i of the pair task")
fig.tight_layout()
plt.show()

computed_by = collections.Counter(pair_worker.values())
print(f"shard pairs: {kinds['C0']} full, {kinds['C1']} crossing the diagonal, "
      f"{kinds['0.92']} skipped")
print("pair tasks run:", len(pair_worker), "| both workers took part:",
      len(computed_by) == 2)

# %% [markdown]
# ## Flash-decoding: one query, many keys
#
# Flash-decoding splits the keys of one new query ({doc}`chapter 3 <03_merging_states>` explains
# why). Here it is `dask_attention` with $N_q = 1$: one query against 65536 keys in 16 shards of
# 4096, so 16 pair tasks in one query shard: 4 chains of 4 that run side by side, and one merge
# task of their ends. This is why a query shard has `split_every` chains rather than one: a
# single chain would run its 16 pairs one after another. (One head; a batch of heads is a
# leading axis of one chunk.)

# %%
n_keys, key_shard = 65536, 4096
q_dec = inputs_rng.standard_normal((1, d), chunks=(1, d))
k_dec, v_dec = (inputs_rng.standard_normal((n_keys, d), chunks=(key_shard, d)) for _ in range(2))
dec_out, dec_lse = flash_dask.dask_attention(q_dec, k_dec, v_dec, causal=True, return_lse=True)
dec_graph = dec_out.__dask_graph__()
dec_pairs = flash_dask.attention_task_count(dec_out)
dec_graph = dict(dec_graph)
dec_pair_keys = {key for key in dec_graph if str(key[0]).startswith("flash-attention-pair-")}
# a chain starts with a pair task that reads no other pair task's result
dec_chains = sum(1 for key in dec_pair_keys
                 if not dec_pair_keys & dask.core.get_dependencies(dec_graph, key))
dec_merges = sum(1 for key in dec_graph if str(key[0]).startswith("flash-attention-merge-"))
print(f"one query, {n_keys} keys in {n_keys // key_shard} shards: {dec_pairs} pair tasks in "
      f"{dec_chains} chains, and {dec_merges} merge task of their ends")
got_dec, got_dec_lse = client.compute([dec_out, dec_lse], sync=True)
q1, k1, v1 = client.compute([q_dec, k_dec, v_dec], sync=True)
ref_dec, ref_dec_lse = flash_lib.flash_attention(q1, k1, v1, causal=True, return_lse=True)
dec_err = float(flash_lib.rowwise_relative_error(got_dec, ref_dec).max())
print("equals flash_attention over all 65536 keys (rowwise relative error <= 1e-12):",
      dec_err <= 1e-12, "| lse to 1e-12:", abs(got_dec_lse[0] - ref_dec_lse[0]) <= 1e-12)

# %% [markdown]
# (With $N_q = 1$ the bottom-right causal diagonal lets the one query see every key, as it
# should for the newest token: causal changes nothing here.)
#
# ## Ring attention: the same merge, another schedule
#
# In the graph above, each chain has ring attention's data flow, but Dask's scheduler decides
# where each chain runs and moves whatever that needs. Ring attention
# ({doc}`chapter 3 <03_merging_states>`) fixes the schedule instead: device $p$ keeps query
# shard $p$ and its running $(o, \mathrm{lse})$, and the key/value shards travel round the
# ring. We follow a public implementation, zhuzilin/ring-flash-attention
# (`ring_flash_attn/ring_flash_attn.py` and `utils.py`): rank $p$ sends to $p + 1$ and receives
# from $p - 1$, so at step $t$ it holds shard $(p - t) \bmod P$; with causal attention it
# computes only at steps $t \le p$ (shards $j \le p$), with the causal mask at step 0 only (its
# own, diagonal, shard); and it folds each block into its state as
#
# $$o \leftarrow o - \sigma(\mathrm{lse}_b - \mathrm{lse})\,(o - o_b), \qquad
#   \mathrm{lse} \leftarrow \mathrm{lse} - \log\sigma(\mathrm{lse} - \mathrm{lse}_b),$$
#
# with $\sigma$ the logistic function. That is `merge_attention` rewritten:
# $\sigma(\mathrm{lse}_b - \mathrm{lse}) = e^{\mathrm{lse}_b} / (e^{\mathrm{lse}} + e^{\mathrm{lse}_b})$
# is block $b$'s share of the weight, and $-\log\sigma(\mathrm{lse} - \mathrm{lse}_b) =
# \log(1 + e^{\mathrm{lse}_b - \mathrm{lse}})$. (Below is our NumPy transcription of that
# formula, not their PyTorch code.)
#
# On our cluster: $P = 4$ devices on the 2 workers (devices 0 and 2 on worker A, 1 and 3 on B),
# causal, $N = 4096$. Every task is pinned to its device's worker, so only key/value shards
# cross between the workers.

# %%
def ring_update(state, block):
    """zhuzilin/ring-flash-attention's update_out_and_lse, transcribed to NumPy."""
    out, lse = state
    block_out, block_lse = block
    share = 1 / (1 + np.exp(lse - block_lse))  # sigmoid(block_lse - lse)
    out = out - share[..., None] * (out - block_out)
    lse = lse + np.logaddexp(0, block_lse - lse)  # lse - logsigmoid(lse - block_lse)
    return out, lse


n_ring, devices = 4096, 4
ring_rows = n_ring // devices
q_r, k_r, v_r = (rng.standard_normal((n_ring, d)) for _ in range(3))
home = [workers[p % len(workers)] for p in range(devices)]
rows = [slice(p * ring_rows, (p + 1) * ring_rows) for p in range(devices)]
q_f = [client.scatter(q_r[rows[p]], workers=[home[p]]) for p in range(devices)]
kv_f = [client.scatter((k_r[rows[p]], v_r[rows[p]]), workers=[home[p]]) for p in range(devices)]
pinned = dict(allow_other_workers=False, pure=False)

states = [None] * devices
schedule = np.full((devices, devices), -1)  # schedule[t, p]: the kv shard device p uses at step t
for t in range(devices):
    for p in range(devices):
        j = (p - t) % devices
        if j > p:  # causal: a shard of later keys; zhuzilin's `step <= rank` condition
            continue
        schedule[t, p] = j
        block = client.submit(lambda qp, kv, c: flash_lib.flash_attention(
            qp, *kv, causal=c, return_lse=True), q_f[p], kv_f[j], t == 0,
            workers=[home[p]], **pinned)
        states[p] = block if states[p] is None else client.submit(
            ring_update, states[p], block, workers=[home[p]], **pinned)
ring_results = client.gather(states)
ring_out = np.concatenate([s[0] for s in ring_results])
ring_lse = np.concatenate([s[1] for s in ring_results])
ring_ref, ring_ref_lse = flash_lib.flash_attention(q_r, k_r, v_r, causal=True, return_lse=True)
ring_err = float(flash_lib.rowwise_relative_error(ring_out, ring_ref).max())
holders = client.who_has(states)
states_home = [list(holders[s.key])[0] for s in states]
print("ring attention on the cluster equals flash_attention (rowwise <= 1e-12):",
      ring_err <= 1e-12, "| lse to 1e-12:", np.abs(ring_lse - ring_ref_lse).max() <= 1e-12)
print("every device's state stayed on its own worker:", states_home == home)
print("blocks computed:", int((schedule >= 0).sum()), "of", devices * devices,
      "(causal: n(n+1)/2 =", devices * (devices + 1) // 2, ")")
ring_pairs = {(p, int(schedule[t, p])) for t in range(devices) for p in range(devices)
              if schedule[t, p] >= 0}
graph_pairs = {key[1:] for key in flash_dask.dask_attention(
    da.from_array(q_r, chunks=(ring_rows, d)), da.from_array(k_r, chunks=(ring_rows, d)),
    da.from_array(v_r, chunks=(ring_rows, d)), causal=True).__dask_graph__()
    if str(key[0]).startswith("flash-attention-pair-")}
print("the same (query shard, key shard) pairs as dask_attention's causal graph:",
      ring_pairs == graph_pairs)

# %% [markdown]
# The schedule, drawn: device $p$'s column lists the key/value shard it attends to at each step;
# the arrows are the ring's hops. The computed blocks are the 10 shard pairs of the causal graph
# with 4 shards; only the order differs, and where the data waits.

# %%
fig, (ax_s, ax_r) = plt.subplots(1, 2, figsize=(11, 4),
                                 gridspec_kw={"width_ratios": [1.3, 1]})
for t in range(devices):
    for p in range(devices):
        j = (p - t) % devices
        used = schedule[t, p] >= 0
        ax_s.add_patch(plt.Rectangle((p, t), 1, 1, ec="white", lw=2,
                                     color=plt.cm.tab10(j) if used else "0.92"))
        ax_s.text(p + 0.5, t + 0.5, f"kv {j}" + ("" if used else "\n(skipped)"),
                  ha="center", va="center", fontsize=9, color="white" if used else "0.4")
ax_s.set_xlim(0, devices)
ax_s.set_ylim(devices, 0)
ax_s.set_xticks(np.arange(devices) + 0.5,
                [f"device {p}\n(worker {label[home[p]]})" for p in range(devices)])
ax_s.set_yticks(np.arange(devices) + 0.5, range(devices))
ax_s.set_ylabel("ring step t")
ax_s.set_xlabel("device p: holds query shard p and its (out, lse)")
ax_s.set_title("Causal ring attention:\nthe key/value shard each device uses", fontsize=11)
angles = np.pi / 2 - 2 * np.pi * np.arange(devices) / devices
xs, ys = np.cos(angles), np.sin(angles)
gap = 0.45  # radians left free around each device's box, so that no arrow runs into one
for p in range(devices):
    start, stop = angles[p] - gap, angles[p] - 2 * np.pi / devices + gap
    ax_r.annotate("", xy=(np.cos(stop), np.sin(stop)), xytext=(np.cos(start), np.sin(start)),
                  arrowprops=dict(arrowstyle="->", color="0.5", lw=1.5,
                                  connectionstyle="arc3,rad=-0.3"))
    ax_r.text(xs[p], ys[p], f"device {p}\nq {p}", ha="center", va="center",
              bbox=dict(boxstyle="round", fc=plt.cm.tab10(p), alpha=0.35))
ax_r.set_xlim(-1.5, 1.5)
ax_r.set_ylim(-1.5, 1.5)
ax_r.set_aspect("equal")
ax_r.axis("off")
ax_r.set_title("Each step, every device sends\nits kv shard to the next", fontsize=11)
fig.tight_layout()
plt.show()

# %% [markdown]
# With causal attention the plain ring is unbalanced: device $p$ computes at $p + 1$ of the $P$
# steps. The "zigzag" variant of the same repository, "more compute-balanced" in its README's
# words (`zigzag_ring_flash_attn.py`), cuts the sequence into $2P$ chunks and gives rank $r$
# chunks $r$ and $2P - 1 - r$ (`extract_local` in its tests): one early chunk, with little to
# attend to, and one late chunk, with much. The Dask graph has no such imbalance: its scheduler
# hands the next ready pair to whichever worker is free.

# %%
work_per_device = (schedule >= 0).sum(axis=0)
print("blocks computed by device 0, 1, 2, 3:", work_per_device.tolist())

# %% [markdown]
# ## A training step over the cluster
#
# The gradients split over the same shard pairs. {doc}`Chapter 12 <12_backward>`'s backward
# recomputes each tile's probabilities from the forward's lse,
# $P_{ij} = e^{S_{ij} - \mathrm{lse}_i}$, and needs one number per query row,
# $D_i = \sum_c dO_{ic} O_{ic}$; then $dS_{ij} = P_{ij} \circ (dO_i V_j^\top - D_i)$ and
#
# $$dQ_i = \tau \sum_j dS_{ij} K_j, \qquad dK_j = \tau \sum_i dS_{ij}^\top Q_i, \qquad
#   dV_j = \sum_i P_{ij}^\top dO_i .$$
#
# With the *global* $\mathrm{lse}_i$ and $O_i$ (from the forward over all key shards), $P_{ij}$
# and $D_i$ are the global ones, so each shard pair's terms are exactly its share of the three
# sums, whichever machine computes them. `flash_dask.dask_attention_backward(q, k, v, out, lse,
# dout, causal=...)` builds that graph: one `flash_attention_backward` task per shard pair of the
# forward, then $dQ_i$ summed over its key shards along the forward's chains (each pair task adds
# its share to the running $dQ_i$ it is given, which stays on its worker) and $dK_j$, $dV_j$ over
# their query shards by trees of fan-in `split_every`.
#
# A small model to train: one causal attention layer over $N = 2048$ tokens of width 32, with
# learned projections $Q = XW_q$, $K = XW_k$, $V = XW_v$ (width 16) and the loss
# $L = \tfrac12 \lVert \mathrm{attention}(Q, K, V) - T \rVert^2$ against a fixed target $T$. On
# the cluster, in shards of 512 tokens: the projections, the forward, the backward,
# $dW = X^\top dQ$ (and likewise for $K$, $V$), then one step of gradient descent. On one
# machine, the same chain with `flash_attention` and `flash_attention_backward`.

# %%
n_tok, width, head, tok_shard = 2048, 32, 16, 512
X = rng.standard_normal((n_tok, width))
target = rng.standard_normal((n_tok, head))
weights = {name: rng.standard_normal((width, head)) / np.sqrt(width) for name in "qkv"}


def training_step(weights):
    """Loss and dL/dW for W_q, W_k, W_v, as Dask arrays on the cluster's shards of tokens."""
    X_d = da.from_array(X, chunks=(tok_shard, width))
    q_d, k_d, v_d = (X_d @ weights[name] for name in "qkv")
    out_d, lse_d = flash_dask.dask_attention(q_d, k_d, v_d, causal=True, return_lse=True)
    dout_d = out_d - da.from_array(target, chunks=(tok_shard, head))  # dL/d(out)
    loss_d = 0.5 * (dout_d**2).sum()
    grads_d = flash_dask.dask_attention_backward(q_d, k_d, v_d, out_d, lse_d, dout_d,
                                                 causal=True)
    dW_d = {name: X_d.T @ g for name, g in zip("qkv", grads_d)}
    return loss_d, dW_d, out_d, grads_d


def training_step_one_machine(weights):
    q1, k1, v1 = (X @ weights[name] for name in "qkv")
    out1, lse1 = flash_lib.flash_attention(q1, k1, v1, causal=True, return_lse=True)
    dout1 = out1 - target
    grads1 = flash_lib.flash_attention_backward(q1, k1, v1, out1, lse1, dout1, causal=True)
    return 0.5 * np.sum(dout1**2), {name: X.T @ g for name, g in zip("qkv", grads1)}


loss_d, dW_d, out_d, grads_d = training_step(weights)
forward_tasks = flash_dask.attention_task_count(out_d)
backward_tasks = flash_dask.backward_task_count(grads_d[0])
loss_c, dW_c = client.compute([loss_d, dW_d], sync=True)  # one graph: forward, then backward
loss_1, dW_1 = training_step_one_machine(weights)
grad_err = max(float(np.abs(dW_c[name] - dW_1[name]).max() / np.abs(dW_1[name]).max())
               for name in "qkv")
lr = 0.05 / max(np.abs(dW_1[name]).max() for name in "qkv")
stepped = {name: weights[name] - lr * dW_c[name] for name in "qkv"}
loss_after = client.compute(training_step(stepped)[0], sync=True)
print(f"{n_tok // tok_shard} shards of {tok_shard} tokens: forward pair tasks {forward_tasks}, "
      f"backward pair tasks {backward_tasks} (causal: n(n+1)/2 = "
      f"{(n_tok // tok_shard) * (n_tok // tok_shard + 1) // 2})")
print("dL/dW_q, dW_k, dW_v on the cluster equal flash_lib's on one machine "
      "(max error / max |dW| <= 1e-12):", grad_err <= 1e-12)
print("the loss equals one machine's to 1e-12 relative:", abs(loss_c - loss_1) <= 1e-12 * loss_1)
print("one step of gradient descent lowered the loss:", loss_after < loss_c)


# %% [markdown]
# Ring attention orders the same pairs for the backward (zhuzilin/ring-flash-attention's
# `ring_flash_attn_backward`). Device $p$ keeps $q_p$, the forward's $o_p$ and
# $\mathrm{lse}_p$, $dO_p$ and its $dQ_p$; the key/value shards travel round the ring as in the
# forward, and with them, on a second ring, each shard's running $dK_j$, $dV_j$. At step $t$
# device $p$ holds shard $j = (p - t) \bmod P$, adds its pair's shares (at steps $t \le p$ when
# causal, masked at step 0 only) and passes shard and gradients on; after $P$ steps they arrive
# back at device $j$. On our cluster each block is `flash_attention_backward` on the device's
# query shard and the shard it holds, with the ring forward's `out` and `lse`, every task pinned
# to its device's worker.

# %%
dout_r = rng.standard_normal((n_ring, d))
query_side = [client.scatter((q_r[rows[p]], ring_out[rows[p]], ring_lse[rows[p]],
                              dout_r[rows[p]]), workers=[home[p]]) for p in range(devices)]


def ring_block_grads(query_side, kv, causal):
    """One ring step's block: (dq, dk, dv) of device p's queries against the shard it holds."""
    q_p, out_p, lse_p, dout_p = query_side
    return flash_lib.flash_attention_backward(q_p, *kv, out_p, lse_p, dout_p, causal=causal)


def add_dq(dq, block):
    return block[0] if dq is None else dq + block[0]


def add_dkv(dkv, block):
    return block[1:] if dkv is None else (dkv[0] + block[1], dkv[1] + block[2])


dq_state, dkv_state = [None] * devices, [None] * devices
visits = [[] for _ in range(devices)]  # visits[j]: the devices that added to dK_j, dV_j, in order
for t in range(devices):
    for p in range(devices):
        j = (p - t) % devices
        if j > p:  # causal: the same pairs as the forward's schedule
            continue
        block = client.submit(ring_block_grads, query_side[p], kv_f[j], t == 0,
                              workers=[home[p]], **pinned)
        dq_state[p] = client.submit(add_dq, dq_state[p], block, workers=[home[p]], **pinned)
        # device p adds to shard j's running gradients, which the ring brought here from p - 1
        dkv_state[j] = client.submit(add_dkv, dkv_state[j], block, workers=[home[p]], **pinned)
        visits[j].append(p)
# after the last step the ring hands each shard's gradients back to its own device
dkv_state = [client.submit(lambda x: x, dkv_state[j], workers=[home[j]], **pinned)
             for j in range(devices)]
ring_dq = np.concatenate(client.gather(dq_state))
ring_dkv = client.gather(dkv_state)
ring_dk, ring_dv = (np.concatenate([g[i] for g in ring_dkv]) for i in range(2))
ring_grads_ref = flash_lib.flash_attention_backward(q_r, k_r, v_r, ring_ref, ring_ref_lse, dout_r,
                                                    causal=True)
ring_grad_err = max(float(flash_lib.rowwise_relative_error(g, r).max())
                    for g, r in zip((ring_dq, ring_dk, ring_dv), ring_grads_ref))
holders = client.who_has(dq_state + dkv_state)
grads_home = [list(holders[f.key])[0] for f in dq_state + dkv_state]
print("ring backward on the cluster equals flash_attention_backward "
      "(dq, dk, dv rowwise <= 1e-12):", ring_grad_err <= 1e-12)
print("each device's dq stayed on its worker, and each shard's dk, dv came home:",
      grads_home == home + home)
print("devices that added to dk_j, dv_j, in ring order:",
      {f"shard {j}": visits[j] for j in range(devices)})
ring_backward_pairs = {(p, j) for j in range(devices) for p in visits[j]}
backward_graph_pairs = {key[1:] for key in flash_dask.dask_attention_backward(
    *(da.from_array(x, chunks=(ring_rows, d)) for x in (q_r, k_r, v_r, ring_ref)),
    da.from_array(ring_ref_lse, chunks=(ring_rows,)), da.from_array(dout_r, chunks=(ring_rows, d)),
    causal=True)[0].__dask_graph__() if str(key[0]).startswith("flash-attention-backward-pair-")}
print("the same (query shard, key shard) pairs as dask_attention_backward's graph, and as the "
      "forward's:", ring_backward_pairs == backward_graph_pairs == ring_pairs)


# %% [markdown]
# ## What changes on GPUs
#
# The algorithm does not change: shards, partial $(o, \mathrm{lse})$ and the merge. The
# communication does.
#
# - **Collectives instead of a scheduler.** ring-flash-attention's `RingComm` posts a send to
#   rank $p + 1$ and a receive from rank $p - 1$ with `torch.distributed.batch_isend_irecv`; the
#   context parallelism of the Llama 3 report (arXiv 2407.21783), which the same repository
#   implements as `llama3_flash_attn_varlen_func`, gathers all keys and values with an
#   all-gather instead. Every rank runs the same program and knows from its rank alone what to
#   send and receive, and when.
# - **Overlapping communication with compute.** `ring_flash_attn_forward` starts sending the
#   current key/value shard to the next device *before* it computes with it, and waits for the
#   next one only afterwards; Ring Attention's abstract claims it "fully overlaps" the two. That
#   works when a step's arithmetic outlasts its transfer: a step does $4\, c_q c_k d$ flops on
#   $2\, c_k d$ received numbers ($2 c_q$ flops per number), so with $F$ flop/s, $B$ bytes/s of
#   link and $b$ bytes per number, the transfer hides when $4 c_q c_k d / F \ge 2 c_k d\, b / B$,
#   that is $c_q \ge F b / (2B)$: the query shard must be long enough, whatever the key shard.
#   A Dask worker overlaps too: it fetches the inputs of its next tasks while it computes.
# - **The merge in fp32.** Kernels keep lse in float32 and merge partial outputs in float32 even
#   for 16-bit inputs (ring-flash-attention casts each block's output to float32 before the
#   update; `flash_dask` keeps float16 partials in float32 and rounds once at the end).

# %% [markdown]
# ## What we showed
#
# - `dask_attention`'s graph is the tile schedule one level up: 64 pair tasks for full attention
#   over $8 \times 8$ shards, 36 $= n(n+1)/2$ for causal, as `tile_schedule` with shard-sized
#   tiles, folded in chains of ring order: 10 steps that take a running state and 7 merges, as
#   4 chains per query shard imply. On a cluster of 2 processes its output
#   and lse equal `flash_attention`'s to $10^{-12}$, and both workers ran pair tasks.
# - Flash-decoding is $N_q = 1$: 16 pair tasks in 4 chains and 1 merge for 65536 keys, equal to
#   `flash_attention` to $10^{-12}$.
# - Ring attention with zhuzilin's update rule, pinned 4 devices to 2 workers, equals
#   `flash_attention` to $10^{-12}$; each device's state never left its worker; causal computes
#   10 of the 16 blocks, device $p$ doing $p + 1$ of them.
# - The backward over the cluster has the forward's shard pairs, 10 tasks for 4 causal
#   shards; a training step of one attention layer got $dL/dW$ equal to `flash_lib`'s on
#   one machine to $10^{-12}$, and one step of gradient descent lowered the loss.
# - Ring attention's backward, each shard's $dK_j$, $dV_j$ travelling with it: the same pairs
#   again, gradients equal to `flash_attention_backward`'s to $10^{-12}$, every shard's gradients
#   back at its device.
# - On GPUs the ring's transfers hide behind its arithmetic when the query shard is long
#   enough: $c_q \ge F b / (2B)$.
# - Operating the cluster (the appendix): a worker killed with `SIGKILL` mid-computation cost
#   recomputation, not exactness.

# %%
assert sorted(worker_threads.values()) == [1, 1]
assert full_pairs == n_shards**2 == 64
assert causal_pairs == schedule_tiles == n_shards * (n_shards + 1) // 2 == 36
assert fold_steps == expected_folds == 10 and merge_tasks == expected_merges == 7
assert err_out <= 1e-12 and err_lse <= 1e-12
assert len(pair_worker) == causal_pairs and len(computed_by) == 2
assert (kinds["C0"], kinds["C1"], kinds["0.92"]) == (28, 8, 28)
assert dec_pairs == 16 and dec_chains == 4 and dec_merges == 1
assert dec_err <= 1e-12 and abs(got_dec_lse[0] - ref_dec_lse[0]) <= 1e-12
assert ring_err <= 1e-12 and np.abs(ring_lse - ring_ref_lse).max() <= 1e-12
assert states_home == home
assert ring_pairs == graph_pairs
assert int((schedule >= 0).sum()) == devices * (devices + 1) // 2 == 10
assert work_per_device.tolist() == [1, 2, 3, 4]
# the sigmoid update is merge_attention rewritten
a = flash_lib.flash_attention(q_r[:8], k_r[:100], v_r[:100], return_lse=True)
b = flash_lib.flash_attention(q_r[:8], k_r[100:300], v_r[100:300], return_lse=True)
m_out, m_lse = flash_lib.merge_attention(*a, *b)
r_out, r_lse = ring_update(a, b)
assert np.abs(m_out - r_out).max() < 1e-14 and np.abs(m_lse - r_lse).max() < 1e-13
assert forward_tasks == backward_tasks == 10
assert grad_err <= 1e-12 and abs(loss_c - loss_1) <= 1e-12 * loss_1
assert loss_after < loss_c
assert ring_grad_err <= 1e-12 and grads_home == home + home
assert visits == [[0, 1, 2, 3], [1, 2, 3], [2, 3], [3]]
assert ring_backward_pairs == backward_graph_pairs == ring_pairs

# %% [markdown]
# ## Appendix: operating the cluster
#
# **The workers' environment.** Besides `FLASH_LIB_THREADS=1`, the cluster cell removes
# `MALLOC_TRIM_THRESHOLD_`, which Dask's nanny sets to 65536 for every worker. A fixed
# threshold turns off glibc's adaptive mmap threshold (mallopt(3)), so every large NumPy
# temporary is mapped afresh: `flash_attention` ran about 30% slower with it in our
# measurements. And it lowers the workers' own logging to critical messages, which would
# otherwise land on this page (below, the surviving worker reports at ERROR level that its
# connection to the killed one broke).

# %%
worker_trim = client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_"))
print("MALLOC_TRIM_THRESHOLD_ unset in each worker:",
      all(value is None for value in worker_trim.values()))

# %% [markdown]
# ### A worker killed in the middle of a computation
#
# A cluster of many machines loses one now and then. Every result of the graph is a pure
# function of its inputs, so when a worker dies, the scheduler recomputes whatever died with it.
# We run the causal graph of the first section again (36 pair tasks), and when 6 of them are
# done the worker process that holds the most of their results (the running states of its
# chains) is killed with `SIGKILL`: no warning, no clean-up. `flash_dask.KillWorkerAt` does it,
# a scheduler plugin that strikes from inside the scheduler's own bookkeeping the moment the
# 6th result arrives, so the kill lands at the same point of the graph on any machine. The
# nanny that watches each worker process starts a new one. The scheduler's warning that
# computed results were lost is caught, not printed.

# %%
class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def computed_twice(dask_scheduler, prefix):
    """Scheduler side: how many keys starting with `prefix` reached memory more than once."""
    count = collections.Counter(entry[0] for entry in dask_scheduler.transition_log
                                if entry[2] == "memory" and isinstance(entry[0], tuple)
                                and str(entry[0][0]).startswith(prefix))
    return sum(1 for times in count.values() if times > 1)


scheduler_log = logging.getLogger("distributed.scheduler")
records_handler = Records()
scheduler_log.addHandler(records_handler)
scheduler_log.setLevel(logging.WARNING)
scheduler_log.propagate = False  # into the list, not onto this page

pids = client.run(os.getpid)
client.register_plugin(flash_dask.KillWorkerAt("flash-attention-pair-", after=6))
kill_result = client.compute(causal_out).result(timeout=60)  # raises if anything was lost for good
victim, held, finished = client.run_on_scheduler(flash_dask.KillWorkerAt.report)
client.wait_for_workers(2, timeout=60)
scheduler_log.removeHandler(records_handler)
scheduler_log.setLevel(logging.NOTSET)
scheduler_log.propagate = True

recomputed = client.run_on_scheduler(computed_twice, prefix="flash-attention-")
lost_warning = any("lose already computed task" in m for m in records_handler.messages)
replaced = pids[victim] not in client.run(os.getpid).values()
kill_err = float(flash_lib.rowwise_relative_error(kill_result, ref_out).max())
print(f"killed when {finished} of the 36 pair tasks were done, holding partial results:",
      victim is not None and held >= 1)
print("the scheduler warned that computed results were lost:", lost_warning)
print("some of this graph's results were computed twice:", recomputed > 0)
print("the killed process was replaced, 2 workers again:", replaced,
      len(client.scheduler_info()["workers"]) == 2)
print("the result equals flash_attention (rowwise relative error <= 1e-12):", kill_err <= 1e-12)

# %% [markdown]
# ### Time: one process against two
#
# One worker process is one core here; `flash_attention` in this notebook's process uses
# `flash_lib`'s own thread pool (one thread per core, up to 4). On a 2-core machine the cluster
# can at best match the one-process kernel: what it buys is reach (more machines, more memory).
# The times below, of the first causal computation and its reference, are the building
# machine's, so the test ignores them; `make bench-dask` (`bench/bench_dask.py`) measures 1
# worker against 2 at larger $N$. At $N = 65536$ (shards of 4096) on this 2-core machine it
# measured 2 workers 1.72 to 1.89 times as fast as one with the chains of the first section,
# 171 to 185 MiB moving between them; when each query shard's partial results met in a merge
# tree, 1.64 to 1.79 times, with 275 to 354 MiB moved, mostly partial outputs travelling to
# their merge. What held the chains below 2 was not the graph but Dask's housekeeping: the
# workers' profiler, its system monitor and every server's event-loop tick took 3.3 to 3.7 s of
# CPU in a 20 s run, from the two cores the workers computed on (one worker leaves a core
# free for them). Slowed down (`flash_dask.QUIET_CLUSTER`, which the benchmark starts its
# clusters with), 2 workers ran 1.80 to 1.90 times as fast as one.

# %% tags=["nbval-ignore-output"]
print(f"on the machine that built this page, causal N = {n}: 2 workers {t_cluster:.2f} s "
      f"(with the inputs made on the workers), flash_attention in one process "
      f"({flash_lib.thread_count()} threads) {t_process:.2f} s")

# %%
client.close()
cluster.close()
assert all(value is None for value in worker_trim.values())
assert victim is not None and finished == 6 and held >= 1
assert lost_warning and recomputed > 0 and replaced
assert kill_err <= 1e-12

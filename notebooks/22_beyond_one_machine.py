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
# Memory no longer limits `flash_attention`'s sequence length, but its time still grows as
# $N_q N_k$ and its inputs must fit on one machine. {doc}`Chapter 3 <03_merging_states>` prepared
# the way out: attention over disjoint sets of keys merges exactly through
# $(\mathrm{out}, \mathrm{lse})$, so its pieces can run anywhere.
#
# `flash_dask.dask_attention` does this with Dask, `tile_schedule` one level up, here on a
# `distributed.LocalCluster` on this machine (TCP on 127.0.0.1); the same graph runs unchanged on
# many. Its settings and its speed against one process are in
# {doc}`the appendix on how this tutorial is tested <28_how_chapters_7_to_23_are_tested>`.

# %%
import collections
import logging
import os

import dask
import dask.array as da
import matplotlib.pyplot as plt
import numpy as np
from distributed import Client, LocalCluster, get_task_stream

import flash_dask
import flash_lib
from flash_bench import relative_difference

rng = np.random.default_rng(14)
d = 64

# %% [markdown]
# ## A cluster of two processes
#
# Two worker processes, each running `flash_lib` on one thread (`FLASH_LIB_THREADS=1`, set before
# it starts), so a worker is one core; the scheduler runs in this notebook's process. (The other
# two settings keep glibc's adaptive memory trimming and the workers' logs off this page: see
# {doc}`the appendix <28_how_chapters_7_to_23_are_tested>`.)

# %%
logging.getLogger("distributed").setLevel(logging.ERROR)
worker_environment = {
    "distributed.nanny.pre-spawn-environ.FLASH_LIB_THREADS": "1",
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,  # Dask's 65536: see above
    "distributed.nanny.pre-spawn-environ.DASK_LOGGING__DISTRIBUTED": "critical",
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
worker_trim = client.run(lambda: __import__("os").environ.get("MALLOC_TRIM_THRESHOLD_"))
print(f"{len(workers)} worker processes, flash_lib threads in each:",
      sorted(worker_threads.values()), "| MALLOC_TRIM_THRESHOLD_ unset in each:",
      all(value is None for value in worker_trim.values()))

# %% [markdown]
# ## The cluster as a bigger tile
#
# `dask_attention(q, k, v, causal=...)` takes Dask arrays whose chunks along the sequence axis
# are the shards, and lazily builds:
#
# - one **pair task** per (query shard $i$, key shard $j$) holding an allowed pair:
#   `flash_attention(q_i, k_j, v_j, return_lse=True)`;
# - **chains**: a query shard visits its key shards in ring attention's order ($i, i - 1, \dots$
#   when causal), cut into `split_every` (default 4) runs; in a run each pair task merges its
#   partial into the running $(o, \mathrm{lse})$ of the one before (`merge_attention`);
# - per query shard one **merge task** that folds the ends of its chains.
#
# Dask runs a task where most of its input bytes are, so a chain's running state stays put and the
# key and value shards come to it: chapter 5's loop, with a shard for a tile. With equal shards the
# pair tasks are the tiles of `tile_schedule(N, N, shard, shard, causal)`, for causal attention
# chapter 6's $n(n+1)/2$ of the $n^2$. Queries $N = 8192$ in 8 shards of 1024, keys the same:

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
graph_pairs_main = {key[1:] for key in pair_keys}  # (query shard, key shard) of each pair task
merge_tasks = sum(1 for key in causal_graph if str(key[0]).startswith("flash-attention-merge-"))
# a chain's step: a pair task that reads another pair task's result, its running state
fold_steps = sum(1 for key in pair_keys
                 if set(pair_keys) & dask.core.get_dependencies(causal_graph, key))
chains = [min(4, i) for i in range(1, n_shards + 1)]  # query shard i (from 1) has i pairs
expected_folds = sum(i - c for i, c in zip(range(1, n_shards + 1), chains))
expected_merges = sum(1 for c in chains if c > 1)
print(f"pair tasks that fold into the one before's running state: {fold_steps} (from the "
      f"chains: {expected_folds}); merge tasks: {merge_tasks} (from the chains: {expected_merges})")

# %% [markdown]
# Query shard $i$ (from 1) has $i$ pair tasks in $\min(4, i)$ chains: shard 1 needs no merge,
# shards 2 to 4 one each, and shards 5 to 8 have $i - 4$ steps that take a running state:
# $1 + 2 + 3 + 4 = 10$ steps and 7 merges.
#
# Every task Dask runs is recorded (`get_task_stream`: which worker, from when to when). The
# inputs are made on the workers (`dask.array.random`, seeded), as a cluster's data would be,
# and brought here for the check against `flash_attention`.

# %%
with get_task_stream(client=client) as stream:
    got_out, got_lse = client.compute([causal_out, causal_lse], sync=True)
q_np, k_np, v_np = client.compute([q, k, v], sync=True)
ref_out, ref_lse = flash_lib.flash_attention(q_np, k_np, v_np, causal=True, return_lse=True)
err_out = float(flash_lib.rowwise_relative_error(got_out, ref_out).max())
err_lse = float((np.abs(got_lse - ref_lse) / (1 + np.abs(ref_lse))).max())
print("the cluster's out equals flash_attention's (rowwise relative error <= 1e-12):",
      err_out <= 1e-12, "| its lse (relative to 1 + |lse|, <= 1e-12):", err_lse <= 1e-12)

# %% [markdown]
# The figure classifies the shard pairs from the graph: the 28 above the diagonal are not in it; on
# the 8 on the diagonal `flash_attention` masks inside the pair; the 28 below are full. Each
# computed pair bears the worker Dask chose. On the right, the same tasks in time, one row per
# worker, coloured by query shard: a chain's steps follow one another on one worker; red triangles
# mark the merges.

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
# each shard pair, from the graph: not in it, on the diagonal (masked inside), or full
kinds = {(i, j): "skipped" if (i, j) not in graph_pairs_main else "diagonal" if i == j else "full"
         for i in range(n_shards) for j in range(n_shards)}
kind_counts = collections.Counter(kinds.values())
computed_by = collections.Counter(pair_worker.values())
print(f"shard pairs in the graph: {kind_counts['full']} full, {kind_counts['diagonal']} on the "
      f"diagonal; {kind_counts['skipped']} not in it; all above the diagonal: "
      f"{all(j > i for (i, j), kind in kinds.items() if kind == 'skipped')}")
print("pair tasks run:", len(pair_worker), "| both workers took part:", len(computed_by) == 2)

# %% tags=["hide-input"]
fig, (ax_grid, ax_time) = plt.subplots(1, 2, figsize=(12, 4.8),
                                       gridspec_kw={"width_ratios": [1, 1.5]})
colour_of = {"full": "C0", "diagonal": "C1", "skipped": "0.92"}
for i in range(n_shards):
    for j in range(n_shards):
        color = colour_of[kinds[i, j]]
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
ax_grid.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colour_of.values()],
               labels=["all pairs allowed", "crosses the diagonal", "not in the graph"],
               loc="upper right", fontsize=8)

for name, idx, w, start, stop in records:
    row = workers.index(w)
    if name.startswith("flash-attention-pair"):
        ax_time.barh(row, stop - start, left=start - t0, height=0.6,
                     color=plt.cm.viridis(idx[0] / (n_shards - 1)), ec="white", lw=0.5)
    elif name.startswith("flash-attention-merge"):
        ax_time.plot(start - t0, row - 0.42, "v", color="C3", ms=9, mec="black", mew=0.5)
ax_time.plot([], [], "v", color="C3", ms=9, mec="black", mew=0.5, label="merge task (when it ran)")
ax_time.legend(loc="lower right", fontsize=8)
ax_time.set_yticks(range(len(workers)), [f"worker {label[w]}" for w in workers])
ax_time.set_ylim(len(workers) - 0.4, -0.7)
ax_time.set_xlabel("time since the first task started (s)")
ax_time.set_title("The same tasks in time:\npair tasks (bars) and merges (triangles)", fontsize=11)
fig.colorbar(plt.cm.ScalarMappable(plt.Normalize(0, n_shards - 1), "viridis"), ax=ax_time,
             label="query shard i of the pair task")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Flash-decoding: one query, many keys
#
# Flash-decoding splits the keys of one new query (chapter 3 says why): `dask_attention` with
# $N_q = 1$ against 65536 keys in 16 shards makes 16 pair tasks, 4 chains of 4 that run side by
# side, and one merge of their ends, where one chain would run all 16 in turn. (With $N_q = 1$,
# bottom-right causal lets the query see every key, as the newest token should.)

# %%
n_keys, key_shard = 65536, 4096
q_dec = inputs_rng.standard_normal((1, d), chunks=(1, d))
k_dec, v_dec = (inputs_rng.standard_normal((n_keys, d), chunks=(key_shard, d)) for _ in range(2))
dec_out, dec_lse = flash_dask.dask_attention(q_dec, k_dec, v_dec, causal=True, return_lse=True)
dec_pairs = flash_dask.attention_task_count(dec_out)
dec_graph = dict(dec_out.__dask_graph__())
dec_pair_keys = {key for key in dec_graph if str(key[0]).startswith("flash-attention-pair-")}
# a chain starts with a pair task that reads no other pair task's result
dec_chains = sum(1 for key in dec_pair_keys
                 if not dec_pair_keys & dask.core.get_dependencies(dec_graph, key))
dec_merges = sum(1 for key in dec_graph if str(key[0]).startswith("flash-attention-merge-"))
print(f"one query, {n_keys} keys in {n_keys // key_shard} shards: {dec_pairs} pair tasks in "
      f"{dec_chains} chains, {dec_merges} merge task of their ends")
got_dec, got_dec_lse = client.compute([dec_out, dec_lse], sync=True)
q1, k1, v1 = client.compute([q_dec, k_dec, v_dec], sync=True)
ref_dec, ref_dec_lse = flash_lib.flash_attention(q1, k1, v1, causal=True, return_lse=True)
dec_err = float(flash_lib.rowwise_relative_error(got_dec, ref_dec).max())
print("equals flash_attention over all 65536 keys (rowwise <= 1e-12):", dec_err <= 1e-12,
      "| lse to 1e-12:", abs(got_dec_lse[0] - ref_dec_lse[0]) <= 1e-12)

# %% [markdown]
# ## Ring attention: the same merge, another schedule
#
# Each chain above has ring attention's data flow, but Dask places it; ring attention
# ({doc}`chapter 3 <03_merging_states>`) fixes the schedule: device $p$ keeps query shard $p$ and
# its running $(o, \mathrm{lse})$, and the key/value shards travel round the ring. Following
# zhuzilin/ring-flash-attention (`ring_flash_attn/ring_flash_attn.py`, `utils.py`): rank $p$ sends
# to $p + 1$ and receives from $p - 1$, so at step $t$ it holds shard $(p - t) \bmod P$; causal, it
# computes only at steps $t \le p$, masked at step 0 only (its own shard); and it folds each block
# into its state as
#
# $$o \leftarrow o - \sigma(\mathrm{lse}_b - \mathrm{lse})\,(o - o_b), \qquad
#   \mathrm{lse} \leftarrow \mathrm{lse} - \log\sigma(\mathrm{lse} - \mathrm{lse}_b),$$
#
# with $\sigma$ the logistic function: `merge_attention` rewritten, since
# $\sigma(\mathrm{lse}_b - \mathrm{lse}) = e^{\mathrm{lse}_b} / (e^{\mathrm{lse}} + e^{\mathrm{lse}_b})$
# is block $b$'s share of the weight and $-\log\sigma(\mathrm{lse} - \mathrm{lse}_b) =
# \log(1 + e^{\mathrm{lse}_b - \mathrm{lse}})$ (our NumPy transcription, not their code). Here:
# $P = 4$ devices on the 2 workers (0 and 2 on worker A, 1 and 3 on B), causal, $N = 4096$,
# every task pinned to its device's worker, so only key/value shards move.

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
ring_out, ring_lse = (np.concatenate([s[i] for s in ring_results]) for i in (0, 1))
ring_ref, ring_ref_lse = flash_lib.flash_attention(q_r, k_r, v_r, causal=True, return_lse=True)
ring_err = float(flash_lib.rowwise_relative_error(ring_out, ring_ref).max())
holders = client.who_has(states)
states_home = [list(holders[s.key])[0] for s in states]
print("ring attention equals flash_attention (rowwise <= 1e-12):", ring_err <= 1e-12,
      "| lse to 1e-12:", np.abs(ring_lse - ring_ref_lse).max() <= 1e-12,
      "| every device's state stayed on its own worker:", states_home == home)
ring_pairs = {(p, int(schedule[t, p])) for t in range(devices) for p in range(devices)
              if schedule[t, p] >= 0}
graph_pairs = {key[1:] for key in flash_dask.dask_attention(
    da.from_array(q_r, chunks=(ring_rows, d)), da.from_array(k_r, chunks=(ring_rows, d)),
    da.from_array(v_r, chunks=(ring_rows, d)), causal=True).__dask_graph__()
    if str(key[0]).startswith("flash-attention-pair-")}
print("the same (query shard, key shard) pairs as dask_attention's causal graph:",
      ring_pairs == graph_pairs)

# %% [markdown]
# Device $p$'s column lists the key/value shard it attends to at each step: the causal graph's
# 10 shard pairs, in another order.

# %% tags=["hide-input"]
fig, ax_s = plt.subplots(figsize=(7, 4))
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
ax_s.set_title("Causal ring attention: the key/value shard each device uses at step t\n"
               "(after each step, every device passes its shard to device p + 1)", fontsize=11)
fig.tight_layout()
plt.show()

# %% [markdown]
# Causal, the plain ring is unbalanced: device $p$ computes at $p + 1$ of the $P$ steps. The
# "zigzag" variant of the same repository, "more compute-balanced" in its README's words
# (`zigzag_ring_flash_attn.py`), cuts the sequence into $2P$ chunks and gives rank $r$ chunks $r$
# and $2P - 1 - r$ (`extract_local` in its tests): one early chunk, with little to attend to, and
# one late chunk, with much. The Dask graph has the same pairs per query shard but no such
# imbalance: its scheduler hands the next ready pair to whichever worker is free.

# %%
work_per_device = (schedule >= 0).sum(axis=0)
graph_per_shard = [sum(1 for i, _ in graph_pairs if i == p) for p in range(devices)]
print("blocks computed by device 0, 1, 2, 3:", work_per_device.tolist(),
      "| pair tasks of query shard 0, 1, 2, 3 in dask_attention's graph:", graph_per_shard)

# %% [markdown]
# ## A training step over the cluster
#
# The gradients split over the same shard pairs. {doc}`Chapter 12 <12_backward>`'s backward
# recomputes $P_{ij} = e^{S_{ij} - \mathrm{lse}_i}$ from the forward's lse and needs
# $D_i = \sum_c dO_{ic} O_{ic}$; then $dS_{ij} = P_{ij} \circ (dO_i V_j^\top - D_i)$ and
#
# $$dQ_i = \tau \sum_j dS_{ij} K_j, \qquad dK_j = \tau \sum_i dS_{ij}^\top Q_i, \qquad
#   dV_j = \sum_i P_{ij}^\top dO_i .$$
#
# Given the forward's *global* $\mathrm{lse}_i$ and $O_i$, each shard pair's terms are exactly its
# share of the three sums. `flash_dask.dask_attention_backward` builds that graph: one
# `flash_attention_backward` task per shard pair, $dQ_i$ summed along the forward's chains,
# $dK_j$, $dV_j$ by trees of fan-in `split_every`.
#
# A small model: one causal attention layer over $N = 2048$ tokens of width 32, projections
# $Q = XW_q$, $K = XW_k$, $V = XW_v$ (width 16), loss $L = \tfrac12 \lVert O - T \rVert^2$. On the
# cluster in shards of 512 tokens, and on one machine with `flash_lib`: projections, forward,
# backward, $dW = X^\top dQ$ (likewise for $K$, $V$), one gradient-descent step.

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


loss_d, dW_d, out_d, grads_d = training_step(weights)
forward_tasks = flash_dask.attention_task_count(out_d)
backward_tasks = flash_dask.backward_task_count(grads_d[0])
loss_c, dW_c = client.compute([loss_d, dW_d], sync=True)  # one graph: forward, then backward
# the same step on one machine
q1, k1, v1 = (X @ weights[name] for name in "qkv")
out1, lse1 = flash_lib.flash_attention(q1, k1, v1, causal=True, return_lse=True)
grads1 = flash_lib.flash_attention_backward(q1, k1, v1, out1, lse1, out1 - target, causal=True)
loss_1, dW_1 = 0.5 * np.sum((out1 - target) ** 2), {n: X.T @ g for n, g in zip("qkv", grads1)}
grad_err = max(relative_difference(dW_c[name], dW_1[name]) for name in "qkv")
lr = 0.05 / max(np.abs(dW_1[name]).max() for name in "qkv")
stepped = {name: weights[name] - lr * dW_c[name] for name in "qkv"}
loss_after = client.compute(training_step(stepped)[0], sync=True)
print(f"{n_tok // tok_shard} shards of {tok_shard} tokens: pair tasks, forward {forward_tasks}, "
      f"backward {backward_tasks}")
print("dL/dW on the cluster equals one machine's (max error / max |dW| <= 1e-12):",
      grad_err <= 1e-12, "| the loss, to 1e-12:", abs(loss_c - loss_1) <= 1e-12 * loss_1,
      "| one step lowered it:", loss_after < loss_c)


# %% [markdown]
# Ring attention's backward (`ring_flash_attn_backward`) visits the same pairs. Device $p$ keeps
# $q_p$, the forward's $o_p$ and $\mathrm{lse}_p$, $dO_p$ and its $dQ_p$; the key/value shards
# travel as in the forward, and on a second ring each shard's running $dK_j$, $dV_j$: at step $t$
# device $p$ adds its pair's shares to shard $j = (p - t) \bmod P$'s and passes them on, so after
# $P$ steps they are back at device $j$. Each block is `flash_attention_backward` with the ring
# forward's `out` and `lse`, pinned to the device's worker.

# %%
dout_r = rng.standard_normal((n_ring, d))
query_side = [client.scatter((q_r[rows[p]], ring_out[rows[p]], ring_lse[rows[p]],
                              dout_r[rows[p]]), workers=[home[p]]) for p in range(devices)]


def ring_block_grads(query_side, kv, causal):
    """One ring step's block: (dq, dk, dv) of device p's queries against the shard it holds."""
    q_p, out_p, lse_p, dout_p = query_side
    return flash_lib.flash_attention_backward(q_p, *kv, out_p, lse_p, dout_p, causal=causal)


def add_to(total, block, part):
    """A running sum: `total` (None: nothing yet) plus the part of block's (dq, dk, dv)."""
    return block[part] if total is None else tuple(a + b for a, b in zip(total, block[part]))


dq_state, dkv_state = [None] * devices, [None] * devices
visits = [[] for _ in range(devices)]  # visits[j]: the devices that added to dK_j, dV_j, in order
for t in range(devices):
    for p in range(devices):
        j = (p - t) % devices
        if j > p:  # causal: the same pairs as the forward's schedule
            continue
        block = client.submit(ring_block_grads, query_side[p], kv_f[j], t == 0,
                              workers=[home[p]], **pinned)
        dq_state[p] = client.submit(add_to, dq_state[p], block, slice(0, 1), workers=[home[p]],
                                    **pinned)
        # device p adds to shard j's running gradients, which the ring brought here from p - 1
        dkv_state[j] = client.submit(add_to, dkv_state[j], block, slice(1, 3), workers=[home[p]],
                                     **pinned)
        visits[j].append(p)
# after the last step the ring hands each shard's gradients back to its own device
dkv_state = [client.submit(lambda x: x, dkv_state[j], workers=[home[j]], **pinned)
             for j in range(devices)]
ring_dq = np.concatenate([g[0] for g in client.gather(dq_state)])
ring_dkv = client.gather(dkv_state)
ring_dk, ring_dv = (np.concatenate([g[i] for g in ring_dkv]) for i in range(2))
ring_grads_ref = flash_lib.flash_attention_backward(q_r, k_r, v_r, ring_ref, ring_ref_lse, dout_r,
                                                    causal=True)
ring_grad_err = max(float(flash_lib.rowwise_relative_error(g, r).max())
                    for g, r in zip((ring_dq, ring_dk, ring_dv), ring_grads_ref))
holders = client.who_has(dq_state + dkv_state)
grads_home = [list(holders[f.key])[0] for f in dq_state + dkv_state]
print("ring backward equals flash_attention_backward (rowwise <= 1e-12):", ring_grad_err <= 1e-12,
      "| each device's dq stayed home, and each shard's dk, dv came home:", grads_home == home + home)
ring_backward_pairs = {(p, j) for j in range(devices) for p in visits[j]}
backward_graph_pairs = {key[1:] for key in flash_dask.dask_attention_backward(
    *(da.from_array(x, chunks=(ring_rows, d)) for x in (q_r, k_r, v_r, ring_ref)),
    da.from_array(ring_ref_lse, chunks=(ring_rows,)), da.from_array(dout_r, chunks=(ring_rows, d)),
    causal=True)[0].__dask_graph__() if str(key[0]).startswith("flash-attention-backward-pair-")}
print("the same (query shard, key shard) pairs as dask_attention_backward's graph, and as the "
      "forward's:", ring_backward_pairs == backward_graph_pairs == ring_pairs)


# %% [markdown]
# ## A worker killed in the middle of a computation
#
# Machines fail. Every result of the graph is a pure function of its inputs, so when a worker
# dies the scheduler recomputes what died with it. The causal graph runs again (36 pair tasks);
# as the 6th result arrives, `flash_dask.KillWorkerAt`, a scheduler plugin, kills with `SIGKILL`
# the worker process holding most of the 6, at the same point of the graph on any machine. The
# nanny starts a new process; the scheduler's warning that results were lost is caught.

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
# ## What changes on GPUs
#
# Only the communication changes, not the algorithm (shards, partial $(o, \mathrm{lse})$, the
# merge).
#
# - **Collectives instead of a scheduler.** ring-flash-attention's `RingComm` passes the shards
#   with `torch.distributed.batch_isend_irecv`; Llama 3's context parallelism (arXiv 2407.21783)
#   all-gathers the keys and values instead.
# - **Overlapping communication with compute.** `ring_flash_attn_forward` sends the current shard
#   *before* computing with it, hiding the transfer when the step's $4\, c_q c_k d$ flops
#   outlast its $2\, c_k d$ numbers: with $F$ flop/s, $B$ bytes/s of link and $b$ bytes a number,
#   when $c_q \ge F b / (2B)$, whatever the key shard.
# - **The merge in fp32**, even for 16-bit inputs (`flash_dask` too keeps float16 partials in
#   float32 and rounds once).

# %% [markdown]
# ## What we showed
#
# - `dask_attention`'s graph is the tile schedule one level up: 64 pair tasks over $8 \times 8$
#   shards, 36 $= n(n+1)/2$ causal, in ring-order chains (10 running-state steps, 7 merges),
#   equal to `flash_attention` to $10^{-12}$ on 2 processes.
# - Flash-decoding: 16 pair tasks in 4 chains and 1 merge for 65536 keys.
# - Ring attention with zhuzilin's update rule computes the graph's pairs, device $p$ doing
#   $p + 1$, its state never leaving its worker; in the backward each shard's $dK_j$, $dV_j$
#   travels with it and comes home.
# - A training step on the cluster matched one machine's $dL/dW$ to $10^{-12}$.
# - A worker killed mid-computation cost recomputation, not exactness.

# %%
client.close()
cluster.close()
assert sorted(worker_threads.values()) == [1, 1]
assert full_pairs == n_shards**2 == 64
assert causal_pairs == schedule_tiles == n_shards * (n_shards + 1) // 2 == 36
assert fold_steps == expected_folds == 10 and merge_tasks == expected_merges == 7
assert err_out <= 1e-12 and err_lse <= 1e-12 and dec_err <= 1e-12 and ring_err <= 1e-12
assert abs(got_dec_lse[0] - ref_dec_lse[0]) <= 1e-12 and np.abs(ring_lse - ring_ref_lse).max() <= 1e-12
assert len(pair_worker) == causal_pairs and len(computed_by) == 2
# the graph's pairs are the causal ones: 28 full, 8 on the diagonal, the 28 above it left out
assert graph_pairs_main == {(i, j) for i in range(n_shards) for j in range(i + 1)}
assert (kind_counts["full"], kind_counts["diagonal"], kind_counts["skipped"]) == (28, 8, 28)
assert dec_pairs == 16 and dec_chains == 4 and dec_merges == 1 and states_home == home
# the ring computes dask_attention's causal pairs, n(n+1)/2 = 10, device p the p + 1 of its shard
assert ring_pairs == graph_pairs and len(graph_pairs) == devices * (devices + 1) // 2
assert work_per_device.tolist() == graph_per_shard == [p + 1 for p in range(devices)]
# the sigmoid update is merge_attention rewritten
a = flash_lib.flash_attention(q_r[:8], k_r[:100], v_r[:100], return_lse=True)
b = flash_lib.flash_attention(q_r[:8], k_r[100:300], v_r[100:300], return_lse=True)
m_out, m_lse = flash_lib.merge_attention(*a, *b)
r_out, r_lse = ring_update(a, b)
assert np.abs(m_out - r_out).max() < 1e-14 and np.abs(m_lse - r_lse).max() < 1e-13
assert forward_tasks == backward_tasks == 10 and loss_after < loss_c
assert grad_err <= 1e-12 and abs(loss_c - loss_1) <= 1e-12 * loss_1
assert ring_grad_err <= 1e-12 and grads_home == home + home
# the ring backward's (device, shard) pairs are dask_attention_backward's and the forward's
assert ring_backward_pairs == backward_graph_pairs == ring_pairs
assert all(value is None for value in worker_trim.values())
# the worker killed: recomputation, not a different result
assert victim is not None and finished == 6 and held >= 1
assert lost_warning and recomputed > 0 and replaced
assert kill_err <= 1e-12

"""Attention over a Dask cluster: ``flash_lib``'s tiles, one level up.

:func:`dask_attention` computes exactly what :func:`flash_lib.flash_attention` computes, for
inputs too long for one process's time or memory. The sequences are cut into *shards* (the
chunks of Dask arrays along the sequence axis -2), and the work is a task graph:

* one **pair task** per (query shard ``i``, key shard ``j``) that holds at least one allowed
  (query, key) pair: ``flash_attention(q_i, k_j, v_j, ..., return_lse=True)``, which returns
  the shard's partial output ``out_ij`` and its log-sum-exp ``lse_ij``;
* the pair tasks of a query shard are folded in **chains**, ring attention's data flow: the
  query shard visits its key shards in the ring's order (``i``, ``i - 1``, ... modulo the
  number of key shards; causal: from the diagonal down), cut into ``split_every`` runs of
  consecutive ones, and in a run each pair task takes the running ``(out, lse)`` of the one
  before and merges its own partial into it (:func:`flash_lib.merge_attention`, the merge
  chapter 3 derives). Dask runs a task where most of its input bytes are, so a chain's running
  state stays on its worker and the key and value shards come to it (each fetched once per
  worker, then kept);
* per query shard one **merge task** folds the ends of its chains, at most ``split_every``
  of them.

This is the kernel's own schedule with a shard in place of a tile: ``tile_schedule(Nq, Nk,
shard_q, shard_k, causal)`` lists exactly the pair tasks for evenly sized shards. Causal shard
pairs wholly above the (bottom-right aligned) diagonal are never put in the graph, and neither
are the shard pairs of a NumPy ``mask`` that allow nothing. Nothing here starts a cluster: the
graph runs on whatever scheduler computes it (threads, processes, ``distributed``).

:func:`dask_attention_backward` is the same graph for the gradients: one
``flash_attention_backward`` task per shard pair of the forward (one helper selects the pairs
for both), given the forward's global ``out`` and ``lse`` of its query shard, which make the
pair's terms exactly its share of the gradients; ``dq`` is summed along the forward's chains
(each step adds its share to the running ``dq`` it is given) and one addition of their ends,
``dk`` and ``dv`` over query shards by trees of fan-in ``split_every``.

Dropout and attention sinks (``dropout_p``, ``dropout_seed``, ``sinks``) keep both graphs as they
are. Each pair task passes flash_lib ``dropout_offset`` = the global position of its first query
row and key (a causal pair cut at the diagonal passes its bottom part's own), and flash_lib draws
an element's keep bit from its global (b, i, j) alone: the cluster's mask is one machine's, bit
for bit. A sink is one more partial state, ``(out 0, lse = sink)``: merged once per query shard,
after the merge of its chains; the pair tasks never see it (in each pair it would count once per key
shard). The backward's pairs need no sink either (the lse they are given holds it), and
``dsinks`` is computed once per query shard from its ``lse`` and ``D = rowsum(dout ∘ out)``, then
summed over the shards.

Why chains and :data:`QUIET_CLUSTER`, from where the time of a 2-worker forward went
(``bench/bench_dask.py``; ``bench/RESULTS.md``, 2026-12-01 and 2026-12-02, has the figures). When
each query shard's pair results were merged by a tree, nearly every partial output travelled to
another worker's merge; with chains the running state stays on its worker and only chain ends
meet, so the workers spend almost none of their time on transfers. What was left, a pair task
running slower beside another one than alone, was not the caches but Dask's housekeeping on
timers (the workers' statistical profiler, the system monitor, every server's event-loop tick),
whose CPU comes from the cores the workers compute on: :data:`QUIET_CLUSTER` slows it down.

Memory: a pair task holds its q, k and v shards, the running state, its partial result and
``flash_attention``'s tile scratch, so a worker's working set is set by the shard sizes, never
by ``Nq`` or ``Nk``. A query shard's chains keep ``split_every`` running states at most.

Within one process a ``flash_attention`` call already spreads over the cores (its own thread
pool, ``FLASH_LIB_THREADS``), so Dask threads in the same process add no parallelism: run the
graph on a cluster of processes (``distributed.LocalCluster(processes=True)``, or machines),
one thread per worker, for shards to run side by side.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import numbers
import operator
import os
import signal

import dask
import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph
from distributed.diagnostics.plugin import SchedulerPlugin

import flash_lib

__all__ = ["DEFAULT_SHARD", "QUIET_CLUSTER", "dask_attention", "dask_attention_backward",
           "attention_task_count", "backward_task_count", "KillWorkerAt"]

#: Dask settings for a compute-bound graph on a machine with no core to spare: the workers'
#: statistical profiler off (it samples every thread's stack every 10 ms, for the dashboard's
#: profile page), the system monitor every 10 s instead of 0.5 s (the dashboard's CPU and
#: network plots) and the event-loop tick every 1 s instead of 20 ms (it measures how long the
#: loop was blocked, for the "unresponsive" warning). Nothing a computation needs: set them
#: before the cluster starts, ``with dask.config.set(QUIET_CLUSTER): LocalCluster(...)``
#: (``bench/RESULTS.md`` says what they cost).
QUIET_CLUSTER = {
    "distributed.worker.profile.enabled": False,
    "distributed.admin.system-monitor.interval": "10s",
    "distributed.admin.tick.interval": "1s",
}

#: Rows per shard along the sequence axis when a NumPy array is wrapped (and no Dask input fixes
#: the chunks). At d = 64 in float64 a 4096-row shard is 2 MiB, and a 4096 × 4096 pair task
#: does 4.3 GFLOP in 64 of flash_lib's default 512 × 512 tiles: long enough (a fraction of a
#: second) that Dask's overhead per task, about a millisecond, is noise.
DEFAULT_SHARD = 4096

_PAIR = "flash-attention-pair-"
_MERGE = "flash-attention-merge-"
_EMPTY = "flash-attention-empty-"
_BPAIR = "flash-attention-backward-pair-"
_BSHARE = "flash-attention-backward-share-"
_BSUM = "flash-attention-backward-sum-"
_SINK = "flash-attention-sink-"
_DSINKS = "flash-attention-backward-dsinks-"


def dask_attention(q, k, v, *, mask=None, causal=False, scale=None, return_lse=False,
                   split_every=None, dropout_p=0.0, dropout_seed=None, sinks=None):
    """Exact attention as a Dask task graph of shard pairs, merged by log-sum-exp.

    Same semantics as :func:`flash_lib.flash_attention`: ``out = softmax(scale · q kᵀ) v`` with
    broadcasting over the leading (batch) axes, ``mask`` True where query ``i`` may attend key
    ``j``, bottom-right causal (key ``j`` allowed for query ``i`` iff ``j <= i + (Nk - Nq)``), and
    rows with no allowed key giving ``out`` 0 and ``lse`` -inf.

    Parameters
    ----------
    q, k, v : dask or NumPy arrays of shape ``(..., Nq, d)``, ``(..., Nk, d)``, ``(..., Nk, dv)``
        Dask arrays are chunked along the sequence axis -2 only: every other axis must be one
        chunk, and ``k`` and ``v`` must have the same chunks along -2. A NumPy array is wrapped
        with ``dask.array.from_array``: along -2 it takes the chunks of the Dask array it must
        agree with (``k`` or ``v``, or a Dask ``mask``), else :data:`DEFAULT_SHARD` rows.
    mask : bool dask or NumPy array broadcastable to ``(..., Nq, Nk)``, optional
        A Dask mask must be chunked like ``q`` along its axis -2 and like ``k`` along its axis -1
        (an axis of length 1 is one chunk), with its other axes in one chunk. A NumPy mask is
        inspected while the graph is built: shard pairs it forbids entirely get no task.
    causal : bool
        Bottom-right aligned; shard pairs wholly above the diagonal get no task.
    scale : float, optional
        Multiplies the scores; default ``1 / sqrt(d)``.
    return_lse : bool
        Also return the log-sum-exp of each row's scaled, masked scores.
    split_every : int >= 2, optional
        How many chains a query shard's pair tasks are folded in, and so the fan-in of its one
        merge task: ``min(split_every, pairs)`` runs of consecutive pairs in ring order, their
        lengths differing by at most one. Fewer chains move fewer partial states between
        workers (at most ``split_every - 1`` per query shard); more let one query shard's pairs
        run side by side (flash-decoding, ``Nq = 1``, has one query shard). Default
        ``dask.config.get("split_every", 4)``, as for Dask's own reductions.
    dropout_p, dropout_seed : float in [0, 1) and int in [0, 2**64), optional
        Dropout, as ``flash_attention``'s: each pair task calls it with ``dropout_offset`` = the
        global positions of its first query row and its first key, so every element (b, i, j)
        draws its keep bit at its own global counter and the cluster's mask is
        ``flash_lib.dropout_keep(dropout_seed, dropout_p, out.shape[:-1] + (Nk,))``, bit for bit,
        whatever the shards. The partials' lse are the undropped ones, so they merge as without
        dropout.
    sinks : array broadcastable to the batch dims, optional
        Attention sinks, as ``flash_attention``'s (one logit per head). A sink is one more partial
        state, ``(out 0, lse = sink)``: the pair tasks run without it and each query shard merges
        it exactly once, after the merge of its chains (in every pair it would count once per key
        shard).

    Returns
    -------
    out : dask.array.Array
        Shape ``(..., Nq, dv)`` (the broadcast batch shape), chunked like ``q`` along -2 and in
        one chunk along every other axis; in the inputs' dtype.
    lse : dask.array.Array
        Shape ``(..., Nq)``, only with ``return_lse=True``; float32 for 16-bit inputs, else the
        inputs' dtype. ``out`` and ``lse`` share one graph: ``dask.compute(out, lse)`` runs it
        once.

    Raises
    ------
    TypeError
        Non-float inputs, a non-boolean mask, a non-bool ``causal`` (as ``flash_attention``).
    ValueError
        Bad shapes or ``scale``; Dask arrays with unknown chunk sizes, chunked along the feature
        axis or a batch axis, ``k`` and ``v`` chunked differently, a mask chunked inconsistently
        with ``q`` and ``k``; ``split_every`` not an integer >= 2. Each names the argument and
        the chunks found.

    Notes
    -----
    float16 and bfloat16 inputs: ``flash_attention`` computes them in float32, and so do the
    pair tasks and the merges here; the output is rounded to the 16-bit dtype once, at the end.
    """
    s = _shards(q, k, v, mask, causal=causal, scale=scale, split_every=split_every,
                dropout_p=dropout_p, dropout_seed=dropout_seed, sinks=sinks)
    q, k, v, mask, sinks, dropout, split_every = (s.q, s.k, s.v, s.mask, s.sinks, s.dropout,
                                                  s.split_every)
    batch, dv, q_chunks, k_chunks = s.checked.batch, s.checked.dv, s.q_chunks, s.k_chunks
    out_dtype, lse_dtype = s.checked.out_dtype, s.checked.dtype
    # flash_attention computes 16-bit inputs in float32, its lse's dtype; keeping the partials in
    # that dtype too means the only 16-bit rounding is the final one, as in one call.
    work = lse_dtype

    token = tokenize(q, k, v, mask, bool(causal), scale, split_every, dropout, sinks)
    pair_name, merge_name, empty_name = _PAIR + token, _MERGE + token, _EMPTY + token
    layer = {}
    finals = []
    q_starts, k_starts = _starts(q_chunks), _starts(k_chunks)
    for i, n_qi in enumerate(q_chunks):
        row = s.pairs.get(i, {})
        parts = []
        for chain in _chains(_ring_order(i, row, len(k_chunks)), split_every):
            state = None
            for j in chain:
                key = (pair_name, i, j)
                # scale=None lets every shard's flash_attention pick the default, 1/sqrt(d)
                task = functools.partial(_attend_pair, scale=scale, delta=row[j], work=work,
                                         dropout=dropout, offset=(q_starts[i], k_starts[j]))
                shards = (_block_key(q, i), _block_key(k, j), _block_key(v, j)) + (
                    () if mask is None else (_mask_key(mask, i, j),))
                # the chain's running state is an input: the step runs where the state is
                layer[key] = ((task, *shards) if state is None
                              else (functools.partial(_fold_pair, task), state, *shards))
                state = key
            parts.append(state)
        if not parts:  # no key at all for this shard's queries
            key = (empty_name, i)
            layer[key] = (functools.partial(_no_keys, batch + (n_qi,), dv, work),)
            parts = [key]
        final = _tree(layer, (merge_name, i), parts, split_every, _merge_parts)
        if sinks is not None:  # the sink: one more partial, merged once per query shard
            layer[(_SINK + token, i)] = (functools.partial(_merge_sink, sink=_batch_sinks(
                sinks, batch, work)), final)
            final = (_SINK + token, i)
        finals.append(final)

    inputs = [x for x in (q, k, v, mask) if x is not None]
    graph = HighLevelGraph.from_collections(pair_name, layer, dependencies=inputs)
    zeros = (0,) * len(batch)
    take_out = functools.partial(_take_out, dtype=out_dtype)
    out = _new_array(graph, pair_name, "flash-attention-out-" + token,
                     {zeros + (i, 0): (take_out, f) for i, f in enumerate(finals)},
                     tuple((b,) for b in batch) + (q_chunks, (dv,)), out_dtype)
    if not return_lse:
        return out
    lse = _new_array(graph, pair_name, "flash-attention-lse-" + token,
                     {zeros + (i,): (operator.getitem, f, 1) for i, f in enumerate(finals)},
                     tuple((b,) for b in batch) + (q_chunks,), lse_dtype)
    return out, lse


def attention_task_count(array):
    """The number of pair tasks (``flash_attention`` calls) in the graph of ``array``.

    ``array`` is an ``out`` or ``lse`` returned by :func:`dask_attention`; counted in the graph
    as built, before Dask's optimisations (which may fuse or rename tasks).
    """
    return sum(1 for key in array.__dask_graph__()
               if isinstance(key, tuple) and str(key[0]).startswith(_PAIR))


def dask_attention_backward(q, k, v, out, lse, dout, *, mask=None, causal=False, scale=None,
                            split_every=None, dropout_p=0.0, dropout_seed=None, sinks=None):
    """The gradients of :func:`dask_attention` as a Dask task graph of the same shard pairs.

    Same semantics as :func:`flash_lib.flash_attention_backward`: the gradients of
    ``sum(dout * out)`` with respect to ``q``, ``k`` and ``v``, ``out`` and ``lse`` being what
    the forward returned for the same arguments.

    One **pair task** per shard pair the forward computes (the same selection: causal and NumPy
    mask) calls ``flash_lib.flash_attention_backward`` on query shard ``i`` and key shard ``j``
    with the forward's *global* ``out_i`` and ``lse_i``. That is exactly the pair's share of the
    gradients: ``P_ij = exp(S_ij - lse_i)`` with the global ``lse_i`` is the block of the global
    softmax, and ``D_i = rowsum(dout_i ∘ out_i)``, which the backward computes from the ``out``
    it is given, is the global ``D_i``; so ``dS_ij = P_ij ∘ (dout_i v_jᵀ - D_i)`` is the global
    ``dS`` restricted to the pair, and ``dq_i = Σ_j dS_ij k_j``, ``dk_j = Σ_i dS_ijᵀ q_i``,
    ``dv_j = Σ_i P_ijᵀ dout_i`` are sums of the pairs' shares. ``dq_i`` is summed over its key
    shards along the forward's chains (ring order, ``split_every`` runs of consecutive pairs):
    each pair task is given the running ``dq_i`` of the step before and returns it with its own
    share added, so the running sum stays on its worker; one addition then sums the chains'
    ends. ``dk_j`` and ``dv_j`` are summed over their query shards by trees of additions of
    fan-in ``split_every``. (``D_i`` costs ``O(rows · dv)`` per pair against the pair's
    ``O(rows · keys · d)``: it is recomputed in each pair rather than sent as one more input.)

    With dropout each pair task regenerates the forward's keep mask from the seed at its global
    positions (``dropout_offset``, as in the forward). With sinks the pair tasks run without
    them (the lse they are given already holds the sink, and given the lse the tile loop is the
    same), and ``dsinks = -Σ_i exp(sink - lse_i)·D_i`` is computed once per query shard from its
    ``lse``, ``out`` and ``dout`` (``D_i = rowsum(dout_i ∘ out_i)``), then summed over the
    shards by a tree of fan-in ``split_every``.

    Parameters
    ----------
    q, k, v, mask, causal, scale, dropout_p, dropout_seed, sinks
        As for :func:`dask_attention`, with the same chunking rules, and the same as the
        forward call.
    split_every : int >= 2, optional
        The number of chains ``dq_i`` is summed along (as the forward's) and the fan-in of the
        additions: of the chains' ends, of the trees over the query shards of ``dk_j`` and
        ``dv_j``, and of ``dsinks``' sum over the query shards. Default as for
        :func:`dask_attention`.
    out, lse : dask or NumPy arrays
        What ``dask_attention(..., return_lse=True)`` (or ``flash_lib.flash_attention``)
        returned: shapes ``(..., Nq, dv)`` and ``(..., Nq)``, ``...`` the broadcast batch. Dask
        arrays must be chunked like ``q`` along the query axis (-2 for ``out``, -1 for
        ``lse``), with every other axis one chunk.
    dout : dask or NumPy array of the shape of ``out``, chunked like it
        The gradient of the loss with respect to ``out``.

    Returns
    -------
    dq, dk, dv : dask.array.Array
        Each of its input's shape and dtype, chunked like it along -2 and in one chunk along
        every other axis. An input broadcast over leading dims gets the sum of the gradients
        over those dims, as in ``flash_attention_backward``. ``dask.compute(dq, dk, dv)`` runs
        the graph once.
    dsinks : dask.array.Array
        Only with ``sinks``: of sinks' shape (one chunk), summed over the axes they were
        broadcast along, in the compute dtype (float32 for 16-bit inputs), as
        ``flash_attention_backward``'s.

    Raises
    ------
    TypeError, ValueError
        As :func:`dask_attention`, and as ``flash_attention_backward`` for ``out``, ``lse`` and
        ``dout`` (dtype, shape), or chunks of theirs inconsistent with ``q``'s.

    Notes
    -----
    16-bit inputs are computed in float32, as by ``flash_attention_backward``, and the sums of
    the shares too; each gradient is rounded to its input's dtype once, at the end.
    """
    s = _shards(q, k, v, mask, causal=causal, scale=scale, split_every=split_every,
                dropout_p=dropout_p, dropout_seed=dropout_seed, sinks=sinks,
                saved={"out": out, "dout": dout, "lse": lse})
    q, k, v, mask, sinks, dropout, split_every = (s.q, s.k, s.v, s.mask, s.sinks, s.dropout,
                                                  s.split_every)
    out, dout, lse = s.saved["out"], s.saved["dout"], s.saved["lse"]
    batch, q_chunks, k_chunks = s.checked.batch, s.q_chunks, s.k_chunks
    # the gradients' dtypes, as flash_attention_backward returns them (dsinks: the compute dtype)
    dtypes = [q.dtype, k.dtype, v.dtype, s.checked.dtype]
    work = np.result_type(np.float32, *dtypes[:3])  # 16-bit -> float32, as flash_lib computes

    token = tokenize(q, k, v, out, lse, dout, mask, bool(causal), scale, split_every, dropout,
                     sinks)
    pair_name, share_name, sum_name = _BPAIR + token, _BSHARE + token, _BSUM + token
    layer = {}
    q_starts, k_starts = _starts(q_chunks), _starts(k_chunks)
    shares = {"dq": {}, "dk": {}, "dv": {}}  # gradient -> shard -> keys of its shares
    for i, row in s.pairs.items():
        for chain in _chains(_ring_order(i, row, len(k_chunks)), split_every):
            running = None  # the chain's running dq: each step adds its pair's share to it
            for j in chain:
                key = (pair_name, i, j)
                task = functools.partial(_backward_pair, scale=scale, delta=row[j], work=work,
                                         dropout=dropout, offset=(q_starts[i], k_starts[j]))
                args = (_block_key(q, i), _block_key(k, j), _block_key(v, j),
                        _block_key(out, i), _lse_key(lse, i), _block_key(dout, i)) + (
                    () if mask is None else (_mask_key(mask, i, j),))
                layer[key] = ((task, *args) if running is None
                              else (functools.partial(_fold_backward, task), running, *args))
                # one small task per share, where the pair ran: the next step of the chain,
                # and a sum of dk or dv, then move only the share they need
                for index, grad in enumerate(("dq", "dk", "dv")):
                    layer[(share_name, grad, i, j)] = (operator.getitem, key, index)
                for grad in ("dk", "dv"):
                    shares[grad].setdefault(j, []).append((share_name, grad, i, j))
                running = (share_name, "dq", i, j)
            shares["dq"].setdefault(i, []).append(running)

    arrays = []
    for grad, x, chunks, index in (("dq", q, q_chunks, 0), ("dk", k, k_chunks, 1),
                                   ("dv", v, k_chunks, 2)):
        roots = {}
        for s, n_s in enumerate(chunks):
            parts = shares[grad].get(s)
            if not parts:  # no allowed pair for this shard: its gradient is exactly 0
                key = (sum_name, grad, s, "zeros")
                layer[key] = (np.zeros, x.shape[:-2] + (n_s, x.shape[-1]), work)
                parts = [key]
            roots[s] = _tree(layer, (sum_name, grad, s), parts, split_every, _add_parts)
        arrays.append((grad, x, chunks, index, roots))

    dsinks_root = None
    if sinks is not None:  # once per query shard, from its lse, out and dout; then summed
        name = _DSINKS + token
        share = functools.partial(_dsinks_share, sink=_batch_sinks(sinks, batch, work),
                                  shape=sinks.shape)
        parts = []
        for i in range(len(q_chunks)):
            layer[(name, i)] = (share, _block_key(out, i), _lse_key(lse, i), _block_key(dout, i))
            parts.append((name, i))
        dsinks_root = _tree(layer, (name, "sum"), parts, split_every, _add_parts)

    inputs = [x for x in (q, k, v, out, lse, dout, mask) if x is not None]
    graph = HighLevelGraph.from_collections(pair_name, layer, dependencies=inputs)
    results = []
    for grad, x, chunks, index, roots in arrays:
        zeros = (0,) * (x.ndim - 2)
        cast = functools.partial(_cast, dtype=dtypes[index])
        results.append(_new_array(
            graph, pair_name, f"flash-attention-{grad}-" + token,
            {zeros + (s, 0): (cast, root) for s, root in roots.items()},
            tuple((b,) for b in x.shape[:-2]) + (chunks, (x.shape[-1],)), dtypes[index]))
    if dsinks_root is not None:
        cast = functools.partial(_cast, dtype=dtypes[3])
        results.append(_new_array(graph, pair_name, "flash-attention-dsinks-" + token,
                                  {(0,) * sinks.ndim: (cast, dsinks_root)},
                                  tuple((n,) for n in sinks.shape), dtypes[3]))
    return tuple(results)


def backward_task_count(array):
    """The number of pair tasks (``flash_attention_backward`` calls) in the graph of ``array``.

    ``array`` is a ``dq``, ``dk`` or ``dv`` returned by :func:`dask_attention_backward`;
    counted in the graph as built, like :func:`attention_task_count` (which counts the
    forward's pair tasks, also in this graph when ``out`` and ``lse`` are Dask arrays of it).
    """
    return sum(1 for key in array.__dask_graph__()
               if isinstance(key, tuple) and str(key[0]).startswith(_BPAIR))


class KillWorkerAt(SchedulerPlugin):
    """Fault injection, for demonstrations and tests: a scheduler plugin that, when the
    ``after``-th task whose key starts with ``prefix`` (e.g. ``"flash-attention-pair-"``) reaches
    memory, SIGKILLs the worker process holding the most such results, there and then, inside the
    scheduler's own transition. The kill comes at a known point of the graph (``after`` of those
    tasks done, the rest to run), whatever the machine's speed or load: nothing polls a clock.

    For a cluster whose workers run on the scheduler's machine (a ``LocalCluster`` of processes):
    ``client.register_plugin(KillWorkerAt(prefix, after))`` before computing, and
    ``client.run_on_scheduler(KillWorkerAt.report)`` after, which returns ``(victim address,
    results it held, tasks finished when it struck)`` (the address None if it never struck) and
    removes the plugin. Chapter 22 kills a worker with it; ``tests/test_dask.py`` too.
    """

    name = "flash-dask-kill-worker-at"

    def __init__(self, prefix, after):
        self.prefix, self.after = prefix, after
        self.finished, self.struck = set(), None

    async def start(self, scheduler):
        self.scheduler = scheduler

    def transition(self, key, start, finish, *args, **kwargs):
        if (self.struck is not None or finish != "memory" or not isinstance(key, tuple)
                or not str(key[0]).startswith(self.prefix)):
            return
        self.finished.add(key)
        if len(self.finished) < self.after:
            return
        held = collections.Counter()
        for done in self.finished:
            ts = self.scheduler.tasks.get(done)
            if ts is not None and ts.state == "memory":
                held.update(ws.address for ws in ts.who_has)
        victim = max(held, key=held.get)
        os.kill(self.scheduler.workers[victim].pid, signal.SIGKILL)
        self.struck = (victim, held[victim], len(self.finished))

    @staticmethod
    def report(dask_scheduler):
        """Scheduler side (``client.run_on_scheduler(KillWorkerAt.report)``): what the plugin
        did, ``(victim, results it held, tasks finished)``; removes it."""
        plugin = dask_scheduler.plugins.pop(KillWorkerAt.name)
        return plugin.struck or (None, 0, len(plugin.finished))


# --------------------------------------------------------------------------------------------
# The tasks: what a worker runs. Plain module-level functions, so they pickle by reference.
# --------------------------------------------------------------------------------------------


def _attend_pair(q, k, v, mask=None, *, scale, delta, work, dropout, offset):
    """One query shard against one key shard: ``(out, lse)`` of ``flash_attention``.

    ``delta`` is None when every (query, key) pair of the shards is allowed by causality (or
    causal is off); else the pair crosses the diagonal, and query ``r`` may see key ``c`` of the
    shards iff ``c <= r + delta``. flash_attention's causal mask is aligned to the bottom-right
    corner of the arrays it is given, that is ``c <= r + (n_k - n_q)``, so the shards are cut
    until that corner lies on the diagonal; flash_attention then skips its own tiles above it.
    ``offset`` is the global (query, key) position of the shards' first row and key: each call
    passes its own first row's as ``dropout_offset`` (the bottom part of a cut shard starts
    ``n`` rows further down), so every element keeps its global keep bit.
    """
    q, k, v = (x.astype(work, copy=False) for x in (q, k, v))  # 16-bit -> float32 only
    parts = [flash_lib.flash_attention(q[..., rows, :], k[..., keys, :], v[..., keys, :],
                                       mask=_cut(_cut(mask, -2, rows), -1, keys), causal=causal,
                                       scale=scale, return_lse=True,
                                       **_at(dropout, offset[0] + rows.start, offset[1]))
             for rows, keys, causal in _diagonal_cut(q.shape[-2], k.shape[-2], delta)]
    if len(parts) == 1:
        return parts[0]
    return (np.concatenate([o for o, _ in parts], axis=-2),
            np.concatenate([s for _, s in parts], axis=-1))


def _backward_pair(q, k, v, out, lse, dout, mask=None, *, scale, delta, work, dropout, offset):
    """One query shard against one key shard: its shares ``(dq, dk, dv)`` of the gradients.

    ``out`` and ``lse`` are the forward's global ones for the query shard (see
    :func:`dask_attention_backward`); ``delta`` and ``offset`` as for :func:`_attend_pair`, and
    the shards are cut the same way so that flash_lib's bottom-right causal mask lies on the
    diagonal and each part regenerates its own rows' keep bits.
    """
    q, k, v, out, lse, dout = (x.astype(work, copy=False) for x in (q, k, v, out, lse, dout))
    n_k = k.shape[-2]
    parts = [flash_lib.flash_attention_backward(
                 q[..., rows, :], k[..., keys, :], v[..., keys, :], out[..., rows, :],
                 lse[..., rows], dout[..., rows, :], mask=_cut(_cut(mask, -2, rows), -1, keys),
                 causal=causal, scale=scale, **_at(dropout, offset[0] + rows.start, offset[1]))
             for rows, keys, causal in _diagonal_cut(q.shape[-2], n_k, delta)]
    if len(parts) == 1:
        dq, dk, dv = parts[0]
        return dq, _pad_rows(dk, n_k), _pad_rows(dv, n_k)  # keys past the diagonal: 0
    # the rows cut in two, each with every key: dq stacks, dk and dv add up
    (dq_top, dk_top, dv_top), (dq_bottom, dk_bottom, dv_bottom) = parts
    return np.concatenate([dq_top, dq_bottom], axis=-2), dk_top + dk_bottom, dv_top + dv_bottom


def _diagonal_cut(n_q, n_k, delta):
    """The calls a shard pair is cut into, so that flash_lib's bottom-right causal mask lies on
    the global diagonal: ``[(rows, keys, causal)]``, slices of the pair's queries and keys.

    ``delta`` None: the whole pair, not causal (causality allows every pair of it). Else query
    ``r`` may see key ``c`` iff ``c <= r + delta``: if the last query's diagonal ends inside the
    shard (``n_q + delta <= n_k``), the keys from ``n_q + delta`` on are past it and dropped, and
    the rest is causal; otherwise the first ``n_k - delta`` queries cross the diagonal (causal)
    and the others see every key of the shard (not causal).
    """
    if delta is None:
        return [(slice(0, n_q), slice(0, n_k), False)]
    if n_q + delta <= n_k:
        return [(slice(0, n_q), slice(0, n_q + delta), True)]
    n = n_k - delta
    return [(slice(0, n), slice(0, n_k), True), (slice(n, n_q), slice(0, n_k), False)]


def _fold_pair(attend, state, *shards):
    """A chain's step: this pair's ``(out, lse)`` (``attend``, one flash_attention call or
    two for a cut pair) merged into the running state of the query shard's earlier pairs."""
    return flash_lib.merge_attention(*state, *attend(*shards))


def _fold_backward(grads, running, *args):
    """A dq chain's step: this pair's shares ``(dq, dk, dv)`` (``grads``), its dq added to the
    running dq of the query shard's earlier pairs in the chain."""
    dq, dk, dv = grads(*args)
    return running + dq, dk, dv


def _at(dropout, q0, k0):
    """flash_lib's dropout keywords for a call whose first row and key are at (q0, k0)."""
    return {**dropout, "dropout_offset": (q0, k0)} if dropout else {}


def _merge_sink(part, sink):
    """Merge the sink into a query shard's final state, as the partial (out 0, lse = sink)."""
    out, lse = part
    sink = np.broadcast_to(sink, lse.shape).astype(lse.dtype)
    return flash_lib.merge_attention(out, lse, np.zeros_like(out), sink)


def _dsinks_share(out, lse, dout, *, sink, shape):
    """One query shard's share of dsinks: ``-Σ_i exp(sink - lse_i)·D_i`` over its rows,
    summed to the sinks' shape."""
    work = sink.dtype
    D = (dout.astype(work) * out.astype(work)).sum(axis=-1)
    share = -(np.exp(sink - lse.astype(work)) * D).sum(axis=-1)
    return flash_lib.sum_to(share, shape)


def _pad_rows(x, n):
    """``x`` with zero rows appended along -2 up to ``n`` rows (``x`` itself if it has them)."""
    if x.shape[-2] == n:
        return x
    pad = [(0, 0)] * x.ndim
    pad[-2] = (0, n - x.shape[-2])
    return np.pad(x, pad)


def _add_parts(*parts):
    """The sum of gradient shares of one shard, left to right."""
    return functools.reduce(operator.add, parts)


def _cast(x, dtype):
    return x.astype(dtype, copy=False)


def _cut(mask, axis, index):
    """``mask`` sliced along ``axis``, unless that axis has length 1 (it broadcasts)."""
    if mask is None or mask.shape[axis] == 1:
        return mask
    return mask[(Ellipsis, index) if axis == -1 else (Ellipsis, index, slice(None))]


def _merge_parts(*parts):
    """Fold partial ``(out, lse)`` states of disjoint key sets, left to right."""
    return functools.reduce(lambda a, b: flash_lib.merge_attention(*a, *b), parts)


def _no_keys(rows, dv, work):
    """The state of attending to no key at all: out 0, lse -inf (flash_attention's empty row)."""
    return np.zeros(rows + (dv,), dtype=work), np.full(rows, -np.inf, dtype=work)


def _take_out(part, dtype):
    return part[0].astype(dtype, copy=False)


# --------------------------------------------------------------------------------------------
# Input checking and the shards
# --------------------------------------------------------------------------------------------


def _dropout_keywords(dropout_p, dropout_seed):
    """flash_lib's dropout keywords, or none when dropout is off (no generator runs; flash_lib
    checks the values)."""
    if isinstance(dropout_p, numbers.Real) and dropout_p == 0 and dropout_seed is None:
        return {}
    return {"dropout_p": dropout_p, "dropout_seed": dropout_seed}


def _batch_sinks(sinks, batch, work):
    """The sinks broadcast to the batch dims, with a trailing axis for the rows, in ``work``."""
    return np.ascontiguousarray(np.broadcast_to(sinks.astype(work), batch)[..., None])


@dataclasses.dataclass(frozen=True)
class _Shards:
    """What the forward's and the backward's graphs start from (:func:`_shards`)."""

    q: da.Array
    k: da.Array
    v: da.Array
    mask: da.Array | None
    saved: dict  # the backward's out, dout, lse, as Dask arrays chunked like q
    checked: object  # flash_lib.check_inputs's record: batch, sizes, dtypes
    q_chunks: tuple
    k_chunks: tuple
    pairs: dict  # {i: {j: delta}}: the shard pairs that get a task (_shard_pairs)
    dropout: dict  # flash_lib's dropout keywords, {} without dropout
    sinks: np.ndarray | None
    split_every: int


def _shards(q, k, v, mask, *, causal, scale, split_every, dropout_p, dropout_seed, sinks,
            saved=None):
    """Check a call's arguments with flash_lib's own rules (shapes and dtypes only: nothing is
    computed), cut the sequences into shards (the chunks of the Dask inputs along -2; NumPy
    inputs wrapped to match) and choose the shard pairs that get a task. ``saved``: the
    backward's ``out``, ``dout`` and ``lse``, chunked like ``q``."""
    split_every = _check_split_every(split_every)
    q, k, v = (_as_array(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
    saved = {name: _as_array(name, x) for name, x in (saved or {}).items()}
    mask = None if mask is None else _as_array("mask", mask)
    if mask is not None and mask.ndim < 2:  # a (Nk,) or scalar mask broadcasts over queries too
        mask = mask.reshape((1,) * (2 - mask.ndim) + mask.shape)
    checked = flash_lib.check_inputs(q, k, v, mask=mask, causal=causal, scale=scale, sinks=sinks,
                                     dropout_p=dropout_p, dropout_seed=dropout_seed, **saved)
    n_q, n_k = checked.n_q, checked.n_k
    q_chunks, q_source = _sequence_chunks([("q", q, -2)] + [(name, x, -1 if name == "lse" else -2)
                                                            for name, x in saved.items()]
                                          + [("mask", mask, -2)], n_q)
    k_chunks, k_source = _sequence_chunks([("k", k, -2), ("v", v, -2), ("mask", mask, -1)], n_k)
    q = _as_dask("q", q, q_chunks, -2, partner=q_source)
    saved = {name: _as_dask(name, x, q_chunks, -1 if name == "lse" else -2, partner=q_source)
             for name, x in saved.items()}
    k = _as_dask("k", k, k_chunks, -2, partner=k_source)
    v = _as_dask("v", v, k_chunks, -2, partner=k_source)
    # A NumPy mask is known now: shard pairs it forbids get no task. A Dask mask is not.
    numpy_mask = None
    if mask is not None:
        if not isinstance(mask, da.Array):
            numpy_mask = np.broadcast_to(mask, mask.shape[:-2] + (n_q, n_k))  # a view
        mask = _as_dask("mask", mask, (q_chunks, k_chunks), None)
    return _Shards(q=q, k=k, v=v, mask=mask, saved=saved, checked=checked, q_chunks=q_chunks,
                   k_chunks=k_chunks,
                   pairs=_shard_pairs(n_q, n_k, q_chunks, k_chunks, causal, numpy_mask),
                   dropout=_dropout_keywords(dropout_p, dropout_seed),
                   sinks=None if sinks is None else np.asarray(sinks), split_every=split_every)


def _starts(chunks):
    """The global position of each shard's first row (Python ints)."""
    return [int(x) for x in np.cumsum((0,) + tuple(chunks))[:-1]]


def _check_split_every(split_every):
    if split_every is None:
        split_every = dask.config.get("split_every", 4)
    if (isinstance(split_every, bool) or not isinstance(split_every, numbers.Integral)
            or split_every < 2):
        raise ValueError(f"split_every must be an integer >= 2 (chains per query shard, the "
                         f"fan-in of the merges and sums), "
                         f"got {split_every!r}")
    return int(split_every)


def _as_array(name, x):
    """A Dask array as it is (with known chunk sizes), anything else as a NumPy array."""
    if not isinstance(x, da.Array):
        return np.asarray(x)
    if any(math.isnan(c) for axis in x.chunks for c in axis):
        raise ValueError(f"{name} has unknown chunk sizes {x.chunks}: call "
                         f"{name}.compute_chunk_sizes() first, or rechunk it")
    # An axis of length 1 is one chunk whatever empty chunks surround it, e.g. (0, 1, 0): the
    # element is where it is, and rechunking it moves nothing.
    single = {axis: -1 for axis, (n, chunks) in enumerate(zip(x.shape, x.chunks))
              if n == 1 and len(chunks) > 1}
    return x.rechunk(single) if single else x


def _sequence_chunks(candidates, n):
    """Chunks of a sequence axis of length ``n``, and the name of the array they come from: the
    first Dask array's, else DEFAULT_SHARD rows (from no array: None).

    A mask axis of length 1 (broadcast) says nothing about the shards and is passed over.
    """
    for name, x, axis in candidates:
        if isinstance(x, da.Array) and x.shape[axis] == n and (n != 1 or name != "mask"):
            return x.chunks[axis], name
    if n == 0:
        return (0,), None
    return tuple(min(DEFAULT_SHARD, n - s) for s in range(0, n, DEFAULT_SHARD)), None


def _as_dask(name, x, seq_chunks, seq_axis, partner=None):
    """Wrap a NumPy input with the given sequence chunks, or check a Dask input has them.

    For q, k, v (out, dout) ``seq_axis`` is -2 and ``seq_chunks`` its chunks, those of
    ``partner``; for an lse ``seq_axis`` is -1. For the mask (``seq_axis``
    None) ``seq_chunks`` is ``(q_chunks, k_chunks)`` for its axes -2 and -1. Every other axis,
    and an axis of length 1, is one chunk.
    """
    if seq_axis is None:
        wanted = [(-2, seq_chunks[0], "q's chunks along -2"),
                  (-1, seq_chunks[1], "k's chunks along -2")]
    else:
        wanted = [(seq_axis, seq_chunks, None)]
    expected = [(size,) for size in x.shape]
    for axis, chunks, _ in wanted:
        if x.shape[axis] != 1:
            expected[axis] = chunks
    expected = tuple(expected)
    if not isinstance(x, da.Array):
        return da.from_array(x, chunks=expected)
    for axis in range(x.ndim):
        if x.chunks[axis] == expected[axis]:
            continue
        if axis - x.ndim == -1 and seq_axis == -2:
            raise ValueError(f"{name} is chunked along its feature axis -1: chunks "
                             f"{x.chunks[axis]}, expected one chunk {expected[axis]}; shards "
                             f"split the sequence axis -2 only (rechunk with {{-1: -1}})")
        match = [why for a, _, why in wanted if a == axis - x.ndim]
        if match and match[0] is None:  # e.g. v against k: a sequence axis
            raise ValueError(f"{name} must be chunked like {partner} along the sequence axis "
                             f"(axis {seq_axis} of {name}), got {x.chunks[axis]} and "
                             f"{partner}'s {expected[axis]}")
        if match:
            raise ValueError(f"{name} is chunked {x.chunks[axis]} along axis {axis - x.ndim}, "
                             f"inconsistent with {match[0]} {expected[axis]}")
        raise ValueError(f"{name} is chunked {x.chunks[axis]} along axis {axis}, a batch "
                         f"axis: batch axes must be one chunk each (rechunk with {{{axis}: -1}})")
    return x


def _any_allowed(mask_block, delta):
    """Does a shard pair's block of the mask allow any pair, within causality (``delta``)?"""
    if delta is None:
        return bool(mask_block.any())
    n_q, n_k = mask_block.shape[-2:]
    # c <= r + delta: the top-left corner of a bottom-right aligned mask, grown by the shift
    shift = delta - (n_k - n_q)
    causal = flash_lib.causal_mask(n_q + max(-shift, 0), n_k + max(shift, 0))[:n_q, :n_k]
    return bool((mask_block & causal).any())


def _shard_pairs(n_q, n_k, q_chunks, k_chunks, causal, numpy_mask):
    """The shard pairs that get a task, forward and backward: ``{i: {j: delta}}`` in order.

    A pair is left out when causality forbids all of it (the kernel's own schedule, shards for
    tiles) or when a NumPy ``mask`` allows none of its pairs within causality. ``delta`` is None
    when causality allows every pair of the two shards (or causal is off); else the pair crosses
    the diagonal and query ``r`` of the shard may see key ``c`` iff ``c <= r + delta``.
    """
    q_starts, k_starts = np.cumsum((0,) + q_chunks), np.cumsum((0,) + k_chunks)
    scheduled = set(flash_lib.tile_schedule(n_q, n_k, q_chunks, k_chunks, causal))
    pairs = {}
    for i in range(len(q_chunks)):
        for j, n_kj in enumerate(k_chunks):
            if (q_starts[i], q_starts[i + 1], k_starts[j], k_starts[j + 1]) not in scheduled:
                continue  # empty, or wholly above the diagonal
            # In the pair's own coordinates, query r may see key c iff c <= r + delta.
            delta = int(q_starts[i] - k_starts[j] + (n_k - n_q))
            crossing = causal and delta < n_kj - 1  # else its first query sees every key
            if numpy_mask is not None and not _any_allowed(
                    numpy_mask[..., q_starts[i]:q_starts[i + 1], k_starts[j]:k_starts[j + 1]],
                    delta if crossing else None):
                continue
            pairs.setdefault(i, {})[j] = delta if crossing else None
    return pairs


def _ring_order(i, row, n_k):
    """Query shard ``i``'s key shards (the keys of ``row``) in ring attention's order: ``i``,
    ``i - 1``, ... modulo ``n_k``, the key shard device ``i`` holds at steps 0, 1, ... of the
    ring. Causal with ``Nq = Nk`` and even shards: the diagonal first, then down to shard 0."""
    return sorted(row, key=lambda j: (i - j) % n_k)


def _chains(order, count):
    """``order`` cut into ``min(count, len(order))`` runs of consecutive items, as even as
    possible (their lengths differ by at most one)."""
    count = min(count, len(order))
    return [order[c * len(order) // count:(c + 1) * len(order) // count] for c in range(count)]


def _tree(layer, prefix, parts, split_every, combine):
    """Add to ``layer`` a tree of ``combine`` tasks of fan-in ``split_every`` over ``parts``.

    The keys are ``prefix + (level, index)``; returns the key of the root (``parts[0]`` itself
    when there is one part: nothing to combine).
    """
    level = 0
    while len(parts) > 1:
        level += 1
        combined = []
        for g in range(0, len(parts), split_every):
            group = parts[g:g + split_every]
            if len(group) == 1:
                combined.append(group[0])  # nothing to combine: passed up a level unchanged
                continue
            key = prefix + (level, g // split_every)
            layer[key] = (combine, *group)
            combined.append(key)
        parts = combined
    return parts[0]


def _block_key(x, i):
    """Key of shard ``i`` of q, k or v: the block at (0, ..., 0, i, 0)."""
    return (x.name,) + (0,) * (x.ndim - 2) + (i, 0)


def _lse_key(lse, i):
    """Key of shard ``i`` of an lse (the query axis is its last)."""
    return (lse.name,) + (0,) * (lse.ndim - 1) + (i,)


def _mask_key(mask, i, j):
    """Key of the mask's block for query shard i and key shard j (a length-1 axis is block 0)."""
    return (mask.name,) + (0,) * (mask.ndim - 2) + (
        i if mask.shape[-2] != 1 else 0, j if mask.shape[-1] != 1 else 0)


def _new_array(graph, dependency, name, layer, chunks, dtype):
    graph = HighLevelGraph(
        {**graph.layers, name: {(name,) + idx: task for idx, task in layer.items()}},
        {**graph.dependencies, name: {dependency}},
    )
    return da.Array(graph, name, chunks, dtype=dtype, meta=np.empty((0,) * len(chunks), dtype))

"""How fast are flash_dask's forward and backward on one worker, on two, and in one process?

Measured side by side in one run, for d = 64, float64 and N queries = N keys (default N = 16384
and 65536):

* ``flash_lib.flash_attention`` in this process (its own thread pool:
  ``flash_lib.thread_count()`` threads, one BLAS thread each);
* ``flash_dask.dask_attention`` on a ``distributed.LocalCluster`` of 1 worker process and of 2,
  one thread each and ``FLASH_LIB_THREADS=1`` in the workers, so a worker is one core. The inputs
  are made on the cluster (``dask.array.random``) and persisted there before the clock starts,
  as for data that lives on a cluster; the time includes gathering ``out`` into this process;
* the backward, ``flash_dask.dask_attention_backward`` from the cluster's own forward (its out
  and lse computed and held there before the clock starts), against
  ``flash_lib.flash_attention_backward`` in this process (``--forward-only`` skips it);
* the share of the 2-worker run's wall time × 2 that the workers spent computing tasks
  (distributed's task stream): what is not compute is transfer or idle;
* the bytes Dask moved between workers during the timed run, summed from every worker's
  ``transfer_incoming_log`` (Dask's ``sizeof`` estimate of each received result), against the
  bytes of q, k and v.

Each output is checked against the in-process ``flash_attention`` (largest rowwise relative
error <= 1e-12); a disagreement makes the exit status 1. Speed never does: this is a report.

Usage::

    .venv/bin/python bench/bench_dask.py               # N = 16384 and 65536 (`make bench-dask`)
    .venv/bin/python bench/bench_dask.py --quick       # N = 4096 and 16384: a smoke run, ~1 min
    .venv/bin/python bench/bench_dask.py --sizes 32768 --causal --shard 8192
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/bench_dask.py

Method: ``time.perf_counter``, best of ``--rounds`` runs (default: 3 below N = 65536, else 1),
the three set-ups taking turns within each round (``flash_bench.best_times``, without its untimed
settling runs: a cluster run is too costly to repeat). Before timing, each cluster computes a
small attention (imports, first transfers) and the in-process kernel runs once on a small input.
On a 2-core machine two workers can at best halve one worker's time; the in-process kernel already
uses both cores, so the cluster's gain over it is the question the numbers answer, not an
assumption.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import dask
import dask.array as da
from distributed import Client, LocalCluster, futures_of

import flash_dask
import flash_lib
from flash_bench import best_times, load_average

D = 64
FULL_SIZES = [16384, 65536]
QUICK_SIZES = [4096, 16384]
TOLERANCE = 1e-12


def log(*args):
    print(*args, flush=True)


# The scheduler runs in this process: only its errors are worth printing here.
logging.getLogger("distributed").setLevel(logging.ERROR)


def start_cluster(n_workers):
    """``n_workers`` processes × 1 thread, flash_lib on one thread in each (set before spawn)."""
    with dask.config.set({
        "distributed.nanny.pre-spawn-environ.FLASH_LIB_THREADS": "1",
        # Dask's default MALLOC_TRIM_THRESHOLD_=65536 turns off glibc's adaptive mmap threshold
        # (mallopt(3)): every large NumPy temporary is then mapped afresh, and flash_attention
        # ran slower in a worker than in this process (bench/RESULTS.md). Dropped, for a fair
        # comparison.
        "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
        # keep every transfer of a run in the log that the byte count sums
        "distributed.admin.low-level-log-length": 1_000_000,
        # Dask's housekeeping, slowed down (flash_dask.QUIET_CLUSTER). On a 2-core machine two
        # workers compute on both cores, and the housekeeping takes its CPU from them, where one
        # worker leaves it a free core (bench/RESULTS.md, 2026-12-02, has what it took).
        **flash_dask.QUIET_CLUSTER,
    }):
        cluster = LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                               host="127.0.0.1", dashboard_address=None,
                               # no dashboard; the scheduler's small HTTP server (health,
                               # metrics) on a free port, not a fixed 8787 another run may hold
                               scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
                               silence_logs=logging.ERROR)
    client = Client(cluster, set_as_default=False)
    client.wait_for_workers(n_workers, timeout=120)
    client.get_task_stream()  # starts the scheduler's task stream, which the busy share reads
    return cluster, client


def _clear_transfer_log(dask_worker):
    dask_worker.transfer_incoming_log.clear()


def _received_bytes(dask_worker):
    return sum(entry["total"] for entry in dask_worker.transfer_incoming_log)


def random_inputs(n, shard, seed):
    """q, k, v as Dask arrays of standard normals, the same numbers whichever cluster runs them."""
    rng = da.random.default_rng(seed)
    return [rng.standard_normal((n, D), chunks=(shard, D)) for _ in range(3)]


def place(client, arrays):
    """Persist ``arrays`` (q, k, v, dout) on the cluster, k and v replicated to every worker.

    Each worker then holds every key shard, as data scattered once would be, so no pair task
    waits for one. What still moves is partial results: the ends of a query shard's chains
    (flash_dask folds its pairs in ``split_every`` chains, each on one worker) meeting at its
    merge, and in the backward the dk and dv shares meeting at their sums. (When flash_dask
    merged each query shard's pair results by a tree, the forward at N = 65536 moved 360 MiB
    with replication and 342 MiB without: the bytes were partials, not key shards.)
    """
    held = client.persist(arrays)
    wait(held)
    n_workers = len(client.scheduler_info()["workers"])
    if n_workers > 1:
        client.replicate(held[1:3], n=n_workers)
    return held


def backward_graph(causal):
    def graph(q, k, v, dout):
        out, lse = flash_dask.dask_attention(q, k, v, causal=causal, return_lse=True)
        return [out, lse], (q, k, v, dout)
    return graph


def wait(arrays):
    for future in futures_of(arrays):
        future.result()


def time_pass(clusters, flash_run, graphs, rounds, failures, pairs_of, what, causal):
    """Best times of flash_run and of each cluster's graph; bytes moved and busy share (2 w)."""
    def cluster_run(w):
        client = clusters[w][1]
        graph = graphs[w]
        if isinstance(graph, tuple):  # the backward: the cluster's own forward, held, then this
            (out, lse), (q, k, v, dout) = graph
            graph = flash_dask.dask_attention_backward(q, k, v, out, lse, dout,
                                                       causal=causal)
            return client.compute(list(graph), sync=True)
        return client.compute(graph, sync=True)

    runs = {"flash": flash_run, **{w: (lambda w=w: cluster_run(w)) for w in clusters}}
    moved, busy, results, started = {}, {}, {}, {}

    def before(name):
        if name != "flash":
            clusters[name][1].run(_clear_transfer_log)
            started[name] = time.time()

    def after(name, result):
        results[name] = result
        if name != "flash":
            client = clusters[name][1]
            moved[name] = sum(client.run(_received_bytes).values())
            wall = time.time() - started[name]
            stream = client.get_task_stream(start=started[name])
            compute = sum(s["stop"] - s["start"] for t in stream for s in t["startstops"]
                          if s["action"] == "compute")
            busy[name] = compute / (wall * name)

    best, _ = best_times(runs, min_rounds=rounds, max_rounds=rounds, settle=None,
                         before=before, after=after)
    for w in clusters:
        for ref, got in pairs_of(results["flash"], results[w]):
            err = float(flash_lib.rowwise_relative_error(got, ref).max())
            if not err <= TOLERANCE:
                failures.append(f"{what}, {w} worker(s): rowwise error {err:.3g}")
    graph = graphs[2]
    if isinstance(graph, tuple):
        (out, lse), (q, k, v, dout) = graph
        tasks = flash_dask.backward_task_count(flash_dask.dask_attention_backward(
            q, k, v, out, lse, dout, causal=causal)[0])
    else:
        tasks = flash_dask.attention_task_count(graph)
    return {**best, "moved": moved[2], "busy": busy[2], "tasks": tasks}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"N in {QUICK_SIZES}")
    p.add_argument("--sizes", type=int, nargs="+", help=f"N values (default {FULL_SIZES})")
    p.add_argument("--shard", type=int, default=flash_dask.DEFAULT_SHARD,
                   help="rows per shard along the sequence (default: flash_dask.DEFAULT_SHARD "
                        "= %(default)s)")
    p.add_argument("--causal", action="store_true", help="causal attention")
    p.add_argument("--forward-only", action="store_true",
                   help="time the forward only (the backward takes about 2.5 times as long)")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds (default 3 below N = 65536, else 1)")
    args = p.parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    if min(sizes) < 1 or args.shard < 1 or (args.rounds is not None and args.rounds < 1):
        p.error("sizes, --shard and --rounds must be positive integers")
    started = time.perf_counter()
    log(f"d = {D}, float64, {'causal' if args.causal else 'full'} attention, shards of "
        f"{args.shard} rows; flash_lib in this process: {flash_lib.thread_count()} threads; "
        f"{os.cpu_count()} CPUs; OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE')}")

    clusters = {}
    failures = []
    try:
        for n_workers in (1, 2):
            clusters[n_workers] = start_cluster(n_workers)
        warm = random_inputs(2048, 512, 0)
        for _, client in clusters.values():
            client.compute(flash_dask.dask_attention(*warm), sync=True)
        flash_lib.flash_attention(*(x.compute(scheduler="sync") for x in warm))

        log(f"\n{'pass':>8} {'N':>6} {'pair tasks':>10} {'flash, 1 process':>17} "
            f"{'1 worker':>10} {'2 workers':>10} {'1 w / 2 w':>10} {'flash / 2 w':>12} "
            f"{'moved between workers':>28} {'2 w busy':>9}")
        for n in sizes:
            shard = min(args.shard, n)
            inputs = random_inputs(n, shard, seed=n)
            dout = random_inputs(n, shard, seed=n + 1)[0]
            persisted = {w: place(client, inputs + [dout]) for w, (_, client) in clusters.items()}
            q, k, v, g = clusters[1][1].compute(persisted[1], sync=True)  # the same numbers
            input_bytes = q.nbytes + k.nbytes + v.nbytes
            rounds = args.rounds or (3 if n < 65536 else 1)
            out, lse = flash_lib.flash_attention(q, k, v, causal=args.causal, return_lse=True)
            passes = {
                "forward": (
                    lambda: flash_lib.flash_attention(q, k, v, causal=args.causal),
                    lambda qd, kd, vd, gd: flash_dask.dask_attention(qd, kd, vd,
                                                                     causal=args.causal),
                    lambda ref, got: [(ref, got)]),
                "backward": (
                    lambda: flash_lib.flash_attention_backward(q, k, v, out, lse, g,
                                                               causal=args.causal),
                    backward_graph(args.causal),
                    lambda ref, got: list(zip(ref, got))),
            }
            for name in ["forward"] + ([] if args.forward_only else ["backward"]):
                flash_run, graph, pairs_of = passes[name]
                graphs = {w: graph(*persisted[w]) for w in clusters}
                if name == "backward":  # the forward's out and lse, computed on the cluster first
                    for w, (_, client) in clusters.items():
                        graphs[w] = client.persist(graphs[w][0]), graphs[w][1]
                        wait(graphs[w][0])
                row = time_pass(clusters, flash_run, graphs, rounds, failures, pairs_of,
                                f"{name}, N = {n}", args.causal)
                tasks = row.pop("tasks")
                log(f"{name:>8} {n:>6} {tasks:>10} {row['flash']:>15.2f} s {row[1]:>8.2f} s "
                    f"{row[2]:>8.2f} s {row[1] / row[2]:>10.2f} {row['flash'] / row[2]:>12.2f} "
                    f"{row['moved'] / 2**20:>10.0f} MiB = {row['moved'] / input_bytes:.1f}× q+k+v"
                    f" {row['busy']:>8.0%}   ({rounds} round{'s' if rounds > 1 else ''})")
                del graphs
            del persisted
    finally:
        for cluster, client in clusters.values():
            client.close()
            cluster.close()
    log("\n'moved between workers' and '2 w busy' are for the 2-worker run (1 worker moves "
        "nothing): bytes the workers received from each other, and the share of the run's wall "
        "time x 2 workers spent computing tasks (distributed's task stream). k and v are "
        "replicated to every worker once, before the clock starts; the backward's out and lse are "
        "the cluster's forward, held there. Each output checked against flash_lib's to "
        f"{TOLERANCE:g} (rowwise relative error)")
    log(f"load average {load_average()}"
        + f"; total time {time.perf_counter() - started:.0f} s")
    if failures:
        log("WRONG RESULTS:\n  " + "\n  ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

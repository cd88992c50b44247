"""What flash_lib's worker threads cost against processes: the GIL's hand-overs.

Every NumPy call gives the GIL up and takes it back, so two threads that both make short calls
hand it to each other at nearly every call, and two processes never do. This script measures
that cost, on one CPU, for two pieces of work:

* the forward, ``flash_lib.flash_attention`` at N = ``--n`` (d = 64, 512 × 512 tiles);
* the same forward with dropout (p = 0.1), whose mask is about 25 NumPy calls of a few tens of
  µs per draw of two tiles (flash_lib's Philox); the difference of the two, per tile and
  thread, is the mask's cost;

each on one thread, on two threads (``flash_lib.threads(2)``), and as two processes of one
thread each that compute half the queries each, started together (the time of the slower one).
The work is exactly the same in the three set-ups, so the ratios are what the threads cost.
``bench/RESULTS.md`` records what it measured (2026-12-01), which ``_flash_runtime.run_blocks``
and ``_flash_dropout`` rest on.

Usage::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/threads_vs_processes.py

Method: ``time.perf_counter``. Each timed forward is preceded by ``flash_bench.SETTLE`` seconds of
untimed calls in the same set-up (threads and processes alike), so that no set-up is timed cold;
each set-up keeps its best of ``--rounds`` and its median.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time

import numpy as np

import flash_lib
from flash_bench import SETTLE, load_average, run_untimed

D = 64
TILE = 512
DROPOUT = dict(dropout_p=0.1, dropout_seed=2024)


def inputs(n, dtype):
    rng = np.random.default_rng(0)
    return [rng.standard_normal((n, D)).astype(dtype) for _ in range(3)]


def settled(call):
    """Seconds of one call of ``call``, after SETTLE seconds of untimed ones."""
    run_untimed(call)
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def forward(q, k, v, dropout, rows=slice(None)):
    """flash_attention of the queries ``rows``; with dropout, the dropout_offset that keeps each
    element's mask bit its own whatever the rows (so the halves draw the whole's mask)."""
    kw = dict(DROPOUT, dropout_offset=(rows.start or 0, 0)) if dropout else {}
    return flash_lib.flash_attention(q[rows], k, v, block_q=TILE, block_k=TILE, **kw)


def forward_half(n, dtype, dropout, half, rounds, barrier, results):
    """In a child process: the forward of half the queries on one thread, ``rounds`` times,
    each start held until the other child is ready too."""
    q, k, v = inputs(n, dtype)
    rows = slice(half * n // 2, (half + 1) * n // 2)
    times = []
    with flash_lib.threads(1):
        for _ in range(rounds):
            barrier.wait()
            times.append(settled(lambda: forward(q, k, v, dropout, rows)))
    results.put(times)


def in_two_processes(target, args_of, context):
    """Run ``target(*args_of(i), barrier, queue)`` in two processes; their results, in order."""
    barrier, results = context.Barrier(2), context.Queue()
    children = [context.Process(target=target, args=(*args_of(i), barrier, results))
                for i in range(2)]
    for c in children:
        c.start()
    out = [results.get() for _ in children]
    for c in children:
        c.join()
    return out


def show(name, times, one):
    best, median = min(times), statistics.median(times)
    print(f"  {name:<14} best {1e3 * best:8.3f} ms   median {1e3 * median:8.3f} ms   "
          f"one thread / this: {one / best:.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=4096, help="N of the forward (default %(default)s)")
    p.add_argument("--rounds", type=int, default=7,
                   help="timed rounds, at least 1 (default %(default)s)")
    args = p.parse_args()
    if args.rounds < 1 or args.n < 2:
        p.error(f"--rounds must be >= 1 and --n >= 2, got {args.rounds} and {args.n}")
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited threads
    print(f"flash_lib {flash_lib.__file__}; load average before: "
          f"{load_average()}")
    tiles = (args.n // TILE) ** 2 if args.n % TILE == 0 else None
    for dtype in (np.float32, np.float64):
        q, k, v = inputs(args.n, dtype)
        best = {}
        for dropout in (False, True):
            times = {}
            both = in_two_processes(forward_half, lambda i: (args.n, dtype, dropout, i, args.rounds),
                                    context)
            times["2 processes"] = [max(a, b) for a, b in zip(*both)]  # round by round, the slower
            for threads in (1, 2):
                with flash_lib.threads(threads):
                    times[f"{threads} thread{'s' * (threads > 1)}"] = [
                        settled(lambda: forward(q, k, v, dropout)) for _ in range(args.rounds)]
            print(f"\nforward{' with dropout p = 0.1' if dropout else ''}, N = {args.n}, d = {D}, "
                  f"{np.dtype(dtype).name}:")
            for name in ("1 thread", "2 threads", "2 processes"):
                show(name, times[name], min(times["1 thread"]))
            best[dropout] = {name: min(t) for name, t in times.items()}
        if tiles:
            print(f"the mask's cost, (with - without) per {TILE} x {TILE} tile and worker:",
                  ", ".join(f"{name} {1e3 * (best[True][name] - best[False][name]) / tiles * w:.2f} ms"
                            for name, w in (("1 thread", 1), ("2 threads", 2), ("2 processes", 2))))
    print(f"\nload average after: {load_average()}")


if __name__ == "__main__":
    main()

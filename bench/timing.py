"""Wall-clock timing of kernels side by side: the one timing loop of the benchmarks and chapters.

Used by ``bench/bench_flash.py`` and ``bench/bench_dask.py`` (as ``timing``, the module beside
them) and importable by a chapter as ``bench.timing`` (the repository root is on ``sys.path``
in the project's editable install)::

    from bench.timing import best_times

    best, rounds = best_times({"flash": lambda: flash_attention(q, k, v),
                               "naive": lambda: naive_attention(q, k, v)}, seconds=2.0)
    print(best["flash"] / best["naive"])

Method: ``time.perf_counter``; the callables are timed in turn, round after round, so that a
change of machine load hits them alike, and each keeps its best (minimum) time: the run least
disturbed by everything else on the machine. Absolute times on a shared machine are noisy; the
ratios, measured side by side, are the result.
"""

from __future__ import annotations

import math
import os
import time

__all__ = ["SETTLE", "best_times", "load_average", "run_untimed"]

#: Seconds each callable runs untimed before its timed call: longer than OpenBLAS's spin after a
#: call (see :func:`best_times`).
SETTLE = 0.25


def run_untimed(fn, seconds=SETTLE):
    """Run ``fn`` untimed, at least once and for at least ``seconds`` (see :func:`best_times`)."""
    until = time.perf_counter() + seconds
    fn()
    while time.perf_counter() < until:
        fn()


def load_average():
    """The 1, 5 and 15 minute load averages, as benchmarks print them beside their figures."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def best_times(fns, seconds=0.0, min_rounds=None, *, max_rounds=50, settle=SETTLE, before=None,
               after=None):
    """Best wall time of each callable in ``fns`` (a dict), timing them in turn, round by round.

    Rounds go on until ``seconds`` have passed and at least ``min_rounds`` were run, and stop at
    ``max_rounds``. ``min_rounds=None`` picks it from the first round: 3, or 2 when one round
    takes longer than ``seconds`` and 1 when it takes longer than 4 × ``seconds`` (huge N).
    Each round starts one callable further on, so none always runs right after the same other.

    ``settle``: before each timed call the callable runs untimed for this many seconds (at least
    once; 0: exactly once; None: never, for calls too costly to repeat). OpenBLAS and OpenMP
    pools keep their threads spinning for ~0.1-0.2 s after a call (measured: flash 36 ms right
    after a threaded matmul, 20 ms after 0.2 s of idle), stealing a core from whatever runs next;
    so each callable is timed in its own steady state, as when a model calls it layer after
    layer. (Idling instead would hand the kernels cold caches and sleeping cores: naive measured
    20% slower after a pause.)

    ``before(name)`` and ``after(name, result)`` run around each timed call, outside the timing
    (to reset a counter, keep the result, read what the call moved).

    Returns ``({name: best_seconds}, rounds)``.
    """
    names = list(fns)
    best = dict.fromkeys(names, math.inf)
    rounds, start = 0, time.perf_counter()
    while True:
        for i in range(len(names)):
            name = names[(rounds + i) % len(names)]
            if settle is not None:
                run_untimed(fns[name], settle)
            if before is not None:
                before(name)
            t0 = time.perf_counter()
            result = fns[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
            if after is not None:
                after(name, result)
            del result
        rounds += 1
        elapsed = time.perf_counter() - start
        if min_rounds is None:
            one_round = elapsed / rounds
            min_rounds = 1 if one_round > 4 * seconds else 2 if one_round > seconds else 3
        if rounds >= max_rounds or (rounds >= min_rounds and elapsed >= seconds):
            return best, rounds

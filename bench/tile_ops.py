"""One tile's alternatives, flash_lib's own tile, and the floor on two threads: the tile study.

The floor of one tile, its unavoidable NumPy operations timed one by one on one thread, is
``flash_bench``'s (:func:`flash_bench.forward_floor`, :func:`flash_bench.backward_floor`; its
docstring says how it is measured). This script times, the same way:

* the alternatives of issue 21's item 2, as variants of the tile: ``exp`` and ``exp2`` (with
  ``log2(e)`` folded into the keys' scale) whichever the kernel uses, the elementwise steps with
  temporaries instead of in place (forward and backward), and, in the forward, the row sum taken
  by the ``p·v`` matmul (a column of ones appended to ``v``);
* flash_lib's own forward and backward on one thread (per tile: what the kernel adds to the
  floor), and the floor on two threads side by side (what the cores cost each other);
* :func:`floor_loop`: the floor's own calls over every tile of a call, on the kernel's threads,
  which ``bench/bench_flash.py`` times against flash_lib.

Which NumPy loop ran each ufunc is read from NumPy itself (``numpy.lib.introspect.opt_func_info``),
not guessed.

Usage::

    .venv/bin/python bench/tile_ops.py              # this process's NumPy loops, both dtypes
    .venv/bin/python bench/tile_ops.py --levels     # native, AVX2 and baseline loops, each in a
                                                    # child process (NPY_DISABLE_CPU_FEATURES)
    .venv/bin/python bench/tile_ops.py --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

import flash_lib
from flash_bench import (
    D,
    DTYPES,
    EXPONENTIALS,
    LEVELS,
    LOG2E,
    MATMULS,
    backward_floor,
    backward_ops,
    best_times,
    cpu_name,
    describe,
    forward_floor,
    forward_ops,
    level_env,
    numpy_loops,
    openblas_kernel,
    workers,
)


def concurrent_floor(dtype, block_q=flash_lib.DEFAULT_BLOCK_Q, block_k=flash_lib.DEFAULT_BLOCK_K,
                     d=D, *, threads=2, seconds=1.0, min_reps=20, backward=False, **variant):
    """:func:`forward_floor` (or :func:`backward_floor`) on ``threads`` threads at once, each on
    its own tile, starting each repetition together (a barrier): ``[{op: s}]``, one per thread.

    Against the one-thread floor, it shows what the cores cost each other when they run the
    same calls side by side (shared caches and memory, the clock a busier chip runs at, the GIL
    each call takes back on return), with nothing of the kernel's own Python or scheduling."""
    import threading

    make = backward_ops if backward else forward_ops
    op_lists = [make(dtype, block_q, block_k, d, **variant) for _ in range(threads)]
    barrier = threading.Barrier(threads)
    stop = threading.Event()
    results = [None] * threads

    def run(i):
        best, reps, start = {}, 0, time.perf_counter()
        while True:
            barrier.wait()
            if stop.is_set():
                break
            for name, fn in op_lists[i]:
                t0 = time.perf_counter()
                fn()
                t = time.perf_counter() - t0
                best[name] = min(best.get(name, math.inf), t)
            reps += 1
            if i == 0 and reps >= min_reps and time.perf_counter() - start >= seconds:
                stop.set()
        results[i] = best

    with threadpool_limits(limits=1, user_api="blas"):
        pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
    return results


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


#: The variants timed by :func:`measure`: label -> keyword arguments of the tile's ops.
#: The first is the kernel's own tile, the floor: its exponential is flash_lib.exponential's.
KERNEL = "the kernel's ops"
FORWARD_VARIANTS = {
    KERNEL: {},
    "exp": {"exp": "exp"},
    "exp2, log2(e) folded": {"exp": "exp2"},
    "temporaries": {"temporaries": True},
    "row sum in p·[v 1]": {"sum_in_matmul": True},
}
BACKWARD_VARIANTS = {label: FORWARD_VARIANTS[label]
                     for label in (KERNEL, "exp", "exp2, log2(e) folded", "temporaries")}


def floor_loop(q, k, v, *, block_q=flash_lib.DEFAULT_BLOCK_Q, block_k=flash_lib.DEFAULT_BLOCK_K,
               threads=None, backward=None):
    """The floor's own calls over every tile of a call, and nothing else: a callable.

    The forward (or, with ``backward=(out, lse, dout)``, the backward) of one head,
    ``q, k, v`` of shapes ``(N, d)``, no mask, ``N`` a multiple of the block sizes: flash_lib's
    own tile functions (``online_softmax_update``, ``attention_backward_tile``: the calls of
    :func:`forward_ops` and :func:`backward_ops`) with the kernel's exponential, on the tiles of
    the kernel's loop (query blocks outside in the forward, key blocks in the backward), shared
    out to the kernel's worker threads (:func:`workers`) through one iterator, BLAS at one
    thread. It has no input checks, masks, variants, dropout or ordered dQ around them: so
    flash's time / this loop's is what flash_lib's own bookkeeping costs, with the
    caches and the threads' contention counted on both sides; the floor, each call at its best
    on its own, leaves those out. ``run()`` returns ``out`` (or ``dq, dk, dv``), to be checked
    against flash_lib's once before it is timed."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    dtype = q.dtype.type
    n, d = q.shape
    exp = flash_lib.exponential(dtype)
    unit = LOG2E if exp is np.exp2 else 1.0
    qs = q * dtype(1 / math.sqrt(d))  # the kernel scales each query block; once here
    ks = k * dtype(unit)
    n_threads = workers(n, n, block_k if backward is not None else block_q, threads)

    def forward_block(i, out):
        s, pv = np.empty((block_q, block_k), dtype), np.empty((block_q, v.shape[1]), dtype)
        q_i = qs[i:i + block_q]
        m = np.full(block_q, -np.inf, dtype)
        l, acc = np.zeros(block_q, dtype), np.zeros((block_q, v.shape[1]), dtype)
        for j in range(0, n, block_k):
            np.matmul(q_i, ks[j:j + block_k].T, out=s)
            flash_lib.online_softmax_update(m, l, acc, s, v[j:j + block_k],
                                            functools.partial(np.matmul, out=pv), exp)
        out[i:i + block_q] = acc / l[:, None]

    def backward_block(j, lse2, D, grads, lock):
        s, dp = (np.empty((block_q, block_k), dtype) for _ in range(2))
        dq, dk, dv = grads
        # S from the keys with log2(e) folded in base 2 (as backward_ops), dQ's share from K_j
        k_s = ks[j:j + block_k]

        def scores(q_i, k_j):  # S into its buffer, no variants
            return np.matmul(q_i, k_s.T, out=s), None

        for i in range(0, n, block_q):
            rows = slice(i, i + block_q)
            share = flash_lib.attention_backward_tile(
                qs[rows], k[j:j + block_k], v[j:j + block_k], dout[rows], lse2[rows], D[rows],
                dk[j:j + block_k], dv[j:j + block_k], scores=scores, dp_buffer=dp, exp=exp)
            with lock:
                dq[rows] += share

    if backward is not None:
        out, lse, dout = backward

    def run():
        blocks = iter(range(0, n, block_k if backward is not None else block_q))
        take = threading.Lock()
        if backward is None:
            result = np.empty((n, v.shape[1]), dtype)
        else:
            D = np.einsum("ij,ij->i", dout, out)
            lse2 = lse * dtype(unit)
            result, lock = tuple(np.zeros_like(x) for x in (q, k, v)), threading.Lock()

        def work():
            while True:
                with take:
                    b = next(blocks, None)
                if b is None:
                    return
                if backward is None:
                    forward_block(b, result)
                else:
                    backward_block(b, lse2, D, result, lock)

        with threadpool_limits(limits=1, user_api="blas"):
            if n_threads == 1:
                work()
            else:
                with ThreadPoolExecutor(n_threads) as pool:
                    for future in [pool.submit(work) for _ in range(n_threads)]:
                        future.result()
        if backward is not None:
            dq = result[0]
            dq *= dtype(1 / math.sqrt(d))  # dQ = τ dS K (dK = dSᵀ (τQ) came with the scaled q)
        return result

    return run


def kernel_per_tile(dtype, block_q=flash_lib.DEFAULT_BLOCK_Q, block_k=flash_lib.DEFAULT_BLOCK_K,
                    seconds=1.0):
    """flash_lib's own forward and backward on one thread at N = 4 blocks (16 tiles): best
    seconds per tile, ``{"forward": s, "backward": s}``, to set against the floors, and the
    minor page faults per tile of each (``"forward page faults"``, ...; :func:`page_faults`)."""
    n = 4 * block_q
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((n, D)).astype(dtype) for _ in range(4))
    kw = dict(block_q=block_q, block_k=block_k)
    out, lse = flash_lib.flash_attention(q, k, v, return_lse=True, **kw)
    tiles = len(flash_lib.tile_schedule(n, n, block_q, block_k))

    def forward():
        with flash_lib.threads(1):
            flash_lib.flash_attention(q, k, v, return_lse=True, **kw)

    def backward():
        with flash_lib.threads(1):
            flash_lib.flash_attention_backward(q, k, v, out, lse, dout, **kw)

    best, _ = best_times({"forward": forward, "backward": backward}, seconds, settle=0.05)
    result = {name: s / tiles for name, s in best.items()}
    result.update({f"{name} page faults": page_faults(fn) / tiles
                   for name, fn in (("forward", forward), ("backward", backward))})
    return result


def page_faults(fn):
    """Minor page faults during one call of ``fn`` (after one untimed call), or None where
    ``resource`` is missing (Windows). A fresh tile-sized array that the allocator took from the
    OS is faulted in page by page (4 KiB each) on its first write: a count, not a timing."""
    try:
        import resource
    except ImportError:
        return None
    fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def measure(dtypes=("float64", "float32"), seconds=1.0, block_q=flash_lib.DEFAULT_BLOCK_Q,
            block_k=flash_lib.DEFAULT_BLOCK_K):
    """Everything this script reports, for this process's NumPy loops: a JSON-able dict."""
    out = {"loops": numpy_loops(), "cpu": cpu_name(), "openblas": openblas_kernel(),
           "block_q": block_q, "block_k": block_k, "d": D, "dtypes": {}}
    for name in dtypes:
        dtype = DTYPES[name]
        res = {"forward": {}, "backward": {}}
        # Two passes over all variants, so that a busy moment does not decide a comparison.
        for _ in range(2):
            for direction, timer, variants in (("forward", forward_floor, FORWARD_VARIANTS),
                                               ("backward", backward_floor, BACKWARD_VARIANTS)):
                for label, var in variants.items():
                    t = timer(dtype, block_q, block_k, seconds=seconds / 2, **var)
                    old = res[direction].get(label, {})
                    res[direction][label] = {op: min(s, old.get(op, math.inf)) for op, s in t.items()}
        res["kernel_one_thread_per_tile"] = kernel_per_tile(dtype, block_q, block_k, seconds)
        res["concurrent"] = {
            direction: concurrent_floor(dtype, block_q, block_k, seconds=seconds,
                                        backward=direction == "backward")
            for direction in ("forward", "backward")}
        out["dtypes"][name] = res
    out["load"] = list(os.getloadavg())
    return out


def pooled(variants):
    """Each variant's ops, an op shared by several variants (the same name: the same call on the
    same shapes) taking its best time over all of them: ``{variant: {op: s}}``. A variant's
    saving is then what its own ops change, not the noise in the matmuls they share."""
    best = {}
    for times in variants.values():
        for op, t in times.items():
            best[op] = min(best.get(op, math.inf), t)
    return {label: {op: best[op] for op in times} for label, times in variants.items()}


def report(res):
    """Print :func:`measure`'s result as tables (µs per tile)."""
    print(describe(res["loops"]))
    print(f"one {res['block_q']} × {res['block_k']} tile, d = {res['d']}, one thread; best of "
          f"repetitions, µs; an op shared by variants: its best over them")
    for name, r in res["dtypes"].items():
        for direction in ("forward", "backward"):
            var = pooled(r[direction])
            base = var[KERNEL]
            floor = sum(base.values())
            print(f"\n{name} {direction}: "
                  + ", ".join(f"{op} {1e6 * t:.0f}" for op, t in base.items())
                  + f"; floor {1e6 * floor:.0f} µs (matmuls {100 * _share(base, MATMULS):.0f}%, "
                  f"exp {100 * _share(base, EXPONENTIALS):.0f}%)")
            k1 = r["kernel_one_thread_per_tile"][direction]
            faults = r["kernel_one_thread_per_tile"][f"{direction} page faults"]
            print(f"  flash_lib's {direction} on one thread: {1e6 * k1:.0f} µs a tile, "
                  f"{k1 / floor:.3f} × floor"
                  + ("" if faults is None else f"; {faults:.0f} minor page faults a tile"))
            side = [sum(times.values()) for times in r["concurrent"][direction]]
            print(f"  the floor on {len(side)} threads side by side: "
                  + ", ".join(f"{1e6 * s:.0f} µs ({s / floor:.3f} × floor)" for s in side))
            for label, t in var.items():
                total = sum(t.values())
                own = ", ".join(f"{op} {1e6 * x:.0f}" for op, x in t.items() if op not in base
                                or op in ("row state",) and label.startswith("exp2"))
                print(f"  {label:<27} {1e6 * total:6.0f} µs {total / floor:6.3f} × floor "
                      f"(saves {1e6 * (floor - total):+4.0f} µs a tile){': ' + own if own else ''}")
    print("load average " + " ".join(f"{x:.2f}" for x in res["load"]))


def _share(times, names):
    return sum(t for op, t in times.items() if op in names) / sum(times.values())


def run_level(level, args):
    """:func:`measure` in a child process with NumPy's loops at ``level`` (:func:`level_env`)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--json", "-", "--seconds",
           str(args.seconds), "--dtypes", *args.dtypes]
    done = subprocess.run(cmd, env=level_env(level), capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", action="store_true",
                   help="measure at NumPy's native, AVX2 and baseline loops, each in a child")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--seconds", type=float, default=2.0,
                   help="timing budget per dtype and variant (default %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON ('-': stdout only)")
    args = p.parse_args(argv)
    if args.levels:
        results = {}
        for level in LEVELS:
            print(f"\n######## NumPy loops: {level}", flush=True)
            results[level] = run_level(level, args)
            report(results[level])
    else:
        results = measure(args.dtypes, args.seconds)
        if args.json != "-":
            report(results)
    if args.json == "-":
        json.dump(results, sys.stdout)
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

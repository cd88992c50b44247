"""The floor of one tile: its unavoidable NumPy operations, timed one by one on one thread.

A FlashAttention tile in NumPy is a handful of calls: two matmuls, a row maximum, a subtraction,
an exponential, a row sum and the rescale of ``acc`` in the forward; five matmuls and four
elementwise passes in the backward. The exponential is the kernel's own, ``flash_lib.exponential``
(``exp2`` with ``log2(e)`` folded into the keys for float32 on AVX-512, ``exp`` elsewhere). No
NumPy kernel can do a tile in less than the sum of those
calls, so that sum, times the tiles a call visits, over the threads that share them, is the
kernel's *floor* on this machine; ``kernel time / floor`` is then what the kernel loses to
everything else (Python between the calls, threads waiting, caches). ``bench/bench_flash.py``
reports it for every row, and chapter 10 draws it.

Method: the operations of one tile run in the kernel's order, on arrays laid out as
``flash_lib`` lays them out (a ``block_q × block_k`` scores buffer reused in place, scores scaled
by τ = 1/√d), and each call is timed on its own with ``time.perf_counter``, repetition after
repetition; each operation keeps its best (minimum) time. Timing them in sequence keeps what
each call finds in the caches what it finds in the kernel, and interleaves them, so that a busy
moment hits them alike. BLAS is held at one thread, as inside the kernel.

The alternatives of issue 21's item 2 are timed the same way, as variants of the tile: ``exp``
and ``exp2`` (with ``log2(e)`` folded into the keys' scale) whichever the kernel uses, the
elementwise steps with temporaries instead of in place (forward and backward), and, in the
forward, the row sum taken by the ``p·v`` matmul (a column of ones appended to ``v``). Beside
them the script times flash_lib's own
forward and backward on one thread (per tile: what the kernel adds to the floor) and the floor
on two threads side by side (what the cores cost each other). Which NumPy loop ran each ufunc is
read from NumPy itself (``numpy.lib.introspect.opt_func_info``), not guessed.

Usage::

    .venv/bin/python bench/tile_ops.py              # this process's NumPy loops, both dtypes
    .venv/bin/python bench/tile_ops.py --levels     # native, AVX2 and baseline loops, each in a
                                                    # child process (NPY_DISABLE_CPU_FEATURES)
    .venv/bin/python bench/tile_ops.py --json out.json

Importable (the repository root is on ``sys.path`` in the editable install) as ``bench.tile_ops``:
:func:`forward_floor`, :func:`backward_floor`, :func:`floor_seconds`, :func:`floor_at_level`,
:func:`numpy_loops`.
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
from threadpoolctl import threadpool_info, threadpool_limits

import flash_lib

D = 64
DTYPES = {"float64": np.float64, "float32": np.float32}
LOG2E = 1.4426950408889634  # log2(e): e^x = 2^(x·log2(e))

#: The forward tile's operations, in the kernel's order (``flash_lib.online_softmax_update``).
FORWARD_OPS = ("q·kᵀ", "row max", "row state", "subtract", "exp", "row sum", "p·v",
               "rescale acc")
#: The backward tile's operations, in the kernel's order (``flash_lib.attention_backward_tile``).
BACKWARD_OPS = ("q·kᵀ", "subtract lse", "exp", "pᵀ·dout", "dv +=", "dout·vᵀ", "dp - D",
                "p∘(dp - D)", "dsᵀ·q", "dk +=", "ds·k", "dq +=")
#: Which of the operations above are matrix products (BLAS), for the breakdowns.
MATMULS = frozenset({"q·kᵀ", "p·v", "p·[v 1]", "pᵀ·dout", "dout·vᵀ", "dsᵀ·q", "ds·k"})
#: The exponential, under each name a variant gives it.
EXPONENTIALS = frozenset({"exp", "exp2", "subtract+exp (temporaries)"})

#: NumPy's loop levels on x86-64, as NPY_DISABLE_CPU_FEATURES sets them (CONTRIBUTING.md).
LEVELS = {
    "native": None,
    "AVX2": "X86_V4 AVX512_ICL AVX512_SPR",
    "baseline": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR",
}

#: The ufunc loops a tile uses, by NumPy's type signature (``f`` float32, ``d`` float64).
UFUNCS = ("exp", "exp2", "subtract", "multiply", "add", "maximum")


# --------------------------------------------------------------------------------------------
# Which code runs
# --------------------------------------------------------------------------------------------


def numpy_loops():
    """What NumPy dispatches here: ``{"baseline", "dispatch", "found", "loops"}``.

    ``loops[ufunc][dtype]`` is the target of the loop that runs for ``ufunc`` on ``dtype``
    (``"X86_V4"``, ``"X86_V3"``, ``"baseline(X86_V2)"``, …: NumPy's own name, from
    ``numpy.lib.introspect.opt_func_info``), so a choice made from it is the same on every run.
    """
    from numpy._core._multiarray_umath import (__cpu_baseline__, __cpu_dispatch__,
                                               __cpu_features__)
    from numpy.lib.introspect import opt_func_info

    info = opt_func_info(func_name="^(" + "|".join(UFUNCS) + ")$", signature="^(f|d)")
    loops = {}
    for ufunc in UFUNCS:
        by_sig = info.get(ufunc, {})
        loops[ufunc] = {}
        for name, code in (("float32", "f"), ("float64", "d")):
            sig = next((s for s in by_sig if set(s) == {code}), None)
            loops[ufunc][name] = by_sig[sig]["current"] if sig else "?"
    return {"baseline": list(__cpu_baseline__), "dispatch": list(__cpu_dispatch__),
            "found": [f for f in __cpu_dispatch__ if __cpu_features__.get(f)],
            "disabled": os.environ.get("NPY_DISABLE_CPU_FEATURES", ""), "loops": loops}


def loop_name(target):
    """A NumPy dispatch target as a reader knows it: ``"X86_V3"`` -> ``"AVX2 (X86_V3)"``."""
    names = {"X86_V4": "AVX-512", "X86_V3": "AVX2", "AVX512_ICL": "AVX-512 (Ice Lake)",
             "AVX512_SPR": "AVX-512 (Sapphire Rapids)", "AVX512_SKX": "AVX-512"}
    if target.startswith("baseline"):
        return f"baseline {target[len('baseline'):]}".strip()
    return f"{names[target]} ({target})" if target in names else target


def openblas_kernel():
    """OpenBLAS's kernel here (threadpoolctl's ``architecture``, e.g. ``SkylakeX``), or None."""
    kernels = sorted({p.get("architecture") or "?" for p in threadpool_info()
                      if p["internal_api"] == "openblas"})
    return " ".join(kernels) or None


def cpu_name():
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def describe(loops=None):
    """Two lines: the CPU, NumPy's loops for the tile's ufuncs, OpenBLAS's kernel, the load."""
    loops = loops or numpy_loops()
    per = ", ".join(f"{u} {loops['loops'][u]['float32']}/{loops['loops'][u]['float64']}"
                    for u in ("exp", "exp2", "subtract", "maximum"))
    return (f"{cpu_name()}; NumPy {np.__version__} loops (float32/float64): {per}; "
            f"NPY_DISABLE_CPU_FEATURES={loops['disabled'] or '(unset)'}\n"
            f"  CPU features NumPy found: {' '.join(loops['found']) or 'none beyond baseline'} "
            f"(baseline {' '.join(loops['baseline'])}); OpenBLAS kernel {openblas_kernel()}; "
            f"load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


# --------------------------------------------------------------------------------------------
# One tile, op by op
# --------------------------------------------------------------------------------------------


def _tile_inputs(dtype, block_q, block_k, d, seed=0):
    """The kernel's view of one tile: q, k scaled as flash_lib scales them (τ = 1/√d split as
    q·τ_q, k·τ_k), v, and the backward's dout, standard normal."""
    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.standard_normal(shape).astype(dtype)
                     for shape in ((block_q, d), (block_k, d), (block_k, d), (block_q, d)))
    return q * dtype(1 / math.sqrt(d)), k, v, dout


def _time_ops(ops, seconds, min_reps):
    """Run ``ops`` (a list of ``(name, fn)``) in order, repetition after repetition, timing each
    call on its own; ``{name: best seconds}`` (an op named twice adds its calls)."""
    best = {}
    reps, start = 0, time.perf_counter()
    with threadpool_limits(limits=1, user_api="blas"):
        while reps < min_reps or time.perf_counter() - start < seconds:
            this = {}
            for name, fn in ops:
                t0 = time.perf_counter()
                fn()
                this[name] = this.get(name, 0.0) + time.perf_counter() - t0
            for name, t in this.items():
                best[name] = min(best.get(name, math.inf), t)
            reps += 1
    return best


def kernel_exponential(dtype):
    """The exponential ``flash_lib`` uses for ``dtype`` here: ``"exp"`` or ``"exp2"``."""
    return flash_lib.exponential(dtype).__name__


def forward_ops(dtype, block_q=flash_lib.DEFAULT_BLOCK_Q, block_k=flash_lib.DEFAULT_BLOCK_K,
                d=D, *, exp=None, temporaries=False, sum_in_matmul=False):
    """The forward tile's calls as ``[(name, fn)]``, sharing one tile's state.

    ``exp``: ``"exp"``, ``"exp2"`` or None, the kernel's (:func:`kernel_exponential`). With
    ``"exp2"`` the scores come out of ``q·kᵀ`` already multiplied by ``log2(e)`` (the kernel folds
    it into the keys' scale, a multiply it does anyway) and ``exp2`` replaces ``exp``;
    ``temporaries``: ``np.exp(s - m)`` as a plain expression, two fresh tiles, instead of in
    place; ``sum_in_matmul``: ``l`` is taken by the ``p·v`` matmul from a column of ones
    appended to v (once per key block), instead of by a row sum.
    """
    dtype = np.dtype(dtype).type
    exp = exp or kernel_exponential(dtype)
    q, k, v, _ = _tile_inputs(dtype, block_q, block_k, d)
    if exp == "exp2":
        q = q * dtype(LOG2E)
    expf = {"exp": np.exp, "exp2": np.exp2}[exp]
    kt = k.T
    s = np.empty((block_q, block_k), dtype)
    pv = np.empty((block_q, d + sum_in_matmul), dtype)
    v_used = np.concatenate([v, np.ones((block_k, 1), dtype)], axis=1) if sum_in_matmul else v
    # A running state as it is midway through a row of tiles: m a little below the tile's maximum.
    np.matmul(q, kt, out=s)
    m0 = s.max(axis=-1) - dtype(0.5)
    st = {"m": m0.copy(), "l": np.ones(block_q, dtype), "acc": np.zeros((block_q, d), dtype)}

    def scores():
        np.matmul(q, kt, out=s)

    def row_max():
        st["tile_max"] = s.max(axis=-1)

    def row_state():
        # m' = max(m, tile max), the empty-row guard, alpha = e^(m - m'), l·alpha
        # (from the same m0 every repetition: alpha = e^-0.5 keeps l and acc bounded)
        m_new = np.maximum(m0, st["tile_max"])
        st["m_ref"] = m_ref = np.where(m_new == -np.inf, 0, m_new)
        st["alpha"] = alpha = expf(m0 - m_ref)
        st["l"] *= alpha
        st["m"][...] = m_new

    def subtract():
        np.subtract(s, st["m_ref"][:, None], out=s)

    def exponential():
        expf(s, out=s)

    def subtract_exp_temporaries():
        st["p"] = expf(s - st["m_ref"][:, None])

    def p_of():
        return st["p"] if temporaries else s

    def row_sum():
        st["l"] += p_of().sum(axis=-1)

    def p_v():
        np.matmul(p_of(), v_used, out=pv)

    def rescale_acc():
        acc = st["acc"]
        acc *= st["alpha"][:, None]
        if sum_in_matmul:
            acc += pv[:, :d]
            st["l"] += pv[:, d]
        else:
            acc += pv

    ops = [("q·kᵀ", scores), ("row max", row_max), ("row state", row_state)]
    if temporaries:
        ops.append(("subtract+exp (temporaries)", subtract_exp_temporaries))
    else:
        ops += [("subtract", subtract), (exp, exponential)]
    if not sum_in_matmul:
        ops.append(("row sum", row_sum))
    ops += [("p·[v 1]" if sum_in_matmul else "p·v", p_v),
            ("rescale acc, l +=" if sum_in_matmul else "rescale acc", rescale_acc)]
    return ops


def backward_ops(dtype, block_q=flash_lib.DEFAULT_BLOCK_Q, block_k=flash_lib.DEFAULT_BLOCK_K,
                 d=D, *, exp=None, temporaries=False):
    """The backward tile's calls as ``[(name, fn)]`` (``flash_lib.attention_backward_tile``):
    recompute S and P = e^(S - lse), then dV, dP, dS, dK, dQ's share. ``exp``: as for
    :func:`forward_ops`; with ``"exp2"``, log2(e) folded into k's tile (once per key block: the
    outer loop) and into the lse; ``temporaries``: the elementwise steps as plain expressions."""
    dtype = np.dtype(dtype).type
    exp = exp or kernel_exponential(dtype)
    q, k, v, dout = _tile_inputs(dtype, block_q, block_k, d)
    k_s = k * dtype(LOG2E) if exp == "exp2" else k
    expf = {"exp": np.exp, "exp2": np.exp2}[exp]
    kt, vt = k_s.T, v.T
    s = np.empty((block_q, block_k), dtype)
    dp = np.empty((block_q, block_k), dtype)
    # The forward's lse and out for these rows, as if this were their only key block: P is a
    # real probability tile, D = rowsum(dout ∘ out) a real one.
    s_nat = q @ k.T
    m = s_nat.max(axis=-1)
    lse = m + np.log(np.exp(s_nat - m[:, None]).sum(axis=-1))
    D_ = np.einsum("ij,ij->i", dout, np.exp(s_nat - lse[:, None]) @ v)
    if exp == "exp2":
        lse = lse * dtype(LOG2E)  # the base-2 lse of the base-2 scores
    dk, dv, dq = (np.zeros((n, d), dtype) for n in (block_k, block_k, block_q))
    st = {}

    def scores():
        np.matmul(q, kt, out=s)

    def subtract_lse():
        np.subtract(s, lse[:, None], out=s)

    def exponential():
        expf(s, out=s)

    def subtract_exp_temporaries():
        st["p"] = expf(s - lse[:, None])

    def p_of():
        return st["p"] if temporaries else s

    def pt_dout():
        st["dv_share"] = p_of().T @ dout

    def dv_add():
        np.add(dv, st["dv_share"], out=dv)

    def dout_vt():
        np.matmul(dout, vt, out=dp)

    def dp_minus_d():
        np.subtract(dp, D_[:, None], out=dp)

    def ds_of():
        np.multiply(p_of(), dp, out=dp)

    def ds_temporaries():
        st["ds"] = p_of() * (dp - D_[:, None])

    def ds():
        return st["ds"] if temporaries else dp

    def dst_q():
        st["dk_share"] = ds().T @ q

    def dk_add():
        np.add(dk, st["dk_share"], out=dk)

    def ds_k():
        st["dq_share"] = ds() @ k_s

    def dq_add():
        np.add(dq, st["dq_share"], out=dq)

    ops = [("q·kᵀ", scores)]
    ops += ([("subtract+exp (temporaries)", subtract_exp_temporaries)] if temporaries
            else [("subtract lse", subtract_lse), (exp, exponential)])
    ops += [("pᵀ·dout", pt_dout), ("dv +=", dv_add), ("dout·vᵀ", dout_vt)]
    ops += ([("dp - D, p∘ (temporaries)", ds_temporaries)] if temporaries
            else [("dp - D", dp_minus_d), ("p∘(dp - D)", ds_of)])
    ops += [("dsᵀ·q", dst_q), ("dk +=", dk_add), ("ds·k", ds_k), ("dq +=", dq_add)]
    return ops


def forward_floor(dtype, block_q=flash_lib.DEFAULT_BLOCK_Q, block_k=flash_lib.DEFAULT_BLOCK_K,
                  d=D, *, seconds=1.0, min_reps=20, **variant):
    """Best seconds of each forward-tile operation, one thread: ``{op: s}`` (sum: the floor)."""
    return _time_ops(forward_ops(dtype, block_q, block_k, d, **variant), seconds, min_reps)


def backward_floor(dtype, block_q=flash_lib.DEFAULT_BLOCK_Q, block_k=flash_lib.DEFAULT_BLOCK_K,
                   d=D, *, seconds=1.0, min_reps=20, **variant):
    """Best seconds of each backward-tile operation, one thread: ``{op: s}``."""
    return _time_ops(backward_ops(dtype, block_q, block_k, d, **variant), seconds, min_reps)


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


def workers(n_q, n_k, block_q, threads=None, batch=1):
    """The worker threads ``flash_lib``'s forward uses for this call (``_flash_runtime.run_blocks``:
    one when the call has fewer than ``PARALLEL_MIN_SCORES`` scores, else up to one per block)."""
    import _flash_runtime

    threads = flash_lib.thread_count() if threads is None else threads
    n_blocks = -(-n_q // block_q)
    return min(threads, n_blocks) if batch * n_q * n_k >= _flash_runtime.PARALLEL_MIN_SCORES else 1


def floor_seconds(per_tile, n, *, block_q=flash_lib.DEFAULT_BLOCK_Q,
                  block_k=flash_lib.DEFAULT_BLOCK_K, causal=False, threads=None,
                  backward=False):
    """The floor of a call at ``Nq = Nk = n``: ``per_tile`` (seconds) × the tiles it visits
    (``flash_lib.tile_schedule``) / the worker threads it runs on (:func:`workers`: the forward
    shares out query blocks, the backward key blocks).

    A lower bound: it assumes the threads share the tiles evenly and slow each other not at all.
    Full tiles only: at ``n`` a multiple of the block sizes every tile is one."""
    tiles = len(flash_lib.tile_schedule(n, n, block_q, block_k, causal=causal))
    return per_tile * tiles / workers(n, n, block_k if backward else block_q, threads)


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

        def scores(q_i, k_j):  # S into its buffer, no variants
            return np.matmul(q_i, k_j.T, out=s), None

        for i in range(0, n, block_q):
            rows = slice(i, i + block_q)
            share = flash_lib.attention_backward_tile(
                qs[rows], k[j:j + block_k], v[j:j + block_k], dout[rows], lse2[rows], D[rows],
                dk[j:j + block_k], dv[j:j + block_k], scores=scores, dp_buffer=dp, exp=exp,
                k_scores=ks[j:j + block_k])
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
    try:
        from timing import best_times  # run as a script, beside it
    except ImportError:
        from bench.timing import best_times

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


def level_env(level):
    """The environment of a child process whose NumPy runs the loops of ``level`` (``LEVELS``):
    the features this process's environment already disables stay disabled (a child never runs
    faster loops than its parent), and OpenBLAS picks its native kernel."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    disabled = set(os.environ.get("NPY_DISABLE_CPU_FEATURES", "").split())
    disabled |= set((LEVELS[level] or "").split())
    if disabled:
        env["NPY_DISABLE_CPU_FEATURES"] = " ".join(sorted(disabled))
    return env


def floor_at_level(level, dtypes=("float64", "float32"), seconds=0.5):
    """:func:`forward_floor` of each dtype in a child process running NumPy's ``level`` loops:
    ``{"loops": numpy_loops(), "exponential": {dtype: "exp" or "exp2"}, "forward": {dtype: {op:
    s}}}`` as the child measured them (the exponential: the child's flash_lib's, at its loops).
    x86-64 only (the levels are x86's): elsewhere, None."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    cmd = [sys.executable, os.path.abspath(__file__), "--floor-only", "--json", "-",
           "--seconds", str(seconds), "--dtypes", *dtypes]
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
    p.add_argument("--floor-only", action="store_true",
                   help="only the forward floor of each dtype (what floor_at_level asks a child)")
    args = p.parse_args(argv)
    if args.floor_only:
        results = {"loops": numpy_loops(), "cpu": cpu_name(), "load": list(os.getloadavg()),
                   "exponential": {name: kernel_exponential(DTYPES[name]) for name in args.dtypes},
                   "forward": {name: forward_floor(DTYPES[name], seconds=args.seconds)
                               for name in args.dtypes}}
        if args.json != "-":
            print(json.dumps(results, indent=1))
    elif args.levels:
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

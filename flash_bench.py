"""The measuring instruments the chapters and the benchmarks share: one timing loop, and the
floor of one tile.

Public, beside ``flash_lib`` (which does not import it): chapters 9 and 10 and the scripts in
``bench/`` import it, so that a chapter's figure and ``make bench``'s come from the same code,
and the later chapters take their comparisons and thread counts from it.

**Timing kernels side by side** (:func:`best_times`)::

    from flash_bench import best_times

    best, rounds = best_times({"flash": lambda: flash_attention(q, k, v),
                               "naive": lambda: naive_attention(q, k, v)}, seconds=2.0)
    print(best["flash"] / best["naive"])

``time.perf_counter``; the callables are timed in turn, round after round, so that a change of
machine load hits them alike, and each keeps its best (minimum) time: the run least disturbed by
everything else on the machine. Absolute times on a shared machine are noisy; the ratios,
measured side by side, are the result.

**The floor of one tile** (:func:`forward_floor`, :func:`backward_floor`, :func:`floor_seconds`).
A FlashAttention tile in NumPy is a handful of calls: two matmuls, a row maximum, a subtraction,
an exponential, a row sum and the rescale of ``acc`` in the forward; five matmuls and four
elementwise passes in the backward. The exponential is the kernel's own, ``flash_lib.exponential``
(``exp_as_exp2``, the exponent times ``log2(e)`` then ``exp2``, for float32 on AVX-512, ``exp``
elsewhere). No
NumPy kernel can do a tile in less than the sum of those calls, so that sum, times the tiles a
call visits, over the threads that share them, is the kernel's *floor* on this machine;
``kernel time / floor`` is then what the kernel loses to everything else (Python between the
calls, threads waiting, caches). ``bench/bench_flash.py`` reports it for every row, and chapter
10 draws it. The operations of one tile run in the kernel's order, on arrays laid out as
``flash_lib`` lays them out (a ``block_q × block_k`` scores buffer reused in place, scores scaled
by τ = 1/√d), and each call is timed on its own with ``time.perf_counter``, repetition after
repetition; each operation keeps its best (minimum) time. Timing them in sequence keeps what
each call finds in the caches what it finds in the kernel, and interleaves them, so that a busy
moment hits them alike. BLAS is held at one thread, as inside the kernel. Which NumPy loop ran
each ufunc is read from NumPy itself (:func:`numpy_loops`, ``numpy.lib.introspect``), not
guessed; :func:`floor_at_level` measures the floor again with NumPy's faster loops switched off.

``bench/tile_ops.py`` times the alternatives to the kernel's tile (the variants of
:func:`forward_ops` and :func:`backward_ops`), flash_lib's own tile, and the floor on two
threads at once, with these instruments.

**Differences and threads, as the chapters show them.** :func:`relative_difference` is the one
way a chapter compares two arrays whose rows may be 0 (gradients); :func:`below` prints a
rounding-level difference as the limit it is under, so that no CPU changes a stored output
(CONTRIBUTING.md); :func:`threads_seen` records which threads ran a kernel's tiles, so that a
chapter that shows "the same bits on 1, 2 and 4 workers" also shows that they ran.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import subprocess
import sys
import threading
import time

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

import flash_lib

__all__ = ["SETTLE", "run_untimed", "load_average", "best_times", "MATMULS", "EXPONENTIALS",
           "numpy_loops", "loop_name", "openblas_kernel", "cpu_name", "describe",
           "kernel_exponential", "forward_ops", "backward_ops", "forward_floor",
           "backward_floor", "workers", "floor_seconds", "floor_at_level", "floor_here",
           "relative_difference", "below", "threads_seen"]

# --------------------------------------------------------------------------------------------
# Timing kernels side by side
# --------------------------------------------------------------------------------------------


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
    pools keep their threads spinning for ~0.1-0.2 s after a call, stealing a core from whatever
    runs next; so each callable is timed in its own steady state, as when a model calls it layer
    after layer. (Idling instead would hand the kernels cold caches and sleeping cores, which
    slows them too; ``bench/RESULTS.md``, 2026-11-29, has both measurements.)

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


# --------------------------------------------------------------------------------------------
# The floor of one tile: which code runs
# --------------------------------------------------------------------------------------------


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
    ``"exp2"`` each exponential is the kernel's ``flash_lib.exp_as_exp2``: the exponent (in nats)
    times ``log2(e)``, then ``exp2``;
    ``temporaries``: ``np.exp(s - m)`` as a plain expression, two fresh tiles, instead of in
    place; ``sum_in_matmul``: ``l`` is taken by the ``p·v`` matmul from a column of ones
    appended to v (once per key block), instead of by a row sum.
    """
    dtype = np.dtype(dtype).type
    exp = exp or kernel_exponential(dtype)
    q, k, v, _ = _tile_inputs(dtype, block_q, block_k, d)
    expf = {"exp": np.exp, "exp2": flash_lib.exp_as_exp2}[exp]
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
    :func:`forward_ops`; ``temporaries``: the elementwise steps as plain expressions."""
    dtype = np.dtype(dtype).type
    exp = exp or kernel_exponential(dtype)
    q, k, v, dout = _tile_inputs(dtype, block_q, block_k, d)
    expf = {"exp": np.exp, "exp2": flash_lib.exp_as_exp2}[exp]
    kt, vt = k.T, v.T
    s = np.empty((block_q, block_k), dtype)
    dp = np.empty((block_q, block_k), dtype)
    # The forward's lse and out for these rows, as if this were their only key block: P is a
    # real probability tile, D = rowsum(dout ∘ out) a real one.
    s_nat = q @ k.T
    m = s_nat.max(axis=-1)
    lse = m + np.log(np.exp(s_nat - m[:, None]).sum(axis=-1))
    D_ = np.einsum("ij,ij->i", dout, np.exp(s_nat - lse[:, None]) @ v)
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


def workers(n_q, n_k, block_q, threads=None, batch=1):
    """The worker threads ``flash_lib``'s forward uses for this call, ``threads`` at most
    (default ``flash_lib.thread_count()``): ``flash_lib.worker_count``, one when the call has
    too few scores to pay for threads, else up to one per block."""
    n_blocks, n_scores = -(-n_q // block_q), batch * n_q * n_k
    if threads is None:
        return flash_lib.worker_count(n_blocks, n_scores)
    with flash_lib.threads(threads):
        return flash_lib.worker_count(n_blocks, n_scores)


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
# The floor at NumPy's other loop levels, in a child process
# --------------------------------------------------------------------------------------------


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
    """:func:`floor_here` in a child process running NumPy's ``level`` loops (NumPy reads
    ``NPY_DISABLE_CPU_FEATURES`` once, at import): ``{"loops": numpy_loops(), "exponential":
    {dtype: "exp" or "exp2"}, "forward": {dtype: {op: s}}, ...}`` as the child measured them (the
    exponential: the child's flash_lib's, at its loops). x86-64 only (the levels are x86's):
    elsewhere, None."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    code = (f"import json, sys, flash_bench; "
            f"json.dump(flash_bench.floor_here({tuple(dtypes)!r}, {seconds!r}), sys.stdout)")
    done = subprocess.run([sys.executable, "-c", code], env=level_env(level),
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def floor_here(dtypes=("float64", "float32"), seconds=0.5):
    """This process's :func:`forward_floor` of each dtype (names of ``DTYPES``), with what ran it:
    ``{"loops", "cpu", "load", "exponential", "forward"}`` (:func:`floor_at_level`'s child)."""
    return {"loops": numpy_loops(), "cpu": cpu_name(), "load": list(os.getloadavg()),
            "exponential": {name: kernel_exponential(DTYPES[name]) for name in dtypes},
            "forward": {name: forward_floor(DTYPES[name], seconds=seconds) for name in dtypes}}


# --------------------------------------------------------------------------------------------
# Differences and threads, as the chapters show them
# --------------------------------------------------------------------------------------------


def relative_difference(x, ref):
    """``max|x - ref| / max|ref|`` over the whole arrays, as a float: the difference relative to
    the reference's largest entry. For arrays whose rows may be exactly 0 (the gradient of a key
    no query attends), where ``flash_lib.rowwise_relative_error`` asks those rows to match
    exactly. NaN when either array holds a NaN (``np.max`` keeps it)."""
    x, ref = np.asarray(x, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def below(x, limit):
    """A rounding-level difference printed so that no CPU changes the text: ``"below 1e-14"``
    when ``x < limit`` (an exact 0 included: whether a difference is 0 is the CPU's rounding),
    else, for a real error, the number and the limit it is above. Equalities that hold bit for
    bit by construction are printed as such by the chapter, not through this."""
    return f"below {limit:.0e}" if x < limit else f"{x:.1e}, above {limit:.0e}"


@contextlib.contextmanager
def threads_seen(*names, pause=0.1):
    """Within the ``with`` block, record the threads that call ``flash_lib``'s functions
    ``names`` (the tile functions its loops look up at each call: ``"online_softmax_update"``
    in the forward, ``"attention_backward_tile"`` in the backward); yields the set of their
    ``threading.get_ident()``, filled as the calls come.

    Each thread waits ``pause`` seconds at its first call, so that the workers a call starts all
    take a block before the first of them could finish every block alone (left alone, one fast
    worker can, and a count of one thread would then show nothing about threads). The wait
    changes no bit: the functions are called with the same arguments, in each thread's order.
    """
    seen, lock = set(), threading.Lock()
    originals = {name: getattr(flash_lib, name) for name in names}

    def recorded(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            me = threading.get_ident()
            with lock:
                first = me not in seen
                seen.add(me)
            if first and pause:
                time.sleep(pause)
            return fn(*args, **kwargs)
        return call

    try:
        for name, fn in originals.items():
            setattr(flash_lib, name, recorded(fn))
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(flash_lib, name, fn)

"""flash_lib's runtime: the worker threads, BLAS held at one thread, the in-order hand-off of
dQ's shares, cancellation, IEEE flags, and which exponential NumPy runs fastest here; and the
knobs that set them per context, which flash_lib exports: :func:`threads`,
:func:`thread_count`, :func:`exponential`, :func:`use_exponential`. Nothing here knows about
attention.

Private to flash_lib: ``flash_lib.py`` and ``flash_reference.py`` import it (and
``tests/test_threads.py``, which tests its internals).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import os
import threading

import numpy as np
from threadpoolctl import ThreadpoolController

import _flash_inputs as inputs


def threads_from_environment():
    """``FLASH_LIB_THREADS``, or the number of cores, at most 4."""
    raw = os.environ.get("FLASH_LIB_THREADS")
    if raw is None:
        return min(os.cpu_count() or 1, 4)
    try:
        threads = int(raw)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(f"FLASH_LIB_THREADS must be a positive integer, got {raw!r}")
    return threads


#: What ``FLASH_LIB_EXP`` may say: choose by the CPU, or always one of the two.
EXPONENTIALS = ("auto", "exp", "exp2")


def exponential_from_environment():
    """``FLASH_LIB_EXP``: ``"auto"`` (the default), ``"exp"`` or ``"exp2"``."""
    raw = os.environ.get("FLASH_LIB_EXP", "auto")
    if raw not in EXPONENTIALS:
        raise ValueError(f"FLASH_LIB_EXP must be one of {', '.join(EXPONENTIALS)}, got {raw!r}")
    return raw


def _exponential(dtype, choice="auto"):
    """``np.exp2`` or ``np.exp`` for compute dtype ``dtype``: the one that makes the kernels faster
    on this CPU, read from the loops NumPy dispatches to (``numpy.lib.introspect.opt_func_info``),
    never from a timing, so that every run on one machine takes the same one. ``choice`` other
    than ``"auto"`` forces it, for both dtypes.

    ``exp2`` for float32 where NumPy runs an AVX-512 loop for it (Intel's SVML, which NumPy
    builds in for AVX-512 only): there it takes half ``exp``'s time on a tile, and the forward
    is faster. ``exp`` otherwise: with AVX2 loops float32's ``exp2`` is scalar, slower than
    ``exp``; and float64's ``exp2`` gains too little of a tile to show in the kernel, so float64
    keeps ``exp``. ``bench/RESULTS.md`` (2026-12-02) has the measurements.
    """
    if choice != "auto":
        return {"exp": np.exp, "exp2": np.exp2}[choice]
    float32 = np.dtype(dtype) == np.float32
    return np.exp2 if float32 and _avx512_loop("exp2", "f") else np.exp


@functools.cache
def _avx512_loop(ufunc, char):
    """Whether NumPy dispatches ``ufunc``'s loop for dtype ``char`` to an AVX-512 target."""
    try:
        from numpy.lib.introspect import opt_func_info
    except ImportError:  # pragma: no cover - NumPy < 2.0 has no dispatch table to read
        return False
    loops = opt_func_info(func_name=f"^{ufunc}$").get(ufunc, {})  # by type chars: {"ff": ...}
    target = loops.get(char + char, {}).get("current", "")
    # NumPy 2.4 names the AVX-512 level X86_V4 (AVX512_ICL, AVX512_SPR above it: "Modulate
    # dispatched x86 CPU features", 2025); NumPy 2.0-2.3 named these loops' target AVX512_SKX
    return target.startswith(("X86_V4", "AVX512"))


# Threads only pay for themselves on real work (a thread pool costs ~0.1 ms to start).
PARALLEL_MIN_SCORES = 1 << 20
# One kernel call at a time holds BLAS at one thread (see _one_blas_thread).
_KERNEL_LOCK = threading.Lock()
# True inside a kernel call (and its workers): a nested call runs inline, under the outer's lock.
_IN_KERNEL = contextvars.ContextVar("flash_lib_in_kernel", default=False)
# Found once at import (NumPy's BLAS is loaded by then); setting a count then costs ~1 µs.
BLAS_LIBS = ThreadpoolController().select(user_api="blas").lib_controllers


def worker_count(threads, n_blocks, n_scores):
    """The threads :func:`run_blocks` runs ``n_blocks`` blocks of ``n_scores`` scores on: one
    below ``PARALLEL_MIN_SCORES``, else up to ``threads``, at most one per block."""
    return min(threads, n_blocks) if n_scores >= PARALLEL_MIN_SCORES else 1


def run_blocks(work_on, blocks, *, n_blocks, n_scores, threads):
    """Call ``work_on(block, cancelled)`` for every block, on up to ``threads`` threads, BLAS at one.

    Query (or key) blocks are independent, so they run on a small thread pool: NumPy releases
    the GIL in matmul, exp and the reductions, which the single-threaded elementwise passes need
    to use all cores. A call of fewer than ``PARALLEL_MIN_SCORES`` scores, or of one block, runs
    on the calling thread. Workers take the next block from one shared iterator, so the
    bookkeeping is O(workers) whatever the number of blocks. Each worker runs in a copy of the
    caller's context, so ``np.errstate`` (a context variable) holds inside the workers as it
    does for the caller. What threads cost against processes: every NumPy call gives the GIL up
    and takes it back, and between two busy threads a short call hands it over, so work made of
    many short calls gains less from a second thread than from a second process (dropout's mask
    most: why ``_flash_dropout`` draws two tiles per call, in fewer calls;
    ``bench/threads_vs_processes.py`` measures it, ``bench/RESULTS.md`` has the figures).
    If a worker raises, or the caller is interrupted (Ctrl-C),
    ``cancelled`` is set: every worker stops before its next tile, and the exception reaches
    the caller once they have.
    """
    workers = worker_count(threads, n_blocks, n_scores)
    cancelled = threading.Event()
    if _IN_KERNEL.get():
        for block in blocks:
            work_on(block, cancelled)
        return
    with _KERNEL_LOCK, _one_blas_thread():
        token = _IN_KERNEL.set(True)
        try:
            if workers == 1:
                for block in blocks:
                    work_on(block, cancelled)
                return
            blocks, take = iter(blocks), threading.Lock()

            def work():
                _one_blas_thread_here()
                while not cancelled.is_set():
                    with take:
                        block = next(blocks, None)
                    if block is None:
                        return
                    work_on(block, cancelled)

            _on_threads(work, workers, cancelled)
        finally:
            _IN_KERNEL.reset(token)


def _on_threads(work, workers, cancelled):
    """Run ``work()`` on ``workers`` new threads, each in a copy of the caller's context, and
    return once every one has stopped; the first exception of a worker is raised here then.

    A worker that raises sets ``cancelled``, so the others stop before their next block. So does
    an exception in the caller while it starts or waits for them (Ctrl-C, whenever it comes):
    then every thread already started is waited for before the exception goes on, so that none
    is left running after the call. (Threads of our own rather than a ThreadPoolExecutor, whose
    ``submit`` interrupted between starting a thread and recording it leaves that thread
    unjoined.) The caller waits on each worker's own ``done`` event and joins only once that is
    set: a ``Thread.join`` interrupted by Ctrl-C can mark a thread that is still running as
    stopped, after which the next ``join`` returns at once (CPython 3.9-3.11,
    python/cpython#90882), and a worker would outlive the call.
    """
    errors, launched = [], []

    def worker(began, done):
        began.set()
        try:
            work()
        except BaseException as error:  # noqa: B036 - reaches the caller once all have stopped
            errors.append(error)
            cancelled.set()
        finally:
            done.set()

    try:
        for n in range(workers):
            began, done = threading.Event(), threading.Event()
            thread = threading.Thread(target=contextvars.copy_context().run,
                                      args=(worker, began, done), name=f"flash_lib_{n}")
            launched.append((thread, began, done))
            thread.start()
        for _, _, done in launched:
            done.wait()
    finally:
        cancelled.set()
        for thread, began, done in launched:
            # started, or its start() interrupted while the thread was already on its way
            if began.is_set() or thread in threading.enumerate():
                began.wait()
                done.wait()
                thread.join()  # its first join: never one that Ctrl-C interrupted
    if errors:
        raise errors[0]


class InOrder:
    """Turns for adding to shared rows in a fixed order, whichever thread is ready first.

    The backward adds the key blocks' shares of ``dQ_i`` in key-block order ``j = 0, 1, ...``
    (FlashAttention's deterministic mode does the same with a semaphore), so the sum's rounding
    does not depend on the threads. ``with turns.turn(i, j, cancelled) as mine:`` waits until
    block ``j`` is next for rows ``i``; ``mine`` is False if the call was cancelled meanwhile.
    """

    def __init__(self, n_rows):
        self._next = [0] * n_rows  # _next[i]: the block whose share of rows i is added next
        self._turns = threading.Condition()

    @contextlib.contextmanager
    def turn(self, i, j, cancelled):
        with self._turns:
            while self._next[i] != j:
                if cancelled.is_set():
                    yield False
                    return
                self._turns.wait(0.05)
            yield True
            self._next[i] = j + 1
            self._turns.notify_all()


@contextlib.contextmanager
def _one_blas_thread():
    """Hold each BLAS library at one thread during a kernel call, then restore what was there.

    How many threads a BLAS uses changes how it splits a matmul, and so the rounding (measured
    with NumPy's OpenBLAS: a 512 × 64 × 512 float32 product differs in 37% of rows between 1
    and 2 threads), and the kernel's own threads already use the cores. NumPy's OpenBLAS keeps
    the count in one process-wide variable. threadpoolctl (>= 3.8) lets only one "controlling"
    Python thread change it and silently ignores the others, which would leave a call from any
    other thread at the caller's count, so OpenBLAS's own setter is called instead. What is put
    back is what was found, unless another thread changed it during the call: theirs stands.
    """
    found = [(lib, lib.get_num_threads()) for lib in BLAS_LIBS]
    for lib, _ in found:
        _set_blas_threads(lib, 1)
    try:
        yield
    finally:
        for lib, threads in found:
            if threads is not None and lib.get_num_threads() == 1:
                _set_blas_threads(lib, threads)


def _one_blas_thread_here():
    """A BLAS threaded by OpenMP keeps its count per thread: each worker sets its own."""
    for lib in BLAS_LIBS:
        if lib.threading_layer == "openmp":
            lib.set_num_threads(1)


def _set_blas_threads(lib, threads):
    if lib.internal_api == "openblas" and lib.threading_layer != "openmp":
        _openblas_setter(lib)(threads)
    else:
        lib.set_num_threads(threads)


@functools.cache
def _openblas_setter(lib):
    """``openblas_set_num_threads`` of this OpenBLAS, under whichever affixes its build uses."""
    for prefix, suffix in itertools.product(("", "scipy_"), ("", "64_", "_64")):
        name = f"{prefix}openblas_set_num_threads{suffix}"
        if hasattr(lib.dynlib, name) and hasattr(lib.dynlib, name.replace("set", "get")):
            return getattr(lib.dynlib, name)
    return lib.set_num_threads  # pragma: no cover - an OpenBLAS without the setter


# --------------------------------------------------------------------------------------------
# The knobs, per context: flash_lib exports them
# --------------------------------------------------------------------------------------------

# The default thread count: FLASH_LIB_THREADS, read at import (default: the number of cores, at
# most 4); threads(n) overrides it for one context.
_THREADS = threads_from_environment()
_THREADS_HERE = contextvars.ContextVar("flash_lib_threads", default=None)
# FLASH_LIB_EXP, read at import: "auto" (the default), "exp" or "exp2"; use_exponential(name)
# overrides it for one context
_EXPONENTIAL = exponential_from_environment()
_EXPONENTIAL_HERE = contextvars.ContextVar("flash_lib_exponential", default=None)


@contextlib.contextmanager
def threads(n):
    """Run the kernel calls made inside ``with flash_lib.threads(n):`` on up to ``n`` worker threads.

    Per context, not process-wide: the setting is a context variable, so it holds for the
    calling thread (and asyncio task) only, other threads keep theirs, and a new thread starts
    at the default, ``FLASH_LIB_THREADS``. The count changes the speed, never the bits.
    """
    token = _THREADS_HERE.set(inputs.int_at_least("threads(n): n", n, 1))
    try:
        yield
    finally:
        _THREADS_HERE.reset(token)


def thread_count():
    """The worker-thread count in force here: the innermost :func:`threads`, else the default."""
    n = _THREADS_HERE.get()
    return _THREADS if n is None else n


def exponential(dtype):
    """The exponential the kernels use for compute dtype ``dtype`` (float32 for half-precision
    inputs) on this machine: ``np.exp2`` for float32 where NumPy runs an AVX-512 loop for it
    (there it took 0.46x the time of ``np.exp`` on a tile, and the forward 0.95x), else ``np.exp``.
    ``FLASH_LIB_EXP=exp`` or ``exp2`` forces one for every dtype, and :func:`use_exponential`
    for one context. In base 2 the scores carry ``log2(e)``, folded into the keys' scale (the
    module docstring)."""
    dtype = np.dtype(dtype)
    choice = _EXPONENTIAL_HERE.get() or _EXPONENTIAL
    return _exponential(np.float32 if dtype in inputs.HALF_DTYPES else dtype, choice)


@contextlib.contextmanager
def use_exponential(name):
    """Compute the kernel calls made inside ``with flash_lib.use_exponential(name):`` with
    ``name``'s exponential: ``"exp"`` (base e) or ``"exp2"`` (base 2) for every dtype, or
    ``"auto"`` (:func:`exponential`'s choice for this machine). Per context, as :func:`threads`.
    The base changes the last bits of the results, within the same error bounds (chapter 7)."""
    if name not in EXPONENTIALS:
        raise ValueError(f"use_exponential(name): name must be one of "
                         f"{', '.join(EXPONENTIALS)}, got {name!r}")
    token = _EXPONENTIAL_HERE.set(name)
    try:
        yield
    finally:
        _EXPONENTIAL_HERE.reset(token)


def ieee_quiet():
    """IEEE's "invalid" flag is ignored inside the kernels and references. The only invalid
    operations left are those that give NaN to a row allowed to meet an inf or NaN (inf - inf,
    0 · inf), which is what the contract gives such rows: the empty-row and masked-key guards keep
    them from every other row. A new errstate per use (a decorator's is safe per call too)."""
    return np.errstate(invalid="ignore")


def per_worker(make):
    """``get()`` returns the calling worker thread's buffers for this call: ``make()``'s, made at
    its first block and reused for the others. A tile-sized array made per block is handed back
    to the OS when freed and, made again, faulted in page by page (512 faults for a 2 MiB tile)."""
    local = threading.local()

    def get():
        if not hasattr(local, "buffers"):
            local.buffers = make()
        return local.buffers
    return get

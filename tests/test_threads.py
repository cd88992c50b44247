"""Threads and BLAS: the same bits from any thread, and the caller's BLAS setting untouched.

How many threads a BLAS uses changes how it splits a matmul and so its rounding, and NumPy's
OpenBLAS keeps that count in one process-wide variable. The kernel holds it at one thread while
a call runs (calls are serialised), and puts back what it found whether the call returns,
raises or is interrupted. These tests run the kernel from several threads at once, overlap calls,
interrupt one with a real SIGINT, and compare bits and BLAS settings.

No test here depends on the machine's speed: where an order of events matters (a call overlapping
another, an interrupt inside a call, every worker busy at once), hooks on the kernel's own steps
make it happen at a known point. ``HANG`` only turns a hang into a failure.
"""

import collections
import contextvars
import signal
import threading

import numpy as np
import pytest
import threadpoolctl

import _flash_runtime  # flash_lib's private runtime: its BLAS pinning is tested here
import flash_lib
from flash_lib import flash_attention

N, D = 1024, 64  # 2**20 scores: large enough for the kernel to use its worker threads
HANG = 120  # seconds: a wait that takes longer is a failure (an idle machine takes milliseconds)


def blas_threads():
    """The thread count of every BLAS library loaded, as threadpoolctl reports it afresh."""
    return [(i["filepath"], i["num_threads"]) for i in threadpoolctl.threadpool_info()
            if i["user_api"] == "blas"]


def inputs(dtype, n_q=N, n_k=N, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((n, D)).astype(dtype) for n in (n_q, n_k, n_k))


def run_in_threads(fn, n_threads):
    """Call ``fn()`` in ``n_threads`` threads released together; return their results in order."""
    barrier = threading.Barrier(n_threads)
    results, errors = [None] * n_threads, []

    def target(i):
        try:
            barrier.wait()
            results[i] = fn()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_four_threads_at_once_give_the_serial_bits(dtype):
    """Four threads calling together each get exactly the main thread's serial result, and the
    BLAS setting afterwards is what it was before (1 vs 2 BLAS threads changes the last bit of
    about a third of the rows in float32, and of every row for these tiles in float64)."""
    q, k, v = inputs(dtype)
    before = blas_threads()
    # 477-key tiles: with them OpenBLAS's float64 products also depend on its thread count.
    blocks = dict(block_q=512, block_k=477)
    serial = flash_attention(q, k, v, return_lse=True, **blocks)
    for out, lse in run_in_threads(lambda: flash_attention(q, k, v, return_lse=True, **blocks), 4):
        np.testing.assert_array_equal(out, serial[0])
        np.testing.assert_array_equal(lse, serial[1])
    assert blas_threads() == before


@pytest.mark.parametrize("first", ["background", "main"])
def test_a_background_call_that_outlives_the_main_one(first, monkeypatch):
    """A long call in a background thread overlapping a shorter one in the main thread, started
    before it or during it: both give their serial bits, and afterwards BLAS is back at the
    caller's setting. (With the old limit, set by the first call to enter and restored by the
    last to leave, a background call leaving last could not restore it: the process stayed at
    one BLAS thread.) The overlap is made, not hoped for: "background" starts the main call once
    the background one is inside its first tile; "main" starts the background call from inside
    the main call's first tile and goes on once it has reached the kernel (where it waits for
    the main call to finish, and then leaves last)."""
    long_inputs, short_inputs = inputs(np.float32, 4 * N, 4 * N, seed=1), inputs(np.float32)
    before = blas_threads()
    serial_long, serial_short = flash_attention(*long_inputs), flash_attention(*short_inputs)
    caller = contextvars.ContextVar("caller", default="main")  # the kernel's workers inherit it
    in_a_tile = {"main": threading.Event(), "background": threading.Event()}
    background_reached_kernel = threading.Event()
    background = {}

    def background_call():
        caller.set("background")
        background["out"] = flash_attention(*long_inputs)

    thread = threading.Thread(target=background_call)
    update, run_blocks = flash_lib.online_softmax_update, _flash_runtime.run_blocks

    def watching_update(*args):
        who = caller.get()
        if who == "main" and first == "main" and not in_a_tile["main"].is_set():
            in_a_tile["main"].set()
            thread.start()
            assert background_reached_kernel.wait(HANG)
        in_a_tile[who].set()
        return update(*args)

    def watching_run_blocks(*args, **kwargs):
        if caller.get() == "background":
            background_reached_kernel.set()  # next: the lock the main call holds, if it runs
        return run_blocks(*args, **kwargs)

    monkeypatch.setattr(flash_lib, "online_softmax_update", watching_update)
    monkeypatch.setattr(_flash_runtime, "run_blocks", watching_run_blocks)
    if first == "background":
        thread.start()
        assert in_a_tile["background"].wait(HANG)
    short = flash_attention(*short_inputs)
    thread.join(HANG)
    assert not thread.is_alive()
    assert blas_threads() == before
    np.testing.assert_array_equal(short, serial_short)
    np.testing.assert_array_equal(background["out"], serial_long)


def test_blas_is_held_at_one_thread_inside_a_call_from_any_thread(monkeypatch):
    """Whichever thread calls, every tile runs with BLAS at one thread (seen from inside the
    recurrence), and the caller's setting (here 2, set with threadpoolctl) is back afterwards."""
    seen = []
    update = flash_lib.online_softmax_update
    blas = _flash_runtime.BLAS_LIBS  # the libraries the kernel pins: those loaded at its import

    def watching_update(*args):
        seen.append(tuple(lib.get_num_threads() for lib in blas))
        return update(*args)

    monkeypatch.setattr(flash_lib, "online_softmax_update", watching_update)
    q, k, v = inputs(np.float64)
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        before = blas_threads()
        flash_attention(q, k, v)
        run_in_threads(lambda: flash_attention(q, k, v), 2)
        after = blas_threads()
    assert seen and set(seen) == {(1,) * len(blas)}, set(seen)
    assert after == before and all(n == 2 for _, n in before), before


def test_a_call_that_raises_in_a_worker_restores_blas_and_leaves_no_threads(monkeypatch):
    """An exception inside one worker's tile stops every worker, reaches the caller, and leaves
    BLAS as it was and no kernel thread behind; the next call works."""
    q, k, v = inputs(np.float64)
    before, serial = blas_threads(), flash_attention(q, k, v)
    update, calls = flash_lib.online_softmax_update, []

    def failing_update(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom in a tile")
        return update(*args)

    with monkeypatch.context() as patch:
        patch.setattr(flash_lib, "online_softmax_update", failing_update)
        with pytest.raises(RuntimeError, match="boom in a tile"):
            flash_attention(q, k, v, block_q=64, block_k=64)
    assert blas_threads() == before
    assert not [t for t in threading.enumerate() if t.name.startswith("flash_lib")]
    np.testing.assert_array_equal(flash_attention(q, k, v), serial)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="SIGINT is delivered to the main thread")
def test_ctrl_c_stops_a_threaded_call_before_each_workers_next_tile(monkeypatch):
    """A real SIGINT, sent from inside the first tile of a call on two worker threads (so it
    arrives at a known point, however fast or loaded the machine): KeyboardInterrupt reaches the
    caller, and once the call is cancelled no worker begins more than the one tile it was already
    in (the kernel checks between tiles); no kernel thread is left, BLAS is as it was, and the
    next call gives the serial bits."""
    # Python's own Ctrl-C handler, whatever an earlier test in this process left installed (an
    # asyncio runner's, say, turns the first SIGINT into a task cancellation, not an exception)
    handler = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch_handler = f"SIGINT handler found: {handler}"
    q, k, v = inputs(np.float32, 1024, 2048, seed=2)  # 16 x 32 tiles of 64 x 64
    blocks = dict(block_q=64, block_k=64)
    small = inputs(np.float32, 64, 64)
    before, serial = blas_threads(), flash_attention(*small)
    main = threading.main_thread().ident
    cancelled = []  # the call's cancellation event, as the kernel hands it to each block
    begun = []  # per tile begun: (worker, whether the call was already cancelled)
    first_tile = threading.Lock()
    run_blocks, update = _flash_runtime.run_blocks, flash_lib.online_softmax_update

    def watching_run_blocks(work_on, *args, **kwargs):
        def work(block, event):
            cancelled.append(event)
            return work_on(block, event)
        return run_blocks(work, *args, **kwargs)

    def interrupting_update(*args):
        event = cancelled[0]
        begun.append((threading.current_thread().name, event.is_set()))
        if first_tile.acquire(blocking=False):  # the first tile of the call, in whichever worker
            signal.pthread_kill(main, signal.SIGINT)
            assert event.wait(HANG), f"the caller was not interrupted ({monkeypatch_handler})"
        return update(*args)

    monkeypatch.setattr(_flash_runtime, "run_blocks", watching_run_blocks)
    monkeypatch.setattr(flash_lib, "online_softmax_update", interrupting_update)
    try:
        with flash_lib.threads(2), pytest.raises(KeyboardInterrupt):
            flash_attention(q, k, v, **blocks)
    finally:
        signal.signal(signal.SIGINT, handler)
    monkeypatch.undo()
    workers = {name for name, _ in begun}
    assert len(workers) <= 2 and all(name.startswith("flash_lib") for name in workers), workers
    after_cancel = collections.Counter(name for name, late in begun if late)
    assert all(n <= 1 for n in after_cancel.values()), (
        f"tiles begun after the call was cancelled, per worker: {dict(after_cancel)}")
    assert len(begun) < 16 * 32  # the call stopped
    assert not [t for t in threading.enumerate() if t.name.startswith("flash_lib")]
    assert blas_threads() == before
    np.testing.assert_array_equal(flash_attention(*small), serial)


def test_threads_sets_the_worker_count_for_calls_inside_it_and_only_there():
    """``flash_lib.threads(n)`` is a context manager: inside it, thread_count() is n and a large
    call runs on exactly n worker threads (seen from inside the recurrence); it nests, restores
    the outer count on exit (also on an exception), holds per context (another thread keeps the
    default), refuses a count that is not a positive integer, and moves no bit."""
    default = flash_lib.thread_count()
    q, k, v = inputs(np.float64)

    def workers_used(n):
        names = set()
        update = flash_lib.online_softmax_update
        # each worker's first tile waits for the others' (16 query blocks: one for each): all n
        # workers take part however the machine schedules them
        all_started = threading.Barrier(n)

        def watching_update(*args):
            name = threading.current_thread().name
            if name not in names:
                names.add(name)
                all_started.wait(HANG)
            return update(*args)

        with pytest.MonkeyPatch.context() as patch, flash_lib.threads(n):
            patch.setattr(flash_lib, "online_softmax_update", watching_update)
            out = flash_attention(q, k, v, block_q=64)
        return names, out

    (one, out_1), (three, out_3) = workers_used(1), workers_used(3)
    assert one == {threading.current_thread().name}, one  # no pool: the calling thread
    assert len(three) == 3 and all(name.startswith("flash_lib") for name in three), three
    np.testing.assert_array_equal(out_1, out_3)

    with flash_lib.threads(2):
        assert flash_lib.thread_count() == 2
        with flash_lib.threads(5):
            assert flash_lib.thread_count() == 5
            seen_elsewhere = []
            other = threading.Thread(target=lambda: seen_elsewhere.append(flash_lib.thread_count()))
            other.start()
            other.join()
            assert seen_elsewhere == [default]
        assert flash_lib.thread_count() == 2
        with pytest.raises(KeyError), flash_lib.threads(1):
            raise KeyError
        assert flash_lib.thread_count() == 2
    assert flash_lib.thread_count() == default
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ValueError, match="positive integer"), flash_lib.threads(bad):
            pass

"""Threads and BLAS: the same bits from any thread, and the caller's BLAS setting untouched.

How many threads a BLAS uses changes how it splits a matmul and so its rounding, and NumPy's
OpenBLAS keeps that count in one process-wide variable. The kernel holds it at one thread while
a call runs (calls are serialised), and puts back what it found whether the call returns,
raises or is interrupted. These tests run the kernel from several threads at once, overlap calls,
interrupt one with a real SIGINT, and compare bits and BLAS settings.
"""

import signal
import threading
import time

import numpy as np
import pytest
import threadpoolctl

import _flash_runtime  # flash_lib's private runtime: its BLAS pinning is tested here
import flash_lib
from flash_lib import flash_attention

N, D = 1024, 64  # 2**20 scores: large enough for the kernel to use its worker threads


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
def test_a_background_call_that_outlives_the_main_one(first):
    """A long call in a background thread overlapping a shorter one in the main thread, started
    before it or during it: both give their serial bits, and afterwards BLAS is back at the
    caller's setting. (With the old limit, set by the first call to enter and restored by the
    last to leave, a background call leaving last could not restore it: the process stayed at
    one BLAS thread.)"""
    long_inputs, short_inputs = inputs(np.float32, 4 * N, 4 * N, seed=1), inputs(np.float32)
    if first == "main":
        short_inputs = inputs(np.float32, 4 * N, 2 * N, seed=3)  # long enough to be overlapped
    before = blas_threads()
    serial_long, serial_short = flash_attention(*long_inputs), flash_attention(*short_inputs)
    background = {}
    thread = threading.Thread(target=lambda: background.update(out=flash_attention(*long_inputs)))
    if first == "background":
        thread.start()
        time.sleep(0.05)
        short = flash_attention(*short_inputs)
    else:
        timer = threading.Timer(0.01, thread.start)
        timer.start()
        short = flash_attention(*short_inputs)
        timer.join()
    thread.join()
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
    before = blas_threads()
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
    np.testing.assert_array_equal(flash_attention(q, k, v), flash_attention(q, k, v))


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="SIGINT is delivered to the main thread")
def test_ctrl_c_stops_a_threaded_call_within_about_a_tile():
    """A real SIGINT 0.2 s into a call with about 1.5 s of work left: KeyboardInterrupt reaches
    the caller within 0.5 s (each worker stops before its next tile; a 512 × 512 tile takes a few
    ms), no kernel thread is left, BLAS is as it was, and the next call runs normally."""
    q, k, v = inputs(np.float32, 2048, 1 << 18, seed=2)
    before = blas_threads()
    main = threading.main_thread().ident
    timer = threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT))
    start = time.perf_counter()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        flash_attention(q, k, v)
    stopped_after = time.perf_counter() - start
    timer.join()
    assert stopped_after < 0.2 + 0.5, f"stopped {stopped_after:.2f} s after the call started"
    assert not [t for t in threading.enumerate() if t.name.startswith("flash_lib")]
    assert blas_threads() == before
    small = inputs(np.float32, 64, 64)
    np.testing.assert_array_equal(flash_attention(*small), flash_attention(*small))


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

        def watching_update(*args):
            names.add(threading.current_thread().name)
            time.sleep(0.005)  # each tile takes long enough for every worker to get one
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

"""flash_cpu (the fused CPU kernel, issue 38) beside flash_lib and PyTorch SDPA, in one run.

``make bench`` runs this section after the fwd+bwd table (``bench_flash.py --cpu-sizes``);
alone: ``.venv/bin/python bench/bench_cpu.py [--sizes 2048 4096 8192] [--dtypes float32]``.

* its floor: one ``block_q × block_k`` tile of flash_cpu timed op by op on one thread, BLAS at
  one thread: the forward's two matmuls and its one fused pass; the backward's five matmuls
  and its fused pass. A row's floor is that sum × the tiles visited / the worker threads;
* forward and fwd+bwd, N = Nq = Nk, d = 64, no mask: flash_cpu, flash_lib and torch SDPA (with
  autograd for fwd+bwd) and a GEMM, timed in turn round after round, each settled first
  (``flash_bench.best_times``), the best of each kept: the ratios, the % of the GEMM rate
  (4·N²·d flops forward, 14·N²·d fwd+bwd), flash_cpu / its floor, and flash_cpu's error
  against flash_lib (rowwise, largest);
* issue 38's targets with PASS or FAIL: forward flash_cpu / torch <= 1.0 at N = 4096 and 8192 in
  float32 and float64, fwd+bwd <= 1.0, and >= 65% of the GEMM rate for the forward.

The first call's time in this process is printed too: compiling (a fresh checkout) or loading
the compiled code from ``__pycache__`` (``cache=True``).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import flash_lib
from flash_bench import best_times

D = 64
DTYPES = {"float64": np.float64, "float32": np.float32}
TARGET_SIZES = (4096, 8192)
TARGET_GEMM = 0.65  # of the GEMM rate, for the forward


def first_call_seconds():
    """Seconds of importing flash_cpu and its first forward and backward in each dtype: the
    compilation on a fresh checkout, else loading the cached machine code."""
    t0 = time.perf_counter()
    import flash_cpu
    for dtype in DTYPES.values():
        q = np.ones((4, 8), dtype)
        out, lse = flash_cpu.flash_attention(q, q, q, return_lse=True)
        flash_cpu.flash_attention_backward(q, q, q, out, lse, q)
    return time.perf_counter() - t0


def _best(fn, seconds):
    fn()  # untimed: a first call may compile
    best, until = np.inf, time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > until:
            return best


def tile_floor(dtype, block_q, block_k, seconds=0.5):
    """One tile of flash_cpu, op by op, one thread (BLAS at one): ``{"forward": {op: s},
    "backward": {op: s}}``, the best of repeats of each."""
    import flash_cpu
    from threadpoolctl import threadpool_limits
    rng = np.random.default_rng(0)
    q, do = (rng.standard_normal((block_q, D)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((block_k, D)).astype(dtype) for _ in range(2))
    s, dp = np.empty((block_q, block_k), dtype), np.empty((block_q, block_k), dtype)
    m, l = np.zeros(block_q, dtype), np.ones(block_q, dtype)
    acc, pv = np.zeros((block_q, D), dtype), np.empty((block_q, D), dtype)
    lse, dsum = np.full(block_q, 8.0, dtype), np.zeros(block_q, dtype)
    no_mask = np.ones((1, 1), bool)
    dk, dq = np.zeros((block_k, D), dtype), np.zeros((block_q, D), dtype)
    each = seconds / 9
    with threadpool_limits(1, user_api="blas"):
        np.matmul(q, k.T, out=s)
        fwd = {"S = QKᵀ": _best(lambda: np.matmul(q, k.T, out=s), each),
               # the fused passes are flash_cpu's internals: a bench of them
               "fused pass": _best(lambda: flash_cpu._forward_tile(  # noqa: SLF001
                   s, m, l, acc, no_mask, False, block_k, 0, 0), each),
               "acc += PV": _best(lambda: np.add(acc, np.matmul(s, v, out=pv), out=acc), each)}
        np.matmul(do, v.T, out=dp)
        bwd = {"S = QKᵀ": fwd["S = QKᵀ"],
               "dP = dO Vᵀ": _best(lambda: np.matmul(do, v.T, out=dp), each),
               "fused pass": _best(lambda: flash_cpu._backward_tile(  # noqa: SLF001
                   s, dp, lse, dsum, no_mask, False, block_k, 0, 0), each),
               "dV += Pᵀ dO": _best(lambda: np.add(dk, s.T @ do, out=dk), each),
               "dK += dSᵀ Q": _best(lambda: np.add(dk, dp.T @ q, out=dk), each),
               "dQ += dS K": _best(lambda: np.add(dq, np.matmul(dp, k), out=dq), each)}
    return {"forward": fwd, "backward": bwd}


def _floor(per_tile, n, block_q, block_k, by_keys=False):
    tiles = len(flash_lib.tile_schedule(n, n, block_q, block_k))
    blocks = -(-n // (block_k if by_keys else block_q))
    return sum(per_tile.values()) * tiles / flash_lib.worker_count(blocks, n * n)


def _row_error(a, b):
    return float((np.abs(a - b).max(axis=-1) / np.abs(b).max(axis=-1)).max())


def cpu_table(sizes, dtypes, torch, seconds, log, gemm=None, gemm_peak=None):
    """The section: floor, forward and fwd+bwd rows, targets. ``gemm(name)`` is a callable
    timing one GEMM into ``gemm_peak[name]`` (bench_flash's), or None: this module's own."""
    import flash_cpu
    first = first_call_seconds()
    bq, bk = flash_cpu.DEFAULT_BLOCK_Q, flash_cpu.DEFAULT_BLOCK_K
    log(f"\n# flash_cpu (issue 38): BLAS for the matmuls, one compiled pass per tile between them; "
        f"block_q = {bq}, block_k = {bk}, d = {D}, no mask, {flash_lib.thread_count()} threads")
    log(f"# first call in this process (import, f32 and f64 forward and backward): {first:.1f} s "
        f"(compiling on a fresh checkout; loading __pycache__ after)")
    if gemm is None:
        gemm_peak = {}

        def gemm(name, n=2048):
            a = np.random.default_rng(0).standard_normal((n, n)).astype(DTYPES[name])

            def run():
                t0 = time.perf_counter()
                a @ a
                gemm_peak[name] = max(gemm_peak.get(name, 0), 2 * n**3 / (time.perf_counter() - t0) / 1e9)
            return run
    floors = {}
    for name in dtypes:
        floors[name] = tile_floor(DTYPES[name], bq, bk)
        for direction, ops in floors[name].items():
            total = sum(ops.values())
            log(f"{name} {direction} tile floor: " + ", ".join(f"{op} {1e6 * s:.0f}"
                                                            for op, s in ops.items())
                + f" µs; {1e6 * total:.0f} µs a tile, fused pass "
                f"{100 * ops['fused pass'] / total:.0f}%")
    log("  dtype       N  pass      cpu ms   lib ms  torch ms  cpu/lib  cpu/torch  floor ms  "
        "cpu/floor  cpu %GEMM  lib %GEMM  torch %GEMM  err vs lib")
    rows = []
    for name in dtypes:
        dtype = DTYPES[name]
        for n in sizes:
            rng = np.random.default_rng(0)
            q, k, v, dout = (rng.standard_normal((n, D)).astype(dtype) for _ in range(4))
            for direction in ("forward", "fwd+bwd"):
                if direction == "forward":
                    fns = {"cpu": lambda: flash_cpu.flash_attention(q, k, v),
                           "lib": lambda: flash_lib.flash_attention(q, k, v)}
                    flops = 4 * n * n * D
                    check = (fns["cpu"](), fns["lib"]())
                else:
                    def both(mod):
                        def run():
                            out, lse = mod.flash_attention(q, k, v, return_lse=True)
                            return mod.flash_attention_backward(q, k, v, out, lse, dout)
                        return run
                    fns = {"cpu": both(flash_cpu), "lib": both(flash_lib)}
                    flops = 14 * n * n * D
                    check = (np.concatenate(fns["cpu"]()), np.concatenate(fns["lib"]()))
                err = _row_error(*check)
                if torch is not None:
                    fns["torch"] = _torch(torch, q, k, v, dout, direction == "fwd+bwd")
                fns["gemm"] = gemm(name)
                best, rounds = best_times(fns, seconds)
                floor = _floor(floors[name]["forward"], n, bq, bk)
                if direction == "fwd+bwd":
                    floor += _floor(floors[name]["backward"], n, bq, bk, by_keys=True)
                rate = gemm_peak[name]
                t_c, t_l, t_t = best["cpu"], best["lib"], best.get("torch")
                rec = dict(kind="flash_cpu", dtype=name, n=n, direction=direction, cpu_s=t_c,
                           lib_s=t_l, torch_s=t_t, floor_s=floor, gemm_gflops=rate,
                           rounds=rounds, err_vs_lib=err, first_call_s=first)
                rows.append(rec)

                def pct(t):
                    return "-" if t is None else f"{100 * flops / t / 1e9 / rate:.0f}%"
                log(f"{name:>7} {n:>7}  {direction:<7} {1e3 * t_c:8.1f} {1e3 * t_l:8.1f} "
                    f"{'-' if t_t is None else f'{1e3 * t_t:.1f}':>9} {t_c / t_l:8.3f} "
                    f"{'-' if t_t is None else f'{t_c / t_t:.3f}':>10} {1e3 * floor:9.1f} "
                    f"{t_c / floor:10.3f} {pct(t_c):>10} {pct(t_l):>10} {pct(t_t):>12} "
                    f"{err:11.1e}")
    targets(rows, torch, log)
    return rows


def _torch(torch, q, k, v, dout, backward):
    n = q.shape[0]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if not backward:
        qt, kt, vt = (torch.from_numpy(x).view(1, 1, n, D) for x in (q, k, v))

        def run():
            with torch.inference_mode():
                return sdpa(qt, kt, vt)
        return run
    qt, kt, vt = (torch.from_numpy(x).view(1, 1, n, D).requires_grad_() for x in (q, k, v))
    gt = torch.from_numpy(dout).view(1, 1, n, D)

    def run_backward():
        for t in (qt, kt, vt):
            t.grad = None
        sdpa(qt, kt, vt).backward(gt)
    return run_backward


def targets(rows, torch, log):
    """Issue 38's targets, each PASS or FAIL with its number (or why it was not measured)."""
    log("\n# issue 38's targets (flash_cpu; a benchmark on this machine, not a test)")
    for row in rows:
        if row["n"] not in TARGET_SIZES:
            continue
        label = f"{row['direction']} {row['dtype']} N = {row['n']}"
        if row["torch_s"] is None:
            log(f"  {label}: flash_cpu / torch <= 1.0: not measured (no torch)")
        else:
            r = row["cpu_s"] / row["torch_s"]
            log(f"  {label}: flash_cpu / torch = {r:.3f} <= 1.0: {'PASS' if r <= 1 else 'FAIL'}")
        if row["direction"] == "forward":
            share = 4 * row["n"] ** 2 * D / row["cpu_s"] / 1e9 / row["gemm_gflops"]
            log(f"  {label}: {100 * share:.0f}% of GEMM >= {100 * TARGET_GEMM:.0f}%: "
                f"{'PASS' if share >= TARGET_GEMM else 'FAIL'}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["float64", "float32"])
    p.add_argument("--seconds", type=float, default=2.5, help="timing budget of one row")
    p.add_argument("--no-torch", action="store_true")
    args = p.parse_args(argv)
    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            torch = None
        else:
            torch.set_num_threads(flash_lib.thread_count())
    import flash_bench
    print(flash_bench.describe(), flush=True)
    cpu_table(args.sizes, args.dtypes, torch, args.seconds, lambda *a: print(*a, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""flash_triton on a CUDA GPU: compiled, checked, then timed against PyTorch's SDPA.

On a machine with CUDA (``make bench-gpu``):

1. flash_triton's kernels are compiled by Triton (no interpreter) and autotuned
   (``flash_triton.GPU_CONFIGS``, pruned by head dimension);
2. ``flash_check`` runs on them with every feature flash_triton declares
   (``flash_triton.FEATURES``: mask, causal, lse, dv, sinks, dropout with flash_lib's generator)
   and their backward, in float32 and float16 (flash_check knows no bfloat16);
3. a grid of its own, float16 and bfloat16 × causal or not × d = 64 and 128 × dropout off and
   on (p = 0.1), compares forward (out, lse) and backward (dq, dk, dv) with flash_lib's
   float64 kernel under the same seed (``flash_lib.flash_attention(dropout_seed=...)``, whose
   mask flash_triton draws bit for bit);
4. forward and forward+backward are timed at N = 1k ... 16k, FlashAttention-2's benchmark
   shapes (its README, "Performance", A100: hidden dimension 2048, so 32 heads at d = 64 and
   16 at d = 128, batch 16k / N), against ``torch.nn.functional.scaled_dot_product_attention``
   forced to its flash backend, in the same run and on the same tensors. Printed: TFLOP/s
   (FlashAttention-2's count: 4·N²·d·heads·batch for the forward, halved under causal, and 2.5
   times that for the backward, as Triton's tutorial 06 counts), flash_triton / SDPA time, and
   % of the GPU's dense float16 tensor-core peak (:data:`PEAKS`, chapter 16's table).

The results (checks and timings) go to a JSON file (``--json``). Without CUDA it says so in one
line and exits 0. ``--interpret --quick`` runs the same code path on tiny shapes under Triton's
interpreter, on the CPU: every step above but compilation and GPU timing (the clock is then
Python's, one call, and SDPA runs its math backend on the CPU); ``tests/test_triton.py`` runs
it, so the script cannot rot. Exit status 1 if any check fails.

Usage::

    .venv/bin/python bench/bench_gpu.py                      # on a CUDA machine, a few minutes
    .venv/bin/python bench/bench_gpu.py --interpret --quick  # anywhere Triton installs, < 1 min
    .venv/bin/python bench/bench_gpu.py --sizes 1024 4096 --dims 64 --json /tmp/gpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repo's modules, not an installed copy
    sys.path.insert(0, str(ROOT))

#: Dense float16 tensor-core peaks, TFLOP/s (chapter 16's table: NVIDIA's A100 and H100
#: datasheets; the H200 has the H100 SXM's compute, its datasheet), by a substring of
#: ``torch.cuda.get_device_name()``. A GPU not listed gets no "% of peak".
PEAKS = {"A100": 312.0, "H100": 989.0, "H200": 989.0}
#: FlashAttention-2's benchmark: tokens per batch (batch = TOKENS / N) and hidden dimension
#: (heads = HIDDEN / d): flash-attention's README, "Performance", A100.
TOKENS, HIDDEN = 16384, 2048
#: The full run's and ``--quick``'s shapes: sequence lengths, head dims; check-grid length.
FULL = dict(sizes=(1024, 2048, 4096, 8192, 16384), dims=(64, 128), check_n=256)
QUICK = dict(sizes=(64,), dims=(16,), check_n=40)
#: flash_check's cases in ``--quick``: one of each kind (plain, causal with Nq > Nk, padding,
#: non-finite padded keys, sinks with gradients, dropout with its mask and gradients).
QUICK_CASES = ("random", "causal_tall", "key_padding", "masked_nonfinite", "sinks", "dropout")
DROPOUT_P, SEED = 0.1, 2026
#: The grid's bounds, relative to each result's largest entry, against flash_lib in float64:
#: out rounded once to the dtype and P rounded to it before P·V (about 1 ulp), the gradients
#: through dS rounded too. Measured under the interpreter (Nq = 40, d = 16 and 32): out <= 0.42
#: ulp (float16) and 0.91 (bfloat16), gradients <= 0.58 and 1.51; the bounds are in ulps.
BOUNDS = {"out": 4, "grads": 8}
LSE_BOUND = 1e-5  # float32, relative to 1 + |lse|
#: The timed forward's largest difference from SDPA's output, in ulps of the dtype relative to
#: SDPA's largest entry: both round P (or its equivalent) and out to the dtype once.
SDPA_ULPS = 8


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpret", action="store_true",
                        help="run the kernels under Triton's interpreter on the CPU")
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny shapes: N in {QUICK['sizes']}, d in {QUICK['dims']}, and "
                             f"flash_check's cases {', '.join(QUICK_CASES)}")
    parser.add_argument("--sizes", type=int, nargs="+", help="sequence lengths to time")
    parser.add_argument("--dims", type=int, nargs="+", help="head dimensions")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "bench_gpu.json",
                        help="where to write the results (default: bench/bench_gpu.json)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    import torch

    if not args.interpret and not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU here, nothing to compile or time (run with --interpret "
              "--quick to exercise the script under Triton's interpreter); exiting.")
        return 0
    if args.interpret:  # before flash_triton imports triton: Triton reads it then
        os.environ["TRITON_INTERPRET"] = "1"
    import flash_triton

    shapes = dict(QUICK if args.quick else FULL)
    shapes["sizes"] = tuple(args.sizes or shapes["sizes"])
    shapes["dims"] = tuple(args.dims or shapes["dims"])
    device = flash_triton.DEVICE
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.machine()})"
    peak = next((v for k, v in PEAKS.items() if k in name), None)
    print(f"bench_gpu: {name}; triton interpreted: {flash_triton.INTERPRETED}; "
          f"shapes: {'quick' if args.quick else 'full'}")
    results = {"device": name, "interpreted": flash_triton.INTERPRETED, "quick": args.quick,
               "peak_tflops": peak, "torch": torch.__version__}

    results["flash_check"] = run_flash_check(flash_triton, args.quick)
    results["grid"] = check_grid(flash_triton, shapes["dims"], shapes["check_n"])
    results["timings"] = time_all(flash_triton, torch, shapes, peak)
    ok = (results["flash_check"]["ok"] and all(r["ok"] for r in results["grid"])
          and all(r["ok"] for r in results["timings"]))
    results["ok"] = ok
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nresults written to {args.json}; checks {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def run_flash_check(flash_triton, quick):
    """flash_check on the kernels, every feature flash_triton declares, with its backward and
    flash_lib's dropout generator: its summary line and failures."""
    import flash_check

    report = flash_check.check_kernel(
        flash_triton.attention_with_lse, features=flash_triton.FEATURES,
        dtypes=("float32", "float16"), backward=flash_triton.attention_backward,
        dropout_generator="flash_lib", cases=list(QUICK_CASES) if quick else None)
    summary = str(report).splitlines()[-1]
    print(f"\nflash_check, features {' '.join(flash_triton.FEATURES)}: {summary}")
    for failure in report.failures:
        print(f"  FAIL {failure}")
    return {"ok": report.ok, "summary": summary, "failures": [str(f) for f in report.failures]}


def _relative(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), np.finfo(float).tiny))


def check_grid(flash_triton, dims, n):
    """float16 and bfloat16 × causal × d × dropout: flash_triton against flash_lib in float64 on
    the same (rounded) inputs and seed, forward and backward."""
    import ml_dtypes

    import flash_lib

    rows = []
    print(f"\nagainst flash_lib (float64, same inputs and seed), Nq = {n}, Nk = {n + 24}, "
          f"2 x 2 heads; errors relative to each result's largest entry, in ulps of the dtype")
    print(f"{'dtype':>9} {'causal':>6} {'d':>4} {'dropout':>7} {'out':>6} {'grads':>6}  ok")
    for dtype in (np.float16, ml_dtypes.bfloat16):
        eps = float(ml_dtypes.finfo(dtype).eps)
        for causal in (False, True):
            for d in dims:
                for p in (0.0, DROPOUT_P):
                    rng = np.random.default_rng([d, int(causal), int(p * 10)])
                    q, k, v, dout = (rng.standard_normal((2, 2, m, d)).astype(dtype)
                                     for m in (n, n + 24, n + 24, n))
                    drop = dict(dropout_p=p, dropout_seed=SEED) if p else {}
                    out, lse = flash_triton.attention(q, k, v, causal=causal, return_lse=True,
                                                      **drop)
                    grads = flash_triton.attention_backward(q, k, v, out, lse, dout,
                                                            causal=causal, **drop)
                    x64 = [x.astype(np.float64) for x in (q, k, v, dout)]
                    ref, ref_lse = flash_lib.flash_attention(*x64[:3], causal=causal,
                                                             return_lse=True, **drop)
                    refs = flash_lib.flash_attention_backward(*x64[:3], ref, ref_lse, x64[3],
                                                              causal=causal, **drop)
                    out_err = _relative(out, ref) / eps
                    grad_err = max(_relative(g, r) for g, r in zip(grads, refs)) / eps
                    lse_err = float(np.max(np.abs(lse - ref_lse) / (1 + np.abs(ref_lse))))
                    ok = (out_err <= BOUNDS["out"] and grad_err <= BOUNDS["grads"]
                          and lse_err <= LSE_BOUND)
                    rows.append(dict(dtype=np.dtype(dtype).name, causal=causal, d=d, dropout=p,
                                     out_ulps=out_err, grad_ulps=grad_err, lse_error=lse_err,
                                     ok=ok))
                    print(f"{np.dtype(dtype).name:>9} {causal!s:>6} {d:>4} {p:>7} "
                          f"{out_err:>6.2f} {grad_err:>6.2f}  {'ok' if ok else 'FAIL'}")
    return rows


# ---------------------------------------------------------------------------------------------
# Timings
# ---------------------------------------------------------------------------------------------


def flops(batch, heads, n, d, causal, mode):
    """FlashAttention-2's count: two N × N × d matmuls forward (4·N²·d), halved under causal;
    the backward 2.5 times the forward (five matmuls, one of them the recomputed S)."""
    f = 4 * batch * heads * n * n * d * (0.5 if causal else 1.0)
    return f * (1 + 2.5) if mode == "fwd+bwd" else f


def _timer(torch, interpreted):
    """ms per call: Triton's do_bench (CUDA events, warm-up, median) on a GPU; under the
    interpreter one call on Python's clock (there is nothing to warm, and it is slow)."""
    if interpreted:
        def once(fn):
            start = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - start)
        return once
    import triton

    def bench(fn):
        fn()  # compiles and autotunes outside the timed calls
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=100)
    return bench


def time_all(flash_triton, torch, shapes, peak):
    """forward and forward+backward, flash_triton against SDPA's flash backend (its math
    backend on a CPU), at each N and d, causal or not, float16 (float32 on a CPU, which has no
    float16 matmul worth timing)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    interpreted = flash_triton.INTERPRETED
    timer = _timer(torch, interpreted)
    device = flash_triton.DEVICE
    dtype = torch.float32 if device == "cpu" else torch.float16
    backend = SDPBackend.MATH if device == "cpu" else SDPBackend.FLASH_ATTENTION
    rows = []
    print(f"\ntimings, {str(dtype).split('.')[-1]}, batch = {TOKENS} / N (at least 1), heads = "
          f"{HIDDEN} / d; TFLOP/s by FlashAttention-2's count"
          + (f"; % of the {peak:.0f} TFLOP/s peak" if peak else ""))
    print(f"{'mode':>8} {'causal':>6} {'d':>4} {'N':>6} {'triton ms':>10} {'sdpa ms':>9} "
          f"{'TFLOP/s':>8} {'sdpa':>8} {'ratio':>6} {'% peak':>7} {'ulps':>5}")
    for d in shapes["dims"]:
        for causal in (False, True):
            for n in shapes["sizes"]:
                batch, heads = max(1, TOKENS // n), HIDDEN // d
                if interpreted:  # the interpreter runs every program in Python: one head
                    batch, heads = 1, 2
                gen = torch.Generator(device=device).manual_seed(n + d)
                q, k, v, dout = (torch.randn((batch, heads, n, d), generator=gen, device=device,
                                             dtype=dtype) for _ in range(4))
                flat = [x.view(batch * heads, n, d) for x in (q, k, v, dout)]
                scale = 1 / math.sqrt(d)

                def triton_fwd():
                    return flash_triton.forward_tensors(*flat[:3], scale=scale, causal=causal)

                def triton_fwd_bwd():
                    out, lse2 = triton_fwd()
                    return flash_triton.backward_tensors(*flat[:3], out, lse2, flat[3],
                                                         scale=scale, causal=causal)

                qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

                def sdpa_fwd():
                    with sdpa_kernel(backend), torch.no_grad():
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                def sdpa_fwd_bwd():
                    with sdpa_kernel(backend):
                        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                    out.backward(dout)

                # the same answer first, relative to SDPA's largest entry, in ulps of the
                # dtype: the timed kernels are the checked ones
                want = sdpa_fwd().float()
                same = float((triton_fwd()[0].view_as(q).float() - want).abs().max()
                             / want.abs().max() / torch.finfo(dtype).eps)
                for mode, ours, theirs in (("fwd", triton_fwd, sdpa_fwd),
                                           ("fwd+bwd", triton_fwd_bwd, sdpa_fwd_bwd)):
                    t_ours, t_sdpa = timer(ours), timer(theirs)
                    tflops = flops(batch, heads, n, d, causal, mode) / (t_ours * 1e-3) / 1e12
                    sdpa_tflops = flops(batch, heads, n, d, causal, mode) / (t_sdpa * 1e-3) / 1e12
                    of_peak = 100 * tflops / peak if peak else None
                    rows.append(dict(mode=mode, causal=causal, d=d, n=n, batch=batch, heads=heads,
                                     triton_ms=t_ours, sdpa_ms=t_sdpa, tflops=tflops,
                                     sdpa_tflops=sdpa_tflops, ratio=t_ours / t_sdpa,
                                     percent_of_peak=of_peak, ulps_from_sdpa=same,
                                     ok=same <= SDPA_ULPS))
                    print(f"{mode:>8} {causal!s:>6} {d:>4} {n:>6} {t_ours:>10.3f} {t_sdpa:>9.3f} "
                          f"{tflops:>8.2f} {sdpa_tflops:>8.2f} {t_ours / t_sdpa:>6.2f} "
                          f"{'' if of_peak is None else f'{of_peak:.1f}':>7} {same:>5.1f}"
                          f"{'' if same <= SDPA_ULPS else '  FAIL'}")
    return rows


if __name__ == "__main__":
    sys.exit(main())

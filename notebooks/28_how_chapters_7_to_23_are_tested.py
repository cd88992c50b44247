# ---
# jupyter:
#   jupytext:
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 28. Appendix B: how chapters 7–23 are tested and measured
#
# Every chapter ends with asserts, and `make test` runs each under nbval, which compares every
# cell's output with the stored one. So a chapter prints an error only as the limit it is under:
# its last digits, like every timing, depend on the machine, on which vector loops NumPy runs for
# `exp` and `exp2` (AVX-512, AVX2 or the baseline SSE; `NPY_DISABLE_CPU_FEATURES` switches the
# faster ones off, as on an older CPU, and CONTRIBUTING.md runs the chapters at each level), which
# kernel OpenBLAS picks, its caches and cores. Here are those measurements and the figures behind
# the chapters' limits; machine-dependent outputs are figures or tagged `nbval-ignore-output`.
# Chapters 1–6' evidence is in {doc}`appendix A <27_how_chapters_1_to_6_are_tested>`.

# %% [markdown]
# ## From chapters 7–11
# ### exp and exp2 in ulps (chapter 7)
#
# Chapter 7's error bound allows `exp` (and `exp2`) an error of 1 ulp in float64 and 3 in
# float32; NumPy's vectorised float32 `exp` errs by up to 2.52 ulp (numpy pull request 13134).
# Against a wider dtype, float32 on $[-87, 0]$ ($[-126, 0]$ for `exp2`), float64 on
# $[-700, 700]$ ($[-1000, 1000]$), `exp` erred by 2.52 and 0.68 ulp (float32, float64) with
# AVX-512 loops, 2.52 and 0.51 with AVX2, 0.50 and 0.51 with the baseline; `exp2` by 0.97 and
# 0.69 with AVX-512 (Intel's SVML), 0.50 and 0.51 otherwise. The cell checks the installed NumPy.

# %%
import numpy as np

exp_ulps, exp_err = {np.float64: 1, np.float32: 3}, {}
for f, ranges in ((np.exp, {np.float32: (-87, 0), np.float64: (-700, 700)}),
                  (np.exp2, {np.float32: (-126, 0), np.float64: (-1000, 1000)})):
    for dt, wide in ((np.float32, np.float64), (np.float64, np.longdouble)):
        x = np.linspace(*ranges[dt], 10**6, dtype=dt)
        exp_err[f, dt] = float((np.abs(f(x) - f(x.astype(wide))) / np.spacing(f(x))).max())
print("np.exp and np.exp2 within the ulps chapter 7 allows: " + ", ".join(
    f"{f.__name__} {dt.__name__} {exp_ulps[dt]} ulp: {err <= exp_ulps[dt]}"
    for (f, dt), err in exp_err.items()))
assert all(err <= exp_ulps[dt] for (f, dt), err in exp_err.items()), exp_err

# %% [markdown]
# ### Flash against naive, and base 2 against base e, row by row (chapter 7)
#
# Chapter 7 asserts the 2× same-dtype rule per dtype and family, not per row: which of flash and
# naive errs less on a row depends on BLAS's order of adding a score's terms (per row, flash's
# error / naive's ranged from 0.08 to 2.4 over the NumPy levels, OpenBLAS kernels and feature orders
# tried). Where NumPy's `exp2` is the faster (its AVX-512 float32 loop), flash_lib computes each
# $e^{s - m}$ as $2^{(s - m) \log_2 e}$ (chapter 5), two more roundings per exponent (chapter 7's
# step 6), each at most one unit in the exponent's last place; the rest are the same roundings drawn
# again. So each base must hold its own derived bound on every row, and base 2's largest error is
# held within a factor 3 of base e's either way (measured 0.59 to 1.82 over the NumPy levels and
# OpenBLAS's Haswell, SkylakeX and Sandybridge kernels when base 2 still scaled the keys; this
# machine's: the figure below), on chapter 7's two families of rows.

# %%
import matplotlib.pyplot as plt

import flash_lib
from flash_lib import rowwise_relative_error

rng, n_k, d = np.random.default_rng(7), 128, 32
tau = 1 / np.sqrt(d)
k = rng.standard_normal((n_k, d))
competing = rng.permutation(n_k)[: n_k // 2]
k[:, 0], k[:, 1] = 1.0, rng.uniform(-1, 1, n_k)
k[competing, 1], v = 1.0, rng.standard_normal((n_k, d))


def queries(a, b, sigma):
    q = rng.standard_normal((len(a), d)) * sigma[:, None]
    q[:, 0], q[:, 1] = a / tau, b / tau
    return q


spans_b = np.logspace(-2, np.log10(2e4), 64)
families = {"fixed span": queries(np.logspace(0, 9, 64), np.full(64, 3.0), np.ones(64)),
            "fixed magnitude": queries(1e4 - spans_b / 2, spans_b / 2, np.minimum(1, spans_b / 5))}


def derived_bound(q, kd, vd, truth, base2):
    """Chapter 7's bound per row, for flash_attention's 8 key blocks of 16."""
    dt, wide = q.dtype.type, np.longdouble
    gamma = lambda n: n * (np.finfo(dt).eps / 2) / (1 - n * (np.finfo(dt).eps / 2))
    mu = ((np.abs(q.astype(wide))[:, None, :] * np.abs(kd.astype(wide))[None]).sum(-1).max(-1)
          * wide(tau)).astype(np.float64)
    kappa = (np.abs(vd).max() / np.abs(truth).max(axis=-1)).astype(np.float64)
    return kappa * (4 * gamma(d + 2 + 2 * base2) * mu + 2 * gamma(n_k + 2 * 8 + 2)
                    + (2 * exp_ulps[dt] + 2) * np.finfo(dt).eps / 2)


flash_over_naive, by_base, base2_within, base2_vs_e = {}, {}, {}, {}
for dt in (np.float32, np.float64):
    u = np.finfo(dt).eps / 2
    kd, vd = k.astype(dt), v.astype(dt)
    for family, q in families.items():
        qd = q.astype(dt)
        truth = flash_lib.precise_attention(qd, kd, vd)
        err = {"naive": rowwise_relative_error(flash_lib.naive_attention(qd, kd, vd), truth)}
        for base in ("exp", "exp2"):
            with flash_lib.use_exponential(base):
                out = flash_lib.flash_attention(qd, kd, vd, block_q=32, block_k=16)
            err[base] = by_base[dt, family, base] = rowwise_relative_error(out, truth).astype(float)
        err["flash"] = err[flash_lib.exponential(dt).__name__]  # the base flash_lib uses here
        both = (np.minimum(err["flash"], err["naive"]) > 100 * u) & (np.maximum(err["flash"],
                                                                                err["naive"]) < 0.1)
        flash_over_naive[dt, family] = (err["flash"] / err["naive"])[both].astype(float)
        base2_within[dt, family] = bool(np.all(err["exp2"] <= derived_bound(qd, kd, vd, truth, 1))
                                        and np.all(err["exp"] <= derived_bound(qd, kd, vd, truth, 0)))
        meaningful = (err["exp"] > 100 * u) & (err["exp"] < 0.1)  # above noise, below garbage
        base2_vs_e[dt, family] = err["exp2"][meaningful].max() / err["exp"][meaningful].max()
print(f"both bases within their derived bounds on every row: {all(base2_within.values())}\nbase "
      f"2's largest error / base e's within [1/3, 3]: {all(1 / 3 <= r <= 3 for r in base2_vs_e.values())}")
assert all(base2_within.values()), base2_within
assert all(1 / 3 <= r <= 3 for r in base2_vs_e.values()), base2_vs_e

# %% tags=["hide-input"]
fig, (ax_h, *axes) = plt.subplots(1, 3, figsize=(14, 4.3))
bins = np.logspace(-1.5, 1, 41)
for i, dt in enumerate((np.float32, np.float64)):
    ratios = np.concatenate([flash_over_naive[dt, family] for family in families])
    ax_h.hist(ratios, bins=bins, histtype="step", lw=1.5, color=f"C{i}", label=dt.__name__)
ax_h.axvline(2, color="k", ls="--", lw=1, label="the 2× rule (on the largest errors)")
ax_h.set_xscale("log")
ax_h.set_xlabel("flash's error / naive's, per row (dimensionless)")
ax_h.set_ylabel("rows")
ax_h.set_title("Flash against naive, row by row", fontsize=10)
ax_h.legend(fontsize=8)
for ax, dt in zip(axes, (np.float32, np.float64)):
    lo = np.finfo(dt).eps / 2
    for i, family in enumerate(families):
        ax.loglog(by_base[dt, family, "exp"], by_base[dt, family, "exp2"], "o^"[i], ms=4,
                  mfc="none", color=f"C{i}", label=family)
    ax.plot([lo, 10], [lo, 10], "-", color="0.4", lw=0.8, label="equal")
    ax.plot([lo, 10], [3 * lo, 30], ":", color="0.4", lw=0.8, label="a factor 3")
    ax.plot([lo, 10], [lo / 3, 10 / 3], ":", color="0.4", lw=0.8)
    ax.set_xlim(lo, 10)
    ax.set_ylim(lo, 10)
    ax.set_xlabel("error in base e (max relative, per row)")
    ax.set_ylabel("error in base 2")
    ax.set_title(f"{dt.__name__}: base 2 against base e, row by row", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="major", alpha=0.3)
ax_h.grid(True, which="major", alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# ### The instrumented loops' rounding (chapter 9)
#
# Chapter 9's instrumented loops, the textbook pipeline and the tiled kernel, compute in float64;
# it prints their largest error against `flash_lib` as under $10^{-14}$ (45 machine epsilons).
# Every one was at most $3 \cdot 10^{-15}$ on every CPU tried (CONTRIBUTING.md); the cell measures
# this machine's, the loops without their byte counters.

# %%
rng9 = np.random.default_rng(26)
loop_err = {}
for n in (256, 512, 1000):
    q9, k9, v9 = (rng9.standard_normal((n, 64)) for _ in range(3))
    s = q9 @ k9.T / 8  # the textbook pipeline: S, P, O
    p = np.exp(s - s.max(axis=1, keepdims=True))
    textbook = (p / p.sum(axis=1, keepdims=True)) @ v9
    tiled = np.empty_like(q9)  # the tiled kernel: 128 x 128 tiles, FlashAttention-2's loop
    for q0 in range(0, n, 128):
        qi = q9[q0:q0 + 128]
        m, l, acc = np.full(len(qi), -np.inf), np.zeros(len(qi)), np.zeros((len(qi), 64))
        for k0 in range(0, n, 128):
            st = qi @ k9[k0:k0 + 128].T / 8
            m_new = np.maximum(m, st.max(axis=1))
            pt, alpha = np.exp(st - m_new[:, None]), np.exp(m - m_new)
            l, acc, m = alpha * l + pt.sum(axis=1), alpha[:, None] * acc + pt @ v9[k0:k0 + 128], m_new
        tiled[q0:q0 + 128] = acc / l[:, None]
    reference = flash_lib.flash_attention(q9, k9, v9)
    loop_err[n] = [float(rowwise_relative_error(o, reference).max()) for o in (textbook, tiled)]
print("every error below 1e-14:", max(max(e) for e in loop_err.values()) < 1e-14)  # chapter 9's
assert max(max(e) for e in loop_err.values()) < 1e-14, loop_err

# %% tags=["hide-input"]
eps64 = np.finfo(np.float64).eps
fig, ax = plt.subplots(figsize=(8, 2.6))
for i, n in enumerate(loop_err):
    for j, (name, color) in enumerate((("textbook pipeline", "C3"), ("tiled kernel", "C0"))):
        ax.barh(2 * i + j, max(loop_err[n][j] / eps64, 0.05), color=color, height=0.7,
                label=name if i == 0 else None)
ax.axvline(1e-14 / eps64, color="k", ls="--", lw=1, label="the limit asserted, 1e-14")
ax.set_yticks([2 * i + 0.5 for i in range(len(loop_err))], [f"N = {n}" for n in loop_err])
ax.set_xlabel("largest row error against flash_lib (machine epsilons; 0 drawn as 0.05)")
ax.set_title("Chapter 9's loops against flash_lib, on this machine", fontsize=10)
ax.legend(fontsize=8, loc="lower right")
fig.tight_layout()
plt.show()

# %% [markdown]
# ### A CPU's memory hierarchy, timed (chapter 9)
#
# A CPU has chapter 9's hierarchy at other sizes: caches of a few hundred KiB per core (L2) and
# tens of MiB shared (L3) in front of main memory. The cell reads their sizes (Linux's sysfs)
# and times, on one thread, a copy, a subtraction and an `exp` over an $N \times N$ float32
# array, and `naive_attention` ($d = 64$), for $N$ from 256 to 4096.

# %%
import pathlib

from threadpoolctl import threadpool_limits

import flash_bench

base = pathlib.Path("/sys/devices/system/cpu/cpu0/cache")  # Linux; elsewhere no cache lines
read = lambda entry, name: (entry / name).read_text().strip()
caches = {f"L{read(e, 'level')}": int(read(e, "size")[:-1]) * {"K": 2**10, "M": 2**20}[read(e, "size")[-1]]
          for e in (sorted(base.glob("index*")) if base.is_dir() else [])
          if read(e, "type") != "Instruction"}
best_time = lambda fn: flash_bench.best_times({"fn": fn}, seconds=0.1, min_rounds=3, max_rounds=50,
                                              settle=0)[0]["fn"]
rng_cpu = np.random.default_rng(10)
sizes_cpu = [256, 512, 1024, 2048, 2896, 4096]
ns_per = {name: [] for name in ("copy", "subtract", "exp", "naive_attention")}
with threadpool_limits(limits=1, user_api="blas"):
    for n in sizes_cpu:
        s = rng_cpu.standard_normal((n, n), dtype=np.float32)
        row, out = s.max(axis=1, keepdims=True), np.empty_like(s)
        q, k, v = (rng_cpu.standard_normal((n, 64), dtype=np.float32) for _ in range(3))
        for name, fn in {"copy": lambda: np.copyto(out, s),
                         "subtract": lambda: np.subtract(s, row, out=out),
                         "exp": lambda: np.exp(s, out=out),
                         "naive_attention": lambda: flash_lib.naive_attention(q, k, v)}.items():
            ns_per[name].append(best_time(fn) / n**2 * 1e9)

# %% tags=["nbval-ignore-output"]
print("on the machine that built this page: caches",
      ", ".join(f"{k} {v // 1024} KiB" for k, v in caches.items()))
print(f"{'N':>5} {'MiB':>6}" + "".join(f"{name:>17}" for name in ns_per))
for i, n in enumerate(sizes_cpu):
    print(f"{n:>5} {n * n * 4 / 2**20:>6.2f}" + "".join(f"{ns_per[name][i]:>17.3f}" for name in ns_per))
in_l3, beyond = sizes_cpu.index(1024), sizes_cpu.index(4096)  # 4 MiB and 64 MiB arrays
print("per element at 64 MiB / at 4 MiB:\n  ",
      ", ".join(f"{name} {ns_per[name][beyond] / ns_per[name][in_l3]:.1f}x" for name in ns_per))

# %% tags=["hide-input"]
fig, ax = plt.subplots(figsize=(8, 4.5))
mib = np.array(sizes_cpu) ** 2 * 4 / 2**20
for name, marker in zip(ns_per, "os^x"):
    ax.loglog(mib, ns_per[name], marker + "-", label=name + (" (per score)" if "att" in name else ""))
for level, size in ((lv, sz) for lv, sz in caches.items() if lv in ("L2", "L3")):
    ax.axvline(size / 2**20, color="0.5", ls=":", lw=1)
    ax.text(size / 2**20 * 1.07, 0.035, level, color="0.3")
ax.set_xlabel("size of one N × N float32 array (MiB)")
ax.set_ylabel("time per element or score (ns), one thread")
ax.set_title("One pass over N × N numbers on this CPU, best of several runs")
ax.legend(fontsize=8, loc="upper right", ncol=2)
ax.set_ylim(0.03, 100)
ax.grid(True, which="major", alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# What to look for (this build's ratios, on a shared machine): copy and subtract, which only move
# data, get several times slower per element once an array outgrows the last-level cache; `exp`,
# limited by arithmetic, less so; the textbook kernel's time per score, dominated by `exp` and each
# NumPy call's fixed cost, grows less than the copy's.

# %% [markdown]
# ### Which exponential, on which loops: a tile's floor (chapter 10)
#
# Chapter 10 times one tile's floor, NumPy call by NumPy call. Which loop NumPy runs for `exp` and
# `exp2` depends on the CPU, and so does which one flash_lib calls (`flash_lib.exponential`:
# `exp2` where faster). NumPy reads `NPY_DISABLE_CPU_FEATURES` once, at import, so the cell
# measures the floor again in a child process with NumPy's AVX-512 loops off, as on an AVX2 CPU
# (`flash_bench.floor_at_level`; loops already off here stay off there), whose flash_lib picks its
# exponential for them.
#
# On the AMD EPYC (Zen 4, AVX-512, 2 cores) chapter 10 was written on, one float64 tile's floor
# measured 1.83 ms with NumPy's AVX-512 loops, the exponential 0.20 ms of it (11%). float32's
# `exp` took 0.125 ms and its `exp2` 0.058 (Intel's SVML, which NumPy builds in for AVX-512
# only), so there the kernel computes float32 in base 2, a forward 5% faster
# (`bench/RESULTS.md`). With the AVX-512 loops off
# (`NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR"`), float32's `exp2` is scalar (0.57
# ms) and the kernel keeps `exp`, still vectorised (0.28 ms of 1.15); float64's `exp` is scalar:
# 1.1 ms of a 2.8 ms tile (38 to 41% in four runs), more than either matmul, so float64
# attention on an AVX2 CPU is bound by `exp`.

# %%
here = flash_bench.floor_here(("float32", "float64"), seconds=0.4)
avx2 = flash_bench.floor_at_level("AVX2", ("float32", "float64"), seconds=0.4)  # None off x86-64
floor_bars = []
for where, run in (("NumPy as installed", here), ("AVX-512 loops off", avx2)):
    for name, ops in (run["forward"].items() if run is not None else ()):
        exp_name = run["exponential"][name]
        loop = flash_bench.loop_name(run["loops"]["loops"][exp_name][name]).split(" (")[0]
        floor_bars.append((f"{name}, np.{exp_name}\n{where}: {loop}", exp_name, ops))

# %% tags=["nbval-ignore-output"]
print(flash_bench.describe(here["loops"]))
for label, exp_name, ops in floor_bars:
    total = sum(ops.values())
    print(f"{label.replace(chr(10), ', ')}: {1e6 * total:.0f} µs, {exp_name} {100 * ops[exp_name] / total:.0f}%")

# %% tags=["hide-input"]
other = lambda op: op not in flash_bench.MATMULS and op not in flash_bench.EXPONENTIALS
groups = [("matmuls q·kᵀ, P·v", "C0", flash_bench.MATMULS.__contains__),
          ("exp or exp2", "C3", flash_bench.EXPONENTIALS.__contains__),
          ("max, subtract, sum, rescale, row state", "C7", other)]
fig, ax = plt.subplots(figsize=(8, 1 + 0.7 * len(floor_bars)))
for i, (label, exp_name, ops) in enumerate(floor_bars):
    left, total = 0.0, sum(ops.values())
    for group, color, member in groups:
        width = 1e6 * sum(s for op, s in ops.items() if member(op))
        ax.barh(i, width, left=left, color=color, label=group if i == 0 else None)
        if group == "exp or exp2":
            ax.text(left + width / 2, i, f"{100 * width / (1e6 * total):.0f}%", ha="center",
                    va="center", color="w", fontsize=8)
        left += width
    ax.text(left, i, f" {left:.0f} µs", va="center", fontsize=8)
ax.set_yticks(range(len(floor_bars)), [label for label, _, _ in floor_bars], fontsize=8)
ax.invert_yaxis()
ax.set_xlim(0, 1.6e6 * max(sum(ops.values()) for *_, ops in floor_bars))  # room: legend
ax.set_xlabel(f"µs per {flash_lib.DEFAULT_BLOCK_Q} × {flash_lib.DEFAULT_BLOCK_K} tile, one thread")
ax.set_title(f"A tile's floor, op by op, on {flash_bench.cpu_name()}", fontsize=10)
ax.legend(fontsize=8, loc="upper right")
fig.tight_layout()
plt.show()

# %% [markdown]
# ### bfloat16 in NumPy (chapter 11)
#
# bfloat16 comes from the `ml_dtypes` package, which registers it as a NumPy dtype; NumPy's own
# machinery treats it unevenly, hence `flash_lib` widens 16-bit inputs to float32 tile by tile.
# Chapter 11 uses `ml_dtypes.finfo`: `np.finfo` knows bfloat16 only since ml_dtypes 0.7, which
# writes its entries into NumPy's private `np.finfo._finfo_cache` on import (`ml_dtypes/_finfo.py`);
# with 0.5 and 0.6 it raises `ValueError`. With the installed versions:
#
# - `np.matmul` (`@`) of two bfloat16 arrays returns **float32**; `np.dot` returns **bfloat16**,
#   through a plain loop (timed below); `np.einsum` rejects bfloat16 with a `TypeError`;
# - elementwise functions (`np.exp`) and reductions stay in bfloat16, and a reduction
#   **accumulates** in bfloat16 unless given `dtype=np.float32`: the sum of 1000 ones is 256,
#   because $256 + 1$ rounds back to 256 with 8 significant bits.
#
# One version difference touches every bfloat16 input chapter 11 makes: rounding float64 to
# bfloat16 via float32 rounds twice, and twice is not once. A float64 just above the midpoint of
# two bfloat16 neighbours can land, in float32, exactly on that midpoint, and the tie goes to the
# even neighbour, the farther one. $1 + 2^{-8} + 2^{-40}$ lies between 1 and
# $1 + 2^{-7}$, nearer the second; float32 drops the $2^{-40}$. ml_dtypes 0.6 converted through
# float32; 0.7 rounds once (its pull request #401).

# %%
import ml_dtypes

bfloat16 = ml_dtypes.bfloat16
np_agrees = all(getattr(np.finfo(bfloat16), f) == getattr(ml_dtypes.finfo(bfloat16), f)
                for f in ("eps", "max", "tiny", "nmant", "maxexp"))
rng11 = np.random.default_rng(11)
a, b = (rng11.standard_normal((256, 256)).astype(bfloat16) for _ in range(2))
matmul_dtype, dot_dtype = (a @ b).dtype, np.dot(a, b).dtype
try:
    np.einsum("ij,jk->ik", a, b)
    einsum_error = None
except TypeError:  # the message's wording is NumPy's and may change between releases
    einsum_error = "raises TypeError"
ones = np.ones(1000, dtype=bfloat16)
sum_bf16, sum_f32 = ones.sum(), ones.sum(dtype=np.float32)
matmul_vs_dot = np.abs((a @ b) - np.dot(a, b).astype(np.float32)).max() / np.abs(a @ b).max()
u_bf16 = float(ml_dtypes.finfo(bfloat16).eps) / 2
x64 = np.random.default_rng(1).standard_normal(1_000_000)
once, twice = x64.astype(bfloat16), x64.astype(np.float32).astype(bfloat16)
differ = once != twice
err_once = np.abs(once.astype(np.float64) - x64)[differ]
err_twice = np.abs(twice.astype(np.float64) - x64)[differ]
midpoint_plus = np.float64(1 + 2**-8 + 2**-40)
print(f"np.finfo(bfloat16) agrees with ml_dtypes.finfo on eps, max, tiny, nmant, maxexp: {np_agrees}\n"
      f"a @ b: {matmul_dtype} | np.dot(a, b): {dot_dtype} | np.einsum: {einsum_error}\n"
      f"np.exp(a).dtype: {np.exp(a).dtype} | a.max().dtype: {a.max().dtype}")
print(f"1000 ones summed in bfloat16: {float(sum_bf16):g} ({sum_bf16.dtype}); "
      f"with dtype=np.float32: {float(sum_f32):g}")
print(f"a @ b vs np.dot(a, b), relative to the largest entry: within bfloat16's u = {u_bf16:.2e}: "
      f"{matmul_vs_dot <= 1.01 * u_bf16}")
print(f"float64 -> bfloat16 directly vs by way of float32: {differ.sum()} of {x64.size:,} "
      f"differ; the direct one is the nearer in all of them: {bool((err_once < err_twice).all())}")
print(f"1 + 2^-8 + 2^-40 -> {float(midpoint_plus.astype(bfloat16))} directly, "
      f"{float(midpoint_plus.astype(np.float32).astype(bfloat16))} by way of float32")
assert np_agrees and matmul_dtype == np.float32 and dot_dtype == bfloat16 and einsum_error
assert float(sum_bf16) == 256 and float(sum_f32) == 1000 and sum_bf16.dtype == bfloat16
assert np.exp(a).dtype == bfloat16 and matmul_vs_dot <= 1.01 * u_bf16, matmul_vs_dot
assert differ.sum() > 0 and (err_once < err_twice).all()
assert float(midpoint_plus.astype(bfloat16)) == 1 + 2**-7  # the nearer neighbour, once
assert float(midpoint_plus.astype(np.float32).astype(bfloat16)) == 1.0  # the tie, twice


# %% tags=["nbval-ignore-output"]
best = flash_bench.best_times({"matmul": lambda: a @ b, "dot": lambda: np.dot(a, b)},
                              seconds=0.1, min_rounds=3, max_rounds=20, settle=0)[0]
t_matmul, t_dot = best["matmul"], best["dot"]
print(f"on the machine that built this page, 256 x 256 bfloat16: np.dot takes "
      f"{t_dot / t_matmul:.0f}x\nas long as np.matmul; their results differ by {matmul_vs_dot:.1e} "
      f"of the largest entry")

# %% [markdown]
# ## From the later chapters

# %% [markdown]
# ### Rounding against the limits: the backward and the variants (chapters 12, 14 and 15)
#
# Chapters 12, 14 and 15 compare `flash_lib`'s kernels with `naive_attention` (and its backward) and
# print each difference as the limit it is under, $10^{-14}$ (45 machine epsilons). Below, the
# differences themselves on the machine that built this page, for the forward and three gradients of
# each variant (random inputs, two batches of four heads, 64 tokens, 16 × 16 tiles). Every one was
# at most $10^{-15}$ at every `NPY_DISABLE_CPU_FEATURES` level (CONTRIBUTING.md), a margin of 10.

# %%
import matplotlib.pyplot as plt
import numpy as np

from flash_bench import relative_difference
from flash_lib import (flash_attention, flash_attention_backward, naive_attention,
                       naive_attention_backward, rowwise_relative_error)

ROUNDING = 1e-14  # the limit chapters 12, 14 and 15 assert
rng = np.random.default_rng(26)
q, k, v, dout = (rng.standard_normal((2, 4, 64, 16)) for _ in range(4))
doc = np.repeat([0, 1, 2, 3], [10, 23, 6, 25])  # chapter 15's four packed documents
variants = {
    "no mask": {},
    "causal": dict(causal=True),
    "sliding window (12, 0)": dict(window=(12, 0)),
    "softcap 5, causal": dict(softcap=5.0, causal=True),
    "ALiBi, causal": dict(alibi_slopes=2.0 ** -np.arange(1, 5), causal=True),
    "GQA 4 / 2, causal": dict(enable_gqa=True, causal=True),
    "document mask_mod, causal": dict(mask_mod=lambda qi, ki: doc[qi] == doc[ki], causal=True),
}
measured = {}
for name, kw in variants.items():
    kk, vv = (k[:, :2], v[:, :2]) if kw.get("enable_gqa") else (k, v)
    out, lse = flash_attention(q, kk, vv, block_q=16, block_k=16, return_lse=True, **kw)
    measured[f"{name}: out"] = float(rowwise_relative_error(out, naive_attention(q, kk, vv, **kw)).max())
    grads = flash_attention_backward(q, kk, vv, out, lse, dout, block_q=16, block_k=16, **kw)
    for g_name, g, r in zip(("dq", "dk", "dv"), grads,
                            naive_attention_backward(q, kk, vv, dout, **kw)):
        measured[f"{name}: {g_name}"] = relative_difference(g, r)
print(f"{len(measured)} differences, every one below the chapters' limit of {ROUNDING:.0e}:",
      max(measured.values()) < ROUNDING)
assert max(measured.values()) < ROUNDING, max(measured.values())

# %% tags=["hide-input"]
eps64 = np.finfo(np.float64).eps
fig, ax = plt.subplots(figsize=(8, 7))
rows = np.arange(len(measured))[::-1]
values = np.array(list(measured.values())) / eps64
ax.plot(np.maximum(values, 0.05), rows, "o", color="C0", label="flash vs naive, this machine")
ax.axvline(ROUNDING / eps64, color="C3", ls="--", label=f"the limit asserted, {ROUNDING:.0e}")
ax.set_xscale("log")
ax.set_xlim(0.03, 100)
ax.set_yticks(rows, list(measured), fontsize=7)
ax.set_xlabel("largest relative difference (machine epsilons, 2.2e-16; exact 0 drawn at 0.05)")
ax.set_title("flash_lib against naive, forward and gradients, every variant of chapters 12-15")
ax.legend(fontsize=8, loc="lower right")
ax.grid(True, axis="x", which="major", alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# ### The Dask cluster's settings and its speed (chapter 22)
#
# **The workers' environment.** Chapter 22's cluster sets `FLASH_LIB_THREADS=1` in every worker
# before it starts (one worker, one core) and removes `MALLOC_TRIM_THRESHOLD_`, which Dask's nanny
# sets to 65536 for every worker. A fixed threshold turns off glibc's adaptive mmap threshold
# (mallopt(3)), so every large NumPy temporary is mapped afresh: `flash_attention` on a 1024-row
# shard took 20.5 ms in a worker against 15.7 ms without the variable, about 30% slower
# (`bench/RESULTS.md`, 2026-12-01). It also lowers the workers' logging to critical, keeping off the
# page the survivor's ERROR report of a broken connection when chapter 22 kills a worker. The cell
# reads the variable in a worker started with Dask's default and in one with the setting.

# %%
import logging
import os

import dask
from distributed import Client, LocalCluster

logging.getLogger("distributed").setLevel(logging.ERROR)  # the scheduler runs here (as chapter 22)
seen, before = {}, os.environ.get("MALLOC_TRIM_THRESHOLD_")
# chapter 22's setting first: a nanny started with Dask's default sets the variable in this
# process's environment too, where every later worker would inherit it (undone below)
for name, setting in (("chapter 22's setting",
                       {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}),
                      ("Dask's default", {})):
    with dask.config.set(setting), LocalCluster(n_workers=1, threads_per_worker=1,
                                                processes=True, host="127.0.0.1",
                                                dashboard_address=None,
                                                silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        seen[name] = list(client.run(
            lambda: __import__("os").environ.get("MALLOC_TRIM_THRESHOLD_")).values())[0]
if before is None:
    os.environ.pop("MALLOC_TRIM_THRESHOLD_", None)
print("MALLOC_TRIM_THRESHOLD_ in a worker:", seen)
assert seen == {"chapter 22's setting": None, "Dask's default": "65536"}, seen

# %% [markdown]
# **Time: one process against two.** A worker process is one core here; `flash_attention` in one
# process uses `flash_lib`'s thread pool (one thread per core, up to 4). On a 2-core machine the
# cluster can at best match the one-process kernel: what it buys is reach (more machines, more
# memory). `make bench-dask` (`bench/bench_dask.py`), at $N = 65536$ in shards of 4096 on a 2-core
# machine, measured 2 workers 1.72 to 1.89 times as fast as one with chapter 22's chains, 171 to 185
# MiB moving between them; with each query shard's partial results meeting in a merge tree instead,
# 1.64 to 1.79 times, with 275 to 354 MiB moved, mostly partial outputs travelling to their merge.
# Dask's housekeeping held the chains below 2: the workers' profiler, system monitor and every
# server's event-loop tick took 3.3 to 3.7 s of CPU in a 20 s run, from the workers' two cores. With
# it slowed down (`flash_dask.QUIET_CLUSTER`, the benchmark's setting), 2 workers ran 1.80 to 1.90
# times as fast as one (`bench/RESULTS.md`, 2026-12-02). The cell times chapter 22's causal
# computation here.

# %% tags=["nbval-ignore-output"]
import logging
import time

import dask
import dask.array as da
import numpy as np
from distributed import Client, LocalCluster

import flash_dask
import flash_lib

logging.getLogger("distributed").setLevel(logging.ERROR)  # the scheduler runs here (as chapter 22)
settings = {"distributed.nanny.pre-spawn-environ.FLASH_LIB_THREADS": "1",
            "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
            "distributed.nanny.pre-spawn-environ.DASK_LOGGING__DISTRIBUTED": "critical",
            **flash_dask.QUIET_CLUSTER}
q, k, v = (da.random.default_rng(2014).standard_normal((8192, 64), chunks=(1024, 64))
           for _ in range(3))
with dask.config.set(settings), LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                             host="127.0.0.1", dashboard_address=None,
                                             silence_logs=logging.ERROR) as cluster, \
        Client(cluster) as client:
    out = flash_dask.dask_attention(q, k, v, causal=True)
    client.compute(out, sync=True)  # the first run starts the workers' imports
    start = time.perf_counter()
    client.compute(out, sync=True)
    t_cluster = time.perf_counter() - start
    q1, k1, v1 = client.compute([q, k, v], sync=True)
start = time.perf_counter()
flash_lib.flash_attention(q1, k1, v1, causal=True)
t_process = time.perf_counter() - start
print(f"causal, N = 8192: 2 workers {t_cluster:.2f} s; flash_attention in one process "
      f"({flash_lib.thread_count()} threads) {t_process:.2f} s")

# %% [markdown]
# ### FACTOR and the floor on each CPU configuration (chapter 23)
#
# Chapter 23 asserts its bound, `FACTOR` (2, FlashAttention's) times `naive_attention`'s
# same-dtype error plus a floor of 8 eps (float64, float32) or 1 eps (float16), on every case run
# of its four correct kernels. Over NumPy's AVX-512, AVX2 and baseline loops
# (`NPY_DISABLE_CPU_FEATURES`, CONTRIBUTING.md) and OpenBLAS's SkylakeX and Haswell kernels
# (`OPENBLAS_CORETYPE`), the largest ratio of a kernel's error to naive's, where naive's is above 4
# eps, was 1.2 to 1.4, and the floor needed at most 5.3 eps (float64; 3.8 in float32), from
# flash_lib's 7 × 1 tiles' thousand rescales in a row. With OpenBLAS's older Sandybridge kernel (no
# fused multiply-add) the ratio reached 2.0 (float64) and 2.3 (float32), and the floor carried the
# difference (47 eps against 2 × 20.7 + 8): the bound is neither alone but their sum. In float16
# every kernel's error is, nearly everywhere, the final rounding to float16 (half an ulp), the same
# for naive, so one eps of floor suffices; where it is more (`float16_overflow`, up to 19 eps with
# the Haswell kernel), naive's error is just as large.

# %% [markdown]
# ### The CPU flash op's float16 lse and its vector lanes (chapter 23)
#
# PyTorch's private `_scaled_dot_product_flash_attention_for_cpu` passes every output case of
# chapter 23, but in float16, where PyTorch 2.13 computes in float32 and stores the weights in
# float16, its lse can be about $5 \cdot 10^{-5}$ off (relative), where naive's, computed in
# float32, is within $10^{-7}$. Which cases fail depends on the CPU. With `ATEN_CPU_CAPABILITY`
# choosing PyTorch's code path, the error traces to the vector loop that computes the weights
# $e^{s - m}$ to within about $10^{-4}$, in 8 lanes with AVX2 and 16 with AVX-512; keys past a
# 512-key block's last full vector are done singly, exactly, and the scalar build (`default`) passes
# every case. So `late_max`, whose weight sits on its last 8 keys (of 1100: 76 in the last block),
# fails with AVX2, whose exact tail is the last 4 keys, and passes with AVX-512, whose tail is the
# last 12; cases whose weight is spread over many keys fail on both.

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
# # 1. Softmax and its overflow
#
# Attention turns each row of scores into weights with a softmax, and the textbook formula for it
# fails on ordinary inputs. In this chapter we find where $e^x$ overflows (about 709 in float64,
# 88 in float32), watch the textbook softmax return NaN past that point and when every score is
# very negative, derive why subtracting the row maximum changes nothing and removes both failures,
# and measure both versions against a higher-precision truth for largest scores from $10^{-1}$ to
# $10^4$.

# %%
import numpy as np
import matplotlib.pyplot as plt

import flash_lib

rng = np.random.default_rng(1)

# %% [markdown]
# ## The textbook softmax
#
# For a row of scores $x_1, \dots, x_n$,
#
# $$\mathrm{softmax}(x)_i = \frac{e^{x_i}}{\sum_{j=1}^{n} e^{x_j}} .$$
#
# Every weight lies in $(0, 1]$ and they sum to 1. Written straight into NumPy:

# %%
def softmax_unsafe(x):
    """The formula as written: exp, then divide by the sum."""
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


x_small = np.array([2.0, 1.0, 0.0])
p_small = softmax_unsafe(x_small)
print("softmax([2, 1, 0]) =", np.array2string(p_small, precision=4, floatmode="fixed"))
# to 4 decimals: the last bits of the sum depend on the CPU's exp and division loops
print(f"sum = {p_small.sum():.4f}")

# %% [markdown]
# ## Where $e^x$ overflows
#
# A floating-point format has a largest finite number, `np.finfo(dtype).max`, so $e^x$ is finite
# exactly when $x \le \log(\text{max})$; beyond that, `np.exp` returns `inf`. The threshold for
# each format (float16's is why kernels, `flash_lib` among them, keep its scores in float32):

# %%
thresholds = {dt: float(np.log(np.finfo(dt).max)) for dt in (np.float64, np.float32, np.float16)}
for dt, t in thresholds.items():
    below = np.exp(dt(t - 0.5))
    with np.errstate(over="ignore"):
        above = np.exp(dt(t + 0.5))
    print(f"{dt.__name__:<7}: exp(x) overflows for x > {t:.2f}; "
          f"exp({t - 0.5:.2f}) = {float(below):.3g}, exp({t + 0.5:.2f}) = {above}")

t64, t32 = thresholds[np.float64], thresholds[np.float32]
# the underflow end: e^x rounds to 0 once it is below half the smallest subnormal, 2^-1075
underflow64 = -1075 * np.log(2.0)
tiny = np.finfo(np.float64).smallest_subnormal
print(f"float64: exp(x) underflows to 0 for x below -1075 log 2 = {underflow64:.2f}: "
      f"exp({underflow64 + 0.1:.2f}) = {np.exp(underflow64 + 0.1):.3g} (the smallest subnormal), "
      f"exp({underflow64 - 0.1:.2f}) = {np.exp(underflow64 - 0.1)}")

# %% [markdown]
# Nothing bounds an attention score: with $d = 64$, query and key entries of size 4 already give
# 128. One score above the threshold and the textbook formula computes $\infty / \infty$ = NaN.
# The other extreme fails too: below $-1075 \log 2 \approx -745.13$, $e^x$ is under half the
# smallest positive float64, $2^{-1074}$, and rounds to 0 (printed above); if every score is that
# low, the formula computes $0/0$ = NaN. (`np.errstate` silences NumPy's warnings: we look at the
# results on purpose.)

# %%
x_big = np.array([1000.0, 999.0, 998.0])
x_very_negative = np.array([-1000.0, -1001.0, -1002.0])
with np.errstate(over="ignore", invalid="ignore"):
    e_big = np.exp(x_big)
    p_big_unsafe = softmax_unsafe(x_big)
    p_neg_unsafe = softmax_unsafe(x_very_negative)
print("exp([1000, 999, 998])                 =", e_big)
print("unsafe softmax([1000, 999, 998])      =", p_big_unsafe)
print("exp([-1000, -1001, -1002])            =", np.exp(x_very_negative))
print("unsafe softmax([-1000, -1001, -1002]) =", p_neg_unsafe)

# %% [markdown]
# ## Subtracting the maximum changes nothing, and fixes both
#
# Take any constant $c$ and multiply the numerator and the denominator by $e^{-c}$:
#
# $$\frac{e^{x_i - c}}{\sum_j e^{x_j - c}} = \frac{e^{-c}\, e^{x_i}}{e^{-c} \sum_j e^{x_j}} = \frac{e^{x_i}}{\sum_j e^{x_j}} ,$$
#
# so $\mathrm{softmax}(x - c) = \mathrm{softmax}(x)$ for every $c$: softmax only sees differences
# between scores. Now choose $c = m = \max_j x_j$. Then
#
# - every exponent $x_j - m \le 0$, so every $e^{x_j - m} \in (0, 1]$: nothing overflows;
# - the largest score contributes $e^{0} = 1$, so the denominator
#   $l = \sum_j e^{x_j - m}$ lies in $[1, n]$: it can neither overflow nor be 0.
#
# These $m$ and $l$ are the two numbers every later chapter carries around.

# %%
def softmax_safe(x):
    """Softmax with the row maximum m subtracted first: exponents <= 0, denominator l >= 1."""
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - m)
    # l = sum_j exp(x_j - m), in [1, n]
    l = e.sum(axis=-1, keepdims=True)
    return e / l


p_big_safe = softmax_safe(x_big)
print("safe softmax([1000, 999, 998]) =", np.array2string(p_big_safe, precision=4, floatmode="fixed"))
# x - m is [0, -1, -2] for both rows, computed exactly, so the results are identical bit for bit.
print("identical to safe softmax([2, 1, 0]):", np.array_equal(p_big_safe, softmax_safe(x_small)))
print("safe softmax([-1000, -1001, -1002]) =",
      np.array2string(softmax_safe(x_very_negative), precision=4, floatmode="fixed"))

# %% [markdown]
# Where the textbook formula does not overflow, the two agree to rounding; on random rows with
# scores up to $\pm 100$:

# %%
x_moderate = rng.uniform(-100, 100, size=(1000, 64))
diff = np.abs(softmax_safe(x_moderate) - softmax_unsafe(x_moderate)).max()
eps64 = np.finfo(np.float64).eps
# Each version is within 4 eps of the truth (the sweep below) and every weight is at most 1, so
# the two differ by at most 8 eps.
print(f"max |safe - unsafe| on rows in [-100, 100] within 8 eps = {8 * eps64:.1e}: "
      f"{diff <= 8 * eps64}")

# %% [markdown]
# ## Error against the largest score
#
# Scores are logits: a difference of 1 is a factor $e$ between two weights, so scores are
# measured in **nats** ($\log$ is always the natural log). We take one row of $n = 256$ scores
# spread at random over $[0, m]$, the largest exactly $m$, for $m$ from $10^{-1}$ to $10^4$ nats,
# in float64 and float32, and compute the normwise relative error
#
# $$\mathrm{err}(p) = \frac{\max_i |p_i - p^\ast_i|}{\max_i p^\ast_i}$$
#
# against a truth $p^\ast$ in higher precision, from `flash_lib.precise_attention` through a
# device later chapters reuse: **softmax of a row $x$ is attention with identity values.** With
# one query $1$, keys $x_j$ (feature size 1) and scale 1 the scores are exactly $x$; with the
# identity matrix as values, output entry $i$ is $\sum_j p_j \delta_{ji} = p_i$. (For float32
# the truth starts from the float32-rounded scores, so only the softmax's rounding is measured.)
#
# An entry is **wrong** if it is not finite or off by more than 4 machine epsilons relative to the
# row's largest weight; a format's **machine epsilon**, `np.finfo(dtype).eps`, is the gap between
# 1 and the next number: $2.2 \times 10^{-16}$ in float64, $1.2 \times 10^{-7}$ in float32. A
# wrong entry can be finite: once $\sum_j e^{x_j} = \infty$, every finite $e^{x_i}/\infty$ is 0.
# The second measure is the share of the true weight on wrong entries, 0 for a correct row.
#
# Where does the textbook version fail? Its denominator is $\sum_j e^{x_j} = e^{\mathrm{lse}}$
# with the row's **log-sum-exp** $\mathrm{lse} = \log \sum_j e^{x_j} = m + \log l$, so it
# overflows once $\mathrm{lse} > \log(\text{max})$: since $1 \le l \le n$, up to $\log n$ nats
# *before* $m$ does. The cell finds that $m$ by bisection and adds points 0.05 nats either side of
# it and of $\log(\text{max})$ to the sweep.

# %%
n = 256
frac = rng.uniform(size=n)
frac = (frac - frac.min()) / (frac.max() - frac.min())  # spread over [0, 1], min 0, max exactly 1


def top_where_lse_reaches(t):
    """The largest score m at which this row's lse = m + log sum_j exp((frac_j - 1) m) equals t."""
    lo, hi = t - np.log(n), t  # lse lies in [m, m + log n]
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid + np.log(np.exp((frac - 1) * mid).sum()) < t else (lo, mid)
    return lo


sum_overflows_at = {dt: top_where_lse_reaches(thresholds[dt]) for dt in (np.float64, np.float32)}
near = [c + dx for dt in sum_overflows_at for c in (sum_overflows_at[dt], thresholds[dt])
        for dx in (-0.05, 0.05)]
tops = np.sort(np.concatenate([np.logspace(-1, 4, 51), near]))

results = {}
for dt in (np.float64, np.float32):
    eps = np.finfo(dt).eps
    x = (tops[:, None] * frac).astype(dt)  # one row per largest score m
    one_query = np.ones((len(tops), 1, 1), dtype=dt)
    truth, lse = flash_lib.precise_attention(one_query, x[..., None], np.eye(n, dtype=dt),
                                             scale=1.0, return_lse=True)
    truth, lse = truth[:, 0, :], lse[:, 0].astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        p_unsafe = softmax_unsafe(x)
    p_safe = softmax_safe(x)

    def err(p):
        # a row holding NaN has error NaN: the left panel leaves it out
        return (np.abs(p - truth).max(axis=-1) / truth.max(axis=-1)).astype(np.float64)

    def wrong_weight(p):
        with np.errstate(invalid="ignore"):
            wrong = ~np.isfinite(p) | (np.abs(p - truth) > 4 * eps * truth.max(axis=-1, keepdims=True))
        return ((truth * wrong).sum(axis=-1) / truth.sum(axis=-1)).astype(np.float64)

    results[dt] = dict(
        err_unsafe=err(p_unsafe),
        err_safe=err(p_safe),
        wrong_unsafe=wrong_weight(p_unsafe),
        wrong_safe=wrong_weight(p_safe),
        lse=lse,
        nan_unsafe=np.isnan(p_unsafe).any(axis=-1),
        all_zero_unsafe=(p_unsafe == 0).all(axis=-1),
        zeros_unsafe=(p_unsafe == 0).mean(axis=-1),
        nonfinite_safe=(~np.isfinite(p_safe)).any(axis=-1),
    )

for dt, r in results.items():
    t, eps = thresholds[dt], np.finfo(dt).eps
    fits, overflows = r["lse"] < t, r["lse"] > t
    between = overflows & (tops < t)
    print(f"{dt.__name__}: exp overflows above {t:.2f}; the row's lse reaches it at m = "
          f"{sum_overflows_at[dt]:.2f}")
    print(f"  unsafe, lse < {t:.2f} (m up to {tops[fits].max():.2f}): error within "
          f"4 eps: {r['err_unsafe'][fits].max() <= 4 * eps}, "
          f"wrong weight {r['wrong_unsafe'][fits].max():.0f}")
    print(f"  unsafe, lse > {t:.2f} (m from {tops[overflows].min():.2f}): wrong weight "
          f"at least {r['wrong_unsafe'][overflows].min():.4f}")
    print(f"  unsafe, m from {tops[between].min():.2f} to {tops[between].max():.2f} (only the sum "
          f"overflows): NaN in {r['nan_unsafe'][between].sum()} of {between.sum()} rows,")
    print(f"     every entry exactly 0 in {r['all_zero_unsafe'][between].sum()}")
    print(f"  unsafe, m above {t:.2f}: NaN in {r['nan_unsafe'][tops > t].sum()} of "
          f"{(tops > t).sum()} rows")
    print(f"  safe, every m: error within 4 eps: {r['err_safe'].max() <= 4 * eps}, "
          f"wrong weight {r['wrong_safe'].max():.0f}")

# %% [markdown]
# Within 0.1 nats the textbook row goes from correct to entirely wrong: first a row of exact
# zeros with no NaN to flag it ($e^{x_i}/\infty = 0$), then, once $m$ itself passes
# $\log(\text{max})$, NaN ($\infty/\infty$). In the figure (top: the error; bottom: the share
# of the true weight on wrong entries) the shaded bands are where the unsafe output holds NaN,
# right of each format's $\log(\text{max})$ (dotted); the row goes wrong 0.4 (float64) and 1.6
# (float32) nats left of that line. The safe softmax stays within a few machine epsilons (grey
# lines) at every $m$. What fails is the scores' offset, not their spread: the same rows shifted
# to $[-m, 0]$ are what the safe version exponentiates.

# %% tags=["hide-input"]
fig, (ax_err, ax_wrong) = plt.subplots(2, 1, figsize=(8.5, 8), sharex=True)
for i, (dt, r) in enumerate(results.items()):
    name, eps = dt.__name__, np.finfo(dt).eps
    safe_color, unsafe_color = f"C{2 * i}", f"C{2 * i + 1}"
    fits = r["lse"] < thresholds[dt]
    # the measured errors, in the legend: the compared output above shows only the bound
    ax_err.loglog(tops, r["err_safe"], "-", color=safe_color,
                  label=f"safe, {name} (at most {r['err_safe'].max() / eps:.1f} eps)")
    ax_err.loglog(tops, r["err_unsafe"], "--", color=unsafe_color,
                  label=f"unsafe, {name} "
                        f"({r['err_unsafe'][fits].max() / eps:.1f} eps while lse fits)")
    ax_err.axhline(eps, color="grey", ls=":", lw=1)
    ax_err.text(0.12, eps * 1.8, f"machine epsilon of {name}: {eps:.1e}", fontsize=8, color="0.3")
    ax_wrong.semilogx(tops, r["wrong_safe"], "-", color=safe_color, lw=2.5 - i,
                      label=f"safe, {name}")
    ax_wrong.semilogx(tops, r["wrong_unsafe"], "--", color=unsafe_color, label=f"unsafe, {name}")
    nan_from = tops[r["nan_unsafe"]].min()
    for ax in (ax_err, ax_wrong):
        ax.axvspan(nan_from, tops[-1], color=unsafe_color, alpha=0.08, lw=0)
        ax.axvline(thresholds[dt], color=unsafe_color, ls=":", lw=1.5)
    ax_wrong.text(thresholds[dt] * 1.1, 0.55 - 0.12 * i,
                  f"log(max {name})\n= {thresholds[dt]:.1f}", fontsize=8, color=unsafe_color)
ax_err.text(1.2e3, 1e-10, "unsafe output\nholds NaN\n(shaded)", fontsize=8, color="0.3")
ax_err.text(0.12, 1.5, "error 1: a row of zeros", fontsize=8, color="0.3")
ax_err.text(0.12, 3e-19, "rows in [-100, 100] (above): max |safe - unsafe| = "
            f"{diff / eps64:.1f} eps of float64", fontsize=8, color="0.3")
ax_err.set_ylim(1e-19, 10)
ax_err.set_xlim(tops[0], tops[-1])
ax_err.set_title("Error against a higher-precision truth")
ax_err.set_ylabel("normwise relative error (dimensionless)")
ax_err.legend(loc="center left", bbox_to_anchor=(0, 0.4), fontsize=8)
ax_wrong.set_ylim(-0.03, 1.03)
ax_wrong.set_xlim(tops[0], tops[-1])
ax_wrong.set_title("Share of the row's true weight on wrong entries")
ax_wrong.set_xlabel("largest score of the row, m (nats); its scores lie in [0, m]")
ax_wrong.set_ylabel("share of the true weight (dimensionless)")
ax_wrong.legend(loc="upper left", fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What we showed
#
# - $e^x$ overflows for $x > \log(\text{max})$: 709.78 in float64, 88.72 in float32, 11.09 in
#   float16. The textbook softmax returns NaN past it, and for rows entirely below
#   $-1075 \log 2 \approx -745.13$ (float64), where every $e^{x_j}$ is 0.
# - $\mathrm{softmax}(x - c) = \mathrm{softmax}(x)$; with $c = \max_j x_j$ every exponent is
#   $\le 0$ and $l \in [1, n]$. The safe softmax of $[1000, 999, 998]$ equals that of $[2, 1, 0]$
#   bit for bit, and agrees with the textbook one within 8 machine epsilons where that one fits.
# - The textbook version fails once $\mathrm{lse} = \log\sum_j e^{x_j}$ passes
#   $\log(\text{max})$, up to $\log n$ nats before the largest score does: within 4 machine
#   epsilons below, more than 99.99% of the weight wrong above (exact zeros, then NaN). The safe
#   version is within 4 machine epsilons at every $m$.

# %%
# exp overflows just above log(max) and not just below, in each format
assert 709 < t64 < 710 and 88 < t32 < 89 and 11 < thresholds[np.float16] < 12
for dt, t in thresholds.items():
    assert np.isfinite(np.exp(dt(t - 0.5)))
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(dt(t + 0.5)))
# the textbook formula fails at both ends
assert np.isnan(p_big_unsafe).all() and np.isnan(p_neg_unsafe).all()
assert (np.exp(x_very_negative) == 0).all()
# -1075 log 2 is the underflow point: 0.1 nats above it exp gives the smallest subnormal (e^0.1
# times 2^-1075 rounds up to 2^-1074), 0.1 nats below it 0 (e^-0.1 times 2^-1075 rounds down)
assert np.exp(underflow64 + 0.1) == tiny and np.exp(underflow64 - 0.1) == 0
# the safe formula: exact shift, bounded exponents and denominator
assert np.array_equal(p_big_safe, softmax_safe(x_small))
assert np.isclose(p_big_safe.sum(), 1.0, rtol=0, atol=1e-15)
assert np.isfinite(softmax_safe(x_very_negative)).all()
assert np.array_equal(softmax_safe(x_very_negative), softmax_safe(x_small))
l_moderate = np.exp(x_moderate - x_moderate.max(axis=-1, keepdims=True)).sum(axis=-1)
assert ((1 <= l_moderate) & (l_moderate <= x_moderate.shape[-1])).all()
assert diff <= 8 * eps64  # derived above from the 4 eps bound
# the sweep: a cliff for the unsafe version exactly where the lse passes log(max), none for the
# safe one
for dt, r in results.items():
    t, eps = thresholds[dt], np.finfo(dt).eps
    fits, overflows = r["lse"] < t, r["lse"] > t
    assert not np.any(np.abs(r["lse"] - t) < 0.01)  # every row is clearly on one side
    assert 0 < t - sum_overflows_at[dt] < np.log(n)
    assert round(t - sum_overflows_at[dt], 1) == {np.float64: 0.4, np.float32: 1.6}[dt]  # the prose
    # 4 eps: a softmax off by 1e-6 relative fails it by 9 orders of magnitude
    assert r["err_unsafe"][fits].max() <= 4 * eps and r["wrong_unsafe"][fits].max() == 0
    assert r["wrong_unsafe"][overflows].min() > 0.9999
    # the sum overflows before the largest score does: exact zeros, wrong and finite, no NaN
    between = overflows & (tops < t)
    assert between.any() and r["all_zero_unsafe"][between].all()
    assert not r["nan_unsafe"][tops < t].any() and r["nan_unsafe"][tops > t].all()
    assert not r["nonfinite_safe"].any()
    assert r["err_safe"].max() <= 4 * eps and r["wrong_safe"].max() == 0

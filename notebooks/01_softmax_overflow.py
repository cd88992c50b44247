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
# fails on ordinary inputs. In this chapter:
#
# - we find, from the floating-point format alone, the score at which $e^x$ overflows: about 709
#   in float64 and about 88 in float32;
# - we watch the textbook softmax return NaN once a row's scores pass that point, and also when
#   every score is very negative;
# - we derive why subtracting the row maximum first changes nothing mathematically, and why it
#   removes both failures;
# - we measure both versions against a higher-precision truth over score spans from $10^{-1}$ to
#   $10^4$: the safe one stays within a few rounding errors everywhere.

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
print(f"sum - 1 = {p_small.sum() - 1:.1e}")

# %% [markdown]
# ## Where $e^x$ overflows
#
# A floating-point format has a largest finite number, `np.finfo(dtype).max`. Since $e^x$ is
# increasing, $e^x$ is finite exactly when $x \le \log(\text{max})$; beyond that, `np.exp`
# returns `inf`. We compute that threshold for each format rather than remember it (float16 is
# shown too: attention kernels keep its scores and sums in float32 for this reason, and so does
# `flash_lib`).

# %%
thresholds = {dt: float(np.log(np.finfo(dt).max)) for dt in (np.float64, np.float32, np.float16)}
for dt, t in thresholds.items():
    below = np.exp(dt(t - 0.5))
    with np.errstate(over="ignore"):
        above = np.exp(dt(t + 0.5))
    print(f"{dt.__name__:<7}: exp(x) overflows for x > {t:.2f};  "
          f"exp({t - 0.5:.2f}) finite: {bool(np.isfinite(below))},  exp({t + 0.5:.2f}) = {above}")

t64, t32 = thresholds[np.float64], thresholds[np.float32]
# below log(smallest subnormal), exp(x) rounds to 0: the underflow end
underflow64 = float(np.log(np.finfo(np.float64).smallest_subnormal))
print(f"float64: exp(x) underflows to 0 for x below about {underflow64:.1f}")

# %% [markdown]
# So a single score above about 709 (float64) or 88 (float32) is enough. An attention score is
# a dot product of two $d$-dimensional vectors times $1/\sqrt{d}$, and nothing in the formula
# bounds it: with $d = 64$, query and key entries of size 4 already give a score of 128.
#
# The textbook formula then computes $\infty / \infty = \text{NaN}$. The opposite extreme fails
# too: if every score is below about $-745$ (the log of the smallest positive float64, printed
# above), every $e^{x_j}$ underflows to 0 and the formula
# computes $0/0 = \text{NaN}$. (NumPy would print a `RuntimeWarning` for each; we silence them
# with `np.errstate` here because we are looking at the results on purpose.)

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
# Where the textbook formula does not overflow, the two agree to rounding. We check that on
# random rows with scores up to $\pm 100$ (safe for float64):

# %%
x_moderate = rng.uniform(-100, 100, size=(1000, 64))
diff = np.abs(softmax_safe(x_moderate) - softmax_unsafe(x_moderate)).max()
print(f"max |safe - unsafe| on rows in [-100, 100]: {diff:.1e}")

# %% [markdown]
# ## Error against the span of the scores
#
# How wide may a row's scores spread before the textbook version fails, and does the safe version
# lose accuracy on wide rows? We take one row of $n = 256$ scores spread evenly at random over
# $[0, \text{span}]$ (the largest exactly at span), for spans from $10^{-1}$ to $10^4$, in float64
# and in float32, and compute the normwise relative error
#
# $$\mathrm{err}(p) = \frac{\max_i |p_i - p^\ast_i|}{\max_i p^\ast_i}$$
#
# against a truth $p^\ast$ computed in higher precision. For that truth we borrow
# `flash_lib.precise_attention` (long double on x86-64, else mpmath): softmax of a row $x$ is
# attention of a single query whose scores are $x$ (query $= 1$, keys $= x$, scale $= 1$) over
# values that are the identity matrix, which returns the weights themselves. For float32 the truth
# is computed from the float32-rounded scores, so only the softmax's own rounding is measured.

# %%
n = 256
u = rng.uniform(size=n)
u = (u - u.min()) / (u.max() - u.min())  # spread over [0, 1], with min 0 and max exactly 1
spans = np.logspace(-1, 4, 51)

results = {}
for dt in (np.float64, np.float32):
    x = (spans[:, None] * u).astype(dt)  # one row per span
    one_query = np.ones((len(spans), 1, 1), dtype=dt)
    truth = flash_lib.precise_attention(one_query, x[..., None], np.eye(n, dtype=dt), scale=1.0)
    truth = truth[:, 0, :]
    with np.errstate(over="ignore", invalid="ignore"):
        p_unsafe = softmax_unsafe(x)
    p_safe = softmax_safe(x)

    def err(p):
        # NaN rows stay NaN; they are counted separately as non-finite
        return (np.abs(p - truth).max(axis=-1) / truth.max(axis=-1)).astype(np.float64)

    results[dt] = dict(
        err_unsafe=err(p_unsafe),
        err_safe=err(p_safe),
        nonfinite_unsafe=(~np.isfinite(p_unsafe)).mean(axis=-1),
        nonfinite_safe=(~np.isfinite(p_safe)).mean(axis=-1),
    )

for dt, r in results.items():
    t, eps = thresholds[dt], np.finfo(dt).eps
    below, above = spans < t, spans > t
    print(f"{dt.__name__} (exp overflows above {t:.2f}):")
    print(f"  unsafe: finite at every span below: {bool(r['nonfinite_unsafe'][below].max() == 0)}; "
          f"error <= 4 eps there: {bool(r['err_unsafe'][below].max() <= 4 * eps)}; "
          f"non-finite at every span above: {bool(r['nonfinite_unsafe'][above].min() > 0)}")
    print(f"  safe:   finite at every span: {bool(r['nonfinite_safe'].max() == 0)}; "
          f"error <= 4 eps at every span: {bool(r['err_safe'].max() <= 4 * eps)}")

# %% [markdown]
# The left panel shows the error where it is defined; the right one the fraction of the unsafe
# version's outputs that are NaN or infinite. Vertical dotted lines mark each format's overflow
# threshold. The textbook softmax is as accurate as the safe one
# right up to the threshold and then falls off a cliff; the safe one stays within a few units of
# the format's machine epsilon (grey dotted lines) at every span.

# %%
fig, (ax_err, ax_nan) = plt.subplots(1, 2, figsize=(11, 4))
for i, (dt, r) in enumerate(results.items()):
    name = dt.__name__
    ax_err.loglog(spans, r["err_safe"], "-", color=f"C{2 * i}", label=f"safe, {name}")
    ax_err.loglog(spans, r["err_unsafe"], "--", color=f"C{2 * i + 1}", label=f"unsafe, {name}")
    ax_err.axhline(np.finfo(dt).eps, color="grey", ls=":", lw=1,
                   label="machine epsilon" if i == 0 else None)
    ax_nan.semilogx(spans, r["nonfinite_safe"], "-", color=f"C{2 * i}", label=f"safe, {name}")
    ax_nan.semilogx(spans, r["nonfinite_unsafe"], "--", color=f"C{2 * i + 1}",
                    label=f"unsafe, {name}")
    ax_err.axvline(thresholds[dt], color=f"C{2 * i + 1}", ls=":", lw=1.5)
    ax_nan.axvline(thresholds[dt], color=f"C{2 * i + 1}", ls=":", lw=1.5,
                   label=f"log(max {name}) = {thresholds[dt]:.1f}")
ax_err.set_ylim(1e-19, 1e-5)
ax_err.set_title("Error against a higher-precision truth")
ax_err.set_xlabel("span of the row's scores, max - min (nats)")
ax_err.set_ylabel("normwise relative error (dimensionless)")
ax_err.legend(loc="center left", fontsize=9)
ax_nan.set_ylim(-0.03, 1.03)
ax_nan.set_title("Outputs that are NaN or inf")
ax_nan.set_xlabel("span of the row's scores, max - min (nats)")
ax_nan.set_ylabel("fraction of the row (dimensionless)")
ax_nan.legend(loc="upper left", fontsize=9)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What we showed
#
# - $e^x$ overflows for $x > \log(\text{max})$: about 709.78 in float64, 88.72 in float32 (11.09
#   in float16), computed from `np.finfo`.
# - The textbook softmax returns NaN for a row whose scores exceed that threshold, and for a row
#   whose scores are all below about $-745$ (float64), where every $e^{x_j}$ underflows to 0.
# - $\mathrm{softmax}(x - c) = \mathrm{softmax}(x)$ for every constant $c$; with $c = \max_j x_j$
#   every exponent is $\le 0$ and the denominator $l$ lies in $[1, n]$.
# - In floating point the safe softmax of $[1000, 999, 998]$ equals that of $[2, 1, 0]$ bit for
#   bit, and where the textbook formula does not overflow the two versions agree to $10^{-15}$.
# - Over spans from $10^{-1}$ to $10^4$ the textbook version is finite (and as accurate as the
#   safe one, within 4 machine epsilons) below the threshold and not above it: a cliff, not a
#   gradual loss. The safe version is finite everywhere with error at most 4 machine epsilons of
#   its format.

# %%
# exp overflows just above log(max) and not just below, in each format
assert 709 < t64 < 710 and 88 < t32 < 89 and 11 < thresholds[np.float16] < 12
for dt, t in thresholds.items():
    assert np.isfinite(np.exp(dt(t - 0.5)))
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(dt(t + 0.5)))
# the textbook formula fails at both ends
assert np.isnan(p_big_unsafe).all() and np.isnan(p_neg_unsafe).all()
assert (np.exp(x_very_negative) == 0).all() and -746 < underflow64 < -744
# the safe formula: exact shift, bounded exponents and denominator
assert np.array_equal(p_big_safe, softmax_safe(x_small))
assert np.isclose(p_big_safe.sum(), 1.0, rtol=0, atol=1e-15)
assert np.isfinite(softmax_safe(x_very_negative)).all()
assert np.array_equal(softmax_safe(x_very_negative), softmax_safe(x_small))
l_moderate = np.exp(x_moderate - x_moderate.max(axis=-1, keepdims=True)).sum(axis=-1)
assert ((1 <= l_moderate) & (l_moderate <= x_moderate.shape[-1])).all()
assert diff < 1e-15
# the sweep: a cliff for the unsafe version exactly at the threshold, none for the safe one
for dt, r in results.items():
    t = thresholds[dt]
    assert r["nonfinite_unsafe"][spans < t].max() == 0
    assert r["nonfinite_unsafe"][spans > t].min() > 0
    assert r["nonfinite_safe"].max() == 0
    assert r["err_safe"].max() <= 4 * np.finfo(dt).eps
    assert r["err_unsafe"][spans < t].max() <= 4 * np.finfo(dt).eps

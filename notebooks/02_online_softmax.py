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
# # 2. Online softmax, one score at a time
#
# The safe softmax of chapter 1 reads the scores twice: once for the maximum $m$, once for the
# sum $l = \sum_j e^{x_j - m}$. FlashAttention never holds a whole row of scores, so it cannot
# afford the first pass. This chapter derives the *online* update that carries $m$ and $l$
# through a stream in one pass (Milakov & Gimelshein, arXiv 1805.02867), runs it by hand on eight
# scores, and checks it against the two-pass result and against `flash_lib.flash_attention`.

# %%
import math

import numpy as np
import matplotlib.pyplot as plt

import flash_lib

rng = np.random.default_rng(2)

# %% [markdown]
# ## The state and its invariant
#
# After reading the first $t$ scores $x_1, \dots, x_t$ of a stream, keep two numbers:
#
# $$m_t = \max_{j \le t} x_j, \qquad l_t = \sum_{j \le t} e^{x_j - m_t} .$$
#
# This pair is the **invariant**: $m$ is the maximum of what has been read, $l$ its sum of
# exponentials measured against that maximum. The empty stream has $(m_0, l_0) = (-\infty, 0)$.
#
# ## The update
#
# A new score $x$ arrives. The new maximum is $m' = \max(m, x)$. Every term of the old sum was
# measured against $m$, and we need it measured against $m'$; since
# $e^{x_j - m'} = e^{x_j - m} \, e^{m - m'}$, one multiplication moves the whole old sum:
#
# $$l' = \sum_{j \le t+1} e^{x_j - m'} = e^{m - m'} \sum_{j \le t} e^{x_j - m} + e^{x - m'} = l \, e^{m - m'} + e^{x - m'} .$$
#
# Both exponents are $\le 0$, so neither factor exceeds 1 and nothing overflows. If the maximum
# stays, the rescaling factor $e^{m - m'}$ is exactly 1; if it rises, the new score contributes
# $e^{0} = 1$, so $l \ge 1$. At the first step $e^{-\infty} = 0$ wipes the empty sum. (A first
# score of $-\infty$, a masked key, would give $e^{-\infty - (-\infty)}$ = NaN: chapter 6.)
# In plain Python, one score at a time:

# %%
def online_softmax_state(stream, steps=None):
    """Read the scores one at a time; return the states (m_t, l_t) after each of them.

    If `steps` is a list, each step's two factors (exp(m - m'), exp(x - m')) are appended to it.
    """
    m, l = -math.inf, 0.0  # the empty stream
    states = []
    for x in stream:
        m_new = max(m, x)
        alpha, term = math.exp(m - m_new), math.exp(x - m_new)
        # l' = l · exp(m - m') + exp(x - m')
        l = l * alpha + term
        m = m_new
        states.append((m, l))
        if steps is not None:
            steps.append((alpha, term))
    return states


# %% [markdown]
# ## Eight scores, step by step
#
# The maximum rises at steps 2, 5 and 8 and is tied at step 4. Each row prints the score, the new
# maximum, the factor $e^{m - m'}$, the new term $e^{x - m'}$, $l$, and the invariant
# $\sum_{j \le t} e^{x_j - m_t}$ computed from its definition, which must equal $l$.

# %%
stream = [1.0, 3.0, 0.5, 3.0, 6.0, 2.0, -4.0, 7.0]
states = online_softmax_state(stream)

print(f"{'t':>2} {'x_t':>6} {'m_t':>6} {'exp(m-m_t)':>11} {'exp(x_t-m_t)':>13} "
      f"{'l_t':>9} {'sum exp(x_j-m_t)':>17}")
invariant_errors = []
m_prev = -math.inf
for t, (x, (m, l)) in enumerate(zip(stream, states), start=1):
    direct = sum(math.exp(xj - m) for xj in stream[:t])
    invariant_errors.append(abs(l - direct) / direct)
    print(f"{t:>2} {x:>6.1f} {m:>6.1f} {math.exp(m_prev - m):>#11.4g} {math.exp(x - m):>#13.4g} "
          f"{l:>#9.4g} {direct:>#17.4g}")
    m_prev = m

# Both l_t and its definition are sums of t positive terms. A term of the recurrence carries one
# exp and then, per later step, one exp (alpha), one product and one sum: at most 2t roundings of
# an ulp (eps relative) or less; the definition's terms carry one exp and t - 1 sums. With room
# for an exp off by up to 2 ulps, the two agree within 4t eps.
eps = np.finfo(np.float64).eps
l_bound = lambda t: 4 * t * eps
invariant_holds = all(e <= l_bound(t) for t, e in enumerate(invariant_errors, start=1))
print(f"l_t equals its definition within 4t eps at every step (4t eps = {l_bound(len(stream)):.1e} "
      f"at t = {len(stream)}): {invariant_holds}")

# %% [markdown]
# The `exp(m-m_t)` column is 1 where the maximum stays (steps 3, 4, 6, 7) and below 1 where it
# rises (2, 5, 8), shrinking the whole old sum in one multiplication. The figure draws each state's
# terms $e^{x_j - m_t}$ (newest in orange; $l_t$ is their total) on a log axis, where the
# multiplication by $\alpha = e^{m - m'}$ moves every old bar down by the same distance; hollow
# outlines are the old bars before it.

# %% tags=["hide-input"]
def draw_state(ax, t):
    """Bars e^(x_j - m_t) for the first t scores (log scale); their total is l_t."""
    m, l = states[t - 1]
    m_old = states[t - 2][0] if t > 1 else -math.inf
    positions = np.arange(1, len(stream) + 1)
    terms = [math.exp(x - m) for x in stream[:t]]
    ax.bar(positions[: t - 1], terms[:-1], color="C0", label="earlier scores")
    ax.bar(positions[t - 1], terms[-1], color="C1", label="newest score")
    if 1 < t and m > m_old:  # the max rose: show the old bars before the rescaling
        before = [math.exp(x - m_old) for x in stream[: t - 1]]
        ax.bar(positions[: t - 1], before, fill=False, edgecolor="0.35", ls="--", lw=0.8,
               label="earlier scores before\nthe rescaling")
        ax.text(0.5, 0.9, rf"old bars $\times\ \alpha = e^{{m - m'}} = {math.exp(m_old - m):.3f}$",
                transform=ax.transAxes, ha="center", va="center", fontsize=9)
    ax.axhline(1.0, color="grey", ls=":", lw=1, label="$e^0$: the maximum's term")
    ax.set_yscale("log")
    ax.set_xticks(positions)
    ax.set_xlim(0.4, len(stream) + 0.6)
    ax.set_ylim(1e-5, 40)
    ax.set_title(f"t={t}: x={stream[t - 1]:g}, m={m:g}, l={l:.3f}", fontsize=10)


fig, axes = plt.subplots(4, 2, figsize=(8.5, 10), sharex=True, sharey=True)
for t, ax in enumerate(axes.flat, start=1):
    draw_state(ax, t)
for ax in axes[-1]:
    ax.set_xlabel("position j in the stream")
for ax in axes[:, 0]:
    ax.set_ylabel("$e^{x_j - m_t}$ (dimensionless)")
# the legend below the panels, with an example of each kind of bar and line (from t = 2)
fig.legend(*axes[0, 1].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=9)
fig.suptitle("Online softmax state after each score: the bars are the terms of $l_t$")
fig.tight_layout(rect=(0, 0.06, 1, 1))
plt.show()

# %% [markdown]
# In JupyterLab the slider below steps through the same states (the static page shows only the
# grid above).

# %% tags=["hide-input", "nbval-ignore-output", "remove-output"]
# nbval ignores this cell's output: it skips the widget's model_id (random per run), but it does
# not route messages into the Output widget as Jupyter does, so it sees the figure drawn inside the
# slider's widget as an extra cell output that the stored notebook keeps in the widget's state.
from ipywidgets import IntSlider, interactive
from IPython.display import display


def show_state(t):
    fig, ax = plt.subplots(figsize=(7, 4))
    draw_state(ax, t)
    ax.set_xlabel("position j in the stream")
    ax.set_ylabel("$e^{x_j - m_t}$ (dimensionless)")
    ax.legend(loc="upper left", fontsize=9)
    fig.tight_layout()
    plt.show()


display(interactive(show_state, t=IntSlider(value=1, min=1, max=len(stream), description="t")))

# %% [markdown]
# ## Against the two-pass result
#
# The online state after the last score must give the two-pass $m$ exactly (a maximum does not
# round) and its $l$ to rounding (other order, other scalings). From $(m, l)$ come the weights
# $e^{x_i - m} / l$ and $\mathrm{lse} = m + \log l = \log \sum_j e^{x_j}$, chapter 3's compact
# state.

# %%
def two_pass_state(stream):
    x = np.asarray(stream, dtype=np.float64)
    m = x.max()
    return float(m), float(np.exp(x - m).sum())


m_online, l_online = states[-1]
m_two, l_two = two_pass_state(stream)
weights_online = np.exp(np.array(stream) - m_online) / l_online
l_diff_short = abs(l_online - l_two) / l_two
print(f"m online - m two-pass: {m_online - m_two}; l relative difference within 4t eps = "
      f"{l_bound(len(stream)):.1e}: {l_diff_short <= l_bound(len(stream))}")
print("weights:", ", ".join(f"{w:.3g}" for w in weights_online))
print("lse = m + log l =", f"{m_online + math.log(l_online):.4f}")

# %% [markdown]
# The same on 10,000 scores around 1000 (standard deviation 1): $e^x$ overflows for every one,
# and hundreds share the weight. The cell records both factors of every step to check that nothing
# but $l$ exceeds 1, and that each factor is what the recurrence says for the stream's running
# maximum. Shifting the eight scores by 1000 leaves every $x_j - m_t$ unchanged (and exact), so
# the sums stay identical bit for bit while $m$ moves by 1000.

# %%
long_stream = rng.normal(1000.0, 1.0, size=10_000)
with np.errstate(over="ignore"):
    overflowing = float(np.isinf(np.exp(long_stream)).mean())
long_steps = []
long_states = online_softmax_state(long_stream.tolist(), long_steps)
m_long, l_long = long_states[-1]
m_long_two, l_long_two = two_pass_state(long_stream)
largest_factor = max(max(alpha, term) for alpha, term in long_steps)

print(f"fraction of the long stream where exp(x) overflows: {overflowing:.2f}")
# l to the unit: its rounding error is about 1e-13 relative, far from moving the last digit shown
print(f"long stream: largest exp(m - m') or exp(x - m') formed: {largest_factor:g}; "
      f"l after {len(long_states):,} scores: {l_long:.0f} (the largest score carries "
      f"1/l = {1 / l_long:.2%} of the weight)")
l_diff_long = abs(l_long - l_long_two) / l_long_two
print(f"long stream: m online - m two-pass: {m_long - m_long_two}; l relative difference within "
      f"4t eps = {l_bound(len(long_stream)):.1e}: {l_diff_long <= l_bound(len(long_stream))}")

shifted_states = online_softmax_state([x + 1000.0 for x in stream])
l_changes = max(abs(ls - l) for (_, ls), (_, l) in zip(shifted_states, states))
m_shifts = sorted({ms - m for (ms, _), (m, _) in zip(shifted_states, states)})
print(f"stream + 1000: largest change of any l_t: {l_changes}; m_t moved by {m_shifts}")

# %% [markdown]
# ## Against flash_lib
#
# Softmax of a row is attention with identity values (chapter 1's device), so the output row is
# the weights. `flash_lib.flash_attention` carries $m$ and $l$ per query row with this update,
# `block_k` keys at a time (chapter 5); `block_k=1` reads one score per step, as our loop does.
# (The differences this chapter measures are drawn against their bounds in the
# {doc}`appendix on how this tutorial is tested <27_how_chapters_1_to_6_are_tested>`.)

# %%
n = len(stream)
q = np.ones((1, 1))
k = np.array(stream)[:, None]
v = np.eye(n)
out_1, lse_1 = flash_lib.flash_attention(q, k, v, scale=1.0, block_k=1, return_lse=True)
out_all, lse_all = flash_lib.flash_attention(q, k, v, scale=1.0, return_lse=True)
lse_online = m_online + math.log(l_online)
# Each weight is e^(x_i - m) / l, and l of either computation is within 2n eps of the exact sum
# (above), so each weight is within (4n + 2) eps relative of the exact one, and, being at most 1,
# the two differ by at most (8n + 4) eps. The lse = m + log l: the l's differ by at most 4n eps
# relative, which log turns into 4n eps absolute, plus the rounding of log and of the sum, an eps
# of |lse| on each side.
weight_bound = (8 * n + 4) * eps
lse_bound = (4 * n + 4 * abs(lse_online)) * eps
flash_diffs = {}
for name, out_fl, lse_fl in (("block_k=1", out_1, lse_1), ("default block_k", out_all, lse_all)):
    flash_diffs[name] = (np.abs(out_fl[0] - weights_online).max(), abs(lse_fl[0] - lse_online))
    dw, dlse = flash_diffs[name]
    print(f"{name}: weights within {weight_bound:.1e}: {dw <= weight_bound}, "
          f"lse within {lse_bound:.1e} nats: {dlse <= lse_bound}")

# %% [markdown]
# ## What we showed
#
# - $m' = \max(m, x)$, $l' = l \, e^{m - m'} + e^{x - m'}$ from $(-\infty, 0)$ keeps the
#   invariant; the factor is 1 exactly when the maximum stays, and nothing but $l \in [1, t]$
#   exceeds 1, even where $e^x$ overflows for every score.
# - It ends with the two-pass $m$ exactly and $l$ within $4t$ machine epsilons; a shift by 1000
#   moves $m$ by 1000 and leaves every $l_t$ bit for bit.
# - `flash_attention` gives the same weights and lse within their derived bounds, with
#   `block_k=1` and with its default block.

# %%
# the invariant, at every step of the short stream
assert invariant_holds
assert states[0] == (stream[0], 1.0)
# rescaling factor: 1 exactly when the max stays, < 1 when it rises; 1 <= l_t <= t
m_before = [-math.inf] + [m for m, _ in states[:-1]]
for (m, l), m_old, t in zip(states, m_before, range(1, n + 1)):
    assert (math.exp(m_old - m) == 1.0) == (m == m_old)
    assert 1.0 <= l <= t
rises = [t for t, (m, _), m_old in zip(range(1, n + 1), states, m_before) if m > m_old]
assert rises == [1, 2, 5, 8]
# against the two-pass result
assert m_online == m_two and l_diff_short <= l_bound(len(stream))
assert overflowing == 1.0
assert l_long > 100  # a real sum: the largest term is 1, so hundreds of terms contribute
assert m_long == m_long_two and l_diff_long <= l_bound(len(long_stream))
# nothing larger than 1 besides l: both factors of every step are in [0, 1], and l_t <= t
assert all(0 <= alpha <= 1 and 0 <= term <= 1 for alpha, term in long_steps)
# each step's factors are exp(m_{t-1} - m_t) and exp(x_t - m_t) for the stream's running maximum,
# computed here independently of the loop: a wrong max, or a factor taken against the old max, fails
running_max = np.maximum.accumulate(long_stream).tolist()
expected_steps = [(math.exp(m_old - m_t), math.exp(x - m_t)) for x, m_t, m_old
                  in zip(long_stream.tolist(), running_max, [-math.inf] + running_max[:-1])]
assert long_steps == expected_steps
assert all(1 <= l <= t for t, (_, l) in enumerate(long_states, start=1))
assert all(ls == l for (_, ls), (_, l) in zip(shifted_states, states))
assert all(ms == m + 1000.0 for (ms, _), (m, _) in zip(shifted_states, states))
# against flash_lib
# a kernel off by 1e-6 relative misses the weight bound (1.5e-14) by 8 orders of magnitude
assert all(dw <= weight_bound and dl <= lse_bound for dw, dl in flash_diffs.values())
assert abs(weights_online.sum() - 1.0) <= weight_bound

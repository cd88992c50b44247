"""FlashAttention's own acceptance rule, applied to flash_lib over a seeded subsample of
FlashAttention's test grid (issue 33, item 16); and ``D = rowsum(dO ∘ O)`` as a pairwise sum.

FlashAttention's tests (Dao-AILab/flash-attention at commit
0251105a2fb19d2957484b7f023cd8c115286ced) measure a kernel against ``attention_ref(upcast=True)``
(``tests/test_flash_attn.py`` line 217: the reference in float32) and accept it when its largest
error is at most twice the largest error of the same reference computed in the inputs' own
precision (``attention_ref(upcast=False, reorder_ops=True)``: the keys scaled instead of the
queries), plus a small absolute slack:

* ``tests/test_flash_attn.py``: ``(out - out_ref).abs().max() <= 2 * (out_pt -
  out_ref).abs().max()`` (line 1121), gradients by autograd likewise (3× in
  ``test_flash_attn_output``, lines 1130-1132; 2× ``+ 1e-5`` in ``test_flash_attn_causal``, lines
  1556-1560, a slack for fp16 and bf16 outputs of size 1, where 1e-5 is a hundredth of an ulp);
* ``tests/cute/test_flash_attn.py`` (FlashAttention-4, lines 462 and 601-618) states the slack in
  the dtype's own terms: ``atol = 2 * (ref + 0.3 - 0.3 - ref).abs().max()``, twice the rounding
  of one addition in the dtype at the reference's values.

Here the inputs are float32 (flash_lib's precision; FlashAttention's grid is fp16/bf16 on a GPU,
whose kernel accumulates in float32), the truth is the same reference in float64, the
same-precision reference is torch's in float32, and the slack is FlashAttention-4's, computed in
float32 (``atol`` about 3e-8 to 1.2e-7: FlashAttention-2's 1e-5 would excuse everything in
float32). The grid: head dims 32-256, MHA, MQA and GQA, causal, local windows drawn as
FlashAttention draws them, ALiBi, sinks, softcap, dropout, Nq > Nk and Nq = 1, and
``test_flash_attn_causal``'s ``Nq = 3, Nk = 799`` with MQA, d = 96 and the window (477, 448) of
the issue; in both of flash_lib's bases.

One exception, FlashAttention-2's own: ``dq`` of a row with exactly one allowed key. Its true
``dS`` is 0 (``P = 1``, ``dP - rowsum(P ∘ dP) = 0``), which torch's softmax backward gets exactly;
FlashAttention-2's ``D = dO·O`` (Algorithm 2, line 4; flash_lib's too) gets the difference of two
dot products summed in different orders, rounding noise. The rule is applied to the other rows,
and :func:`test_a_row_with_one_key_gets_only_the_rounding_of_fa2s_d` bounds that noise.
"""

import math

import numpy as np
import pytest

import flash_lib

torch = pytest.importorskip("torch")

#: the heads: (query heads, kv heads) for MHA, GQA and MQA (FlashAttention's test: 6 and 6, 2, 1)
HEADS = {"mha": (6, 6), "gqa": (6, 2), "mqa": (6, 1)}
#: FlashAttention's grid (``tests/test_flash_attn.py``: test_flash_attn_output's and
#: test_flash_attn_causal's head dims and (seqlen_q, seqlen_k), those of 1000 and more left out)
HEAD_DIMS = (32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)
SEQLENS = ((1, 147), (1, 239), (3, 799), (113, 203), (128, 217), (113, 211), (108, 256),
           (127, 512), (127, 513), (256, 512), (512, 256))
#: the issue's case (its draw gave base-2 dk 2.98e-7 against 2.38e-7 allowed, log2(e) in the keys;
#: this seeded draw of it is within the rule on main too: dk 0.58 of what it allows)
ISSUE_CASE = dict(seed=0, batch=4, heads="mqa", n_q=3, n_k=799, d=96, causal=False,
                  window=(477, 448), alibi=False, softcap=0.0, sinks=False, dropout_p=0.0)
GRADS = ("out", "dq", "dk", "dv")


@pytest.fixture(autouse=True)
def torch_on_one_thread():
    """torch's float32 reference on one thread: the same bits on every machine and run."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def grid(n_cases, seed=33):
    """A seeded subsample of FlashAttention's grid: ``n_cases`` draws of head dim, seqlens, heads
    (MHA, GQA, MQA), causal, local (a window drawn as FlashAttention draws it, ``randint(0,
    seqlen_k, (2,))``), ALiBi (slopes ``rand · 0.3``), sinks, softcap 50 and dropout 0.17 (not both:
    FlashAttention skips softcap with dropout)."""
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(n_cases):
        n_q, n_k = SEQLENS[rng.integers(len(SEQLENS))]
        softcap = 50.0 if rng.random() < 0.25 else 0.0
        cases.append(dict(
            seed=1000 + i, d=int(rng.choice(HEAD_DIMS)), n_q=n_q, n_k=n_k,
            heads=("mha", "gqa", "mqa")[rng.integers(3)], causal=bool(rng.random() < 0.5),
            window=tuple(int(w) for w in rng.integers(0, n_k, 2)) if rng.random() < 0.5 else None,
            alibi=bool(rng.random() < 0.5), sinks=bool(rng.random() < 0.3), softcap=softcap,
            dropout_p=0.17 if not softcap and rng.random() < 0.3 else 0.0))
    return cases


def allowed_pairs(n_q, n_k, causal, window):
    """``(n_q, n_k)`` bool: the pairs causal and window allow (bottom-right, FlashAttention's)."""
    i = np.arange(n_q)[:, None] + (n_k - n_q)
    j = np.arange(n_k)[None, :]
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    ok = np.ones((n_q, n_k), bool)
    if right is not None:
        ok &= j <= i + right
    if left is not None:
        ok &= j >= i - left
    return ok


def torch_reference(q, k, v, g, *, dtype, allowed, alibi, softcap, sinks, keep, dropout_p):
    """FlashAttention's ``attention_ref`` in ``dtype`` (the keys scaled, ``reorder_ops=True``)
    with flash_lib's layout (batch, heads, N, d), sinks as FlashAttention-4's reference adds
    them, and the gradients of ``sum(g * out)`` by autograd: ``out, dq, dk, dv`` as float64."""
    t = [torch.tensor(x, dtype=dtype, requires_grad=True) for x in (q, k, v)]
    tq, tk, tv = t
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    groups = q.shape[1] // k.shape[1]
    k_rep, v_rep = tk.repeat_interleave(groups, dim=1), tv.repeat_interleave(groups, dim=1)
    scores = torch.einsum("bhtd,bhsd->bhts", tq, k_rep * (1 / math.sqrt(d)))
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi is not None:
        distance = (torch.arange(n_q)[:, None] + (n_k - n_q) - torch.arange(n_k)[None, :]).abs()
        scores = scores - torch.tensor(alibi, dtype=dtype)[None, :, None, None] * distance.to(dtype)
    allowed = torch.tensor(allowed)
    scores = scores.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        sink = torch.tensor(sinks, dtype=dtype)[None, :, None, None].expand(scores.shape[:-1] + (1,))
        p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(scores, dim=-1)
    p = p.masked_fill(~allowed.any(-1)[:, None], 0.0)  # a row with no key: 0, not NaN
    if keep is not None:
        p = p.masked_fill(~torch.tensor(keep), 0.0)
    out = torch.einsum("bhts,bhsd->bhtd", p, v_rep * (1 / (1 - dropout_p)))
    grads = torch.autograd.grad(out, t, torch.tensor(g, dtype=dtype))
    return [x.detach().numpy().astype(np.float64) for x in (out,) + grads]


def problem(case):
    """The case's float32 inputs (FlashAttention's: standard normal, q times the cap with
    softcap), flash_lib's keyword arguments, and the pairs allowed."""
    rng = np.random.default_rng(case["seed"])
    hq, hkv = HEADS[case["heads"]]
    n_q, n_k, d, batch = case["n_q"], case["n_k"], case["d"], case.get("batch", 2)
    q = rng.standard_normal((batch, hq, n_q, d)).astype(np.float32)
    if case["softcap"]:
        q *= np.float32(case["softcap"])
    k, v = (rng.standard_normal((batch, hkv, n_k, d)).astype(np.float32) for _ in range(2))
    g = rng.standard_normal((batch, hq, n_q, d)).astype(np.float32)
    alibi = (rng.random(hq) * 0.3).astype(np.float32) if case["alibi"] else None
    sinks = rng.standard_normal(hq).astype(np.float32) if case["sinks"] else None
    p = case["dropout_p"]
    kw = dict(causal=case["causal"], window=case["window"], softcap=case["softcap"] or None,
              alibi_slopes=alibi, sinks=sinks, enable_gqa=hq != hkv, dropout_p=p,
              dropout_seed=case["seed"] if p else None)
    return (q, k, v, g), kw, allowed_pairs(n_q, n_k, case["causal"], case["window"])


def fa_rule_errors(case, base):
    """flash_lib's largest error (in ``base``), torch-in-float32's and FlashAttention-4's slack,
    each a dict over ``out, dq, dk, dv``, all against torch in float64; ``dq`` over the rows with
    more than one allowed key (the module docstring says why)."""
    (q, k, v, g), kw, allowed = problem(case)
    with flash_lib.use_exponential(base):
        out, lse = flash_lib.flash_attention(q, k, v, return_lse=True, block_q=64, block_k=128, **kw)
        grads = flash_lib.flash_attention_backward(q, k, v, out, lse, g, block_q=64, block_k=128,
                                                   **kw)
    mine = dict(zip(GRADS, (out,) + tuple(grads[:3])))
    p = case["dropout_p"]
    keep = flash_lib.dropout_keep(kw["dropout_seed"], p, g.shape[:-1] + (k.shape[-2],)) if p else None
    ref = dict(allowed=allowed, alibi=kw["alibi_slopes"], softcap=case["softcap"],
               sinks=kw["sinks"], keep=keep, dropout_p=p)
    truth = dict(zip(GRADS, torch_reference(q, k, v, g, dtype=torch.float64, **ref)))
    same = dict(zip(GRADS, torch_reference(q, k, v, g, dtype=torch.float32, **ref)))
    rows = allowed.sum(axis=-1) != 1
    for x in (mine, truth, same):
        x["dq"] = x["dq"][..., rows, :]
    err = {n: float(np.abs(mine[n] - truth[n]).max(initial=0)) for n in GRADS}
    err_pt = {n: float(np.abs(same[n] - truth[n]).max(initial=0)) for n in GRADS}
    atol = {}
    for n, x in truth.items():  # (ref + 0.3 - 0.3 - ref) in float32, as FlashAttention-4's
        x32 = x.astype(np.float32)
        moved = (x32 + np.float32(0.3) - np.float32(0.3)).astype(np.float64)
        atol[n] = 2 * float(np.abs(moved - x32).max(initial=0))
    return err, err_pt, atol


@pytest.mark.parametrize("base", ["exp", "exp2"])
def test_flash_lib_meets_flashattentions_rule_over_its_grid(base):
    """Over 24 seeded cases of FlashAttention's grid and the issue's case, in each base: every
    output's and gradient's largest error against float64 is at most twice torch's in float32
    plus FlashAttention-4's slack. (Today's main failed it in base 2, log2(e) folded into the
    keys and the backward's P in base 2: dq 1.11× and 1.08× what the rule allows, d = 160 MQA
    causal ALiBi and d = 160 GQA softcap sinks.)"""
    failures = []
    for case in grid(24) + [ISSUE_CASE]:
        err, err_pt, atol = fa_rule_errors(case, base)
        for n in GRADS:
            if not err[n] <= 2 * err_pt[n] + atol[n]:
                failures.append(f"{n}: {err[n]:.3g} > 2 × {err_pt[n]:.3g} + {atol[n]:.2g} in "
                                f"{ {c: x for c, x in case.items() if c != 'seed'} }")
    assert not failures, "\n".join(failures)


def test_a_row_with_one_key_gets_only_the_rounding_of_fa2s_d():
    """Causal with Nq = 2·Nk: row Nk has one key j. Its true dq is 0, which torch's float32
    softmax backward gets exactly; flash_lib's is τ·(dP - D)·k_j with dP = dO·v_j (BLAS) and
    D = dO·O, O = v_j exactly: two sums of the same dv products, so within
    ``2γ_dv · Σ|dO ∘ v_j| · τ|k_j|`` (Higham §3.1), and not 0."""
    case = dict(seed=1002, heads="mqa", n_q=512, n_k=256, d=96, causal=True, window=None,
                alibi=False, softcap=0.0, sinks=False, dropout_p=0.0)
    (q, k, v, g), kw, allowed = problem(case)
    out, lse = flash_lib.flash_attention(q, k, v, return_lse=True, **kw)
    dq = flash_lib.flash_attention_backward(q, k, v, out, lse, g, **kw)[0]
    same = torch_reference(q, k, v, g, dtype=torch.float32, allowed=allowed, alibi=None,
                           softcap=0, sinks=None, keep=None, dropout_p=0)
    row, d = 256, q.shape[-1]
    assert allowed[row].sum() == 1 and allowed[row, 0]
    assert np.all(same[1][..., row, :] == 0)
    u = np.finfo(np.float32).eps / 2
    gamma = d * u / (1 - d * u)
    terms = np.abs(g[..., row, :].astype(np.float64) * v[..., 0, :]).sum(axis=-1)  # (b, h)
    bound = 2 * gamma * terms[..., None] * np.abs(k[..., 0, :]) / math.sqrt(d) * (1 + 8 * u)
    got = np.abs(dq[..., row, :].astype(np.float64))
    assert np.all(got <= bound)
    assert got.max() > 0


def test_d_is_a_pairwise_sum(monkeypatch):
    """``D = rowsum(dO ∘ O)``, float32, dv = 256, 4096 rows: its RMS error against float64 is at
    most 0.4 of a left-to-right float32 sum's on the same products. NumPy's pairwise sum
    measured 0.32 of it; einsum's loop, the sum before issue 33, 0.52 (and about twice
    pairwise's largest error at dv = 224 and 256)."""
    rng = np.random.default_rng(7)
    q, k = (rng.standard_normal((4096 if n == "q" else 8, 16)).astype(np.float32) for n in "qk")
    v = rng.standard_normal((8, 256)).astype(np.float32)
    dout = rng.standard_normal((4096, 256)).astype(np.float32)
    out, lse = flash_lib.flash_attention(q, k, v, return_lse=True)
    seen = []
    block = flash_lib.attention_backward_block

    def spy(*args, D, **kw):
        seen.append(D)
        return block(*args, D=D, **kw)

    monkeypatch.setattr(flash_lib, "attention_backward_block", spy)
    flash_lib.flash_attention_backward(q, k, v, out, lse, dout)
    product = dout * out  # float32 products, each rounded once: the same in any order of sums
    truth = product.astype(np.float64).sum(axis=-1)
    in_order = np.add.accumulate(product, axis=-1)[..., -1]  # left to right, in float32

    def rms(x):
        return float(np.sqrt(np.mean((x.astype(np.float64) - truth) ** 2)))
    assert rms(seen[0]) <= 0.4 * rms(in_order)

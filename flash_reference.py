"""The dense references: attention and its gradients with the whole ``Nq × Nk`` score matrix.

:func:`naive_attention` and :func:`naive_attention_backward` are the textbook oracles flash_lib's
tiled kernels are tested against; :func:`precise_attention` and
:func:`precise_attention_backward` are the same in more precision than float64, the truth that
errors are measured against. They take the kernels' arguments, checked by the same code
(``_flash_inputs``), and follow the same conventions (the contracts in ``flash_lib``'s
docstring); ``flash_lib`` exports them, so ``from flash_lib import naive_attention`` is the way
to use them.

Beside flash_lib, private to it like its ``_flash_*`` modules (copy them with it). It imports
none of flash_lib's algorithm: only the checks, the tile's score variants and masks
(``_flash_tiles``) and the masked-key product, so that an oracle shares as little as possible
with what it checks.
"""

from __future__ import annotations

import numpy as np

import _flash_inputs as _inputs
import _flash_masked as masked
import _flash_runtime as runtime
import _flash_tiles as tiles

__all__ = ["naive_attention", "precise_attention", "naive_attention_backward",
           "precise_attention_backward"]


def naive_attention(q, k, v, *, mask=None, causal=False, scale=None, return_lse=False,
                    window=None, softcap=None, alibi_slopes=None, enable_gqa=False, mask_mod=None,
                    sinks=None, dropout_p=0.0, dropout_seed=None, dropout_offset=(0, 0)):
    """Textbook attention: the full ``Nq × Nk`` score matrix, then a max-subtracted softmax.

    Same arguments, results and conventions as :func:`flash_attention` (minus the block sizes);
    it is the oracle the tiled kernel is tested against, so it stays as plain as possible. Its
    one matmul uses the BLAS threads the caller has set.
    """
    problem = _inputs.problem(q, k, v, mask=mask, causal=causal, scale=scale, window=window,
                              softcap=softcap, alibi_slopes=alibi_slopes, enable_gqa=enable_gqa,
                              mask_mod=mask_mod, sinks=sinks, dropout_p=dropout_p,
                              dropout_seed=dropout_seed, dropout_offset=dropout_offset)
    out, lse = _dense_attention(problem, problem.dtype)
    out = problem.merge_heads(out.astype(problem.out_dtype, copy=False))
    lse = problem.merge_heads(lse)
    return (out, lse) if return_lse else out


def precise_attention(q, k, v, *, mask=None, causal=False, scale=None, return_lse=False,
                      window=None, softcap=None, alibi_slopes=None, enable_gqa=False,
                      mask_mod=None, sinks=None, dropout_p=0.0,
                      dropout_seed=None, dropout_offset=(0, 0)):
    """Attention in more precision than float64: the truth the other kernels are measured against.

    Same semantics as :func:`naive_attention`; the scale is the float64 number the kernels use,
    so only the kernels' own rounding is measured. Computed in ``np.longdouble`` where that is
    wider than float64 (x86-64: 64-bit mantissa; aarch64 Linux: 113-bit), else with ``mpmath`` at
    40 significant digits, elementwise and slow: meant for small inputs. Returns float64 arrays
    from the mpmath path and longdouble arrays otherwise.
    """
    problem = _inputs.problem(q, k, v, mask=mask, causal=causal, scale=scale, window=window,
                              softcap=softcap, alibi_slopes=alibi_slopes, enable_gqa=enable_gqa,
                              mask_mod=mask_mod, sinks=sinks, dropout_p=dropout_p,
                              dropout_seed=dropout_seed, dropout_offset=dropout_offset)
    if np.finfo(np.longdouble).nmant > np.finfo(np.float64).nmant:
        out, lse = _dense_attention(problem, np.dtype(np.longdouble))
    else:  # pragma: no cover - only where longdouble is float64 (macOS arm64, Windows)
        out, lse = _mpmath_attention(problem)
    out, lse = problem.merge_heads(out), problem.merge_heads(lse)
    return (out, lse) if return_lse else out


def _dense_softmax(problem, dtype, grad=False):
    """The one dense reference: the whole score matrix in ``dtype``, then ``p = exp(s - m)``
    against each row's max ``m``: ``p, m, allowed`` (None: all pairs); with ``grad=True``
    also the scores and softcap's slope (first and last). Naive, precise and the backward's."""
    n_q, n_k = problem.n_q, problem.n_k
    s = tiles.tile_scores(problem, problem.q_tile(0, n_q, dtype), problem.k_tile(0, n_k, dtype),
                0, n_q, 0, n_k, grad=grad)
    s, slope = s if grad else (s, None)
    allowed = _dense_allowed(problem)
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    m = s.max(axis=-1, initial=-np.inf)
    if problem.sinks is not None:  # the sink is one more score of the row
        m = np.maximum(m, problem.sinks.astype(dtype))
    p = np.exp(s - _reference(m)[..., None])
    return (s, p, m, allowed, slope) if grad else (p, m, allowed)


def _denominator(problem, p, m):
    """``Σ_j p_ij``, plus the sink's ``exp(sink - m_i)`` (it takes probability, carries no value)."""
    l = p.sum(axis=-1)
    return l if problem.sinks is None else l + np.exp(problem.sinks.astype(m.dtype) - m)


def _reference(m):
    """The reference point of ``exp(s - m)``: the row max, or 0 for an empty row, whose -inf would
    give -inf - (-inf) = NaN (``flash_lib.online_softmax_update`` does the same)."""
    return np.where(m == -np.inf, 0, m)


@runtime.ieee_quiet()
def _dense_attention(problem, dtype):
    """naive's and precise's forward: :func:`_dense_softmax`, then ``p v / Σ p``."""
    p, m, allowed = _dense_softmax(problem, dtype)
    l = _denominator(problem, p, m)  # the undropped softmax's
    z = _dense_dropout(problem, dtype)
    p = p if z is None else p * z  # P ∘ Z / (1 - p), unnormalised
    v = problem.v_tile(0, problem.n_k, dtype)
    bad = problem.bad_values(0, problem.n_k) if allowed is not None else None
    pv = p @ v if bad is None else masked.matmul_allowed(p, v, allowed=allowed, bad=bad)
    empty = l == 0  # no allowed key: out 0 and lse -inf
    out = pv / np.where(empty, 1, l)[..., None]
    lse = np.full_like(l, -np.inf)
    np.log(l, out=lse, where=~empty)
    lse += m
    return out, lse


def _dense_dropout(problem, dtype):
    """``Z / (1 - p)`` over the whole matrix, from :func:`dropout_keep`'s mask; None without dropout."""
    keep = problem.keep_tile(0, problem.n_q, 0, problem.n_k)
    return None if keep is None else np.multiply(keep, problem.dropout_scale(dtype), dtype=dtype)


def naive_attention_backward(q, k, v, dout, *, mask=None, causal=False, scale=None,
                             window=None, softcap=None, alibi_slopes=None, enable_gqa=False,
                             mask_mod=None, sinks=None, dropout_p=0.0, dropout_seed=None,
                             dropout_offset=(0, 0)):
    """The dense oracle of :func:`flash_attention_backward`: ``P`` whole, then the textbook chain.

    ``P = softmax(S)``, ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P ∘ (dP - rowsum(P ∘ dP))`` (the
    softmax Jacobian applied row by row), ``dQ = τ dS K``, ``dK = τ dSᵀ Q``; the same conventions,
    scale placement, broadcasting and gradient dtypes. It needs no ``out`` or ``lse``, and does
    not use the identity ``rowsum(P ∘ dP) = rowsum(dO ∘ O)`` the tiled kernel rests on.
    """
    problem = _inputs.problem(q, k, v, mask=mask, causal=causal, scale=scale, window=window,
                              softcap=softcap, alibi_slopes=alibi_slopes, enable_gqa=enable_gqa,
                              mask_mod=mask_mod, sinks=sinks, dropout_p=dropout_p,
                              dropout_seed=dropout_seed, dropout_offset=dropout_offset)
    dout = _inputs.check_saved(problem, dout=dout)
    grads = _dense_backward(problem, dout, problem.dtype)
    return problem.input_shapes(*(g.astype(x.dtype, copy=False)
                                  for g, x in zip(grads, (problem.q, problem.k, problem.v)))
                                ) + grads[3:]


def precise_attention_backward(q, k, v, dout, *, mask=None, causal=False, scale=None,
                               window=None, softcap=None, alibi_slopes=None, enable_gqa=False,
                               mask_mod=None, sinks=None, dropout_p=0.0,
                               dropout_seed=None, dropout_offset=(0, 0)):
    """:func:`naive_attention_backward` in ``np.longdouble``: the truth gradients are measured
    against (x86-64 and aarch64 Linux, where longdouble is wider than float64). Returns
    longdouble arrays."""
    problem = _inputs.problem(q, k, v, mask=mask, causal=causal, scale=scale, window=window,
                              softcap=softcap, alibi_slopes=alibi_slopes, enable_gqa=enable_gqa,
                              mask_mod=mask_mod, sinks=sinks, dropout_p=dropout_p,
                              dropout_seed=dropout_seed, dropout_offset=dropout_offset)
    dout = _inputs.check_saved(problem, dout=dout)
    grads = _dense_backward(problem, dout, np.dtype(np.longdouble))
    return problem.input_shapes(*grads[:3]) + grads[3:]


@runtime.ieee_quiet()
def _dense_backward(problem, dout, dtype):
    n_q, n_k = problem.n_q, problem.n_k
    q, k, v = problem.q_tile(0, n_q, dtype), problem.k_tile(0, n_k, dtype), problem.v_tile(0, n_k, dtype)
    dout = dout.astype(dtype)
    # s stays alive as in a textbook backward: chapter 13 counts S, P, dP, dS at the peak
    s, p, m, allowed, slope = _dense_softmax(problem, dtype, grad=True)
    l = _denominator(problem, p, m)
    p /= np.where(l == 0, 1, l)[..., None]  # P = softmax(S); an empty row stays 0
    if allowed is not None:  # and a masked pair weighs exactly 0, in a NaN row too
        p = np.where(allowed, p, 0)
    dp = dout @ np.swapaxes(v, -1, -2)
    if allowed is not None:  # what a masked pair's dP holds must not reach rowsum(P ∘ dP)
        dp = np.where(allowed, dp, 0)
    z = _dense_dropout(problem, dtype)
    if z is not None:  # out = P̃ V with P̃ = P ∘ Z / (1 - p): dP = dP̃ ∘ Z / (1 - p)
        dp = dp * z
    D = (p * dp).sum(axis=-1, keepdims=True)  # the sink's dP is 0: its value is 0
    ds = p * (dp - D)
    if slope is not None:  # the chain rule through softcap
        ds = ds * slope
    tiles.masked_pairs_zero(ds, allowed)

    def matmul(a, b, allowed_for_a, name, x):
        bad = None if allowed is None else problem.nonfinite_rows(name, 0, x.shape[-2], x)
        return a @ b if bad is None else masked.matmul_allowed(a, b, allowed=allowed_for_a, bad=bad)

    allowed_t = None if allowed is None else np.swapaxes(allowed, -1, -2)
    dv = matmul(np.swapaxes(p if z is None else p * z, -1, -2), dout, allowed_t, "dout", dout)
    dq = matmul(ds, k, allowed, "k", problem.k) * dtype.type(problem.scale_q)
    dk = matmul(np.swapaxes(ds, -1, -2), q, allowed_t, "q", problem.q) * dtype.type(problem.scale_k)
    grads = tuple(tiles.sum_to(g, x.shape[:-2] + g.shape[-2:])
                  for g, x in zip((dq, dk, dv), (problem.q, problem.k, problem.v)))
    if problem.sinks is None:
        return grads
    return grads + (problem.dsinks(m + np.log(l), D[..., 0]),)  # lse = m + log l, never -inf


def _dense_allowed(problem):
    """The whole Nq × Nk matrix of allowed pairs, or None when every pair is allowed."""
    allowed = tiles.allowed_pairs(problem, 0, problem.n_q, 0, problem.n_k)
    return np.zeros((problem.n_q, problem.n_k), bool) if allowed is False else allowed


def _mpmath_attention(problem):  # pragma: no cover - see precise_attention
    import mpmath

    mp = mpmath.mp.clone()
    mp.dps = 40
    batch, n_q, n_k = problem.batch, problem.n_q, problem.n_k
    if (problem.softcap is not None or problem.alibi is not None or problem.sinks is not None
            or problem.dropout_p):
        raise NotImplementedError("softcap, ALiBi, sinks and dropout need np.longdouble wider "
                                  "than float64")
    allowed = tiles.allowed_pairs(problem, 0, n_q, 0, n_k)
    allowed = np.broadcast_to(True if allowed is None else allowed, batch + (n_q, n_k))
    q, k, v = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (problem.q, problem.k, problem.v))
    out = np.zeros(batch + (n_q, problem.dv))
    lse = np.full(batch + (n_q,), -np.inf)
    for idx in np.ndindex(*batch, n_q):
        b, i = idx[:-1], idx[-1]
        keys = [j for j in range(n_k) if allowed[b + (i, j)]]
        if not keys:
            continue
        s = [mp.mpf(problem.scale) * mp.fsum(mp.mpf(x) * mp.mpf(y) for x, y in zip(q[b + (i,)], k[b + (j,)]))
             for j in keys]
        mx = max(s)
        w = [mp.exp(x - mx) for x in s]
        total = mp.fsum(w)
        for c in range(problem.dv):
            out[b + (i, c)] = float(mp.fsum(wj * mp.mpf(v[b + (j, c)]) for wj, j in zip(w, keys)) / total)
        lse[b + (i,)] = float(mx + mp.log(total))
    return out, lse

"""Top-k sparse attention: each query attends exactly the keys listed for it (flash_lib exports
:func:`sparse_attention`).

DeepSeek Sparse Attention has a "lightning indexer" pick ``topk`` keys per query; the attention
kernel then gathers those keys and values by index, ``-1`` marking an unused slot (FlashMLA's
sparse kernels, FlashAttention's ``gather_kv_indices``). Nothing here is ``Nq × Nk``: the gathered
keys and values are ``(..., Nq, topk, d)``, the scores ``(..., Nq, topk)``.
"""

from __future__ import annotations

import numpy as np

import _flash_inputs as _inputs
from _flash_runtime import ieee_quiet


def check_indices(indices, batch, n_q, n_k):
    """``indices`` checked against a call of ``batch`` leading dims, ``n_q`` queries and ``n_k``
    keys: an integer array ``(..., n_q, topk)`` whose leading dims broadcast with ``batch``,
    each entry ``-1`` (unused) or in ``[0, n_k)``, no key listed twice in a row. Returns it as
    int64 and the broadcast batch. Raises TypeError/ValueError naming ``indices``."""
    if not hasattr(indices, "dtype") or not hasattr(indices, "shape"):
        indices = np.asarray(indices)
    dtype = np.dtype(indices.dtype)
    if dtype.kind not in "iu":
        raise TypeError(f"indices must be an integer array, got dtype {dtype}")
    shape = tuple(indices.shape)
    if len(shape) < 2 or shape[-2] != n_q:
        raise ValueError(f"indices must have shape (..., Nq={n_q}, topk), got {shape}")
    try:
        out_batch = np.broadcast_shapes(tuple(batch), shape[:-2])
    except ValueError:
        raise ValueError(f"indices' leading dims {shape[:-2]} do not broadcast with the batch "
                         f"dims {tuple(batch)} of q, k, v") from None
    idx = np.asarray(indices).astype(np.int64, copy=False)
    bad = (idx < -1) | (idx >= n_k)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"indices must be -1 (unused) or in [0, Nk={n_k}), got {idx[where]} "
                         f"at {where}")
    ordered = np.sort(idx, axis=-1)
    twice = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if twice.any():
        where = tuple(int(i) for i in np.argwhere(twice)[0])
        raise ValueError(f"indices must list each key at most once per query, got key "
                         f"{ordered[where]} twice in row {where[:-1]}")
    return idx, out_batch


def sparse_attention(q, k, v, indices, *, scale=None, return_lse=False):
    checked = _inputs.check(q, k, v, scale=scale)
    idx, batch = check_indices(indices, checked.batch, checked.n_q, checked.n_k)
    dtype, topk = checked.dtype, idx.shape[-1]
    q, k, v = (np.asarray(x).astype(dtype, copy=False) for x in (q, k, v))
    q = np.broadcast_to(q, batch + q.shape[-2:])
    k = np.broadcast_to(k, batch + k.shape[-2:])
    v = np.broadcast_to(v, batch + v.shape[-2:])
    idx = np.broadcast_to(idx, batch + idx.shape[-2:])
    used = idx >= 0
    flat = np.where(used, idx, 0).reshape(batch + (checked.n_q * topk, 1))
    with ieee_quiet():
        # the listed keys and values: (..., Nq, topk, d); a -1 slot reads key 0, then is masked
        k_g = np.take_along_axis(k, flat, axis=-2).reshape(batch + (checked.n_q, topk, checked.d))
        v_g = np.take_along_axis(v, flat, axis=-2).reshape(batch + (checked.n_q, topk, checked.dv))
        v_g = np.where(used[..., None], v_g, 0)  # an unused slot's value never reaches a row
        s = (q[..., None, :] @ np.swapaxes(k_g, -1, -2))[..., 0, :] * dtype.type(checked.scale)
        s = np.where(used, s, -np.inf)
        m = s.max(axis=-1, initial=-np.inf)
        m_ref = np.where(m == -np.inf, 0, m)  # a row with no key: any finite reference
        p = np.exp(s - m_ref[..., None])
        l = p.sum(axis=-1)
        empty = l == 0
        out = (p[..., None, :] @ v_g)[..., 0, :] / np.where(empty, 1, l)[..., None]
        lse = np.full(l.shape, -np.inf, dtype)
        np.log(l, out=lse, where=~empty)
        lse += m_ref
    out = out.astype(checked.out_dtype, copy=False)
    return (out, lse) if return_lse else out

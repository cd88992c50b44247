"""Multi-head latent attention (MLA; DeepSeek-V2 §2.1, DeepSeek-V3; FlashMLA), on flash_lib.

Each token caches one latent vector ``c_kv`` (rank ``r``, 512 in DeepSeek-V3) and one RoPE key
``k_rope`` (64 dims) shared by all heads. Head ``h``'s key is ``[c_kv W_uk[h], k_rope]`` and its
value ``c_kv W_uv[h]``. Since ``q_nope · (c W_uk[h]) = (q_nope W_uk[h]ᵀ) · c``, decoding can
"absorb" ``W_uk`` into the query and ``W_uv`` into the output: attention then runs on the latent
cache itself, ``d_qk = r + d_rope`` (576), ``d_v = r`` (512), every head sharing the one K/V (GQA
with one group), which is what FlashMLA computes.

This module names no private attribute of flash_lib.
"""

from __future__ import annotations

import math

import numpy as np

import flash_lib

__all__ = ["mla_attention", "kv_cache_elements_per_token"]


def _shape_error(name, arr, expected):
    return ValueError(f"{name} must have shape {expected}, got {tuple(np.shape(arr))}")


def _checked(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):
    """The shapes, checked against one another: ``(H, d_nope, d_rope, r, dv)``."""
    for name, arr, ndim in (("q_nope", q_nope, 3), ("q_rope", q_rope, 3), ("c_kv", c_kv, 2),
                            ("k_rope", k_rope, 2), ("w_uk", w_uk, 3), ("w_uv", w_uv, 3)):
        if not hasattr(arr, "shape") or len(arr.shape) < ndim:
            raise ValueError(f"{name} must be an array with at least {ndim} dims, got "
                             f"{type(arr).__name__} of shape {tuple(np.shape(arr))}")
    heads, n_q, d_nope = q_nope.shape[-3:]
    r, n_k = c_kv.shape[-1], c_kv.shape[-2]
    d_rope = q_rope.shape[-1]
    if tuple(q_rope.shape[-3:-1]) != (heads, n_q):
        raise _shape_error("q_rope", q_rope, f"(..., H={heads}, Nq={n_q}, d_rope)")
    if tuple(k_rope.shape[-2:]) != (n_k, d_rope):
        raise _shape_error("k_rope", k_rope, f"(..., Nk={n_k}, d_rope={d_rope})")
    if w_uk.ndim != 3 or tuple(w_uk.shape) != (heads, r, d_nope):
        raise _shape_error("w_uk", w_uk, f"(H={heads}, r={r}, d_nope={d_nope})")
    if w_uv.ndim != 3 or tuple(w_uv.shape[:2]) != (heads, r):
        raise _shape_error("w_uv", w_uv, f"(H={heads}, r={r}, dv)")
    return heads, d_nope, d_rope, r, w_uv.shape[-1]


def mla_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, *, causal=False, absorbed=True):
    """Multi-head latent attention, ``out (..., H, Nq, dv)``.

    q_nope ``(..., H, Nq, d_nope)``, q_rope ``(..., H, Nq, d_rope)``: each head's query, its
    position-free and its RoPE part. c_kv ``(..., Nk, r)``: the latent cache; k_rope
    ``(..., Nk, d_rope)``: the RoPE key, shared by the heads. w_uk ``(H, r, d_nope)``,
    w_uv ``(H, r, dv)``: the up-projections. Scale ``1/√(d_nope + d_rope)`` (the per-head key's
    size), causal bottom-right as flash_lib's.

    ``absorbed=False``: each head's keys ``[c_kv W_uk[h], k_rope]`` and values ``c_kv W_uv[h]``
    are materialised, ``H · Nk · (d_nope + d_rope + dv)`` numbers, and attended by
    :func:`flash_lib.flash_attention`. ``absorbed=True``: the queries become
    ``[q_nope W_uk[h]ᵀ, q_rope]``, one flash_lib call attends the latent cache
    ``[c_kv, k_rope]`` / ``c_kv`` (one kv head for all H), and its output is projected by
    ``W_uv[h]``. The same real number; only rounding differs.
    """
    heads, d_nope, d_rope, r, dv = _checked(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv)
    scale = 1.0 / math.sqrt(d_nope + d_rope)
    c_kv, k_rope = np.asarray(c_kv), np.asarray(k_rope)
    if absorbed:
        q_lat = q_nope @ np.swapaxes(w_uk, -1, -2)  # (..., H, Nq, r)
        q = np.concatenate([q_lat, np.broadcast_to(q_rope, q_lat.shape[:-1] + (d_rope,))], -1)
        latent = np.concatenate([c_kv, np.broadcast_to(k_rope, c_kv.shape[:-1] + (d_rope,))], -1)
        k = latent[..., None, :, :]  # (..., 1, Nk, r + d_rope): one kv head
        v = c_kv[..., None, :, :]  # (..., 1, Nk, r), the first r columns of k in FlashMLA
        flash_lib.check_inputs(q, k, v, causal=causal, scale=scale, enable_gqa=True)
        out_lat = flash_lib.flash_attention(q, k, v, causal=causal, scale=scale, enable_gqa=True)
        return out_lat @ w_uv  # (..., H, Nq, r) @ (H, r, dv)
    c = c_kv[..., None, :, :]  # (..., 1, Nk, r)
    k_nope = c @ w_uk  # (..., H, Nk, d_nope)
    k = np.concatenate([k_nope, np.broadcast_to(k_rope[..., None, :, :],
                                                k_nope.shape[:-1] + (d_rope,))], -1)
    q = np.concatenate([q_nope, np.broadcast_to(q_rope, q_nope.shape[:-1] + (d_rope,))], -1)
    v = c @ w_uv  # (..., H, Nk, dv)
    flash_lib.check_inputs(q, k, v, causal=causal, scale=scale)
    return flash_lib.flash_attention(q, k, v, causal=causal, scale=scale)


def kv_cache_elements_per_token(kind, *, heads, d_head, kv_heads=None, r=512, d_rope=64,
                                dv=None):
    """Numbers cached per token per layer: ``"mha"`` ``heads · (d_head + dv)``; ``"gqa"``
    ``kv_heads · (d_head + dv)``; ``"mla"`` ``r + d_rope`` (the latent and the shared RoPE key;
    FlashMLA's 576). ``dv`` defaults to ``d_head``."""
    dv = d_head if dv is None else dv
    if kind == "mha":
        return heads * (d_head + dv)
    if kind == "gqa":
        if kv_heads is None or heads % kv_heads:
            raise ValueError(f"kv_heads must divide heads={heads}, got {kv_heads!r}")
        return kv_heads * (d_head + dv)
    if kind == "mla":
        return r + d_rope
    raise ValueError(f"kind must be 'mha', 'gqa' or 'mla', got {kind!r}")

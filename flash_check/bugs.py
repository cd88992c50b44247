"""The bug zoo: small tiled attention kernels, each able to make one classic mistake on request.

Imported by ``tests/test_check.py`` (every bug must fail with its cause named) and printed by
chapter 20 with ``inspect.getsource``, as chapters 5 and 12 print theirs; flash_check itself does
not use it. Written from FlashAttention's conventions, independently of flash_lib, so that a
kernel passing the cases is evidence about the cases and not about flash_lib's code.

- :func:`tiled_attention` is FlashAttention's forward pass over block × block tiles, returning
  ``(out, lse)``; ``bug=`` one of :data:`BUGS` changes one line of it.
- :func:`variant_attention` adds the variants (window, softcap, ALiBi, GQA, mask_mod); ``bug=``
  one of :data:`VARIANT_BUGS` gets one of them wrong the way real kernels do.

Both are plain Python loops over tiles: small inputs only.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BUGS", "VARIANT_BUGS", "tiled_attention", "variant_attention"]

#: The classic bugs of :func:`tiled_attention`: name -> what the kernel then does.
BUGS = {
    "missing_rescale": "l and acc are not multiplied by alpha = exp(m - m') when the max rises",
    "nan_empty_rows": "no guard for a running max of -inf: exp(-inf - (-inf)) = NaN",
    "quadratic_memory": "one tile as large as the whole score matrix",
    "top_left": "key j allowed iff j <= i, whatever Nq and Nk",
    "lse_base2": "the lse of an exp2-based kernel, returned without the factor ln 2",
    "drop_partial_block": "the key loop stops at the last multiple of the block size",
    "float16_accumulation": "float16 inputs computed in float16 throughout",
    "uniform_empty_rows": "masked scores set to -1e9 instead of -inf",
    "stale_max": "p = exp(s - m) against the previous block's max",
}

#: The variants' bugs of :func:`variant_attention`: name -> what the kernel then does.
VARIANT_BUGS = {
    "window_left_off_by_one": "the window's left edge is exclusive: keys > i + (Nk - Nq) - left",
    "window_top_left": "the window is centred on j = i, not on j = i + (Nk - Nq)",
    "softcap_after_mask": "softcap applied after the mask: masked scores become -c, not -inf",
    "softcap_after_bias": "softcap applied after the ALiBi bias, not before it",
    "alibi_gym_form": "ALiBi as slope·(j - i) (attention-gym's score_mod), right only under causal",
    "alibi_top_left": "ALiBi's distance |i - j|, not |i + (Nk - Nq) - j|",
    "gqa_h_mod_hkv": "query head h reads kv head h mod Hkv, not h // (Hq / Hkv)",
    "mask_mod_inverted": "mask_mod's True taken as masked out",
    "mask_mod_swapped": "mask_mod called as mask_mod(k_idx, q_idx)",
    "mask_mod_corner_skip": "a tile skipped when mask_mod is False at its four corners",
    "mask_mod_local_indices": "mask_mod called with positions local to the tile",
}


def _check_bug(bug, known):
    if bug is not None and bug not in known:
        raise ValueError(f"bug must be None or one of {list(known)}, got {bug!r}")


def tiled_attention(q, k, v, *, mask=None, causal=False, scale=None, bug=None, block=16):
    """FlashAttention's forward pass over block x block tiles; returns (out, lse)."""
    _check_bug(bug, BUGS)
    n_q, n_k = q.shape[-2], k.shape[-2]
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    acc = np.float32 if q.dtype == np.float16 else q.dtype
    if bug == "float16_accumulation":
        acc = q.dtype
    if bug == "quadratic_memory":
        block = max(n_q, n_k, 1)
    batch = np.broadcast_shapes(q.shape[:-2], () if mask is None else np.shape(mask)[:-2])
    if mask is not None:
        mask = np.broadcast_to(mask, np.shape(mask)[:-2] + (n_q, n_k))
    out = np.zeros(batch + (n_q, v.shape[-1]), q.dtype)
    lse = np.full(batch + (n_q,), -np.inf, np.float32 if q.dtype == np.float16 else q.dtype)
    offset = 0 if bug == "top_left" else n_k - n_q  # query i sits at position i + offset
    key_end = n_k - n_k % block if bug == "drop_partial_block" else n_k
    for qs in range(0, n_q, block):
        qe = min(qs + block, n_q)
        m = np.full(batch + (qe - qs,), -np.inf, acc)  # running max
        l = np.zeros_like(m)  # running sum of exp(s - m)
        o = np.zeros(batch + (qe - qs, v.shape[-1]), acc)  # running sum of exp(s - m) v
        for ks in range(0, key_end, block):
            ke = min(ks + block, n_k)
            s = q[..., qs:qe, :].astype(acc) @ np.swapaxes(k[..., ks:ke, :], -1, -2).astype(acc)
            s = s * np.asarray(scale, acc)
            allowed = np.ones(s.shape[-2:], bool)
            if mask is not None:
                allowed = allowed & mask[..., qs:qe, ks:ke]
            if causal:
                allowed = allowed & (np.arange(ks, ke) <= np.arange(qs, qe)[:, None] + offset)
            masked = -1e9 if bug == "uniform_empty_rows" else -np.inf
            s = np.where(allowed, s, np.asarray(masked, acc))
            m_new = np.maximum(m, s.max(axis=-1))
            m_ref = np.where(m_new == -np.inf, 0, m_new)  # the guard: a finite reference
            if bug == "nan_empty_rows":
                m_ref = m_new
            p_ref = m_ref
            if bug == "stale_max":
                p_ref = np.where(m == -np.inf, 0, m)
            p = np.exp(s - p_ref[..., None])
            alpha = np.exp(m - m_ref)  # moves l and o from the old max to the new one
            if bug == "missing_rescale":
                alpha = np.ones_like(m)
            # Keys no query of the tile may attend (a KV cache's padding) have their values
            # zeroed: 0 · NaN = NaN in P·V, and padding may hold garbage.
            v_blk = np.where(allowed.any(axis=-2)[..., None], v[..., ks:ke, :], 0).astype(acc)
            l = l * alpha + p.sum(axis=-1)
            o = o * alpha[..., None] + p @ v_blk
            m = m_new
        empty = (l == 0) & (bug != "nan_empty_rows")
        out[..., qs:qe, :] = o / np.where(empty, 1, l)[..., None]
        lse[..., qs:qe] = np.where(empty, -np.inf, m + np.log(np.where(empty, 1, l)))
    if bug == "lse_base2":
        lse = lse * np.log2(np.e)
    return out, lse


def variant_attention(q, k, v, *, mask=None, causal=False, scale=None, window=None, softcap=None,
                      alibi_slopes=None, enable_gqa=False, mask_mod=None, block=16, bug=None):
    """The variants, tiled like a GPU kernel, written from FlashAttention's conventions; returns
    (out, lse). Unlike :func:`tiled_attention` it does not zero the values of masked keys."""
    _check_bug(bug, VARIANT_BUGS)
    acc = np.float32 if q.dtype == np.float16 else q.dtype.type
    n_q, n_k = q.shape[-2], k.shape[-2]
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    if enable_gqa:  # a gather per query head (a real kernel indexes instead of copying)
        heads = np.arange(q.shape[-3])
        groups = q.shape[-3] // k.shape[-3]
        kv_head = heads % k.shape[-3] if bug == "gqa_h_mod_hkv" else heads // groups
        k, v = k[..., kv_head, :, :], v[..., kv_head, :, :]
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2],
                                () if mask is None else np.shape(mask)[:-2])
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, acc)[..., None, None]
    offset = n_k - n_q
    window_offset = 0 if bug == "window_top_left" else offset
    out = np.zeros(batch + (n_q, v.shape[-1]), acc)
    lse = np.full(batch + (n_q,), -np.inf, acc)

    def cap(x):
        return acc(softcap) * np.tanh(x / acc(softcap))

    for qs in range(0, n_q, block):
        qe = min(qs + block, n_q)
        i = np.arange(qs, qe)[:, None]
        m = np.full(batch + (qe - qs,), -np.inf, acc)
        l = np.zeros_like(m)
        o = np.zeros(batch + (qe - qs, v.shape[-1]), acc)
        for ks in range(0, n_k, block):
            ke = min(ks + block, n_k)
            j = np.arange(ks, ke)[None, :]
            ok = np.ones((qe - qs, ke - ks), bool)
            if mask_mod is not None:
                if bug == "mask_mod_corner_skip":  # looks at the tile's corners only
                    corners = np.asarray(mask_mod(np.array([[qs], [qe - 1]]),
                                                  np.array([[ks, ke - 1]])))
                    if not corners.any():
                        continue
                a, b = (i - qs, j - ks) if bug == "mask_mod_local_indices" else (i, j)
                mod = np.asarray(mask_mod(b, a) if bug == "mask_mod_swapped" else mask_mod(a, b))
                mod = ~mod if bug == "mask_mod_inverted" else mod
                if not mod.any():  # no pair allowed: the tile is never multiplied
                    continue
                ok = ok & mod
            if mask is not None:
                ok = ok & np.broadcast_to(mask, np.shape(mask)[:-2] + (n_q, n_k))[..., qs:qe, ks:ke]
            if causal:
                ok = ok & (j <= i + offset)
            if window is not None:
                left, right = window
                if left is not None:
                    first = i + window_offset - left
                    ok = ok & ((j > first) if bug == "window_left_off_by_one" else (j >= first))
                if right is not None:
                    ok = ok & (j <= i + window_offset + right)
            s = (q[..., qs:qe, :].astype(acc) @ np.swapaxes(k[..., ks:ke, :], -1, -2).astype(acc)
                 * acc(scale))
            if softcap is not None and bug not in ("softcap_after_mask", "softcap_after_bias"):
                s = cap(s)
            if slopes is not None:
                if bug == "alibi_gym_form":
                    s = s + slopes * (j - i)
                elif bug == "alibi_top_left":
                    s = s - slopes * np.abs(i - j)
                else:
                    s = s - slopes * np.abs(i + offset - j)
            if softcap is not None and bug == "softcap_after_bias":
                s = cap(s)
            s = np.where(ok, s, -np.inf)
            if softcap is not None and bug == "softcap_after_mask":
                s = cap(s)
            m_new = np.maximum(m, s.max(axis=-1))
            m_ref = np.where(m_new == -np.inf, 0, m_new)
            p = np.exp(s - m_ref[..., None])
            alpha = np.exp(m - m_ref)
            l = alpha * l + p.sum(axis=-1)
            o = alpha[..., None] * o + p @ v[..., ks:ke, :].astype(acc)
            m = m_new
        empty = l == 0
        out[..., qs:qe, :] = o / np.where(empty, 1, l)[..., None]
        lse[..., qs:qe] = np.where(empty, -np.inf, m + np.log(np.where(empty, 1, l)))
    return out.astype(q.dtype), lse.astype(np.float32 if q.dtype == np.float16 else q.dtype)

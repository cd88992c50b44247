"""The bug zoo: small tiled attention kernels, each able to make one classic mistake on request.

Imported by ``tests/test_check.py`` (every bug must fail with its cause named) and printed by
chapter 23 with ``inspect.getsource``, as chapters 5 and 12 print theirs; flash_check itself does
not use it. Written from FlashAttention's conventions, independently of flash_lib, so that a
kernel passing the cases is evidence about the cases and not about flash_lib's code.

- :func:`tiled_attention` is FlashAttention's forward pass over block × block tiles, returning
  ``(out, lse)``; ``bug=`` one of :data:`BUGS` changes one line of it. Its P·V runs over the
  allowed pairs only (:func:`allowed_matmul`): a masked pair's weight is 0, but ``0 · NaN`` is
  NaN, and a KV cache's unused slots may hold anything.
- :func:`variant_attention` adds the variants (window, softcap, ALiBi, GQA, mask_mod, attention
  sinks, dropout); ``bug=`` one of :data:`VARIANT_BUGS` gets one of them wrong the way real
  kernels do. :func:`variant_attention_backward` is its backward (masks, causal, sinks, dropout),
  with the bugs of :data:`VARIANT_BUGS` that belong to a backward. Each of these bugs is one row
  of a table: the steps of the kernel it replaces (``_VARIANT_ZOO``).

All are plain Python loops over tiles: small inputs only. The dropout mask here comes from a
generator of its own (SplitMix64's finaliser applied to the seed, the batch index and the global
positions), not flash_lib's Philox: by default flash_check holds a kernel to what dropout must be
(a keep rate of 1 - p, independent elements, the same mask whatever the tiles, a backward that
regenerates it), not to one library's random numbers, and this kernel passes; it fails, as it
should, when checked with ``dropout_generator="flash_lib"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

__all__ = ["BUGS", "VARIANT_BUGS", "BACKWARD_BUGS", "tiled_attention", "variant_attention",
           "variant_attention_backward", "counter_keep", "allowed_matmul"]

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
    "garbage_per_tile": "P·V zeroes the v of keys no row of the tile may attend and multiplies "
                        "the rest, as flash_triton's forward did",
    "garbage_past_diagonal": "P·V leaves out the pairs the mask hides, not those past the causal "
                             "diagonal",
}

def _check_bug(bug, known):
    if bug is not None and bug not in known:
        raise ValueError(f"bug must be None or one of {list(known)}, got {bug!r}")


def allowed_matmul(a, b, allowed):
    """``a @ b`` over the allowed pairs only: ``a`` (..., rows, keys) weighs each pair (exactly 0
    where it is not allowed), ``b`` (..., keys, c) holds a row per key. IEEE arithmetic makes
    ``0 · inf`` and ``0 · NaN`` NaN, so the keys whose row of ``b`` holds inf or NaN (garbage in
    a KV cache's unused slots) are left out of the matmul and added pair by pair, where allowed."""
    bad = ~np.isfinite(b).all(axis=-1)
    bad = bad.reshape(-1, bad.shape[-1]).any(axis=0)  # the keys with garbage in any batch element
    out = a @ np.where(bad[:, None], 0, b)
    if bad.any():
        with np.errstate(invalid="ignore"):  # 0 · inf at the masked pairs, dropped by the where
            terms = a[..., bad, None] * b[..., bad, :][..., None, :, :]
        ok = np.broadcast_to(allowed, a.shape)[..., bad, None]
        out = out + np.where(ok, terms, 0).sum(axis=-2)
    return out


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
            unmasked = allowed  # the pairs the mask allows (causal aside)
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
            # A masked pair's p is 0, but 0 · NaN = NaN in P·V, and a KV cache's unused slots
            # may hold garbage: P·V over the allowed pairs only.
            v_blk = v[..., ks:ke, :].astype(acc)
            if bug == "garbage_per_tile":
                pv = p @ np.where(allowed.any(axis=-2)[..., None], v_blk, 0)
            else:
                pv = allowed_matmul(p, v_blk, unmasked if bug == "garbage_past_diagonal"
                                    else allowed)
            l = l * alpha + p.sum(axis=-1)
            o = o * alpha[..., None] + pv
            m = m_new
        empty = (l == 0) & (bug != "nan_empty_rows")
        out[..., qs:qe, :] = o / np.where(empty, 1, l)[..., None]
        lse[..., qs:qe] = np.where(empty, -np.inf, m + np.log(np.where(empty, 1, l)))
    if bug == "lse_base2":
        lse = lse * np.log2(np.e)
    return out, lse


def counter_keep(seed, p, b, i, j):
    """The keep mask of element (b, i, j) (batch index, global query and key positions, arrays
    that broadcast): a function of the seed and the element alone, so the same whatever the
    tiles. SplitMix64's finaliser, chained over (seed, b, i, j); kept iff its top 53 bits, as a
    fraction of 2**53, are >= p."""
    def mix(x):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))

    with np.errstate(over="ignore"):
        h = mix(np.asarray(seed, np.uint64) ^ np.asarray(b, np.uint64))
        h = mix(h ^ np.asarray(i, np.uint64))
        h = mix(h ^ np.asarray(j, np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) * 2.0 ** -53 >= p


def _batch_index(batch):
    """The flat C-order index of each batch element, shaped to broadcast over (rows, keys)."""
    return np.arange(int(np.prod(batch, dtype=np.int64))).reshape(batch + (1, 1))


# --------------------------------------------------------------------------------------------
# The variants' kernel: its steps, and the bugs that replace them
# --------------------------------------------------------------------------------------------


def _counter_mask(dropout, batch, i, j):
    """A tile's keep mask, :func:`counter_keep` at its pairs' global positions (i, j): the same
    whatever the tiles and the order they are visited in."""
    p, seed, _, _ = dropout
    return counter_keep(seed, p, _batch_index(batch), i, j)


def _stateful_mask(dropout, batch, i, j):
    """The next numbers of one generator seeded once per call: a mask that depends on the tiles
    and on the order they are visited in."""
    p, _, _, state = dropout
    return state.random(batch + (i.shape[0], j.shape[1])) >= p


def _swapped_mask(dropout, batch, i, j):
    """The counter with the positions swapped, (b, j, i): another mask than the forward's."""
    p, seed, _, _ = dropout
    return counter_keep(seed, p, _batch_index(batch), j, i)


def _mask_mod_pairs(mask_mod, i, j):
    """mask_mod on the tile's global positions: True = may attend."""
    return np.asarray(mask_mod(i, j))


def _corners_only(mask_mod, i, j):
    """mask_mod's pairs, or none (the tile skipped) where it is False at the tile's 4 corners."""
    corners = np.asarray(mask_mod(i[[0, -1]], j[:, [0, -1]]))
    return _mask_mod_pairs(mask_mod, i, j) if corners.any() else np.zeros((i.size, j.size), bool)


@dataclasses.dataclass(frozen=True)
class _Steps:
    """The steps of :func:`variant_attention` and its backward that a bug replaces, each as
    FlashAttention takes it: ``_Steps()`` is the right kernel, a bug one or two steps changed."""

    #: GQA: query head h of Hq reads kv head h // (Hq / Hkv), a group of consecutive heads
    kv_head: Callable = lambda h, h_q, h_kv: h // (h_q // h_kv)
    #: the window is centred on key i + offset (offset = Nk - Nq: aligned bottom-right)
    window_offset: Callable = lambda offset: offset
    #: the window's left edge is inclusive: key j >= first = i + offset - left
    window_left: Callable = lambda j, first: j >= first
    #: mask_mod's pairs of a tile: on global positions, True = may attend
    mask_mod_pairs: Callable = _mask_mod_pairs
    #: softcap on the scaled "scores", not after the ALiBi bias ("biased") or the mask ("masked")
    cap_at: str = "scores"
    #: ALiBi: s - slope·|i + offset - j|
    alibi: Callable = lambda s, slopes, i, j, offset: s - slopes * np.abs(i + offset - j)
    #: the key ranges each started from a fresh state (the sink's) and merged: all keys in one
    splits: Callable = lambda n_k: [(0, n_k)]
    #: dropout's kept weights are divided by 1 - p
    rescale: Callable = lambda p: 1 / (1 - p)
    #: the keep mask of a tile, in the forward and in the backward: the same, from the counter
    keep: Callable = _counter_mask
    backward_keep: Callable = _counter_mask
    #: dsinks_h = -Σ_i exp(sink_h - lse_i)·D_i, from share = Σ_i exp(sink_h - lse_i)·D_i
    dsinks: Callable = lambda share: -share
    #: the backward's dS = P∘(dP - D), 0 at the masked pairs (where dP may be 0 · NaN)
    dscores: Callable = lambda p, dp, D, ok: np.where(ok, p * (dp - D), 0)
    #: the backward's share of dQ, dS·K over the allowed pairs (a masked key's k may be NaN)
    dq_share: Callable = lambda ds, k, ok: allowed_matmul(ds, k, ok)


_RIGHT = _Steps()


def _bug(what, **steps):
    """One bug of the zoo: what the kernel then does, and its steps (``steps`` replaced)."""
    return what, dataclasses.replace(_RIGHT, **steps)


#: The variants' bugs, one row each: name -> (what the kernel then does, its steps).
_VARIANT_ZOO = {
    "window_left_off_by_one": _bug(
        "the window's left edge is exclusive: keys > i + (Nk - Nq) - left",
        window_left=lambda j, first: j > first),
    "window_top_left": _bug(
        "the window is centred on j = i, not on j = i + (Nk - Nq)",
        window_offset=lambda offset: 0),
    "softcap_after_mask": _bug(
        "softcap applied after the mask: masked scores become -c, not -inf", cap_at="masked"),
    "softcap_after_bias": _bug(
        "softcap applied after the ALiBi bias, not before it", cap_at="biased"),
    "alibi_gym_form": _bug(
        "ALiBi as slope·(j - i) (attention-gym's score_mod), right only under causal",
        alibi=lambda s, slopes, i, j, offset: s + slopes * (j - i)),
    "alibi_top_left": _bug(
        "ALiBi's distance |i - j|, not |i + (Nk - Nq) - j|",
        alibi=lambda s, slopes, i, j, offset: s - slopes * np.abs(i - j)),
    "gqa_h_mod_hkv": _bug(
        "query head h reads kv head h mod Hkv, not h // (Hq / Hkv)",
        kv_head=lambda h, h_q, h_kv: h % h_kv),
    "mask_mod_inverted": _bug(
        "mask_mod's True taken as masked out",
        mask_mod_pairs=lambda mask_mod, i, j: ~_mask_mod_pairs(mask_mod, i, j)),
    "mask_mod_swapped": _bug(
        "mask_mod called as mask_mod(k_idx, q_idx)",
        mask_mod_pairs=lambda mask_mod, i, j: _mask_mod_pairs(mask_mod, j, i)),
    "mask_mod_corner_skip": _bug(
        "a tile skipped when mask_mod is False at its four corners",
        mask_mod_pairs=_corners_only),
    "mask_mod_local_indices": _bug(
        "mask_mod called with positions local to the tile",
        mask_mod_pairs=lambda mask_mod, i, j: _mask_mod_pairs(mask_mod, i - i[0, 0],
                                                              j - j[0, 0])),
    "dropout_stateful_tiles": _bug(
        "each tile's keep mask drawn, in visiting order, from one stateful generator seeded once "
        "per call", keep=_stateful_mask, backward_keep=_stateful_mask),
    "dropout_backward_other_mask": _bug(
        "the backward regenerates the mask with i and j swapped in the counter: another mask "
        "than the forward's", backward_keep=_swapped_mask),
    "dropout_no_rescale": _bug(
        "kept weights not divided by 1 - p", rescale=lambda p: 1),
    "sink_counted_twice": _bug(
        "split-KV over two halves of the keys, each started from the sink, then merged: the "
        "sink counted twice", splits=lambda n_k: [(0, n_k // 2), (n_k // 2, n_k)]),
    "dsinks_sign": _bug(
        "the backward returns +sum exp(sink - lse) D for dsinks, not minus",
        dsinks=lambda share: share),
    "garbage_ds_unmasked": _bug(
        "the backward's dS = P∘(dP - D) not set to 0 at masked pairs, where dP = dO·Vᵀ is NaN at "
        "a key whose v holds garbage, as flash_triton's backward did",
        dscores=lambda p, dp, D, ok: p * (dp - D)),
    "garbage_k_in_dq": _bug(
        "the backward's dQ = dS·K multiplies every key of a tile, a masked key's NaN in k "
        "by its dS = 0 included", dq_share=lambda ds, k, ok: ds @ k),
}
#: The variants' bugs of :func:`variant_attention`: name -> what the kernel then does.
VARIANT_BUGS = {name: what for name, (what, _) in _VARIANT_ZOO.items()}
#: The bugs of :data:`VARIANT_BUGS` that only :func:`variant_attention_backward` makes (the
#: forward makes the others; "dropout_stateful_tiles" both, each in its own visiting order).
BACKWARD_BUGS = ("dropout_backward_other_mask", "dsinks_sign", "garbage_ds_unmasked",
                 "garbage_k_in_dq")


def _steps(bug):
    """The steps of the kernel that makes ``bug`` (None: the right one)."""
    _check_bug(bug, VARIANT_BUGS)
    return _RIGHT if bug is None else _VARIANT_ZOO[bug][1]


def _keep_tile(dropout, batch, qs, qe, ks, ke, draw):
    """The keep mask of one tile, (*batch, qe - qs, ke - ks), drawn by ``draw`` (the step
    ``keep`` or ``backward_keep``) at the tile's global positions, or None without dropout."""
    if dropout is None:
        return None
    _, _, (oq, ok), _ = dropout
    i, j = np.arange(oq + qs, oq + qe)[:, None], np.arange(ok + ks, ok + ke)[None, :]
    return draw(dropout, batch, i, j)


def _dropout_state(dropout_p, dropout_seed, dropout_offset):
    if not dropout_p:
        return None
    return (dropout_p, dropout_seed, tuple(dropout_offset), np.random.default_rng(dropout_seed))


def variant_attention(q, k, v, *, mask=None, causal=False, scale=None, window=None, softcap=None,
                      alibi_slopes=None, enable_gqa=False, mask_mod=None, sinks=None,
                      dropout_p=0.0, dropout_seed=None, dropout_offset=(0, 0), block_q=16,
                      block_k=16, bug=None):
    """The variants, tiled like a GPU kernel, written from FlashAttention's conventions; returns
    (out, lse). P·V runs over the allowed pairs only (:func:`allowed_matmul`), so garbage in v at
    a key reaches exactly the rows allowed to attend it.

    A sink starts each row's state at ``m = sink, l = 1, acc = 0`` (one more key, of score
    ``sink`` and value 0). Dropout multiplies each tile's weights by its keep mask / (1 - p) in
    ``acc`` only, so that ``l`` and the lse stay the undropped ones (FlashAttention's)."""
    steps = _steps(bug)  # a backward's bug leaves the forward's steps right
    acc = np.float32 if q.dtype == np.float16 else q.dtype.type
    n_q, n_k = q.shape[-2], k.shape[-2]
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    if enable_gqa:  # a gather per query head (a real kernel indexes instead of copying)
        kv_head = steps.kv_head(np.arange(q.shape[-3]), q.shape[-3], k.shape[-3])
        k, v = k[..., kv_head, :, :], v[..., kv_head, :, :]
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2],
                                () if mask is None else np.shape(mask)[:-2])
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, acc)[..., None, None]
    offset = n_k - n_q
    window_offset = steps.window_offset(offset)
    out = np.zeros(batch + (n_q, v.shape[-1]), acc)
    lse = np.full(batch + (n_q,), -np.inf, acc)
    sink = None if sinks is None else np.broadcast_to(np.asarray(sinks, acc), batch)[..., None]
    dropout = _dropout_state(dropout_p, dropout_seed, dropout_offset)
    rescale = acc(steps.rescale(dropout_p))
    # The keys in splits, each from a fresh state: one split, unless the bug is flash-decoding's
    # split-KV with the sink in every split's start.
    splits = steps.splits(n_k)

    def cap(x):
        return acc(softcap) * np.tanh(x / acc(softcap))

    for qs in range(0, n_q, block_q):
        qe = min(qs + block_q, n_q)
        i = np.arange(qs, qe)[:, None]
        states = []
        for key_start, key_stop in splits:
            m = np.full(batch + (qe - qs,), -np.inf, acc)
            l = np.zeros_like(m)
            if sink is not None:  # the sink: one more key, of score sink and value 0
                m, l = np.broadcast_to(sink, m.shape).copy(), np.ones_like(m)
            o = np.zeros(batch + (qe - qs, v.shape[-1]), acc)
            for ks in range(key_start, key_stop, block_k):
                ke = min(ks + block_k, key_stop)
                j = np.arange(ks, ke)[None, :]
                ok = np.ones((qe - qs, ke - ks), bool)
                if mask_mod is not None:
                    mod = steps.mask_mod_pairs(mask_mod, i, j)
                    if not mod.any():  # no pair allowed: the tile is never multiplied
                        continue
                    ok = ok & mod
                if mask is not None:
                    ok = ok & np.broadcast_to(mask, np.shape(mask)[:-2] + (n_q, n_k))[
                        ..., qs:qe, ks:ke]
                if causal:
                    ok = ok & (j <= i + offset)
                if window is not None:
                    left, right = window
                    if left is not None:
                        ok = ok & steps.window_left(j, i + window_offset - left)
                    if right is not None:
                        ok = ok & (j <= i + window_offset + right)
                s = (q[..., qs:qe, :].astype(acc)
                     @ np.swapaxes(k[..., ks:ke, :], -1, -2).astype(acc) * acc(scale))
                # softcap where the steps put it: on the scaled scores (right), or after the bias
                # or the mask
                if softcap is not None and steps.cap_at == "scores":
                    s = cap(s)
                if slopes is not None:
                    s = steps.alibi(s, slopes, i, j, offset)
                if softcap is not None and steps.cap_at == "biased":
                    s = cap(s)
                s = np.where(ok, s, -np.inf)
                if softcap is not None and steps.cap_at == "masked":
                    s = cap(s)
                m_new = np.maximum(m, s.max(axis=-1))
                m_ref = np.where(m_new == -np.inf, 0, m_new)
                p = np.exp(s - m_ref[..., None])
                alpha = np.exp(m - m_ref)
                l = alpha * l + p.sum(axis=-1)  # undropped: the softmax's own denominator
                keep = _keep_tile(dropout, batch, qs, qe, ks, ke, steps.keep)
                if keep is not None:
                    p = np.where(keep, p * rescale, 0)
                o = alpha[..., None] * o + allowed_matmul(p, v[..., ks:ke, :].astype(acc), ok)
                m = m_new
            states.append((m, l, o))
        m, l, o = states[0]
        for m2, l2, o2 in states[1:]:  # the splits merged by their maxima (split-KV)
            m_new = np.maximum(m, m2)
            m_ref = np.where(m_new == -np.inf, 0, m_new)
            a, a2 = np.exp(m - m_ref), np.exp(m2 - m_ref)
            m, l, o = m_new, a * l + a2 * l2, a[..., None] * o + a2[..., None] * o2
        empty = l == 0
        out[..., qs:qe, :] = o / np.where(empty, 1, l)[..., None]
        lse[..., qs:qe] = np.where(empty, -np.inf, m + np.log(np.where(empty, 1, l)))
    return out.astype(q.dtype), lse.astype(np.float32 if q.dtype == np.float16 else q.dtype)


def variant_attention_backward(q, k, v, out, lse, dout, *, mask=None, causal=False, scale=None,
                               sinks=None, dropout_p=0.0, dropout_seed=None,
                               dropout_offset=(0, 0), block_q=16, block_k=16, bug=None):
    """The backward of :func:`variant_attention` for masks, causal, sinks and dropout, tiled key
    block by key block (FlashAttention-2's order); returns ``(dq, dk, dv)``, and ``dsinks`` with
    sinks. ``bug`` is one of :data:`BACKWARD_BUGS` (the others are the forward's: ignored here).

    With ``Z`` the keep mask and ``P = exp(S - lse)`` (lse holds the sink): ``dV = (P∘Z/(1-p))ᵀ
    dO``, ``dP = (dO Vᵀ)∘Z/(1-p)``, ``dS = P∘(dP - D)``, ``D = rowsum(dO∘O)``, and
    ``dsinks_h = -Σ_i exp(sink_h - lse_i)·D_i``. ``dS`` is 0 at the masked pairs and the products
    ``dS·K``, ``dSᵀ·Q`` run over the allowed pairs only, so garbage in k or v at a key reaches
    exactly the gradients of the pairs allowed to meet it."""
    steps = _steps(bug)  # of which the backward takes backward_keep, dsinks, dscores, dq_share
    acc = np.float32 if q.dtype == np.float16 else q.dtype.type
    n_q, n_k = q.shape[-2], k.shape[-2]
    scale = acc(1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2],
                                () if mask is None else np.shape(mask)[:-2])
    q_in, k_in, v_in = q, k, v
    q, k, v, out, dout = (np.broadcast_to(x, batch + x.shape[-2:]).astype(acc)
                          for x in (q, k, v, out, dout))
    lse = np.broadcast_to(lse, batch + (n_q,)).astype(acc)
    lse_ref = np.where(lse == -np.inf, 0, lse)[..., None]  # an empty row: every P is 0
    D = (dout * out).sum(axis=-1, keepdims=True)
    dropout = _dropout_state(dropout_p, dropout_seed, dropout_offset)
    rescale = acc(1 / (1 - dropout_p))
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros(batch + v.shape[-2:], acc)
    for ks in range(0, n_k, block_k):
        ke = min(ks + block_k, n_k)
        j = np.arange(ks, ke)[None, :]
        for qs in range(0, n_q, block_q):
            qe = min(qs + block_q, n_q)
            ok = np.ones((qe - qs, ke - ks), bool)
            if mask is not None:
                ok = ok & np.broadcast_to(mask, np.shape(mask)[:-2] + (n_q, n_k))[
                    ..., qs:qe, ks:ke]
            if causal:
                ok = ok & (j <= np.arange(qs, qe)[:, None] + n_k - n_q)
            s = q[..., qs:qe, :] @ np.swapaxes(k[..., ks:ke, :], -1, -2) * scale
            p = np.where(ok, np.exp(np.where(ok, s, 0) - lse_ref[..., qs:qe, :]), 0)
            dp = dout[..., qs:qe, :] @ np.swapaxes(v[..., ks:ke, :], -1, -2)
            # the mask's bugs a backward can make: another counter, or a stateful generator
            # visited key block first (another mask than the forward's, visited query block first)
            keep = _keep_tile(dropout, batch, qs, qe, ks, ke, steps.backward_keep)
            p_dropped = p if keep is None else np.where(keep, p * rescale, 0)
            if keep is not None:
                dp = np.where(keep, dp * rescale, 0)
            dv[..., ks:ke, :] += np.swapaxes(p_dropped, -1, -2) @ dout[..., qs:qe, :]
            ds = steps.dscores(p, dp, D[..., qs:qe, :], ok)
            dq[..., qs:qe, :] += steps.dq_share(ds, k[..., ks:ke, :], ok) * scale
            dk[..., ks:ke, :] += allowed_matmul(np.swapaxes(ds, -1, -2), q[..., qs:qe, :],
                                                np.swapaxes(ok, -1, -2)) * scale
    grads = tuple(_sum_to(g, x.shape).astype(x.dtype) for g, x in
                  ((dq, q_in), (dk, k_in), (dv, v_in)))
    if sinks is None:
        return grads
    sinks = np.asarray(sinks)
    sink = np.broadcast_to(sinks.astype(acc), batch)[..., None]
    share = (np.exp(sink - lse) * D[..., 0]).sum(axis=-1)  # Σ_i exp(sink - lse_i)·D_i
    dsinks = _sum_to(steps.dsinks(share), sinks.shape)
    return grads + (dsinks.astype(acc),)


def _sum_to(x, shape):
    """``x`` summed over the axes along which ``shape`` was broadcast to ``x.shape``."""
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead))) if lead else x
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x

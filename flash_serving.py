"""Serving on top of flash_lib: packed variable-length batches and the KV cache.

Two interfaces of FlashAttention's, built on flash_lib's public kernels only (this module names
no private flash_lib attribute, so it is not part of the algorithm and flash_lib does not import
it; chapter 21 explains both):

* :func:`flash_attention_varlen` / :func:`flash_attention_varlen_backward`, FlashAttention's
  ``flash_attn_varlen_func``: sequences packed end to end along the token axis, delimited by
  ``cu_seqlens``. Each sequence is one :func:`flash_lib.flash_attention` call on its own slices,
  so the work is ``Σ_b Nq_b · Nk_b`` (:func:`varlen_tile_schedule` lists the tiles), never the
  ``total_q × total_k`` of a document mask, and causal and window are bottom-right per sequence.
* :func:`flash_attention_with_kvcache`, FlashAttention's ``flash_attn_with_kvcache``: attention
  of new queries over a cache of keys and values, contiguous ``(B, Hkv, max_len, d)`` or paged as
  in vLLM (``block_table``), with the new keys written into the cache in place. The valid keys
  are walked in chunks of :data:`KV_CHUNK` (split-KV, flash-decoding): each chunk is gathered
  into a buffer of its own, attended by :func:`flash_lib.flash_attention`, and the partial
  results are combined by :func:`flash_lib.merge_attention`. Scratch is therefore O(chunk), not
  O(cache length), and a paged cache gives exactly the bits of a contiguous one holding the same
  keys: the same buffers reach the same calls.
"""

from __future__ import annotations

import types

import numpy as np

import flash_lib

__all__ = [
    "KV_CHUNK",
    "flash_attention_varlen",
    "flash_attention_varlen_backward",
    "varlen_tile_schedule",
    "flash_attention_with_kvcache",
]

#: Keys per split of the KV cache, one default key block of flash_lib. A decoding step's scratch
#: is a few chunks' worth, whatever the cache's length.
KV_CHUNK = flash_lib.DEFAULT_BLOCK_K


# --------------------------------------------------------------------------------------------
# Packed variable-length batches
# --------------------------------------------------------------------------------------------


def _cu_seqlens(name, cu, total):
    """``cu`` checked: a 1-D integer array starting at 0, non-decreasing, ending at ``total``."""
    arr = np.asarray(cu)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a 1-D integer array of length B + 1, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr[0] != 0:
        raise ValueError(f"{name} must start at 0, got {arr[0]}")
    if (np.diff(arr) < 0).any():
        at = int(np.argmax(np.diff(arr) < 0))
        raise ValueError(f"{name} must be non-decreasing, got {arr[at]} then {arr[at + 1]} at {at}")
    if arr[-1] != total:
        raise ValueError(f"{name} must end at the total number of tokens {total}, got {arr[-1]}")
    return [int(x) for x in arr]


def _sequences(total_q, total_k, cu_seqlens_q, cu_seqlens_k):
    """``(q_start, q_stop, k_start, k_stop)`` of each sequence, the offsets checked."""
    cu_q = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q)
    cu_k = _cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k)
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length B + 1, got "
                         f"{len(cu_q)} and {len(cu_k)}")
    return list(zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]))


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, window=None,
                           softcap=None, alibi_slopes=None, scale=None, enable_gqa=False,
                           sinks=None, dropout_p=0.0, dropout_seed=None, return_lse=False,
                           block_q=None, block_k=None):
    """Attention over sequences packed end to end, FlashAttention's ``flash_attn_varlen_func``.

    Parameters
    ----------
    q, k, v : arrays of shape ``(..., total_q, d)``, ``(..., total_k, d)``, ``(..., total_k, dv)``
        The sequences' tokens one after another along axis -2; leading axes (heads) as in
        :func:`flash_lib.flash_attention`.
    cu_seqlens_q, cu_seqlens_k : integer arrays of length ``B + 1``
        Sequence ``b`` owns queries ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and keys
        ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``. Each starts at 0, never decreases and ends at
        the total (``total_q``, ``total_k``); anything else is a ValueError naming it.
    causal, window, softcap, alibi_slopes, scale, enable_gqa, sinks, return_lse
        As for :func:`flash_lib.flash_attention`, applied to each sequence alone: causal and
        window are bottom-right per sequence (key ``j`` of sequence ``b`` for its query ``i`` iff
        ``j <= i + (Nk_b - Nq_b)``), ALiBi's distance likewise; ``sinks`` (one logit per head)
        joins every row's softmax, so a row of a sequence without keys gives ``out`` 0 and
        ``lse = sink``.
    dropout_p, dropout_seed
        As for :func:`flash_lib.flash_attention`. Sequence ``b`` draws flash_lib's mask at its
        packed positions, ``dropout_offset = (cu_seqlens_q[b], cu_seqlens_k[b])``: the batch's
        mask is that of the packed ``(..., total_q, total_k)`` problem (this call equals
        ``flash_attention`` with the document mask and the same seed), no two sequences share an
        element's random bits, and the backward given the same seed draws the same mask.
        FlashAttention's varlen kernel keys sequence ``b`` by its batch index and its positions
        within it instead (``csrc/flash_attn/src/``: ``flash_fwd_kernel.h`` builds
        ``Dropout(seed, offset, p, bidb, bidh, ...)`` and ``dropout.h`` adds
        ``(bidb·nheads + bidh)·32`` to the Philox offset, the counter being the row and column
        block within the sequence); flash_lib's ``dropout_offset`` moves positions, not the
        batch index.
    block_q, block_k : int, optional
        Tile size of each sequence's call (default flash_lib's).

    Returns
    -------
    out : ndarray ``(..., total_q, dv)``
        Row ``i`` of sequence ``b`` attends only keys of sequence ``b``. A sequence with no keys
        gives zero rows.
    lse : ndarray ``(..., total_q)``, only with ``return_lse=True``
        ``-inf`` for rows with no allowed key (the sink with ``sinks``).

    Notes
    -----
    Every argument is checked once, up front, with flash_lib's rules
    (:func:`flash_lib.check_inputs` on the packed arrays), whatever the lengths, so an empty
    batch refuses what flash_lib refuses. Each sequence with queries is then one
    :func:`flash_lib.flash_attention` call, so the result equals that call on the sequence alone
    (with its ``dropout_offset``), bit for bit, and only its tiles are visited
    (:func:`varlen_tile_schedule`): work ``∝ Σ_b Nq_b · Nk_b``.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    kwargs = _tiles(dict(causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                         scale=scale, enable_gqa=enable_gqa, sinks=sinks, dropout_p=dropout_p,
                         dropout_seed=dropout_seed), block_q, block_k)
    # Checked on the packed arrays: the sequences' dropout offsets and lengths lie within them.
    checked = flash_lib.check_inputs(q, k, v, **kwargs)
    seqs = _sequences(q.shape[-2], k.shape[-2], cu_seqlens_q, cu_seqlens_k)
    out = np.zeros(checked.batch + (checked.n_q, checked.dv), checked.out_dtype)
    lse = np.full(checked.batch + (checked.n_q,), -np.inf, checked.dtype)
    for q0, q1, k0, k1 in seqs:
        if q1 == q0:  # no query: nothing to compute
            continue
        o, s = flash_lib.flash_attention(q[..., q0:q1, :], k[..., k0:k1, :], v[..., k0:k1, :],
                                         return_lse=True, dropout_offset=(q0, k0), **kwargs)
        out[..., q0:q1, :], lse[..., q0:q1] = o, s
    return (out, lse) if return_lse else out


def _tiles(kwargs, block_q, block_k):
    if block_q is not None:
        kwargs["block_q"] = block_q
    if block_k is not None:
        kwargs["block_k"] = block_k
    return kwargs


def flash_attention_varlen_backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, *,
                                    causal=False, window=None, softcap=None, alibi_slopes=None,
                                    scale=None, enable_gqa=False, sinks=None, dropout_p=0.0,
                                    dropout_seed=None, block_q=None, block_k=None):
    """The gradients of ``sum(dout * flash_attention_varlen(q, k, v, ...))``: ``(dq, dk, dv)``,
    and ``dsinks`` with ``sinks``.

    Parameters
    ----------
    q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window, softcap, alibi_slopes, scale, enable_gqa, sinks, dropout_p, dropout_seed, block_q, block_k
        As for :func:`flash_attention_varlen`, and the same as the forward call (each
        sequence's dropout mask is drawn again at its packed positions).
    out, lse
        What ``flash_attention_varlen(..., return_lse=True)`` returned.
    dout : array of the shape of ``out``

    Returns
    -------
    dq, dk, dv : ndarrays
        Each of its input's shape and dtype; each sequence's slices are
        :func:`flash_lib.flash_attention_backward` on that sequence alone (bit for bit). Keys of
        a sequence with no query, and queries of a sequence with no key, get exact zeros.
    dsinks : ndarray
        Only with ``sinks``: of sinks' shape, in the compute dtype, the sum over the sequences
        (in order) of each one's ``dsinks``.
    """
    q, k, v, out, lse, dout = (np.asarray(x) for x in (q, k, v, out, lse, dout))
    kwargs = _tiles(dict(causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                         scale=scale, enable_gqa=enable_gqa, sinks=sinks, dropout_p=dropout_p,
                         dropout_seed=dropout_seed), block_q, block_k)
    checked = flash_lib.check_inputs(q, k, v, out=out, lse=lse, dout=dout, **kwargs)
    seqs = _sequences(q.shape[-2], k.shape[-2], cu_seqlens_q, cu_seqlens_k)
    dq, dk, dv = (np.zeros(x.shape, x.dtype) for x in (q, k, v))
    dsinks = None if sinks is None else np.zeros(np.shape(sinks), checked.dtype)
    for q0, q1, k0, k1 in seqs:
        if q1 == q0:  # no query: its keys get no gradient, and add nothing to dsinks
            continue
        rows, keys = (..., slice(q0, q1)), (..., slice(k0, k1))
        g = flash_lib.flash_attention_backward(
            q[rows + (slice(None),)], k[keys + (slice(None),)], v[keys + (slice(None),)],
            out[rows + (slice(None),)], lse[rows], dout[rows + (slice(None),)],
            dropout_offset=(q0, k0), **kwargs)
        dq[rows + (slice(None),)], dk[keys + (slice(None),)], dv[keys + (slice(None),)] = g[:3]
        if dsinks is not None:
            dsinks += g[3]
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)


def varlen_tile_schedule(cu_seqlens_q, cu_seqlens_k, block_q=flash_lib.DEFAULT_BLOCK_Q,
                         block_k=flash_lib.DEFAULT_BLOCK_K, causal=False, *, window=None):
    """The tiles :func:`flash_attention_varlen` visits, as ``(q_start, q_stop, k_start, k_stop)``
    in packed (global) positions: each sequence's :func:`flash_lib.tile_schedule`, shifted."""
    cu_q = np.asarray(cu_seqlens_q)
    cu_k = np.asarray(cu_seqlens_k)
    # the totals are the offsets' own last entries (a 0-d or empty array is refused by the check)
    seqs = _sequences(int(cu_q[-1]) if cu_q.ndim == 1 and cu_q.size else 0,
                      int(cu_k[-1]) if cu_k.ndim == 1 and cu_k.size else 0, cu_q, cu_k)
    return [(q0 + a, q0 + b, k0 + c, k0 + e)
            for q0, q1, k0, k1 in seqs
            for a, b, c, e in flash_lib.tile_schedule(q1 - q0, k1 - k0, block_q, block_k, causal,
                                                      window=window)]


# --------------------------------------------------------------------------------------------
# The KV cache, contiguous or paged
# --------------------------------------------------------------------------------------------


def _int_array(name, x, shape=None):
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if shape is not None and arr.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {arr.shape}")
    return arr


def _cache_arrays(k_cache, v_cache, written):
    """The caches as arrays; when ``k_new`` is written into them, the caller's own, writable (a
    copy made here would take the write, and the caller's cache would miss it)."""
    if not written:
        return np.asarray(k_cache), np.asarray(v_cache)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array when k_new is given (k_new is "
                            f"written into it in place), got {type(c).__name__}")
        if not c.flags.writeable:
            raise ValueError(f"{name} is read-only, and k_new is written into it in place")
    return k_cache, v_cache


class _Cache:
    """Where logical key ``t`` of sequence ``b`` lives: ``(page, slot)`` of a paged cache, or
    ``(b, t)`` of a contiguous one (a contiguous cache is the paged one with one page per
    sequence, of ``max_len`` slots, and ``block_table[b] = [b]``)."""

    def __init__(self, k_cache, v_cache, batch, block_table):
        self.k, self.v = k_cache, v_cache
        if k_cache.ndim != 4 or v_cache.ndim != 4:
            raise ValueError(f"k_cache and v_cache must be 4-D, got shapes {k_cache.shape} and "
                             f"{v_cache.shape}")
        if k_cache.shape[:3] != v_cache.shape[:3]:
            raise ValueError(f"k_cache and v_cache must agree on their first three axes, got "
                             f"{k_cache.shape} and {v_cache.shape}")
        if block_table is None:
            if k_cache.shape[0] != batch:
                raise ValueError(f"a contiguous k_cache must have B = {batch} rows (axis 0, q's "
                                 f"batch), got shape {k_cache.shape}")
            self.page_size = k_cache.shape[2]
            self.table = np.arange(batch)[:, None]
        else:
            self.table = _int_array("block_table", block_table)
            if self.table.ndim != 2 or self.table.shape[0] != batch:
                raise ValueError(f"block_table must have shape (B = {batch}, max_pages), got "
                                 f"{self.table.shape}")
            self.page_size = k_cache.shape[2]
        if self.page_size == 0:
            raise ValueError(f"the cache has pages of 0 slots (shape {k_cache.shape})")
        self.capacity = self.table.shape[1] * self.page_size

    def pages(self, b, start, stop):
        """``(page, slot_start, slot_stop, t_start, t_stop)`` covering keys ``start:stop`` of ``b``."""
        runs = []
        t = start
        while t < stop:
            index, slot = divmod(t, self.page_size)
            page = int(self.table[b, index])
            if not 0 <= page < self.k.shape[0]:
                raise ValueError(f"block_table[{b}, {index}] = {page} is not a page of the cache "
                                 f"(0 to {self.k.shape[0] - 1})")
            n = min(self.page_size - slot, stop - t)
            runs.append((page, slot, slot + n, t, t + n))
            t += n
        return runs

    def write(self, b, start, k_new, v_new):
        for page, s0, s1, t0, t1 in self.pages(b, start, start + k_new.shape[-2]):
            self.k[page, :, s0:s1] = k_new[:, t0 - start:t1 - start]
            self.v[page, :, s0:s1] = v_new[:, t0 - start:t1 - start]

    def gather(self, b, start, stop, dtype):
        """Keys and values ``start:stop`` of sequence ``b``, copied into buffers of their own:
        the same buffers, bit for bit, whatever the layout."""
        k = np.empty((self.k.shape[1], stop - start, self.k.shape[3]), dtype)
        v = np.empty((self.v.shape[1], stop - start, self.v.shape[3]), dtype)
        for page, s0, s1, t0, t1 in self.pages(b, start, stop):
            k[:, t0 - start:t1 - start] = self.k[page, :, s0:s1]
            v[:, t0 - start:t1 - start] = self.v[page, :, s0:s1]
        return k, v


def flash_attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None,
                                 block_table=None, causal=False, window=None, softcap=None,
                                 alibi_slopes=None, scale=None, enable_gqa=False, sinks=None,
                                 return_lse=False):
    """Attention of new queries over a KV cache, FlashAttention's ``flash_attn_with_kvcache``.

    Parameters
    ----------
    q : array ``(B, H, Nq, d)``
        The new queries of each sequence (``Nq = 1`` when decoding).
    k_cache, v_cache : arrays
        Contiguous: ``(B, Hkv, max_len, d)`` and ``(B, Hkv, max_len, dv)``. Paged (with
        ``block_table``): ``(num_pages, Hkv, page_size, d)`` and ``(..., dv)``. With ``k_new``,
        the caller's own writable NumPy arrays (anything else is refused: a copy would take the
        write and the caller's cache would miss it).
    cache_seqlens : integer array ``(B,)``
        Valid keys of each sequence before this call. Slots and pages beyond them are never
        read: whatever they hold (NaN, inf) changes nothing.
    k_new, v_new : arrays ``(B, Hkv, Nnew, d)``, ``(B, Hkv, Nnew, dv)``, optional
        Written into the cache **in place** at positions
        ``cache_seqlens[b] : cache_seqlens[b] + Nnew`` (ValueError if that overflows the cache),
        then attended with the rest. The caller advances ``cache_seqlens``. Each of the cache's
        dtype (FlashAttention's ``mha_fwd_kvcache``, ``csrc/flash_attn/flash_api.cpp``, requires
        the same). A call that raises has written nothing: every argument is checked first.
    block_table : integer array ``(B, max_pages)``, optional
        Paged cache: logical key ``t`` of sequence ``b`` is slot ``t % page_size`` of page
        ``block_table[b, t // page_size]``. Pages may be shared by sequences (a common prefix)
        and be in any order; entries past a sequence's valid pages are not read.
    causal, window, softcap, alibi_slopes, scale, enable_gqa, sinks, return_lse
        As for :func:`flash_lib.flash_attention`, per sequence over its
        ``L_b = cache_seqlens[b] + Nnew`` valid keys: causal is bottom-right
        (query ``i`` sees keys ``j <= i + L_b - Nq``), and so are the window and ALiBi.
        ``alibi_slopes`` and ``sinks`` (gpt-oss's one logit per head) broadcast to ``(B, H)``.

    Returns
    -------
    out : ndarray ``(B, H, Nq, dv)``
    lse : ndarray ``(B, H, Nq)``, only with ``return_lse=True`` (float32 at least)

    Notes
    -----
    Split-KV (flash-decoding): the valid keys below ``s_b = KV_CHUNK · ⌊(L_b - Nq) / KV_CHUNK⌋``
    are walked in chunks of :data:`KV_CHUNK`, each gathered into a buffer of its own and attended
    on its own; the last ``L_b - s_b`` keys (at least ``Nq``, fewer than ``Nq + KV_CHUNK``) are
    one call with the queries, where flash_lib's own bottom-right alignment is exactly the
    cache's. A key below ``s_b`` precedes every query's position, so causal allows it, the
    window can only cut it from the left (a mask_mod) and its ALiBi distance is the chunk's own
    plus a per-row constant (added to the chunk's lse). The parts are combined in key order by
    :func:`flash_lib.merge_attention`. A sink joins the last call alone (flash_lib starts its
    rows at the sink), so it is counted once per row, never once per chunk; fewer than
    ``Nq + KV_CHUNK`` valid keys are one :func:`flash_lib.flash_attention` call, sink included.
    Scratch: a few chunks of keys and values, and ``O(H · Nq · dv)`` partial results,
    independent of the cache's length. A paged cache and a contiguous one holding the same keys
    give the same bits. Half-precision inputs are computed, and merged, in float32, rounded once
    at the end.
    """
    q = np.asarray(q)
    if q.ndim != 4:
        raise ValueError(f"q must be (B, H, Nq, d), got shape {q.shape}")
    batch, heads, n_q, _ = q.shape
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    cache = _Cache(*_cache_arrays(k_cache, v_cache, written=k_new is not None), batch,
                   block_table)
    seqlens = _int_array("cache_seqlens", cache_seqlens, (batch,))
    if (seqlens < 0).any():
        raise ValueError(f"cache_seqlens must be non-negative, got {seqlens}")
    n_new = 0
    if k_new is not None:
        k_new, v_new = np.asarray(k_new), np.asarray(v_new)
        hkv = cache.k.shape[1]
        for name, x, c in (("k_new", k_new, cache.k), ("v_new", v_new, cache.v)):
            if x.ndim != 4 or x.shape[:2] != (batch, hkv) or x.shape[3] != c.shape[3]:
                raise ValueError(f"{name} must have shape (B = {batch}, Hkv = {hkv}, Nnew, "
                                 f"{c.shape[3]}), got {x.shape}")
            if x.dtype != c.dtype:
                raise TypeError(f"{name} must have the dtype of the cache it is written into, "
                                f"{c.dtype}, got {x.dtype}")
        if k_new.shape[2] != v_new.shape[2]:
            raise ValueError(f"k_new and v_new must have the same Nnew, got {k_new.shape[2]} "
                             f"and {v_new.shape[2]}")
        n_new = k_new.shape[2]
    lengths = seqlens.astype(np.int64) + n_new
    if (lengths > cache.capacity).any():
        b = int(np.argmax(lengths > cache.capacity))
        raise ValueError(f"sequence {b}: cache_seqlens {int(seqlens[b])} + Nnew {n_new} keys "
                         f"overflow the cache's {cache.capacity} slots")
    for b in range(batch):  # check the pages first, so that a bad table writes nothing
        cache.pages(b, 0, int(lengths[b]))
    # Every other argument checked with flash_lib's rules before anything is written, the
    # cache described as the kernels will see each sequence's keys: (B, Hkv, longest, d) (the
    # check reads shapes and dtypes only).
    longest = int(lengths.max(initial=0))
    keys, values = (types.SimpleNamespace(shape=(batch, c.shape[1], longest, c.shape[3]), ndim=4,
                                          dtype=c.dtype) for c in (cache.k, cache.v))
    checked = flash_lib.check_inputs(q, keys, values, causal=causal, window=window,
                                     softcap=softcap, alibi_slopes=alibi_slopes, scale=scale,
                                     enable_gqa=enable_gqa, sinks=sinks)
    out_dtype, lse_dtype = checked.out_dtype, checked.dtype
    if k_new is not None:
        for b in range(batch):
            cache.write(b, int(seqlens[b]), k_new[b], v_new[b])
    acc = np.result_type(out_dtype, np.float32)
    slopes, sinks = (None if x is None else np.broadcast_to(np.asarray(x), (batch, heads))
                     for x in (alibi_slopes, sinks))
    kwargs = dict(softcap=softcap, scale=scale)
    out = np.empty((batch, heads, n_q, cache.v.shape[3]), out_dtype)
    lse = np.empty((batch, heads, n_q), lse_dtype) if return_lse else None
    for b in range(batch):
        o, s = _one_sequence(q[b].astype(acc, copy=False), cache, b, int(lengths[b]), acc,
                             None if slopes is None else slopes[b],
                             None if sinks is None else sinks[b], causal, window, enable_gqa,
                             kwargs)
        out[b] = o
        if lse is not None:
            lse[b] = s
    return (out, lse) if return_lse else out


def _one_sequence(q, cache, b, length, acc, slopes, sinks, causal, window, enable_gqa, kwargs):
    heads, n_q = q.shape[0], q.shape[1]
    if n_q == 0:
        return np.zeros((heads, 0, cache.v.shape[3]), acc), np.zeros((heads, 0), acc)
    split = KV_CHUNK * (max(length - n_q, 0) // KV_CHUNK)
    hkv = cache.k.shape[1]
    groups = heads // hkv if enable_gqa else 1
    # Each query row its own one-query problem (leading axis), so that a chunk's ALiBi distance
    # is never negative: (Hkv, G, Nq, 1, d) against keys (Hkv, 1, 1, chunk, d).
    lead = (hkv, groups) if enable_gqa else (heads,)
    q_rows = q.reshape(lead + (n_q, 1, q.shape[-1]))
    positions = np.arange(n_q) + (length - n_q)  # each query's position in the sequence
    chunk_slopes = None if slopes is None else slopes.reshape(lead + (1,))
    out = lse = None
    for start in range(0, split, KV_CHUNK):  # in key order, merged as they come: O(1) parts
        stop = start + KV_CHUNK
        k, v = (x.reshape((hkv,) + (1,) * len(lead) + x.shape[1:])
                for x in cache.gather(b, start, stop, acc))
        mask_mod = None
        if window is not None and window[0] is not None:
            left = positions[:, None, None] - window[0]  # key j is cut iff start + j < pos - left

            def mask_mod(q_idx, k_idx, left=left, start=start):
                return k_idx + start >= left
        o, s = flash_lib.flash_attention(q_rows, k, v, alibi_slopes=chunk_slopes,
                                         mask_mod=mask_mod, return_lse=True, **kwargs)
        o, s = o.reshape(heads, n_q, -1), s.reshape(heads, n_q)
        if slopes is not None:
            # distance = the chunk's own (stop - 1 - j) + (position - stop + 1), both >= 0
            s = s - slopes.astype(acc)[:, None] * (positions - stop + 1).astype(acc)
        out, lse = (o, s) if out is None else flash_lib.merge_attention(out, lse, o, s)
    # The last keys with the queries: flash_lib's bottom-right is the cache's here. The sink
    # joins this call alone: once per row, whatever the number of chunks.
    k, v = cache.gather(b, split, length, acc)
    o, s = flash_lib.flash_attention(q, k, v, causal=causal, window=window, alibi_slopes=slopes,
                                     enable_gqa=enable_gqa, sinks=sinks, return_lse=True,
                                     **kwargs)
    return (o, s) if out is None else flash_lib.merge_attention(out, lse, o, s)

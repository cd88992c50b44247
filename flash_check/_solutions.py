"""The solutions of the tutorial's exercises (``flash_check.exercises``), one function each.

Not on the reading path: the chapters show them behind a "show solution" toggle
(``flash_check.exercises.show_solution(name)`` prints one), and the tests grade every one of them
(``tests/test_exercises.py``). Each is written the way its chapter derives it, plainly, with NumPy
only: they are what a learner's answer may look like, not flash_lib's code (which they do not call).
The Triton exercise's solution is in ``_solutions_triton.py`` (it needs Triton).
"""

from __future__ import annotations

import math

import numpy as np


def merge(out_a, lse_a, out_b, lse_b):
    """Chapter 3: attention over two disjoint key sets, combined by their log-sum-exps."""
    m = np.maximum(lse_a, lse_b)
    m = np.where(m == -np.inf, 0.0, m)  # both parts empty: any finite reference
    w_a, w_b = np.exp(lse_a - m), np.exp(lse_b - m)  # exp(-inf) = 0 for an empty part
    # an empty part weighs 0 whatever its out holds: select, do not multiply (0 · inf = NaN)
    part_a = w_a[:, None] * np.where(lse_a[:, None] > -np.inf, out_a, 0.0)
    part_b = w_b[:, None] * np.where(lse_b[:, None] > -np.inf, out_b, 0.0)
    total = w_a + w_b
    empty = total == 0
    out = (part_a + part_b) / np.where(empty, 1.0, total)[:, None]
    lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1.0, total)))
    return out, lse


def online_update(m, l, acc, s, v):
    """Chapter 5: fold one tile of scores ``s`` and values ``v`` into the rows' running state."""
    m_new = np.maximum(m, s.max(axis=1))
    ref = np.where(m_new == -np.inf, 0.0, m_new)  # a row with no allowed key yet: no -inf - -inf
    alpha = np.exp(m - ref)
    p = np.exp(s - ref[:, None])
    return m_new, l * alpha + p.sum(axis=1), acc * alpha[:, None] + p @ v


def forward(q, k, v, *, causal=False, block_q=64, block_k=64):
    """Chapters 5 and 6: the tiled forward, bottom-right causal, empty rows 0 and -inf."""
    n_q, n_k, scale = q.shape[0], k.shape[0], 1 / math.sqrt(q.shape[1])
    out = np.zeros((n_q, v.shape[1]), np.result_type(q, k, v))
    lse = np.full(n_q, -np.inf, out.dtype)
    for i0 in range(0, n_q, block_q):
        rows = np.arange(i0, min(i0 + block_q, n_q))
        m = np.full(len(rows), -np.inf)
        l = np.zeros(len(rows))
        acc = np.zeros((len(rows), v.shape[1]))
        for j0 in range(0, n_k, block_k):
            keys = np.arange(j0, min(j0 + block_k, n_k))
            s = scale * (q[rows] @ k[keys].T)
            if causal:
                s = np.where(keys[None, :] <= rows[:, None] + (n_k - n_q), s, -np.inf)
            m, l, acc = online_update(m, l, acc, s, v[keys])
        empty = l == 0
        out[rows] = acc / np.where(empty, 1.0, l)[:, None]
        lse[rows] = np.where(empty, -np.inf, m + np.log(np.where(empty, 1.0, l)))
    return out, lse


def backward(q, k, v, out, lse, dout, *, causal=False, block_q=64, block_k=64):
    """Chapters 12 and 13: the gradients, P recomputed from lse tile by tile, D = rowsum(dO ∘ O)."""
    n_q, n_k, scale = q.shape[0], k.shape[0], 1 / math.sqrt(q.shape[1])
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    D = (dout * out).sum(axis=1)
    lse_safe = np.where(lse == -np.inf, 0.0, lse)  # an empty row: P = 0, whatever lse says
    for j0 in range(0, n_k, block_k):
        keys = np.arange(j0, min(j0 + block_k, n_k))
        for i0 in range(0, n_q, block_q):
            rows = np.arange(i0, min(i0 + block_q, n_q))
            s = scale * (q[rows] @ k[keys].T)
            allowed = np.broadcast_to(lse[rows, None] > -np.inf, s.shape)
            if causal:
                allowed = allowed & (keys[None, :] <= rows[:, None] + (n_k - n_q))
            p = np.where(allowed, np.exp(np.where(allowed, s, 0.0) - lse_safe[rows, None]), 0.0)
            dv[keys] += p.T @ dout[rows]
            dp = dout[rows] @ v[keys].T
            ds = p * (dp - D[rows, None])
            dq[rows] += scale * (ds @ k[keys])
            dk[keys] += scale * (ds.T @ q[rows])
    dtype = np.result_type(q, k, v)
    return dq.astype(dtype), dk.astype(dtype), dv.astype(dtype)


def philox4x32(c0, c1, c2, c3, k0, k1, rounds=7):
    """Philox4x32 on arrays of 32-bit counters (chapter 17's formula); four uint64 words."""
    c = [np.asarray(x, np.uint64) for x in (c0, c1, c2, c3)]
    low = np.uint64(0xFFFFFFFF)
    for _ in range(rounds):
        p0, p1 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & low,
             (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1), p0 & low]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c


def keep_mask(seed, p, shape, offset=(0, 0)):
    """Chapter 17: the dropout keep mask of ``shape = (..., rows, keys)``, as flash_lib draws it."""
    *batch, rows, keys = shape
    b = np.arange(math.prod(batch), dtype=np.uint64).reshape(*batch, 1, 1)
    i = np.arange(offset[0], offset[0] + rows, dtype=np.uint64)[:, None]
    j = np.arange(offset[1], offset[1] + keys, dtype=np.uint64)[None, :]
    b, i, j = np.broadcast_arrays(b, i, j)
    words = philox4x32(j // 8, i, b & np.uint64(0xFFFFFFFF), b >> np.uint64(32),
                       seed & 0xFFFFFFFF, seed >> 32)
    word = np.choose((j % 8 // 2).astype(np.intp), words)
    number = np.where(j % 2 == 0, word & np.uint64(0xFFFF), word >> np.uint64(16))
    return number >= round(p * 2**16)


def attention_with_sinks(q, k, v, sinks, *, causal=False):
    """Chapter 18: one more logit per head, ``sinks[h]``, in every row's denominator."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    s = (q @ np.swapaxes(k, -1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.arange(n_k) <= np.arange(n_q)[:, None] + (n_k - n_q), s, -np.inf)
    sink = np.asarray(sinks, np.float64)[:, None]  # (H, 1): unscaled, one per head
    m = np.maximum(s.max(axis=-1, initial=-np.inf), sink)  # finite: the sink is always there
    p = np.exp(s - m[..., None])
    l = p.sum(axis=-1) + np.exp(sink - m)
    return (p @ v) / l[..., None], m + np.log(l)


def paged_decode(q, k_cache, v_cache, block_table, cache_seqlens):
    """Chapter 21: one query per sequence against its keys, gathered page by page."""
    n_batch, n_heads, d = q.shape
    page_size = k_cache.shape[2]
    out = np.zeros((n_batch, n_heads, v_cache.shape[-1]), np.result_type(q, v_cache))
    for b in range(n_batch):
        n = int(cache_seqlens[b])
        if n == 0:
            continue  # no key: the empty sum, 0
        pages = block_table[b, : -(-n // page_size)]
        keys = k_cache[pages].transpose(1, 0, 2, 3).reshape(n_heads, -1, d)[:, :n]
        values = v_cache[pages].transpose(1, 0, 2, 3).reshape(n_heads, -1, v_cache.shape[-1])[:, :n]
        s = np.einsum("hd,hnd->hn", q[b], keys) / math.sqrt(d)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[b] = np.einsum("hn,hnd->hd", p, values) / p.sum(axis=1, keepdims=True)
    return out

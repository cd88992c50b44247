"""Batch invariance of split-KV decoding, on flash_lib's merge.

A decoding kernel splits each sequence's keys into parts, attends each part and merges the
parts' ``(out, lse)`` (flash-decoding; :func:`flash_lib.merge_attention`). The merge is exact in
real numbers, not in floating point: different splits give different last bits. A GPU kernel
that picks the *number* of splits from the batch (to fill its SMs) therefore gives a sequence
different bits depending on what else is in the batch; one that fixes the split *size* gives
the same bits whatever the batch (Thinking Machines, "Defeating Nondeterminism in LLM
Inference", 2025; FlashAttention issue #1897 and PR #2450; FlashInfer PR #1675).

FlashAttention's choice is :func:`num_splits_heuristic`, after
``flash_attn/cute/interface.py`` (``num_splits_heuristic``, lines 276-289, and its call, lines
365-371, Dao-AILab/flash-attention at ``0251105a2fb19d2957484b7f023cd8c115286ced``):
``min(num_SMs // (batch · kv_heads · m_blocks), 128, n_blocks)``, and 1 split when there are at
most 4 key blocks.

This module names no private attribute of flash_lib (it validates through
:func:`flash_lib.check_inputs`).
"""

from __future__ import annotations

import numpy as np

import flash_lib

__all__ = ["num_splits_heuristic", "split_kv_attention", "decode_in_batch"]


def num_splits_heuristic(total_mblocks, num_sms, num_n_blocks, max_splits=128):
    """FlashAttention's split count: 1 for at most 4 key blocks (or no work), else
    ``min(num_sms // total_mblocks, max_splits, num_n_blocks)``, at least 1."""
    if num_n_blocks <= 4 or total_mblocks == 0:
        return 1
    return max(1, min(num_sms // total_mblocks, max_splits, num_n_blocks))


def split_kv_attention(q, k, v, *, split_size, scale=None, return_lse=False):
    """Attention of ``q`` over ``k, v`` computed as split-KV decoding does: the keys in
    consecutive parts of ``split_size`` keys (the last may be shorter), one
    :func:`flash_lib.flash_attention` call per part (one key block each), the parts merged left
    to right by :func:`flash_lib.merge_attention`. The result depends on ``split_size`` in its
    last bits only."""
    checked = flash_lib.check_inputs(q, k, v, scale=scale)
    if isinstance(split_size, bool) or not isinstance(split_size, (int, np.integer)) \
            or split_size < 1:
        raise ValueError(f"split_size must be an integer >= 1, got {split_size!r}")
    n_k = checked.n_k
    merged = None
    for start in range(0, max(n_k, 1), split_size):
        stop = min(start + split_size, n_k)
        part = flash_lib.flash_attention(q, k[..., start:stop, :], v[..., start:stop, :],
                                         scale=checked.scale, block_k=max(stop - start, 1),
                                         return_lse=True)
        merged = part if merged is None else flash_lib.merge_attention(*merged, *part)
    return merged if return_lse else merged[0]


def decode_in_batch(q, k, v, *, batch_size, fixed_split_size=None, num_sms=132, block_k=128,
                    scale=None):
    """One sequence's decoding attention, computed as it would be inside a batch of
    ``batch_size`` sequences: with ``fixed_split_size`` None, the number of splits comes from
    :func:`num_splits_heuristic` (``total_mblocks = batch_size · heads``, one query block per
    head; ``num_sms`` 132, an H100 SXM's) and each split is ``ceil(n_blocks / splits)`` blocks of
    ``block_k`` keys, as FlashAttention divides them; else every split is ``fixed_split_size``
    keys, whatever the batch. q: ``(H, Nq, d)`` (or any leading dims: their product is the
    heads)."""
    checked = flash_lib.check_inputs(q, k, v, scale=scale)
    if fixed_split_size is None:
        heads = int(np.prod(checked.batch, dtype=np.int64))
        n_blocks = -(-checked.n_k // block_k)
        splits = num_splits_heuristic(batch_size * heads, num_sms, n_blocks)
        split_size = -(-n_blocks // splits) * block_k
    else:
        split_size = fixed_split_size
    return split_kv_attention(q, k, v, split_size=split_size, scale=checked.scale)

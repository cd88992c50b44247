"""The Triton exercise (chapter 16): its solution and the kernel that grades a learner's answer.

``attend_tile(m, l, acc, s, v)`` is the body of ``flash_triton.forward_kernel``'s key loop, a
``@triton.jit`` function: fold one tile of base-2 scores ``s (BM, BN)`` (-inf where masked) and
values ``v (BN, BD)`` into the rows' state, ``m`` (base-2 running max), ``l``, ``acc``, and return
``(m, l, acc)``. :func:`run_tiles` launches :func:`fold_kernel`, which starts every row at
``m = -inf, l = 0, acc = 0`` and calls the function it is given on tile after tile, as
``forward_kernel`` does; under Triton's interpreter on a machine without a GPU.

Imported by ``flash_check.exercises`` only when the Triton exercise is graded (Triton is not
installed everywhere: ``notebooks/_platform.py``), and by the tests. flash_triton is imported
first: on a machine without CUDA it sets ``TRITON_INTERPRET=1`` before Triton is imported.
"""

from __future__ import annotations

import warnings

import flash_triton
import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def attend_tile(m, l, acc, s, v):
    m_new = tl.maximum(m, tl.max(s, 1))
    # a row with no allowed key yet keeps m = -inf: subtract 0 there, not -inf (NaN)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m - m_use)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, l, acc


@triton.jit
def fold_kernel(S, V, M, L, ACC, n_tiles, STEP: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BD: tl.constexpr):
    rows = tl.arange(0, BM)
    keys = tl.arange(0, BN)
    cols = tl.arange(0, BD)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    for t in range(n_tiles):
        s = tl.load(S + t * BM * BN + rows[:, None] * BN + keys[None, :])
        v = tl.load(V + t * BN * BD + keys[:, None] * BD + cols[None, :])
        m, l, acc = STEP(m, l, acc, s, v)
    tl.store(M + rows, m)
    tl.store(L + rows, l)
    tl.store(ACC + rows[:, None] * BD + cols[None, :], acc)


def run_tiles(step, s, v):
    """Fold the tiles ``s (tiles, BM, BN)``, ``v (tiles, BN, BD)`` (float32, NumPy) through
    ``step`` from the empty state; returns ``(m, l, acc)`` as float64 NumPy arrays."""
    if not isinstance(step, triton.runtime.JITFunction) and not hasattr(step, "fn"):
        raise TypeError(f"attend_tile must be a @triton.jit function, got {type(step).__name__}")
    n_tiles, bm, bn = s.shape
    bd = v.shape[2]
    ts, tv = (torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(flash_triton.DEVICE)
              for x in (s, v))
    m, l = (torch.empty(bm, device=flash_triton.DEVICE) for _ in range(2))
    acc = torch.empty((bm, bd), device=flash_triton.DEVICE)
    # under the interpreter the arithmetic is NumPy's, which warns on IEEE's exp2(-inf) and the
    # like; the answer is the kernel's to give, and graded, so the warnings are not shown
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fold_kernel[(1,)](ts, tv, m, l, acc, n_tiles, STEP=step, BM=bm, BN=bn, BD=bd)
    return tuple(x.cpu().numpy().astype(np.float64) for x in (m, l, acc))

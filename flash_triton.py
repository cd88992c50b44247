"""FlashAttention-2, forward and backward, as Triton GPU kernels, with NumPy in and NumPy out.

The same algorithm as :func:`flash_lib.flash_attention` (chapter 5's algorithm box) and
:func:`flash_lib.flash_attention_backward` (chapter 12's loop), written as the kernels a GPU runs:
one program per (query block, batch·head) for the forward and for ``dq``, one per (key block,
batch·head) for ``dk`` and ``dv``, and a small preprocess kernel for ``D = rowsum(dout ∘ out)``.

Where it runs
-------------
On a machine with a CUDA GPU the kernels are compiled by Triton and run there. Without one, this
module sets ``TRITON_INTERPRET=1`` *before it imports triton* (Triton reads the variable when a
``@triton.jit`` function is defined), and Triton's interpreter runs the same kernels on the CPU,
one program after another, with PyTorch CPU tensors and NumPy arithmetic: slow (seconds for
N = 1024), but the same code, line for line. To use the interpreter on a CUDA machine too, set
``TRITON_INTERPRET=1`` in the environment before the first ``import triton`` (or ``import
flash_triton``). ``TRITON_INTERPRET=0`` on a machine without CUDA is refused: there is then
nothing to run the kernels on. Needs ``torch`` and ``triton``, which ``make`` installs; Triton
publishes wheels for Linux on x86_64 and aarch64 only.

Conventions (flash_lib's)
-------------------------
``mask`` True = may attend, broadcastable to ``(..., Nq, Nk)`` (a key-padding mask ``(..., 1,
Nk)`` is read with a query stride of 0, never expanded); ``causal`` is aligned bottom-right (key
``j`` allowed for query ``i`` iff ``j <= i + Nk - Nq``); a row with no allowed key gets ``out = 0``
and ``lse = -inf`` (``log 0``). FlashAttention itself stores ``lse = +inf`` for such a row, so
that its backward's ``exp(s - lse)`` is 0 there with no test; this module returns flash_lib's
``-inf`` (the true log of an empty sum, what :func:`flash_lib.merge_attention` and flash_check
expect) and makes FlashAttention's substitution inside the backward kernels, where it is needed.

Inputs are float32 or float16; every matmul accumulates in float32 and so do m, l and the output
accumulator; ``P`` (and, in the backward, ``dS``) is rounded to the input dtype before its matmul,
as FlashAttention does for the tensor cores.
"""

from __future__ import annotations

import math
import os
import warnings

import numpy as np

import flash_lib

_MISSING = ("flash_triton needs PyTorch and Triton, which `make setup` installs (pyproject.toml); "
            "Triton publishes wheels for Linux on x86_64 and aarch64 only")

try:
    import torch
except ImportError as exc:  # pragma: no cover - not installed
    raise ImportError(_MISSING) from exc

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    if os.environ.get("TRITON_INTERPRET", "1") != "1":
        raise RuntimeError(
            "flash_triton: no CUDA GPU, and TRITON_INTERPRET is set to "
            f"{os.environ['TRITON_INTERPRET']!r}: there is nothing to run the kernels on. "
            "Unset it (or set TRITON_INTERPRET=1) to run them on the CPU under Triton's "
            "interpreter.")
    # Must precede `import triton`'s first @triton.jit: the decorator reads it.
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - not installed
    raise ImportError(_MISSING) from exc

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime.interpreter import InterpretedFunction

    # Triton's own helpers (tl.zeros, tl.max, ...) are @triton.jit functions too, made into
    # interpreted ones only if the variable was set when triton was first imported.
    if not isinstance(tl.zeros, InterpretedFunction):
        raise ImportError(
            "flash_triton: triton was imported before flash_triton without TRITON_INTERPRET=1, "
            "so its interpreter cannot run the kernels here. Set TRITON_INTERPRET=1 in the "
            "environment, or import flash_triton before anything imports triton.")

__all__ = ["attention", "attention_with_lse", "attention_backward", "with_bug", "BUGS",
           "INTERPRETED", "DEVICE", "BLOCK_M", "BLOCK_N", "LOG2E",
           # the kernels themselves, public so that chapter 16 can print and read them
           "forward_kernel", "allowed_pairs", "dot_allowed", "backward_preprocess_kernel", "load_row_stats",
           "backward_dkdv_kernel", "backward_dq_kernel"]

#: True when the kernels run under Triton's interpreter (on the CPU), False when compiled.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: Where the tensors live: "cuda" when compiled, "cpu" under the interpreter.
DEVICE = "cuda" if HAS_CUDA and not INTERPRETED else "cpu"
#: Query rows and key columns of one tile (tl.dot needs each side >= 16).
BLOCK_M, BLOCK_N = 32, 32
#: log2(e): the factor that turns a natural exponent into a base-2 one, exp(x) = exp2(x·log2 e).
LOG2E = 1.4426950408889634
#: The bugs :func:`with_bug` can plant: name -> what the kernel then does.
BUGS = {"missing_rescale":
        "l and acc are not multiplied by alpha = exp2(m - m') when the max rises"}


# ---------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def allowed_pairs(offs_m, offs_k, n_k, shift, CAUSAL: tl.constexpr):
    # Which (row, key) pairs of the tile may attend: keys past Nk were loaded as zeros (their
    # score 0 is not "masked"), and under causal a key beyond the bottom-right diagonal
    # i + (Nk - Nq) is not allowed. (BLOCK_M, BLOCK_N), whatever CAUSAL is.
    allowed = (offs_k[None, :] < n_k) & (offs_m[:, None] >= 0)
    if CAUSAL:
        allowed = allowed & (offs_k[None, :] <= offs_m[:, None] + shift)
    return allowed


@triton.jit
def dot_allowed(a, b, allowed):
    # a @ b over the allowed pairs only: sum_j a_ij b_jc with j allowed for i. A masked pair's
    # weight is exactly 0, but IEEE makes 0 · inf = NaN, so when b may hold inf or NaN a plain
    # tl.dot would let a key's (or a row's) garbage into rows that may not see it. One product
    # per pair, selected: (M, N, C) values, so only for inputs that hold such numbers
    # (NONFINITE), as flash_lib's _flash_masked does for its rare key blocks.
    terms = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
    return tl.sum(tl.where(allowed[:, :, None], terms, 0.0), 1)


@triton.jit
def forward_kernel(
    Q, K, V, Mask, Out, Lse2,
    stride_qb, stride_qm, stride_kb, stride_kn, stride_vb, stride_vn,
    stride_mb, stride_mm, stride_ob, stride_om,
    n_q, n_k, d, dv, qk_scale,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NONFINITE: tl.constexpr, RESCALE: tl.constexpr,
):
    # One program = one block of BLOCK_M query rows of one (batch, head): FlashAttention-2's grid.
    # Its q tile, m, l and acc stay in registers for the whole key loop; only K and V stream in.
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)  # int64: bh·stride overflows int32 on large batches
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)  # BLOCK_D is d rounded up to a power of two (tl.arange's rule)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < n_q

    q = tl.load(Q + bh * stride_qb + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < d), other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, in base-2 units
    l = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)  # running sum of exp2(s - m) · v

    # Causal, bottom-right: row i may see keys j <= i + shift. The block's last row sees up to
    # start_m + BLOCK_M - 1 + shift, so key tiles from `hi` on are above the diagonal for every
    # row of the block and are never loaded; tiles before `full` are allowed for every row (its
    # first row sees them) and need no mask. Only the tiles in between -- the diagonal ones, and
    # the last, partial tile of the keys -- are masked.
    shift = n_k - n_q
    if CAUSAL:
        hi = tl.minimum(n_k, start_m + BLOCK_M + shift)
        full = tl.minimum(n_k, start_m + shift + 1)
    else:
        hi = n_k
        full = n_k

    for start_n in range(0, hi, BLOCK_N):
        offs_k = start_n + offs_n
        k = tl.load(K + bh * stride_kb + offs_k[:, None] * stride_kn + offs_d[None, :],
                    mask=(offs_k[:, None] < n_k) & (offs_d[None, :] < d), other=0.0)
        v = tl.load(V + bh * stride_vb + offs_k[:, None] * stride_vn + offs_dv[None, :],
                    mask=(offs_k[:, None] < n_k) & (offs_dv[None, :] < dv), other=0.0)
        # S = q k^T on the tensor cores, accumulated in fp32; one multiply applies the softmax
        # scale and the change of base together (qk_scale = scale · log2 e), so that the exp
        # below is exp2, the one the hardware computes (MUFU.EX2), with no extra multiply.
        # "ieee": fp32 inputs would otherwise be rounded to TF32 on NVIDIA GPUs.
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        allowed = allowed_pairs(offs_m, offs_k, n_k, shift, CAUSAL)
        if HAS_MASK:
            keep = tl.load(Mask + bh * stride_mb + offs_m[:, None] * stride_mm + offs_k[None, :],
                           mask=row_ok[:, None] & (offs_k[None, :] < n_k), other=0)
            allowed = allowed & (keep != 0)
        if HAS_MASK or NONFINITE or start_n + BLOCK_N > full:
            s = tl.where(allowed, s, float("-inf"))

        # The online softmax (chapter 2), in base 2: the new max, the tile's probabilities
        # against it, and the factor alpha that brings the old l and acc to the new max.
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row that has seen no allowed key yet has m_new = -inf; subtracting 0 instead keeps
        # exp2(-inf - m) at 0 rather than exp2(-inf + inf) = NaN (chapter 6's empty rows).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m - m_use)
        if RESCALE:  # False only to plant the classic bug (with_bug("missing_rescale"))
            l = l * alpha
            acc = acc * alpha[:, None]
        l = l + tl.sum(p, 1)
        # P · V on the tensor cores: p rounded to v's dtype (fp16 in, fp32 accumulate).
        if NONFINITE:  # v may hold inf or NaN: keep every masked pair out of the product
            acc += dot_allowed(p.to(v.dtype), v, allowed)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        m = m_new

    # The epilogue, once per row: divide by l (an empty row has l = 0 and acc = 0: out 0, not
    # 0/0), and store lse in base 2 (m + log2 l; -inf for an empty row), what the backward wants.
    l_safe = tl.where(l == 0.0, 1.0, l)
    out = acc / l_safe[:, None]
    tl.store(Out + bh * stride_ob + offs_m[:, None] * stride_om + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < dv))
    tl.store(Lse2 + bh * n_q + offs_m, m + tl.math.log2(l_safe), mask=row_ok)


@triton.jit
def backward_preprocess_kernel(Out, DOut, Delta, stride_ob, stride_om, n_q, dv,
                         BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    # D_i = rowsum(dO_i ∘ O_i) = Σ_j P_ij dP_ij, once per row, so that no backward program ever
    # needs a whole row of P: dS = P ∘ (dP - D).
    bh = tl.program_id(1).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    ok = (offs_m[:, None] < n_q) & (offs_dv[None, :] < dv)
    where = bh * stride_ob + offs_m[:, None] * stride_om + offs_dv[None, :]
    o = tl.load(Out + where, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DOut + where, mask=ok, other=0.0).to(tl.float32)
    tl.store(Delta + bh * n_q + offs_m, tl.sum(o * do, 1), mask=offs_m < n_q)


@triton.jit
def load_row_stats(Lse2, Delta, bh, offs_m, n_q):
    # FlashAttention's convention, here where it serves: an empty row's lse -inf becomes +inf,
    # so p = exp2(s - lse) is exactly 0 on it whatever s is. Rows past Nq read +inf too.
    lse2 = tl.load(Lse2 + bh * n_q + offs_m, mask=offs_m < n_q, other=float("inf"))
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
    delta = tl.load(Delta + bh * n_q + offs_m, mask=offs_m < n_q, other=0.0)
    return lse2, delta


@triton.jit
def backward_dkdv_kernel(
    Q, K, V, Mask, DOut, Lse2, Delta, DK, DV,
    stride_qb, stride_qm, stride_kb, stride_kn, stride_vb, stride_vn,
    stride_mb, stride_mm, stride_ob, stride_om,
    n_q, n_k, d, dv, qk_scale, scale,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NONFINITE: tl.constexpr,
):
    # Key blocks outside (chapter 12): this program owns one key block's dK_j and dV_j in
    # registers and walks the query blocks, so no two programs ever write the same dk, dv row.
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    offs_k = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_ok = offs_k < n_k
    k = tl.load(K + bh * stride_kb + offs_k[:, None] * stride_kn + offs_d[None, :],
                mask=key_ok[:, None] & (offs_d[None, :] < d), other=0.0)
    v = tl.load(V + bh * stride_vb + offs_k[:, None] * stride_vn + offs_dv[None, :],
                mask=key_ok[:, None] & (offs_dv[None, :] < dv), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    # Causal: query i sees key j iff i >= j - shift, so the query blocks before the one holding
    # row start_n - shift see none of this key block and are skipped.
    shift = n_k - n_q
    lo = 0
    if CAUSAL:
        lo = tl.maximum(0, start_n - shift) // BLOCK_M * BLOCK_M
    for start_m in range(lo, n_q, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < n_q
        q = tl.load(Q + bh * stride_qb + offs_m[:, None] * stride_qm + offs_d[None, :],
                    mask=row_ok[:, None] & (offs_d[None, :] < d), other=0.0)
        do = tl.load(DOut + bh * stride_ob + offs_m[:, None] * stride_om + offs_dv[None, :],
                     mask=row_ok[:, None] & (offs_dv[None, :] < dv), other=0.0)
        lse2, delta = load_row_stats(Lse2, Delta, bh, offs_m, n_q)
        # Recompute S and P from the saved lse: one exp2 per score, no max, no sum.
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        allowed = allowed_pairs(offs_m, offs_k, n_k, shift, CAUSAL)
        if HAS_MASK:
            keep = tl.load(Mask + bh * stride_mb + offs_m[:, None] * stride_mm + offs_k[None, :],
                           mask=row_ok[:, None] & key_ok[None, :], other=0)
            allowed = allowed & (keep != 0)
        s = tl.where(allowed, s, float("-inf"))
        p = tl.math.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        # the gradient with respect to the scaled scores; exactly 0 at a masked pair, even where
        # v's inf or NaN made its dp NaN
        ds = tl.where(allowed, p * (dp - delta[:, None]), 0.0)
        if NONFINITE:  # q or dout may hold inf or NaN at rows that may not see these keys
            dv_acc += dot_allowed(tl.trans(p.to(do.dtype)), do, tl.trans(allowed))
            dk += dot_allowed(tl.trans(ds.to(q.dtype)), q, tl.trans(allowed))
        else:
            dv_acc += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision="ieee")
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision="ieee")

    # S = scale · q k^T, so dK = scale · dS^T Q: one multiply per element, at the end.
    tl.store(DK + bh * stride_kb + offs_k[:, None] * stride_kn + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=key_ok[:, None] & (offs_d[None, :] < d))
    tl.store(DV + bh * stride_vb + offs_k[:, None] * stride_vn + offs_dv[None, :],
             dv_acc.to(DV.dtype.element_ty), mask=key_ok[:, None] & (offs_dv[None, :] < dv))


@triton.jit
def backward_dq_kernel(
    Q, K, V, Mask, DOut, Lse2, Delta, DQ,
    stride_qb, stride_qm, stride_kb, stride_kn, stride_vb, stride_vn,
    stride_mb, stride_mm, stride_ob, stride_om,
    n_q, n_k, d, dv, qk_scale, scale,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NONFINITE: tl.constexpr,
):
    # dQ_i = scale · Σ_j dS_ij K_j needs every key block's share. FlashAttention-2 adds them with
    # atomic adds from the key-block programs; a second pass over query blocks (this kernel, as
    # Triton's tutorial does) recomputes P once more and needs no atomics: the same bits on every
    # run, and the order of the sum is chapter 12's, key blocks in order.
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < n_q
    q = tl.load(Q + bh * stride_qb + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < d), other=0.0)
    do = tl.load(DOut + bh * stride_ob + offs_m[:, None] * stride_om + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv[None, :] < dv), other=0.0)
    lse2, delta = load_row_stats(Lse2, Delta, bh, offs_m, n_q)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    shift = n_k - n_q
    hi = n_k
    if CAUSAL:
        hi = tl.minimum(n_k, start_m + BLOCK_M + shift)
    for start_n in range(0, hi, BLOCK_N):
        offs_k = start_n + offs_n
        k = tl.load(K + bh * stride_kb + offs_k[:, None] * stride_kn + offs_d[None, :],
                    mask=(offs_k[:, None] < n_k) & (offs_d[None, :] < d), other=0.0)
        v = tl.load(V + bh * stride_vb + offs_k[:, None] * stride_vn + offs_dv[None, :],
                    mask=(offs_k[:, None] < n_k) & (offs_dv[None, :] < dv), other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        allowed = allowed_pairs(offs_m, offs_k, n_k, shift, CAUSAL)
        if HAS_MASK:
            keep = tl.load(Mask + bh * stride_mb + offs_m[:, None] * stride_mm + offs_k[None, :],
                           mask=row_ok[:, None] & (offs_k[None, :] < n_k), other=0)
            allowed = allowed & (keep != 0)
        s = tl.where(allowed, s, float("-inf"))
        p = tl.math.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = tl.where(allowed, p * (dp - delta[:, None]), 0.0)
        if NONFINITE:  # k may hold inf or NaN at keys these rows may not see
            dq += dot_allowed(ds.to(k.dtype), k, allowed)
        else:
            dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")

    tl.store(DQ + bh * stride_qb + offs_m[:, None] * stride_qm + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < d))


# ---------------------------------------------------------------------------------------------
# NumPy in, NumPy out
# ---------------------------------------------------------------------------------------------


def _check(q, k, v, mask, causal, scale):
    """The inputs, checked by flash_lib's own rules (``flash_lib.check_inputs``: shapes, dtypes,
    ``causal``, ``scale``), then this kernel's one restriction, and broadcast to one batch."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    mask = None if mask is None else np.asarray(mask)
    checked = flash_lib.check_inputs(q, k, v, mask=mask, causal=causal, scale=scale)
    batch, scale = checked.batch, checked.scale
    dtypes = {q.dtype, k.dtype, v.dtype}
    if len(dtypes) != 1 or q.dtype not in (np.float32, np.float16):
        raise TypeError("flash_triton takes q, k, v of one dtype, float32 or float16, got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    n_q, n_k = q.shape[-2], k.shape[-2]
    q = np.ascontiguousarray(np.broadcast_to(q, batch + q.shape[-2:]))
    k = np.ascontiguousarray(np.broadcast_to(k, batch + k.shape[-2:]))
    v = np.ascontiguousarray(np.broadcast_to(v, batch + v.shape[-2:]))
    if mask is not None:
        # A mask whose query axis is 1 (key padding) stays one row per sequence: stride 0.
        rows = n_q if mask.ndim >= 2 and mask.shape[-2] == n_q else 1
        mask = np.ascontiguousarray(np.broadcast_to(mask, batch + (rows, n_k))).view(np.int8)
    return q, k, v, mask, bool(causal), float(scale), batch


def _flat(x):
    """A contiguous (batch·heads, rows, cols) tensor on DEVICE (on the CPU, x's own memory)."""
    x = x.reshape((math.prod(x.shape[:-2]),) + x.shape[-2:])  # not -1: rows or cols may be 0
    # torch refuses to wrap a read-only array (a broadcast view) without a warning: copy it.
    return torch.from_numpy(x if x.flags.writeable else x.copy()).to(DEVICE)


def _nonfinite(*arrays):
    """Whether any of the arrays holds inf or NaN: the kernels then keep every masked pair out
    of their products (``dot_allowed``), one pass over the inputs to spare every other call."""
    return not all(np.isfinite(x).all() for x in arrays)


def _launch(kernel, grid, *args, **meta):
    """``kernel[grid](*args, **meta)``. Under the interpreter the kernel's arithmetic is NumPy's,
    which warns where IEEE arithmetic is defined and the kernel expects it (exp2(-inf), inf - inf
    on an input's NaN or inf, a NaN's comparisons; ``tl.max`` is ``np.nanmax``, which warns on
    a row of NaN scores): the answer is the kernel's, so no warning leaves the call. Compiled,
    there is nothing to silence."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "All-NaN slice encountered", RuntimeWarning)
        kernel[grid](*args, **meta)


def _common_args(q, k, v, mask, causal, scale):
    """The pointer, stride and size arguments every kernel takes, in their order."""
    tq, tk, tv = _flat(q), _flat(k), _flat(v)
    if mask is None:
        tm, stride_mb, stride_mm = tq, 0, 0  # never read: HAS_MASK is False
    else:
        tm = _flat(mask)
        stride_mb, stride_mm = tm.stride(0), (tm.stride(1) if tm.shape[1] > 1 else 0)
    n_q, d, n_k, dv = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    strides = (tq.stride(0), tq.stride(1), tk.stride(0), tk.stride(1), tv.stride(0), tv.stride(1),
               stride_mb, stride_mm)
    meta = dict(CAUSAL=causal, HAS_MASK=mask is not None, NONFINITE=_nonfinite(k, v),
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                BLOCK_D=triton.next_power_of_2(max(d, 16)),
                BLOCK_DV=triton.next_power_of_2(max(dv, 16)))
    return (tq, tk, tv, tm), strides, (n_q, n_k, d, dv, scale * LOG2E), meta


def _forward(q, k, v, mask, causal, scale, rescale=True):
    (tq, tk, tv, tm), strides, sizes, meta = _common_args(q, k, v, mask, causal, scale)
    n_bh, n_q, dv = tq.shape[0], q.shape[-2], v.shape[-1]
    out = torch.empty((n_bh, n_q, dv), dtype=tq.dtype, device=DEVICE)
    lse2 = torch.empty((n_bh, n_q), dtype=torch.float32, device=DEVICE)
    if n_bh and n_q:
        grid = (triton.cdiv(n_q, BLOCK_M), n_bh)
        _launch(forward_kernel, grid, tq, tk, tv, tm, out, lse2, *strides, out.stride(0),
                out.stride(1), *sizes, RESCALE=rescale, **meta)
    return out, lse2


def attention(q, k, v, *, causal=False, mask=None, scale=None, return_lse=False):
    """FlashAttention-2's forward pass, in Triton: ``softmax(scale · q k^T + mask) v``.

    Parameters
    ----------
    q, k, v : arrays ``(..., Nq, d)``, ``(..., Nk, d)``, ``(..., Nk, dv)``
        One dtype, float32 or float16; leading dims broadcast together (and with ``mask``'s).
    causal : bool
        Key ``j`` allowed for query ``i`` iff ``j <= i + Nk - Nq`` (bottom-right).
    mask : bool array broadcastable to ``(..., Nq, Nk)``, optional
        True = may attend; ANDed with ``causal``.
    scale : float, optional
        Multiplies the scores; ``1 / sqrt(d)`` by default.
    return_lse : bool
        Also return the natural log-sum-exp of each row's scaled, masked scores.

    Returns
    -------
    out : ndarray ``(..., Nq, dv)``, the input dtype
        0 on a row with no allowed key.
    lse : ndarray ``(..., Nq)``, float32, if ``return_lse``
        ``-inf`` on a row with no allowed key (flash_lib's convention; FlashAttention stores
        ``+inf``). The kernel keeps it in base 2; one multiply by ln 2 converts it here.
    """
    return _attention(q, k, v, causal=causal, mask=mask, scale=scale, return_lse=return_lse)


def _attention(q, k, v, *, causal=False, mask=None, scale=None, return_lse=False, rescale=True):
    q, k, v, mask, causal, scale, batch = _check(q, k, v, mask, causal, scale)
    out, lse2 = _forward(q, k, v, mask, causal, scale, rescale)
    out = out.cpu().numpy().reshape(batch + out.shape[-2:])
    if not return_lse:
        return out
    # base 2 -> natural: lse = lse2 · ln 2 (one multiply; -inf stays -inf)
    return out, (lse2.cpu().numpy() * np.float32(math.log(2))).reshape(batch + lse2.shape[-1:])


def attention_with_lse(q, k, v, *, causal=False, mask=None, scale=None):
    """``attention(..., return_lse=True)``: ``(out, lse)``, the form flash_check's ``lse``
    feature calls (``python -m flash_check flash_triton:attention_with_lse --features causal
    lse``), since flash_check passes no ``return_lse``."""
    return _attention(q, k, v, causal=causal, mask=mask, scale=scale, return_lse=True)


def with_bug(bug):
    """``attention_with_lse`` with one classic bug planted (a name from :data:`BUGS`), for
    chapter 16: it returns ``(out, lse)`` unless called with ``return_lse=False``.

    The same kernel, compiled (or interpreted) with a constexpr flag that removes one line's
    effect, so the chapter shows the bug without a second copy of the kernel."""
    if bug not in BUGS:
        raise ValueError(f"bug must be one of {list(BUGS)}, got {bug!r}")

    def buggy_attention(q, k, v, *, causal=False, mask=None, scale=None, return_lse=True):
        return _attention(q, k, v, causal=causal, mask=mask, scale=scale, return_lse=return_lse,
                          rescale=False)

    buggy_attention.__name__ = f"attention_with_{bug}"
    return buggy_attention


def attention_backward(q, k, v, out, lse, dout, *, causal=False, mask=None, scale=None):
    """The gradients ``dq, dk, dv`` of ``sum(dout * attention(q, k, v, ...))``, in Triton.

    FlashAttention-2's backward: a preprocess kernel computes ``D = rowsum(dout ∘ out)``; one
    program per key block (key blocks outside) recomputes ``P = exp2(S - lse)`` tile by tile and
    accumulates its ``dK_j``, ``dV_j``; one program per query block does the same for ``dQ_i``.

    Parameters
    ----------
    q, k, v, causal, mask, scale
        As for :func:`attention`, and the same as the forward call.
    out, lse
        What ``attention(..., return_lse=True)`` returned (``lse`` natural, ``-inf`` on empty
        rows); ``dout`` the gradient of the loss with respect to ``out``, of ``out``'s shape.

    Returns
    -------
    dq, dk, dv : ndarrays of q's, k's, v's shapes and dtype
        An input broadcast over leading dims gets the sum over them (as autograd gives it).
        Empty rows give ``dq = 0``; a key no row attends gets ``dk = dv = 0``.
    """
    shapes = (np.shape(q), np.shape(k), np.shape(v))
    q, k, v, mask, causal, scale, batch = _check(q, k, v, mask, causal, scale)
    n_q, dv = q.shape[-2], v.shape[-1]
    out, lse, dout = np.asarray(out), np.asarray(lse), np.asarray(dout)
    for name, x, shape in (("out", out, batch + (n_q, dv)), ("lse", lse, batch + (n_q,)),
                           ("dout", dout, batch + (n_q, dv))):
        if x.dtype.kind != "f":
            raise TypeError(f"{name} must be a float array, got dtype {x.dtype}")
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, what the forward returns for "
                             f"these q, k, v (and mask), got {x.shape}")
    (tq, tk, tv, tm), strides, sizes, meta = _common_args(q, k, v, mask, causal, scale)
    n_bh = tq.shape[0]
    tout = _flat(np.ascontiguousarray(out, dtype=q.dtype))
    tdout = _flat(np.ascontiguousarray(dout, dtype=q.dtype))
    # natural -> base 2, the kernel's unit: one multiply (an empty row's -inf stays -inf)
    lse2 = torch.from_numpy(np.ascontiguousarray(lse, dtype=np.float32).reshape(n_bh, n_q)
                            * np.float32(LOG2E)).to(DEVICE)
    delta = torch.empty((n_bh, n_q), dtype=torch.float32, device=DEVICE)
    dq, dk, dvv = torch.empty_like(tq), torch.empty_like(tk), torch.empty_like(tv)
    if n_bh and n_q and k.shape[-2]:
        o_strides = (tout.stride(0), tout.stride(1))
        _launch(backward_preprocess_kernel, (triton.cdiv(n_q, BLOCK_M), n_bh),
                tout, tdout, delta, *o_strides, n_q, dv, BLOCK_M=BLOCK_M,
                BLOCK_DV=meta["BLOCK_DV"])
        # the products with q and dout keep masked pairs out too when those hold inf or NaN
        meta["NONFINITE"] = _nonfinite(q, k, v, dout)
        tensors = (tq, tk, tv, tm, tdout, lse2, delta)
        _launch(backward_dkdv_kernel, (triton.cdiv(k.shape[-2], BLOCK_N), n_bh),
                *tensors, dk, dvv, *strides, *o_strides, *sizes, scale, **meta)
        _launch(backward_dq_kernel, (triton.cdiv(n_q, BLOCK_M), n_bh),
                *tensors, dq, *strides, *o_strides, *sizes, scale, **meta)
    else:  # nothing to attend, or no one attending: every gradient is 0
        dq.zero_(), dk.zero_(), dvv.zero_()
    grads = [t.cpu().numpy().reshape(x.shape) for t, x in ((dq, q), (dk, k), (dvv, v))]
    return tuple(flash_lib.sum_to(g, shape) for g, shape in zip(grads, shapes))

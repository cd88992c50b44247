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
           "FEATURES", "INTERPRETED", "DEVICE", "BLOCK_M", "BLOCK_N", "LOG2E",
           "forward_tensors", "backward_tensors", "GPU_CONFIGS", "INTERPRETER_CONFIG",
           "NONFINITE_CONFIG", "prune_configs",
           # the kernels themselves, public so that chapter 16 can print and read them
           "forward_kernel", "allowed_pairs", "dot_allowed", "mm", "dropout_keep",
           "backward_preprocess_kernel", "load_row_stats",
           "backward_dkdv_kernel", "backward_dq_kernel"]

#: True when the kernels run under Triton's interpreter (on the CPU), False when compiled.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: Where the tensors live: "cuda" when compiled, "cpu" under the interpreter.
DEVICE = "cuda" if HAS_CUDA and not INTERPRETED else "cpu"
#: log2(e): the factor that turns a natural exponent into a base-2 one, exp(x) = exp2(x·log2 e).
LOG2E = 1.4426950408889634
#: What flash_check may hold the kernels to (its ``features=``): flash_triton takes a mask,
#: causal, returns the lse (``attention_with_lse``), takes dv != d, sinks (with ``dsinks``
#: from the backward) and dropout with flash_lib's generator (``dropout_generator="flash_lib"``).
FEATURES = ("mask", "causal", "lse", "dv", "sinks", "dropout")
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
def mm(a, b, UPCAST: tl.constexpr):
    # a @ b on the tensor cores, accumulated in fp32 ("ieee": fp32 operands would otherwise be
    # rounded to TF32 on NVIDIA GPUs). UPCAST: only under the interpreter, whose tl.dot
    # multiplies bfloat16 operands wrongly (triton 3.7); their products are exact in fp32, so
    # widening them first changes no product.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def dropout_keep(seed, threshold, bh, rows, start_j,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr):
    # flash_lib.dropout_keep's mask for the tile's pairs, bit for bit: element (b, i, j), i and j
    # global positions, is kept iff its 16-bit number is >= threshold = round(p · 2^16). The
    # number: Philox4x32-7 (FlashAttention-2's round count) keyed by the seed, of the counter
    # (j // 8, i, b mod 2^32, b // 2^32); its word (j % 8) // 2, low half for even j, high half
    # for odd j. A pure function of (seed, b, i, j): the backward's tiles, in another order and
    # of other sizes, regenerate the forward's mask; no mask is ever stored.
    zero = tl.zeros([BLOCK_M, BLOCK_N // 8], tl.uint32)
    c1 = zero + rows.to(tl.uint32)[:, None]
    c2 = zero + (bh & 0xFFFFFFFF).to(tl.uint32)
    c3 = zero + (bh >> 32).to(tl.uint32)
    if ALIGNED:
        # start_j a multiple of 8: one counter gives 8 consecutive keys, so the tile needs
        # BLOCK_N / 8 counters per row, whose words interleave into the keys' numbers in order:
        # key 8c + 2w + h is word w's half h of counter c.
        c0 = zero + (start_j // 8 + tl.arange(0, BLOCK_N // 8)).to(tl.uint32)[None, :]
        r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3, n_rounds=7)
        # tl.join(a, b) stacks along a new last axis, the fastest-varying one: word w = 2y + x
        # sits at [..., y, x], so the pairs to join are (r0, r2) and (r1, r3)
        words = tl.join(tl.join(r0, r2), tl.join(r1, r3))  # (M, N/8, 2, 2)
        halves = tl.join(words & 0xFFFF, words >> 16)  # (M, N/8, 2, 2, 2): the half fastest
        numbers = tl.reshape(halves, (BLOCK_M, BLOCK_N))
    else:  # a key offset not a multiple of 8 (dropout_offset): one counter per key
        j = start_j + tl.arange(0, BLOCK_N)
        zero_n = tl.zeros([BLOCK_M, BLOCK_N], tl.uint32)
        c0 = zero_n + (j // 8).to(tl.uint32)[None, :]
        c1 = zero_n + rows.to(tl.uint32)[:, None]
        c2 = zero_n + (bh & 0xFFFFFFFF).to(tl.uint32)
        c3 = zero_n + (bh >> 32).to(tl.uint32)
        r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3, n_rounds=7)
        w = ((j % 8) // 2)[None, :]
        word = tl.where(w == 0, r0, tl.where(w == 1, r1, tl.where(w == 2, r2, r3)))
        numbers = tl.where((j % 2 == 0)[None, :], word & 0xFFFF, word >> 16)
    return numbers.to(tl.int32) >= threshold


@triton.jit
def forward_kernel(
    Q, K, V, Mask, Sinks, Out, Lse2,
    stride_qb, stride_qm, stride_kb, stride_kn, stride_vb, stride_vn,
    stride_mb, stride_mm, stride_ob, stride_om,
    n_q, n_k, d, dv, qk_scale, seed, drop_t, drop_scale, off_i, off_j, n_bucket,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SINKS: tl.constexpr,
    DROPOUT: tl.constexpr, DROP_ALIGNED: tl.constexpr, NONFINITE: tl.constexpr,
    UPCAST: tl.constexpr, RESCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # One program = one block of BLOCK_M query rows of one (batch, head): FlashAttention-2's grid.
    # Its q tile, m, l and acc stay in registers for the whole key loop; only K and V stream in.
    # (n_bucket is read by no line: it is the autotuner's key, the sizes rounded up.)
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)  # int64: bh·stride overflows int32 on large batches
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)  # BLOCK_D is d rounded up to a power of two (tl.arange's rule)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < n_q

    q = tl.load(Q + bh * stride_qb + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < d), other=0.0)
    if HAS_SINKS:
        # The sink is one more key of score `sink` (base 2: sink · log2 e) and value 0: the row
        # starts as if it had seen it, m = sink, l = exp2(sink - m) = 1, acc = 0.
        m = tl.zeros([BLOCK_M], tl.float32) + tl.load(Sinks + bh) * 1.4426950408889634
        l = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
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
        s = mm(q, tl.trans(k), UPCAST) * qk_scale
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
        l = l + tl.sum(p, 1)  # undropped: dropout changes the weights, not the softmax
        if DROPOUT:  # P ∘ Z: the dropped weights are 0; 1 / (1 - p) once per row, below
            p = tl.where(dropout_keep(seed, drop_t, bh, offs_m + off_i, start_n + off_j,
                                      BLOCK_M, BLOCK_N, DROP_ALIGNED), p, 0.0)
        # P · V on the tensor cores: p rounded to v's dtype (fp16 in, fp32 accumulate).
        if NONFINITE:  # v may hold inf or NaN: keep every masked pair out of the product
            acc += dot_allowed(p.to(v.dtype), v, allowed)
        else:
            acc += mm(p.to(v.dtype), v, UPCAST)
        m = m_new

    # The epilogue, once per row: divide by l (an empty row has l = 0 and acc = 0: out 0, not
    # 0/0), and store lse in base 2 (m + log2 l; -inf for an empty row), what the backward wants.
    l_safe = tl.where(l == 0.0, 1.0, l)
    out = acc / l_safe[:, None]
    if DROPOUT:
        out = out * drop_scale
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
    n_q, n_k, d, dv, qk_scale, scale, seed, drop_t, drop_scale, off_i, off_j, n_bucket,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    DROPOUT: tl.constexpr, DROP_ALIGNED: tl.constexpr, NONFINITE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
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
        s = mm(q, tl.trans(k), UPCAST) * qk_scale
        allowed = allowed_pairs(offs_m, offs_k, n_k, shift, CAUSAL)
        if HAS_MASK:
            keep = tl.load(Mask + bh * stride_mb + offs_m[:, None] * stride_mm + offs_k[None, :],
                           mask=row_ok[:, None] & key_ok[None, :], other=0)
            allowed = allowed & (keep != 0)
        s = tl.where(allowed, s, float("-inf"))
        p = tl.math.exp2(s - lse2[:, None])
        dp = mm(do, tl.trans(v), UPCAST)
        if DROPOUT:  # the forward's mask, regenerated: dV = (P∘Z/(1-p))ᵀ dO, dP ← dP∘Z/(1-p)
            z = dropout_keep(seed, drop_t, bh, offs_m + off_i, start_n + off_j,
                             BLOCK_M, BLOCK_N, DROP_ALIGNED)
            pv = tl.where(z, p * drop_scale, 0.0)
            dp = tl.where(z, dp * drop_scale, 0.0)
        else:
            pv = p
        # the gradient with respect to the scaled scores; exactly 0 at a masked pair, even where
        # v's inf or NaN made its dp NaN
        ds = tl.where(allowed, p * (dp - delta[:, None]), 0.0)
        if NONFINITE:  # q or dout may hold inf or NaN at rows that may not see these keys
            dv_acc += dot_allowed(tl.trans(pv.to(do.dtype)), do, tl.trans(allowed))
            dk += dot_allowed(tl.trans(ds.to(q.dtype)), q, tl.trans(allowed))
        else:
            dv_acc += mm(tl.trans(pv.to(do.dtype)), do, UPCAST)
            dk += mm(tl.trans(ds.to(q.dtype)), q, UPCAST)

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
    n_q, n_k, d, dv, qk_scale, scale, seed, drop_t, drop_scale, off_i, off_j, n_bucket,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    DROPOUT: tl.constexpr, DROP_ALIGNED: tl.constexpr, NONFINITE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
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
        s = mm(q, tl.trans(k), UPCAST) * qk_scale
        allowed = allowed_pairs(offs_m, offs_k, n_k, shift, CAUSAL)
        if HAS_MASK:
            keep = tl.load(Mask + bh * stride_mb + offs_m[:, None] * stride_mm + offs_k[None, :],
                           mask=row_ok[:, None] & (offs_k[None, :] < n_k), other=0)
            allowed = allowed & (keep != 0)
        s = tl.where(allowed, s, float("-inf"))
        p = tl.math.exp2(s - lse2[:, None])
        dp = mm(do, tl.trans(v), UPCAST)
        if DROPOUT:  # the same mask again, from the same (seed, b, i, j)
            z = dropout_keep(seed, drop_t, bh, offs_m + off_i, start_n + off_j,
                             BLOCK_M, BLOCK_N, DROP_ALIGNED)
            dp = tl.where(z, dp * drop_scale, 0.0)
        ds = tl.where(allowed, p * (dp - delta[:, None]), 0.0)
        if NONFINITE:  # k may hold inf or NaN at keys these rows may not see
            dq += dot_allowed(ds.to(k.dtype), k, allowed)
        else:
            dq += mm(ds.to(k.dtype), k, UPCAST)

    tl.store(DQ + bh * stride_qb + offs_m[:, None] * stride_qm + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < d))


# ---------------------------------------------------------------------------------------------
# Autotuning: the tile sizes, warps and pipeline stages a GPU tries, by head dimension
# ---------------------------------------------------------------------------------------------


def _config(block_m, block_n, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps,
                         num_stages=stages)


#: The configurations a compiled kernel's autotuner tries (the fastest is kept per key: the
#: head dims, causal, mask, dropout, non-finite inputs and the sizes rounded up to a power of
#: two), before :func:`prune_configs` drops those a head dimension rules out. Sources:
#:
#: * forward: Triton's tutorial 06 (``python/tutorials/06-fused-attention.py``, triton-lang/triton
#:   at 003da478): BLOCK_M in {64, 128} × BLOCK_N in {32, 64} × num_stages in {3, 4, 7} ×
#:   num_warps in {4, 8}, 8 warps only for tiles of 128 × 128 or more; plus FlashAttention-2's
#:   own choices on sm80/sm90 (``csrc/flash_attn/src/flash_fwd_launch_template.h``,
#:   Dao-AILab/flash-attention at 0251105a): 128 × 128, 4 warps at d = 64 (128 × 64 with
#:   dropout); 128 × 64, 4 warps at d = 128 (128 × 32 with dropout);
#: * backward: the tutorial's fixed choice, 4 warps, 5 stages, 32 × 128 tiles for dK/dV (32
#:   query rows against 128 keys) and 128 × 32 for dQ; and FlashAttention-2's
#:   (``flash_bwd_launch_template.h``): 128 × 128 with 8 warps at d = 64, 64 × 128 with 8 warps
#:   at d = 128 (on GPUs with 144 KiB of shared memory per block or more, A100 and H100).
GPU_CONFIGS = {
    "forward": [_config(m, n, w, s) for m in (64, 128) for n in (32, 64) for s in (3, 4, 7)
                for w in (4, 8) if w == 4 or m * n >= 128 * 128]
    + [_config(128, 128, 4, s) for s in (2, 3)] + [_config(128, 128, 8, 2)],
    "dkdv": [_config(32, 128, 4, 5), _config(64, 128, 8, 2), _config(128, 128, 8, 2),
             _config(64, 64, 4, 3)],
    "dq": [_config(128, 32, 4, 5), _config(64, 64, 4, 3), _config(128, 64, 8, 2)],
}
#: Under the interpreter: one configuration, small tiles (each program is NumPy calls on a CPU,
#: so a small tile wastes less on the partial tiles of small test shapes), and nothing to time.
INTERPRETER_CONFIG = _config(32, 32, 4, 1)
#: Query rows and key columns of one tile under the interpreter (tl.dot needs each side >= 16).
BLOCK_M, BLOCK_N = INTERPRETER_CONFIG.kwargs["BLOCK_M"], INTERPRETER_CONFIG.kwargs["BLOCK_N"]
#: The tile of the kernels' slow path for inputs holding inf or NaN (dot_allowed holds
#: BLOCK_M · BLOCK_N · d products at once): compiled, the smallest tl.dot allows.
NONFINITE_CONFIG = _config(16, 16, 4, 1)


def prune_configs(configs, d, dropout=False, nonfinite=False):
    """The configurations of ``configs`` a GPU tries for head dimension ``d`` (the larger of d
    and dv, rounded up to a power of two): FlashAttention-2's rule that a 128 × 128 tile is for
    d <= 64 only (at d = 128 its fp32 S and acc over 4 warps need 256 registers a thread, over
    the 255 limit), the same with dropout (its mask costs registers too: FlashAttention-2 halves
    BLOCK_N), and past d = 128 nothing over 64 × 64 with more than 3 stages (shared memory).
    With inputs holding inf or NaN: :data:`NONFINITE_CONFIG` alone."""
    if nonfinite:
        return [NONFINITE_CONFIG]
    kept = []
    for c in configs:
        m, n = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        if m * n >= 128 * 128 and (d > 64 or dropout):
            continue
        if d > 128 and (m * n > 64 * 64 or c.num_stages > 3):
            continue
        kept.append(c)
    return kept or [_config(32, 32, 4, 2)]


def _prune(configs, named_args, **kwargs):
    """The autotuner's early_config_prune: :func:`prune_configs` on the launch's constexprs."""
    return prune_configs(configs, max(kwargs["BLOCK_D"], kwargs["BLOCK_DV"]),
                         kwargs["DROPOUT"], kwargs["NONFINITE"])


KEY = ["n_bucket", "BLOCK_D", "BLOCK_DV", "CAUSAL", "HAS_MASK", "DROPOUT", "NONFINITE"]


def _tuned(kernel, which):
    """The kernel as launched: autotuned over :data:`GPU_CONFIGS` when compiled, with the one
    :data:`INTERPRETER_CONFIG` under the interpreter (then nothing is timed)."""
    if INTERPRETED:
        return triton.autotune([INTERPRETER_CONFIG], key=[])(kernel)
    return triton.autotune(GPU_CONFIGS[which], key=KEY,
                           prune_configs_by={"early_config_prune": _prune})(kernel)


_forward_tuned = _tuned(forward_kernel, "forward")
_dkdv_tuned = _tuned(backward_dkdv_kernel, "dkdv")
_dq_tuned = _tuned(backward_dq_kernel, "dq")
#: Rows per program of the backward's preprocess kernel (D = rowsum(dO ∘ O)), as Triton's
#: tutorial (PRE_BLOCK = 128) when compiled.
PRE_BLOCK = BLOCK_M if INTERPRETED else 128


# ---------------------------------------------------------------------------------------------
# Tensors in, tensors out (on DEVICE): what the NumPy functions below and bench/bench_gpu.py call
# ---------------------------------------------------------------------------------------------


def _grid(n, block, n_bh):
    """A launch grid over ``n`` rows (or keys) of each of ``n_bh`` (batch, head) pairs, for the
    autotuner: ``block`` names the configuration's block size along ``n``."""
    return lambda meta: (triton.cdiv(n, meta[block]), n_bh)


def _launch(kernel, grid, *args, **meta):
    """``kernel[grid](*args, **meta)``. Under the interpreter the kernel's arithmetic is NumPy's,
    which warns where IEEE arithmetic is defined and the kernel expects it (exp2(-inf), inf - inf
    on an input's NaN or inf, a NaN's comparisons; ``tl.max`` is ``np.nanmax``, which warns on
    a row of NaN scores): the answer is the kernel's, so no warning leaves the call. Compiled,
    there is nothing to silence."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "All-NaN slice encountered", RuntimeWarning)
        kernel[grid](*args, **meta)


def _dropout_args(dropout_p, dropout_seed, dropout_offset):
    """The kernels' dropout scalars: seed, threshold t = round(p · 2^16) (flash_lib's rule: kept
    iff the 16-bit number is >= t), 1 / (1 - p) in float32 (flash_lib's dropout_scale), the row
    and key offsets, and whether the key offset keeps tiles on 8-key counters."""
    if not dropout_p:
        return dict(seed=0, drop_t=0, drop_scale=1.0, off_i=0, off_j=0), False, True
    p = np.float32(dropout_p)
    scale = float(np.float32(1) / (np.float32(1) - p))
    off_i, off_j = (int(x) for x in dropout_offset)
    return (dict(seed=int(dropout_seed), drop_t=round(float(dropout_p) * 2**16), drop_scale=scale,
                 off_i=off_i, off_j=off_j), True, off_j % 8 == 0)


def _sizes(q, k, v, mask):
    """The stride and size arguments every kernel takes, and the (mask tensor, its strides)."""
    if mask is None:
        tm, stride_mb, stride_mm = q, 0, 0  # never read: HAS_MASK is False
    else:
        tm, stride_mb = mask, mask.stride(0)
        stride_mm = mask.stride(1) if mask.shape[1] > 1 else 0  # key padding: one row, stride 0
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               stride_mb, stride_mm)
    return tm, strides


def _constexprs(q, k, v, mask, causal, dropout, aligned, nonfinite):
    d, dv = q.shape[-1], v.shape[-1]
    return dict(CAUSAL=causal, HAS_MASK=mask is not None, DROPOUT=dropout, DROP_ALIGNED=aligned,
                NONFINITE=nonfinite, UPCAST=INTERPRETED and q.dtype == torch.bfloat16,
                BLOCK_D=triton.next_power_of_2(max(d, 16)),
                BLOCK_DV=triton.next_power_of_2(max(dv, 16)))


def _bucket(n_q, n_k):
    """The autotuner's size key: the larger length rounded up to a power of two (from 128), so
    that each size class is tuned once, not every length."""
    return triton.next_power_of_2(max(n_q, n_k, 128))


def forward_tensors(q, k, v, *, scale, causal=False, mask=None, sinks=None, dropout_p=0.0,
                    dropout_seed=0, dropout_offset=(0, 0), nonfinite=False, rescale=True):
    """The forward on tensors already on :data:`DEVICE`: ``(out, lse2)``.

    ``q``, ``k``, ``v``: ``(BH, Nq, d)``, ``(BH, Nk, d)``, ``(BH, Nk, dv)`` tensors of one dtype
    (float32, float16 or bfloat16), each row contiguous (last stride 1); ``mask`` None or an int8
    ``(BH, Nq or 1, Nk)`` tensor (nonzero = may attend); ``sinks`` None or a float32 ``(BH,)``
    tensor; ``scale`` a float. No checks: :func:`attention` checks, then calls this;
    ``bench/bench_gpu.py`` calls it on tensors it made. ``nonfinite``: the inputs may hold inf or
    NaN (the kernels then keep masked pairs out of every product). Returns ``out`` ``(BH, Nq,
    dv)`` in q's dtype and ``lse2``, the log-sum-exp in base 2 (float32 ``(BH, Nq)``, -inf on an
    empty row), what :func:`backward_tensors` takes."""
    n_bh, n_q, n_k = q.shape[0], q.shape[1], k.shape[1]
    out = torch.empty((n_bh, n_q, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse2 = torch.empty((n_bh, n_q), dtype=torch.float32, device=q.device)
    if not (n_bh and n_q):
        return out, lse2
    drop, dropout, aligned = _dropout_args(dropout_p, dropout_seed, dropout_offset)
    tm, strides = _sizes(q, k, v, mask)
    _launch(_forward_tuned, _grid(n_q, "BLOCK_M", n_bh), q, k, v, tm,
            q if sinks is None else sinks, out, lse2, *strides, out.stride(0), out.stride(1),
            n_q, n_k, q.shape[-1], v.shape[-1], scale * LOG2E, drop["seed"], drop["drop_t"],
            drop["drop_scale"], drop["off_i"], drop["off_j"], _bucket(n_q, n_k),
            HAS_SINKS=sinks is not None, RESCALE=rescale,
            **_constexprs(q, k, v, mask, causal, dropout, aligned, nonfinite))
    return out, lse2


def backward_tensors(q, k, v, out, lse2, dout, *, scale, causal=False, mask=None, sinks=None,
                     dropout_p=0.0, dropout_seed=0, dropout_offset=(0, 0), nonfinite=False):
    """The backward on tensors on :data:`DEVICE`, as :func:`forward_tensors` takes them, with
    its ``out`` and ``lse2`` and ``dout`` (of out's shape and dtype): ``(dq, dk, dv, dsinks)``,
    ``dsinks`` a float32 ``(BH,)`` tensor (``-Σ_i exp2(sink2 - lse2_i)·D_i``) or None."""
    n_bh, n_q, n_k, dv = q.shape[0], q.shape[1], k.shape[1], v.shape[-1]
    dq, dk, dvv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = torch.zeros((n_bh, n_q), dtype=torch.float32, device=q.device)
    if n_bh and n_q and n_k:
        drop, dropout, aligned = _dropout_args(dropout_p, dropout_seed, dropout_offset)
        tm, strides = _sizes(q, k, v, mask)
        meta = _constexprs(q, k, v, mask, causal, dropout, aligned, nonfinite)
        o_strides = (out.stride(0), out.stride(1))
        _launch(backward_preprocess_kernel, (triton.cdiv(n_q, PRE_BLOCK), n_bh), out, dout,
                delta, *o_strides, n_q, dv, BLOCK_M=PRE_BLOCK, BLOCK_DV=meta["BLOCK_DV"])
        args = (*strides, *o_strides, n_q, n_k, q.shape[-1], dv, scale * LOG2E, scale,
                drop["seed"], drop["drop_t"], drop["drop_scale"], drop["off_i"], drop["off_j"],
                _bucket(n_q, n_k))
        tensors = (q, k, v, tm, dout, lse2, delta)
        _launch(_dkdv_tuned, _grid(n_k, "BLOCK_N", n_bh), *tensors, dk, dvv, *args, **meta)
        _launch(_dq_tuned, _grid(n_q, "BLOCK_M", n_bh), *tensors, dq, *args, **meta)
    dsinks = None
    if sinks is not None:
        # the sink's weight in each row, exp2(sink2 - lse2), against that row's D; an empty
        # row (no keys at all) has D = 0
        dsinks = -(torch.exp2(sinks[:, None] * LOG2E - lse2) * delta).sum(dim=1)
    return dq, dk, dvv, dsinks


# ---------------------------------------------------------------------------------------------
# NumPy in, NumPy out
# ---------------------------------------------------------------------------------------------


def _is_bfloat16(dtype):
    return np.dtype(dtype).name == "bfloat16"


def _check(q, k, v, mask, causal, scale, sinks=None, dropout_p=0.0, dropout_seed=None,
           dropout_offset=(0, 0)):
    """The inputs, checked by flash_lib's own rules (``flash_lib.check_inputs``: shapes, dtypes,
    ``causal``, ``scale``, ``sinks``, the dropout arguments), then this kernel's one restriction,
    and broadcast to one batch; ``sinks`` float32, one per (batch, head)."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    mask = None if mask is None else np.asarray(mask)
    checked = flash_lib.check_inputs(q, k, v, mask=mask, causal=causal, scale=scale, sinks=sinks,
                                     dropout_p=dropout_p, dropout_seed=dropout_seed,
                                     dropout_offset=dropout_offset)
    batch, scale = checked.batch, checked.scale
    dtypes = {q.dtype, k.dtype, v.dtype}
    if len(dtypes) != 1 or not (q.dtype in (np.float32, np.float16) or _is_bfloat16(q.dtype)):
        raise TypeError("flash_triton takes q, k, v of one dtype, float32, float16 or bfloat16, "
                        f"got {q.dtype}, {k.dtype}, {v.dtype}")
    n_q, n_k = q.shape[-2], k.shape[-2]
    q = np.ascontiguousarray(np.broadcast_to(q, batch + q.shape[-2:]))
    k = np.ascontiguousarray(np.broadcast_to(k, batch + k.shape[-2:]))
    v = np.ascontiguousarray(np.broadcast_to(v, batch + v.shape[-2:]))
    if mask is not None:
        # A mask whose query axis is 1 (key padding) stays one row per sequence: stride 0.
        rows = n_q if mask.ndim >= 2 and mask.shape[-2] == n_q else 1
        mask = np.ascontiguousarray(np.broadcast_to(mask, batch + (rows, n_k))).view(np.int8)
    if sinks is not None:
        sinks = np.broadcast_to(np.asarray(sinks, np.float32), batch).reshape(-1).copy()
    return q, k, v, mask, bool(causal), float(scale), batch, sinks


def _flat(x):
    """A contiguous (batch·heads, rows, cols) tensor on DEVICE (on the CPU, x's own memory)."""
    x = x.reshape((math.prod(x.shape[:-2]),) + x.shape[-2:])  # not -1: rows or cols may be 0
    # torch refuses to wrap a read-only array (a broadcast view) without a warning: copy it.
    x = x if x.flags.writeable else x.copy()
    if _is_bfloat16(x.dtype):  # torch knows no NumPy bfloat16 (ml_dtypes): its bits, re-read
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).to(DEVICE)
    return torch.from_numpy(x).to(DEVICE)


def _numpy(t, dtype):
    """A tensor back to NumPy, in ``dtype`` (bfloat16 through its bits)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(dtype)
    return t.cpu().numpy()


def _nonfinite(*arrays):
    """Whether any of the arrays holds inf or NaN: the kernels then keep every masked pair out
    of their products (``dot_allowed``), one pass over the inputs to spare every other call."""
    return not all(np.isfinite(x.astype(np.float32) if _is_bfloat16(x.dtype) else x).all()
                   for x in arrays)


def _tensors(q, k, v, mask, sinks):
    return (_flat(q), _flat(k), _flat(v), None if mask is None else _flat(mask),
            None if sinks is None else torch.from_numpy(sinks).to(DEVICE))


def attention(q, k, v, *, causal=False, mask=None, scale=None, return_lse=False, sinks=None,
              dropout_p=0.0, dropout_seed=None, dropout_offset=(0, 0)):
    """FlashAttention-2's forward pass, in Triton: ``softmax(scale · q k^T + mask) v``.

    Parameters
    ----------
    q, k, v : arrays ``(..., Nq, d)``, ``(..., Nk, d)``, ``(..., Nk, dv)``
        One dtype, float32, float16 or bfloat16 (``ml_dtypes``); leading dims broadcast together
        (and with ``mask``'s).
    causal : bool
        Key ``j`` allowed for query ``i`` iff ``j <= i + Nk - Nq`` (bottom-right).
    mask : bool array broadcastable to ``(..., Nq, Nk)``, optional
        True = may attend; ANDed with ``causal``.
    scale : float, optional
        Multiplies the scores; ``1 / sqrt(d)`` by default.
    return_lse : bool
        Also return the natural log-sum-exp of each row's scaled, masked scores.
    sinks : array, optional
        flash_lib's attention sinks: one finite logit per head, broadcastable to the leading
        dims; each row's softmax gets one more key of score ``sink`` and value 0.
    dropout_p, dropout_seed, dropout_offset
        flash_lib's dropout: ``out = (P ∘ Z / (1 - p)) V`` with ``Z`` the mask of
        :func:`flash_lib.dropout_keep` for this seed and offset, bit for bit (Philox4x32-7,
        computed tile by tile in the kernel); the lse is the undropped one.

    Returns
    -------
    out : ndarray ``(..., Nq, dv)``, the input dtype
        0 on a row with no allowed key.
    lse : ndarray ``(..., Nq)``, float32, if ``return_lse``
        ``-inf`` on a row with no allowed key (flash_lib's convention; FlashAttention stores
        ``+inf``), ``sink`` there with sinks. The kernel keeps it in base 2; one multiply by
        ln 2 converts it here.
    """
    return _attention(q, k, v, causal=causal, mask=mask, scale=scale, return_lse=return_lse,
                      sinks=sinks, dropout_p=dropout_p, dropout_seed=dropout_seed,
                      dropout_offset=dropout_offset)


def _attention(q, k, v, *, causal=False, mask=None, scale=None, return_lse=False, sinks=None,
               dropout_p=0.0, dropout_seed=None, dropout_offset=(0, 0), rescale=True):
    q, k, v, mask, causal, scale, batch, sinks = _check(q, k, v, mask, causal, scale, sinks,
                                                        dropout_p, dropout_seed, dropout_offset)
    tq, tk, tv, tm, ts = _tensors(q, k, v, mask, sinks)
    out, lse2 = forward_tensors(tq, tk, tv, scale=scale, causal=causal, mask=tm, sinks=ts,
                                dropout_p=dropout_p, dropout_seed=dropout_seed,
                                dropout_offset=dropout_offset, nonfinite=_nonfinite(k, v),
                                rescale=rescale)
    out = _numpy(out, q.dtype).reshape(batch + out.shape[-2:])
    if not return_lse:
        return out
    # base 2 -> natural: lse = lse2 · ln 2 (one multiply; -inf stays -inf)
    return out, (lse2.cpu().numpy() * np.float32(math.log(2))).reshape(batch + lse2.shape[-1:])


def attention_with_lse(q, k, v, *, causal=False, mask=None, scale=None, sinks=None,
                       dropout_p=0.0, dropout_seed=None, dropout_offset=(0, 0)):
    """``attention(..., return_lse=True)``: ``(out, lse)``, the form flash_check's ``lse``
    feature calls (``python -m flash_check flash_triton:attention_with_lse --features causal
    lse``), since flash_check passes no ``return_lse``."""
    return _attention(q, k, v, causal=causal, mask=mask, scale=scale, return_lse=True,
                      sinks=sinks, dropout_p=dropout_p, dropout_seed=dropout_seed,
                      dropout_offset=dropout_offset)


def with_bug(bug):
    """``attention_with_lse`` with one classic bug planted (a name from :data:`BUGS`), for
    chapter 16: it returns ``(out, lse)`` unless called with ``return_lse=False``.

    The same kernel, compiled (or interpreted) with a constexpr flag that removes one line's
    effect, so the chapter shows the bug without a second copy of the kernel."""
    if bug not in BUGS:
        raise ValueError(f"bug must be one of {list(BUGS)}, got {bug!r}")

    def buggy_attention(q, k, v, *, causal=False, mask=None, scale=None, return_lse=True,
                        **variants):
        return _attention(q, k, v, causal=causal, mask=mask, scale=scale, return_lse=return_lse,
                          rescale=False, **variants)

    buggy_attention.__name__ = f"attention_with_{bug}"
    return buggy_attention


def attention_backward(q, k, v, out, lse, dout, *, causal=False, mask=None, scale=None,
                       sinks=None, dropout_p=0.0, dropout_seed=None, dropout_offset=(0, 0)):
    """The gradients ``dq, dk, dv`` of ``sum(dout * attention(q, k, v, ...))``, in Triton.

    FlashAttention-2's backward: a preprocess kernel computes ``D = rowsum(dout ∘ out)``; one
    program per key block (key blocks outside) recomputes ``P = exp2(S - lse)`` tile by tile and
    accumulates its ``dK_j``, ``dV_j``; one program per query block does the same for ``dQ_i``.
    With dropout each tile regenerates the forward's mask from the seed.

    Parameters
    ----------
    q, k, v, causal, mask, scale, sinks, dropout_p, dropout_seed, dropout_offset
        As for :func:`attention`, and the same as the forward call.
    out, lse
        What ``attention(..., return_lse=True)`` returned (``lse`` natural, ``-inf`` on empty
        rows); ``dout`` the gradient of the loss with respect to ``out``, of ``out``'s shape.

    Returns
    -------
    dq, dk, dv : ndarrays of q's, k's, v's shapes and dtype
        An input broadcast over leading dims gets the sum over them (as autograd gives it).
        Empty rows give ``dq = 0``; a key no row attends gets ``dk = dv = 0``.
    dsinks : ndarray, only with ``sinks``
        Of sinks' shape, float32: ``-Σ_i exp(sink - lse_i) · D_i`` over each head's rows,
        summed over the axes sinks was broadcast along (flash_lib's).
    """
    shapes = (np.shape(q), np.shape(k), np.shape(v))
    sinks_shape = None if sinks is None else np.shape(sinks)
    q, k, v, mask, causal, scale, batch, sinks = _check(q, k, v, mask, causal, scale, sinks,
                                                        dropout_p, dropout_seed, dropout_offset)
    n_q, dv = q.shape[-2], v.shape[-1]
    out, lse, dout = np.asarray(out), np.asarray(lse), np.asarray(dout)
    for name, x, shape in (("out", out, batch + (n_q, dv)), ("lse", lse, batch + (n_q,)),
                           ("dout", dout, batch + (n_q, dv))):
        if x.dtype.kind != "f" and not _is_bfloat16(x.dtype):
            raise TypeError(f"{name} must be a float array, got dtype {x.dtype}")
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, what the forward returns for "
                             f"these q, k, v (and mask), got {x.shape}")
    tq, tk, tv, tm, ts = _tensors(q, k, v, mask, sinks)
    tout = _flat(np.ascontiguousarray(out.astype(q.dtype)))
    tdout = _flat(np.ascontiguousarray(dout.astype(q.dtype)))
    # natural -> base 2, the kernel's unit: one multiply (an empty row's -inf stays -inf)
    lse2 = torch.from_numpy(np.ascontiguousarray(lse, dtype=np.float32).reshape(tq.shape[:2])
                            * np.float32(LOG2E)).to(DEVICE)
    dq, dk, dvv, dsinks = backward_tensors(
        tq, tk, tv, tout, lse2, tdout, scale=scale, causal=causal, mask=tm, sinks=ts,
        dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
        # the products with q and dout keep masked pairs out too when those hold inf or NaN
        nonfinite=_nonfinite(q, k, v, dout))
    grads = [_numpy(t, x.dtype).reshape(x.shape) for t, x in ((dq, q), (dk, k), (dvv, v))]
    grads = tuple(flash_lib.sum_to(g, shape) for g, shape in zip(grads, shapes))
    if sinks is None:
        return grads
    dsinks = dsinks.cpu().numpy().reshape(batch)
    return grads + (flash_lib.sum_to(dsinks, sinks_shape),)

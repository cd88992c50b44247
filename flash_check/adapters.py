"""Real kernels as kernels for :func:`flash_check.check_kernel`, through thin wrappers: PyTorch's
``scaled_dot_product_attention`` and its CPU flash op, JAX's ``dot_product_attention``.

Re-exported by ``flash_check`` (``flash_check.torch_sdpa`` and so on). Each imports its library
when called, so flash_check works without either installed. Also the layout wrappers of the
serving cases, :func:`varlen_from_thd` and :func:`from_bshd` (``flash_check.adapters.…``), for a
kernel written in FlashAttention's own layouts.
"""

from __future__ import annotations

import numpy as np

import flash_lib


def _flatten_batch(q, k, v, mask, causal, causal_alignment):
    """(B, N, d) views of q, k, v, and the combined boolean mask (B, Nq, Nk) or None."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    batch = q.shape[:-2]
    flat = [np.ascontiguousarray(x).reshape((-1,) + x.shape[-2:]) for x in (q, k, v)]
    allowed = None if mask is None else np.broadcast_to(mask, batch + (n_q, n_k))
    if causal:
        tri = (flash_lib.causal_mask(n_q, n_k) if causal_alignment == "bottom-right"
               else np.tril(np.ones((n_q, n_k), dtype=bool)))  # top-left: j <= i
        allowed = np.broadcast_to(tri, batch + (n_q, n_k)) if allowed is None else allowed & tri
    if allowed is not None:
        allowed = np.ascontiguousarray(allowed).reshape(-1, n_q, n_k)
    return flat, allowed, batch


def _alignment(causal_alignment):
    if causal_alignment not in ("bottom-right", "top-left"):
        raise ValueError(f"causal_alignment must be 'bottom-right' or 'top-left', got "
                         f"{causal_alignment!r}")
    return causal_alignment


def torch_sdpa(backend="math", *, causal_alignment="bottom-right", device="cpu"):
    """PyTorch's ``scaled_dot_product_attention`` as a kernel for :func:`check_kernel`.

    ``backend`` ("math", "flash", "efficient", "cudnn") is forced with ``sdpa_kernel``, so the
    call fails rather than silently running another one. NumPy arrays go to ``device`` as
    (batch, 1 head, N, d) tensors and come back. ``causal=True`` becomes PyTorch's own
    bottom-right bias, ``torch.nn.attention.bias.causal_lower_right`` (without a mask), or
    ``is_causal=True`` with ``causal_alignment="top-left"``, PyTorch's convention (its docs:
    ``torch.ones(L, S).tril(diagonal=0)``); with a mask, the causal triangle is ANDed into it.
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    backends = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    if backend not in backends:
        raise ValueError(f"backend must be one of {list(backends)}, got {backend!r}")
    _alignment(causal_alignment)

    def sdpa(q, k, v, *, mask=None, causal=False, scale=None):
        n_q, n_k = q.shape[-2], k.shape[-2]
        if mask is None and causal:  # PyTorch's own causal: top-left flag or bottom-right bias
            (tq, tk, tv), _, batch = _flatten_batch(q, k, v, None, False, causal_alignment)
            bias = causal_lower_right(n_q, n_k) if causal_alignment == "bottom-right" else None
            is_causal = causal_alignment == "top-left"
        else:
            (tq, tk, tv), allowed, batch = _flatten_batch(q, k, v, mask, causal, causal_alignment)
            bias = None if allowed is None else torch.from_numpy(allowed[:, None]).to(device)
            is_causal = False
        tq, tk, tv = (torch.from_numpy(x[:, None]).to(device) for x in (tq, tk, tv))
        with sdpa_kernel(backends[backend]):
            out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=bias,
                                                 is_causal=is_causal, scale=scale)
        return out[:, 0].cpu().numpy().reshape(batch + out.shape[-2:])

    sdpa.__qualname__ = f"torch_sdpa(backend={backend!r}, causal_alignment={causal_alignment!r})"
    return sdpa


def torch_flash_for_cpu_with_lse(q, k, v, *, mask=None, causal=False, scale=None):
    """PyTorch's private CPU flash op, which also returns the lse: ``(out, lse)``.

    ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` (what SDPA's flash backend
    runs on the CPU); it takes an additive float mask, so the boolean mask (and a bottom-right
    causal triangle) becomes 0 / -inf. Its lse of a fully masked row is 0.0: check it with
    ``lse_empty=0.0``. A private op: its signature may change between releases.
    """
    import torch

    (tq, tk, tv), allowed, batch = _flatten_batch(q, k, v, mask, causal, "bottom-right")
    tq, tk, tv = (torch.from_numpy(x[:, None]) for x in (tq, tk, tv))
    bias = None
    if allowed is not None:
        bias = torch.zeros(allowed[:, None].shape, dtype=tq.dtype)
        bias.masked_fill_(torch.from_numpy(~allowed[:, None]), float("-inf"))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = op(tq, tk, tv, attn_mask=bias, scale=scale)
    return (out[:, 0].numpy().reshape(batch + out.shape[-2:]),
            lse[:, 0].numpy().reshape(batch + lse.shape[-1:]))


def jax_dot_product_attention(*, causal_alignment="bottom-right", implementation="xla"):
    """``jax.nn.dot_product_attention`` as a kernel for :func:`check_kernel`.

    Turns on ``jax_enable_x64`` (process-wide) so float64 stays float64, and runs it under
    ``jax.jit``: XLA compiles it once per shape and dtype (about a second each on a busy 2-core
    machine, so a full check takes a minute). Arrays go in as (batch, N, 1 head, d), JAX's layout. ``causal=True`` becomes an explicit bottom-right mask,
    or ``is_causal=True`` with ``causal_alignment="top-left"``, JAX's own convention.
    """
    import jax

    jax.config.update("jax_enable_x64", True)
    _alignment(causal_alignment)
    # Compiled once per shape and dtype, as a model would run it (eager dispatch compiles every
    # primitive separately and is several times slower to start).
    compiled = jax.jit(jax.nn.dot_product_attention,
                       static_argnames=("is_causal", "implementation"))

    def attention(q, k, v, *, mask=None, causal=False, scale=None):
        if mask is None and causal and causal_alignment == "top-left":
            (jq, jk, jv), allowed, batch = _flatten_batch(q, k, v, None, False, "top-left")
            is_causal = True
        else:
            (jq, jk, jv), allowed, batch = _flatten_batch(q, k, v, mask, causal, causal_alignment)
            is_causal = False
        out = compiled(
            jq[:, :, None], jk[:, :, None], jv[:, :, None], scale=scale, is_causal=is_causal,
            mask=None if allowed is None else allowed[:, None], implementation=implementation)
        return np.asarray(out)[:, :, 0].reshape(batch + out.shape[1:2] + out.shape[-1:])

    attention.__qualname__ = (f"jax_dot_product_attention(causal_alignment="
                              f"{causal_alignment!r}, implementation={implementation!r})")
    return attention



# --------------------------------------------------------------------------------------------
# FlashAttention's own layouts (tokens before heads), for the serving cases
# --------------------------------------------------------------------------------------------


def varlen_from_thd(fn):
    """A packed-batch kernel in FlashAttention's layout as a ``"varlen"`` kernel: one line,
    ``check_kernel(adapters.varlen_from_thd(fn), features=("varlen", "causal", "lse"))``.

    ``fn(q, k, v, *, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None)`` takes ``q
    (total_q, H, d)``, ``k (total_k, H, d)``, ``v (total_k, H, dv)`` (``flash_attn_varlen_func``'s
    layout; put its ``max_seqlen_*`` in a lambda: ``lambda q, k, v, **kw: my_varlen(q, k, v,
    max_seqlen_q=..., **kw)``) and returns ``out (total_q, H, dv)``, or ``(out, lse)`` with
    ``lse (H, total_q)``, FlashAttention 2's ``softmax_lse`` layout, which is flash_lib's.
    """
    def kernel(q, k, v, **kwargs):
        result = fn(*(np.ascontiguousarray(np.swapaxes(x, 0, 1)) for x in (q, k, v)), **kwargs)
        if isinstance(result, (tuple, list)):
            return np.swapaxes(np.asarray(result[0]), 0, 1), np.asarray(result[1])
        return np.swapaxes(np.asarray(result), 0, 1)

    kernel.__qualname__ = f"varlen_from_thd({getattr(fn, '__qualname__', fn)!s})"
    return kernel


def from_bshd(fn):
    """A kernel in FlashAttention's ``(batch, seqlen, heads, d)`` layout as a flash_check kernel
    (heads before tokens): one line, ``check_kernel(adapters.from_bshd(fn), ...)``.

    Every 4-D array given to it (``q``, ``k``, ``v``; a cache ``(B, max_len, Hkv, d)`` or its
    pages ``(num_pages, page_size, Hkv, d)``; ``k_new``, ``v_new``) reaches ``fn`` with axes 1 and
    2 swapped, as a view, so that what ``fn`` writes into a cache lands in the caller's (the
    ``"kvcache"`` cases check that ``k_new`` was written in place). ``out (B, Nq, H, dv)`` comes
    back as ``(B, H, Nq, dv)``; an lse is ``(B, H, Nq)`` in both layouts and is left alone.
    """
    def swap(x):
        return np.swapaxes(x, 1, 2) if isinstance(x, np.ndarray) and x.ndim == 4 else x

    def kernel(*args, **kwargs):
        result = fn(*map(swap, args), **{key: swap(val) if key in ("k_new", "v_new") else val
                                         for key, val in kwargs.items()})
        if isinstance(result, (tuple, list)):
            return np.swapaxes(np.asarray(result[0]), 1, 2), np.asarray(result[1])
        return np.swapaxes(np.asarray(result), 1, 2)

    kernel.__qualname__ = f"from_bshd({getattr(fn, '__qualname__', fn)!s})"
    return kernel

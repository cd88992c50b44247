"""The serving cases: packed variable-length batches (feature ``"varlen"``) and the KV cache
(``"kvcache"``, and ``"paged"`` for a block table), each skipped unless the feature is listed.

Registered when ``flash_check`` imports this module, last (after ``training.py``'s). The kernels
they call take flash_lib's layout (heads before tokens, as :mod:`flash_serving` does):

* ``"varlen"``: ``fn(q, k, v, *, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None)`` with
  ``q (H, total_q, d)``, ``k (H, total_k, d)``, ``v (H, total_k, dv)``; returns ``out
  (H, total_q, dv)`` (and ``lse (H, total_q)`` with ``"lse"``), FlashAttention's
  ``flash_attn_varlen_func``: sequence ``b`` attends only itself, causal bottom-right per sequence.
* ``"kvcache"``: ``fn(q, k_cache, v_cache, *, cache_seqlens, k_new, v_new, causal=False,
  scale=None)`` with ``q (B, H, Nq, d)``, ``k_cache (B, H, max_len, d)``; ``"paged"`` adds
  ``block_table=`` with ``k_cache (num_pages, H, page_size, d)``. FlashAttention's
  ``flash_attn_with_kvcache``: ``k_new`` is written into the cache in place at
  ``cache_seqlens[b]``, then the first ``cache_seqlens[b] + Nnew`` keys are attended; slots past
  them hold NaN here, and must never be read.

A kernel whose signature requires ``cu_seqlens_q`` or ``cache_seqlens`` is run through the cases
that pass them only (``FEATURE_KEYWORDS``, below): the dense cases are listed as not applying
to it.

A kernel with FlashAttention's own layout goes through a one-line wrapper of
:mod:`flash_check.adapters`: ``adapters.varlen_from_thd(fn)`` for ``(total, heads, d)`` and
``adapters.from_bshd(fn)`` for ``(batch, seqlen, heads, d)`` (caches and pages included).

The bound is the runner's: per sequence, ``error <= FACTOR · naive's error + floor`` against
``flash_lib.precise_attention`` on that sequence alone; empty rows must be exactly 0 with
``lse = lse_empty``.
"""

from __future__ import annotations

import numpy as np

import flash_lib
from flash_check._core import (FACTOR, FEATURE_KEYWORDS, FEATURES, LSE_FLOOR, OUT_FLOOR, Case,
                               Result, _call, _lse_error, _max_error, _split, register_case)

FEATURES.update({
    "varlen": "takes q (H, total_q, d), k, v (H, total_k, ·) packed end to end with "
              "cu_seqlens_q=, cu_seqlens_k= (int arrays of length B + 1), FlashAttention's "
              "flash_attn_varlen_func",
    "kvcache": "takes q (B, H, Nq, d), k_cache, v_cache (B, H, max_len, ·), cache_seqlens= (B,), "
               "k_new=, v_new= (B, H, Nnew, ·) written in place, FlashAttention's "
               "flash_attn_with_kvcache",
    "paged": "with kvcache: takes block_table= (B, max_pages) over k_cache (num_pages, H, "
             "page_size, ·), vLLM's paged cache",
})
FEATURE_KEYWORDS.update({"varlen": ("cu_seqlens_q", "cu_seqlens_k"),
                         "kvcache": ("cache_seqlens", "k_new", "v_new"),
                         "paged": ("block_table",)})


class _Problem:
    """One case's inputs and, per sequence, the references; ``parts`` index the kernel's output."""

    def __init__(self, call, sequences, kwargs):
        self.call = call  # (args, kwargs) for the kernel
        self.sequences = sequences  # [(index into out, (q, k, v) of the sequence alone)]
        self.kwargs = kwargs  # the keywords of the references (causal, scale)


def _varlen(lens_q, lens_k, causal):
    def make(rng, dtype):
        cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
        q = rng.standard_normal((2, cu_q[-1], 16)).astype(dtype)
        k = rng.standard_normal((2, cu_k[-1], 16)).astype(dtype)
        v = rng.standard_normal((2, cu_k[-1], 16)).astype(dtype)
        seqs = [((slice(None), slice(cu_q[b], cu_q[b + 1])),
                 (q[:, cu_q[b]:cu_q[b + 1]], k[:, cu_k[b]:cu_k[b + 1]], v[:, cu_k[b]:cu_k[b + 1]]))
                for b in range(len(lens_q))]
        kwargs = {"causal": True} if causal else {}
        return _Problem(((q, k, v), {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, **kwargs}),
                        seqs, kwargs)
    return make


def _kvcache(seqlens, n_q, n_new, page_size=None):
    def make(rng, dtype):
        b, h, d, max_len = len(seqlens), 2, 16, 800
        kc = rng.standard_normal((b, h, max_len, d)).astype(dtype)
        vc = rng.standard_normal((b, h, max_len, d)).astype(dtype)
        if page_size is not None:  # sequences 0 and 1 share their first 3 pages (a prefix)
            kc[1, :, :3 * page_size] = kc[0, :, :3 * page_size]
            vc[1, :, :3 * page_size] = vc[0, :, :3 * page_size]
        q = rng.standard_normal((b, h, n_q, d)).astype(dtype)
        k_new = rng.standard_normal((b, h, n_new, d)).astype(dtype)
        v_new = rng.standard_normal((b, h, n_new, d)).astype(dtype)
        seqs = []
        for i, n in enumerate(seqlens):
            seqs.append(((i,), (q[i], np.concatenate([kc[i, :, :n], k_new[i]], 1),
                                np.concatenate([vc[i, :, :n], v_new[i]], 1))))
            kc[i, :, n:] = np.nan  # unused slots: never to be read
            vc[i, :, n:] = np.nan
        lens = np.array(seqlens, np.int32)
        if page_size is None:
            return _Problem(((q, kc, vc), {"cache_seqlens": lens, "k_new": k_new, "v_new": v_new,
                                           "causal": True}), seqs, {"causal": True}), None
        per_seq = max_len // page_size
        spare = 4  # pages no sequence uses, NaN: never to be read
        order = rng.permutation(b * per_seq + spare)
        table = order[:b * per_seq].reshape(b, per_seq)
        table[1, :3] = table[0, :3]  # the shared prefix: one copy of its pages
        pages_k = np.full((b * per_seq + spare, h, page_size, d), np.nan, dtype)
        pages_v = np.full((b * per_seq + spare, h, page_size, d), np.nan, dtype)
        for i in range(b):
            for p in range(per_seq):
                pages_k[table[i, p]] = kc[i, :, p * page_size:(p + 1) * page_size]
                pages_v[table[i, p]] = vc[i, :, p * page_size:(p + 1) * page_size]
        # table entries past a sequence's pages name a spare NaN page: never to be read
        for i, n in enumerate(seqlens):
            table[i, -(-(n + n_new) // page_size):] = order[-1]
        where = [(table[i, (n + t) // page_size], (n + t) % page_size)
                 for i, n in enumerate(seqlens) for t in range(n_new)]
        return _Problem(((q, pages_k, pages_v), {"cache_seqlens": lens, "k_new": k_new,
                                                 "v_new": v_new, "block_table": table,
                                                 "causal": True}),
                        seqs, {"causal": True}), where
    return make


def _run(make):
    def run(ctx):
        result = Result(ctx.case.name, ctx.dtype)
        rng = np.random.default_rng([ctx.seed, sum(map(ord, ctx.case.name))])
        made = make(rng, np.dtype(ctx.dtype))
        problem, where = made if isinstance(made, tuple) else (made, None)
        args, kwargs = problem.call
        try:
            returned, caught = _call(ctx.fn, *args, kwargs)
        except Exception as exc:  # the kernel's own error is the finding
            ctx.fail(result, "raised", f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}",
                     "no exception", f"the kernel raised on this case; if it does not support "
                     f"{', '.join(ctx.case.needs)}, leave the feature out")
            return result
        if caught:
            result.note = f"warned: {caught[0].message}"[:60]
        want_lse = "lse" in ctx.features
        out, lse, wrong = _split(returned, want_lse)
        expected = args[0].shape[:-1] + (args[2].shape[-1],)
        if wrong is None and out.shape != expected:
            wrong = f"out has shape {out.shape}, expected {expected}"
        if wrong is None and want_lse and lse.shape != expected[:-1]:
            wrong = f"lse has shape {lse.shape}, expected {expected[:-1]}"
        if wrong is not None:
            ctx.fail(result, "shape", wrong, "as documented", wrong)
            return result
        if where is not None or "k_new" in kwargs:
            _check_written(ctx, result, args, kwargs, where)
        _check_sequences(ctx, result, problem, out, lse)
        return result
    return run


def _check_written(ctx, result, args, kwargs, where):
    k_cache, k_new = args[1], kwargs["k_new"]
    if where is None:  # contiguous: rows cache_seqlens[b] ... + Nnew
        slots = [(b, n + t) for b, n in enumerate(kwargs["cache_seqlens"])
                 for t in range(k_new.shape[2])]
        got = np.stack([k_cache[b, :, s] for b, s in slots]) if slots else None
    else:
        got = np.stack([k_cache[p, :, s] for p, s in where]) if where else None
    if got is None:
        return
    want = np.stack([k_new[b, :, t] for b in range(k_new.shape[0]) for t in range(k_new.shape[2])])
    if not np.array_equal(got, want):
        ctx.fail(result, "cache write", "k_new is not at slots cache_seqlens[b] ... + Nnew",
                 "k_new written in place there",
                 "the new keys were not written into the cache in place at cache_seqlens[b] "
                 "(appended at the wrong offset, into a copy, or to the wrong page?)")


def _check_sequences(ctx, result, problem, out, lse):
    errors, naives, lse_errors, lse_naives = [], [], [], []
    empty_bad = lse_bad = nonfinite = 0
    for index, (q, k, v) in problem.sequences:
        if q.shape[-2] == 0:
            continue
        with np.errstate(all="ignore"):
            truth, truth_lse = flash_lib.precise_attention(q, k, v, return_lse=True,
                                                           **problem.kwargs)
            naive, naive_lse = flash_lib.naive_attention(q, k, v, return_lse=True,
                                                         **problem.kwargs)
        got = out[index]
        got_lse = None if lse is None else lse[index]
        empty = truth_lse == -np.inf
        empty_bad += int((~(got[empty] == 0).all(axis=-1)).sum())
        if got_lse is not None:
            e = got_lse[empty].astype(np.float64)
            lse_bad += int((~((e == ctx.lse_empty) | (np.isnan(e) & np.isnan(ctx.lse_empty)))).sum())
        rows = ~empty
        finite = np.isfinite(got[rows]).all(axis=-1)
        nonfinite += int((~finite).sum())
        errors.append(_max_error(got[rows][finite], truth[rows][finite]))
        naives.append(_max_error(naive[rows][finite], truth[rows][finite]))
        if got_lse is not None:
            lse_errors.append(_lse_error(got_lse[rows], truth_lse[rows]))
            lse_naives.append(_lse_error(naive_lse[rows], truth_lse[rows]))
    if nonfinite:
        ctx.fail(result, "non-finite", f"NaN or inf in {nonfinite} rows",
                 "finite wherever the exact output is",
                 "the kernel read keys it must not: another sequence's, or cache slots past "
                 "cache_seqlens (they hold NaN here), or pages the table does not name")
    if empty_bad:
        ctx.fail(result, "empty rows", f"{empty_bad} rows not 0", "out exactly 0",
                 "a row with no allowed key (a sequence without keys, or causal with Nq > Nk) "
                 "must be exactly 0")
    if lse_bad:
        ctx.fail(result, "empty lse", f"{lse_bad} rows", f"lse_empty = {ctx.lse_empty}",
                 "the lse of a row with no allowed key is lse_empty")
    err, naive = max(errors, default=0.0), max(naives, default=0.0)
    bound = FACTOR * naive + OUT_FLOOR[ctx.dtype]
    result.out_error, result.out_naive, result.out_bound = err, naive, bound
    if err > bound:
        ctx.fail(result, "out error", f"{err:.2g}", f"{FACTOR:g} x naive's {naive:.2g} + floor = "
                 f"{bound:.2g}", ctx.case.hint)
    if lse is not None:
        err, naive = max(lse_errors, default=0.0), max(lse_naives, default=0.0)
        bound = FACTOR * naive + LSE_FLOOR[ctx.dtype]
        result.lse_error, result.lse_naive, result.lse_bound = err, naive, bound
        if err > bound:
            ctx.fail(result, "lse error", f"{err:.2g}", f"{bound:.2g}", ctx.case.hint)


_VARLEN_HINT = ("wrong on a packed batch: each sequence attends only its own keys "
                "(cu_seqlens_k[b]:cu_seqlens_k[b + 1], no key of the next sequence), causal "
                "bottom-right per sequence (j <= i + Nk_b - Nq_b), not top-left")
_CACHE_HINT = ("wrong over the cache: the valid keys are the first cache_seqlens[b] + Nnew, k_new "
               "after the old ones, causal bottom-right against them")
_PAGED_HINT = ("wrong over a paged cache: key t of sequence b is slot t % page_size of page "
               "block_table[b, t // page_size] (an index off by one, or pages read in table order "
               "as if contiguous?)")
# Lengths 0 and 1, Nq < Nk, Nq = Nk, Nq > Nk (causal: empty rows), a sequence with no keys.
_LENS_Q = (5, 0, 1, 37, 70, 3)
_LENS_K = (9, 4, 1, 37, 20, 0)

for _case in [
    Case("varlen", f"packed batch, lengths q {_LENS_Q} / k {_LENS_K} (0 and 1, no keys)",
         None, needs=("varlen",), hint=_VARLEN_HINT, run=_run(_varlen(_LENS_Q, _LENS_K, False))),
    Case("varlen_causal", "packed batch with causal, bottom-right per sequence (Nq_b > Nk_b: "
         "empty rows)", None, needs=("varlen", "causal"), hint=_VARLEN_HINT,
         run=_run(_varlen(_LENS_Q, _LENS_K, True))),
    Case("kvcache_decode", "decoding: Nq = 1, one new key, cache_seqlens (0, 1, 700), NaN in "
         "the unused slots", None, needs=("kvcache",), hint=_CACHE_HINT,
         run=_run(_kvcache((0, 1, 700), 1, 1))),
    Case("kvcache_prefill", "4 new queries and keys after (0, 3, 500) cached, causal "
         "bottom-right", None, needs=("kvcache",), hint=_CACHE_HINT,
         run=_run(_kvcache((0, 3, 500), 4, 4))),
    Case("kvcache_paged", "paged, pages of 16 shuffled, a shared 3-page prefix, NaN spare "
         "pages, (100, 130, 7) cached", None, needs=("kvcache", "paged"), hint=_PAGED_HINT,
         run=_run(_kvcache((100, 130, 7), 1, 1, page_size=16))),
]:
    register_case(_case)

"""The serving cases: packed variable-length batches (feature ``"varlen"``) and the KV cache
(``"kvcache"``, and ``"paged"`` for a block table), each skipped unless the feature is listed;
with ``"sinks"`` and ``"dropout"``, the training features over a packed batch and the cache.

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

With ``"sinks"`` both kinds also take ``sinks=`` (``(H,)`` for a packed batch, ``(B, H)`` for
the cache): each row's softmax gets its head's sink once, a row with no key gives ``out`` 0 and
``lse = sink``; in a split-KV decode the sink is one more partial, merged once per row, never
once per chunk. With ``"dropout"`` a packed batch takes ``dropout_p=``, ``dropout_seed=``: the
``varlen_dropout`` case reads each sequence's keep mask off its output (``q = 0``, ``v`` the
identity within each sequence, as ``training.py``'s dropout case does) and checks the keep rate,
that two sequences of the same lengths draw independent masks (a mask keyed by positions within
the sequence alone gives them the same one), and ``out`` and ``lse`` on random inputs against
``(P∘Z/(1 - p))·V`` with that mask. The serving cases check the forward only.

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

import math

import numpy as np

import flash_lib
from flash_check._core import (FACTOR, FEATURE_KEYWORDS, FEATURES, LSE_FLOOR, OUT_FLOOR, Case,
                               Result, _call, _lse_error, _max_error, _split, register_case)
from flash_check.training import DROPOUT_P

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
#: Half-width of the varlen dropout case's binomial intervals, in standard deviations: a correct
#: generator falls outside one with probability below 6e-7 (two intervals per case run).
SIGMAS = 5.0
FEATURE_KEYWORDS.update({"varlen": ("cu_seqlens_q", "cu_seqlens_k"),
                         "kvcache": ("cache_seqlens", "k_new", "v_new"),
                         "paged": ("block_table",)})


class _Problem:
    """One case's inputs and, per sequence, the references' inputs and keywords."""

    def __init__(self, call, sequences):
        self.call = call  # (args, kwargs) for the kernel
        # [(index into out, (q, k, v) of the sequence alone, the references' keywords)]
        self.sequences = sequences


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _varlen(lens_q, lens_k, causal, sinks=None):
    def make(rng, dtype):
        cu_q, cu_k = _cu(lens_q), _cu(lens_k)
        q = rng.standard_normal((2, cu_q[-1], 16)).astype(dtype)
        k = rng.standard_normal((2, cu_k[-1], 16)).astype(dtype)
        v = rng.standard_normal((2, cu_k[-1], 16)).astype(dtype)
        kwargs = ({"causal": True} if causal else {}) | ({} if sinks is None else {"sinks": sinks})
        seqs = [((slice(None), slice(cu_q[b], cu_q[b + 1])),
                 (q[:, cu_q[b]:cu_q[b + 1]], k[:, cu_k[b]:cu_k[b + 1]], v[:, cu_k[b]:cu_k[b + 1]]),
                 kwargs)
                for b in range(len(lens_q))]
        return _Problem(((q, k, v), {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, **kwargs}), seqs)
    return make


def _kvcache(seqlens, n_q, n_new, page_size=None, sinks=None):
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
        # sinks (B, H): each sequence's reference gets its own row
        extra = {} if sinks is None else {"sinks": sinks}
        seqs = []
        for i, n in enumerate(seqlens):
            seqs.append(((i,), (q[i], np.concatenate([kc[i, :, :n], k_new[i]], 1),
                                np.concatenate([vc[i, :, :n], v_new[i]], 1)),
                         {"causal": True} | ({} if sinks is None else {"sinks": sinks[i]})))
            kc[i, :, n:] = np.nan  # unused slots: never to be read
            vc[i, :, n:] = np.nan
        lens = np.array(seqlens, np.int32)
        if page_size is None:
            return _Problem(((q, kc, vc), {"cache_seqlens": lens, "k_new": k_new, "v_new": v_new,
                                           "causal": True, **extra}), seqs), None
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
                                                 "causal": True, **extra}), seqs), where
    return make


def _run(make):
    """A serving case's check: the call, the shapes, the cache write, each sequence against its
    references."""
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
    for index, (q, k, v), kwargs in problem.sequences:
        if q.shape[-2] == 0:
            continue
        with np.errstate(all="ignore"):
            truth, truth_lse = flash_lib.precise_attention(q, k, v, return_lse=True, **kwargs)
            naive, naive_lse = flash_lib.naive_attention(q, k, v, return_lse=True, **kwargs)
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
    checks = [("out error", err, bound, f"{FACTOR:g} x naive's {naive:.2g} + floor = {bound:.2g}")]
    if lse is not None:
        err, naive = max(lse_errors, default=0.0), max(lse_naives, default=0.0)
        lse_bound = FACTOR * naive + LSE_FLOOR[ctx.dtype]
        result.lse_error, result.lse_naive, result.lse_bound = err, naive, lse_bound
        checks.append(("lse error", err, lse_bound, f"{lse_bound:.2g}"))
    failed = [check for check in checks if check[1] > check[2]]
    why = _diagnosis(ctx, problem, out, bound) if failed else None
    for name, err, _, limit in failed:
        ctx.fail(result, name, f"{err:.2g}", limit, why)


def _diagnosis(ctx, problem, out, bound):
    """Why a sinks case's output is wrong: the mistake of its sinkless twin, if that case
    failed too in this dtype; the sinks ignored, if the output is the sinkless attention; else
    the case's hint."""
    twin = _WITHOUT_SINKS.get(ctx.case.name)
    done = ctx.done.get((twin, ctx.dtype))
    if done is not None and not done.ok:
        return f"{twin} fails too, the same mistake without sinks: {_TWIN_HINTS[twin]}"
    if "sinks" in ctx.case.needs and _sinks_ignored(problem, out, bound):
        return _SINKS_IGNORED
    return ctx.case.hint


def _sinks_ignored(problem, out, bound):
    """Whether ``out`` is, within ``bound``, each sequence's attention without its sinks."""
    for index, (q, k, v), kwargs in problem.sequences:
        if q.shape[-2] and k.shape[-2]:
            with np.errstate(all="ignore"):
                sinkless = flash_lib.precise_attention(
                    q, k, v, **{key: val for key, val in kwargs.items() if key != "sinks"})
            if _max_error(out[index], sinkless) > bound:
                return False
    return True


# --------------------------------------------------------------------------------------------
# Dropout over a packed batch
# --------------------------------------------------------------------------------------------

#: The dropout case's sequences: 0 and 1 of the same lengths, so that their masks can be compared.
_DROPOUT_LENS_Q = (40, 40, 1, 24)
_DROPOUT_LENS_K = (64, 64, 5, 48)


def _varlen_dropout(ctx):
    """Each sequence's keep mask read off the output on q = 0 (uniform P = 1/Nk_b) and v the
    identity within the sequence (``out[i, j] = Z_ij / (Nk_b·(1 - p))``), then checked."""
    result = Result(ctx.case.name, ctx.dtype)
    dtype, p = np.dtype(ctx.dtype), DROPOUT_P
    rng = np.random.default_rng([ctx.seed, sum(map(ord, ctx.case.name))])
    cu_q, cu_k = _cu(_DROPOUT_LENS_Q), _cu(_DROPOUT_LENS_K)
    seqs = [(slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1]))
            for b in range(len(_DROPOUT_LENS_Q))]
    # a seed with both 32-bit halves nonzero (Philox's two key words), below 2**63
    kwargs = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "dropout_p": p,
              "dropout_seed": (0x9E3779B97F4A7C15 * (ctx.seed + 1)) % 2**63}

    def call(q, k, v, what):
        try:
            returned, _ = _call(ctx.fn, q, k, v, dict(kwargs))
        except Exception as exc:  # the kernel's own error is the finding
            ctx.fail(result, "raised", f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}",
                     "no exception", f"the kernel raised on {what}; if it has no dropout on a "
                     f"packed batch, leave the feature out")
            return None, None
        out, lse, wrong = _split(returned, "lse" in ctx.features)
        if wrong is None and out.shape != q.shape[:-1] + (v.shape[-1],):
            wrong = f"out has shape {out.shape}, expected {q.shape[:-1] + (v.shape[-1],)}"
        if wrong is not None:
            ctx.fail(result, "shape", wrong, "as documented", wrong)
            return None, None
        return out, lse

    # The masks, read off the probe
    q = np.zeros((2, cu_q[-1], 16), dtype)
    k = rng.standard_normal((2, cu_k[-1], 16)).astype(dtype)
    v = np.zeros((2, cu_k[-1], max(_DROPOUT_LENS_K)), dtype)
    for _, keys in seqs:
        v[:, keys, : keys.stop - keys.start] = np.eye(keys.stop - keys.start, dtype=dtype)
    out, _ = call(q, k, v, "the dropout probe (q = 0, v = I within each sequence)")
    if out is None:
        return result
    keep = []
    for b, (rows, keys) in enumerate(seqs):
        n_k = keys.stop - keys.start
        ratio = out[:, rows, :n_k].astype(np.float64) * n_k * (1 - p)
        kept, dropped = np.abs(ratio - 1) <= 1e-2, np.abs(ratio) <= 1e-2
        if not (kept | dropped).all():
            ctx.fail(result, "keep values", f"{int((~(kept | dropped)).sum())} of {ratio.size} "
                     f"entries of sequence {b} neither 0 nor 1", "0 or 1",
                     "on q = 0 and v = I within each sequence, out·Nk_b·(1 - p) must be the keep "
                     "mask (0 or 1): dropout ignored, kept weights not divided by 1 - p, or "
                     "keys of other sequences attended")
            return result
        keep.append(kept)
    n = sum(x.size for x in keep)
    rate = sum(int(x.sum()) for x in keep) / n
    half = SIGMAS * math.sqrt(p * (1 - p) / n)
    if abs(rate - (1 - p)) > half:
        ctx.fail(result, "keep rate", f"{rate:.4f} over {n} pairs", f"{1 - p:g} ± {half:.4f} "
                 f"(5σ)", "the keep rate over the packed batch is outside 1 - p ± 5σ: kept with "
                 "probability p instead of 1 - p, or wrong uniform numbers")
    agree = float(np.mean(keep[0] == keep[1]))
    expected = p * p + (1 - p) ** 2
    half = SIGMAS * math.sqrt(expected * (1 - expected) / keep[0].size)
    if abs(agree - expected) > half:
        ctx.fail(result, "independent sequences", f"agreement {agree:.3f} of sequences 0 and 1",
                 f"{expected:.3f} ± {half:.3f}",
                 "sequences 0 and 1, of the same lengths, draw " + (
                     "the same mask" if agree == 1 else "correlated masks") + ": a mask keyed "
                 "by positions within the sequence alone repeats in every sequence; key it by "
                 "the sequence too (FlashAttention: its batch index; flash_serving: its packed "
                 "positions, dropout_offset = (cu_seqlens_q[b], cu_seqlens_k[b]))")
    if not result.ok:
        return result

    # Random inputs, against (P∘Z/(1 - p))·V with the masks just read, sequence by sequence
    q, k, v = (rng.standard_normal((2, total, 16)).astype(dtype)
               for total in (cu_q[-1], cu_k[-1], cu_k[-1]))
    out, lse = call(q, k, v, "random inputs")
    if out is None:
        return result
    errors = []
    for (rows, keys), z in zip(seqs, keep):
        with np.errstate(all="ignore"):
            truth, truth_lse = _dropped(flash_lib.precise_attention, q[:, rows], k[:, keys],
                                        v[:, keys], z, p)
            naive, naive_lse = _dropped(flash_lib.naive_attention, q[:, rows], k[:, keys],
                                        v[:, keys], z, p)
        errors.append((_max_error(out[:, rows], truth), _max_error(naive.astype(dtype), truth),
                       None if lse is None else _lse_error(lse[:, rows], truth_lse),
                       _lse_error(naive_lse, truth_lse)))
    err, naive_err = max(e[0] for e in errors), max(e[1] for e in errors)
    bound = FACTOR * naive_err + OUT_FLOOR[ctx.dtype]
    result.out_error, result.out_naive, result.out_bound = err, naive_err, bound
    if err > bound:
        ctx.fail(result, "out error", f"{err:.2g}", f"{bound:.2g}", "wrong with dropout on "
                 "random inputs, although each sequence's mask read off the probe (same seed) "
                 "was a keep mask: out = (P∘Z/(1 - p))·V with the undropped P, the mask a "
                 "function of the seed and the element alone")
    if lse is not None:
        err, naive_err = max(e[2] for e in errors), max(e[3] for e in errors)
        bound = FACTOR * naive_err + LSE_FLOOR[ctx.dtype]
        result.lse_error, result.lse_naive, result.lse_bound = err, naive_err, bound
        if err > bound:
            ctx.fail(result, "lse error", f"{err:.2g}", f"{bound:.2g}", "the lse with dropout "
                     "is the undropped log-sum-exp of each sequence's scores")
    return result


def _dropped(attention, q, k, v, keep, p):
    """``(P∘Z/(1 - p))·V`` and the undropped lse, from ``attention`` (flash_lib's precise or
    naive reference) without a mask and with ``mask = keep``: the kept keys' softmax, scaled by
    their share of the whole row's, ``exp(lse_kept - lse)``, and by ``1/(1 - p)``."""
    out, lse = attention(q, k, v, return_lse=True)
    kept, lse_kept = attention(q, k, v, mask=keep, return_lse=True)
    return kept * (np.exp(lse_kept - lse) / (1 - p))[..., None], lse


_VARLEN_HINT = ("wrong on a packed batch: each sequence attends only its own keys "
                "(cu_seqlens_k[b]:cu_seqlens_k[b + 1], no key of the next sequence), causal "
                "bottom-right per sequence (j <= i + Nk_b - Nq_b), not top-left")
_CACHE_HINT = ("wrong over the cache: the valid keys are the first cache_seqlens[b] + Nnew, k_new "
               "after the old ones, causal bottom-right against them")
_PAGED_HINT = ("wrong over a paged cache: key t of sequence b is slot t % page_size of page "
               "block_table[b, t // page_size] (an index off by one, or pages read in table order "
               "as if contiguous?)")
_SINKS_HINT = ("wrong with sinks: every row's softmax gets its head's sink exactly once, "
               "unscaled and uncapped (a row with no key: out 0, lse = sink, not -inf); over a "
               "cache split in chunks the sink is one more partial (out 0, lse = sink) merged "
               "once per row: passed to every chunk it is counted once per chunk")
_SINKS_IGNORED = ("the output is attention without the sinks: the sinks= keyword was accepted "
                  "and ignored (gpt-oss-style models then lose their sink, silently)")
#: The sinks cases' twins without sinks (the same sequences), and the hints of those twins.
_WITHOUT_SINKS = {"varlen_sinks": "varlen_causal", "kvcache_sinks": "kvcache_decode"}
_TWIN_HINTS = {"varlen_causal": _VARLEN_HINT, "kvcache_decode": _CACHE_HINT}
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
    Case("varlen_sinks", "packed batch with causal and sinks (0.5, 3): rows of no key (Nq_b > "
         "Nk_b, a sequence without keys) give out 0 and lse = sink", None,
         needs=("varlen", "sinks"),
         hint=_SINKS_HINT,
         run=_run(_varlen(_LENS_Q, _LENS_K, True, sinks=np.array([0.5, 3.0])))),
    Case("kvcache_sinks", "decoding with sinks of shape (B, H) over cache_seqlens (0, 1, 700): "
         "the longest split in chunks, its sink merged once per row", None,
         needs=("kvcache", "sinks"), hint=_SINKS_HINT,
         run=_run(_kvcache((0, 1, 700), 1, 1, sinks=np.array([[1.0, 6.0], [-2.0, 2.5],
                                                               [5.0, 0.5]])))),
    Case("varlen_dropout", f"packed batch with dropout p = {DROPOUT_P:g}, each sequence's mask "
         f"read off q = 0, v = I: keep rate within 5σ, two sequences of the same lengths "
         f"independent, out and lse on random inputs", None,
         needs=("varlen", "dropout"), once=True, run=_varlen_dropout),
]:
    register_case(_case)

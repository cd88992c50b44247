"""The likely cause of a failure: per check, a table of known mistakes (a condition, a message).

Imported by ``_runner.py`` (the accuracy check builds one :class:`Evidence` per run and calls
:meth:`Evidence.explain` with the table of the check that failed), by ``training.py`` (whose
checks keep their own tables, built from :class:`Mistake` and :func:`explain`, beside them) and
by ``tests/test_check.py`` (which holds the one softmax written here, :func:`_misplaced`, to
precise_attention).

A condition looks at the :class:`Evidence` (the case's inputs and references, the kernel's output,
the probes below) and the facts of the failure (what the check measured); it returns something
false when its mistake does not explain the failure, else True or the fields of its message. The
first row that holds gives the diagnosis; every table ends with a row that always holds. Most
conditions compare the kernel's output with what a known mistake computes on the same inputs
(flash_lib's references with one thing changed: a top-left causal mask, the first ``n`` keys, the
default scale, a variant's edge moved); :meth:`Evidence.key_order` probes the kernel itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import numpy as np

import flash_lib
from flash_check._core import FACTOR, OUT_FLOOR, _call, _max_error, _split

_KEEP = object()  # "as the case says", for Evidence.allowed
#: The keywords that decide which pairs may attend.
_PAIRWISE = ("mask", "causal", "window", "mask_mod")
#: The keywords whose answer depends on the keys' positions or heads.
_POSITIONAL = ("window", "alibi_slopes", "mask_mod", "enable_gqa", "sinks")
#: Block sizes tried when a mistake depends on the kernel's tiles (square tiles).
_BLOCKS = (8, 16, 32, 64, 128, 256, 512)


@dataclasses.dataclass(frozen=True)
class Mistake:
    """One known mistake: ``test(evidence, facts)`` is false when it does not explain the failure,
    else True or a dict of the fields ``message`` is formatted with (with the facts)."""

    test: Callable
    message: str


def always(evidence, facts):
    """The condition of a table's last row: it always holds."""
    return True


def explain(table, evidence, **facts):
    """The message of the first mistake in ``table`` that explains the facts."""
    for mistake in table:
        found = mistake.test(evidence, facts)
        if found:
            return mistake.message.format(**{**facts, **(found if isinstance(found, dict)
                                                          else {})})
    raise AssertionError("every table of mistakes ends with one that always holds")


# --------------------------------------------------------------------------------------------
# What the kernel's output is compared with
# --------------------------------------------------------------------------------------------


def _passed(ctx, case, dtype):
    result = ctx.done.get((case, dtype))
    return result is not None and result.ok


def _alibi_bias(slopes, n_q, n_k, form):
    """ALiBi's bias, (..., Nq, Nk), in one of its forms: FlashAttention's ("bottom-right",
    -slope·|i + (Nk - Nq) - j|) and the mistakes "flipped", "top-left" and "gym" (attention-gym's
    slope·(j - i), right only under causal masking)."""
    i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    slopes = np.asarray(slopes, np.longdouble)[..., None, None]
    distance = {"bottom-right": np.abs(i + (n_k - n_q) - j), "flipped": -np.abs(i + (n_k - n_q) - j),
                "top-left": np.abs(i - j), "gym": i - j}[form]
    return -slopes * distance


def _misplaced(q, k, v, scale, allowed, *, softcap=None, bias=None, cap_at="scores", sinks=None):
    """Dense attention in longdouble with softcap applied at a chosen step and a given bias: the
    one softmax written here rather than taken from flash_lib, because it computes what flash_lib
    never does, a variant in the wrong order or with a wrong bias. ``cap_at``: "scores" (the
    scaled scores: right), "unscaled" (q·kᵀ before the scale), "biased" (after the bias) or
    "masked" (after the mask, where c·tanh(-inf) = -c). k and v hold q's heads (GQA expanded).
    ``sinks`` (broadcast to the batch dims) join each row's denominator, unscaled and uncapped."""
    wide = np.longdouble
    q, k, v = (x.astype(wide) for x in (q, k, v))
    raw = q @ np.swapaxes(k, -1, -2)
    cap = None if softcap is None else wide(softcap)

    def capped(x):
        return cap * np.tanh(x / cap)

    s = wide(scale) * (capped(raw) if cap is not None and cap_at == "unscaled" else raw)
    if cap is not None and cap_at == "scores":
        s = capped(s)
    if bias is not None:
        s = s + bias
    if cap is not None and cap_at == "biased":
        s = capped(s)
    s = np.where(allowed, s, -np.inf)
    if cap is not None and cap_at == "masked":
        s = capped(s)
    m = s.max(axis=-1, keepdims=True)
    sink = None
    if sinks is not None:
        sink = np.broadcast_to(np.asarray(sinks, wide), s.shape[:-2])[..., None, None]
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    total = p.sum(axis=-1, keepdims=True) + (0 if sink is None else np.exp(sink - m))
    return (p @ v) / np.where(total == 0, 1, total)


def _tile_corners_kept(allowed, block):
    """For square tiles of ``block``: True on the pairs of every tile where ``allowed`` holds at
    one of its four corners (what a kernel that tests only the corners would compute)."""
    n_q, n_k = allowed.shape[-2:]
    kept = np.zeros(allowed.shape, dtype=bool)
    for q0 in range(0, n_q, block):
        q1 = min(q0 + block, n_q) - 1
        for k0 in range(0, n_k, block):
            k1 = min(k0 + block, n_k) - 1
            corners = allowed[..., [q0, q0, q1, q1], [k0, k1, k0, k1]].any(axis=-1)
            kept[..., q0:q1 + 1, k0:k1 + 1] = corners[..., None, None]
    return kept


class Evidence:
    """What the diagnoses look at: the case's inputs and references, the kernel's output and lse,
    and the outputs of known mistakes on the same inputs (each probe computed once)."""

    def __init__(self, ctx, ref, out, lse):
        self.ctx, self.ref, self.out, self.lse = ctx, ref, out, lse
        self.inputs = ref.inputs
        self.q, self.k, self.v = (ref.inputs.clean if ref.inputs.clean is not None
                                  else (ref.inputs.q, ref.inputs.k, ref.inputs.v))
        self.n_q, self.n_k = ref.out.shape[-2], ref.inputs.k.shape[-2]
        self.out_error = None  # set by the runner once measured
        self.out_failed = False
        self._out = None

    def explain(self, table, **facts):
        """The message of the first mistake in ``table`` that explains the failure."""
        return explain(table, self, **facts)

    def explain_out(self):
        """Why the output's error is above the bound (computed once, reused for the lse)."""
        if self._out is None:
            self._out = self.explain(OUT_ERROR)
        return self._out

    def allowed(self, window=_KEEP, mask_mod=_KEEP, window_offset=None, causal_offset=None):
        """The (..., Nq, Nk) pairs that may attend, from the case's mask, causal, window and
        mask_mod, written out here from their definitions; a mistake's pairs with the keywords
        replaced (``window``, ``mask_mod``) or the diagonal moved (``*_offset``, default
        Nk - Nq)."""
        kwargs = self.inputs.kwargs
        offset = self.n_k - self.n_q
        rel = np.arange(self.n_k)[None, :] - np.arange(self.n_q)[:, None]  # j - i
        allowed = np.ones(self.ref.lse.shape + (self.n_k,), dtype=bool)
        if kwargs.get("mask") is not None:
            allowed = allowed & kwargs["mask"]
        if kwargs.get("causal"):
            allowed = allowed & (flash_lib.causal_mask(self.n_q, self.n_k) if causal_offset is None
                                 else rel <= causal_offset)
        window = kwargs.get("window") if window is _KEEP else window
        if window is not None:
            shift = rel - (offset if window_offset is None else window_offset)
            left, right = window
            if left is not None:
                allowed = allowed & (shift >= -left)
            if right is not None:
                allowed = allowed & (shift <= right)
        mask_mod = kwargs.get("mask_mod") if mask_mod is _KEEP else mask_mod
        if mask_mod is not None:
            allowed = allowed & np.asarray(mask_mod(np.arange(self.n_q)[:, None],
                                                    np.arange(self.n_k)[None, :]), dtype=bool)
        return allowed

    def positional(self):
        """True if the case's answer depends on where each key is (window, ALiBi, mask_mod) or
        which head it belongs to (GQA), so that reordering or dropping keys changes it."""
        return any(key in self.inputs.kwargs for key in _POSITIONAL)

    def other_kwargs(self, *drop):
        return {key: val for key, val in self.inputs.kwargs.items() if key not in drop}

    def precise(self, allowed, *drop, k=None, v=None, **replace):
        """precise_attention with the pairs ``allowed`` as its mask, the keywords ``drop`` left
        out and those of ``replace`` replaced: the case's attention with one thing changed."""
        return flash_lib.precise_attention(
            self.q, self.k if k is None else k, self.v if v is None else v, mask=allowed,
            **{**self.other_kwargs(*_PAIRWISE, *drop), **replace})

    def misplaced(self, cap_at="scores", alibi="bottom-right"):
        """The case's attention with softcap at ``cap_at`` and ALiBi's bias in the form
        ``alibi`` (:func:`_misplaced`); with the defaults, the truth."""
        kwargs = self.inputs.kwargs
        scale = kwargs.get("scale")
        scale = 1 / math.sqrt(self.q.shape[-1]) if scale is None else scale
        slopes = kwargs.get("alibi_slopes")
        bias = None if slopes is None else _alibi_bias(slopes, self.n_q, self.n_k, alibi)
        k, v = self.k, self.v
        if kwargs.get("enable_gqa"):
            g = self.q.shape[-3] // k.shape[-3]
            k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
        return _misplaced(self.q, k, v, scale, self.allowed(), softcap=kwargs.get("softcap"),
                          bias=bias, cap_at=cap_at, sinks=kwargs.get("sinks"))

    def closer_to(self, alt, rows=None):
        """True if the kernel's output is far closer to ``alt`` than to the truth."""
        rows = self.ref.rows if rows is None else rows
        to_alt = _max_error(self.out[rows], alt[rows])
        to_truth = _max_error(self.out[rows], self.ref.out[rows])
        return to_alt <= 0.01 * to_truth and to_alt < 1e-2

    def float16_only(self):
        return self.ctx.dtype == "float16" and _passed(self.ctx, self.ctx.case.name, "float32")

    # The probes shared by several tables, each computed once ----------------------------

    @functools.cached_property
    def top_left(self):
        """(Nq, Nk) if the output is that of a causal mask aligned top-left, else None."""
        if (not self.inputs.kwargs.get("causal") or self.n_q == self.n_k
                or "window" in self.inputs.kwargs):  # the window's own diagnoses say it
            return None
        mask = np.tril(np.ones((self.n_q, self.n_k), dtype=bool))  # the mistake: j <= i
        if self.inputs.kwargs.get("mask") is not None:
            mask = mask & self.inputs.kwargs["mask"]
        alt = flash_lib.precise_attention(self.q, self.k, self.v, mask=mask,
                                          **self.other_kwargs("mask", "causal"))
        everywhere = np.ones(self.ref.lse.shape, dtype=bool)
        return {"n_q": self.n_q, "n_k": self.n_k} if self.closer_to(alt, everywhere) else None

    @functools.cached_property
    def dropped_keys(self):
        """The fields of the message if the output is attention over the first n keys only."""
        if "alibi_slopes" in self.inputs.kwargs:  # the bias depends on Nk: not comparable
            return None
        allowed = np.broadcast_to(self.allowed(), self.ref.lse.shape + (self.n_k,))
        for b in _BLOCKS:
            n = self.n_k - self.n_k % b
            if n == self.n_k:
                continue
            if n == 0:
                alt = np.zeros(self.ref.out.shape)
            else:
                alt = flash_lib.precise_attention(self.q, self.k[..., :n, :], self.v[..., :n, :],
                                                  mask=allowed[..., :n],
                                                  **self.other_kwargs(*_PAIRWISE))
            if self.closer_to(alt):
                return {"n": n, "n_k": self.n_k}
        return None

    def garbage_probe(self, garbage, which, of_lse=False):
        """(*batch, Nq): the rows whose out (or lse) is not finite when the kernel is called
        with the case's garbage in ``which`` ("k" or "v") alone (:class:`Garbage`)."""
        suspects = np.ones(self.ref.lse.shape, bool)  # no answer: every row stays a suspect
        try:
            returned, _ = _call(self.ctx.fn, *(x.copy() for x in garbage.only(which)),
                                dict(self.inputs.kwargs))
        except Exception:
            return suspects
        out, lse, problem = _split(returned, "lse" in self.ctx.features)
        got = lse if of_lse else out
        if problem or got is None or (got.shape if of_lse else got.shape[:-1]) != suspects.shape:
            return suspects
        return ~np.isfinite(got) if of_lse else ~np.isfinite(got).all(axis=-1)

    def key_order(self):
        """Probe one row: right with its keys in descending order of score, wrong ascending?

        Attention does not depend on the order of the keys. A kernel that forgets to rescale l
        and acc when the running max rises (or exponentiates against the previous max) is
        right when the max comes first and wrong when it rises, whatever its block size.
        """
        ctx, ref = self.ctx, self.ref
        if self.positional():  # reordering keys changes the answer
            return None
        allowed = np.broadcast_to(self.allowed(), ref.lse.shape + (self.n_k,))
        row_err = flash_lib.rowwise_relative_error(self.out, ref.out)
        candidates = ref.rows & (allowed.sum(axis=-1) >= 2)
        if not candidates.any():
            return None
        row = np.unravel_index(np.argmax(np.where(candidates, row_err, -1)), row_err.shape)
        batch = ref.lse.shape[:-1]
        q, k, v = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (self.q, self.k, self.v))
        keys = allowed[row]
        q_row = q[row[:-1]][row[-1]][None]
        k_row, v_row = k[row[:-1]][keys], v[row[:-1]][keys]
        score = (k_row.astype(np.float64) @ q_row[0].astype(np.float64))
        other = self.other_kwargs("mask", "causal")
        errors = []
        for order in (np.argsort(-score, kind="stable"), np.argsort(score, kind="stable")):
            args = (q_row.copy(), k_row[order].copy(), v_row[order].copy())
            try:
                returned, _ = _call(ctx.fn, *args, dict(other))
            except Exception:
                return None
            out, _, problem = _split(returned, "lse" in ctx.features)
            if problem or out.shape != (1, v_row.shape[-1]):
                return None
            truth = flash_lib.precise_attention(*args, **other)
            naive = flash_lib.naive_attention(*args, **other)
            errors.append((_max_error(out, truth),
                           FACTOR * _max_error(naive, truth) + OUT_FLOOR[ctx.dtype]))
        (err_first, bound_first), (err_last, bound_last) = errors
        if err_first <= bound_first and not err_last <= 10 * bound_last:
            return {"err_first": err_first, "err_last": err_last}
        return None


# --------------------------------------------------------------------------------------------
# The variants' classic mistakes: (applies, message, output), the closest one wins
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VariantMistake:
    """``applies(evidence)`` yields the fields of each instance of the mistake this case can
    show (none, one, or one per edge or block size); ``output(evidence, **fields)`` is what a
    kernel making it computes."""

    applies: Callable
    message: str
    output: Callable


def _window_edges(ev):
    window = ev.inputs.kwargs.get("window")
    if window is None:
        return
    left, right = window
    for side, value, edge in (("left", left, "i + (Nk - Nq) - left <= j"),
                              ("right", right, "j <= i + (Nk - Nq) + right")):
        for alt in (() if value is None else (value - 1, value + 1)):
            if alt >= 0:
                other = (alt, right) if side == "left" else (left, alt)
                yield {"side": side, "other": other, "window": window, "edge": edge}


def _if(condition):
    """``applies`` for a mistake with one instance, present when ``condition(evidence)``."""
    return lambda ev: [{}] if condition(ev) else []


def _kw(ev, name):
    return ev.inputs.kwargs.get(name)


def _mod(ev, i=None, j=None):
    """The case's mask_mod on the global positions (or on ``i``, ``j``), as a bool array."""
    i = np.arange(ev.n_q)[:, None] if i is None else i
    j = np.arange(ev.n_k)[None, :] if j is None else j
    return np.asarray(_kw(ev, "mask_mod")(i, j), dtype=bool)


def _mask_mod_blocks(ev):
    if _kw(ev, "mask_mod") is not None:
        for b in _BLOCKS:
            if b >= max(ev.n_q, ev.n_k):
                break
            yield {"b": b, "last": b - 1}


def _first_layout(ev):
    """mask_mod's first (batch, head) entry used for every sequence."""
    mod = _mod(ev)
    first = mod[(0,) * (mod.ndim - 2)]
    return ev.precise(ev.allowed(mask_mod=lambda a, b: first))


def _local(ev, b, last):
    i, j = np.arange(ev.n_q)[:, None], np.arange(ev.n_k)[None, :]
    local = _mod(ev, i % b, j % b)
    return ev.precise(ev.allowed(mask_mod=lambda a, c: local))


def _tiled_gqa(ev):
    """Query head h reading kv head h mod Hkv: the kv heads tiled, not repeated."""
    g = ev.q.shape[-3] // ev.k.shape[-3]
    reps = (1,) * (ev.k.ndim - 3) + (g, 1, 1)
    return ev.precise(ev.allowed(), "enable_gqa", k=np.tile(ev.k, reps), v=np.tile(ev.v, reps))


_WINDOW = lambda ev: _kw(ev, "window") is not None  # noqa: E731
_CAP = lambda ev: _kw(ev, "softcap") is not None  # noqa: E731
_ALIBI = lambda ev: _kw(ev, "alibi_slopes") is not None  # noqa: E731
_MASK_MOD = lambda ev: _kw(ev, "mask_mod") is not None  # noqa: E731
_SINKS = lambda ev: _kw(ev, "sinks") is not None  # noqa: E731


def _sinks(ev):
    return np.asarray(_kw(ev, "sinks"), np.float64)


def _scale(ev):
    scale = _kw(ev, "scale")
    return 1 / math.sqrt(ev.q.shape[-1]) if scale is None else scale


def _sink_counts(ev):
    if _SINKS(ev):
        for n in (2, 3, 4):
            yield {"n": n}

VARIANT_MISTAKES = (
    VariantMistake(
        _window_edges,
        "window off by one at the {side} edge: the kernel computes window={other}, not {window} "
        "(the window is inclusive: {edge})",
        lambda ev, other, **_: ev.precise(ev.allowed(window=other))),
    VariantMistake(
        _if(_WINDOW),
        "the window is aligned top-left (around j = i), not bottom-right around j = i + (Nk - Nq) "
        "as FlashAttention's window_size",
        lambda ev: ev.precise(ev.allowed(window_offset=0))),
    VariantMistake(
        _if(_WINDOW),
        "the window and causal are both aligned top-left (around j = i), not bottom-right "
        "(j = i + (Nk - Nq))",
        lambda ev: ev.precise(ev.allowed(window_offset=0, causal_offset=0))),
    VariantMistake(
        lambda ev: ([{"swapped": _kw(ev, "window")[::-1]}]
                    if _WINDOW(ev) and _kw(ev, "window")[0] != _kw(ev, "window")[1] else []),
        "the window's sides are swapped: window=(left, right) counts left keys before the "
        "diagonal and right after it, got {swapped}",
        lambda ev, swapped: ev.precise(ev.allowed(window=swapped))),
    VariantMistake(_if(_WINDOW), "the window is ignored",
                   lambda ev: ev.precise(ev.allowed(window=None))),
    VariantMistake(
        _if(lambda ev: _CAP(ev) and not ev.allowed().all()),
        "softcap applied after the mask: c·tanh(-inf / c) = -c, so masked keys get weight "
        "exp(-c - m); cap the scaled scores first, then set masked ones to -inf",
        lambda ev: ev.misplaced(cap_at="masked")),
    VariantMistake(
        _if(lambda ev: _CAP(ev) and _ALIBI(ev)),
        "softcap applied after the ALiBi bias: cap the scaled scores, then add the bias "
        "(FlashAttention's order)",
        lambda ev: ev.misplaced(cap_at="biased")),
    VariantMistake(
        _if(_CAP),
        "softcap applied to q·kᵀ before the scale: it caps the scaled scores, c·tanh(τ·q·kᵀ / c) "
        "(FlashAttention passes softmax_scale / softcap to tanh)",
        lambda ev: ev.misplaced(cap_at="unscaled")),
    VariantMistake(_if(_CAP), "softcap is ignored",
                   lambda ev: ev.precise(ev.allowed(), "softcap")),
    VariantMistake(
        _if(_ALIBI),
        "ALiBi's sign is flipped: the bias is -slope·|i + (Nk - Nq) - j|, a penalty growing with "
        "the distance",
        lambda ev: ev.misplaced(alibi="flipped")),
    VariantMistake(
        _if(_ALIBI),
        "ALiBi's distance is aligned top-left, |i - j|: FlashAttention measures it from the "
        "query's position, |i + (Nk - Nq) - j|",
        lambda ev: ev.misplaced(alibi="top-left")),
    VariantMistake(
        _if(lambda ev: _ALIBI(ev) and not _kw(ev, "causal")),
        "ALiBi written as slope·(j - i) (attention-gym's score_mod): that equals "
        "-slope·|i + (Nk - Nq) - j| up to a constant per row only under causal masking; without "
        "it, keys after the diagonal get a bonus instead of a penalty",
        lambda ev: ev.misplaced(alibi="gym")),
    VariantMistake(_if(_ALIBI), "ALiBi's bias is ignored",
                   lambda ev: ev.precise(ev.allowed(), "alibi_slopes")),
    VariantMistake(
        _if(lambda ev: _kw(ev, "enable_gqa")),
        "GQA grouped as h mod Hkv instead of h // (Hq/Hkv): query heads 0, 1, ... of a group are "
        "consecutive (FlashAttention: 'head 0, 1, 2 of Q will attention to head 0 of K, V'; SDPA: "
        "repeat_interleave), not every Hkv-th head (np.tile, Tensor.repeat)",
        _tiled_gqa),
    VariantMistake(
        _if(_MASK_MOD),
        "mask_mod's result is inverted: True means may attend (FlexAttention's convention), not "
        "masked out",
        lambda ev: ev.precise(ev.allowed(mask_mod=lambda a, b: ~_mod(ev)))),
    VariantMistake(
        _if(_MASK_MOD),
        "mask_mod is called with its arguments swapped: it takes (q_idx, k_idx), in that order",
        lambda ev: ev.precise(ev.allowed(mask_mod=lambda a, b: np.asarray(
            _kw(ev, "mask_mod")(b, a), dtype=bool)))),
    VariantMistake(
        _if(lambda ev: _MASK_MOD(ev) and _mod(ev).ndim > 2 and _mod(ev).shape[0] > 1),
        "mask_mod's leading (batch, head) dims are dropped: its first entry is used for every "
        "sequence",
        _first_layout),
    VariantMistake(_if(_MASK_MOD), "mask_mod is ignored",
                   lambda ev: ev.precise(ev.allowed(mask_mod=None))),
    VariantMistake(
        _mask_mod_blocks,
        "mask_mod is called with positions local to the tile (0 ... {last}, block {b}), not "
        "global ones",
        _local),
    VariantMistake(
        _mask_mod_blocks,
        "tiles are skipped when mask_mod is False at their four corners (block {b}): a tile may "
        "be skipped only if mask_mod is False on every pair of it (create_block_mask sums the "
        "whole block)",
        lambda ev, b, last: ev.precise(ev.allowed() & _tile_corners_kept(_mod(ev), b))),
    VariantMistake(
        _sink_counts,
        "the sink is counted {n} times (its weight {n}·exp(sink) in every row, as a sink of "
        "sink + ln {n}): each split or partial state started from the sink and the merge added "
        "them; a sink is one more partial (out 0, lse = sink), merged exactly once",
        lambda ev, n: ev.precise(ev.allowed(), sinks=_sinks(ev) + math.log(n))),
    VariantMistake(_if(_SINKS), "the sinks are ignored: each row's denominator is exp(sink) + "
                   "Σ_j exp(s_ij)", lambda ev: ev.precise(ev.allowed(), "sinks")),
    VariantMistake(
        _if(lambda ev: _SINKS(ev) and _scale(ev) != 1),
        "the sink is multiplied by the scale: a sink is a logit, added to the denominator as it "
        "is (gpt-oss, FlashAttention-3's s_aux), not a score q·k to scale",
        lambda ev: ev.precise(ev.allowed(), sinks=_sinks(ev) * _scale(ev))),
    VariantMistake(
        _if(lambda ev: _SINKS(ev) and _CAP(ev)),
        "the sink is softcapped: the cap applies to the scaled scores, not to the sink",
        lambda ev: ev.precise(ev.allowed(), sinks=_kw(ev, "softcap") * np.tanh(
            _sinks(ev) / _kw(ev, "softcap")))),
    VariantMistake(_if(_SINKS), "the sink's sign is flipped: the denominator holds exp(+sink)",
                   lambda ev: ev.precise(ev.allowed(), sinks=-_sinks(ev))),
)


def _variant_mistake(ev, facts):
    """The classic mistake of a variant that explains the output, if one does: the kernel's
    output is within 5% of its distance to the truth from that mistake's output."""
    if not any(key in ev.inputs.kwargs for key in _POSITIONAL + ("softcap",)):
        return None
    rows = ev.ref.rows & np.isfinite(ev.out).all(axis=-1)
    if not rows.any():
        return None
    to_truth = _max_error(ev.out[rows], ev.ref.out[rows])
    best = None
    for mistake in VARIANT_MISTAKES:
        for fields in mistake.applies(ev):
            to_alt = _max_error(ev.out[rows], mistake.output(ev, **fields)[rows])
            if to_alt <= 0.05 * to_truth and to_alt < 1e-2 and (best is None or to_alt < best[0]):
                best = (to_alt, mistake.message.format(**fields))
    return None if best is None else {"mistake": best[1]}


# --------------------------------------------------------------------------------------------
# Garbage at masked keys: where a case put it, and which rows it reached
# --------------------------------------------------------------------------------------------


def spans(indices):
    """Sorted integers written as ranges: ``[0, 1, 2, 5, 7, 8]`` -> ``"0–2, 5, 7–8"``."""
    indices = [int(i) for i in indices]
    runs = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}–{b}" for a, b in runs)


def nonfinite_kinds(x):
    """What non-finite values ``x`` holds: "NaN", "+inf", "-inf", joined by "/"."""
    return "/".join(name for name, hit in (("NaN", np.isnan(x).any()), ("+inf", (x == np.inf).any()),
                                           ("-inf", (x == -np.inf).any())) if hit)


class Garbage:
    """The inf and NaN a case put in ``k`` and ``v`` (at keys), the pairs that may attend them,
    and the words for where garbage went: which rows it reached, from which keys, hidden from
    those rows how. Built from a case's :class:`Evidence`; ``batch`` are the result's batch dims.

    Which keys brought a row its garbage: those hidden from it, narrowed, where a case holds
    garbage in both k and v, by ``probe(which)``: the rows that come out not finite when the
    kernel (or its backward) is called with the garbage of ``which`` ("k" or "v") alone.
    """

    def __init__(self, ev):
        self.inputs = ev.inputs
        self.batch = ev.ref.lse.shape[:-1]
        n_q, n_k = ev.n_q, ev.n_k
        k, v = (np.broadcast_to(x, self.batch + x.shape[-2:]) for x in (ev.inputs.k, ev.inputs.v))
        self.k, self.v = k, v
        self.in_k = ~np.isfinite(k).all(axis=-1)  # (*batch, Nk)
        self.in_v = ~np.isfinite(v).all(axis=-1)
        self.keys = self.in_k | self.in_v
        self.allowed = np.broadcast_to(ev.allowed(), self.batch + (n_q, n_k))
        self.beyond = (~flash_lib.causal_mask(n_q, n_k) if ev.inputs.kwargs.get("causal")
                       else np.zeros((n_q, n_k), bool))
        #: (*batch, Nq, Nk): the garbage each row may not attend
        self.hidden = self.keys[..., None, :] & ~self.allowed

    def __bool__(self):
        return bool(self.keys.any())

    def only(self, which):
        """``(q, k, v)`` with the garbage of ``which`` ("k" or "v") alone, the other clean."""
        q, k, v = self.inputs.clean
        return (q, self.inputs.k if which == "k" else k, self.inputs.v if which == "v" else v)

    def sources(self, bad, probe=None):
        """(*batch, Nq, Nk): for each ``bad`` row, the garbage keys that brought it garbage."""
        hidden = bad[..., None] & self.hidden
        kinds = [(which, flags) for which, flags in (("k", self.in_k), ("v", self.in_v))
                 if (hidden & flags[..., None, :]).any()]
        if probe is None or len(kinds) < 2:
            return hidden
        found = np.zeros_like(hidden)
        for which, flags in kinds:
            found |= hidden & probe(which)[..., None] & flags[..., None, :]
        unexplained = bad & ~found.any(axis=-1)  # neither garbage alone does it
        return found | (unexplained[..., None] & hidden)

    def where(self, b):
        """``"batch 0, "`` for batch element ``b`` (nothing without batch dims)."""
        if not self.batch:
            return ""
        return f"batch {b[0] if len(b) == 1 else b}, "

    def kind(self, b, keys):
        """What garbage the keys of batch element ``b`` hold, e.g. ``"v NaN"`` or ``"k NaN at
        30–33; v +inf at 34–39"``."""
        labels = {}
        for j in keys:
            label = ", ".join(f"{name} {nonfinite_kinds(x[b][j])}" for name, x, bad in
                              (("k", self.k, self.in_k), ("v", self.v, self.in_v)) if bad[b][j])
            labels.setdefault(label, []).append(j)
        if len(labels) == 1:
            return next(iter(labels))
        return "; ".join(f"{label} at {spans(js)}" for label, js in labels.items())

    def how(self, b, rows, keys):
        """How the keys are hidden from the rows, and who attends them."""
        attend = np.flatnonzero(self.allowed[b][:, keys].any(axis=-1))
        it = "it" if len(keys) == 1 else "them"
        who = (f"no row may attend {it}" if not attend.size else
               f"row{'s' if attend.size > 1 else ''} {spans(attend)} attend{'s' * (attend.size == 1)}"
               f" {it}")
        if self.beyond[np.ix_(rows, keys)].all():
            return f"beyond their causal diagonal; {who}"
        return f"masked for them; {who}"

    def groups(self, sources):
        """``(b, rows, keys)``: in each batch element, the keys that brought garbage to the same
        rows, together (``sources`` from :meth:`sources`)."""
        found = []
        for b in np.ndindex(self.batch):
            by_rows = {}
            for j in np.flatnonzero(sources[b].any(axis=0)):
                by_rows.setdefault(tuple(np.flatnonzero(sources[b][:, j])), []).append(j)
            found += [(b, np.array(rows), keys) for rows, keys in by_rows.items()]
        return found

    def describe(self, sources, most=4):
        """``"batch 0, rows 0–20 from key 21 (v NaN; beyond their causal diagonal; rows 21–79
        attend it); ..."``, or "" if no row got garbage."""
        parts = [f"{self.where(b)}row{'s' if rows.size > 1 else ''} {spans(rows)} from "
                 f"key{'s' if len(keys) > 1 else ''} {spans(keys)} ({self.kind(b, keys)}; "
                 f"{self.how(b, rows, keys)})" for b, rows, keys in self.groups(sources)]
        more = f"; and {len(parts) - most} more" if len(parts) > most else ""
        return "; ".join(parts[:most]) + more

    def through(self, sources):
        """Which of k and v brought the garbage: ``(through k, through v)``."""
        return (bool((sources & self.in_k[..., None, :]).any()),
                bool((sources & self.in_v[..., None, :]).any()))

    def block_rows(self, block):
        """(*batch, Nq): the rows hidden from garbage in v at a key that another row of their
        query block of ``block`` rows attends (a kernel that zeroes the v of keys no row of a
        tile may attend lets exactly these through)."""
        hidden = self.hidden & self.in_v[..., None, :]
        starts = np.arange(hidden.shape[-2]) // block * block
        attend = np.zeros_like(hidden)
        for start in np.unique(starts):
            rows = starts == start
            attend[..., rows, :] = (self.allowed[..., rows, :] & self.in_v[..., None, :]).any(
                axis=-2, keepdims=True)
        return (hidden & attend).any(axis=-1)

    def mechanism(self, sources):
        """How the garbage got through, from the pattern of the rows it reached: k's garbage
        through the scores; v's through 0 · inf in P·V, at every masked pair or per tile."""
        through_k, through_v = self.through(sources)
        how = []
        if through_v:
            reached = (sources & self.in_v[..., None, :]).any(axis=-1)
            every = (self.hidden & self.in_v[..., None, :]).any(axis=-1)
            tiled = next((block for block in _BLOCKS if not np.array_equal(reached, every)
                          and np.array_equal(reached, self.block_rows(block))), None)
            how.append(
                "from v: a masked pair weighs 0, but 0 · inf = NaN in P·V; " + (
                    f"these are exactly the rows that share a {tiled}-row query block with a row "
                    f"that attends the key: the kernel zeroes the v of keys that no row of a "
                    f"tile may attend, which misses a key the tile's other rows attend (partly "
                    f"masked, or on the causal diagonal); keep every masked pair out of P·V "
                    f"(select its products with where)" if tiled else
                    "keep masked pairs out of P·V (zero the v of keys no row may attend; for a "
                    "key some rows attend, select the products with where)"))
        if through_k:
            how.append("from k: NaN in k makes that key's scores NaN, and a mask added as a bias "
                       "(NaN + (-inf) = NaN) or applied after the exponential lets it through: "
                       "set the masked scores to -inf with where, before the max and the exp")
        return "; ".join(how)

    def explain(self, bad, probe=None, what="non-finite values in k or v at keys these rows may "
                                             "not attend reached them"):
        """The whole diagnosis for the bad rows, or None if garbage does not explain them."""
        sources = self.sources(bad, probe)
        if not sources.any():
            return None
        mechanism = self.mechanism(sources)
        return {"garbage": f"{what}: {self.describe(sources)}. "
                           f"{mechanism[0].upper()}{mechanism[1:]}"}


def _garbage(ev, facts):
    """The rows ``bad`` got garbage from keys they may not attend (the case put it there)."""
    if ev.inputs.clean is None:
        return None
    garbage = Garbage(ev)
    return garbage and garbage.explain(facts["bad"], functools.partial(
        ev.garbage_probe, garbage, of_lse=facts.get("of_lse", False)))


def _garbage_hidden(ev, facts):
    garbage = Garbage(ev)
    parts = []
    for b in np.ndindex(garbage.batch):
        rows = np.flatnonzero(facts["hidden"][b])
        if rows.size:
            keys = np.flatnonzero((garbage.allowed[b][rows] & garbage.in_v[b]).any(axis=0))
            parts.append(f"{garbage.where(b)}rows {spans(rows)} (key{'s' * (keys.size > 1)} "
                         f"{spans(keys)}: {garbage.kind(b, keys)})")
    return {"where": "; ".join(parts)}


#: Why rows allowed to attend an inf or NaN in v (``hidden``) came out finite.
GARBAGE_HIDDEN = (
    Mistake(_garbage_hidden,
            "rows that may attend a key whose v holds inf or NaN came out finite: {where}: the "
            "garbage must reach exactly the rows allowed to attend it, as a NaN in q does; a "
            "kernel that replaces non-finite values by 0 (nan_to_num, a where on v) hides a "
            "broken cache instead of keeping it from the other rows"),
    Mistake(always, "rows that attend an inf or NaN in v came out finite"),
)


# --------------------------------------------------------------------------------------------
# The tables, one per check
# --------------------------------------------------------------------------------------------


def _tail_rows(ev, facts):
    row_err = flash_lib.rowwise_relative_error(ev.out, ev.ref.out)
    wrong = np.where(ev.ref.rows, row_err, 0) > 1e-2
    wrong = wrong.any(axis=tuple(range(wrong.ndim - 1)))
    for b in _BLOCKS:
        first = ev.n_q - ev.n_q % b
        if 0 < first < ev.n_q and wrong[first:].all() and not wrong[:first].any():
            return {"first": first, "last": ev.n_q - 1}
    return None


def _scale_ignored(ev, facts):
    scale = ev.inputs.kwargs.get("scale")
    if scale is None:
        return None
    alt = flash_lib.precise_attention(ev.q, ev.k, ev.v, **ev.other_kwargs("scale"))
    return {"scale": scale} if ev.closer_to(alt) else None


def _float32_precision(err):
    """A condition: a float64 run whose error ``err(evidence, facts)`` is float32's."""
    eps32 = float(np.finfo(np.float32).eps)

    def test(ev, facts):
        e = err(ev, facts)
        return (ev.ctx.dtype == "float64" and 1e-3 * eps32 < e < 1e3 * eps32
                and {"err": e, "eps32": eps32})
    return test


def _first_keys_masked(ev, facts):
    allowed = np.broadcast_to(ev.allowed(), ev.ref.lse.shape + (ev.n_k,))
    bad = facts["bad"]
    values = ev.lse[bad] if facts["of_lse"] else ev.out[bad]
    return np.isnan(values).any() and (~allowed[..., 0][bad]).all()


def _uniform_weights(ev, facts):
    v_mean = np.broadcast_to(ev.inputs.v.astype(np.float64).mean(axis=-2, keepdims=True),
                             ev.ref.out.shape)[ev.ref.empty]
    tol = 2e-2 if ev.ctx.dtype == "float16" else 1e-5
    return np.allclose(facts["rows"].astype(np.float64), v_mean, rtol=tol, atol=tol)


def _lse_pair(ev, facts):
    rows = facts["rows"]
    return ev.lse[rows].astype(np.float64), ev.ref.lse[rows].astype(np.float64)


def _lse_base2(ev, facts):
    got, true = _lse_pair(ev, facts)
    return got.size and np.allclose(got, true * math.log2(math.e), rtol=1e-3, atol=1e-3)


def _alibi_row_constant(ev, facts):
    """Under causal masking, ALiBi written as slope·(j - i) (attention-gym) or slope·j
    (FlashAttention's CUDA kernel) gives the same output but an lse shifted by a constant per
    row: say which, if the lse is off by exactly that."""
    kwargs, rows = ev.inputs.kwargs, facts["rows"]
    if kwargs.get("alibi_slopes") is None or not kwargs.get("causal"):
        return None
    shape = ev.ref.lse.shape
    slopes = np.broadcast_to(np.asarray(kwargs["alibi_slopes"], np.float64)[..., None], shape)
    position = np.arange(ev.n_q) + (ev.n_k - ev.n_q)  # i + (Nk - Nq)
    shift = (ev.lse.astype(np.float64) - ev.ref.lse.astype(np.float64))[rows]
    forms = {"slope·(j - i), attention-gym's form, which shifts it by slope·(Nk - Nq)":
             slopes * (ev.n_k - ev.n_q),
             "slope·j, as FlashAttention's CUDA kernel adds it under causal "
             "(csrc/flash_attn/src/alibi.h), which shifts it by slope·(i + Nk - Nq)":
             slopes * position}
    for form, expected in forms.items():
        expected = expected[rows]
        if np.abs(expected).max(initial=0) > 1e-3 and np.allclose(shift, expected, rtol=1e-4,
                                                                   atol=1e-4):
            return {"form": form}
    return None


def _constant_shift(ev, facts):
    got, true = _lse_pair(ev, facts)
    if got.size > 1:
        shift = got - true
        c = float(np.mean(shift))
        if abs(c) > 1e-3 and np.ptp(shift) < 1e-3 * abs(c):
            return {"c": c, "near": " = ln 2" if abs(c - math.log(2)) < 1e-3 else ""}
    return None


def _hint(prefix=""):
    """The last row of a table: the case's own hint."""
    return Mistake(lambda ev, facts: {"hint": ev.ctx.case.hint or "error above the bound"},
                   prefix + "{hint}")


#: The last row of the non-finite table (the hint as the case gives it, possibly empty).
_NON_FINITE_HINT = Mistake(lambda ev, facts: {"hint": ev.ctx.case.hint},
                           "non-finite where the exact result is finite: {hint}")


TOP_LEFT = Mistake(
    lambda ev, facts: ev.top_left,
    "causal is aligned top-left (key j allowed iff j <= i): with Nq = {n_q} != Nk = {n_k} it must "
    "be bottom-right, j <= i + (Nk - Nq) (FlashAttention >= 2.1; in PyTorch pass "
    "torch.nn.attention.bias.causal_lower_right, not is_causal=True)")
DROPPED_KEYS = Mistake(
    lambda ev, facts: ev.dropped_keys,
    "the output is attention over the first {n} of {n_k} keys: the last partial key block is "
    "dropped (block_k divides {n}; loop to Nk, not to the last multiple of block_k)")
FLOAT32_PRECISION = ("float64 result only as accurate as float32 (error {err:.2g}, float32's eps "
                     "{eps32:.2g}): some step (scores, softmax or P·V) runs in float32")

#: Why the output's error is above its bound.
OUT_ERROR = (
    Mistake(_variant_mistake, "{mistake}"),
    TOP_LEFT,
    DROPPED_KEYS,
    Mistake(_tail_rows, "rows {first} to {last} are wrong, the rows before them right: the last "
            "partial query block is dropped or mishandled (block_q divides {first})"),
    Mistake(_scale_ignored, "the scale argument ({scale:g}) is ignored: the output is attention "
            "with the default 1/sqrt(d)"),
    Mistake(_float32_precision(lambda ev, facts: ev.out_error or 0.0), FLOAT32_PRECISION),
    Mistake(lambda ev, facts: ev.key_order(),
            "the result depends on the order of the keys: on one row, error {err_first:.2g} with "
            "its largest score first, {err_last:.2g} with it last: when the running max rises "
            "from m to m', l and acc are not rescaled by exp(m - m') (or p is taken against the "
            "old max)"),
    Mistake(lambda ev, facts: ev.float16_only(),
            "fails in float16 only, where float32 passed: the sums are accumulated in float16 "
            "(l, acc or P·V); accumulate in float32, as FlashAttention does, and round once at "
            "the end"),
    _hint(),
)

def _sink_empty_rows(ev, facts):
    """The rows ``bad`` have no allowed key, and a sink: out 0 and lse = sink there."""
    if not _SINKS(ev):
        return None
    allowed = np.broadcast_to(ev.allowed(), ev.ref.lse.shape + (ev.n_k,))
    none = ~allowed.any(axis=-1)
    return bool(none[facts["bad"]].all()) and {"what": "lse" if facts["of_lse"] else "out"}


#: Why out (or the lse, ``of_lse``) is not finite in the rows ``bad``, where the truth is.
NON_FINITE = (
    Mistake(_sink_empty_rows,
            "{what} of a row with no allowed key is not finite, and the row has a sink: with a "
            "sink no row is empty (it starts at m = sink, l = 1, acc = 0 and ends with out = 0, "
            "lse = sink); the empty-row guard (lse = -inf, or 0 / 0) overrides the sink"),
    TOP_LEFT,
    Mistake(lambda ev, facts: ev.ctx.case.name == "late_max",
            "exp overflowed where the row max rises: p = exp(s - m) is taken against a stale "
            "running max; use the new max m' = max(m, rowmax(s)) for p and for the rescale "
            "exp(m - m')"),
    Mistake(lambda ev, facts: ev.ctx.case.name == "float16_overflow" or ev.float16_only(),
            "non-finite in float16 only: scores past 65504 overflow float16; compute q·kᵀ and the "
            "softmax in float32"),
    Mistake(_garbage, "{garbage}"),
    Mistake(lambda ev, facts: ev.inputs.nan_rows is not None,
            "the NaN in one row of q reached other rows: rows must stay independent"),
    Mistake(_first_keys_masked,
            "NaN in rows that have allowed keys but whose first keys are masked: a key block "
            "with no allowed key gives exp(-inf - (-inf)) = NaN while the running max is still "
            "-inf; guard it (a finite reference, e.g. 0, for such rows)"),
    DROPPED_KEYS,
    _NON_FINITE_HINT,
)

#: Why rows with no allowed key (their out, ``rows``; ``nan``, which are NaN) are not 0.
EMPTY_ROWS = (
    Mistake(lambda ev, facts: facts["nan"].any() and _garbage(ev, {"bad": facts["nan_rows"]}),
            "fully masked row is NaN: {garbage}"),
    Mistake(lambda ev, facts: facts["nan"].any() and "mask_mod" in ev.inputs.kwargs,
            "fully masked row is NaN: mask_mod allows none of its pairs, so its tiles are skipped "
            "or all -inf and l = 0; out = acc / l is then 0 / 0 (or the exp(-inf - (-inf)) guard "
            "is missing): return 0 where l = 0"),
    Mistake(lambda ev, facts: facts["nan"].any(),
            "fully masked row is NaN: the exp(-inf - (-inf)) guard is missing (use a finite "
            "reference, e.g. 0, where the running max is still -inf, and 0 where l = 0)"),
    TOP_LEFT,
    Mistake(_uniform_weights,
            "fully masked row gets uniform weights (the mean of all values): masked scores are "
            "set to a large finite negative number (-1e9, -0.7 * finfo.max) instead of -inf, and "
            "empty rows are not zeroed"),
    Mistake(always, "fully masked rows are not 0: an empty row must give the empty sum, 0"),
)

#: Why the lse of rows with no allowed key (``got``, shown as ``values``) is not ``lse_empty``.
EMPTY_LSE = (
    Mistake(lambda ev, facts: np.isnan(facts["got"]).any(),
            "the lse of a fully masked row is NaN, expected lse_empty = {lse_empty}: log(0) or "
            "-inf - (-inf) of an empty row is not guarded"),
    Mistake(lambda ev, facts: (np.isfinite(facts["got"]).all()
                               and (np.abs(facts["got"]) > 1e6).all()),
            "the lse of a fully masked row is {values}, expected lse_empty = {lse_empty}: masked "
            "scores are a large finite number rather than -inf"),
    TOP_LEFT,
    Mistake(always, "the lse of a fully masked row is {values}, expected lse_empty = "
            "{lse_empty}; if that is the kernel's convention (FlashAttention writes +inf, "
            "PyTorch's CPU flash op 0.0), pass it as lse_empty"),
)

#: Why the lse's error (``err``, over the ``rows`` measured) is above its bound.
LSE_ERROR = (
    Mistake(_lse_base2, "lse is in log base 2 (lse · log2(e), as kernels built on exp2 store "
            "it): multiply by ln 2 to return the natural log-sum-exp"),
    Mistake(lambda ev, facts: ev.out_failed and {"out": ev.explain_out()}, "as the output: {out}"),
    Mistake(_alibi_row_constant,
            "the output is right but the lse is that of ALiBi written as {form}: under causal "
            "masking the two biases differ by a constant per row, which softmax ignores and the "
            "lse does not; the lse expected is that of -slope·|i + (Nk - Nq) - j|"),
    Mistake(_constant_shift, "lse is off by the same constant {c:.4g}{near} in every row"),
    Mistake(_float32_precision(lambda ev, facts: facts["err"]), FLOAT32_PRECISION),
    Mistake(lambda ev, facts: ev.float16_only(),
            "lse wrong in float16 only, where float32 passed: part of it (the scores, exp or the "
            "sum l) is computed at float16 precision; FlashAttention keeps them in float32"),
    _hint("lse wrong: "),
)


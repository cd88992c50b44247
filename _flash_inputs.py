"""flash_lib's input checking: every kernel's arguments validated into one :class:`Problem`, so
that all of them accept and reject exactly the same inputs with the same messages; and the
public way in for the code built on flash_lib, :func:`check` (``flash_lib.check_inputs``), which
applies the same rules to shapes and dtypes alone and returns :class:`Checked`.

Private to flash_lib: imported by ``flash_lib.py``, ``flash_reference.py`` and
``_flash_runtime.py`` (its one integer check) only, and by the tests of its internals. Other code
uses flash_lib's public names.
"""

from __future__ import annotations

import functools
import math
import numbers
import threading
from dataclasses import dataclass

import numpy as np

import _flash_dropout as dropout
import _flash_tiles as tiles

try:  # bfloat16 is not a NumPy dtype; ml_dtypes (a dependency) provides it.
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # flash_lib copied without ml_dtypes: float16, float32, float64 only
    BFLOAT16 = None

FLOAT_DTYPES = (np.float16, np.float32, np.float64)
# Computed in float32: float16 has 11 bits of mantissa and overflows at 65504, bfloat16 has 8.
# (Never compare a dtype with BFLOAT16 when it may be None: NumPy reads None as float64.)
HALF_DTYPES = (np.dtype(np.float16),) + (() if BFLOAT16 is None else (BFLOAT16,))
FLOAT_NAMES = "float16, bfloat16, float32 or float64"
#: The largest ``dropout_p`` the kernels accept. The keep mask keeps a weight with probability
#: ``1 - round(p·2¹⁶)/2¹⁶``, within ``2⁻¹⁷`` of ``1 - p``, so ``E[P∘Z/(1 - p)]`` is ``P`` within a
#: relative ``2⁻¹⁷/(1 - p)``: at most ``2⁻⁸`` (bfloat16's unit roundoff) for ``p <= 1 - 2⁻⁹``.
#: Beyond it the error grows without bound (at ``p >= 1 - 2⁻¹⁷`` nothing is kept at all).
MAX_DROPOUT_P = 1 - 2**-9
#: log2(e) and ln(2): e^x = 2^(x·log2 e), and log x = log2(x) · ln 2
LOG2E, LN2 = 1 / math.log(2), math.log(2)


def is_float(dtype):
    """One of the dtypes the kernels accept; a bfloat16 that ml_dtypes did not provide is refused."""
    if dtype.name == "bfloat16" and BFLOAT16 is None:
        raise TypeError("bfloat16 arrays need the ml_dtypes package, which flash_lib could not "
                        "import: install ml_dtypes, or pass float16, float32 or float64")
    return dtype.type in FLOAT_DTYPES or (BFLOAT16 is not None and dtype == BFLOAT16)




@dataclass(frozen=True, kw_only=True)
class Problem:
    """Validated inputs (``q``, ``k``, ``v``, ``mask`` unbroadcast) and what the kernels derive;
    built by keyword, by :func:`check_inputs` only.

    With ``enable_gqa`` the head axis of ``q`` (and of the mask, the ALiBi slopes, mask_mod's
    result) is split into (Hkv, groups) and ``k``, ``v`` get a groups axis of 1, so that NumPy's
    broadcasting pairs each query head with its kv head; ``merge_heads`` and ``input_shapes``
    undo the split on the results.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None
    band: tiles.Band  # causal and window
    scale: float
    scale_q: float  # r·2^a, see the module docstring
    scale_k: float  # 2^b
    softcap: float | None
    alibi: np.ndarray | None  # the slopes, shaped (..., 1, 1) to broadcast against a tile
    mask_mod: object  # callable or None
    sinks: np.ndarray | None  # float64, shaped (..., 1) to broadcast against a block's rows
    sinks_shape: tuple | None  # the caller's shape of sinks: dsinks is summed back to it
    dropout_p: float = 0.0
    dropout_seed: int | None = None
    dropout_offset: tuple = (0, 0)  # global position of query row 0 and key 0
    batch: tuple
    out_dtype: np.dtype
    dtype: np.dtype  # the compute dtype: float32 for 16-bit inputs
    groups: int | None = None  # with enable_gqa: query heads per kv head
    shapes: tuple = ()  # the caller's q, k, v shapes
    user_batch: tuple = ()  # the broadcast batch as the caller sees it (Hq heads)

    @property
    def n_q(self):
        return self.q.shape[-2]

    @property
    def n_k(self):
        return self.k.shape[-2]

    @property
    def dv(self):
        return self.v.shape[-1]

    @property
    def n_scores(self):
        """Entries of the (never stored) score matrix: what decides whether threads pay."""
        return math.prod(self.batch) * self.n_q * self.n_k

    def q_tile(self, start, stop, dtype=None, out=None):
        """``τ_q · q`` for queries ``start:stop`` (into ``out``, a buffer of at least its rows)."""
        dtype = self.dtype if dtype is None else dtype
        q = self.q[..., start:stop, :]
        if out is not None:
            out = out[..., : stop - start, :]
        return np.multiply(q, dtype.type(self.scale_q), dtype=dtype, out=out)

    def k_tile(self, start, stop, dtype=None):
        """``τ_k · k`` for keys ``start:stop`` (``τ_k = 2^b``, a power of two)."""
        dtype = self.dtype if dtype is None else dtype
        if self.scale_k == 1:
            return self.k[..., start:stop, :].astype(dtype, copy=False)
        # a k shared by every head is scaled once, not once per head
        return np.multiply(self.k_stored[..., start:stop, :], dtype.type(self.scale_k), dtype=dtype)

    def v_tile(self, start, stop, dtype=None):
        return self.v[..., start:stop, :].astype(self.dtype if dtype is None else dtype, copy=False)

    @functools.cached_property
    def k_stored(self):
        """``k`` with its batch axes broadcast with stride 0 cut to length 1 (the matmuls
        broadcast them back): the keys as memory holds them."""
        return self.k[tuple(slice(0, 1) if n > 1 and st == 0 else slice(None)
                            for n, st in zip(self.k.shape[:-2], self.k.strides))]

    @functools.cached_property
    def product_bound(self):
        """An upper bound on every ``|τ q·k|``, the scores before the variants: ``d · max|τ_q q| ·
        max|τ_k k|`` over the finite entries (a Python float; inf beyond float64)."""
        return (self.q.shape[-1] * (largest_finite(self.q) * self.scale_q)
                * (largest_finite(self.k) * self.scale_k))

    def mask_mod_tile(self, q_start, q_stop, k_start, k_stop):
        """``mask_mod`` on one tile, checked, with its head axis split for grouped queries."""
        allowed = call_mask_mod(self.mask_mod, q_start, q_stop, k_start, k_stop)
        expected = self.user_batch + (q_stop - q_start, k_stop - k_start)
        if not broadcasts_to(allowed.shape, expected):
            raise ValueError(
                f"mask_mod returned an array of shape {allowed.shape}, which does not broadcast "
                f"to (..., tile_q, tile_k) = {expected}"
            )
        return split_heads(allowed, -3, self.groups) if self.groups else allowed

    def keep_tile(self, q_start, q_stop, k_start, k_stop, out=None):
        """The dropout keep mask of one tile, bool ``batch + (rows, keys)``; None without dropout.
        Keyed by the global positions (the offset added) and the flat batch index, which with
        grouped queries is the same over (…, Hkv, groups) as over the caller's (…, Hq).
        ``out``: a flat bool array of the mask's size to write it to."""
        if not self.dropout_p:
            return None
        i, j = self.dropout_offset
        keep = dropout.keep(self.dropout_seed, dropout.threshold(self.dropout_p),
                            math.prod(self.batch), (i + q_start, i + q_stop),
                            (j + k_start, j + k_stop), self.dropout_scratch, out)
        return keep.reshape(self.batch + keep.shape[-2:])

    def row(self, q_start, q_stop, block_k):
        """The forward's walk for query block ``q_start:q_stop``: a :class:`tiles.Tile` for each
        key block of its band, in order (exactly its tiles of ``tile_schedule``, plus those
        where ``mask_mod`` allows nothing, whose ``allowed`` is False)."""
        key_blocks = functools.partial(self.band.key_blocks, q_start, q_stop, block_k)
        keep = self._keep_walk((q_start, q_stop, k_start, k_stop) for k_start, k_stop in key_blocks())
        for k_start, k_stop in key_blocks():
            yield tiles.Tile(self, q_start, q_stop, k_start, k_stop, keep)

    def column(self, k_start, k_stop, block_q):
        """The backward's walk for key block ``k_start:k_stop``: a :class:`tiles.Tile` for every
        query block in order; for those the band leaves out ``allowed`` is False (the backward
        still takes its turn at adding to their ``dQ_i``)."""
        keep = self._keep_walk((q_start, q_stop, k_start, k_stop)
                               for q_start, q_stop in tiles.blocks(self.n_q, block_q)
                               if self.band.visits(q_start, q_stop, k_start, k_stop))
        for q_start, q_stop in tiles.blocks(self.n_q, block_q):
            yield tiles.Tile(self, q_start, q_stop, k_start, k_stop, keep,
                             visits=self.band.visits(q_start, q_stop, k_start, k_stop))

    def _keep_walk(self, walk):
        """The keep masks along ``walk`` (:class:`tiles.KeepWalk`), or None without dropout."""
        if not self.dropout_p:
            return None
        return tiles.KeepWalk(self, walk, tiles.tiles_per_draw(self))

    def initial_state(self, rows):
        """Each row's ``(m, l)`` before its first key: ``(-inf, 0)``; with a sink, ``(sink, 1)``:
        the sink is one key already seen, of score ``sink`` and value 0 (``acc`` stays 0). A row
        its keys add nothing to ends with ``lse = sink + log 1 = sink`` exactly."""
        if self.sinks is None:
            return np.full(rows, -np.inf, self.dtype), np.zeros(rows, self.dtype)
        m = np.broadcast_to(self.sinks.astype(self.dtype), rows).copy()
        return m, np.ones(rows, self.dtype)

    def dsinks(self, lse, D):
        """``dsinks_h = -Σ_i exp(sink_h - lse_i) · D_i`` over head h's rows, summed to sinks' shape.

        The sink is one more key, of score ``sink`` and value 0: it enters ``out_i`` only
        through the denominator, ``∂P_ij/∂sink = -P_ij · P_i,sink`` with ``P_i,sink = exp(sink -
        lse_i)``, so ``Σ_j dP_ij · ∂P_ij/∂sink = -P_i,sink · D_i`` (``D_i = Σ_j P_ij dP_ij``)."""
        p_sink = np.exp(self.sinks.astype(lse.dtype) - lse)
        return tiles.sum_to(self.merge_heads(-(p_sink * D).sum(axis=-1)), self.sinks_shape)

    def dropout_scale(self, dtype):
        """``1 / (1 - p)`` in ``dtype``: the kept weights' factor (FlashAttention's), so that
        ``E[P ∘ Z / (1 - p)] = P`` within a relative ``2⁻¹⁷/(1 - p) <= 2⁻⁸`` (``MAX_DROPOUT_P``),
        exactly when ``p·2¹⁶`` is an integer."""
        return dtype.type(1) / (dtype.type(1) - dtype.type(self.dropout_p))

    def merge_heads(self, x):
        """A result with the grouped-query split (…, Hkv, groups, Nq, …) back to (…, Hq, Nq, …)."""
        if not self.groups or x is None:
            return x
        lead = len(self.batch) - 2
        heads = x.shape[lead] * x.shape[lead + 1]  # not -1: an empty result has no size to divide
        return x.reshape(x.shape[:lead] + (heads,) + x.shape[lead + 2:])

    def input_shapes(self, dq, dk, dv):
        """Gradients in the caller's shapes of q, k, v (undoing the grouped-query split)."""
        return tuple(g.reshape(shape) for g, shape in zip((dq, dk, dv), self.shapes))

    @functools.cached_property
    def dropout_scratch(self):
        return threading.local()  # each worker's Philox buffers and mask, for this call only

    @functools.cached_property
    def _nonfinite(self):
        return {}  # name -> sorted row indices, filled on first use (once per call)

    def nonfinite_rows(self, name, start, stop, x=None):
        """Positions, within rows ``start:stop`` of ``q``, ``k``, ``v`` (or ``x``, under
        ``name``), of the rows holding an inf or NaN; or None when there are none."""
        if name not in self._nonfinite:
            self._nonfinite[name] = nonfinite_rows(getattr(self, name) if x is None else x)
        rows = self._nonfinite[name]
        lo, hi = np.searchsorted(rows, (start, stop))
        return rows[lo:hi] - start if hi > lo else None

    def bad_values(self, k_start, k_stop):
        """Positions, within keys ``k_start:k_stop``, of values holding inf or NaN; or None."""
        return self.nonfinite_rows("v", k_start, k_stop)


def largest_finite(x):
    """``max |x|`` over the finite entries of ``x`` (0 if none), a Python float: with ``max`` and
    ``min``, which make no temporaries, unless ``x`` holds an inf or NaN, then 1024 rows at a time."""
    if x.size == 0:
        return 0.0
    hi, lo = float(x.max()), float(x.min())
    if math.isfinite(hi) and math.isfinite(lo):
        return max(hi, -lo)
    best = 0.0
    for start in range(0, x.shape[-2], 1024):
        chunk = np.abs(x[..., start : start + 1024, :])
        best = max(best, float(chunk.max(initial=0, where=np.isfinite(chunk))))
    return best


def nonfinite_rows(x):
    """Sorted indices (axis -2) of the rows of ``x`` holding an inf or NaN in any batch entry.

    A chunk of rows at a time, so that finding them needs no scratch proportional to N.
    """
    batch_axes = tuple(range(x.ndim - 2))
    found = [
        start + np.flatnonzero(~np.isfinite(chunk).all(axis=-1).all(axis=batch_axes))
        for start in range(0, x.shape[-2], 1024)
        for chunk in [x[..., start : start + 1024, :]]
    ]
    return np.concatenate(found) if found else np.zeros(0, dtype=np.intp)


def check_saved(problem, out=None, lse=None, dout=None):
    """The forward's ``out`` and ``lse`` and the incoming ``dout``, checked against q, k, v."""
    shapes = saved_shapes(problem.user_batch, problem.n_q, problem.dv)
    checked = []
    for name, x in (("out", out), ("lse", lse), ("dout", dout)):
        if x is None:
            continue
        x = c_order(check_saved_shape(name, np.asarray(x), shapes[name]))
        if problem.groups:
            x = split_heads(x, -2 if name == "lse" else -3, problem.groups)
        checked.append(x)
    return checked[0] if len(checked) == 1 else tuple(checked)


def saved_shapes(user_batch, n_q, dv):
    """The shapes of ``out``, ``lse`` and ``dout`` for a call of these q, k, v (and mask)."""
    return {"out": user_batch + (n_q, dv), "lse": user_batch + (n_q,), "dout": user_batch + (n_q, dv)}


def check_saved_shape(name, x, shape):
    """One of ``out``, ``lse``, ``dout``: a float array of the ``shape`` the forward returns."""
    if not is_float(x.dtype):
        raise TypeError(f"{name} must be a {FLOAT_NAMES} array, got dtype {x.dtype}")
    if x.shape != shape:
        raise ValueError(
            f"{name} must have shape {shape}, what the forward returns for these q, k, v "
            f"(and mask), got {x.shape}"
        )
    return x


def c_order(x):
    """``x`` in C order, so that no result depends on the caller's memory layout (BLAS and
    NumPy's loops pick their kernels and summation orders by strides: a Fortran-order, strided
    or transposed ``k`` moved results by an ulp). A no-op for a C-contiguous array; axes
    broadcast with stride 0 stay broadcast (never materialised), the rest is copied once."""
    if x.flags.c_contiguous:
        return x
    stretched = tuple(slice(0, 1) if n > 1 and st == 0 else slice(None)
                      for n, st in zip(x.shape, x.strides))
    return np.broadcast_to(np.ascontiguousarray(x[stretched]), x.shape)


def as_float_array(name, x, longdouble=False):
    return check_float_array(name, np.asarray(x), longdouble)


def check_float_array(name, x, longdouble=False):
    """``x`` itself, checked: a float dtype the kernels accept and at least 2 dimensions."""
    if not (longdouble and x.dtype == np.longdouble) and not is_float(x.dtype):
        raise TypeError(f"{name} must be a {FLOAT_NAMES} array, got dtype {x.dtype}")
    if x.ndim < 2:
        raise ValueError(
            f"{name} must have at least 2 dimensions (..., N, features), got shape {x.shape}"
        )
    return x


def check_merge(out_a, lse_a, out_b, lse_b):
    """The arguments of ``merge_attention``, checked."""
    out_a = c_order(as_float_array("out_a", out_a, longdouble=True))
    out_b = c_order(as_float_array("out_b", out_b, longdouble=True))
    lse_a, lse_b = c_order(np.asarray(lse_a)), c_order(np.asarray(lse_b))
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.dtype != np.longdouble and not is_float(x.dtype):
            raise TypeError(f"{name} must be a {FLOAT_NAMES} (or longdouble) array, got dtype "
                            f"{x.dtype}")
    if out_a.shape != out_b.shape:
        raise ValueError(
            f"out_a and out_b must have the same shape, got {out_a.shape} and {out_b.shape}"
        )
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.shape != out_a.shape[:-1]:
            raise ValueError(
                f"{name} must have shape out.shape[:-1] = {out_a.shape[:-1]}, got {x.shape}"
            )
        if np.any(x == np.inf):
            raise ValueError(
                f"{name} is +inf in {np.count_nonzero(x == np.inf)} row(s). FlashAttention "
                f"writes +inf as the lse of a row with no allowed key (its out is 0); flash_lib "
                f"writes -inf, which is log(0), the lse such a row has. Convert before merging: "
                f"np.where({name} == np.inf, -np.inf, {name})"
            )
    return out_a, lse_a, out_b, lse_b


def int_at_least(name, value, low):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        kind = "positive" if low == 1 else "non-negative"
        raise ValueError(f"{name} must be a {kind} integer, got {value!r}")
    return int(value)


def block_sizes(block_q, block_k):
    """A kernel's tile size, checked: ``block_q`` and ``block_k`` positive integers."""
    return int_at_least("block_q", block_q, 1), int_at_least("block_k", block_k, 1)


def check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def result_dtype(*dtypes):
    """The output dtype: NumPy's promotion, with float16 and bfloat16 (no common type) → float32."""
    if len(set(dtypes)) > 1 and set(dtypes) <= set(HALF_DTYPES):
        return np.dtype(np.float32)
    rest = [d for d in dtypes if BFLOAT16 is None or d != BFLOAT16] or [BFLOAT16]
    return np.result_type(*rest)


def checked_scale(scale, d, dtype):
    """``scale`` as a float64, refused unless it is a normal number of the compute dtype."""
    if scale is None:
        return 1.0 / math.sqrt(d) if d > 0 else 1.0
    return checked_real("scale", scale, dtype, what="a finite positive number")


def as_float64(name, value, what):
    """A real number as a float64 (±inf beyond its range), or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    with np.errstate(over="ignore", under="ignore"):  # a longdouble beyond float64's range
        try:
            return float(value)
        except OverflowError:  # an int such as 10**400, a Fraction beyond float64
            return math.inf if value > 0 else -math.inf


def checked_real(name, value, dtype, *, what, limit=None, limit_why=""):
    """The one check of a scalar parameter (``scale``, ``softcap``, each ALiBi slope) against
    the compute dtype ``dtype``: a positive number that ``dtype`` holds as a normal number, at most
    ``limit`` (default ``finfo(dtype).max``); returned as a float64. Any ``numbers.Real`` (int,
    Fraction, NumPy scalar, longdouble) is accepted; the error names the argument, its value
    and the range, so that nothing the kernels compute from it overflows or vanishes."""
    as_float = as_float64(name, value, what)
    # the value itself, not its float64 (a longdouble 1e-4000 is positive, and too small)
    if not value > 0 or value == math.inf:  # NaN, <= 0, inf (not a huge finite number)
        raise ValueError(f"{name} must be {what}, got {value!r}")
    info = np.finfo(dtype)
    low, high = float(info.tiny), float(info.max) if limit is None else limit
    if not low <= as_float <= high:
        where = (f"the normal range of the compute dtype {dtype}" if limit is None else
                 f"the range where the compute dtype {dtype} holds it{limit_why}")
        raise ValueError(
            f"{name} = {value!r} is outside {where} [{low:.4g}, {high:.4g}]: in {dtype} it "
            f"{'overflows' if as_float > 1 else 'vanishes'}"
        )
    return as_float


def split_scale(scale):
    """τ = r·2^e (0.5 <= r < 1) → (r·2^a, 2^b) with a + b = e, b = trunc(e/2)."""
    r, e = math.frexp(scale)
    b = int(e / 2)
    return math.ldexp(r, e - b), math.ldexp(1.0, b)


def problem(q, k, v, *, mask, causal, scale, window, softcap, alibi_slopes, enable_gqa, mask_mod,
            sinks, dropout_p, dropout_seed, dropout_offset):
    """Validate and normalise the arguments of every kernel; return a :class:`Problem`."""
    q = as_float_array("q", q)
    k = as_float_array("k", k)
    v = as_float_array("v", v)
    mask = None if mask is None else np.asarray(mask)
    groups, batch, user_batch = check_arrays(q, k, v, mask, enable_gqa=enable_gqa)
    q, k, v = c_order(q), c_order(k), c_order(v)  # after the checks: never copy what is refused
    shapes = (q.shape, k.shape, v.shape)
    if groups:
        q = split_heads(q, -3, groups)
        k, v = k[..., None, :, :], v[..., None, :, :]
        if mask is not None:
            mask = split_heads(mask, -3, groups)
    fields = _variants(q, k, v, user_batch, groups, causal=causal, scale=scale, window=window,
                       softcap=softcap, alibi_slopes=alibi_slopes, mask_mod=mask_mod, sinks=sinks,
                       dropout_p=dropout_p, dropout_seed=dropout_seed,
                       dropout_offset=dropout_offset)
    checked = Problem(q=q, k=k, v=v, mask=mask, batch=batch, groups=groups, shapes=shapes,
                      user_batch=user_batch, **fields)
    _check_scores_fit(checked)
    return checked


def _check_scores_fit(problem):
    """Without softcap, the scores ``τ q·k`` must fit the compute dtype: one beyond it is ±inf,
    and a row holding +inf gets NaN (inf - inf) where the extended-precision truth is finite.
    Checked on the bound ``d · max|τ_q q| · max|τ_k k|`` (finite entries), before any tile.
    With softcap an overflowing product is harmless: ``tanh(±inf) = ±1`` caps it, as the truth."""
    largest = float(np.finfo(problem.dtype).max)
    if problem.softcap is None and not problem.product_bound <= largest:
        raise ValueError(
            f"scale = {problem.scale!r} with these q and k gives scores up to "
            f"{problem.product_bound:.4g} (d · max|q| · max|k| · scale, over their finite "
            f"entries), beyond the compute dtype {problem.dtype}'s largest {largest:.4g}: they "
            f"would overflow to inf and turn rows NaN. Use a smaller scale, smaller inputs, a "
            f"wider dtype, or softcap")


def _variants(q, k, v, user_batch, groups, *, causal, scale, window, softcap, alibi_slopes,
              mask_mod, sinks, dropout_p, dropout_seed, dropout_offset):
    """Every check of the keyword arguments, in one order for every caller: :class:`Problem`'s
    fields other than the arrays. Reads ``q``, ``k``, ``v``'s shapes and dtypes only."""
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    band = tiles.Band.of(n_q, n_k, check_bool("causal", causal), checked_window(window))
    out_dtype = result_dtype(q.dtype, k.dtype, v.dtype)
    dtype = np.dtype(np.float32) if out_dtype in HALF_DTYPES else out_dtype
    scale = checked_scale(scale, d, dtype)
    scale_q, scale_k = split_scale(scale)
    return dict(band=band, scale=scale, scale_q=scale_q, scale_k=scale_k,
                softcap=checked_softcap(softcap, dtype),
                alibi=checked_alibi(alibi_slopes, user_batch, groups, dtype, n_q, n_k),
                mask_mod=checked_mask_mod(mask_mod), out_dtype=out_dtype, dtype=dtype,
                sinks=checked_sinks(sinks, user_batch, groups, dtype),
                sinks_shape=None if sinks is None else np.shape(sinks),
                **checked_dropout(dropout_p, dropout_seed, dropout_offset, n_q, n_k))


@dataclass(frozen=True, kw_only=True)
class Checked:
    """What :func:`check` found valid: the shapes and dtypes of a kernel call's results, and the
    scale it uses. ``flash_lib.check_inputs`` returns it."""

    batch: tuple  #: the leading (batch, head) dims of ``out`` and ``lse``: all inputs broadcast
    n_q: int  #: queries
    n_k: int  #: keys
    d: int  #: features of q and k
    dv: int  #: features of v
    out_dtype: np.dtype  #: ``out``'s dtype: the inputs' (float16 with bfloat16: float32)
    dtype: np.dtype  #: the compute dtype, also the lse's and dsinks': float32 for 16-bit inputs
    scale: float  #: τ, as the kernels apply it: ``1/√d`` unless given
    groups: int | None  #: query heads per kv head, with ``enable_gqa``


def check(q, k, v, *, mask=None, causal=False, scale=None, window=None, softcap=None,
          alibi_slopes=None, enable_gqa=False, mask_mod=None, sinks=None, dropout_p=0.0,
          dropout_seed=None, dropout_offset=(0, 0), block_q=None, block_k=None, out=None,
          lse=None, dout=None):
    """The kernels' checks on shapes and dtypes alone (``flash_lib.check_inputs``): arrays are
    read for their ``shape``, ``ndim`` and ``dtype`` only, so a Dask array is not computed; the
    scalars, ``sinks`` and ``alibi_slopes`` are checked by value. Raises the kernels' own errors."""
    q, k, v = (_shaped(x) for x in (q, k, v))
    mask = None if mask is None else _shaped(mask)
    groups, batch, user_batch = check_arrays(q, k, v, mask, enable_gqa=enable_gqa)
    fields = _variants(q, k, v, user_batch, groups, causal=causal, scale=scale, window=window,
                       softcap=softcap, alibi_slopes=alibi_slopes, mask_mod=mask_mod, sinks=sinks,
                       dropout_p=dropout_p, dropout_seed=dropout_seed,
                       dropout_offset=dropout_offset)
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size is not None:
            int_at_least(name, size, 1)
    n_q, dv = q.shape[-2], v.shape[-1]
    shapes = saved_shapes(user_batch, n_q, dv)
    for name, x in (("out", out), ("lse", lse), ("dout", dout)):
        if x is not None:
            check_saved_shape(name, _shaped(x), shapes[name])
    return Checked(batch=user_batch, n_q=n_q, n_k=k.shape[-2], d=q.shape[-1], dv=dv,
                   out_dtype=fields["out_dtype"], dtype=fields["dtype"], scale=fields["scale"],
                   groups=groups)


def _shaped(x):
    """``x`` itself if it has a shape and a dtype (a NumPy or Dask array), else ``np.asarray(x)``."""
    return x if hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "ndim") else np.asarray(x)


def check_arrays(q, k, v, mask=None, *, enable_gqa=False):
    """The one check of the arrays' dtypes and shapes, for every kernel and for flash_dask.

    ``q``, ``k``, ``v`` and ``mask`` need only ``shape``, ``ndim`` and ``dtype`` (NumPy or Dask
    arrays). Returns ``(groups, batch, user_batch)``: query heads per kv head (None without
    enable_gqa), the broadcast batch the kernels compute over (with grouped queries, Hq split
    into (Hkv, groups)), and the batch of the results as the caller sees it.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float_array(name, x)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same feature size d (last axis), "
            f"got q.shape={q.shape} and k.shape={k.shape}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same number of keys Nk (axis -2), "
            f"got k.shape={k.shape} and v.shape={v.shape}"
        )
    n_q, n_k = q.shape[-2], k.shape[-2]
    groups = gqa_groups(q, k, v) if check_bool("enable_gqa", enable_gqa) else None
    lead_q, lead_k, lead_v = q.shape[:-2], k.shape[:-2], v.shape[:-2]
    if groups:
        lead_q = lead_q[:-1] + (k.shape[-3], groups)
        lead_k, lead_v = lead_k + (1,), lead_v + (1,)
    try:
        batch = np.broadcast_shapes(lead_q, lead_k, lead_v)
    except ValueError:
        raise ValueError(
            f"the leading (batch) dimensions of q, k and v must broadcast together, got "
            f"q.shape={q.shape}, k.shape={k.shape}, v.shape={v.shape}"
        ) from None
    # the batch as the caller sees it: with grouped queries, Hq heads rather than (Hkv, groups)
    user_batch = batch[:-2] + (batch[-2] * batch[-1],) if groups else batch
    if mask is not None:
        if mask.dtype != np.bool_:
            raise TypeError(
                f"mask must be a boolean array (True = may attend), got dtype {mask.dtype}"
            )
        try:
            full = np.broadcast_shapes(mask.shape, user_batch + (n_q, n_k))
        except ValueError:
            full = None
        if full is None or full[-2:] != (n_q, n_k):
            raise ValueError(
                f"mask of shape {mask.shape} does not broadcast to (..., Nq, Nk) = "
                f"{user_batch + (n_q, n_k)}"
            )
        user_batch = full[:-2]
        mask_lead = split_shape(mask.shape, -3, groups)[:-2] if groups else mask.shape[:-2]
        batch = np.broadcast_shapes(batch, mask_lead)
    return groups, batch, user_batch


def gqa_groups(q, k, v):
    """Query heads per kv head, checked: axis -3 holds the heads, Hkv divides Hq."""
    if min(q.ndim, k.ndim, v.ndim) < 3:
        raise ValueError(
            f"enable_gqa needs a head axis (-3) in q, k and v, got q.shape={q.shape}, "
            f"k.shape={k.shape}, v.shape={v.shape}"
        )
    h_q, h_kv = q.shape[-3], k.shape[-3]
    if v.shape[-3] != h_kv or h_kv == 0 or h_q % h_kv:
        raise ValueError(
            f"enable_gqa needs k and v with the same number of heads Hkv (axis -3) dividing "
            f"q's Hq, got q.shape={q.shape}, k.shape={k.shape}, v.shape={v.shape}"
        )
    return h_q // h_kv


def split_heads(x, axis, groups):
    """Split the head axis ``axis`` of an array aligned with q's leading dims into
    (Hkv, groups); a head axis of 1, or none, stays broadcastable."""
    shape = split_shape(x.shape, axis, groups)
    return x if shape == x.shape else x.reshape(shape)


def split_shape(shape, axis, groups):
    """The shape :func:`split_heads` gives an array of ``shape``."""
    if len(shape) < -axis:
        return shape
    axis = len(shape) + axis
    heads = shape[axis]
    split = (heads // groups, groups) if heads != 1 else (1, 1)
    return shape[:axis] + split + shape[axis + 1:]


def checked_window(window):
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(
            f"window must be None or a pair (left, right) of non-negative integers or None, "
            f"got {window!r}"
        )
    for side, value in zip(("left", "right"), window):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                                  or value < 0):
            raise ValueError(
                f"window's {side} must be a non-negative integer or None (unbounded), got "
                f"{value!r} in window={window!r}"
            )
    return tuple(None if value is None else int(value) for value in window)


def checked_softcap(softcap, dtype):
    if softcap is None:
        return None
    return checked_real("softcap", softcap, dtype,
                        what="a finite positive number (None turns it off)")


def broadcasts_to(shape, target):
    """Whether an array of ``shape`` broadcasts to exactly ``target`` (not to something larger)."""
    try:
        return np.broadcast_shapes(shape, target) == target
    except ValueError:
        return False


def per_head(name, x, batch, unit):
    """``x`` as an array of real numbers broadcastable to the leading (batch, head) dims."""
    x = np.asarray(x)
    if x.dtype.kind not in "fiu":
        raise TypeError(f"{name} must be an array of real numbers, got dtype {x.dtype}")
    if not broadcasts_to(x.shape, batch):
        raise ValueError(
            f"{name} of shape {x.shape} does not broadcast to the leading (batch, head) dims "
            f"{batch}: give one {unit} per head, e.g. shape (H,) or (B, H)"
        )
    return x


def checked_alibi(slopes, batch, groups, dtype, n_q, n_k):
    """The slopes, shaped (..., 1, 1), each checked by :func:`checked_real`: a bias
    ``-slope · distance`` (distance up to ``max(Nq, Nk) - 1``) must not overflow ``dtype``."""
    if slopes is None:
        return None
    slopes = per_head("alibi_slopes", slopes, batch, "slope")
    with np.errstate(over="ignore"):  # a longdouble beyond float64: refused below
        slopes = slopes.astype(np.float64)
    if not np.isfinite(slopes).all():
        raise ValueError(f"alibi_slopes must be finite, got {slopes}")
    # A slope of 0 is no bias; any other must be normal in dtype, and its largest bias finite
    # (an infinite one gives inf - inf or 0 · inf, NaN, where a distance is 0).
    limit = float(np.finfo(dtype).max) / max(1, n_q - 1, n_k - 1)
    nonzero = slopes[slopes != 0]
    extremes = (nonzero[np.abs(nonzero).argmin()], nonzero[np.abs(nonzero).argmax()])
    for slope in extremes if nonzero.size else ():  # the smallest and the largest in size
        checked_real("each of alibi_slopes", abs(float(slope)), dtype, what="finite", limit=limit,
                     limit_why=f" as slope · distance, distance up to {max(1, n_q - 1, n_k - 1)}")
    slopes = slopes[..., None, None]  # broadcasts against a tile's (rows, keys)
    return split_heads(slopes, -3, groups) if groups else slopes


def checked_sinks(sinks, batch, groups, dtype):
    """The sinks as float64, shaped (..., 1) to broadcast against a block's rows (the grouped
    query split applied as for the ALiBi slopes); each finite in the compute dtype ``dtype``."""
    if sinks is None:
        return None
    sinks = per_head("sinks", sinks, batch, "logit")
    with np.errstate(over="ignore"):  # a longdouble beyond float64, or a float64 beyond dtype
        finite = np.isfinite(sinks.astype(np.float64)) & np.isfinite(sinks.astype(dtype))
    if not finite.all():
        raise ValueError(f"sinks must be finite numbers in the compute dtype {dtype}, got {sinks}")
    sinks = sinks.astype(np.float64)[..., None]  # broadcasts against a block's rows
    return split_heads(sinks, -2, groups) if groups else sinks


def checked_dropout(p, seed, offset, n_q, n_k):
    """``dropout_p``, ``dropout_seed`` and ``dropout_offset`` checked, as Problem's fields: every
    element's position must fit its counter word (``i < 2³²``, ``j // 8 < 2³²``)."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number in [0, 1), got {p!r}")
    if not 0 <= p < 1:
        raise ValueError(f"dropout_p must be in [0, 1) (the probability of dropping), got {p!r}")
    if p > MAX_DROPOUT_P:
        t = dropout.threshold(p)
        raise ValueError(
            f"dropout_p = {p!r} is above the largest accepted, 1 - 2**-9 = {MAX_DROPOUT_P}: the "
            f"mask's 16-bit threshold round(p·2**16) = {t} keeps {1 - t / 2**16:.4g} of the "
            f"weights, not 1 - p = {1 - p:.4g}, so (P∘Z/(1 - p))·V would not average to P·V")
    if p > 0 or seed is not None:
        if (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                or not 0 <= seed < 2**64):
            raise ValueError(f"dropout_seed must be an integer in [0, 2**64) when dropout_p > 0 "
                             f"(it keys the mask), got {seed!r}")
        seed = int(seed)
    if (not isinstance(offset, (tuple, list)) or len(offset) != 2
            or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in offset)):
        raise TypeError(f"dropout_offset must be a pair (row, key) of non-negative integers, "
                        f"got {offset!r}")
    if min(offset) < 0:
        raise ValueError(f"dropout_offset must be non-negative, got {offset!r}")
    offset = (int(offset[0]), int(offset[1]))
    if offset[0] + n_q > 2**32 or offset[1] + n_k > 2**35:
        raise ValueError(f"dropout_offset {offset!r} puts a position beyond the counter's 32-bit "
                         f"words (query < 2**32, key < 2**35), for Nq = {n_q}, Nk = {n_k}")
    return dict(dropout_p=float(p), dropout_seed=seed, dropout_offset=offset)


def checked_keep_args(seed, p, shape, offset):
    """flash_lib.dropout_keep's arguments: ``(shape, offset, dropout fields)``."""
    if (not isinstance(shape, (tuple, list)) or len(shape) < 2
            or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0 for n in shape)):
        raise ValueError(f"shape must be a tuple (..., Nq, Nk) of non-negative ints, got {shape!r}")
    shape = tuple(int(n) for n in shape)
    drop = checked_dropout(p, seed, offset, shape[-2], shape[-1])
    return shape, drop["dropout_offset"], drop


def checked_mask_mod(mask_mod):
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(f"mask_mod must be a callable mask_mod(q_idx, k_idx) or None, got "
                        f"{mask_mod!r}")
    return mask_mod


def call_mask_mod(mask_mod, q_start, q_stop, k_start, k_stop):
    """``mask_mod(q_idx, k_idx)`` on one tile's global positions, checked to be boolean."""
    q_idx = np.arange(q_start, q_stop)[:, None]
    k_idx = np.arange(k_start, k_stop)[None, :]
    allowed = np.asarray(mask_mod(q_idx, k_idx))
    if allowed.dtype != np.bool_:
        raise TypeError(
            f"mask_mod must return a boolean array (True = may attend), got dtype "
            f"{allowed.dtype}"
        )
    tile = (q_stop - q_start, k_stop - k_start)
    if not broadcasts_to(allowed.shape[-2:], tile):
        raise ValueError(
            f"mask_mod returned an array of shape {allowed.shape}, which does not broadcast "
            f"to (..., tile_q, tile_k) = (..., {tile[0]}, {tile[1]})"
        )
    return allowed

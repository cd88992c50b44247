"""flash_lib's measuring instruments: the peak memory of a call, and the row-wise error metric
of the tests, chapters and benchmark. Not part of the algorithm.

Private to flash_lib: imported by ``flash_lib.py`` only, which exports
``flash_lib.measure_peak_bytes`` and ``flash_lib.rowwise_relative_error``.
"""

import tracemalloc

import numpy as np


def measure_peak_bytes(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)``; return ``(result, peak_bytes)`` allocated during the call.

    Measured from outside by ``tracemalloc``, where NumPy reports its array buffers, so it is
    evidence about the kernel rather than the kernel's word about itself. ``peak_bytes`` counts
    from the traced total at the call, so it includes the returned arrays: subtract their
    ``nbytes`` to get the scratch memory. Allocations from all threads are counted.

    If the caller is tracing already, its own peak survives the call: tracemalloc can only
    reset the peak, not set it, so a peak above what this call reached is re-created afterwards
    by one short-lived allocation (it may come out a few hundred bytes higher than it was).
    """
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    _, callers_peak = tracemalloc.get_traced_memory()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        result = fn(*args, **kwargs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        if started:
            tracemalloc.stop()
        elif callers_peak > tracemalloc.get_traced_memory()[1]:
            np.empty(callers_peak - tracemalloc.get_traced_memory()[0], np.uint8)  # freed at once
    return result, peak - base


def rowwise_relative_error(out, ref):
    """Error of each row against a reference: ``max_c |out_ic - ref_ic| / max_c |ref_ic|``.

    The metric of this project's tests, chapters and benchmark: relative to the row's own scale,
    so that a row of small outputs is held to the same standard as a row of large ones.
    Entries where ``ref`` is not finite must match exactly (the same infinity, or NaN for NaN),
    so identical inf rows have error 0; the finite entries are measured against the largest
    finite ``|ref|`` of the row. A row whose finite reference is all zeros (a fully masked
    row) has error 0 only if ``out``'s row matches exactly, else inf. A non-finite ``out`` where
    ``ref`` is finite is inf. Computed in the wider of the two dtypes (``ref`` may be
    longdouble). Returns an array of shape ``out.shape[:-1]``.
    """
    wide = np.result_type(out, ref, np.float64)
    out, ref = np.asarray(out, wide), np.asarray(ref, wide)
    if out.ndim == 0 or ref.ndim == 0:
        raise ValueError(
            f"out and ref must have at least 1 dimension (..., features), got shapes "
            f"{out.shape} and {ref.shape}"
        )
    if out.shape != ref.shape:
        raise ValueError(f"out and ref must have the same shape, got {out.shape} and {ref.shape}")
    if out.shape[-1] == 0:
        return np.zeros(out.shape[:-1])
    finite = np.isfinite(ref)
    same = (out == ref) | (np.isnan(out) & np.isnan(ref))
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(same, 0, np.where(finite & np.isfinite(out), np.abs(out - ref), np.inf))
    size = np.where(finite, np.abs(ref), 0).max(axis=-1)
    worst = diff.max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        err = np.where(size == 0, np.where(worst == 0, 0, np.inf), worst / np.where(size == 0, 1, size))
    return err

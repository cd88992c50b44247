"""flash_check.exercises: every solution passes, every stub is "not implemented yet", every planted
mistake fails with its own hint, and correct answers written independently of the solutions pass.

A planted mistake is the solution's source with one line broken (``MISTAKES``: the exercise, the
text replaced, its replacement and a phrase its hint must contain), as a learner would break it;
the grader never sees the solutions' code, only what the broken function returns.
"""

import importlib
import inspect
import math
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import flash_lib
from flash_check import _solutions, exercises
from flash_check.exercises import EXERCISES, NOT_IMPLEMENTED, grade, stub

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed here")
NUMPY_EXERCISES = [name for name in EXERCISES if name != "attend_tile"]


def _params(names):
    return [pytest.param(n, marks=needs_triton) if n == "attend_tile" else n for n in names]


@pytest.mark.parametrize("name", _params(EXERCISES))
def test_every_solution_passes(name):
    result = grade(name, exercises.solution(name))
    assert result.passed, result.hint
    assert result.hint == "" and all(case.ok for case in result.cases) and len(result.cases) >= 3
    assert str(result).startswith(f"{name}: passed")


@pytest.mark.parametrize("name", EXERCISES)
def test_every_stub_is_not_implemented_yet(name):
    result = grade(name, stub(name))
    assert not result.passed and result.hint == NOT_IMPLEMENTED
    assert "not implemented yet" in str(result) and "Traceback" not in str(result)
    with pytest.raises(NotImplementedError, match="not implemented yet"):
        stub(name)()


def test_a_learners_own_stub_is_not_implemented_yet_too():
    def merge(out_a, lse_a, out_b, lse_b):
        raise NotImplementedError
    assert grade("merge", merge).hint == NOT_IMPLEMENTED


def test_the_exercises_cover_eight_steps_in_six_chapters_or_more():
    assert len(EXERCISES) >= 8 and len({e.chapter for e in EXERCISES.values()}) >= 6
    fixed = {"online_update": "online_update(m, l, acc, s, v) -> (m, l, acc)",
             "merge": "merge(out_a, lse_a, out_b, lse_b) -> (out, lse)",
             "forward": "forward(q, k, v, *, causal=False, block_q=64, block_k=64) -> (out, lse)",
             "paged_decode": "paged_decode(q, k_cache, v_cache, block_table, cache_seqlens) -> "
                             "out"}
    for name, signature in fixed.items():
        assert EXERCISES[name].signature == signature


# --- the planted mistakes: exercise, label, old text, new text, a phrase of its hint ----------

MISTAKES = [
    ("merge", "plain_average", "out = (part_a + part_b) / np.where(empty, 1.0, total)[:, None]",
     "out = (out_a + out_b) / 2", "plain average"),
    ("merge", "not_normalised", "out = (part_a + part_b) / np.where(empty, 1.0, total)[:, None]",
     "out = part_a + part_b", "without dividing by w_a + w_b"),
    ("merge", "lse_is_the_max", "lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1.0, "
     "total)))", "lse = np.maximum(lse_a, lse_b)", "lse is max(lse_a, lse_b)"),
    ("merge", "no_max_subtracted", "w_a, w_b = np.exp(lse_a - m), np.exp(lse_b - m)",
     "w_a, w_b = np.exp(lse_a), np.exp(lse_b); m = 0 * m", "exp(lse) overflowed"),
    ("merge", "both_empty_nan", "m = np.where(m == -np.inf, 0.0, m)", "pass",
     "both parts are empty"),
    ("merge", "empty_part_multiplied",
     "part_b = w_b[:, None] * np.where(lse_b[:, None] > -np.inf, out_b, 0.0)",
     "part_b = w_b[:, None] * out_b", "0 · NaN = NaN"),

    ("online_update", "acc_not_rescaled", "acc * alpha[:, None] + p @ v", "acc + p @ v",
     "acc is not rescaled"),
    ("online_update", "l_not_rescaled", "l * alpha + p.sum(axis=1)", "l + p.sum(axis=1)",
     "l is not rescaled"),
    ("online_update", "nothing_rescaled", "return m_new, l * alpha + p.sum(axis=1), acc * "
     "alpha[:, None] + p @ v", "return m_new, l + p.sum(axis=1), acc + p @ v",
     "neither l nor acc"),
    ("online_update", "no_empty_row_guard",
     "ref = np.where(m_new == -np.inf, 0.0, m_new)", "ref = m_new", "all -inf"),
    ("online_update", "p_against_old_max",
     "p = np.exp(s - ref[:, None])", "p = np.exp(s - np.where(m == -np.inf, ref, m)[:, None])",
     "against the old max"),
    ("online_update", "m_not_updated", "return m_new,", "return m,", "m is returned unchanged"),

    ("forward", "missing_1_over_l", "out[rows] = acc / np.where(empty, 1.0, l)[:, None]",
     "out[rows] = acc", "not acc / l"),
    ("forward", "top_left_causal", "keys[None, :] <= rows[:, None] + (n_k - n_q)",
     "keys[None, :] <= rows[:, None]", "top-left"),
    ("forward", "no_scale", "s = scale * (q[rows] @ k[keys].T)", "s = q[rows] @ k[keys].T",
     "not scaled"),
    ("forward", "lse_without_log_l", "m + np.log(np.where(empty, 1.0, l))", "m",
     "running max m alone"),
    ("forward", "last_key_block_dropped", "for j0 in range(0, n_k, block_k):",
     "for j0 in range(0, n_k - n_k % block_k if n_k > block_k else n_k, block_k):",
     "last, partial key block is dropped"),
    ("forward", "empty_rows_nan", "out[rows] = acc / np.where(empty, 1.0, l)[:, None]",
     "out[rows] = acc / l[:, None]", "no allowed key"),
    ("forward", "full_n2_scores", "    for i0 in range(0, n_q, block_q):",
     "    block_q, block_k = n_q, n_k  # one tile: the whole score matrix\n"
     "    for i0 in range(0, n_q, block_q):", "materialises the Nq x Nk scores"),

    ("forward", "last_query_block_dropped", "for i0 in range(0, n_q, block_q):",
     "for i0 in range(0, n_q - n_q % block_q if n_q > block_q else n_q, block_q):",
     "last, partial query block"),

    ("backward", "D_forgotten", "ds = p * (dp - D[rows, None])", "ds = p * dp", "without D"),
    ("backward", "dq_without_scale", "dq[rows] += scale * (ds @ k[keys])",
     "dq[rows] += ds @ k[keys]", "dq lacks the softmax scale"),
    ("backward", "dk_without_scale", "dk[keys] += scale * (ds.T @ q[rows])",
     "dk[keys] += ds.T @ q[rows]", "dk lacks the softmax scale"),
    ("backward", "top_left_causal", "keys[None, :] <= rows[:, None] + (n_k - n_q)",
     "keys[None, :] <= rows[:, None]", "top-left"),
    ("backward", "empty_rows_nan",
     "p = np.where(allowed, np.exp(np.where(allowed, s, 0.0) - lse_safe[rows, None]), 0.0)",
     "p = np.exp(np.where(allowed, s, -np.inf) - lse[rows, None])", "no allowed key"),

    ("backward", "D_without_out", "D = (dout * out).sum(axis=1)", "D = dout.sum(axis=1)",
     "dv is right, dq and dk are not"),
    ("backward", "dv_scaled", "dv[keys] += p.T @ dout[rows]", "dv[keys] += scale * (p.T @ "
     "dout[rows])", "dv is not"),

    ("keep_mask", "keeps_with_p", "return number >= round(p * 2**16)",
     "return number < round(p * 2**16)", "probability p, not 1 - p"),
    ("keep_mask", "halves_swapped", "np.where(j % 2 == 0,", "np.where(j % 2 == 1,",
     "halves of each word are swapped"),
    ("keep_mask", "counter_swapped", "words = philox4x32(j // 8, i,",
     "words = philox4x32(i, j // 8,",
     "first two words are swapped"),
    ("keep_mask", "offset_ignored", "i = np.arange(offset[0], offset[0] + rows",
     "i = np.arange(0, rows", "offset is ignored"),
    ("keep_mask", "same_mask_every_head", "b = np.arange(math.prod(batch), dtype=np.uint64)",
     "b = 0 * np.arange(math.prod(batch), dtype=np.uint64)", "same mask"),

    ("attention_with_sinks", "sink_scaled", "sink = np.asarray(sinks, np.float64)[:, None]",
     "sink = np.asarray(sinks, np.float64)[:, None] / math.sqrt(q.shape[-1])", "unscaled"),
    ("attention_with_sinks", "sink_sign", "sink = np.asarray(sinks, np.float64)[:, None]",
     "sink = -np.asarray(sinks, np.float64)[:, None]", "sign is flipped"),
    ("attention_with_sinks", "lse_without_sink", "return (p @ v) / l[..., None], m + np.log(l)",
     "return (p @ v) / l[..., None], m + np.log(p.sum(axis=-1))", "lse leaves the sink out"),
    ("attention_with_sinks", "empty_row_guard_overrides_sink",
     "return (p @ v) / l[..., None], m + np.log(l)",
     "return (p @ v) / l[..., None], np.where(np.isfinite(s).any(axis=-1), m + np.log(l), "
     "-np.inf)", "no row is empty"),
    ("attention_with_sinks", "one_sink_for_all_heads",
     "sink = np.asarray(sinks, np.float64)[:, None]",
     "sink = np.full((q.shape[0], 1), float(np.asarray(sinks)[0]))", "sinks[0]"),

    ("attention_with_sinks", "top_left_causal",
     "np.arange(n_k) <= np.arange(n_q)[:, None] + (n_k - n_q)",
     "np.arange(n_k) <= np.arange(n_q)[:, None]", "top-left"),

    ("paged_decode", "one_key_too_many", "n = int(cache_seqlens[b])",
     "n = int(cache_seqlens[b]) + (cache_seqlens[b] > 0)", "one key too many"),
    ("paged_decode", "page_index_off_by_one", "pages = block_table[b, : -(-n // page_size)]",
     "pages = block_table[b, 1 : 1 - (-n // page_size)]", "off by one"),
    ("paged_decode", "garbage_slots_read", "[:, :n]", "", "past cache_seqlens"),
    ("paged_decode", "empty_sequence_nan", "continue  # no key: the empty sum, 0",
     "out[b] = np.nan; continue", "length 0"),
    ("paged_decode", "pages_assumed_contiguous", "pages = block_table[b, : -(-n // page_size)]",
     "pages = b * block_table.shape[1] + np.arange(-(-n // page_size))", "as if contiguous"),
    ("paged_decode", "no_scale", "/ math.sqrt(d)", "", "not scaled"),
]


def _broken(name, old, new):
    """The solution of ``name`` with ``old`` replaced by ``new`` (which must be there)."""
    source = textwrap.dedent(inspect.getsource(getattr(_solutions, name)))
    assert old in source, f"{name}'s solution no longer contains {old!r}"
    namespace = {"np": np, "math": math, "online_update": _solutions.online_update,
                 "philox4x32": _solutions.philox4x32}
    exec(compile(source.replace(old, new), f"<{name}, broken>", "exec"), namespace)
    return namespace[name]


@pytest.mark.parametrize("name, label, old, new, phrase", MISTAKES,
                         ids=[f"{m[0]}-{m[1]}" for m in MISTAKES])
def test_a_planted_mistake_fails_with_its_hint(name, label, old, new, phrase):
    result = grade(name, _broken(name, old, new))
    assert not result.passed
    assert phrase in result.hint, result.hint
    assert result.hint.startswith(f"case {result.cases[-1].name!r}")


def test_each_exercise_has_three_planted_mistakes_or_more_with_distinct_hints():
    for name in EXERCISES:
        phrases = [m[4] for m in MISTAKES + TRITON_MISTAKES if m[0] == name]
        assert len(phrases) >= 3 and len(set(phrases)) == len(phrases), name


# --- the Triton exercise's mistakes: the solution's source, broken, in a module of its own ---

TRITON_MISTAKES = [
    ("attend_tile", "acc_not_rescaled", "acc = acc * alpha[:, None] + tl.dot",
     "acc = acc + tl.dot", "acc is not rescaled"),
    ("attend_tile", "l_not_rescaled", "l = l * alpha + tl.sum(p, 1)", "l = l + tl.sum(p, 1)",
     "l is not rescaled"),
    ("attend_tile", "exp_not_exp2", "p = tl.math.exp2(s - m_use[:, None])\n    alpha = "
     "tl.math.exp2(m - m_use)", "p = tl.exp(s - m_use[:, None])\n    alpha = tl.exp(m - m_use)",
     "exp2"),
    ("attend_tile", "no_empty_row_guard",
     'm_use = tl.where(m_new == float("-inf"), 0.0, m_new)', "m_use = m_new", "all -inf"),
]


@needs_triton
@pytest.mark.parametrize("name, label, old, new, phrase", TRITON_MISTAKES,
                         ids=[m[1] for m in TRITON_MISTAKES])
def test_a_planted_triton_mistake_fails_with_its_hint(name, label, old, new, phrase, tmp_path,
                                                       monkeypatch):
    solutions = importlib.import_module("flash_check._solutions_triton")
    source = inspect.getsource(solutions.attend_tile.fn)  # with its @triton.jit
    assert old in source and source.startswith("@triton.jit")
    (tmp_path / f"broken_{label}.py").write_text(
        "import triton\nimport triton.language as tl\n\n\n" + source.replace(old, new, 1))
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = importlib.import_module(f"broken_{label}").attend_tile
    result = grade(name, broken)
    assert not result.passed and phrase in result.hint, result.hint


@needs_triton
def test_attend_tile_must_be_a_triton_function():
    result = grade("attend_tile", _solutions.online_update)
    assert not result.passed and "@triton.jit" in result.hint


# --- exceptions in the learner's code ----------------------------------------------------------


def test_an_exception_is_shown_in_one_line_with_the_case_that_raised_it():
    def merge(out_a, lse_a, out_b, lse_b):
        halves = out_a.reshape(2, -1)  # one row of one value cannot be split in two
        return halves, lse_a
    result = grade("merge", merge)
    assert not result.passed and result.cases[-1].name == "one_row"
    assert result.hint.startswith("case 'one_row'")
    assert "your code raised ValueError" in result.hint and "\n" not in result.hint
    assert "in merge, line" in result.hint and "out_a.reshape(2, -1)" in result.hint
    assert "Traceback" not in result.hint


def test_a_wrong_return_type_or_shape_is_named():
    assert "expected a tuple (out, lse)" in grade("merge", lambda a, la, b, lb: a).hint
    wrong_shape = grade("merge", lambda a, la, b, lb: (a[None], la))
    assert "out has shape" in wrong_shape.hint
    assert "bool" in grade("keep_mask", lambda seed, p, shape, offset=(0, 0):
                           np.zeros(shape)).hint


def test_grade_refuses_an_unknown_exercise_or_a_non_function():
    with pytest.raises(ValueError, match="name must be one of"):
        grade("softmax", print)
    with pytest.raises(TypeError, match="fn must be a function"):
        grade("merge", 3)


# --- correct answers written independently of the solutions ------------------------------------


def merge_by_logaddexp(out_a, lse_a, out_b, lse_b):
    lse = np.logaddexp(lse_a, lse_b)  # -inf where both are -inf, no warning
    out = np.zeros(np.broadcast_shapes(out_a.shape, out_b.shape))
    for w_lse, part in ((lse_a, out_a), (lse_b, out_b)):
        live = w_lse > -np.inf
        out[live] += np.exp(w_lse[live] - lse[live])[:, None] * part[live]
    return out, lse


def update_in_float32(m, l, acc, s, v):
    """Computes in float32, by rows, with 2**x (ln 2 folded in)."""
    m32, l32, acc32 = (x.astype(np.float32) for x in (m, l, acc))
    out_m, out_l, out_acc = m32.copy(), l32.copy(), acc32.copy()
    for i in range(s.shape[0]):
        row = s[i].astype(np.float32)
        new = max(m32[i], row.max())
        if new == -np.inf:
            continue
        a = np.exp2((m32[i] - new) / np.float32(math.log(2)))
        p = np.exp2((row - new) / np.float32(math.log(2)))
        out_m[i], out_l[i] = new, l32[i] * a + p.sum()
        out_acc[i] = acc32[i] * a + p @ v.astype(np.float32)
    return out_m, out_l, out_acc


def forward_two_pass(q, k, v, *, causal=False, block_q=64, block_k=64, dtype=np.float64):
    """Another tiling: each query block's row max first (pass 1), then sums against it (pass 2);
    key blocks of block_k // 2 + 3, in ``dtype``."""
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    n_q, n_k = len(q), len(k)
    step = block_k // 2 + 3
    out, lse = np.zeros((n_q, v.shape[1]), dtype), np.full(n_q, -np.inf, dtype)
    for i0 in range(0, n_q, block_q):
        i = np.arange(i0, min(n_q, i0 + block_q))[:, None]
        blocks = []
        for j0 in range(0, n_k, step):
            j = np.arange(j0, min(n_k, j0 + step))[None, :]
            ok = (j <= i + n_k - n_q) if causal else np.ones((len(i), j.shape[1]), bool)
            blocks.append((j[0], ok))
        m = np.full(len(i), -np.inf, dtype)
        for j, ok in blocks:
            s = q[i[:, 0]] @ k[j].T / dtype(math.sqrt(q.shape[1]))
            m = np.maximum(m, np.where(ok, s, -np.inf).max(axis=1))
        live = m > -np.inf
        l, acc = np.zeros(len(i), dtype), np.zeros((len(i), v.shape[1]), dtype)
        for j, ok in blocks:
            s = q[i[:, 0]] @ k[j].T / dtype(math.sqrt(q.shape[1]))
            ref = np.where(live, m, 0)[:, None]
            p = np.where(ok & live[:, None], np.exp(np.where(ok, s, 0) - ref), 0)
            l += p.sum(axis=1)
            acc += p @ v[j]
        out[i[:, 0]] = np.where(live[:, None], acc / np.where(live, l, 1)[:, None], 0)
        lse[i[:, 0]] = np.where(live, m + np.log(np.where(live, l, 1)), -np.inf)
    return out, lse


def backward_query_blocks_outside(q, k, v, out, lse, dout, *, causal=False, block_q=64,
                                  block_k=64, dtype=np.float64):
    """Query blocks of 24 outside, all keys at once inside; D from dP: rowsum(P ∘ dP) equals
    rowsum(dO ∘ O)."""
    q, k, v, dout = (x.astype(dtype) for x in (q, k, v, dout))
    n_q, n_k, c = len(q), len(k), 1 / math.sqrt(q.shape[1])
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for i0 in range(0, n_q, 24):
        i = np.arange(i0, min(n_q, i0 + 24))
        live = lse[i] > -np.inf
        allowed = np.ones((len(i), n_k), bool) & live[:, None]
        if causal:
            allowed &= np.arange(n_k)[None, :] <= i[:, None] + n_k - n_q
        s = c * q[i] @ k.T
        p = np.zeros_like(s)
        p[allowed] = np.exp(s[allowed] - np.broadcast_to(lse[i, None], s.shape)[allowed])
        dp = dout[i] @ v.T
        D = (p * dp).sum(axis=1, keepdims=True)
        ds = p * (dp - D)
        dq[i] = c * ds @ k
        dk += c * ds.T @ q[i]
        dv += p.T @ dout[i]
    return dq, dk, dv


def keep_mask_by_element(seed, p, shape, offset=(0, 0)):
    """Element by element, with Python ints: Philox from chapter 17's formula, written anew."""
    *batch, rows, keys = shape
    flat = np.zeros((math.prod(batch), rows, keys), bool)
    mask32, t = 0xFFFFFFFF, round(p * 65536)
    for b in range(flat.shape[0]):
        for i in range(rows):
            for jj in range(0, keys):
                j = offset[1] + jj
                c = [j // 8, offset[0] + i, b & mask32, b >> 32]
                k0, k1 = seed & mask32, seed >> 32
                for _ in range(7):
                    hi0, lo0 = divmod(0xD2511F53 * c[0], 1 << 32)
                    hi1, lo1 = divmod(0xCD9E8D57 * c[2], 1 << 32)
                    c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
                    k0, k1 = (k0 + 0x9E3779B9) & mask32, (k1 + 0xBB67AE85) & mask32
                word = c[(j % 8) // 2]
                flat[b, i, jj] = ((word >> 16) if j % 2 else (word & 0xFFFF)) >= t
    return flat.reshape(shape)


def sinks_as_an_extra_key(q, k, v, sinks, *, causal=False):
    """The sink as one more key, at column 0, whose value is 0, through flash_lib's forward with
    a mask, at another scale folded into q."""
    heads, n_q, d = q.shape
    n_k = k.shape[1]
    c = 1 / math.sqrt(d)
    k1 = np.concatenate([np.zeros((heads, 1, d)), k], axis=1)
    q1 = np.concatenate([q, np.ones((heads, n_q, 1))], axis=2)
    k1 = np.concatenate([k1, np.zeros((heads, n_k + 1, 1))], axis=2)
    k1[:, 0, -1] = np.asarray(sinks) / c  # q1 · k1[0] · c = sink
    v1 = np.concatenate([np.zeros((heads, 1, v.shape[2])), v], axis=1)
    allowed = np.ones((n_q, n_k + 1), bool)
    if causal:
        allowed[:, 1:] = flash_lib.causal_mask(n_q, n_k)
    return flash_lib.flash_attention(q1, k1, v1, mask=allowed, scale=c, return_lse=True,
                                     block_q=7, block_k=5)


def paged_decode_by_gathering_positions(q, k_cache, v_cache, block_table, cache_seqlens):
    page_size = k_cache.shape[2]
    out = np.zeros(q.shape[:2] + (v_cache.shape[-1],), np.float32)
    for b, n in enumerate(cache_seqlens):
        t = np.arange(n)
        keys = k_cache[block_table[b, t // page_size], :, t % page_size]  # (n, H, d)
        values = v_cache[block_table[b, t // page_size], :, t % page_size]
        for h in range(q.shape[1]):
            if n:
                out[b, h] = flash_lib.naive_attention(q[b, h][None].astype(np.float32),
                                                      keys[:, h].astype(np.float32),
                                                      values[:, h].astype(np.float32))[0]
    return out


INDEPENDENT = {
    "merge": [merge_by_logaddexp],
    "online_update": [update_in_float32],
    "forward": [forward_two_pass,
                lambda q, k, v, **kw: forward_two_pass(q, k, v, dtype=np.float32, **kw)],
    "backward": [backward_query_blocks_outside,
                 lambda *a, **kw: backward_query_blocks_outside(*a, dtype=np.float32, **kw)],
    "keep_mask": [keep_mask_by_element],
    "attention_with_sinks": [sinks_as_an_extra_key],
    "paged_decode": [paged_decode_by_gathering_positions],
}


@pytest.mark.parametrize("name, index", [(n, i) for n, fns in INDEPENDENT.items()
                                         for i in range(len(fns))])
def test_an_independently_written_answer_passes(name, index):
    result = grade(name, INDEPENDENT[name][index])
    assert result.passed, result.hint


def test_flash_lib_itself_passes_the_forward_at_other_block_sizes():
    def forward(q, k, v, *, causal=False, block_q=64, block_k=64):
        return flash_lib.flash_attention(q, k, v, causal=causal, block_q=block_q + 5,
                                         block_k=max(1, block_k // 3), return_lse=True)
    assert grade("forward", forward).passed


# --- the command line and the solutions' display ----------------------------------------------


def test_show_solution_prints_the_source(capsys):
    exercises.show_solution("merge")
    assert capsys.readouterr().out.startswith("def merge(out_a, lse_a, out_b, lse_b):")


def test_the_command_line_grades_the_learners_module(tmp_path):
    (tmp_path / "my_solutions.py").write_text(
        "from flash_check._solutions import merge\n"
        "def online_update(m, l, acc, s, v):\n    return m, l, acc\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout's flash_check, the cwd's module
    run = subprocess.run([sys.executable, "-m", "flash_check.exercises"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    lines = run.stdout.splitlines()
    assert run.returncode == 1, run.stderr
    assert any(line.split()[2:] == ["merge", "passed"] for line in lines), run.stdout
    assert any("online_update" in line and "not yet" in line for line in lines), run.stdout
    assert any("paged_decode" in line and "not implemented yet" in line for line in lines)
    assert lines[-1] == f"1 of {len(EXERCISES)} exercises passed"

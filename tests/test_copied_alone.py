"""flash_lib copied into a project without ml_dtypes: every dtype it accepts computes exactly as
with ml_dtypes, and bfloat16 is refused with an error naming ml_dtypes.

Each test runs flash_lib in a fresh interpreter where ``import ml_dtypes`` fails
(``sys.modules["ml_dtypes"] = None``), and compares with this process, where ml_dtypes is there.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np

import flash_lib

# The same calls in both processes: forward, lse, backward, references, merge; each dtype alone
# and mixed (float32 with float64 promotes to float64, float16 with float32 to float32).
CALLS = """
import numpy as np
import flash_lib

def calls():
    rng = np.random.default_rng(0)
    results = {}
    for dtypes in (("float64",) * 3, ("float32",) * 3, ("float16",) * 3,
                   ("float32", "float64", "float64"), ("float16", "float32", "float16")):
        q, k, v = (rng.standard_normal((2, n, 8)).astype(t) for n, t in zip((33, 40, 40), dtypes))
        mask = rng.random((33, 40)) < 0.8
        key = "-".join(dtypes)
        out, lse = flash_lib.flash_attention(q, k, v, mask=mask, causal=True, block_q=8,
                                             block_k=16, return_lse=True, softcap=5.0)
        results[key + ":out"], results[key + ":lse"] = out, lse
        results[key + ":naive"] = flash_lib.naive_attention(q, k, v, mask=mask, causal=True)
        dout = rng.standard_normal(out.shape).astype(out.dtype)
        grads = flash_lib.flash_attention_backward(q, k, v, out, lse, dout, mask=mask,
                                                   causal=True, block_q=8, block_k=16,
                                                   softcap=5.0)
        for name, g in zip(("dq", "dk", "dv"), grads):
            results[key + ":" + name] = g
        merged = flash_lib.merge_attention(out, lse, out[..., ::-1, :], lse[..., ::-1])
        results[key + ":merged"], results[key + ":merged_lse"] = merged
    return results
"""

BLOCKED = "import sys\nsys.modules['ml_dtypes'] = None  # import ml_dtypes now raises ImportError\n"


def run(script, tmp_path):
    """Run ``script`` in a fresh interpreter that imports this flash_lib, and return the run."""
    env = dict(os.environ)
    here = str(pathlib.Path(flash_lib.__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)


def test_without_ml_dtypes_every_other_dtype_computes_bit_for_bit_as_with_it(tmp_path):
    """float64 stays float64 (it used to run in float32: NumPy compares a dtype with None as
    with float64), float32 and float16 and their mixtures are unchanged, bit for bit."""
    script = BLOCKED + CALLS + (
        "assert 'ml_dtypes' not in sys.modules or sys.modules['ml_dtypes'] is None\n"
        "np.savez('results.npz', **calls())\n"
    )
    done = run(script, tmp_path)
    assert done.returncode == 0, done.stderr
    namespace = {}
    exec(CALLS, namespace)
    expected = namespace["calls"]()
    with np.load(tmp_path / "results.npz") as alone:
        assert sorted(alone.files) == sorted(expected)
        for name, want in expected.items():
            got = alone[name]
            assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
            np.testing.assert_array_equal(got, want, err_msg=name, strict=True)


def test_without_ml_dtypes_bfloat16_is_refused_naming_ml_dtypes(tmp_path):
    """A bfloat16 array that flash_lib cannot use (its ml_dtypes import failed) is refused with a
    TypeError that says what to install, by every kernel, rather than computed some other way."""
    script = (
        "import sys\nimport numpy as np\nimport ml_dtypes\n"
        "x = np.ones((4, 8), ml_dtypes.bfloat16)\n"
        "sys.modules['ml_dtypes'] = None\n"
        "import flash_lib\n"
        "for kernel in (flash_lib.flash_attention, flash_lib.naive_attention):\n"
        "    try:\n"
        "        kernel(x, x, x)\n"
        "    except TypeError as e:\n"
        "        print('TypeError:', e)\n"
        "    else:\n"
        "        print('accepted')\n"
    )
    done = run(script, tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("TypeError:") for line in lines), lines
    assert all("ml_dtypes" in line for line in lines), lines

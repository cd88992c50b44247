"""flash_dask.dask_attention: exact on a cluster of processes; its graph, a lost worker, memory.

The tests that take the ``client`` fixture run on one ``distributed.LocalCluster`` of 2 worker
processes with one thread each, on 127.0.0.1 with no dashboard, started once for this module
and closed after its last test; a few graph-only tests use Dask's in-process schedulers. The
reference is ``flash_lib.flash_attention`` on the same inputs in this process.
"""

import collections
import contextlib
import logging
import os
import time

import dask
import dask.array as da
import ml_dtypes
import numpy as np
import pytest
from distributed import Client, LocalCluster
from hypothesis import given, settings
from hypothesis import strategies as st

import flash_dask
import flash_lib
from flash_lib import causal_mask

TIMEOUT = 60  # seconds: any wait on the cluster that takes longer is a failure, not a hang
# Set in each worker before it starts. Dask's default MALLOC_TRIM_THRESHOLD_=65536 is dropped:
# setting it turns off glibc's adaptive mmap threshold (mallopt(3)), so every large NumPy
# temporary is mapped afresh; flash_attention ran about 30% slower with it here.
# And Dask's housekeeping slowed (flash_dask.QUIET_CLUSTER), as the benchmark runs it.
WORKER_ENVIRONMENT = {"distributed.nanny.pre-spawn-environ.FLASH_LIB_THREADS": "1",
                     "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
                     **flash_dask.QUIET_CLUSTER}


@contextlib.contextmanager
def _cluster():
    """A LocalCluster of 2 worker processes × 1 thread and a client of it (see ``client``)."""
    saved = dict(os.environ)
    with dask.config.set(WORKER_ENVIRONMENT):
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                               host="127.0.0.1", dashboard_address=None,
                               # no dashboard; the scheduler's small HTTP server (health,
                               # metrics) on a free port, not a fixed 8787 another run may hold
                               scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
                               silence_logs=logging.ERROR)
    _restore(saved)
    client = Client(cluster, set_as_default=False)
    try:
        client.wait_for_workers(2, timeout=TIMEOUT)
        yield client
    finally:
        client.close()
        cluster.close()
        _restore(saved)


@pytest.fixture(scope="module")
def client():
    """2 worker processes × 1 thread, each running flash_lib on one thread (one core each).

    Started once and closed when this module's tests are done, not at the end of the session:
    the scheduler and the nannies run on a thread of *this* process, and even idle they
    allocate (heartbeats), which tracemalloc counts in tests/test_memory.py's measurements (15
    runs out of 15 of its scratch comparison failed with an idle cluster beside it, 0 without).

    FLASH_LIB_THREADS is set before the workers are spawned (Dask's pre-spawn environment);
    Dask also sets it, with OMP_NUM_THREADS and friends, in *this* process's environment,
    which notebooks started later by the same pytest run would inherit: the ``_environ``
    fixture below puts this process's environment back after every test.
    """
    with _cluster() as client:
        yield client


@pytest.fixture
def own_client():
    """A cluster of its own for a test that kills a worker: no later test depends on the nanny
    bringing the victim back (under load, CI once saw a restarted worker's nanny close instead)."""
    with _cluster() as client:
        yield client


@pytest.fixture(autouse=True)
def _environ():
    saved = dict(os.environ)
    yield
    _restore(saved)


def _restore(saved):
    for name in set(os.environ) - set(saved):
        del os.environ[name]
    os.environ.update(saved)


def _inputs(rng, batch_q, batch_k, batch_v, n_q, n_k, d, dv, dtype=np.float64):
    q = rng.standard_normal(batch_q + (n_q, d)).astype(dtype)
    k = rng.standard_normal(batch_k + (n_k, d)).astype(dtype)
    v = rng.standard_normal(batch_v + (n_k, dv)).astype(dtype)
    return q, k, v


def _chunked(x, seq_chunks):
    return da.from_array(x, chunks=tuple((s,) for s in x.shape[:-2]) + (seq_chunks, x.shape[-1]))


def _assert_equals_flash(out, lse, ref_out, ref_lse, tol=1e-12):
    """out: rowwise relative error <= tol; lse: to tol relative to 1 + |lse|; empty rows exact."""
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == ref_lse.dtype
    empty = ref_lse == -np.inf
    np.testing.assert_array_equal(lse == -np.inf, empty, err_msg="rows with no key differ")
    assert np.all(out[empty] == 0)
    err = flash_lib.rowwise_relative_error(out, ref_out).max(initial=0.0)
    assert err <= tol, f"out: rowwise relative error {err:.3g} > {tol:g}"
    ok = ~empty
    lse_err = (np.abs(lse[ok].astype(np.float64) - ref_lse[ok])
               / (1 + np.abs(ref_lse[ok].astype(np.float64)))).max(initial=0.0)
    assert lse_err <= tol, f"lse: relative error {lse_err:.3g} > {tol:g}"


def _pair_keys(graph_keys):
    return [key for key in graph_keys
            if isinstance(key, tuple) and str(key[0]).startswith("flash-attention-pair-")]


def _expected_pairs(n_q, n_k, q_chunks, k_chunks, allowed):
    """Brute force: the (query shard, key shard) pairs whose block of ``allowed`` has a True."""
    qs, ks = np.cumsum((0,) + q_chunks), np.cumsum((0,) + k_chunks)
    return {(i, j) for i in range(len(q_chunks)) for j in range(len(k_chunks))
            if allowed[qs[i]:qs[i + 1], ks[j]:ks[j + 1]].any()}


# --------------------------------------------------------------------------------------------
# Exactness on the cluster
# --------------------------------------------------------------------------------------------

rng = np.random.default_rng(11)
_random_mask = rng.random((130, 170)) < 0.2
_random_mask[:7] = False  # rows with no allowed key
_random_mask[40:80, 60:110] = False  # a whole shard pair forbidden (shards of 40 and 50 below)

CASES = {
    # name: (batch q, k, v, Nq, Nk, d, dv, q chunks, k chunks, keyword arguments)
    "full": ((), (), (), 300, 300, 16, 16, 64, 100, {}),
    "causal, Nq = Nk, uneven shards": ((), (), (), 300, 300, 16, 16, (50, 120, 130),
                                       (30, 170, 100), {"causal": True}),
    "causal, Nq < Nk, uneven shards": ((), (), (), 150, 400, 16, 8, (50, 30, 70),
                                       (100, 57, 143, 100), {"causal": True}),
    "causal, Nq > Nk: top rows see no key": ((), (), (), 400, 150, 16, 8, (100, 57, 143, 100),
                                             (50, 30, 70), {"causal": True}),
    "masked, NumPy mask": ((), (), (), 130, 170, 8, 8, 40, 50, {"mask": _random_mask}),
    "masked and causal, Dask mask": ((), (), (), 130, 170, 8, 8, 40, 50,
                                     {"mask": da.from_array(_random_mask, chunks=(40, 50)),
                                      "causal": True}),
    "mask broadcast over queries": ((), (), (), 130, 170, 8, 8, 40, 50,
                                    {"mask": _random_mask[0:1] | _random_mask[60:61]}),
    "one decoding query over 10 key shards": ((), (), (), 1, 1000, 32, 32, 1, 100,
                                              {"causal": True}),
    "broadcast batch dims, dv != d, scale": ((2, 3), (2, 1), (1, 3), 120, 90, 16, 24, 50, 40,
                                             {"causal": True, "scale": 0.3}),
    "batched mask over broadcast heads": ((2, 1), (2, 1), (2, 1), 64, 96, 8, 8, 32, 32,
                                          {"mask": rng.random((2, 3, 64, 96)) < 0.5}),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_equals_flash_attention_on_the_cluster(client, case):
    bq, bk, bv, n_q, n_k, d, dv, q_chunks, k_chunks, kwargs = CASES[case]
    q, k, v = _inputs(np.random.default_rng(len(case)), bq, bk, bv, n_q, n_k, d, dv)
    out, lse = flash_dask.dask_attention(_chunked(q, q_chunks), _chunked(k, k_chunks),
                                         _chunked(v, k_chunks), return_lse=True, **kwargs)
    assert isinstance(out, da.Array) and isinstance(lse, da.Array)  # lazy
    assert out.chunks[-2] == _chunked(q, q_chunks).chunks[-2]
    got_out, got_lse = client.compute([out, lse], sync=True)
    np_kwargs = {name: (np.asarray(x) if isinstance(x, da.Array) else x)
                 for name, x in kwargs.items()}
    _assert_equals_flash(got_out, got_lse,
                         *flash_lib.flash_attention(q, k, v, return_lse=True, **np_kwargs))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16],
                         ids=["float32", "float16", "bfloat16"])
def test_low_precision_dtypes(client, dtype):
    """Like flash_attention, 16-bit inputs are computed in float32 and rounded once, at the end.

    So the two outputs are the same float32 numbers (to ~1e-7) rounded to the 16-bit dtype:
    equal but where a value lies next to a rounding boundary, and there one rounding apart.
    Partials rounded to 16 bits before merging differed in 44% of the elements, by up to 100s
    of ulps (the small ones).
    """
    q, k, v = _inputs(np.random.default_rng(3), (), (), (), 200, 300, 16, 16, dtype)
    out, lse = flash_dask.dask_attention(_chunked(q, 64), _chunked(k, 70), _chunked(v, 70),
                                         causal=True, return_lse=True)
    got_out, got_lse = client.compute([out, lse], sync=True)
    ref_out, ref_lse = flash_lib.flash_attention(q, k, v, causal=True, return_lse=True)
    assert got_out.dtype == dtype and got_lse.dtype == ref_lse.dtype == np.float32
    got, ref = got_out.astype(np.float64), ref_out.astype(np.float64)
    if dtype == np.float32:
        assert flash_lib.rowwise_relative_error(got, ref).max() <= 1e-5
    else:
        eps = float(ml_dtypes.finfo(dtype).eps)
        assert np.all(np.abs(got - ref) <= eps * np.abs(ref)), "more than one rounding apart"
        assert np.mean(got != ref) <= 0.02, f"{np.mean(got != ref):.1%} of the elements differ"
    assert np.abs(got_lse.astype(np.float64) - ref_lse).max() <= 1e-5 * (1 + np.abs(ref_lse).max())


def test_quiet_cluster_changes_real_settings_and_reaches_the_workers(client):
    """Every key of QUIET_CLUSTER is one of distributed's own settings (Dask takes a misspelt key
    silently), set to other than its default, and the workers started under it run with it."""
    import distributed  # noqa: F401 - loads distributed's defaults into dask.config

    defaults = dask.config.defaults
    for key, value in flash_dask.QUIET_CLUSTER.items():
        node = None
        for part in key.split("."):  # dask.config's own nesting, "-" and "_" alike
            layers = [node] if node is not None else defaults
            found = [d[p] for d in layers for p in (part, part.replace("_", "-")) if p in d]
            assert found, f"{key}: no such setting in Dask's defaults"
            node = found[-1]
        assert node != value, f"{key} is already {value!r} by default"
    seen = client.run(lambda: {key: dask.config.get(key) for key in flash_dask.QUIET_CLUSTER})
    assert list(seen.values()) == [flash_dask.QUIET_CLUSTER] * 2, seen


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_runs_unchanged_on_local_schedulers(scheduler):
    """The same graph on Dask's in-process schedulers, no cluster involved."""
    q, k, v = _inputs(np.random.default_rng(4), (2,), (2,), (2,), 100, 130, 8, 8)
    out, lse = flash_dask.dask_attention(_chunked(q, 30), _chunked(k, 40), _chunked(v, 40),
                                         causal=True, return_lse=True)
    _assert_equals_flash(*dask.compute(out, lse, scheduler=scheduler),
                         *flash_lib.flash_attention(q, k, v, causal=True, return_lse=True))


def test_numpy_inputs_get_the_default_shards_or_their_partners():
    rng = np.random.default_rng(5)
    n = flash_dask.DEFAULT_SHARD * 2 + 10
    q, k, v = _inputs(rng, (), (), (), n, 50, 4, 4)
    out = flash_dask.dask_attention(q, k, v)
    assert out.chunks[-2] == (flash_dask.DEFAULT_SHARD, flash_dask.DEFAULT_SHARD, 10)
    # a NumPy k takes the chunks of the Dask v it must agree with, and q those of a Dask mask
    mask = da.from_array(rng.random((n, 50)) < 0.5, chunks=(5000, 20))
    out = flash_dask.dask_attention(q, k, _chunked(v, 20), mask=mask)
    assert out.chunks[-2] == (5000, n - 5000)
    assert flash_dask.attention_task_count(out) == 2 * 3
    np.testing.assert_allclose(out.compute(scheduler="sync"),
                               flash_lib.flash_attention(q, k, v, mask=mask.compute()),
                               rtol=0, atol=1e-13)


def test_nan_in_a_query_row_stays_in_that_row(client):
    q, k, v = _inputs(np.random.default_rng(6), (), (), (), 90, 120, 8, 8)
    q[17, 3] = np.nan
    out = client.compute(flash_dask.dask_attention(_chunked(q, 30), _chunked(k, 40),
                                                   _chunked(v, 40)), sync=True)
    assert np.isnan(out[17]).all()
    ref = flash_lib.flash_attention(q, k, v)
    rows = np.arange(90) != 17
    assert flash_lib.rowwise_relative_error(out[rows], ref[rows]).max() <= 1e-12


def test_no_keys_and_no_queries():
    out, lse = flash_dask.dask_attention(np.ones((3, 4)), np.ones((0, 4)), np.ones((0, 5)),
                                         return_lse=True)
    out, lse = dask.compute(out, lse, scheduler="sync")
    assert np.array_equal(out, np.zeros((3, 5))) and np.all(lse == -np.inf)
    out = flash_dask.dask_attention(np.ones((0, 4)), np.ones((6, 4)), np.ones((6, 5)),
                                    causal=True).compute(scheduler="sync")
    assert out.shape == (0, 5)


@st.composite
def _chunks(draw, n):
    """A random partition of n rows into shards (n = 0: one empty shard)."""
    if n == 0:
        return (0,)
    cuts = draw(st.sets(st.integers(1, n - 1), max_size=min(n - 1, 6))) if n > 1 else set()
    edges = [0, *sorted(cuts), n]
    return tuple(b - a for a, b in zip(edges[:-1], edges[1:]))


@st.composite
def _sharded_cases(draw):
    n_q, n_k = draw(st.integers(0, 24)), draw(st.integers(0, 24))
    return (n_q, n_k, draw(_chunks(n_q)), draw(_chunks(n_k)), draw(st.booleans()),
            draw(st.sampled_from([None, 0.5, 0.9])), draw(st.integers(2, 5)),
            draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=200)
@given(_sharded_cases())
def test_any_shards_any_alignment_equal_flash_attention(case):
    """Every way of cutting small sequences into shards, causal or not, masked or not.

    Small sizes reach every alignment of a shard pair with the causal diagonal (wholly above,
    crossing at any offset, wholly below), which a few hand-picked shapes would not.
    """
    n_q, n_k, q_chunks, k_chunks, causal, density, split_every, seed = case
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, (), (), (), n_q, n_k, 4, 3)
    mask = None if density is None else rng.random((n_q, n_k)) < density
    out, lse = flash_dask.dask_attention(_chunked(q, q_chunks), _chunked(k, k_chunks),
                                         _chunked(v, k_chunks), mask=mask, causal=causal,
                                         return_lse=True, split_every=split_every)
    _assert_equals_flash(*dask.compute(out, lse, scheduler="sync"),
                         *flash_lib.flash_attention(q, k, v, mask=mask, causal=causal,
                                                    return_lse=True))
    allowed = np.ones((n_q, n_k), dtype=bool) if mask is None else mask
    if causal:
        allowed = allowed & causal_mask(n_q, n_k)
    pairs = {key[1:] for key in _pair_keys(out.__dask_graph__())}
    assert pairs == _expected_pairs(n_q, n_k, q_chunks, k_chunks, allowed)


# --------------------------------------------------------------------------------------------
# The graph
# --------------------------------------------------------------------------------------------

GRAPH_SHAPES = [  # Nq, Nk, q chunks, k chunks
    (1024, 1024, 128, 128),
    (1000, 1000, 128, 100),
    (300, 1000, (100, 50, 150), 125),
    (1000, 300, 125, (100, 50, 150)),
    (1, 4096, 1, 512),
]


@pytest.mark.parametrize("n_q, n_k, qc, kc", GRAPH_SHAPES)
def test_causal_graph_holds_exactly_the_pairs_on_or_below_the_diagonal(n_q, n_k, qc, kc):
    q = da.zeros((n_q, 8), chunks=(qc, 8))
    k = da.zeros((n_k, 8), chunks=(kc, 8))
    v = da.zeros((n_k, 8), chunks=(kc, 8))
    causal = flash_dask.dask_attention(q, k, v, causal=True)
    full = flash_dask.dask_attention(q, k, v)
    pairs = {key[1:] for key in _pair_keys(causal.__dask_graph__())}
    expected = _expected_pairs(n_q, n_k, q.chunks[0], k.chunks[0],
                               causal_mask(n_q, n_k))
    assert pairs == expected
    assert flash_dask.attention_task_count(causal) == len(expected)
    assert flash_dask.attention_task_count(full) == q.numblocks[0] * k.numblocks[0]
    if isinstance(qc, int) and isinstance(kc, int):  # even shards: the tile schedule, one level up
        assert len(expected) == len(flash_lib.tile_schedule(n_q, n_k, qc, kc, causal=True))
    assert len(expected) < q.numblocks[0] * k.numblocks[0] or n_q == 1


def test_numpy_mask_forbidding_shard_pairs_leaves_them_out():
    rng = np.random.default_rng(7)
    mask = rng.random((130, 170)) < 0.2
    mask[40:80, 50:150] = False
    out = flash_dask.dask_attention(_chunked(np.zeros((130, 8)), 40),
                                    _chunked(np.zeros((170, 8)), 50),
                                    _chunked(np.zeros((170, 8)), 50), mask=mask)
    pairs = {key[1:] for key in _pair_keys(out.__dask_graph__())}
    assert pairs == _expected_pairs(130, 170, (40,) * 3 + (10,), (50,) * 3 + (20,), mask)
    assert len(pairs) == 16 - 2


def _chains_of(dsk, steps, row, prefix="flash-attention-pair-"):
    """The chains of query shard ``row`` as the graph holds them: lists of key shards, each
    from the pair that starts a chain (it takes no other step's result) to its end.

    ``steps`` maps (i, j) to the key of that pair's step (the pair task, or what the next
    step of its chain reads); a step reads the previous step of its chain, and nothing else
    of ``steps``."""
    key_of = {steps[i, j]: j for (i, j) in steps if i == row}
    before = {}
    for (i, j) in steps:
        if i != row:
            continue
        deps = dask.core.get_dependencies(dsk, _pair_key(dsk, i, j, prefix))
        read = [key_of[dep] for dep in deps if dep in key_of]
        assert len(read) <= 1, f"pair {(i, j)} reads {len(read)} running states"
        before[j] = read[0] if read else None
    after = {b: j for j, b in before.items() if b is not None}
    assert len(after) == sum(b is not None for b in before.values()), "a state read twice"
    chains = []
    for head in (j for j, b in before.items() if b is None):
        chain = [head]
        while chain[-1] in after:
            chain.append(after[chain[-1]])
        chains.append(chain)
    return chains


def _block_key(x, i):
    """The key of shard i of a Dask array chunked along -2 only."""
    return (x.name,) + (0,) * (x.ndim - 2) + (i, 0)


def _pair_key(dsk, i, j, prefix="flash-attention-pair-"):
    return next(key for key in dsk
                if isinstance(key, tuple) and str(key[0]).startswith(prefix) and key[1:] == (i, j))


@pytest.mark.parametrize("split_every", [2, 3, 4, 8, 16, None])
def test_a_query_shards_pairs_fold_in_split_every_chains_merged_once(split_every):
    """4 query shards × 8 key shards. Query shard i visits its key shards in ring attention's
    order i, i - 1, ... (mod 8), cut into min(split_every, 8) chains of consecutive ones
    (lengths differing by at most one); in a chain each pair task takes the running state of
    the one before it, and one merge task per query shard folds the chains' last states, in
    ring order: fan-in min(split_every, 8), so no tree of two levels."""
    fan_in = min(split_every or 4, 8)
    q, k, v = _inputs(np.random.default_rng(8), (), (), (), 4 * 16, 8 * 32, 8, 8)
    qd, kd, vd = _chunked(q, 16), _chunked(k, 32), _chunked(v, 32)
    out = flash_dask.dask_attention(qd, kd, vd, split_every=split_every)
    dsk = dict(out.__dask_graph__())
    steps = {key[1:]: key for key in _pair_keys(dsk)}
    assert len(steps) == flash_dask.attention_task_count(out) == 32
    merges = [key for key in dsk if str(key[0]).startswith("flash-attention-merge-")]
    assert len(merges) == 4
    ends = {}
    for merge in merges:
        args = [a for a in dsk[merge][1:] if a in steps.values()]
        assert len(args) == len(dsk[merge]) - 1 == fan_in  # the merge reads chain ends only
        ends[args[0][1]] = [a[2] for a in args]
    for i in range(4):
        chains = _chains_of(dsk, steps, i)
        ring = [(i - t) % 8 for t in range(8)]
        chains.sort(key=lambda c: ring.index(c[0]))
        assert sum(chains, []) == ring, "not ring order, or not consecutive runs of it"
        assert len(chains) == fan_in
        assert max(map(len, chains)) - min(map(len, chains)) <= 1
        assert ends[i] == [c[-1] for c in chains]
        for j in range(8):  # besides the running state, the pair's own shards and nothing else
            deps = dask.core.get_dependencies(dsk, steps[i, j]) - set(steps.values())
            assert deps == {_block_key(qd, i), _block_key(kd, j), _block_key(vd, j)}
    np.testing.assert_allclose(out.compute(scheduler="sync"), flash_lib.flash_attention(q, k, v),
                               rtol=0, atol=1e-14)


def test_a_causal_query_shard_starts_its_chains_at_the_diagonal():
    """Causal, 8 × 8 even shards: query shard i has pairs with key shards 0..i and visits them
    from the diagonal down (i, i - 1, ..., 0: ring attention's causal order); shard 0, one
    pair, needs no merge, shards 1..3 have 2..4 chains of one pair, shards 4..7 four chains."""
    q, k, v = _inputs(np.random.default_rng(10), (), (), (), 8 * 16, 8 * 16, 8, 8)
    out = flash_dask.dask_attention(_chunked(q, 16), _chunked(k, 16), _chunked(v, 16),
                                    causal=True)
    dsk = dict(out.__dask_graph__())
    steps = {key[1:]: key for key in _pair_keys(dsk)}
    for i in range(8):
        chains = sorted(_chains_of(dsk, steps, i), key=lambda c: -c[0])
        assert sum(chains, []) == list(range(i, -1, -1))
        assert len(chains) == min(i + 1, 4)
    merges = [key for key in dsk if str(key[0]).startswith("flash-attention-merge-")]
    assert len(merges) == 7
    np.testing.assert_allclose(out.compute(scheduler="sync"),
                               flash_lib.flash_attention(q, k, v, causal=True),
                               rtol=0, atol=1e-14)


# --------------------------------------------------------------------------------------------
# A worker killed in the middle of a computation
# --------------------------------------------------------------------------------------------


def _compute_with_a_strike(client, collections, prefix, done=6):
    """Compute ``collections`` with ``flash_dask.KillWorkerAt`` armed on the scheduler, so that a
    worker is killed when ``done`` of the 36 pair tasks have finished; return the results
    (gathered: this raises if one was lost for good) and the victim's address, once the test's
    premise is checked: the kill came with the rest of the graph still to run, and the victim
    held some of its results."""
    client.register_plugin(flash_dask.KillWorkerAt(prefix, done))
    futures = client.compute(collections)
    try:
        results = client.gather(futures)
    finally:
        client.cancel(futures)
        victim, held, finished = client.run_on_scheduler(flash_dask.KillWorkerAt.report)
    assert victim is not None and finished == done, finished  # 36 - done pair tasks to run
    assert held >= 1, "no partial result in memory to lose"
    return results, victim


def _computed_twice(dask_scheduler, prefix):
    """Scheduler side: keys with ``prefix`` that reached memory more than once (recomputed)."""
    count = collections.Counter(
        entry[0] for entry in dask_scheduler.transition_log
        if entry[2] == "memory" and isinstance(entry[0], tuple)
        and str(entry[0][0]).startswith(prefix))
    return sorted(str(key) for key, times in count.items() if times > 1)


def test_a_worker_killed_mid_computation_loses_nothing(own_client):
    """SIGKILL the worker holding the most finished partial results; Dask recomputes them.

    The kill comes from inside the scheduler when 6 of the graph's 36 pair tasks are done
    (:class:`_StrikeAt`), so it always hits the graph while it runs. The test checks the rest of
    its premise: the killed worker held results of this graph, and some were computed again.
    """
    client = own_client
    n, d, shard = 8192, 64, 1024
    rng = da.random.default_rng(2026)
    q, k, v = (rng.standard_normal((n, d), chunks=(shard, d)) for _ in range(3))
    out, lse = flash_dask.dask_attention(q, k, v, causal=True, return_lse=True)  # 36 pairs
    prefix = "flash-attention-"
    pids = client.run(os.getpid)
    # when 6 of the 36 pair tasks are done, the worker holding most of them (running states of
    # the chains) is killed, from inside the scheduler
    (got_out, got_lse), victim = _compute_with_a_strike(client, [out, lse], prefix + "pair-")
    assert pids[victim] not in client.run(os.getpid).values(), "the victim still runs"
    recomputed = client.run_on_scheduler(_computed_twice, prefix=prefix)
    assert recomputed, "nothing was recomputed: the kill did not hit the computation"
    q, k, v = client.compute([q, k, v], sync=True)
    _assert_equals_flash(got_out, got_lse,
                         *flash_lib.flash_attention(q, k, v, causal=True, return_lse=True))


# --------------------------------------------------------------------------------------------
# Memory: each task's scratch is set by its shards, not by N; N = 65536 keys on 2 workers
# --------------------------------------------------------------------------------------------

_PEAKS = []


def _install_probe():
    """Worker side: wrap flash_dask's pair task to record its scratch bytes (tracemalloc).

    The graph refers to the task function by module and name, so a worker that unpickles a
    task after this runs gets the wrapper. Scratch is the peak traced during the call minus
    the returned arrays; the inputs existed before.
    """
    task = flash_dask._attend_pair
    if getattr(task, "probe_of", None) is None:
        def probed(*args, **kwargs):
            result, peak = flash_lib.measure_peak_bytes(task, *args, **kwargs)
            _PEAKS.append(peak - result[0].nbytes - result[1].nbytes)
            return result
        probed.probe_of = task
        flash_dask._attend_pair = probed


def _remove_probe():
    peaks, task = list(_PEAKS), flash_dask._attend_pair
    _PEAKS.clear()
    flash_dask._attend_pair = getattr(task, "probe_of", task)
    return peaks


def _flash_scratch(q, k, v):
    (out, lse), peak = flash_lib.measure_peak_bytes(flash_lib.flash_attention, q, k, v,
                                                    return_lse=True)
    return peak - out.nbytes - lse.nbytes


def test_task_scratch_is_bounded_by_shards_and_65536_keys_complete(client):
    n_q, d, shard = 512, 64, 4096
    rng = da.random.default_rng(65536)
    q = rng.standard_normal((n_q, d), chunks=(n_q, d))
    least, worst = {}, {}
    for n_k in (16384, 65536):
        k, v = (rng.standard_normal((n_k, d), chunks=(shard, d)) for _ in range(2))
        # On both workers before the graph runs, so no transfer competes with a task for memory.
        inputs = client.persist([q, k, v])
        deadline = time.monotonic() + TIMEOUT
        while True:  # replicate waits for the copies; on a loaded machine one may take a retry
            client.replicate(inputs)
            if all(len(holders) == 2 for holders in client.who_has(inputs).values()):
                break
            assert time.monotonic() < deadline, client.who_has(inputs)
            time.sleep(0.1)
        out = flash_dask.dask_attention(*inputs)
        client.run(_install_probe)
        try:
            got = client.compute(out, sync=True)
        finally:
            peaks = [p for w in client.run(_remove_probe).values() for p in w]
        assert len(peaks) == flash_dask.attention_task_count(out) == n_k // shard
        least[n_k], worst[n_k] = min(peaks), max(peaks)
        if n_k == 65536:
            qn, kn, vn = client.compute(inputs, sync=True)
            ref = flash_lib.flash_attention(qn, kn, vn)
            assert flash_lib.rowwise_relative_error(got, ref).max() <= 1e-12
            # flash_attention on one pair of shards, called directly on a worker
            own = client.submit(_flash_scratch, qn, kn[:shard], vn[:shard]).result(TIMEOUT)
        del inputs
    # Other threads of a worker (its transfers) allocate too, and tracemalloc counts them, so a
    # task's figure can only come out too high: the least of them is the task's own scratch.
    # Four times the keys, the same scratch per task ...
    assert least[65536] <= 1.1 * least[16384], least
    # ... which is what flash_attention itself needs for one pair of shards ...
    assert 0.9 * own <= least[65536] <= 1.1 * own, (least, own)
    # ... and even the worst task holds less than one pair of shards' score matrix, itself
    # 1/16 of the scores of the query shard against all 65536 keys.
    pair_scores = n_q * shard * 8
    assert max(worst.values()) < pair_scores, (worst, pair_scores)
    assert pair_scores * 16 == n_q * 65536 * 8


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def _qkv(n_q=100, n_k=120, qc=50, kc=40):
    return (da.zeros((n_q, 8), chunks=(qc, 8)), da.zeros((n_k, 8), chunks=(kc, 8)),
            da.zeros((n_k, 8), chunks=(kc, 8)))


def test_errors_name_the_argument_and_the_chunks():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"q is chunked along its feature axis -1: "
                                         r"chunks \(4, 4\)"):
        flash_dask.dask_attention(q.rechunk((50, 4)), k, v)
    with pytest.raises(ValueError, match=r"v must be chunked like k .* got \(60, 60\) and k's "
                                         r"\(40, 40, 40\)"):
        flash_dask.dask_attention(q, k, v.rechunk((60, 8)))
    with pytest.raises(ValueError, match=r"k is chunked \(1, 1\) along axis 0, a batch axis"):
        flash_dask.dask_attention(q[None], da.zeros((2, 120, 8), chunks=(1, 40, 8)), v)
    mask = da.ones((100, 120), dtype=bool, chunks=(50, 60))
    with pytest.raises(ValueError, match=r"mask is chunked \(60, 60\) along axis -1, "
                                         r"inconsistent with k's chunks along -2 \(40, 40, 40\)"):
        flash_dask.dask_attention(q, k, v, mask=mask)
    with pytest.raises(ValueError, match=r"mask is chunked \(25, 25, 25, 25\) along axis -2"):
        flash_dask.dask_attention(q, k, v, mask=mask.rechunk((25, 40)))
    unknown = da.zeros((100, 8), chunks=(50, 8))
    unknown = unknown[unknown[:, 0] == 0]  # boolean indexing: chunk sizes unknown
    with pytest.raises(ValueError, match=r"q has unknown chunk sizes \(\(nan, nan\), \(8,\)\)"):
        flash_dask.dask_attention(unknown, k, v)
    with pytest.raises(ValueError, match="mask of shape"):
        flash_dask.dask_attention(q, k, v, mask=np.ones((7, 120), dtype=bool))
    with pytest.raises(ValueError, match="same feature size"):
        flash_dask.dask_attention(q, da.zeros((120, 4), chunks=(40, 4)), v)
    with pytest.raises(ValueError, match="same number of keys"):
        flash_dask.dask_attention(q, k, v[:100])
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        flash_dask.dask_attention(q[:, 0], k, v)
    for bad in (1, 0, 2.5, True):
        with pytest.raises(ValueError, match=f"split_every must be an integer >= 2.*{bad!r}"):
            flash_dask.dask_attention(q, k, v, split_every=bad)
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        flash_dask.dask_attention(q, k, v, scale=-1.0)


def test_type_errors_come_from_flash_lib():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="q must be a float16, .*float64 array, got dtype int64"):
        flash_dask.dask_attention(q.astype(int), k, v)
    with pytest.raises(TypeError, match="mask must be a boolean array"):
        flash_dask.dask_attention(q, k, v, mask=np.ones((100, 120)))
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_dask.dask_attention(q, k, v, causal="yes")


# --------------------------------------------------------------------------------------------
# The backward: dask_attention_backward against flash_attention_backward
# --------------------------------------------------------------------------------------------


def _grad_inputs(case):
    """q, k, v and the keyword arguments of CASES[case], its forward on one machine and a dout."""
    bq, bk, bv, n_q, n_k, d, dv, q_chunks, k_chunks, kwargs = CASES[case]
    rng = np.random.default_rng(len(case))
    q, k, v = _inputs(rng, bq, bk, bv, n_q, n_k, d, dv)
    np_kwargs = {name: (np.asarray(x) if isinstance(x, da.Array) else x)
                 for name, x in kwargs.items()}
    out, lse = flash_lib.flash_attention(q, k, v, return_lse=True, **np_kwargs)
    dout = rng.standard_normal(out.shape)
    return q, k, v, dout, q_chunks, k_chunks, kwargs, np_kwargs


def _assert_grads_equal(got, ref, tol=1e-12):
    """Each gradient: its input's shape and dtype, rowwise relative error <= tol (zero rows,
    such as those of rows or keys with no allowed pair, exactly zero)."""
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, (name, g.shape, r.shape, g.dtype)
        err = flash_lib.rowwise_relative_error(g, r).max(initial=0.0)
        assert err <= tol, f"{name}: rowwise relative error {err:.3g} > {tol:g}"


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_backward_equals_flash_attention_backward_on_the_cluster(client, case):
    """The forward on the cluster, then the backward on the cluster from its out and lse."""
    q, k, v, dout, q_chunks, k_chunks, kwargs, np_kwargs = _grad_inputs(case)
    qd, kd, vd = _chunked(q, q_chunks), _chunked(k, k_chunks), _chunked(v, k_chunks)
    out, lse = flash_dask.dask_attention(qd, kd, vd, return_lse=True, **kwargs)
    grads = flash_dask.dask_attention_backward(qd, kd, vd, out, lse, _chunked(dout, q_chunks),
                                               **kwargs)
    assert all(isinstance(g, da.Array) for g in grads)  # lazy
    assert [g.chunks[-2] for g in grads] == [qd.chunks[-2], kd.chunks[-2], vd.chunks[-2]]
    # every backward pair task is one of the forward's, and the other way round
    assert flash_dask.backward_task_count(grads[0]) == flash_dask.attention_task_count(out)
    got = client.compute(list(grads), sync=True)
    ref_out, ref_lse = flash_lib.flash_attention(q, k, v, return_lse=True, **np_kwargs)
    shapes = [x.shape for x in (q, k, v)]
    if "mask" in np_kwargs and np_kwargs["mask"].ndim > max(x.ndim for x in (q, k, v)) or (
            case == "batched mask over broadcast heads"):
        # flash_attention_backward raises when the mask's batch is wider than q, k, v's: the
        # reference is the same gradients with q, k, v broadcast first, summed back over heads
        q, k, v = (np.broadcast_to(x, ref_out.shape[:-2] + x.shape[-2:]) for x in (q, k, v))
        ref = flash_lib.flash_attention_backward(q, k, v, ref_out, ref_lse, dout, **np_kwargs)
        ref = [r.sum(axis=1, keepdims=True) if r.shape != s else r for r, s in zip(ref, shapes)]
    else:
        ref = flash_lib.flash_attention_backward(q, k, v, ref_out, ref_lse, dout, **np_kwargs)
    _assert_grads_equal(got, ref)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
def test_backward_low_precision_dtypes(dtype):
    """16-bit inputs: computed in float32 and rounded once, as flash_attention_backward does."""
    rng = np.random.default_rng(12)
    q, k, v = _inputs(rng, (), (), (), 100, 130, 8, 8, dtype)
    out, lse = flash_lib.flash_attention(q, k, v, causal=True, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(dtype)
    got = dask.compute(*flash_dask.dask_attention_backward(
        _chunked(q, 30), _chunked(k, 40), _chunked(v, 40), out, lse, dout, causal=True),
        scheduler="sync")
    ref = flash_lib.flash_attention_backward(q, k, v, out, lse, dout, causal=True)
    # float32 sums of the shares in another order (float32: 1e-5, as the forward's test), then
    # for float16 one rounding each, at most half an ulp of the largest entry (eps for margin)
    tol = 1e-5 if dtype == np.float32 else float(np.finfo(dtype).eps)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype == dtype
        g, r = g.astype(np.float64), r.astype(np.float64)
        assert np.abs(g - r).max() <= tol * np.abs(r).max()


@settings(max_examples=150)
@given(_sharded_cases())
def test_backward_any_shards_any_alignment(case):
    """Every way of cutting small sequences into shards: the gradients, and the same pairs as
    the forward's graph (the one selection), which are exactly the blocks with an allowed pair.

    Measured against the largest entry of each gradient, not rowwise: a key attended by one
    query has ``dS = P (dP - D)`` with ``P = 1`` and ``dP = D`` up to rounding, a row of a few
    ulps whose rounding depends on the matmul's shape. Rows with no allowed pair are exactly 0.
    """
    n_q, n_k, q_chunks, k_chunks, causal, density, split_every, seed = case
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, (), (), (), n_q, n_k, 4, 3)
    mask = None if density is None else rng.random((n_q, n_k)) < density
    out, lse = flash_lib.flash_attention(q, k, v, mask=mask, causal=causal, return_lse=True)
    dout = rng.standard_normal(out.shape)
    qd, kd, vd = _chunked(q, q_chunks), _chunked(k, k_chunks), _chunked(v, k_chunks)
    grads = flash_dask.dask_attention_backward(qd, kd, vd, out, lse, dout, mask=mask,
                                               causal=causal, split_every=split_every)
    got = dask.compute(*grads, scheduler="sync")
    ref = flash_lib.flash_attention_backward(q, k, v, out, lse, dout, mask=mask, causal=causal)
    allowed = np.ones((n_q, n_k), dtype=bool) if mask is None else mask
    if causal:
        allowed = allowed & causal_mask(n_q, n_k)
    unseen = {"dq": ~allowed.any(axis=1), "dk": ~allowed.any(axis=0), "dv": ~allowed.any(axis=0)}
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert g.shape == r.shape
        assert np.all(g[unseen[name]] == 0) and np.all(r[unseen[name]] == 0), name
        assert np.abs(g - r).max(initial=0) <= 1e-12 * np.abs(r).max(initial=1.0), name
    forward = flash_dask.dask_attention(qd, kd, vd, mask=mask, causal=causal)
    backward_pairs = {key[1:] for key in grads[0].__dask_graph__()
                      if str(key[0]).startswith("flash-attention-backward-pair-")}
    assert backward_pairs == {key[1:] for key in _pair_keys(forward.__dask_graph__())}
    assert backward_pairs == _expected_pairs(n_q, n_k, q_chunks, k_chunks, allowed)
    assert flash_dask.backward_task_count(grads[2]) == len(backward_pairs)


@pytest.mark.parametrize("n_q, n_k, qc, kc", GRAPH_SHAPES)
def test_backward_graph_holds_the_forwards_pairs(n_q, n_k, qc, kc):
    q = da.zeros((n_q, 8), chunks=(qc, 8))
    k = da.zeros((n_k, 8), chunks=(kc, 8))
    v = da.zeros((n_k, 8), chunks=(kc, 8))
    out = da.zeros((n_q, 8), chunks=(qc, 8))
    lse = da.zeros((n_q,), chunks=(qc,))
    expected = _expected_pairs(n_q, n_k, q.chunks[0], k.chunks[0], causal_mask(n_q, n_k))
    dq, dk, dv = flash_dask.dask_attention_backward(q, k, v, out, lse, out, causal=True)
    assert flash_dask.backward_task_count(dq) == len(expected)
    dq, dk, dv = flash_dask.dask_attention_backward(q, k, v, out, lse, out)
    assert flash_dask.backward_task_count(dk) == q.numblocks[0] * k.numblocks[0]


def _tree_additions(parts, fan_in):
    """Additions a tree of fan-in ``fan_in`` takes to sum ``parts`` terms, level by level."""
    tasks = 0
    while parts > 1:
        tasks += parts // fan_in + (parts % fan_in > 1)  # a group of one is passed up
        parts = -(-parts // fan_in)
    return tasks


@pytest.mark.parametrize("split_every", [2, 3, 4, 8, 16, None])
def test_backward_dq_folds_in_chains_dk_dv_sum_in_trees(split_every):
    """8 query shards × 8 key shards. dq_i: the forward's chains (ring order, min(split_every,
    8) of them), each step adding its pair's dq share to the running dq of the step before,
    then one addition of the chains' ends; dk_j and dv_j: their 8 shares (one per query shard)
    summed by a tree of fan-in split_every."""
    fan_in = min(split_every or 4, 8)
    rng = np.random.default_rng(9)
    q, k, v = _inputs(rng, (), (), (), 8 * 16, 8 * 32, 8, 8)
    out, lse = flash_lib.flash_attention(q, k, v, return_lse=True)
    dout = rng.standard_normal(out.shape)
    grads = flash_dask.dask_attention_backward(_chunked(q, 16), _chunked(k, 32), _chunked(v, 32),
                                               out, lse, dout, split_every=split_every)
    dsk = dict(grads[0].__dask_graph__())
    pairs = [key for key in dsk if str(key[0]).startswith("flash-attention-backward-pair-")]
    assert len(pairs) == flash_dask.backward_task_count(grads[0]) == 64
    share_of = {}  # (i, j) -> the dq share of the pair: what the chain's next step reads
    for key in dsk:
        if str(key[0]).startswith("flash-attention-backward-share-") and key[1] == "dq":
            share_of[key[2:]] = key
    for i in range(8):
        chains = _chains_of(dsk, share_of, i, prefix="flash-attention-backward-pair-")
        ring = [(i - t) % 8 for t in range(8)]
        chains.sort(key=lambda c: ring.index(c[0]))
        assert sum(chains, []) == ring and len(chains) == fan_in
        assert max(map(len, chains)) - min(map(len, chains)) <= 1
    sums = collections.Counter(key[1] for key in dsk
                               if str(key[0]).startswith("flash-attention-backward-sum-"))
    assert sums == {"dq": 8, "dk": 8 * _tree_additions(8, fan_in),
                    "dv": 8 * _tree_additions(8, fan_in)}
    sum_keys = [key for key in dsk if str(key[0]).startswith("flash-attention-backward-sum-")]
    assert max(len(dask.core.get_dependencies(dsk, key)) for key in sum_keys) == fan_in
    _assert_grads_equal(dask.compute(*grads, scheduler="sync"),
                        flash_lib.flash_attention_backward(q, k, v, out, lse, dout))


def test_backward_errors_name_the_argument_and_the_chunks():
    q, k, v = _qkv()
    out, lse = da.zeros((100, 8), chunks=(50, 8)), da.zeros((100,), chunks=(50,))
    with pytest.raises(ValueError, match=r"out must be chunked like q along the sequence axis "
                                         r"\(axis -2 of out\), got \(25, 25, 25, 25\) and q's "
                                         r"\(50, 50\)"):
        flash_dask.dask_attention_backward(q, k, v, out.rechunk((25, 8)), lse, out)
    with pytest.raises(ValueError, match=r"lse must be chunked like q along the sequence axis "
                                         r"\(axis -1 of lse\), got \(20, 80\)"):
        flash_dask.dask_attention_backward(q, k, v, out, lse.rechunk(((20, 80),)), out)
    with pytest.raises(ValueError, match=r"dout is chunked along its feature axis -1"):
        flash_dask.dask_attention_backward(q, k, v, out, lse, out.rechunk((50, 4)))
    with pytest.raises(ValueError, match=r"lse must have shape \(100,\).*got \(99,\)"):
        flash_dask.dask_attention_backward(q, k, v, out, lse[:99], out)
    with pytest.raises(ValueError, match=r"v must be chunked like k"):
        flash_dask.dask_attention_backward(q, k, v.rechunk((60, 8)), out, lse, out)
    with pytest.raises(TypeError, match="dout must be a"):
        flash_dask.dask_attention_backward(q, k, v, out, lse, out.astype(int))
    with pytest.raises(ValueError, match="split_every must be an integer >= 2"):
        flash_dask.dask_attention_backward(q, k, v, out, lse, out, split_every=1)


def test_a_worker_killed_mid_backward_loses_nothing(own_client):
    """As for the forward: SIGKILL the worker holding the most finished backward pair results.

    The forward's out and lse are computed and held on the cluster first, so the kill hits the
    backward; the inputs the victim held are lost with it and recomputed too. The kill comes
    from inside the scheduler when 6 of the 36 pair tasks are done; the test checks the rest of
    its premise (the victim held its partial results, some were computed again) and that the
    gradients equal flash_attention_backward's.
    """
    client = own_client
    n, d, shard = 8192, 64, 1024
    rng = da.random.default_rng(2027)
    q, k, v, dout = (rng.standard_normal((n, d), chunks=(shard, d)) for _ in range(4))
    out, lse = flash_dask.dask_attention(q, k, v, causal=True, return_lse=True)
    held = client.persist([q, k, v, out, lse, dout])
    client.gather(client.compute(held[3:5]))  # the forward is done before the clock starts
    grads = flash_dask.dask_attention_backward(*held, causal=True)  # 36 pairs
    prefix = "flash-attention-backward-"
    pids = client.run(os.getpid)
    # when 6 of the 36 pair tasks are done, the worker holding most of their results (running
    # dq, shares of dk and dv) is killed, from inside the scheduler
    got, victim = _compute_with_a_strike(client, list(grads), prefix + "pair-")
    assert pids[victim] not in client.run(os.getpid).values(), "the victim still runs"
    recomputed = client.run_on_scheduler(_computed_twice, prefix=prefix)
    assert recomputed, "nothing was recomputed: the kill did not hit the backward"
    q, k, v, dout = client.compute([q, k, v, dout], sync=True)
    ref_out, ref_lse = flash_lib.flash_attention(q, k, v, causal=True, return_lse=True)
    _assert_grads_equal(got, flash_lib.flash_attention_backward(q, k, v, ref_out, ref_lse, dout,
                                                                causal=True))
    del held


# --------------------------------------------------------------------------------------------
# Training features: dropout (the cluster's mask is flash_lib's, bit for bit) and sinks (merged
# once per query shard)
# --------------------------------------------------------------------------------------------

DROPOUT = {"dropout_p": 0.25, "dropout_seed": 2**40 + 2027}  # both 32-bit halves of the key used

#: CASES on which dropout and sinks are run: causal (its cut shards), masks, Nq != Nk, broadcast
#: batch dims, and a mask wider than q, k, v's batch.
TRAINING_CASES = ["causal, Nq = Nk, uneven shards", "causal, Nq < Nk, uneven shards",
                  "causal, Nq > Nk: top rows see no key", "masked, NumPy mask",
                  "masked and causal, Dask mask", "broadcast batch dims, dv != d, scale",
                  "batched mask over broadcast heads"]


def _sinks_for(batch, rng):
    """One sink per head (the last batch axis; a scalar without one), from -1 to 4."""
    return rng.uniform(-1, 4, batch[-1:]) if batch else np.array(rng.uniform(-1, 4))


def _training_inputs(case):
    q, k, v, dout, q_chunks, k_chunks, kwargs, np_kwargs = _grad_inputs(case)
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2],
                                np_kwargs["mask"].shape[:-2] if "mask" in np_kwargs else ())
    sinks = _sinks_for(batch, np.random.default_rng(len(case) + 1))
    return q, k, v, dout, q_chunks, k_chunks, kwargs, np_kwargs, sinks


@pytest.mark.parametrize("features", ["dropout", "sinks", "dropout and sinks"])
@pytest.mark.parametrize("case", TRAINING_CASES, ids=TRAINING_CASES)
def test_dropout_and_sinks_equal_flash_lib_on_the_cluster(client, case, features):
    """Forward and backward on the cluster against flash_lib on one machine with the same
    keywords: with dropout the keep mask is the same bit for bit (else the outputs would differ
    by O(1), not by rounding); with sinks the sink counts once (merged in every pair it would
    count once per key shard), and dsinks is summed over the query shards. The pair tasks are
    those of the same call without these keywords."""
    q, k, v, dout, q_chunks, k_chunks, kwargs, np_kwargs, sinks = _training_inputs(case)
    extra = {**(DROPOUT if "dropout" in features else {}),
             **({"sinks": sinks} if "sinks" in features else {})}
    qd, kd, vd = _chunked(q, q_chunks), _chunked(k, k_chunks), _chunked(v, k_chunks)
    out, lse = flash_dask.dask_attention(qd, kd, vd, return_lse=True, **kwargs, **extra)
    grads = flash_dask.dask_attention_backward(qd, kd, vd, out, lse, _chunked(dout, q_chunks),
                                               **kwargs, **extra)
    assert len(grads) == (4 if "sinks" in extra else 3)
    plain = flash_dask.dask_attention(qd, kd, vd, **kwargs)
    assert flash_dask.attention_task_count(out) == flash_dask.attention_task_count(plain)
    assert flash_dask.backward_task_count(grads[0]) == flash_dask.attention_task_count(plain)
    got_out, got_lse, *got = client.compute([out, lse, *grads], sync=True)
    ref_out, ref_lse = flash_lib.flash_attention(q, k, v, return_lse=True, **np_kwargs, **extra)
    _assert_equals_flash(got_out, got_lse, ref_out, ref_lse)
    ref = flash_lib.flash_attention_backward(q, k, v, ref_out, ref_lse, dout, **np_kwargs, **extra)
    _assert_grads_equal(got[:3], ref[:3])
    if "sinks" in extra:
        dsinks, ref_dsinks = got[3], ref[3]
        assert dsinks.shape == sinks.shape and dsinks.dtype == ref_dsinks.dtype
        assert np.abs(dsinks - ref_dsinks).max() <= 1e-12 * np.abs(ref_dsinks).max()


def test_the_clusters_keep_mask_is_dropout_keeps(client):
    """Read off the output (q = 0: uniform weights 1/Nk; v = identity: out[..., i, j] =
    Z_ij / (Nk (1 - p))), on uneven shards with causal (shards cut at the diagonal, their bottom
    rows at an offset of their own): exactly flash_lib.dropout_keep's mask where causal allows."""
    n_q, n_k, p = 150, 200, DROPOUT["dropout_p"]
    q = np.zeros((2, 3, n_q, 4))
    k = np.random.default_rng(0).standard_normal((2, 3, n_k, 4))
    v = np.broadcast_to(np.eye(n_k), (2, 3, n_k, n_k))
    q_chunks, k_chunks = (40, 70, 40), (30, 90, 80)
    out, lse = flash_dask.dask_attention(_chunked(q, q_chunks), _chunked(k, k_chunks),
                                         _chunked(np.ascontiguousarray(v), k_chunks),
                                         causal=True, return_lse=True, **DROPOUT)
    got, got_lse = client.compute([out, lse], sync=True)
    allowed = causal_mask(n_q, n_k)
    seen = allowed.sum(axis=-1)[:, None]  # keys each row may see: P = 1 / seen
    keep = got * seen * (1 - p)
    assert np.all((np.abs(keep - 1) < 1e-9) | (keep == 0))
    expected = flash_lib.dropout_keep(DROPOUT["dropout_seed"], p, (2, 3, n_q, n_k)) & allowed
    np.testing.assert_array_equal(keep > 0.5, expected)
    np.testing.assert_allclose(got_lse, np.broadcast_to(np.log(seen[:, 0]), got_lse.shape),
                               rtol=0, atol=1e-13)  # the undropped lse


def test_the_sink_is_merged_once_per_query_shard_never_in_a_pair():
    """The pair tasks' partials are attention without the sink (their lse holds no exp(sink)),
    and the result is flash_lib's: a sink merged in every pair would count once per key shard
    (here 4), and one merged nowhere not at all; both are far from 1e-12."""
    rng = np.random.default_rng(21)
    q, k, v = _inputs(rng, (2,), (2,), (2,), 60, 200, 8, 8)
    sinks = np.array([1.0, 3.0])
    qd, kd, vd = _chunked(q, 30), _chunked(k, 50), _chunked(v, 50)
    out, lse = flash_dask.dask_attention(qd, kd, vd, sinks=sinks, return_lse=True)
    graph = dict(out.__dask_graph__())
    pair = next(key for key in _pair_keys(graph) if key[1:] == (1, 2))  # rows 30:60, keys 100:150
    _, pair_lse = dask.get(graph, pair)
    _, bare_lse = flash_lib.flash_attention(q[:, 30:60], k[:, 100:150], v[:, 100:150],
                                            return_lse=True)
    np.testing.assert_allclose(pair_lse, bare_lse, rtol=0, atol=1e-13)
    sink_tasks = [key for key in graph if str(key[0]).startswith("flash-attention-sink-")]
    assert len(sink_tasks) == 2  # one per query shard
    got_out, got_lse = dask.compute(out, lse, scheduler="sync")
    _assert_equals_flash(got_out, got_lse,
                         *flash_lib.flash_attention(q, k, v, sinks=sinks, return_lse=True))


@settings(max_examples=100)
@given(_sharded_cases())
def test_dropout_and_sinks_any_shards_any_alignment(case):
    """Every way of cutting small sequences into shards, causal or not, masked or not, with
    dropout and a sink: forward and backward equal flash_lib's (so every pair task, cut or not,
    regenerates its elements' keep bits at their global positions, and the sink counts once)."""
    n_q, n_k, q_chunks, k_chunks, causal, density, split_every, seed = case
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, (2,), (2,), (2,), n_q, n_k, 4, 3)
    mask = None if density is None else rng.random((n_q, n_k)) < density
    kwargs = dict(mask=mask, causal=causal, sinks=np.array([0.5, -1.0]), dropout_p=0.4,
                  dropout_seed=seed)
    qd, kd, vd = _chunked(q, q_chunks), _chunked(k, k_chunks), _chunked(v, k_chunks)
    out, lse = flash_dask.dask_attention(qd, kd, vd, return_lse=True, split_every=split_every,
                                         **kwargs)
    got_out, got_lse = dask.compute(out, lse, scheduler="sync")
    ref_out, ref_lse = flash_lib.flash_attention(q, k, v, return_lse=True, **kwargs)
    _assert_equals_flash(got_out, got_lse, ref_out, ref_lse)
    dout = rng.standard_normal(ref_out.shape)
    got = dask.compute(*flash_dask.dask_attention_backward(qd, kd, vd, ref_out, ref_lse, dout,
                                                           split_every=split_every, **kwargs),
                       scheduler="sync")
    ref = flash_lib.flash_attention_backward(q, k, v, ref_out, ref_lse, dout, **kwargs)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), got, ref):
        assert g.shape == r.shape, name
        assert np.abs(g - r).max(initial=0) <= 1e-12 * np.abs(r).max(initial=1.0), name


def test_dropout_off_is_the_graph_without_it():
    """dropout_p = 0 (no seed needed) runs no generator: the very graph of a call without it."""
    q, k, v = _qkv()
    assert (flash_dask.dask_attention(q, k, v, dropout_p=0.0).name
            == flash_dask.dask_attention(q, k, v).name)


def test_dropout_and_sinks_errors_come_from_flash_lib():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="dropout_p"):
        flash_dask.dask_attention(q, k, v, dropout_p=1.0, dropout_seed=0)
    with pytest.raises(ValueError, match="dropout_seed"):
        flash_dask.dask_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="sinks"):
        flash_dask.dask_attention(q, k, v, sinks=np.array(np.inf))
    with pytest.raises(ValueError, match="sinks"):
        flash_dask.dask_attention(q, k, v, sinks=np.zeros(3))  # no head axis to broadcast to
    out, lse = da.zeros((100, 8), chunks=(50, 8)), da.zeros((100,), chunks=(50,))
    with pytest.raises(ValueError, match="dropout_seed"):
        flash_dask.dask_attention_backward(q, k, v, out, lse, out, dropout_p=0.5,
                                           dropout_seed=-1)
    with pytest.raises(ValueError, match="sinks"):
        flash_dask.dask_attention_backward(q, k, v, out, lse, out, sinks=np.array(np.nan))


def test_dropout_and_sinks_in_float16():
    """16-bit inputs with dropout and a sink: computed in float32 and rounded once, as one
    flash_lib call (so at most one rounding apart, in few elements); dsinks in float32."""
    rng = np.random.default_rng(13)
    q, k, v = _inputs(rng, (2,), (2,), (2,), 100, 130, 8, 8, np.float16)
    kwargs = dict(causal=True, sinks=np.array([1.0, 2.0]), **DROPOUT)
    qd, kd, vd = _chunked(q, 30), _chunked(k, 40), _chunked(v, 40)
    out, lse = flash_dask.dask_attention(qd, kd, vd, return_lse=True, **kwargs)
    got, got_lse = dask.compute(out, lse, scheduler="sync")
    ref, ref_lse = flash_lib.flash_attention(q, k, v, return_lse=True, **kwargs)
    eps = float(np.finfo(np.float16).eps)
    assert got.dtype == np.float16 and got_lse.dtype == np.float32
    g, r = got.astype(np.float64), ref.astype(np.float64)
    assert np.all(np.abs(g - r) <= eps * np.abs(r)) and np.mean(g != r) <= 0.02
    assert np.abs(got_lse - ref_lse).max() <= 1e-5 * (1 + np.abs(ref_lse).max())
    dout = rng.standard_normal(ref.shape).astype(np.float16)
    grads = dask.compute(*flash_dask.dask_attention_backward(qd, kd, vd, ref, ref_lse, dout,
                                                             **kwargs), scheduler="sync")
    refs = flash_lib.flash_attention_backward(q, k, v, ref, ref_lse, dout, **kwargs)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, refs):
        assert g.dtype == r.dtype == (np.float32 if name == "dsinks" else np.float16), name
        g, r = g.astype(np.float64), r.astype(np.float64)
        tol = 1e-5 if name == "dsinks" else eps  # float32 sums, then one float16 rounding
        assert np.abs(g - r).max() <= tol * np.abs(r).max(), name


def test_a_length_one_sequence_axis_with_empty_chunks_is_one_shard():
    """Chunks (0, 1, 0) along a sequence axis of length 1 (Dask allows empty chunks) are that one
    element: accepted for q, k and v alike, and computed exactly as flash_attention (it was
    refused as "q must be chunked like k … got (0, 1, 0) and k's (1,)", and even "k must be
    chunked like k"). A real mismatch still names the array the shards were taken from."""
    x = np.random.default_rng(15).standard_normal((1, 8))
    padded, plain = (da.from_array(x, chunks=(chunks, (8,))) for chunks in ((0, 1, 0), (1,)))
    ref = flash_lib.flash_attention(x, x, x)
    for q, k, v in ((padded, plain, plain), (plain, padded, padded), (padded, padded, padded)):
        np.testing.assert_array_equal(flash_dask.dask_attention(q, k, v).compute(scheduler="sync"),
                                      ref)
    y = np.random.default_rng(16).standard_normal((8, 4))
    k, v = da.from_array(y, chunks=((4, 4), (4,))), da.from_array(y, chunks=((2, 6), (4,)))
    with pytest.raises(ValueError, match=r"v must be chunked like k .* got \(2, 6\) and k's "
                                         r"\(4, 4\)"):
        flash_dask.dask_attention(y, k, v)

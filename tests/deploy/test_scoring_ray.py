"""Scoring on a real local Ray instance (``ray.init(num_cpus=2)``, one per test session, shut down at
its end): 20,000 rows through two workers give the rows, order and values of one ``exe(x)`` call in this
process, and no worker imports torch, Pyro, SciPy or TVM's compiler; a worker killed in the middle
still yields every row exactly once; ``pyro2pfp score`` reports a corrupt shard and a shard with a NaN
by name, writes the others, and skips them when run again, the workers taking the library of their
architecture.

Every run is bounded (:func:`within`, the command by a subprocess timeout); under pytest-xdist the tests share
one worker (``xdist_group``)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pyro2pfp
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.plan import plan
from pyro2pfp.runtime.ray_scoring import actor_cpus, score_files
from tests.support.builders import mlp_graph
from tests.support.scoring_worker import ProbeScorer

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = 20_000
LIMIT = 900
"""Seconds one pipeline may take (a local Ray instance on two loaded cores starts in tens of seconds)."""


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``, failing the test if it has not returned after ``seconds`` (a starved pipeline never
    returns; the session's ``ray.shutdown()`` ends it)."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 -- re-raised in the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"the Ray pipeline did not finish in {seconds} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.fixture(scope="session")
def local_ray():
    """One local Ray instance with 2 CPUs for the session; the workers find this checkout's packages."""
    import ray

    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    """An MLP 64-32-10 exported for this machine and 20,000 inputs."""
    tmp = tmp_path_factory.mktemp("ray_scoring")
    graph = mlp_graph(np.random.default_rng(0), [64, 32, 10])
    PFPNetwork(graph, plan(graph)).compile("llvm").export_library(tmp / "mlp.so")
    x = np.random.default_rng(1).normal(0, 1, (ROWS, 64)).astype(np.float32)
    return tmp / "mlp.so", x


def _score_command(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``python -m pyro2pfp *argv`` in a fresh process (at most ``LIMIT`` seconds)."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "pyro2pfp", *argv], capture_output=True, text=True, timeout=LIMIT,
                          env={**os.environ, "PYTHONPATH": path})


def _collect(ds) -> dict[str, np.ndarray]:
    batches = list(ds.iter_batches(batch_size=None, batch_format="numpy"))
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def _check_values(out: dict[str, np.ndarray], mean: np.ndarray, var: np.ndarray) -> None:
    np.testing.assert_allclose(out["mean"], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["var"], var, rtol=1e-5, atol=1e-7)


def test_two_workers_give_the_rows_order_and_values_of_one_call(local_ray, network):
    """``ds.map_batches(Scorer, ...)`` as a user writes it: every id once, in order, the values of
    ``exe(x)`` in this process, both workers used, and none imported torch, Pyro, SciPy or TVM."""
    ray = local_ray
    path, x = network
    ids = np.arange(ROWS) * 3 + 7
    tables = [pa.table({"id": ids[i:i + 2500], "x": pa.FixedShapeTensorArray.from_numpy_ndarray(x[i:i + 2500])})
              for i in range(0, ROWS, 2500)]
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    scored = ray.data.from_arrow(tables).map_batches(
        ProbeScorer, fn_constructor_args=(str(path),), fn_constructor_kwargs={"metrics": True},
        compute=ray.data.ActorPoolStrategy(size=2), num_cpus=actor_cpus([2.0]), batch_size=256,
        batch_format="numpy")
    out = within(LIMIT, lambda: _collect(scored))
    np.testing.assert_array_equal(out["id"], ids)
    mean, var = pyro2pfp.load(path)(x)
    _check_values(out, mean, var)
    assert np.all(out["epistemic"] >= 0) and np.allclose(out["probs"].sum(1), 1, atol=1e-5)
    assert len(set(out["pid"].tolist())) == 2 and os.getpid() not in set(out["pid"].tolist())
    assert set(out["heavy"].tolist()) == {""}, f"a worker imported {set(out['heavy'].tolist())}"


def test_a_worker_killed_in_the_middle_still_yields_every_row_once(local_ray, network, tmp_path):
    """One worker kills itself (SIGKILL) on its third batch; Ray restarts it and runs the batch again:
    ``score_files`` still writes every row exactly once (it checks each shard's rows arrive once, in
    order), with the values of ``exe(x)``."""
    path, x = network
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(4):
        np.save(inputs / f"part{i}.npy", x[i * 5000:(i + 1) * 5000])
    marker = tmp_path / "died"
    report = within(LIMIT, lambda: score_files([path], [str(inputs)], str(tmp_path / "out"), batch_size=256,
                                               rows_per_block=1024, scorer=ProbeScorer,
                                               scorer_kwargs={"die_once": str(marker)}, progress=False))
    assert marker.exists(), "no worker was killed: the test did not test anything"
    assert report.failed == {} and report.rows == ROWS and len(report.written) == 4
    mean, var = pyro2pfp.load(path)(x)
    for i in range(4):
        table = pq.read_table(tmp_path / "out" / f"part{i}.parquet")
        np.testing.assert_array_equal(table.column("row").to_numpy(), np.arange(5000))
        out = {k: np.stack(table.column(k).to_numpy(zero_copy_only=False)) for k in ("mean", "var")}
        _check_values(out, mean[i * 5000:(i + 1) * 5000], var[i * 5000:(i + 1) * 5000])
        assert int(marker.read_text()) not in set(table.column("pid").to_numpy().tolist())


def test_the_command_reports_bad_shards_by_name_finishes_the_others_and_resumes(network, tmp_path):
    """``pyro2pfp score`` run as a user runs it (a fresh process that starts its own local Ray) on a
    directory of .npy/.npz/Parquet shards: a truncated file, rows of another shape and a NaN are reported
    by name (exit status 1), the other shards are written with their ids and the values of ``exe(x)``, and
    a second run scores only the shard whose output was removed.  The workers take the second library
    given: the first is for another architecture."""
    path, x = network
    inputs = tmp_path / "in"
    inputs.mkdir()
    np.save(inputs / "a.npy", x[:6000])
    np.savez(inputs / "b.npz", x=x[6000:9000], id=np.arange(3000) + 10**6)
    pq.write_table(pa.table({"key": [f"k{i}" for i in range(3000)],
                             "x": pa.FixedShapeTensorArray.from_numpy_ndarray(x[9000:12000])}),
                   inputs / "c.parquet", row_group_size=1000)
    (inputs / "corrupt.npy").write_bytes((inputs / "a.npy").read_bytes()[:3000])
    nan = x[12000:16000].copy()
    nan[2345, 7] = np.nan
    np.save(inputs / "nan.npy", nan)
    np.save(inputs / "wide.npy", x[:10, :32])
    # the first model is for AArch64 nodes: every worker here passes it over for the x86 one (--library)
    shutil.copy(path, tmp_path / "arm.so")
    info = json.loads(path.with_name(path.name + ".json").read_text())
    (tmp_path / "arm.so.json").write_text(json.dumps({**info, "library": "arm.so", "target_arch": "aarch64"}))
    out = tmp_path / "out"
    argv = ["score", str(tmp_path / "arm.so"), str(inputs), "-o", str(out), "--library", str(path), "--metrics",
            "--batch-size", "256"]
    first = _score_command(argv)
    assert first.returncode == 1, first.stderr[-3000:]
    err = first.stderr
    assert f"failed: {inputs / 'corrupt.npy'}: cannot be read" in err
    assert f"failed: {inputs / 'nan.npy'}: rows shard=" in err and "non-finite values in row(s) [2345]" in err
    assert f"failed: {inputs / 'wide.npy'}: its rows have shape (32,); the network takes (64,)" in err
    assert sorted(os.listdir(out)) == ["a.parquet", "b.parquet", "c.parquet"]
    mean, var = pyro2pfp.load(path)(x[:12000])
    tables = {name: pq.read_table(out / f"{name}.parquet") for name in "abc"}
    assert tables["b"].column_names[:2] == ["row", "id"] and tables["c"].column_names[:2] == ["row", "key"]
    assert tables["b"].column("id").to_pylist()[:2] == [10**6, 10**6 + 1]
    got = {k: np.concatenate([np.stack(tables[n].column(k).to_numpy(zero_copy_only=False)) for n in "abc"])
           for k in ("mean", "var")}
    _check_values(got, mean, var)
    assert "epistemic" in tables["a"].column_names

    os.remove(out / "b.parquet")  # run again on the good shards: only b is scored
    inputs_again = [str(inputs / name) for name in ("a.npy", "b.npz", "c.parquet")]
    again_run = _score_command(["score", str(path), *inputs_again, "-o", str(out), "-q"])
    assert again_run.returncode == 0, again_run.stderr[-3000:]
    printed = again_run.stdout
    assert "scored 3,000 rows into 1 file(s)" in printed and "skipped 2 shard(s)" in printed
    again = pq.read_table(out / "b.parquet")
    np.testing.assert_array_equal(np.stack(again.column("mean").to_numpy(zero_copy_only=False)),
                                  np.stack(tables["b"].column("mean").to_numpy(zero_copy_only=False)))

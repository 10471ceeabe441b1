"""The scorer and the shard files without Ray: a Scorer maps batches to the predictor's own outputs
(bit for bit), keeps ids and order, names rows in its errors, picks the model a worker can run, and
pickles; shards are planned from headers, read by row ranges, and a scored shard is written whole.
(On a real Ray instance: test_scoring_ray.py.)"""
from __future__ import annotations

import json
import os
import pickle
import shutil

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pyro2pfp
from pyro2pfp.network import PFPNetwork
from pyro2pfp.ops.head import append_head
from pyro2pfp.planning.plan import plan
from pyro2pfp.runtime.ray_scoring import _failed_shard, _quoted_error, actor_cpus
from pyro2pfp.runtime.scoring import METRICS, ModelFiles, Scorer, load_for_this_worker
from pyro2pfp.runtime.shards import (
    ShardError,
    expand_inputs,
    output_path,
    plan_chunks,
    plan_shard,
    read_rows,
    write_scored,
)
from tests.support.builders import mlp_graph

SHAPE = (12,)


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    """An MLP 12-8-3 exported for this machine ("llvm"), the same with the uncertainty head, and inputs."""
    tmp = tmp_path_factory.mktemp("scoring")
    graph = mlp_graph(np.random.default_rng(0), [12, 8, 3])
    PFPNetwork(graph, plan(graph)).compile("llvm").export_library(tmp / "mlp.so")
    PFPNetwork(graph, plan(append_head(graph, "probs"))).compile("llvm").export_library(tmp / "head.so")
    x = np.random.default_rng(1).uniform(0, 1, (700, *SHAPE)).astype(np.float32)
    return tmp, x


def test_a_batch_scores_as_the_predictor_does_with_ids_kept_in_order(libraries):
    tmp, x = libraries
    exe = pyro2pfp.load(tmp / "mlp.so")
    scorer = Scorer(str(tmp / "mlp.so"), metrics=True)
    ids = np.arange(len(x))[::-1] * 7  # not the positions
    keys = np.array([f"k{i}" for i in range(len(x))])
    out = scorer({"id": ids, "key": keys, "x": x})
    assert list(out) == ["id", "key", "mean", "var", *METRICS]
    np.testing.assert_array_equal(out["id"], ids)
    np.testing.assert_array_equal(out["key"], keys)
    mean, var = exe(x)
    np.testing.assert_array_equal(out["mean"], mean)
    np.testing.assert_array_equal(out["var"], var)
    # the metrics: pyro2pfp.uncertainty's, from logit draws shared by every row -- the same whatever the batch
    halves = [scorer({"x": x[:300]}), scorer({"x": x[300:]})]
    for name in METRICS:
        np.testing.assert_array_equal(np.concatenate([h[name] for h in halves]), out[name])
    z = np.random.default_rng(0).standard_normal((100, 3))
    row = pyro2pfp.uncertainty_from_logit_samples(mean[5] + np.sqrt(var[5]) * z)
    for name in METRICS:
        np.testing.assert_allclose(out[name][5], row[name][0], rtol=1e-5, atol=1e-6)
    assert out["probs"].dtype == np.float32 and out["total"].shape == (len(x),)
    # a bare array, a pandas DataFrame of row arrays, rows of shape (1, 12): the same numbers
    np.testing.assert_array_equal(scorer(x)["mean"], mean)
    import pandas as pd

    frame = pd.DataFrame({"id": ids[:5], "x": list(x[:5])})
    np.testing.assert_array_equal(scorer(frame)["mean"], mean[:5])
    np.testing.assert_array_equal(scorer({"x": x[:5, None, :]})["mean"], mean[:5])


def test_a_network_with_the_uncertainty_head_gives_its_own_columns(libraries):
    tmp, x = libraries
    head = pyro2pfp.load(tmp / "head.so")(x[:50])
    out = Scorer(str(tmp / "head.so"), metrics=True)({"x": x[:50]})
    assert list(out) == ["probs", "total", "aleatoric", "epistemic"]
    np.testing.assert_array_equal(out["epistemic"], head.mutual_information)
    np.testing.assert_array_equal(out["total"], head.predictive_entropy)
    with pytest.raises(pyro2pfp.ArgumentError, match="outputs .*probs.*not \\['mean'\\]"):
        Scorer(str(tmp / "head.so"), outputs=["mean"])
    with pytest.raises(pyro2pfp.ArgumentError, match="unknown metrics \\['entropy'\\]"):
        Scorer(str(tmp / "mlp.so"), metrics=["entropy"])


def test_errors_name_the_rows(libraries):
    tmp, x = libraries
    scorer = Scorer(str(tmp / "mlp.so"))
    bad = x[:20].copy()
    bad[13, 4] = np.nan
    with pytest.raises(pyro2pfp.InputShapeError, match=r"rows id=100…119; non-finite values in row\(s\) \[113\]") as e:
        scorer({"id": np.arange(100, 120), "x": bad})
    assert e.value.rows == {"id": (100, 119)} and e.value.first_bad == {"id": 113}
    back = pickle.loads(pickle.dumps(e.value))  # as Ray ships it from a worker
    assert back.rows == e.value.rows and back.first_bad == {"id": 113} and str(back) == str(e.value)
    with pytest.raises(pyro2pfp.InputShapeError, match=r"rows shard=3, row=0…19: column 'x' holds rows of shape"):
        scorer({"shard": np.full(20, 3), "row": np.arange(20), "x": x[:20, :10]})
    with pytest.raises(pyro2pfp.InputShapeError, match=r"rows 0…4 of a batch of 5 .*must be real numbers"):
        scorer(x[:5].astype(str))
    with pytest.raises(pyro2pfp.InputShapeError, match="rows of different shapes"):
        scorer({"x": np.array([x[0], x[1, :5]], dtype=object)})
    with pytest.raises(pyro2pfp.InputShapeError, match="columns \\['a', 'b'\\]: name the input column"):
        scorer({"a": x[:3], "b": x[:3]})
    with pytest.raises(pyro2pfp.InputShapeError, match="no input column 'image'"):
        Scorer(str(tmp / "mlp.so"), column="image")({"x": x[:3]})


def test_the_scorer_and_its_model_files_pickle_and_ship(libraries, tmp_path):
    tmp, x = libraries
    bundle = ModelFiles.read(tmp / "mlp.so")
    assert sorted(bundle.files) == ["mlp.so", "mlp.so.json"] and bundle.input_shape() == SHAPE
    scorer = Scorer(bundle, metrics=["epistemic"])
    assert not os.path.exists(str(tmp_path / "mlp.so"))  # written to a directory of the scorer's own
    for dumps in (pickle.dumps, cloudpickle.dumps):
        copy = pickle.loads(dumps(scorer))
        assert copy.metrics == ["epistemic"] and copy.path != scorer.path
        np.testing.assert_array_equal(copy(x[:9])["epistemic"], scorer(x[:9])["epistemic"])
    directory = os.path.dirname(copy.path)
    del copy
    import gc

    gc.collect()
    assert not os.path.exists(directory)  # removed with the scorer


def _variant(source, directory, name, **sidecar):
    """A copy of ``source/mlp.so`` in ``directory`` whose sidecar says other things (target, architecture)."""
    shutil.copy(source / "mlp.so", directory / name)
    info = json.loads((source / "mlp.so.json").read_text())
    info.update(sidecar, library=name)
    (directory / (name + ".json")).write_text(json.dumps(info))
    return str(directory / name)


def test_each_worker_takes_the_first_model_it_can_run(libraries, tmp_path):
    """A library for another architecture is passed over; a CPU-specific one (an mcpu in its target) is
    loaded in a child process first, and passed over if that fails; none fitting is one LoadError
    naming the worker and every model's reason."""
    tmp, x = libraries
    arm = _variant(tmp, tmp_path, "arm.so", target_arch="aarch64")
    native = _variant(tmp, tmp_path, "native.so", target={"kind": "llvm", "mcpu": "x86-64"})
    exe, path = load_for_this_worker([arm, native])
    assert path == native
    np.testing.assert_array_equal(exe(x[:4])[0], pyro2pfp.load(tmp / "mlp.so")(x[:4])[0])
    broken = _variant(tmp, tmp_path, "broken.so", target={"kind": "llvm", "mcpu": "x86-64"})
    with open(broken, "r+b") as f:  # the sidecar's sha256 no longer holds: the child's load fails
        f.seek(100)
        f.write(b"\0" * 64)
    exe, path = load_for_this_worker([broken, str(tmp / "mlp.so")])
    assert path == str(tmp / "mlp.so")
    with pytest.raises(pyro2pfp.LoadError) as e:
        load_for_this_worker([arm, broken, str(tmp_path / "gone.so")])
    message = str(e.value)
    assert "can run none of the models" in message and "arm.so: compiled for aarch64" in message
    assert "broken.so: " in message and "sha256" in message and "gone.so: not found on this worker" in message
    assert "ONNX" in message
    with pytest.raises(pyro2pfp.ArgumentError, match="non-empty list"):
        Scorer([])


def test_shards_are_planned_from_headers_and_read_by_row_ranges(libraries, tmp_path):
    _, x = libraries
    np.save(tmp_path / "a.npy", x[:100])
    np.savez(tmp_path / "b.npz", x=x[100:150], id=np.arange(50) + 1000, other=np.zeros((3, 3)))
    tensors = pa.FixedShapeTensorArray.from_numpy_ndarray(x[150:250])
    pq.write_table(pa.table({"key": [f"r{i}" for i in range(100)], "x": tensors}), tmp_path / "c.parquet",
                   row_group_size=30)
    nested = pa.FixedSizeListArray.from_arrays(pa.array(x[250:260].reshape(-1)), 12)
    pq.write_table(pa.table({"image": nested}), tmp_path / "d.parquet")
    (tmp_path / "e.npy").write_bytes((tmp_path / "a.npy").read_bytes()[:1000])  # truncated
    (tmp_path / "f.parquet").write_bytes(b"PAR1 not really")
    files = expand_inputs([str(tmp_path)])
    assert [os.path.basename(f) for f in files] == ["a.npy", "b.npz", "c.parquet", "d.parquet", "e.npy", "f.parquet"]
    a, b, c, d = (plan_shard(f) for f in files[:4])
    assert (a.rows, a.row_shape, a.passthrough) == (100, SHAPE, ())
    assert (b.rows, b.column, b.passthrough) == (50, "x", ("id",))
    assert (c.rows, c.column, c.row_shape, c.passthrough) == (100, "x", SHAPE, ("key",))
    assert (d.column, d.row_shape) == ("image", SHAPE)
    for bad in files[4:]:
        with pytest.raises(ShardError, match=f"{os.path.basename(bad)}: cannot be read") as e:
            plan_shard(bad)
        assert e.value.shard == bad and pickle.loads(pickle.dumps(e.value)).shard == bad
    assert plan_chunks(a, 40) == [(0, 40), (40, 80), (80, 100)]
    assert plan_chunks(b, 40) == [(0, 50)]
    assert plan_chunks(c, 40) == [(0, 60), (60, 100)]  # whole row groups of 30
    got = [read_rows(c, *r, shard_id=2) for r in plan_chunks(c, 40)]
    np.testing.assert_array_equal(np.concatenate([g["x"] for g in got]), x[150:250])
    np.testing.assert_array_equal(np.concatenate([g["row"] for g in got]), np.arange(100))
    assert list(got[1]["key"][:2]) == ["r60", "r61"] and set(got[0]["shard"]) == {2}
    np.testing.assert_array_equal(read_rows(a, 40, 80)["x"], x[40:80])
    np.testing.assert_array_equal(read_rows(b, 0, 50)["id"], np.arange(50) + 1000)
    np.testing.assert_array_equal(read_rows(d, 0, 10)["image"], x[250:260])
    assert a.mismatch((1, 12)) is None and "rows have shape (12,); the network takes (3, 4)" in a.mismatch((3, 4))
    with pytest.raises(ShardError, match="not whole row groups"):
        read_rows(c, 0, 40)
    with pytest.raises(pyro2pfp.PFPError, match="not found"):
        expand_inputs([str(tmp_path / "nothing")])


def test_a_scored_shard_is_written_whole(tmp_path):
    out = output_path(str(tmp_path), "/data/pool/part-7.npy")
    assert out == str(tmp_path / "part-7.parquet")
    columns = {"row": np.arange(4), "mean": np.arange(12, dtype=np.float32).reshape(4, 3),
               "epistemic": np.ones(4, np.float32)}
    write_scored(out, columns)
    table = pq.read_table(out)
    assert table.column_names == ["row", "mean", "epistemic"] and os.listdir(tmp_path) == ["part-7.parquet"]
    np.testing.assert_array_equal(np.stack(table.column("mean").to_numpy(zero_copy_only=False)), columns["mean"])
    with pytest.raises(pa.ArrowInvalid):
        write_scored(out + "2", {"a": np.arange(3), "b": np.arange(4)})
    assert sorted(os.listdir(tmp_path)) == ["part-7.parquet"]  # no partial file left behind


def test_actor_sizing_leaves_every_node_cpus_for_reading():
    assert actor_cpus([2.0]) == 0.75  # two actors: 1.5 CPUs, 0.5 left for read tasks (0.25 each)
    assert actor_cpus([8.0, 2.0]) == 0.75 and actor_cpus([8.0, 16.0]) == 0.9375
    assert actor_cpus([1.0]) == 0.5 and actor_cpus([]) == 0.5


def test_a_workers_error_is_traced_to_its_shard():
    """Ray wraps a worker's exception (a RayTaskError whose ``cause`` is the original, and Ray Data's
    exception raised from it): the shard is found along the chain, from a ShardError or the rows a
    scorer error names (the first non-finite row's shard when a batch spans two)."""
    from pyro2pfp.runtime.shards import Shard

    shards = [Shard(f"s{i}.npy", "x", 10, SHAPE) for i in range(3)]

    class Wrapped(Exception):
        def __init__(self, cause):
            super().__init__("Traceback (most recent call last): ...")
            self.cause = cause

    error = pyro2pfp.InputShapeError("rows shard=1…2, row=0…9: x contains 1 NaN or infinite value(s)")
    error.rows, error.first_bad = {"shard": (1, 2), "row": (0, 9)}, {"shard": 2, "row": 3}
    try:
        raise RuntimeError("the dataset failed") from Wrapped(error)
    except RuntimeError as exc:
        assert _failed_shard(exc, shards) == ("s2.npy", f"s2.npy: {error}")
    unreadable = Wrapped(ShardError("s0.npy", "cannot be read"))
    assert _failed_shard(unreadable, shards) == ("s0.npy", "s0.npy: cannot be read")
    assert _failed_shard(RuntimeError("anything else"), shards) == (None, "")
    # an actor's __init__ failing reaches the driver as text only (Ray's ActorDiedError)
    died = RuntimeError("The actor died because of an error raised in its creation task, ray::MapWorker ... File "
                        "\"scoring.py\", line 202\npyro2pfp.errors.LoadError: worker vm (x86_64) can run none of the "
                        "models: arm.so: compiled for aarch64")
    quoted = _quoted_error(died)
    assert isinstance(quoted, pyro2pfp.LoadError) and str(quoted).startswith("worker vm (x86_64) can run none")
    assert _quoted_error(RuntimeError("no pyro2pfp error here")) is None

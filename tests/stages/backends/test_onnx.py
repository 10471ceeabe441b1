"""ONNX export (pyro2pfp.backends.onnx.builder) run with onnxruntime against the float64 NumPy reference.

Graphs are built by hand (tests/support/builders.py) and planned with both moment forms; the exported
model must pass ``onnx.checker`` (full check), use standard operators only, have a dynamic batch
dimension, and reproduce ``pyro2pfp.backends.reference.execute`` to float32 accuracy.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pyro
import pyro.distributions as dist
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyro.nn import PyroSample

import pyro2pfp
from pyro2pfp.backends.onnx.builder import onnx_ops_used, to_onnx
from pyro2pfp.backends.reference import execute
from pyro2pfp.backends.reference.arrays import conv2d_nchw
from pyro2pfp.errors import UnsupportedLayerError
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.graph import INPUT, GaussianParam, Layer, LayerGraph
from pyro2pfp.planning.plan import plan
from tests.support.builders import (
    U32,
    ResidualNet,
    assert_compute_layer,
    conv_layer,
    dense_layer,
    forms,
    input_var,
    inputs,
    lenet_graph,
    mlp_graph,
    pool_cases,
    pool_graph,
    pool_layer,
    relu_layer,
    reshape_layer,
    scales,
    var_scales,
)

STANDARD_OPS = {"MatMul", "Conv", "Mul", "Add", "Sub", "Div", "Neg", "Erf", "Exp", "Sqrt", "Max", "Min",
                "Greater", "Less", "Where", "Slice", "Pad", "MaxPool", "AveragePool", "Relu", "Reshape", "Shape",
                "ConstantOfShape", "Identity"}
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def run(model, x, x_var=None):
    feeds = {"x": x} if x_var is None else {"x": x, "x_var": x_var}
    mean, var = session(model).run(["mean", "var"], feeds)
    assert mean.dtype == np.float32 and var.dtype == np.float32
    return mean, var



def check_structure(model: onnx.ModelProto, graph, batch_dim: str = "batch") -> None:
    onnx.checker.check_model(model, full_check=True)
    assert all(op.domain in ("", "ai.onnx") and op.version >= 17 for op in model.opset_import)
    assert all(node.domain in ("", "ai.onnx") for node in model.graph.node)
    assert set(onnx_ops_used(model)) <= STANDARD_OPS, set(onnx_ops_used(model)) - STANDARD_OPS
    names = [i.name for i in model.graph.input]
    assert names == (["x"] if graph.input_repr.name == "DETERMINISTIC" else ["x", "x_var"])
    assert [o.name for o in model.graph.output] == ["mean", "var"]
    for value in list(model.graph.input) + list(model.graph.output):
        assert value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        assert value.type.tensor_type.shape.dim[0].dim_param == batch_dim
    assert all(init.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.INT64)
               for init in model.graph.initializer)


# ---------------------------------------------------------------------------------------------
# Compute layers: within the float32 summation bound (as tests/stages/backends/test_compiled_vs_reference.py)
# ---------------------------------------------------------------------------------------------

@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), k=st.integers(1, 48), m=st.integers(1, 24),
       mean_scale=scales, var_scale=var_scales, x_scale=scales, x_var=input_var, form=forms,
       bias=st.sampled_from(["prob", "det", "none"]))
def test_dense_matches_reference(seed, batch, k, m, mean_scale, var_scale, x_scale, x_var, form, bias):
    rng = np.random.default_rng(seed)
    layer = dense_layer(rng, "fc", INPUT, k, m, mean_scale, var_scale, bias)
    graph = LayerGraph(input_shape=(k,), layers=[layer], output="fc", input_variance=x_var is not None)
    planned = plan(graph, 1.0, form)
    model = to_onnx(planned)
    check_structure(model, planned)
    x, xv = inputs(rng, batch, (k,), x_scale, x_var)
    ref, out = execute(planned, x, xv), run(model, x, xv)
    assert_compute_layer(layer, x, xv, ref, out, lambda a, w: a @ w.T, form)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 3), c=st.integers(1, 4), size=st.integers(5, 9),
       out_c=st.integers(1, 5), kernel=st.sampled_from([1, 3]), stride=st.sampled_from([1, 2]),
       pad=st.sampled_from([0, 1]), dil=st.sampled_from([1, 2]), grouped=st.booleans(),
       mean_scale=scales, var_scale=var_scales, x_var=input_var, form=forms)
def test_conv2d_matches_reference(seed, batch, c, size, out_c, kernel, stride, pad, dil, grouped,
                                  mean_scale, var_scale, x_var, form):
    rng = np.random.default_rng(seed)
    groups = c if grouped else 1
    out_c = out_c * groups
    layer = conv_layer(rng, "conv", INPUT, (c, size, size), out_c, kernel, stride, pad, dil, groups,
                       mean_scale, var_scale)
    graph = LayerGraph(input_shape=(c, size, size), layers=[layer], output="conv",
                       input_variance=x_var is not None)
    planned = plan(graph, 1.0, form)
    model = to_onnx(planned)
    check_structure(model, planned)
    x, xv = inputs(rng, batch, (c, size, size), 1.0, x_var)
    ref, out = execute(planned, x, xv), run(model, x, xv)
    a = layer.attrs

    def apply(inp, w):
        return conv2d_nchw(inp, w, a["stride"], a["padding"], a["dilation"], a["groups"])

    assert_compute_layer(layer, x, xv, ref, out, apply, form)


# ---------------------------------------------------------------------------------------------
# ReLU and max pooling moments (incl. the σ = 0 limits): a few float32 ulps of the input scale
# ---------------------------------------------------------------------------------------------


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), scale=scales, rel_var=st.sampled_from([0.0, 1e-8, 1e-3, 1.0, 100.0]),
       zero_fraction=st.sampled_from([0.0, 0.5]), kernel=st.sampled_from([2, 3]),
       stride=st.sampled_from([1, 2]))
def test_relu_and_max_pool_moments_match_reference(seed, scale, rel_var, zero_fraction, kernel, stride):
    rng = np.random.default_rng(seed)
    shape = (3, 7, 7)
    pool = pool_layer("pool", INPUT, shape, kernel, stride)
    layers = [relu_layer("relu", INPUT, shape), pool]
    for graph_layers, output in ((layers[:1], "relu"), ([pool], "pool")):
        graph = LayerGraph(input_shape=shape, layers=graph_layers, output=output, input_variance=True)
        planned = plan(graph)
        model = to_onnx(planned)
        check_structure(model, planned)
        x = (scale * rng.standard_normal((4, *shape))).astype(np.float32)
        xv = (rel_var * scale**2 * rng.uniform(0, 1, x.shape)).astype(np.float32)
        xv[rng.uniform(size=x.shape) < zero_fraction] = 0.0  # σ = 0 limit elementwise
        ref, out = execute(planned, x, xv), run(model, x, xv)
        assert all(np.all(np.isfinite(o)) for o in out)
        sigma = np.sqrt(xv.astype(np.float64))
        # float32 evaluation of the same formula: erf/exp to a few ulps, times the input scale
        tol_mean = 64 * U32 * (np.abs(x).max() + sigma.max()) + 1e-30
        tol_var = 64 * U32 * (scale**2 * max(rel_var, 1e-30)) * 4 + 1e-30
        assert np.abs(out[0] - ref[0]).max() <= tol_mean, (output, np.abs(out[0] - ref[0]).max())
        assert np.abs(out[1] - ref[1]).max() <= tol_var + 64 * U32 * np.abs(ref[1]).max(), output


def test_zero_variance_gives_the_deterministic_result_exactly():
    """σ = 0 everywhere: ReLU gives max(0, μ) and Clark's max gives max(μ1, μ2), bit for bit."""
    rng = np.random.default_rng(3)
    shape = (2, 6, 6)
    layers = [relu_layer("relu", INPUT, shape), pool_layer("pool", "relu", shape, 2, 2)]
    graph = LayerGraph(input_shape=shape, layers=layers, output="pool", input_variance=True)
    model = to_onnx(plan(graph))
    x = (1e3 * rng.standard_normal((3, *shape))).astype(np.float32)
    x[:, :, ::2, ::2] = 0.0  # exact zeros: α = 0/0 must not appear
    mean, var = run(model, x, np.zeros_like(x))
    expected = np.maximum(x, 0).reshape(3, 2, 3, 2, 3, 2).max(axis=(3, 5))
    np.testing.assert_array_equal(mean, expected)
    np.testing.assert_array_equal(var, np.zeros_like(var))


# ---------------------------------------------------------------------------------------------
# Whole networks (MLP and LeNet shapes), both plans, with and without input variance
# ---------------------------------------------------------------------------------------------


def _graph(kind: str, rng) -> LayerGraph:
    if kind == "mlp":
        return mlp_graph(rng, [64, 40, 30, 10], mean_scale=0.15, var_scale=1e-3)
    return lenet_graph(rng, widths=(4, 8, 32, 16), image=28, mean_scale=0.2, var_scale=1e-3)


@pytest.mark.parametrize("kind", ["mlp", "lenet"])
@pytest.mark.parametrize("form", ["variance", "raw"])
@pytest.mark.parametrize("with_input_var", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_networks_match_reference(kind, form, with_input_var, seed, tmp_path):
    rng = np.random.default_rng(seed)
    graph = _graph(kind, rng)
    graph.input_variance = with_input_var
    planned = plan(graph, calibration=0.7, moment_form=form)
    path = tmp_path / "net.onnx"
    to_onnx(PFPNetwork(graph, planned), path)
    model = onnx.load(path)
    check_structure(model, planned)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (1, 7):  # dynamic batch: one model, any batch size
        x, xv = inputs(rng, batch, graph.input_shape, 1.0, 1e-2 if with_input_var else None)
        feeds = {"x": x} if xv is None else {"x": x, "x_var": xv}
        mean, var = sess.run(["mean", "var"], feeds)
        ref_mean, ref_var = execute(planned, x, xv)
        assert mean.shape == ref_mean.shape == (batch, 10)
        # float32 network vs float64 reference: relative to the output scale
        np.testing.assert_allclose(mean, ref_mean, rtol=1e-4, atol=1e-4 * np.abs(ref_mean).max())
        np.testing.assert_allclose(var, ref_var, rtol=1e-3, atol=1e-4 * np.abs(ref_var).max())


def test_deterministic_output_and_metadata(tmp_path):
    """A network without parameters stays deterministic: var is exact zeros; metadata is recorded."""
    shape = (2, 4, 4)
    layers = [relu_layer("relu", INPUT, shape), pool_layer("pool", "relu", shape, 2, 2),
              reshape_layer("flat", "pool", (8,))]
    planned = plan(LayerGraph(input_shape=shape, layers=layers, output="flat"))
    model = to_onnx(planned, tmp_path / "det.onnx")
    check_structure(model, planned)
    x = np.random.default_rng(0).standard_normal((5, *shape)).astype(np.float32)
    mean, var = run(model, x)
    np.testing.assert_array_equal(mean, execute(planned, x)[0].astype(np.float32))
    np.testing.assert_array_equal(var, np.zeros((5, 8), np.float32))
    props = {p.key: p.value for p in model.metadata_props}
    assert props["pyro2pfp.input_shape"] == "2,4,4" and props["pyro2pfp.input_variance"] == "false"


def test_unsupported_op_and_bad_arguments_are_clear(tmp_path):
    rng = np.random.default_rng(0)
    planned = plan(mlp_graph(rng, [8, 4, 2]))
    planned.layers[1].layer.op = "mish"  # an op the exporter does not know
    with pytest.raises(UnsupportedLayerError, match="mish"):
        to_onnx(planned)
    with pytest.raises(TypeError, match="PFPNetwork or a PlannedGraph"):
        to_onnx(object())
    with pytest.raises(FileNotFoundError, match="does not exist"):
        to_onnx(plan(mlp_graph(rng, [8, 4, 2])), tmp_path / "missing" / "net.onnx")


# ---------------------------------------------------------------------------------------------
# LeakyReLU, per-channel affine (batch norm), residual add, pooling with padding / ceil mode
# ---------------------------------------------------------------------------------------------


def export_and_compare(graph: LayerGraph, x, xv, scale: float, form: str = "variance"):
    planned = plan(graph, 1.0, form)
    model = to_onnx(planned)
    check_structure(model, planned)
    ref, out = execute(planned, x, xv), run(model, x, xv)
    for o, r in zip(out, ref):
        assert np.all(np.isfinite(o))
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-5 * scale)
    return ref, out


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 40), slope=st.sampled_from([0.0, 0.01, 0.2, 0.5, 1.0]),
       x_var=st.sampled_from([None, 0.0, 1e-6, 1.0, 100.0]), form=forms)
def test_leaky_relu_matches_reference(seed, n, slope, x_var, form):
    rng = np.random.default_rng(seed)
    graph = LayerGraph((n,), [Layer("lrelu", "leaky_relu", [INPUT], (n,), "t", {"slope": slope})], "lrelu",
                       input_variance=x_var is not None)
    x = (3 * rng.standard_normal((3, n))).astype(np.float32)
    xv = None if x_var is None else (x_var * rng.uniform(0, 1, x.shape)).astype(np.float32)
    export_and_compare(graph, x, xv, 10.0 + (x_var or 0.0), form)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), case=pool_cases(), kind=st.sampled_from(["max", "avg"]),
       include_pad=st.booleans(), x_var=st.sampled_from([None, 0.0, 1e-4, 1.0]))
def test_pooling_with_padding_and_ceil_mode_matches_reference(seed, case, kind, include_pad, x_var):
    graph, torch_pool = pool_graph(kind, case, include_pad, input_variance=x_var is not None)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, *graph.input_shape)).astype(np.float32)
    xv = None if x_var is None else (x_var * rng.uniform(0, 1, x.shape)).astype(np.float32)
    _, out = export_and_compare(graph, x, xv, 10.0)
    if x_var in (None, 0.0):  # the deterministic mean is torch's pooling
        np.testing.assert_allclose(out[0], torch_pool(torch.as_tensor(x)).numpy(), rtol=1e-6, atol=1e-6)


def test_affine_and_add_match_reference():
    rng = np.random.default_rng(0)
    c, n = 3, 4
    zeros = np.zeros(c)
    params = {"scale": GaussianParam(rng.standard_normal(c), zeros),
              "shift": GaussianParam(rng.standard_normal(c), zeros)}
    layers = [Layer("bn", "affine", [INPUT], (c, n, n), "t", params=params),
              Layer("sum", "add", ["bn", INPUT], (c, n, n), "t")]
    for input_variance in (True, False):
        graph = LayerGraph((c, n, n), layers, "sum", input_variance=input_variance)
        x = rng.standard_normal((2, c, n, n)).astype(np.float32)
        xv = rng.uniform(0.1, 1, x.shape).astype(np.float32) if input_variance else None
        export_and_compare(graph, x, xv, 10.0)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["variance", "raw"])
def test_converted_torch_model_with_every_op(form, tmp_path):
    torch.manual_seed(0)
    body = ResidualNet()
    with torch.no_grad():
        body.bn.running_mean.uniform_(-0.5, 0.5)
        body.bn.running_var.uniform_(0.5, 2.0)
    body.eval()
    pyro.nn.module.to_pyro_module_(body)
    for name in ("conv", "conv2", "fc"):
        layer = body.get_submodule(name)
        layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand(layer.weight.shape).to_event(layer.weight.dim()))
    locs = {n: 0.3 * torch.randn(body.get_submodule(n).weight.shape) for n in ("conv", "conv2", "fc")}

    def guide(x, y=None):
        for n, loc in locs.items():
            pyro.sample(f"{n}.weight", dist.Normal(loc, 0.05 + 0.0 * loc).to_event(loc.dim()))

    net = pyro2pfp.convert(body, guide, input_shape=(3, 9, 9), moment_form=form, input_variance=True,
                           fold_batch_norm=False)  # keep the affine op in the exported graph
    assert {"conv2d", "affine", "leaky_relu", "add", "relu", "avg_pool2d", "max_pool2d", "dense"} <= {
        p.op for p in net.plan.layers}
    to_onnx(net, tmp_path / "residual.onnx")
    model = onnx.load(tmp_path / "residual.onnx")
    check_structure(model, net.plan)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 3, 9, 9)).astype(np.float32)
    xv = rng.uniform(0, 0.05, x.shape).astype(np.float32)
    mean, var = run(model, x, xv)
    ref_mean, ref_var = net.reference(x, xv)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-4, atol=1e-4 * np.abs(ref_mean).max())
    np.testing.assert_allclose(var, ref_var, rtol=1e-3, atol=1e-4 * np.abs(ref_var).max())


def test_load_runs_an_onnx_model_with_the_predictor_input_checks(tmp_path):
    """``pyro2pfp.load("net.onnx")`` runs an exported model with onnxruntime: the reference's moments
    (and the uncertainty head's outputs), the compiled predictor's input checks, and a LoadError naming
    a file that is not an ONNX model."""
    from pyro2pfp.ops.head import append_head

    rng = np.random.default_rng(0)
    graph = mlp_graph(rng, [12, 8, 3])
    net = PFPNetwork(graph, plan(graph))
    net.to_onnx(tmp_path / "mlp.onnx")
    exe = pyro2pfp.load(tmp_path / "mlp.onnx")
    assert exe.input_shape == (12,) and not exe.input_variance
    x = rng.uniform(0, 1, (4, 12)).astype(np.float32)
    mean, var = exe(x)
    ref_mean, ref_var = net.reference(x)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-4, atol=1e-5 * np.abs(ref_mean).max())
    np.testing.assert_allclose(var, ref_var, rtol=1e-3, atol=1e-5 * np.abs(ref_var).max())
    with pytest.raises(pyro2pfp.InputShapeError, match="expected"):
        exe(x[:, :5])
    with pytest.raises(pyro2pfp.PFPError):
        exe(np.where(x > 0.5, np.inf, x))

    head_net = PFPNetwork(graph, plan(append_head(graph, "probs")))
    head_net.to_onnx(tmp_path / "head.onnx")
    out = pyro2pfp.load(str(tmp_path / "head.onnx"))(x)
    ref = head_net.reference(x)
    np.testing.assert_allclose(out.probs, ref.probs, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out.mutual_information, ref.mutual_information, rtol=1e-3, atol=1e-6)

    (tmp_path / "junk.onnx").write_bytes(b"not an onnx model")
    with pytest.raises(pyro2pfp.LoadError, match="junk.onnx"):
        pyro2pfp.load(tmp_path / "junk.onnx")
    with pytest.raises(pyro2pfp.LibraryNotFoundError):
        pyro2pfp.load(tmp_path / "missing.onnx")

"""pyro2pfp.diagnose: per-layer PFP vs Monte Carlo over the guide's samples, table, plot and CLI."""
from __future__ import annotations

import numpy as np
import pyro
import pytest
import torch

import pyro2pfp


@pytest.fixture(scope="module")
def resnet_case():
    from pyro2pfp_experiments.zoo import bayesian_resnet, he_posterior

    torch.manual_seed(1)
    model = bayesian_resnet(blocks=1, widths=(4,))  # one stage: global pooling over 64 positions
    x = torch.randn(4, 3, 8, 8)
    guide = he_posterior(model, x, scale=0.02, seed=1)
    return model, guide, x


@pytest.mark.slow
def test_per_layer_rows_locate_the_global_pooling_failure(resnet_case, tmp_path):
    model, guide, x = resnet_case
    d = pyro2pfp.diagnose(model, guide, x, num_samples=120, correlation="mean-field")
    rows = {r.name: r for r in d.layers}
    assert "fc" in rows and "conv1" in rows and "input" not in rows
    # conv1 sees a deterministic input: its PFP variance is exact, so the ratio is 1 up to MC noise
    # (120 samples: per-element relative sd 0.13; the median over 256 elements is far tighter)
    assert 0.85 <= rows["conv1"].ratio_median <= 1.15, rows["conv1"]
    assert rows["conv1"].ratio_p10 <= rows["conv1"].ratio_median <= rows["conv1"].ratio_p90
    assert rows["conv1"].mean_error < 0.2
    pool = next(r for r in d.layers if r.op == "avg_pool2d")
    assert pool.ratio_median < 0.5  # mean-field over-shrinks correlated variance at global pooling
    assert d.argmax_agreement == 1.0
    table = d.table()
    assert "fc" in table and "var ratio" in table
    png = tmp_path / "ratio.png"
    d.plot(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the default (correlation="auto" picks shared factors for global pooling): the pooling layer is repaired
    dc = pyro2pfp.diagnose(model, guide, x, num_samples=120)
    pool_c = next(r for r in dc.layers if r.op == "avg_pool2d")
    assert 0.7 <= pool_c.ratio_median <= 1.4, pool_c


def test_bad_arguments(resnet_case):
    model, guide, x = resnet_case
    with pytest.raises(pyro2pfp.PFPError):
        pyro2pfp.diagnose(model, guide, x, num_samples=1)
    with pytest.raises(pyro2pfp.InputShapeError):
        pyro2pfp.diagnose(model, guide, x[0], num_samples=10, input_shape=(3, 8, 8))


@pytest.mark.slow
def test_mc_moments_match_numpy_on_the_logits(resnet_case):
    """The output-only mode gives the same MC logit moments as per-layer mode with the same seed: the same
    guide draws (other draws would differ by tens of %), through a vmapped forward instead of one forward per
    draw (float32 rounding)."""
    model, guide, x = resnet_case
    a = pyro2pfp.diagnose(model, guide, x, num_samples=20, per_layer=False, seed=3)
    b = pyro2pfp.diagnose(model, guide, x, num_samples=20, per_layer=True, seed=3)
    assert [r.name for r in a.layers] == ["fc"]
    np.testing.assert_allclose(a.output["mc_var"], b.output["mc_var"], rtol=1e-5)


@pytest.mark.slow
def test_cli_diagnose(tmp_path, capsys):
    from pyro2pfp.cli import main

    (tmp_path / "builder.py").write_text(
        "import torch\nfrom pyro2pfp_experiments.zoo import bayesian_resnet, he_posterior\n"
        "def build():\n    torch.manual_seed(0)\n    m = bayesian_resnet(blocks=1, widths=(4,))\n"
        "    return m, he_posterior(m, torch.randn(2, 3, 8, 8))\n")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32))
    png = tmp_path / "r.png"
    status = main(["diagnose", str(tmp_path / "builder.py") + ":build", str(tmp_path / "x.npy"), "-s", "3,8,8",
                   "-n", "10", "--plot", str(png)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "adaptive_avg_pool2d" in out and "10 MC samples, 2 inputs" in out
    assert png.exists()
    assert main(["diagnose", str(tmp_path / "builder.py") + ":build", str(tmp_path / "missing.npy"),
                 "-s", "3,8,8"]) != 0


def test_saturated_units_do_not_dominate_the_mean_error():
    """A unit far in a flat tail (a saturated Softplus) has a sampled sd near 0: its negligible absolute
    mean difference must not swamp the layer's figure (it read 1e6 and more when divided by that sd)."""
    from pyro2pfp.diagnosis import layer_fidelity

    rng = np.random.default_rng(0)
    n = 200
    samples = 1.0 + rng.standard_normal((n, 4, 32))  # (samples, inputs, units), unit sd 1
    samples[:, :, :3] = 1e-9 + 1e-12 * rng.standard_normal((n, 4, 3))  # three saturated units
    mc_mean, mc_var = samples.mean(0), samples.var(0, ddof=1)
    pfp_mean, pfp_var = np.where(mc_var > 1e-6, 1.0, 2e-6), np.where(mc_var > 1e-6, 1.0, 1e-24)
    row = layer_fidelity("softplus", "softplus", pfp_mean, pfp_var, mc_mean, mc_var)
    # the healthy units are exact: the MC noise floor, |N(0, 1)|/√n (median 0.67/√n, p90 1.64/√n)
    assert row.mean_error < 3 * 0.67 / np.sqrt(n), row
    assert row.mean_error_p90 < 3 * 1.64 / np.sqrt(n), row
    assert 0.7 < row.ratio_median < 1.4, row


@pytest.mark.slow
def test_tyxe_bnn_alone():
    """diagnose takes what convert takes: a TyXe VariationalBNN alone, or with its own guide (which also
    holds the likelihood's scale), stands for its net and net_guide; the caller's random streams are left
    as they were."""
    from tests.support.gallery_models import D_IN, tyxe_regression

    bnn = tyxe_regression(learned_scale=True)
    x, y = torch.randn(16, D_IN), torch.randn(16, 1)
    bnn.fit(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16),
            pyro.optim.Adam({"lr": 0.02}), 3)
    net = pyro2pfp.convert(bnn)
    rng = torch.get_rng_state()
    alone = pyro2pfp.diagnose(bnn, None, x[:4], num_samples=20, net=net)
    assert torch.equal(torch.get_rng_state(), rng)
    with_guide = pyro2pfp.diagnose(bnn, bnn.guide, x[:4], num_samples=20, net=net)
    parts = pyro2pfp.diagnose(bnn.net, bnn.net_guide, x[:4], num_samples=20, net=net)
    for d in (alone, with_guide):
        assert [r.name for r in d.layers] == [r.name for r in parts.layers] == ["0", "relu", "2"]
        np.testing.assert_allclose(d.output["mc_var"], parts.output["mc_var"], rtol=1e-10)

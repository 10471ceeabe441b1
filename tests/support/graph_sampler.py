"""Monte Carlo of a :class:`~pyro2pfp.planning.graph.LayerGraph` with Gaussian parameters, in torch (shared test
helper).

Each draw takes new weights and biases from every layer's ``N(mean, var)`` and runs the network on the
given inputs; ``n`` draws run at once as ``n`` groups of one grouped convolution (dense layers: a batched
matmul), chunk by chunk.  Returns every layer's draws, ``(n, batch, *shape)`` -- the independent truth the
moments of a plan are compared with.  Ops: conv2d (groups 1), dense, affine, scale, add, concat,
reshape, layer_norm, max/avg pooling and the activations torch has."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pyro2pfp.planning.graph import INPUT, GaussianParam, LayerGraph

_ACTIVATIONS = {
    "relu": lambda x, a: F.relu(x),
    "leaky_relu": lambda x, a: F.leaky_relu(x, a["slope"]),
    "gelu": lambda x, a: F.gelu(x, approximate=a.get("approximate", "none")),
    "silu": lambda x, a: F.silu(x),
    "tanh": lambda x, a: torch.tanh(x),
    "sigmoid": lambda x, a: torch.sigmoid(x),
}


def _draw(rng: np.random.Generator, p: GaussianParam, n: int) -> torch.Tensor:
    return torch.as_tensor(p.mean + np.sqrt(p.var) * rng.standard_normal((n, *p.mean.shape)))


def _chunk(g: LayerGraph, x: np.ndarray, n: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """``n`` draws of every layer: tensors ``(batch, n, *shape)`` (draw-major within the batch)."""
    batch = x.shape[0]
    values = {INPUT: torch.as_tensor(x, dtype=torch.float64)[:, None].expand(batch, n, *x.shape[1:])}
    for layer in g.layers:
        a = layer.attrs
        ins = [values[name] for name in layer.inputs]
        op = layer.op
        if op == "conv2d":
            w, b = _draw(rng, layer.params["weight"], n), layer.params.get("bias")
            xs = ins[0].reshape(batch, -1, *ins[0].shape[3:])
            out = F.conv2d(xs, w.reshape(-1, *w.shape[2:]), None if b is None else _draw(rng, b, n).reshape(-1),
                           stride=a["stride"], padding=a["padding"], dilation=a.get("dilation", 1), groups=n)
            values[layer.name] = out.reshape(batch, n, -1, *out.shape[2:])
        elif op == "dense":
            w, b = _draw(rng, layer.params["weight"], n), layer.params.get("bias")
            out = torch.einsum("bni,noi->bno", ins[0].reshape(batch, n, -1), w)
            values[layer.name] = out if b is None else out + _draw(rng, b, n)[None]
        elif op == "affine":
            shape = (1, 1, -1) + (1,) * (ins[0].dim() - 3)
            values[layer.name] = ins[0] * torch.as_tensor(layer.params["scale"].mean).reshape(shape) \
                + torch.as_tensor(layer.params["shift"].mean).reshape(shape)
        elif op == "scale":
            values[layer.name] = ins[0] * a["factor"]
        elif op == "add":
            values[layer.name] = ins[0] + ins[1]
        elif op == "concat":
            values[layer.name] = torch.cat(ins, dim=a["axis"] + 2)
        elif op == "reshape":
            values[layer.name] = ins[0].reshape(batch, n, *layer.out_shape)
        elif op in ("max_pool2d", "avg_pool2d"):
            flat = ins[0].reshape(batch * n, *ins[0].shape[2:])
            if op == "max_pool2d":
                out = F.max_pool2d(flat, a["kernel"], a["stride"], a["padding"], ceil_mode=a["ceil_mode"])
            else:
                out = F.avg_pool2d(flat, a["kernel"], a["stride"], a["padding"], ceil_mode=a["ceil_mode"],
                                   count_include_pad=a.get("count_include_pad", True))
            values[layer.name] = out.reshape(batch, n, *out.shape[1:])
        elif op == "layer_norm":
            d = layer.params["weight"].mean.shape
            gamma, beta = (_draw(rng, layer.params[k], n).reshape(1, n, *d) for k in ("weight", "bias"))
            out = F.layer_norm(ins[0], tuple(d), eps=a["eps"])
            values[layer.name] = out * gamma + beta
        elif op in _ACTIVATIONS:
            values[layer.name] = _ACTIVATIONS[op](ins[0], a)
        else:
            raise NotImplementedError(f"graph_sampler: op {op!r}")
    return values


def sample_graph(g: LayerGraph, x: np.ndarray, n: int, seed: int = 0, chunk: int = 500) -> dict[str, np.ndarray]:
    """``n`` Monte Carlo draws of every layer of ``g`` on the inputs ``x``: ``{layer: (n, batch, *shape)}``."""
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {}
    with torch.no_grad():
        for start in range(0, n, chunk):
            for name, t in _chunk(g, x, min(chunk, n - start), rng).items():
                if name != INPUT:
                    parts.setdefault(name, []).append(t.transpose(0, 1).numpy())
    return {name: np.concatenate(p) for name, p in parts.items()}

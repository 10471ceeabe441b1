"""The arguments the model and guide are run with while converting.

Without ``convert(..., example_args=...)`` only the shape of one input is known: the model and guide are
called with a zero batch ``x`` (further required positional parameters get ``None``, see
:class:`pyro2pfp.frontend.posterior.ModelArgs`).  Models and guides written as ``model(X, cll)`` that *use* the
labels (``cll.size(0)`` for a plate, a guide that reads them) need real ones: ``example_args=(x, y)``
(and ``example_kwargs``) are the arguments of one call, the input batch first.

The guide is run with them as given.  The network is traced with the input batch as the network's input
and every other argument whose first dimension is the batch (the labels) as a further input sharing
the symbolic batch dimension, so a plate sized by the labels follows the input's batch; arguments
without the batch dimension are constants.  None of them may reach the network's output (checked when
the graph is walked): labels never enter the network.
"""
from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch

from ..errors import ArgumentError, InputShapeError
from .posterior import ModelArgs


def user_model_args(example_args: Any, example_kwargs: Any, input_shape: Any) -> ModelArgs | None:
    """The user's example arguments as :class:`ModelArgs` (None when not given), checked."""
    if example_args is None and not example_kwargs:
        return None
    if example_args is None:
        raise ArgumentError("example_kwargs needs example_args=(x, ...) too: the input batch x comes first")
    if isinstance(example_args, torch.Tensor | np.ndarray):
        example_args = (example_args,)
    if not isinstance(example_args, tuple | list) or not example_args:
        raise ArgumentError(f"example_args must be a tuple of the model's arguments, the input batch first, e.g. "
                            f"example_args=(x, y); got {type(example_args).__name__}")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise ArgumentError(f"example_kwargs must be a dict of keyword arguments, got {type(example_kwargs).__name__}")
    args = [torch.as_tensor(a) if isinstance(a, np.ndarray) else a for a in example_args]
    x = args[0]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2:
        raise ArgumentError("example_args[0] must be a batch of inputs, a float tensor (batch, *input_shape); got "
                            f"{type(x).__name__}{tuple(x.shape) if isinstance(x, torch.Tensor) else ''}")
    if input_shape is not None:
        shape = (int(input_shape),) if isinstance(input_shape, numbers.Integral) else tuple(input_shape)
        if tuple(x.shape[1:]) != shape:
            raise InputShapeError(f"example_args[0] has shape {tuple(x.shape)}, but input_shape={shape}: give "
                                  "inputs of that shape with a batch dimension first, or drop input_shape")
    kwargs = {k: torch.as_tensor(v) if isinstance(v, np.ndarray) else v for k, v in (example_kwargs or {}).items()}
    return ModelArgs([x.detach().to(torch.float32), *args[1:]], kwargs, given=True)


def _batched(value: Any, batch: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch


def _rows(t: torch.Tensor, batch: int) -> torch.Tensor:
    """``batch`` rows of ``t`` (repeated if it has fewer)."""
    return t[:batch] if t.shape[0] >= batch else t[torch.arange(batch) % t.shape[0]]


class TracedArgs:
    """How the traced module calls the model: the input ``x``, the batched arguments (further inputs of
    the traced graph), the others as constants."""

    def __init__(self, args: ModelArgs) -> None:
        self.args = args
        n = int(args[0].shape[0])
        self.batched_names: list[str] = []
        self.batched: list[torch.Tensor] = []
        self._positional: list[tuple[str, Any]] = [("input", None)]
        self._keywords: dict[str, tuple[str, Any]] = {}
        for i, value in enumerate(args[1:], start=1):
            self._positional.append(self._slot(value, n, f"example_args[{i}]"))
        for key, value in args.kwargs.items():
            self._keywords[key] = self._slot(value, n, f"example_kwargs[{key!r}]")

    def _slot(self, value: Any, n: int, name: str) -> tuple[str, Any]:
        if _batched(value, n):
            self.batched.append(value)
            self.batched_names.append(name)
            return "batched", len(self.batched) - 1
        return "constant", value

    def inputs(self, batch: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The traced module's inputs at ``batch`` rows: ``(x, batched arguments)``."""
        x = _rows(self.args[0], batch)
        return x, tuple(_rows(t, batch) for t in self.batched)

    def inputs_at(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The traced module's inputs for the input batch ``x``: ``(x, batched arguments resized to it)``."""
        return x, tuple(_rows(t, int(x.shape[0])) for t in self.batched)

    def at(self, x: torch.Tensor) -> ModelArgs:
        """The model's arguments for another input batch ``x`` (the batched arguments resized to it)."""
        return self.call(x, tuple(_rows(t, int(x.shape[0])) for t in self.batched))

    def call(self, x: Any, batched: tuple) -> ModelArgs:
        """The model's arguments with the traced input and batched arguments in place."""

        def value(slot: tuple[str, Any]) -> Any:
            kind, v = slot
            return x if kind == "input" else batched[v] if kind == "batched" else v

        return ModelArgs([value(s) for s in self._positional], {k: value(s) for k, s in self._keywords.items()},
                         self.args.given)

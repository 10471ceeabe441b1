"""Checks of what the user passes to ``convert`` before the model is traced: the model has a
``forward`` to trace, the input shape is known and well formed, and Dropout/BatchNorm are in the mode
that is converted."""
from __future__ import annotations

import numbers
import warnings
from typing import Any

import torch

from ..errors import InputShapeError, TracingError
from .preserve import reachable_modules


def modules_of_function(model: Any) -> list[torch.nn.Module]:
    """The modules a model *function* runs (its bound ``self``, globals, closure): traced in eval mode,
    as the deterministic copy of a model module is."""
    if isinstance(model, torch.nn.Module):
        return []
    return reachable_modules(model)


def first_linear(model: Any) -> str | None:
    """The path of the Linear layer :func:`infer_input_shape` reads the input shape from (None: none)."""
    if not isinstance(model, torch.nn.Module):
        return None
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.modules.conv._ConvNd):
            return None
        if isinstance(module, torch.nn.Linear):
            return path or type(model).__name__
    return None


def infer_input_shape(model: torch.nn.Module) -> tuple[int, ...]:
    """The input shape fixed by the model's first layer, if that is a Linear layer."""
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            return (int(module.in_features),)
        if isinstance(module, torch.nn.modules.conv._ConvNd):
            kind = next(c.__name__ for c in type(module).__mro__ if c.__module__.startswith("torch.nn"))
            raise InputShapeError(
                f"the first layer '{path}' is a convolution ({kind}); its input size is not fixed "
                "by its weights. Pass input_shape=(channels, height, width) to convert()."
            )
    raise InputShapeError(
        "cannot infer the input shape from the model (no Linear first layer found). "
        "Pass input_shape=(...) without the batch dimension to convert()."
    )


def check_has_forward(model: Any) -> None:
    """A module whose Pyro model is a method (``bnn.model``) has no network to trace as ``forward``."""
    if isinstance(model, torch.nn.Module) and type(model).forward is torch.nn.Module.forward:
        methods = [name for name in ("model", "guide") if callable(getattr(model, name, None))]
        hint = f" (it has {', '.join(f'.{m}()' for m in methods)})" if methods else ""
        raise TracingError(
            f"the model {type(model).__name__} has no forward(){hint}: convert() runs the Pyro model, so pass "
            f"the method that is the model, e.g. convert(obj.model, obj.guide, input_shape=...), or give "
            f"{type(model).__name__} a forward(x) that runs the network and the likelihood.")


def checked_input_shape(model: Any, input_shape: tuple[int, ...] | None) -> tuple[int, ...]:
    if not isinstance(model, torch.nn.Module) and not callable(model):
        raise TracingError(
            f"convert() needs the model as a torch.nn.Module (e.g. a PyroModule) or a Pyro model function, "
            f"got {type(model).__name__}.")
    if input_shape is None:
        if not isinstance(model, torch.nn.Module):
            raise InputShapeError(f"the model {getattr(model, '__name__', model)!r} is a function: pass "
                                  "input_shape=(...) (one input, without the batch dimension) to convert().")
        input_shape = infer_input_shape(model)
    if isinstance(input_shape, numbers.Integral) and not isinstance(input_shape, bool):
        input_shape = (int(input_shape),)  # one feature dimension
    if isinstance(input_shape, str | bytes) or not isinstance(input_shape, tuple | list | torch.Size) or not all(
            isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in input_shape):
        raise InputShapeError(f"input_shape must be a tuple of positive ints without the batch dimension, e.g. "
                              f"(784,) or (1, 28, 28); got {input_shape!r}")
    shape = tuple(int(d) for d in input_shape)
    if not shape or any(d <= 0 for d in shape):
        raise InputShapeError(f"input_shape must be positive sizes without the batch, got {shape}")
    return shape


_TRAIN_DIFFERS = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._BatchNorm)


def warn_train_mode(model: Any) -> None:
    """PFP converts eval semantics (Dropout off, BatchNorm with its running statistics); say so when
    the model is left in train mode, where these layers compute something else."""
    if isinstance(model, torch.nn.Module):
        training = [path or type(model).__name__ for path, m in model.named_modules()
                    if m.training and isinstance(m, _TRAIN_DIFFERS)]
    else:  # a model function: the modules it runs
        training = [type(m).__name__ for m in modules_of_function(model)
                    if m.training and isinstance(m, _TRAIN_DIFFERS)]
    if training:
        warnings.warn(f"the model is in train mode ({', '.join(training[:4])}{' …' if len(training) > 4 else ''}): "
                      "converted with eval semantics (Dropout off, BatchNorm with its running statistics). "
                      "Call model.eval() before convert() to make this explicit.", stacklevel=4)

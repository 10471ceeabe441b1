"""TE kernels of ``concat`` (``torch.cat`` / ``torch.stack`` of branches) with its default CPU schedule
(elementwise), and its shared-factor rule ``sf_concat``.  (The op definition, converters, reference
and ONNX export: ``pyro2pfp/ops/concat.py``.)

Each output element reads the one input that holds it (``if_then_else`` on the joined axis, so no
input is read out of its bounds); mean and variance are one loop nest, a deterministic input's
variance is 0 and the layer's epilogue gives the representation the plan asks for."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tvm import te, tirx

from ....planning.graph import Repr
from ....planning.plan import PlannedLayer
from ....planning.registry import shared_kernel
from ..emit import EmitContext, RelaxActivation, activation_out, epilogue, kernel, variance_of
from ..schedules import schedule
from ..shared_factor import SharedRelax, SharedStep, emit_part, f32, widened_column
from ..shared_factor_schedule import schedule_shared
from .activation import schedule_elementwise

Reader = Callable[[tuple[Any, ...]], Any]
"""``index ↦ element`` of one input of a concatenation."""


def _zero(index: tuple[Any, ...]) -> Any:
    return f32(0.0)


def _element(t: te.Tensor) -> Reader:
    return lambda index: t[index]


def joined(index: tuple[Any, ...], axis: int, sizes: Sequence[int], readers: Sequence[Reader]) -> Any:
    """The element at ``index`` (batch first) of the concatenation along ``axis`` (batch excluded) of
    inputs of ``sizes`` along it, ``readers[i](index in input i)`` giving input ``i``'s element."""
    pos = axis + 1
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    value = None
    for i in reversed(range(len(sizes))):
        here = readers[i]((*index[:pos], index[pos] - offsets[i], *index[pos + 1:]))
        value = here if value is None else tirx.if_then_else(index[pos] < offsets[i] + sizes[i], here, value)
    return value


def _columns(g: te.Tensor) -> Reader:
    """``(b, r, f) ↦ g[b, r, f]``, 0 for ``f`` beyond ``g``'s columns (widened to the output's ``K``)."""
    column = widened_column(g)
    return lambda index: column(*index)


@kernel("concat")
def concat(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    """Means and variances side by side (``ops/concat.py``)."""
    axis = layer.layer.attrs["axis"]
    sizes = [int(ctx.shapes[name][axis]) for name in layer.inputs]
    counts = [len(x.tensors()) for x in inputs]

    def fn(*ts: te.Tensor) -> Any:
        out_shape = (ts[0].shape[0], *layer.layer.out_shape)
        groups, start = [], 0
        for n in counts:
            groups.append(ts[start:start + n])
            start += n
        means = [_element(g[0]) for g in groups]
        if layer.out_repr is Repr.DETERMINISTIC:
            return te.compute(out_shape, lambda *i: joined(i, axis, sizes, means), name="concat")

        def var(g: tuple[te.Tensor, ...], r: Repr) -> Reader:
            if r is Repr.DETERMINISTIC:
                return _zero
            return lambda i: variance_of(g[0][i], g[1][i], r)

        variances = [var(g, x.repr) for g, x in zip(groups, inputs, strict=True)]
        return te.compute(out_shape, lambda *i: epilogue(joined(i, axis, sizes, means),
                                                         joined(i, axis, sizes, variances), layer), name="concat")

    args = [t for x in inputs for t in x.tensors()]
    return activation_out(ctx.emit_te(fn, args, layer), layer)


schedule("concat")(schedule_elementwise)


# ------------------------------------------------------------------ shared-factor rule
@shared_kernel("concat")
def concat_shared_kernel(step: SharedStep, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                         shared: list[SharedRelax | None], out: RelaxActivation
                         ) -> tuple[SharedRelax | None, RelaxActivation]:
    """:func:`pyro2pfp.ops.concat.concat_shared` as one kernel ``sf_concat``: the profiles and the
    loadings (widened with zero columns to the output's ``K``) joined along the rows."""
    k = step.fp.width[layer.name]
    rows = [int(ctx.shapes[name][0]) for name in layer.inputs]
    with_part = [sh is not None for sh in shared]
    args = [t for sh in shared if sh is not None for t in (sh.s, sh.g)]

    def fn(*ts: te.Tensor) -> list[te.Tensor]:
        batch = ts[0].shape[0]
        s_read: list[Reader] = []
        g_read: list[Reader] = []
        it = iter(ts)
        for present in with_part:
            if not present:
                s_read.append(_zero)
                g_read.append(_zero)
                continue
            s_t, g_t = next(it), next(it)
            s_read.append(_element(s_t))
            g_read.append(_columns(g_t))
        s = te.compute((batch, *layer.layer.out_shape), lambda *i: joined(i, 0, rows, s_read), name="s")
        g = te.compute((batch, sum(rows), k), lambda *i: joined(i, 0, rows, g_read), name="g")
        return [s, g]

    s, g = emit_part(ctx, fn, args, layer, "concat")
    return SharedRelax(s, g, k), out


schedule("sf_concat")(schedule_shared)

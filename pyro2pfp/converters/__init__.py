"""Stage 2: walk the exported torch graph and build the :class:`~pyro2pfp.graph.LayerGraph`.

One walk over the nodes the output depends on, in graph order; each ``call_function`` node is
dispatched by its op name (``"aten.linear.default"``) to a converter registered with
:func:`register`.  A converter returns a :class:`~pyro2pfp.graph.Layer`, or :class:`Alias` when the
node is the identity on one of its inputs (dropout at inference, ``contiguous``, …).
One small module per op family registers its converters (``linear``, ``conv``, ``activation``,
``pooling``, ``shape``).
"""
from . import activation, arithmetic, conv, linear, normalization, pooling, shape  # noqa: F401,E501
from ._registry import CONVERTERS, PRODUCES, Alias, register, supported_ops
from ._walk import ConversionContext, build_layer_graph

__all__ = ["CONVERTERS", "PRODUCES", "Alias", "ConversionContext", "build_layer_graph", "register", "supported_ops"]

"""Which ReLUs are computed in their producer's kernel (the producer's epilogue)."""
from __future__ import annotations

from collections import Counter

from ...planning.graph import Repr
from ...planning.plan import PlannedGraph, PlannedLayer

FUSABLE_PRODUCERS = ("dense", "add")
"""Kernels whose epilogue also computes a following ReLU's moments: dense, and the residual ``add``
(an elementwise pass either way: fused, the block's last ReLU costs no kernel launch and no extra
pass over the tensor pair).  Not conv2d: its
epilogue tile (one output row of a channel block) runs slower with the ReLU in it than the two kernels
do (``benchmarks/kernel_profile.py``)."""


def fused_activations(graph: PlannedGraph) -> dict[str, PlannedLayer]:
    """``{compute layer name: ReLU layer}`` for every ReLU whose input is a layer of
    :data:`FUSABLE_PRODUCERS` that feeds nothing else (and is not the output), both edges carrying
    variances: the compute kernel's epilogue then evaluates the ReLU moments on its (mean,
    variance) tile while it is in registers -- one kernel launch, one tensor pair and one memory
    pass fewer per ReLU."""
    by_name = {p.name: p for p in graph.layers}
    uses = Counter(name for p in graph.layers for name in p.inputs)
    out = {}
    for p in graph.layers:
        producer = by_name.get(p.inputs[0]) if p.op == "relu" and len(p.inputs) == 1 else None
        if (producer is not None and producer.op in FUSABLE_PRODUCERS and uses[producer.name] == 1
                and producer.name != graph.output and producer.out_repr is Repr.VARIANCE
                and p.in_reprs[0] is Repr.VARIANCE):
            out[producer.name] = p
    return out

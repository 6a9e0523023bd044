"""The layer-level dataflow of a captured graph (:class:`~hetplan.ir.dataflow.LayerDataflow`).

Read from the same graph edges as the IR's ``act_in_bytes`` / ``act_out_bytes``
(:func:`~hetplan.ir.capture.assemble._activation_bytes`), but kept per tensor: which layer
produced it (-1: a model input) and which other layers read it, so a pipeline boundary's
crossing tensors are known (:meth:`~hetplan.ir.dataflow.LayerDataflow.crossing`).
"""

from __future__ import annotations

from hetplan.ir.capture.assemble import _tensor_bytes
from hetplan.ir.capture.execute import Executor
from hetplan.ir.capture.trace import Graph
from hetplan.ir.dataflow import FlowTensor, LayerDataflow

__all__ = ["layer_dataflow"]


def layer_dataflow(graph: Graph, ex: Executor) -> LayerDataflow:
    """Every tensor one layer (or the model's inputs) hands to another, with its bytes."""
    index = {inv: i for i, (inv, _) in enumerate(graph.invocations)}
    layer_of = ex.exec_layer
    out = []
    for node in graph.gm.graph.nodes:
        if node.op in ("get_attr", "output"):
            continue
        size = _tensor_bytes(ex.values.get(node))
        if size == 0:
            continue
        src = layer_of.get(node)
        consumers = sorted({index[d] for d in (layer_of.get(u) for u in node.users)
                            if d is not None and d != src})
        if consumers:
            out.append(FlowTensor(node.name, index[src] if src is not None else -1,
                                  tuple(consumers), size))
    return LayerDataflow.from_edges(len(graph.invocations), out)

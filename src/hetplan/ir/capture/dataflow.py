"""The layer-level dataflow of a captured graph (:class:`~hetplan.ir.dataflow.LayerDataflow`).

Read from the same graph edges as the IR's ``act_in_bytes`` / ``act_out_bytes``
(:func:`~hetplan.ir.capture.assemble._activation_bytes`), but kept per tensor: which layer
produced it (-1: a model input) and which other layers read it, so a pipeline boundary's
crossing tensors are known (:meth:`~hetplan.ir.dataflow.LayerDataflow.crossing`).

:func:`boundary_fields` turns it into the IR's per-layer boundary fields: the bytes a
pipeline boundary after each layer cuts (``LayerIR.cut_bytes_after``) and whether a stage may
start at each layer (``LayerIR.cuttable_before``: the runtime splits the model right before a
module call, so the layer must be a module called exactly once).
"""

from __future__ import annotations

from hetplan.ir.capture.assemble import _tensor_bytes
from hetplan.ir.capture.execute import Executor
from hetplan.ir.capture.trace import Graph
from hetplan.ir.dataflow import FlowTensor, LayerDataflow

__all__ = ["layer_dataflow", "boundary_fields"]


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


def boundary_fields(graph: Graph, ex: Executor,
                    act_out: dict[str, int]) -> tuple[list[int], list[bool]]:
    """Per layer (invocation order): the bytes a pipeline boundary right after it cuts, and
    whether a stage may start at it.

    The last layer has no boundary after it: its entry is its ``act_out`` bytes. A layer is
    cuttable when it runs compute nodes of its own (it is called as a module; a layer seen
    only through ``get_attr`` of its parameters is read by glue code) and its module is
    called once (no ``name@k`` invocation shares it). The first layer is always cuttable.
    """
    invs = [inv for inv, _ in graph.invocations]
    cut = list(layer_dataflow(graph, ex).boundary_bytes())
    cut.append(act_out.get(invs[-1], 0) if invs else 0)
    called = {inv for node, inv in graph.node_layer.items() if node.op != "get_attr"}
    calls: dict[str, int] = {}
    for _, unit in graph.invocations:
        calls[unit] = calls.get(unit, 0) + 1
    ok = [i == 0 or (inv in called and calls[unit] == 1)
          for i, (inv, unit) in enumerate(graph.invocations)]
    return cut, ok

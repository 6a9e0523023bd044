"""The model's dataflow between layers, as a graph (networkx), for models that are not a
chain (encoder-decoder, skip connections).

A pipeline boundary before layer ``b`` cuts every tensor produced before ``b`` (by a layer
of index ``< b``, or a model input) and consumed at or after ``b``: all of them must be sent
to the later stages, not only the output of layer ``b - 1``. In a chain they are the same;
in T5 the encoder's output and the attention masks and position biases cross every decoder
boundary, and a residual shortcut crosses every boundary inside its block.

:class:`LayerDataflow` holds the tensors (:class:`FlowTensor`: producer, consumers, bytes)
and builds a ``networkx.MultiDiGraph`` of them: nodes are layer indices and ``"input"``,
one edge per (tensor, consumer) keyed by the tensor's name. A boundary's crossing tensors
are ``networkx.edge_boundary`` of the layers before it against the layers from it on
(:meth:`LayerDataflow.crossing`); the capture verifies the layer order against the graph
(:meth:`LayerDataflow.backward_edges`: no layer may consume a later layer's tensor, so every
boundary of the order is a valid cut).

Built by the capture (:func:`hetplan.ir.capture.capture_dataflow`); pure, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a graph is built: every capture imports this module
    import networkx as nx

__all__ = ["FlowTensor", "LayerDataflow", "INPUT"]

#: The graph node of the model's inputs (tensors no layer produced).
INPUT = "input"


@dataclass(frozen=True)
class FlowTensor:
    """A tensor passed between layers.

    Attributes:
        name: the graph node that produced it (unique within a capture).
        producer: index of the producing layer; -1 for a model input or a tensor made
            outside every layer before the first.
        consumers: indices of the other layers that read it, ascending.
        size_bytes: its size at the captured micro-batch.
    """

    name: str
    producer: int
    consumers: tuple[int, ...]
    size_bytes: int


@dataclass(frozen=True)
class LayerDataflow:
    """Tensors between the ``num_layers`` layers of a model (see the module docstring)."""

    num_layers: int
    tensors: tuple[FlowTensor, ...]

    def graph(self) -> nx.MultiDiGraph:
        """Nodes: ``"input"`` and ``0 .. num_layers - 1``; an edge ``producer -> consumer``
        per tensor and consumer, key = the tensor's name, attribute ``size_bytes``."""
        import networkx as nx

        g = nx.MultiDiGraph()
        g.add_node(INPUT)
        g.add_nodes_from(range(self.num_layers))
        for t in self.tensors:
            src = INPUT if t.producer < 0 else t.producer
            for c in t.consumers:
                g.add_edge(src, c, key=t.name, size_bytes=t.size_bytes)
        return g

    def backward_edges(self) -> list[tuple[int, int, str]]:
        """Edges ``(producer, consumer, tensor)`` against the layer order (a layer reading a
        later layer's tensor); empty for a valid capture."""
        return sorted((u, v, k) for u, v, k in self.graph().edges(keys=True)
                      if u != INPUT and v <= u)

    def crossing(self, boundary: int, graph: nx.MultiDiGraph | None = None
                 ) -> tuple[FlowTensor, ...]:
        """The tensors a pipeline boundary before layer ``boundary`` cuts (each once, in
        name order): produced before it, read at or after it."""
        import networkx as nx

        g = self.graph() if graph is None else graph
        before: list[object] = [INPUT, *range(boundary)]
        after = range(boundary, self.num_layers)
        names = {k for _, _, k in nx.edge_boundary(g, before, after, keys=True)}
        return tuple(sorted((t for t in self.tensors if t.name in names),
                            key=lambda t: t.name))

    def boundary_bytes(self) -> tuple[int, ...]:
        """Per boundary ``1 .. num_layers - 1``, the bytes of the tensors it cuts."""
        g = self.graph()
        return tuple(sum(t.size_bytes for t in self.crossing(b, g))
                     for b in range(1, self.num_layers))

    def is_chain(self) -> bool:
        """True when every boundary cuts only tensors of the layer just before it."""
        g = self.graph()
        return all(t.producer == b - 1 for b in range(1, self.num_layers)
                   for t in self.crossing(b, g))

    @classmethod
    def from_edges(cls, num_layers: int, tensors: Iterable[FlowTensor]) -> LayerDataflow:
        """Tensors sorted by (producer, name), so equal captures compare equal."""
        return cls(num_layers, tuple(sorted(tensors, key=lambda t: (t.producer, t.name))))

"""The layer dataflow graph (:mod:`hetplan.ir.dataflow`, networkx): a pipeline boundary cuts
every tensor produced before it and read after it, not only the previous layer's output.
Checked on a toy skip connection and on T5 (encoder-decoder) against the send list that
``torch.distributed.pipelining`` builds for the same split (what the runtime sends)."""

from __future__ import annotations

import pytest

from hetplan.ir.dataflow import FlowTensor, LayerDataflow


def _skip() -> LayerDataflow:
    """0 -> 1 -> 2 -> 3, plus a shortcut 0 -> 3 and a model input read by layer 2."""
    return LayerDataflow.from_edges(4, [
        FlowTensor("a0", 0, (1, 3), 100), FlowTensor("a1", 1, (2,), 10),
        FlowTensor("a2", 2, (3,), 20), FlowTensor("ids", -1, (0, 2), 8)])


def test_a_cut_inside_a_skip_connection_sends_the_skipped_tensor() -> None:
    flow = _skip()
    assert [t.name for t in flow.crossing(1)] == ["a0", "ids"]
    assert [t.name for t in flow.crossing(2)] == ["a0", "a1", "ids"]
    assert [t.name for t in flow.crossing(3)] == ["a0", "a2"]
    assert flow.boundary_bytes() == (108, 118, 120)  # a chain would send 100, 10, 20
    assert not flow.is_chain() and flow.backward_edges() == []


def test_a_chain_is_a_chain_and_a_backward_edge_is_found() -> None:
    chain = LayerDataflow.from_edges(3, [FlowTensor("a0", 0, (1,), 4),
                                         FlowTensor("a1", 1, (2,), 4)])
    assert chain.is_chain() and chain.boundary_bytes() == (4, 4)
    bad = LayerDataflow.from_edges(3, [FlowTensor("a2", 2, (1,), 4)])
    assert bad.backward_edges() == [(2, 1, "a2")]


@pytest.fixture(scope="module")
def t5() -> tuple[object, tuple, dict, LayerDataflow, list[str], list[int]]:
    from hetplan import zoo
    from hetplan.ir.capture import capture, capture_dataflow

    args, kwargs = zoo.example_inputs("tiny-t5", batch=2)
    model = zoo.build("tiny-t5")
    ir = capture(model, args, kwargs, name="tiny-t5", reuse_blocks=False)
    flow = capture_dataflow(model, args, kwargs)
    return model, args, kwargs, flow, [x.name for x in ir.layers], \
        [x.act_out_bytes for x in ir.layers]


@pytest.mark.parametrize("layer", ["decoder.block.1", "decoder.final_layer_norm"])
def test_t5_boundary_sends_what_torch_pipelining_sends(t5: tuple, layer: str) -> None:
    """A two-stage split of T5 before a decoder layer: the tensors the dataflow graph says
    the boundary cuts are exactly the later stage's inputs in torch's split (the runtime's
    send list), by name and bytes; none is dropped. Before decoder.block.1 that includes
    the encoder's output, the masks and position biases: more than the previous layer's
    ``act_out_bytes`` that a chain model would price."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    from hetplan import zoo

    _, args, kwargs, flow, names, act_out = t5
    b = names.index(layer)
    # a fresh model: pipeline() leaves its split hooks on the modules it was given
    pipe = pipeline(zoo.build("tiny-t5"), mb_args=args, mb_kwargs=kwargs,
                    split_spec={layer: SplitPoint.BEGINNING})
    subs = dict(pipe.split_gm.named_children())
    assert len(subs) == 2
    later = subs["submod_pp_1"]
    sent = {n.name: n.meta["val"] for n in later.graph.nodes if n.op == "placeholder"}
    cut = {t.name: t.size_bytes for t in flow.crossing(b)}
    assert set(cut) == set(sent)
    assert all(cut[k] == v.numel() * v.element_size() for k, v in sent.items())
    if layer == "decoder.block.1":
        assert "dropout_7" in cut  # the encoder's output crosses every decoder boundary
        assert sum(cut.values()) == 17408 > act_out[b - 1] == 13312


def test_t5_boundary_after_glue_differs_by_the_glue(t5: tuple) -> None:
    """Before decoder.block.0, glue in T5's forward (the embedding's dropout, the mask
    expansion) runs between the two layers. The IR attributes glue to the next layer, torch
    places it in the earlier stage: torch sends the glue's outputs where the dataflow graph
    has its input. The encoder's output crosses in both; nothing else is lost."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    from hetplan import zoo

    _, args, kwargs, flow, names, _ = t5
    pipe = pipeline(zoo.build("tiny-t5"), mb_args=args, mb_kwargs=kwargs,
                    split_spec={"decoder.block.0": SplitPoint.BEGINNING})
    later = dict(pipe.split_gm.named_children())["submod_pp_1"]
    sent = {n.name for n in later.graph.nodes if n.op == "placeholder"}
    cut = {t.name for t in flow.crossing(names.index("decoder.block.0"))}
    assert cut & sent == {"dropout_7"}
    assert cut - sent == {"embedding_2"}  # the decoder's embedding, before the glue
    assert sent - cut == {"dropout_8", "expand_1", "expand_2"}  # the glue's outputs

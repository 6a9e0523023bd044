"""What the engines' fused blocks keep (``cost_models/engine_memory.py``) and the loss of a
vocabulary-parallel head, against hand-computed byte counts and Korthikanti et al. 2022."""

from __future__ import annotations

import pytest
import torch

import hetplan

from hetplan.cost_models.compute import workload_tokens
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.engine_memory import engine_layer, tied_head_copy, vocab_layers
from hetplan.cost_models.hetero import _rank_param_bytes
from hetplan.cost_models.kernels import bias_grad_bytes
from hetplan.cost_models.predict import resolve_cluster
from hetplan.cost_models.rank_memory import stage_precision
from hetplan.cost_models.stage_times import shard_bytes, tied_sync_s, vocab_comm_s
from hetplan.cost_models.memory import MIXED, capture_bytes, layer_activations, loss_activations
from hetplan.ir.capture import capture
from hetplan.ir.cluster import ClusterSpec
from hetplan.ir.model import ModelIR
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import LayerCost, WorkloadSummary
from hetplan.zoo.builders import hf


def _capture(config_cls: str, model_cls: str, seq: int, batch: int,
             **cfg: object) -> WorkloadSummary:
    with torch.device("meta"):
        model = hf(config_cls, model_cls, **cfg)()
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return WorkloadSummary.from_model_ir(capture(model, (ids,), {"use_cache": False}))


@pytest.fixture(scope="module")
def gpt2() -> tuple[WorkloadSummary, LayerCost]:
    s, b, h, a = 256, 2, 512, 8
    wl = _capture("GPT2Config", "GPT2LMHeadModel", s, b, vocab_size=1000, n_positions=s,
                  n_embd=h, n_layer=3, n_head=a)
    blocks = [x for x in wl.layers if x.kind == "block"]
    return wl, blocks[1]


def korthikanti(s: int, b: int, h: int, a: int, t: int, mode: str, sp: bool) -> float:
    """Bytes per layer at 16 bits, Table 2 of the paper."""
    sbh, core = s * b * h, 5 * a * s / h
    if mode == "full":
        return 2 * sbh / (t if sp else 1)
    if sp:
        return sbh / t * (34 + (core if mode == "none" else 0))
    return sbh * (10 + 24 / t + (core / t if mode == "none" else 0))


def test_decomposed_gpt2_block_keeps_more_than_the_fused_engine(
        gpt2: tuple[WorkloadSummary, LayerCost]) -> None:
    wl, lay = gpt2
    # the captured (eager, decomposed) block keeps well over the paper's 34 s*b*h without
    # its core; the engine's view is what the paper counts
    sbh2 = 256 * 2 * 512 * 2
    captured = layer_activations(lay, "selective", precision=MIXED)
    assert captured / sbh2 > 40 / 2
    fused = engine_layer(lay, workload_tokens(wl), capture_bytes(wl), "materialized")
    assert layer_activations(fused, "selective", precision=MIXED) == pytest.approx(
        34 * sbh2 / 2)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_fused_gpt2_block_is_korthikanti(gpt2: tuple[WorkloadSummary, LayerCost], t: int,
                                         sp: bool, mode: str) -> None:
    wl, lay = gpt2
    fused = engine_layer(lay, workload_tokens(wl), capture_bytes(wl), "materialized")
    model = layer_activations(fused, mode, tp=t, sequence_parallel=sp and t > 1,
                              precision=MIXED)
    assert model == pytest.approx(korthikanti(256, 2, 512, 8, t, mode, sp and t > 1),
                                  rel=1e-9)


def test_flash_attention_keeps_no_scores(gpt2: tuple[WorkloadSummary, LayerCost]) -> None:
    wl, lay = gpt2
    fused = engine_layer(lay, workload_tokens(wl), capture_bytes(wl), "flash")
    assert fused.act_attn_core_bytes == 0
    none = layer_activations(fused, "none", precision=MIXED)
    assert none == pytest.approx(34 * 256 * 2 * 512)


def test_fused_llama_block_by_hand() -> None:
    # gated MLP, grouped-query attention, no dropout: per token at 2 bytes,
    # 4h (norm inputs, QKV and MLP inputs) + (h + 2 kv + h) + 3 f, times 2 bytes
    s, b, h, f, kv = 128, 1, 256, 688, 64
    wl = _capture("LlamaConfig", "LlamaForCausalLM", s, b, vocab_size=1000, hidden_size=h,
                  intermediate_size=f, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=s)
    lay = [x for x in wl.layers if x.kind == "block"][1]  # the first takes no mask input
    fused = engine_layer(lay, workload_tokens(wl), capture_bytes(wl), "flash")
    tokens = s * b
    assert fused.act_saved_bytes == 4 * (4 * h + (h + 2 * kv + h) + 3 * f) * tokens
    assert fused.act_replicated_bytes == 4 * 4 * h * tokens  # captured in fp32
    assert fused.act_saved_nonfloat_bytes == 0 and fused.act_attn_core_bytes == 0
    assert fused.act_in_bytes == 4 * h * tokens
    # the captured block keeps more: fp32 norm copies, the causal mask as every layer's input
    assert lay.act_saved_bytes > fused.act_saved_bytes
    assert lay.act_in_bytes > fused.act_in_bytes


def test_layers_that_are_not_blocks_or_norms_are_unchanged(
        gpt2: tuple[WorkloadSummary, LayerCost]) -> None:
    wl, _ = gpt2
    others = [x for x in wl.layers if x.kind not in ("block", "norm")]
    assert others
    for x in others:
        assert engine_layer(x, workload_tokens(wl), capture_bytes(wl), "flash") is x
    # GPT-2's final layer norm keeps its fp32 input (and statistics, not counted)
    ln_f = next(x for x in wl.layers if x.kind == "norm")
    fused = engine_layer(ln_f, workload_tokens(wl), capture_bytes(wl), "flash")
    assert fused.act_saved_bytes == ln_f.act_in_bytes == 256 * 2 * 512 * 4


def test_cost_model_counts_fused_blocks_only_when_asked(
        gpt2: tuple[WorkloadSummary, LayerCost]) -> None:
    wl, lay = gpt2
    plain = CostModel(_cluster(), fusion="none")
    fused = CostModel(_cluster(), fusion="fused", attention="materialized")
    assert plain.memory_layers(wl) is wl.layers
    layers = fused.memory_layers(wl)
    assert layers is fused.memory_layers(wl)  # memoised
    k = wl.layers.index(lay)
    assert layers[k].act_saved_bytes < lay.act_saved_bytes


def _cluster() -> ClusterSpec:
    return resolve_cluster("a100-nvlink-8x8")


def test_vocab_parallel_loss_by_hand() -> None:
    head = LayerCost(name="lm_head", kind="head", act_out_bytes=4 * 8 * 1000)  # 8 tokens
    elems = 8 * 1000
    assert loss_activations(head, 4) == (8 * elems, 8 * elems)
    held, transient = loss_activations(head, 4, vocab_tp=4)
    assert (held, transient) == (4 * elems / 4, 8 * elems / 4)
    assert loss_activations(head, 4, micro_batch_scale=2, vocab_tp=2) == (
        4 * 2 * elems / 2, 8 * 2 * elems / 2)


# -- the vocabulary: a vocabulary-parallel head and a head tied across pipeline stages -------
def test_vocab_layers_split_the_head_and_its_embedding_only(
        gpt2: tuple[WorkloadSummary, LayerCost]) -> None:
    wl, _ = gpt2
    split = vocab_layers(wl.layers, capture_bytes(wl))
    by_name = {x.name: x for x in split}
    assert by_name["transformer.wte"].tp_split_bytes == 1000 * 512 * 4  # V x h, fp32
    assert by_name["transformer.wpe"].tp_split_bytes == 0  # positions are not vocabulary
    for old, new in zip(wl.layers, split):
        if old.name != "transformer.wte":
            assert new == old


def test_tied_head_copy(gpt2: tuple[WorkloadSummary, LayerCost]) -> None:
    wl, _ = gpt2
    table, copy = tied_head_copy(wl.layers, 4, True)  # type: ignore[misc]
    assert wl.layers[table].name == "transformer.wte"
    assert copy.param_bytes == copy.tp_split_bytes == 1000 * 512 * 4
    assert tied_head_copy(wl.layers, 4, False)[1].tp_split_bytes == 0  # type: ignore[index]
    # an untied head has parameters of its own: no copy
    untied = wl.layers[:-1] + (wl.layers[-1].model_copy(update={"param_bytes": 1000 * 512 * 4}),)
    assert tied_head_copy(untied, 4, True) is None


TIED_S, TIED_H, TIED_V = 128, 256, 4096


def _tied_gpt2() -> ModelIR:
    """A tied GPT-2 (4 blocks, h 256, vocabulary 4096) captured on the meta device."""
    s, h, v = TIED_S, TIED_H, TIED_V
    with torch.device("meta"):
        model = hf("GPT2Config", "GPT2LMHeadModel", vocab_size=v, n_positions=s, n_embd=h,
                   n_layer=4, n_head=4)()
    return capture(model, (torch.zeros(1, s, dtype=torch.long, device="meta"),),
                   {"use_cache": False})


def _tied_plan(ir: ModelIR, pp: int = 2) -> Plan:
    """``ir`` on ``a100-nvlink-8x8`` (64 GPUs) at tp 2 with a vocabulary-parallel head."""
    return hetplan.compile(ir, "a100-nvlink-8x8", batch_size=64, dp=32 // pp, pp=pp, tp=2,
                           dtype="bf16", vocab_parallel=True, passes="uniform-stages")


def test_last_stage_holds_the_tied_copy_split_over_tp() -> None:
    h, v = TIED_H, TIED_V
    ir = _tied_gpt2()
    plan = _tied_plan(ir)
    wl = plan.model.workload
    assert wl is not None
    last = plan.stages[-1]
    mine = wl.layers[last.first_layer:last.last_layer + 1]
    assert mine[-1].kind == "head" and all(x.name != "transformer.wte" for x in mine)
    # elements on one TP rank: the stage's own (Megatron-split parts halved) + V x h / 2
    elems = sum((x.param_bytes - x.tp_split_bytes + x.tp_split_bytes / 2) / 4 for x in mine)
    elems += v * h / 2
    rank = last.ranks[0]
    assert plan.predictions.memory_breakdown[rank].params == int(2 * elems)  # bf16 weights
    first = plan.stages[0]
    mine0 = wl.layers[first.first_layer:first.last_layer + 1]
    elems0 = sum((x.param_bytes - x.tp_split_bytes + x.tp_split_bytes / 2) / 4
                 for x in mine0 if x.name != "transformer.wte") + v * h / 2
    assert plan.predictions.memory_breakdown[first.ranks[0]].params == int(2 * elems0)


def test_tp_divisor_splits_the_head_only_when_vocabulary_parallel(
        gpt2: tuple[WorkloadSummary, LayerCost]) -> None:
    # the stage balancers and lower bounds divide a layer's single-rank time by this: a
    # vocabulary-parallel head runs 1/tp of its products on each rank (as kernel_times
    # prices it), a replicated one all of them
    wl, block = gpt2
    head = wl.layers[-1]
    plain = CostModel(_cluster()).compute
    vocab = CostModel(_cluster(), vocab_parallel=True).compute
    assert (plain.tp_divisor(head, 4), vocab.tp_divisor(head, 4)) == (1, 4)
    assert plain.tp_divisor(block, 4) == vocab.tp_divisor(block, 4) == 4
    assert vocab.tp_divisor(head, 1) == 1
    norm = next(x for x in wl.layers if x.kind == "norm")
    assert vocab.tp_divisor(norm, 4) == 1


def test_vocab_parallel_embedding_gradient_is_split_over_tp(
        gpt2: tuple[WorkloadSummary, LayerCost]) -> None:
    # each TP rank of a vocabulary-parallel model holds, reduce-scatters, all-reduces and
    # updates V/tp rows of the token embedding (Megatron-LM's VocabParallelEmbedding, the
    # runtime's shard_vocab): the gradient bytes the sync and the optimizer step price
    wl, _ = gpt2
    k = next(i for i, x in enumerate(wl.layers) if x.name == "transformer.wte")
    table = 1000 * 512 * 4  # V x h, fp32
    vocab = CostModel(_cluster(), vocab_parallel=True).memory_layers(wl)
    plain = CostModel(_cluster()).memory_layers(wl)
    assert shard_bytes(vocab, table, k, 4) == table / 4
    assert shard_bytes(plain, table, k, 4) == table
    assert shard_bytes(vocab, table, k, 1) == table
    pos = next(i for i, x in enumerate(wl.layers) if x.name == "transformer.wpe")
    assert shard_bytes(vocab, wl.layers[pos].param_bytes, pos, 4) == wl.layers[pos].param_bytes
    # the heterogeneous search's per-stage tables count the same bytes
    assert _rank_param_bytes(vocab, 4)[k] == table / 4
    assert _rank_param_bytes(plain, 4)[k] == table


def test_bias_gradients_read_off_captured_blocks(
        gpt2: tuple[WorkloadSummary, LayerCost]) -> None:
    # a captured Hugging Face GPT-2 block carries a bias on each of its four linears, a Llama
    # block on none (kernels.bias_grad_bytes decides it from the block's parameters)
    _, block = gpt2
    h = 512
    assert bias_grad_bytes(block, 4) == (2 * h * 4, 7 * h * 4)  # captured in fp32
    wl = _capture("LlamaConfig", "LlamaForCausalLM", 64, 1, vocab_size=1000, hidden_size=256,
                  intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=64)
    llama = [x for x in wl.layers if x.kind == "block"][1]
    assert bias_grad_bytes(llama, 4) == (0.0, 0.0)


def test_tied_embedding_gradient_all_reduce_between_first_and_last_stage() -> None:
    h, v = TIED_H, TIED_V
    ir = _tied_gpt2()
    plan = _tied_plan(ir)
    wl = plan.model.workload
    assert wl is not None
    costs = CostModel(_cluster(), dtype="bf16", vocab_parallel=True)
    first, last = plan.stages[0], plan.stages[1]
    a, b = first.ranks[0], last.ranks[0]
    link = costs.cluster.link_between(a, b)
    # the two stages on different nodes: the 8 ranks of the first stage on a's node send at
    # once through its network; each all-reduces its V/tp rows in bf16 with its peer
    assert costs.devices[a].node_index != costs.devices[b].node_index
    assert sum(costs.devices[r].node_index == costs.devices[a].node_index
               for r in first.ranks) == 8
    expected = costs.comm.time_s("allreduce", v * h / 2 * 2 * 8, 2, link)
    assert tied_sync_s(wl, plan.stages, plan.layout, costs) == pytest.approx(expected)
    assert expected > 0
    # a head that is not vocabulary-parallel all-reduces the whole table
    whole = CostModel(_cluster(), dtype="bf16")
    assert tied_sync_s(wl, plan.stages, plan.layout, whole) == pytest.approx(
        whole.comm.time_s("allreduce", v * h * 2 * 8, 2, link))
    # one stage holds both the embedding and the head: nothing to sum
    one = _tied_plan(ir, pp=1)
    assert tied_sync_s(wl, one.stages, one.layout, costs) == 0.0
    # Chimera: the ranks of the first stage hold the last one too (the up pipeline's), and
    # the runtime sums the two copies in the process
    chimera = plan.layout.model_copy(update={"schedule": "chimera"})
    assert tied_sync_s(wl, plan.stages, chimera, costs) == 0.0


def test_vocab_parallel_collectives_by_hand() -> None:
    s, h, v = 128, 256, 4096
    with torch.device("meta"):
        model = hf("GPT2Config", "GPT2LMHeadModel", vocab_size=v, n_positions=s, n_embd=h,
                   n_layer=4, n_head=4)()
    ir = capture(model, (torch.zeros(1, s, dtype=torch.long, device="meta"),),
                 {"use_cache": False})
    for sp in (False, True):
        plan = hetplan.compile(ir, "a100-nvlink-8x8", batch_size=64, dp=16, pp=2, tp=2,
                               dtype="bf16", vocab_parallel=True, passes="uniform-stages",
                               micro_batch_size=2, sequence_parallel=sp)
        wl = plan.model.workload
        assert wl is not None
        costs = CostModel(_cluster(), dtype="bf16", vocab_parallel=True)
        first, last = plan.stages
        prec = stage_precision(wl, first, costs)
        link = costs.cluster.link_between(first.ranks[0], first.ranks[1])
        t = costs.comm.time_s
        act = 2 * s * h * 2  # micro-batch 2, bf16 hidden states
        # the embedding sums its partial lookups in forward
        emb = t("reduce_scatter" if sp else "allreduce", act, 2, link)
        assert vocab_comm_s(wl, first, plan.layout, costs, 2.0, prec) == pytest.approx(
            (emb, 0.0))
        # the head: its input's gradient summed in backward (SP: gathered in forward and
        # reduce-scattered in backward); the cross-entropy's three fp32 values per token
        ce = 3 * t("allreduce", 4 * 2 * s, 2, link)
        head = ((t("allgather", act, 2, link), t("reduce_scatter", act, 2, link)) if sp
                else (0.0, t("allreduce", act, 2, link)))
        assert vocab_comm_s(wl, last, plan.layout, costs, 2.0, prec) == pytest.approx(
            (head[0] + ce, head[1]))
        # without a vocabulary-parallel head there is none of it
        plain = CostModel(_cluster(), dtype="bf16")
        assert vocab_comm_s(wl, last, plan.layout, plain, 2.0, prec) == (0.0, 0.0)


def test_fused_final_norm_keeps_its_input_only() -> None:
    # a Hugging Face Llama's final RMSNorm keeps fp32 copies; the engine's fused norm keeps
    # its 16-bit input (h x 2 bytes per token at a bf16 capture)
    s, h = 64, 256
    with torch.device("meta"):
        model = hf("LlamaConfig", "LlamaForCausalLM", vocab_size=1000, hidden_size=h,
                   intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=2, max_position_embeddings=s)().to(torch.bfloat16)
    ids = torch.zeros(1, s, dtype=torch.long, device="meta")
    wl = WorkloadSummary.from_model_ir(capture(model, (ids,), {"use_cache": False}))
    norm = next(x for x in wl.layers if x.kind == "norm")
    assert norm.act_saved_bytes > 2 * h * s  # decomposed: more than its input
    fused = engine_layer(norm, workload_tokens(wl), capture_bytes(wl), "flash")
    assert fused.act_saved_bytes == fused.act_replicated_bytes == 2 * h * s
    assert fused.act_saved_nonfloat_bytes == 0

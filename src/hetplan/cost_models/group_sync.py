"""Throughput of a plan's pipeline replicas under each synchronisation policy, over many
iterations with random stragglers (the objective of the ``sdpipe`` pass).

:func:`replica_mesh` turns a plan's layout and stages into the pure simulator's input
(:class:`hetplan.algorithms.sdpipe_sim.ReplicaMesh`):

- replica (j, i) is stage j of pipeline i (data-parallel coordinate i); one SDPipe iteration
  is one replica's mini-batch, all ``layout.micro_batches`` micro-batches of the plan's
  iteration: its forward and backward time is the micro-batch time of its own device (the
  slowest of its TP group) times the micro-batches, so pipelines on slower devices are slower;
- activations cross from stage j to j+1 over the link between pipeline 0's ranks;
- averaging stage j's parameters in a group of s replicas is one all-reduce of the stage's
  parameter bytes over the slowest link among the stage's replicas
  (:class:`~hetplan.cost_models.comm.CommModel`);
- the straggler model is the cluster spec's (:meth:`ClusterSpec.straggler_of`, the worst of
  a TP group), or the one given.

:func:`predict_policies` simulates K iterations of each policy with the same seed (so each
sees the same delays) and returns the results, all-reduce first. Deterministic.
"""

from __future__ import annotations

from hetplan.algorithms.sdpipe import SchedulerConfig
from hetplan.algorithms.sdpipe_sim import ReplicaMesh, SimResult, simulate
from hetplan.cost_models.costs import CostModel
from hetplan.cost_models.stage_times import group_link, recompute_s
from hetplan.ir.plan_sections import Layout, Stage, WorkloadSummary
from hetplan.ir.stragglers import StragglerSpec

__all__ = ["predict_policies", "replica_mesh", "stage_param_bytes", "steady_iteration_s"]


def stage_param_bytes(workload: WorkloadSummary, stage: Stage, tp: int = 1) -> int:
    """Bytes of the parameters stage ``stage`` holds on one rank (TP-sharded layers / tp)."""
    total = 0
    for lay in workload.layers[stage.first_layer : stage.last_layer + 1]:
        total += lay.param_bytes // tp if lay.tp_pairs and tp > 1 else lay.param_bytes
    return total


def replica_mesh(workload: WorkloadSummary, layout: Layout, stages: tuple[Stage, ...],
                 costs: CostModel, *, stragglers: StragglerSpec | None = None
                 ) -> ReplicaMesh:
    """The simulator's mesh for the plan's M = pp stages × N = dp pipelines (see the
    module docstring). ``stragglers`` overrides the cluster spec's model for every device."""
    m, n, tp, mb = layout.pp, layout.dp, layout.tp, layout.micro_batch_size
    if len(stages) != m:
        raise ValueError(f"the plan lists {len(stages)} stages for pp={m} (interleaved "
                         "stages have no replica mesh)")
    fwd = [[0.0] * n for _ in range(m)]
    bwd = [[0.0] * n for _ in range(m)]
    prob = [[0.0] * n for _ in range(m)]
    delay = [[0.0] * n for _ in range(m)]
    cluster = costs.cluster
    for j, st in enumerate(stages):
        layers = workload.layers[st.first_layer : st.last_layer + 1]
        for i in range(n):
            ranks = [layout.rank_of(i, j, t) for t in range(tp)]
            for r in ranks:
                times = costs.compute.layer_times(workload, costs.devices[r], mb)
                f = b = 0.0
                for lay, t in zip(layers, times[st.first_layer : st.last_layer + 1]):
                    lf, lb = t.fwd_s, t.bwd_s
                    if tp > 1 and lay.tp_pairs:
                        lf, lb = lf / tp, lb / tp
                    f += lf
                    b += lb + recompute_s(lay, lf, st.recompute)
                fwd[j][i] = max(fwd[j][i], f * layout.micro_batches)
                bwd[j][i] = max(bwd[j][i], b * layout.micro_batches)
                if stragglers is not None:
                    p, d = stragglers.probability, stragglers.delay_s
                else:
                    p, d = cluster.straggler_of(r)
                if p * d > prob[j][i] * delay[j][i]:
                    prob[j][i], delay[j][i] = p, d
    scale = mb * layout.micro_batches / workload.batch_size
    p2p = []
    for j in range(m - 1):
        a, b_ = layout.rank_of(0, j, 0), layout.rank_of(0, j + 1, 0)
        nbytes = workload.layers[stages[j].last_layer].boundary_bytes * scale / tp
        p2p.append(costs.comm.time_s("p2p", nbytes, 2, cluster.link_between(a, b_)))
    avg = []
    for j, st in enumerate(stages):
        replicas = [layout.rank_of(i, j, 0) for i in range(n)]
        link, _, _ = group_link(costs, replicas)
        nbytes = stage_param_bytes(workload, st, tp)
        avg.append(tuple([0.0, 0.0] + [costs.comm.time_s("allreduce", nbytes, s, link)
                                       for s in range(2, n + 1)]))
    return ReplicaMesh(
        fwd_s=tuple(map(tuple, fwd)), bwd_s=tuple(map(tuple, bwd)), p2p_s=tuple(p2p),
        avg_s=tuple(avg), straggle_prob=tuple(map(tuple, prob)),
        straggle_delay_s=tuple(map(tuple, delay)),
    )


def steady_iteration_s(mesh: ReplicaMesh) -> float:
    """One iteration of the slowest replica without stragglers or synchronisation
    (forward + backward): the time SDPipe's window T is a fraction of."""
    return max(f + b for fr, br in zip(mesh.fwd_s, mesh.bwd_s) for f, b in zip(fr, br))


def predict_policies(mesh: ReplicaMesh, config: SchedulerConfig, iterations: int, seed: int
                     ) -> dict[str, SimResult]:
    """Simulated throughput of ``allreduce``, ``sdpipe`` and ``adpsgd`` (in that order) over
    ``iterations`` iterations with the same straggler delays."""
    return {
        "allreduce": simulate(mesh, "allreduce", iterations, seed=seed),
        "sdpipe": simulate(mesh, "sdpipe", iterations, seed=seed, scheduler=config),
        "adpsgd": simulate(mesh, "adpsgd", iterations, seed=seed),
    }

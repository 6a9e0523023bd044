"""Make ``docs/timeline-gpt2.png``: the simulated iteration of a compressed, bucketed GPT-2 plan.

Compiles GPT-2 (zoo) for the ``v100-pcie-8x8`` preset at batch 64 with ``pp=1``, then edits
the plan's gradient sync by hand: gradients (in backward-ready order) are packed into buckets
of whole layers up to 64 MiB; buckets of at least 4 MiB use DGC (1 % of the elements) compressed
on the GPU and exchanged hierarchically (allgather inside each node, then across nodes), the
small ones a flat fp32 allreduce. The edited plan is re-simulated and drawn.

Run from the repository root::

    python docs/make_timeline_example.py [--html docs/timeline-gpt2.html]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hetplan.ir.plan import (
    Bucket,
    CommStep,
    CompressedSync,
    GradientSync,
    NoSync,
    Plan,
    WorkloadSummary,
)
from hetplan.cost_models.predict import simulate
from hetplan.optimizer.compile import compile
from hetplan.report.timeline import render_timeline

HERE = Path(__file__).resolve().parent
BUCKET_CAP = 64 * 2**20
SMALL = 4 * 2**20


def compressed_buckets(workload: WorkloadSummary) -> GradientSync:
    """Whole-layer buckets up to ``BUCKET_CAP``: DGC for the large ones, fp32 for the small."""
    layers: list[list[int]] = []  # gradient indices per layer, in backward-ready order
    for i, g in enumerate(workload.grads):
        if layers and workload.grads[layers[-1][0]].layer_index == g.layer_index:
            layers[-1].append(i)
        else:
            layers.append([i])

    def size(idx: list[int]) -> int:
        return sum(workload.grads[i].size_bytes for i in idx)

    groups: list[list[int]] = []
    for idx in layers:
        small = size(idx) < SMALL
        if groups and (size(groups[-1]) < SMALL) == small and (
            small or size(groups[-1]) + size(idx) <= BUCKET_CAP
        ):
            groups[-1] += idx
        else:
            groups.append(list(idx))
    dgc = CompressedSync(
        compressor="dgc", params={"ratio": 0.01}, compress_device="gpu",
        hierarchy="hierarchical",
        steps=(CommStep(level="intra", routine="allgather", compressed=True),
               CommStep(level="inter", routine="allgather", compressed=True)),
    )
    buckets = tuple(
        Bucket(tensors=tuple(workload.grads[i].name for i in idx), size_bytes=size(idx),
               strategy="fp32" if size(idx) < SMALL else "dgc")
        for idx in groups
    )
    return GradientSync(strategies={"fp32": NoSync(), "dgc": dgc}, buckets=buckets)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "timeline-gpt2.png")
    ap.add_argument("--html", type=Path, default=None, help="also write an HTML version")
    args = ap.parse_args()

    plan = compile("gpt2", "v100-pcie-8x8", batch_size=64, pp=1)
    assert plan.model.workload is not None
    sync = compressed_buckets(plan.model.workload)
    data = plan.model_dump()
    data["gradient_sync"] = sync.model_dump()
    variant = Plan.model_validate(data)
    variant = variant.model_copy(update={"predictions": simulate(variant)})
    assert plan.predictions is not None and variant.predictions is not None
    print(f"compiled plan: {plan.predictions.iteration_time_ms:.1f} ms/iteration; "
          f"compressed variant ({len(sync.buckets)} buckets): "
          f"{variant.predictions.iteration_time_ms:.1f} ms/iteration")
    print("wrote", render_timeline(variant, args.out))
    if args.html:
        print("wrote", render_timeline(variant, args.html))


if __name__ == "__main__":
    main()

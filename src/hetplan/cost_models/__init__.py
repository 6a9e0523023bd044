"""How long things take: compute, communication, compression, memory, and the plan
evaluation that every pass uses as its single objective (``evaluate``; its data-parallel
timeline is the pure solver ``hetplan.algorithms.dp_timeline``; see DESIGN.md)."""

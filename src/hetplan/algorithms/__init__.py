"""Pure solvers over plain numbers (no torch): fusion DP, partitioning, decision search."""

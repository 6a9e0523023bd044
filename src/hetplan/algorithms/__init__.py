"""Pure solvers over plain numbers (no torch): fusion DP, partitioning, decision search, and
the data-parallel timeline simulator (``dp_timeline`` reference, ``dp_session`` search)."""

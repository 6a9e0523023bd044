"""Everything that is described, never executed: the model IR, the cluster spec, the plan."""

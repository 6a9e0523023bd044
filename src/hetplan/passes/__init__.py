"""Optimization passes: one file per pass, each owning one section of the plan."""

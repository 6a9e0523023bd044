"""``compile()``: capture, cost model, layout search, the pass pipeline, plan assembly."""

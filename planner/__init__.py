"""Capacity planner: hardware catalog, cost model, discrete-event simulator, placement search."""

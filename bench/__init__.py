"""Benchmarks: load sweeps, open-loop load, soak, profiles and kernel timings over the engine (random-weight
model directories come from ``engine.demo``)."""

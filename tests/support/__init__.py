"""Helpers shared by kvtier's tests only (servers and processes benchmarks use too: rigs/)."""

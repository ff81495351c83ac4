"""Peers that kvtier is measured against (benchmarks only; never imported by the package)."""

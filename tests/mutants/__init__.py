"""Mutation checks: each claimed mutant is applied in a subprocess and its tests must fail."""

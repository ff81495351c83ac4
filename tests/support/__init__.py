"""Helpers shared by kvtier's tests: real servers on loopback ports, free ports."""

"""Real servers and processes on loopback, and the connector's halves, for tests and benchmarks."""

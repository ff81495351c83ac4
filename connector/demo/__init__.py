"""``kvtier demo``: a real vLLM engine with kvtier, its workload, tiny models, the report."""

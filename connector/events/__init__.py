"""vLLM's KV-event model: wire format, full/partial classification, the index, token hashing.

Never imports vLLM.
"""

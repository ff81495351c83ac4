"""kvtier's storage half: the CPU tier, the Redis tier and the stack between them.

Knows nothing of vLLM: it stores and returns opaque, fixed-layout KV payloads under
:class:`~offload_tiers.keys.BlockKey`.
"""

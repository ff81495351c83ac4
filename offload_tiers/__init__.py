"""kvtier's storage half: block keys, the value codec, the CPU tier and the Redis tier.

Knows nothing of vLLM: it stores and returns opaque, fixed-layout KV payloads under
:class:`~offload_tiers.keys.BlockKey`. The connector composes the tiers itself: a CPU
slot directory in the scheduler, slabs and a :class:`~offload_tiers.redis.tier.RedisTier`
in each worker.
"""

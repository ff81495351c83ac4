"""kvtier's Redis tier inside vLLM's native multi-tier offloading (``TieringOffloadingSpec``).

``module_path``: ``connector.native_tier.tier``, ``type``: ``KvtierRedisTier``.
"""

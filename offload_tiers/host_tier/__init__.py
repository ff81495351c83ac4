"""The host tier: one CPU tier per host in shared memory, owned by ``kvtier daemon``.

``pins`` (per-client pin counters in shared memory), ``directory`` (the owner's slot
bookkeeping), ``protocol`` (messages on the daemon's Unix socket), ``server`` (the
daemon's side) and ``client`` (an engine's side). The bytes live in a
:class:`offload_tiers.shared_segment.SharedSegment`. Nothing here knows vLLM.
"""

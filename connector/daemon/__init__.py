"""``kvtier daemon``: subscribe to vLLM KV-event streams, index them, serve look-ups.

What the daemon holds (:class:`~connector.daemon.service.Daemon`): the KV-event index
(subscriber → ingest → :mod:`connector.events`' index) behind its HTTP API, and, when
configured, its parts (:class:`~connector.daemon.parts.DaemonParts`): the Redis janitor
(``redis_url``), the host tier's server (``cpu_bytes``: the host's shared CPU tier, with
its Redis service for ``host_tier_redis`` engines when ``redis_url`` is set too) and the
presence feed that service announces on and learns from.

Importing this package never imports vLLM.
"""

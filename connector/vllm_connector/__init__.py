"""The vLLM kv-connector ``TieredOffloadingConnector``.

Role dispatch (``connector``), config, the scheduler→worker plan (``plan``), the scheduler
half (``scheduler``, ``jobs``), the worker half (``worker``), layout, transfer, stats.
"""

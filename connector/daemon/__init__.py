"""``kvtier daemon``: subscribe to vLLM KV-event streams, index them, serve look-ups.

Importing this package never imports vLLM.
"""

"""The Redis tier's one home.

URL parsing, client construction and health, the tier (block semantics) and its channel (the
transport), RESP packing, write-behind, the janitor.
"""

"""The Redis tier's one home.

URL parsing, client construction and health, the tier, RESP packing, write-behind, the janitor.
"""

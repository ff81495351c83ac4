"""kvtier's Redis tier as an LMCache L2 storage adapter (LMCache 0.5.6's ``plugin`` type).

LMCache's multiprocess server loads it by name::

    --l2-adapter '{"type": "plugin", "module_path": "connector.lmcache_l2.adapter",
                   "class_name": "KvtierL2Adapter",
                   "adapter_params": {"redis_url_env": "KVTIER_REDIS_URL"}}'

Importing this package never imports LMCache: only :mod:`connector.lmcache_l2.adapter` does,
and only LMCache loads it. :mod:`.keys` (how LMCache's object key maps into kvtier's key) and
:mod:`.settings` (the ``adapter_params``) are plain kvtier. See docs/lmcache.md.
"""

"""kvtier's LMCache L2 adapter inside LMCache 0.5.6 (``make lmcache``, in .venv-lmcache).

The main suite runs in .venv, which has no LMCache: there the files that need it are not
collected (this folder's pure key-mapping tests still run). ``make lmcache`` runs them all.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HAVE_LMCACHE = importlib.util.find_spec("lmcache") is not None

#: Files that import LMCache: collected only where it is installed (``make lmcache``).
collect_ignore_glob = [] if HAVE_LMCACHE else ["test_adapter*.py", "test_mp_server.py"]

os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")


if HAVE_LMCACHE:
    from tests.lmcache.helpers import make_adapter
    from tests.support.redis_cluster import RedisClusterProcs

    @pytest.fixture
    def adapter_factory(redis_url: str, key_prefix: str) -> Iterator[Callable[..., Any]]:
        """Adapters LMCache's plugin loader builds, on the machine's Redis under a prefix of
        the test's own (closed afterwards)."""
        made: list[Any] = []

        def make(**params: Any) -> Any:
            params.setdefault("redis_url", redis_url)
            params.setdefault("key_prefix", key_prefix)
            adapter = make_adapter(params)
            made.append(adapter)
            return adapter

        yield make
        for adapter in made:
            adapter.close()

    @pytest.fixture
    def adapter(adapter_factory: Callable[..., Any]) -> Any:
        return adapter_factory()

    @pytest.fixture(scope="module")
    def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
        cluster = RedisClusterProcs(Path(tmp_path_factory.mktemp("lmcache-cluster"))).start()
        yield cluster
        cluster.stop()

"""Fixtures shared across kvtier's tests. Real servers only; unique key prefixes per test."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from rigs import engine_starts
from rigs.redis_server import RedisServer, SecretRedis

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
#: Every Python process the tests start loads tests/support/spawned/sitecustomize.py: vLLM's
#: queue readers go idle after 20 ms instead of spinning 1 s (tests/support/idle_wait.py).
SPAWNED_SITE = str(Path(__file__).resolve().parent / "support" / "spawned")
if SPAWNED_SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (SPAWNED_SITE, os.environ.get("PYTHONPATH")) if p)

REDIS_URL = os.environ.get("KVTIER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
_STARTS_KEY = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    """One engine-start log for the session (xdist workers inherit the variable)."""
    if not os.environ.get(engine_starts.ENV):
        fd, path = tempfile.mkstemp(prefix="kvtier-engine-starts-", suffix=".log")
        os.close(fd)
        os.environ[engine_starts.ENV] = path
        config.stash[_STARTS_KEY] = Path(path)


#: Test files that run on one pytest worker together (the engine host's kept baseline engine
#: of that worker serves them all); every other file is a group of its own.
SHARED_WORKER = {
    "tests/e2e/test_connector_llama.py": "llama-baseline",
    "tests/e2e/test_connector_faults.py": "llama-baseline",
}


def scheduling_group(nodeid: str) -> str:
    """The scheduling group of a test: its file, or the group its file shares."""
    test_file = nodeid.split("::", 1)[0]
    return SHARED_WORKER.get(test_file, test_file)


#: The longest test files (own-process engines: the demo's, the OpenAI servers, the stall
#: benchmark's servers), longest first: handed out before the rest so they overlap each
#: other, not the tail (a worker queues two files at a time).
LONGEST_FIRST = (  # worker-seconds in a full run of 2026-12-07: 272, 184, 149, 144, ...
    "tests/e2e/test_demo.py",
    "tests/e2e/test_exit_flush.py",
    "tests/e2e/test_openai_server.py",
    "tests/e2e/test_connector_tp.py",
    "tests/e2e/test_host_tier.py",
    "tests/e2e/test_connector_stall.py",
    "tests/e2e/test_connector_hybrid.py",
    "tests/native/test_native_tier_e2e.py",
    "tests/e2e/test_fast_start.py",
    "tests/e2e/test_connector_faults.py",
    "tests/native/test_native_tier_tp_e2e.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first, then the other real-engine tests, then the rest (stable
    otherwise): the scheduler hands out test files in this order, so the long files start
    early and the short ones fill the end, instead of one worker finishing a long engine
    file alone."""
    def cost_rank(item: pytest.Item) -> tuple[bool, int]:
        test_file = item.nodeid.split("::", 1)[0]
        rank = LONGEST_FIRST.index(test_file) if test_file in LONGEST_FIRST else len(LONGEST_FIRST)
        return item.get_closest_marker("e2e") is None, rank

    items.sort(key=cost_rank)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: every test file on one worker (its module-scoped engines start
    once), files of one :data:`SHARED_WORKER` group on the same worker.

    Not xdist's own loadgroup: it appends ``@group`` to ``item._nodeid``, which pytest 9.2
    no longer reads (``Node.nodeid`` comes from ``_id``), so every file's tests were spread
    over both workers and each worker started the file's engines."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    # Hand files out in collection order (pytest_collection_modifyitems: longest first),
    # not xdist's default of the files with the most tests first.
    config.option.loadscopereorder = False

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_group(nodeid)

    return FileGroupScheduling(config, log)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """How many engines the session started, by kind (the suite's main cost)."""
    path = config.stash.get(_STARTS_KEY, None)
    if path is None:
        return
    total, by_kind, by_file = engine_starts.summary(path)
    terminalreporter.write_sep("=", f"engine starts: {total}")
    for label, count in sorted(by_kind.items(), key=lambda kv: (-kv[1], kv[0])):
        terminalreporter.write_line(f"{count:4d}  {label}")
    terminalreporter.write_sep("-", "engine starts by test file")
    for test_file, count in sorted(by_file.items(), key=lambda kv: (-kv[1], kv[0])):
        terminalreporter.write_line(f"{count:4d}  {test_file}")
    path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The machine's Redis (CI starts one when it is absent). Fails loudly, never skips."""
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis at {REDIS_URL} is not reachable ({exc}); run scripts/bootstrap.sh")
    return REDIS_URL


@pytest.fixture
def key_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix no other test uses; every key under it is deleted afterwards."""
    prefix = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture(scope="module")
def redis_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of the module's own, shared by its tests (engine starts are costly)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def secret_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecretRedis]:
    """A module's own password-protected redis-server with an ACL user."""
    server = RedisServer(tmp_path_factory.mktemp("secret-redis"),
                         password=f"admin-{uuid.uuid4().hex}").start()
    yield SecretRedis(server)
    server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own on a free loopback port, which it may kill or pause."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    """A tiny random Llama checkpoint, built once and cached outside the repo."""
    from connector.demo.tiny_models import tiny_llama

    return tiny_llama()


@pytest.fixture(scope="session")
def tiny_hybrid_dir() -> Path:
    """A tiny random GraniteMoeHybrid (Mamba + attention) checkpoint, built once."""
    from connector.demo.tiny_models import tiny_hybrid

    return tiny_hybrid()

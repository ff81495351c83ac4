"""The worker's Redis tier (``make_redis_tier``) against a TLS redis-server with an ACL user.

No vLLM: the worker half builds its tier from the connector's settings exactly as it does
inside vLLM's worker process. The engine-level runs are in tests/e2e/test_connector_faults.py;
these cover the right CA and user (a save and a restore over TLS), a CA that did not sign the
server, and a wrong password.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connector.vllm_connector.config import TieredConfig, load_config
from connector.vllm_connector.remote_store import OwnRedis
from connector.vllm_connector.remote_store_factory import make_redis_tier
from connector.vllm_connector.worker import TieredWorker
from rigs.halves import BS, Halves
from rigs.sched_doubles import Blk, Req
from tests.support.redis_tls import start_tls_acl_server, tls_url
from tests.support.tls_certs import TlsFiles, make_tls_files

USER, PASSWORD = "kvt", "Rt-Pw-5e1d0c"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tls: TlsFiles) -> Iterator[Any]:
    srv, port = start_tls_acl_server(tmp_path_factory.mktemp("redis"), tls, USER, PASSWORD)
    yield port
    srv.stop()


def _config(port: int, ca: Path, password: str = PASSWORD, **extra: Any) -> TieredConfig:
    return load_config({"redis_url": tls_url(port, USER, password),
                        "redis_ssl_ca_certs": str(ca), "redis_timeout_s": 1.0, **extra})


def _worker(cfg: TieredConfig) -> TieredWorker:
    return TieredWorker(cfg, 0, 1, 4, OwnRedis(make_redis_tier(cfg), cfg.write_mode))


def test_right_ca_and_user_connect(server: int, tls: TlsFiles) -> None:
    worker = _worker(_config(server, tls.ca_cert))
    try:
        assert worker.redis is not None and worker.redis.available
        assert worker.take_report().redis_up == {0: 1}
        assert not worker.take_report()  # nothing changed: a quiet step reports nothing
        snap = worker.counters.snapshot()
        assert snap["redis_available"] == 1 and snap["redis_configured"] == 1
    finally:
        worker.close()


def test_blocks_round_trip_over_tls_between_two_engines(server: int, tls: TlsFiles) -> None:
    cfg = _config(server, tls.ca_cert, redis_prefix="kvtier-tls-roundtrip")
    first, second = Halves(cfg), Halves(cfg)
    try:
        first.fill([1, 2], seed=21)
        first.admit(Req("a", 70), [[Blk(1, BS), Blk(2, 2 * BS)]], 0)
        first.step({"a": 2 * BS})
        assert first.counter("blocks_written_redis") == [2]
        again = Req("b", 70)
        assert second.lookup(again) == (64, True)
        second.admit(again, [[Blk(5), Blk(6), Blk(7)]], 64)
        assert second.step().finished == {"b"}
        assert first.ranks[0].kv["attn0"][1:3].equal(second.ranks[0].kv["attn0"][5:7])
    finally:
        for e in (first, second):
            for rank in e.ranks:
                assert isinstance(rank.worker.redis, OwnRedis)
                rank.worker.redis.tier.delete_many([
                    rank.worker.storage_key(e.key(Req("a", 70), 0, n)) for n in (BS, 2 * BS)])
            e.close()


@pytest.mark.parametrize("case", ["other-ca", "wrong-password"])
def test_unverifiable_server_or_wrong_password_is_a_clear_cpu_only_start(
        server: int, tls: TlsFiles, case: str, caplog: pytest.LogCaptureFixture) -> None:
    ca = tls.other_ca_cert if case == "other-ca" else tls.ca_cert
    wrong = "Bad-Pw-99aa" if case == "wrong-password" else PASSWORD
    cfg = _config(server, ca, wrong)
    with caplog.at_level(logging.WARNING, logger="connector.vllm_connector.worker"):
        worker = _worker(cfg)
    try:
        assert worker.redis is not None and not worker.redis.available
        assert worker.take_report().redis_up == {0: 0}
        snap = worker.counters.snapshot()
        assert snap["redis_available"] == 0 and snap["redis_configured"] == 1
        assert isinstance(worker.redis, OwnRedis)
        stats = worker.redis.tier.stats()
        error = stats["last_error"].lower()
        assert ("certificate verify failed" in error if case == "other-ca"
                else "authentication failed" in error), error
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "not answering" in said
        for text in (str(stats), str(snap), said):
            assert wrong not in text and PASSWORD not in text
    finally:
        worker.close()


def test_an_engine_whose_redis_refuses_it_serves_from_the_cpu_tier(server: int,
                                                                   tls: TlsFiles) -> None:
    e = Halves(_config(server, tls.ca_cert, "Bad-Pw-99aa"))
    try:
        e.fill([1, 2], seed=23)
        e.admit(Req("a", 70), [[Blk(1, BS), Blk(2, 2 * BS)]], 0)
        result = e.step({"a": 2 * BS})
        assert len(result.plan.saves) == 2 and result.report.redis_up == {0: 0}
        assert not e.sched.redis_up and e.cpu()["pinned"] == 0
        assert e.counter("blocks_written_redis") == [0]
        assert e.lookup(Req("b", 70)) == (64, False)  # CPU tier only, no probe
    finally:
        e.close()

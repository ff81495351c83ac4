"""Credentials (requirepass, ACL user), wrong passwords, TLS with server verification,
unix sockets. Secrets never appear in errors, logs or stats."""

from __future__ import annotations

import logging
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest

from offload_tiers.redis.tier import RedisTier, RedisTierError
from offload_tiers.redis.url import parse_redis_url, redact_url
from rigs.redis_server import RedisServer
from tests.support.redis_tls import start_tls_acl_server, start_tls_server
from tests.support.tls_certs import make_tls_files
from tests.tiers.helpers import key, payload

SECRET = "p@ss:w/rd%-Zq81"  # characters that need percent-encoding in a URL


def _url(user: str, password: str, port: int) -> str:
    return f"redis://{user}:{quote(password, safe='')}@127.0.0.1:{port}/0"


def _no_secret(*texts: str) -> None:
    for text in texts:
        assert SECRET not in text and quote(SECRET, safe="") not in text, text


def test_redact_url() -> None:
    url = _url("alice", SECRET, 6379)
    assert redact_url(url) == "redis://alice:***@127.0.0.1:6379/0"
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis://h:1/0?password=pw&db=1") == "redis://h:1/0?password=***&db=1"
    assert parse_redis_url("rediss+cluster://h:1").cluster
    assert parse_redis_url("redis://h:1", cluster=True).cluster
    with pytest.raises(ValueError) as info:
        parse_redis_url("ftp://u:" + SECRET + "@h:1")
    _no_secret(str(info.value))


@pytest.fixture
def auth_server(tmp_path: Path) -> RedisServer:
    server = RedisServer(tmp_path / "auth", password=SECRET).start()
    yield server
    server.stop()


def test_requirepass_in_url(auth_server: RedisServer, key_prefix: str) -> None:
    with RedisTier.from_url(_url("", SECRET, auth_server.port), prefix=key_prefix,
                            strict=True) as t:
        assert t.put_many([(key(0), b"secret-protected")]) == 1
        assert bytes(t.get(key(0))) == b"secret-protected"
        _no_secret(str(t.stats()))


def test_acl_user_in_url(auth_server: RedisServer, key_prefix: str) -> None:
    admin = auth_server.client()
    admin.execute_command("ACL", "SETUSER", "kvuser", "on", f">{SECRET}",
                          f"~{key_prefix}:*", "+@all", "-@admin")
    with RedisTier.from_url(_url("kvuser", SECRET, auth_server.port), prefix=key_prefix,
                            strict=True) as t:
        assert t.put_many([(key(0), b"acl")]) == 1 and bytes(t.get(key(0))) == b"acl"
        assert not t.stats()["noeviction"]  # CONFIG denied by ACL: silently skipped
    # the ACL forbids keys outside the prefix: a store there fails, counted, no exception
    with RedisTier.from_url(_url("kvuser", SECRET, auth_server.port), prefix="elsewhere") as t:
        assert t.put_many([(key(0), b"x")]) == 0 and t.stats()["put_failures"] == 1
        assert t.available


@pytest.mark.parametrize("user", ["", "kvuser"])
def test_wrong_password_is_clear_and_secret_free(auth_server: RedisServer, key_prefix: str,
                                                 user: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    wrong = SECRET + "-wrong"
    url = _url(user, wrong, auth_server.port)
    with pytest.raises(RedisTierError) as info:
        RedisTier.from_url(url, prefix=key_prefix, strict=True)
    message = str(info.value)
    # kvtier's words, then Redis's own reason for the WRONGPASS reply
    assert message == (f"cannot use Redis at redis://{user}:***@127.0.0.1:{auth_server.port}/0: "
                       "authentication failed (invalid username-password pair or user is "
                       "disabled.)"), message
    assert wrong not in message and quote(wrong, safe="") not in message
    _no_secret(message)
    with caplog.at_level(logging.DEBUG):
        t = RedisTier.from_url(url, prefix=key_prefix)
        assert not t.available and t.get(key(0)) is None and t.put_many([(key(0), b"x")]) == 0
        texts = [t.last_error, str(t.stats())] + [r.getMessage() for r in caplog.records]
        t.close(timeout=1)
    assert texts[0].startswith("authentication failed"), texts[0]  # last_error
    for text in texts:
        assert wrong not in text and quote(wrong, safe="") not in text, text


def test_no_password_given_to_protected_server(auth_server: RedisServer, key_prefix: str) -> None:
    with pytest.raises(RedisTierError, match="(?i)auth"):
        RedisTier.from_url(f"redis://127.0.0.1:{auth_server.port}/0", prefix=key_prefix,
                           strict=True)


@pytest.fixture
def tls_server(tmp_path: Path):  # noqa: ANN201
    files = make_tls_files(tmp_path / "tls")
    server, tls_port = start_tls_server(tmp_path / "tls-redis", files)
    yield server, tls_port, files
    server.stop()


def test_tls_verifies_the_server(tls_server, key_prefix: str) -> None:  # noqa: ANN001
    _server, port, files = tls_server
    for host in ("127.0.0.1", "localhost"):
        with RedisTier.from_url(f"rediss://{host}:{port}/0", prefix=key_prefix,
                                ssl_ca_certs=str(files.ca_cert), strict=True) as t:
            assert t.target.tls
            assert t.put_many([(key(0), b"over tls" * 5000)]) == 1
            assert bytes(t.get(key(0))) == b"over tls" * 5000


def test_tls_with_an_untrusted_ca_fails_clearly(tls_server, key_prefix: str) -> None:  # noqa: ANN001
    _server, port, files = tls_server
    with pytest.raises(RedisTierError, match="(?i)certificate"):
        RedisTier.from_url(f"rediss://127.0.0.1:{port}/0", prefix=key_prefix,
                           ssl_ca_certs=str(files.other_ca_cert), strict=True,
                           redis_timeout_s=2)


def test_plain_client_against_tls_port_is_a_miss_not_a_hang(tls_server, key_prefix: str) -> None:  # noqa: ANN001
    _server, port, _files = tls_server
    t = RedisTier.from_url(f"redis://127.0.0.1:{port}/0", prefix=key_prefix,
                           redis_timeout_s=0.5)
    try:
        assert not t.available and t.get(key(0)) is None
    finally:
        t.close(timeout=1)


def test_unix_socket(tmp_path: Path, key_prefix: str) -> None:
    sock = tmp_path / "redis.sock"
    server = RedisServer(tmp_path / "unix", "--unixsocket", str(sock),
                         "--unixsocketperm", "700").start()
    try:
        with RedisTier.from_url(f"unix://{sock}?db=0", prefix=key_prefix, strict=True) as t:
            assert t.put_many([(key(0), b"unix")]) == 1 and bytes(t.get(key(0))) == b"unix"
    finally:
        server.stop()


def test_get_many_into_over_tls_with_an_acl_user(tmp_path: Path, key_prefix: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    files = make_tls_files(tmp_path / "tls")
    server, port = start_tls_acl_server(tmp_path / "tls-acl", files, "kvtls", SECRET)
    url = f"rediss://kvtls:{quote(SECRET, safe='')}@127.0.0.1:{port}/0"
    t = RedisTier.from_url(url, prefix=key_prefix, ssl_ca_certs=str(files.ca_cert),
                           redis_timeout_s=0.5, backoff_initial_s=0.05, strict=True)
    try:
        sizes = [100, 70_000, 2 << 20]  # TLS records are 16 KiB: values span many
        keys = [key(i) for i in range(3)]
        assert t.put_many([(k, payload(k, n)) for k, n in zip(keys, sizes, strict=True)]) == 3
        server.client().set(f"{key_prefix}:{key(3).name}", b"not a kvtier value")
        dests = [np.zeros(n, np.uint8) for n in sizes] + [np.zeros(10, np.uint8)] * 2
        assert t.get_many_into(keys + [key(3), key(4)], dests) == [True] * 3 + [False] * 2
        assert [d.tobytes() for d in dests[:3]] == [payload(k, n)
                                                    for k, n in zip(keys, sizes, strict=True)]
        with caplog.at_level(logging.DEBUG, logger="offload_tiers.redis"):
            server.kill()
            assert t.get_many_into(keys, dests[:3]) == [False] * 3 and not t.available
        _no_secret(t.last_error, str(t.stats()), caplog.text)
        assert "kvtls:***@" in t.stats()["url"]
    finally:
        t.close(timeout=1)
        server.stop()

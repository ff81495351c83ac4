"""Redis credentials outside printed configs: ``redis_url_env``, ``redis_password_file``.

Pure logic first (what URL comes out, what is refused, what is warned), then a real
password-protected redis-server with an ACL user, reached through each way.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from offload_tiers.keys import BlockKey, BlockKind, Namespace
from offload_tiers.redis.credentials import (
    has_inline_password,
    resolve_redis_url,
    with_credentials,
)
from offload_tiers.redis.tier import RedisTier
from rigs.redis_server import SecretRedis

PLAIN = "redis://127.0.0.1:6379/0"


def private_file(path: Path, text: str, mode: int = 0o600) -> str:
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_url_from_the_environment_is_used_as_given_without_warning() -> None:
    url, warnings = resolve_redis_url(None, url_env="KV_URL",
                                      environ={"KV_URL": "redis://u:p%40ss@h:1/2\n"})
    assert url == "redis://u:p%40ss@h:1/2" and warnings == []


def test_password_file_goes_into_the_url_quoted(tmp_path: Path) -> None:
    secret = "p@ss:w/rd %&?#"
    path = private_file(tmp_path / "pw", secret + "\n")
    url, warnings = resolve_redis_url(PLAIN, username="bob", password_file=path)
    assert warnings == []
    import redis

    parsed = redis.connection.parse_url(url)  # redis-py reads back exactly the password
    assert parsed["username"] == "bob" and parsed["password"] == secret
    assert parsed["host"] == "127.0.0.1" and parsed["port"] == 6379 and parsed["db"] == 0


def test_password_file_replaces_a_password_in_the_url(tmp_path: Path) -> None:
    path = private_file(tmp_path / "pw", "new\r\n")
    url, _ = resolve_redis_url("redis://:old@h:1/0", password_file=path)
    assert url == "redis://:new@h:1/0"


def test_an_inline_password_is_warned_once_without_the_password() -> None:
    url, warnings = resolve_redis_url("redis://:hunter2@h:1/0")
    assert url == "redis://:hunter2@h:1/0"
    assert len(warnings) == 1
    assert "hunter2" not in warnings[0] and "redis://:***@h:1/0" in warnings[0]
    assert "redis_url_env" in warnings[0] and "redis_password_file" in warnings[0]
    assert resolve_redis_url(PLAIN) == (PLAIN, [])
    assert has_inline_password("redis://h:1/0?password=x")


def test_a_password_file_others_can_read_is_warned(tmp_path: Path) -> None:
    path = private_file(tmp_path / "pw", "s3cret", mode=0o644)
    _, warnings = resolve_redis_url(PLAIN, password_file=path)
    assert len(warnings) == 1 and "chmod 600" in warnings[0] and "s3cret" not in warnings[0]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"url": PLAIN, "url_env": "KV_URL"}, "both set"),
    ({"url": None, "url_env": "KV_UNSET"}, "KV_UNSET, which is not set"),
    ({"url": None, "password_file": "/nonexistent"}, "need redis_url or redis_url_env"),
    ({"url": PLAIN, "password_file": "/nonexistent/pw"}, "cannot read the password file"),
    ({"url": "http://:s3cret@h:1"}, "unsupported Redis URL scheme"),
])
def test_bad_settings_are_refused_naming_the_setting_never_the_secret(
        kwargs: dict[str, str], message: str) -> None:
    url = kwargs.pop("url")
    with pytest.raises(ValueError, match=message) as err:
        resolve_redis_url(url, environ={"KV_URL": "redis://:s3cret@h:1"}, **kwargs)
    assert "s3cret" not in str(err.value)


def test_an_empty_password_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is empty"):
        resolve_redis_url(PLAIN, password_file=private_file(tmp_path / "pw", "\n"))


def test_username_alone_keeps_the_urls_password() -> None:
    assert with_credentials("redis://:pw@h:1/0", "alice", None) == "redis://alice:pw@h:1/0"
    assert with_credentials("redis://h:1/0", "alice", None) == "redis://alice@h:1/0"


@pytest.mark.parametrize("how", ["url_env", "password_file"])
def test_acl_user_stores_and_reads_through_each_way(how: str, secret_redis: SecretRedis,
                                                    tmp_path: Path) -> None:
    """A real redis-server that requires a password: the ACL user's credentials, given by
    a variable or a file, store a value and read it back byte-exact."""
    plain = f"redis://127.0.0.1:{secret_redis.server.port}/0"
    if how == "url_env":
        url, _ = resolve_redis_url(None, url_env="KV_URL",
                                   environ={"KV_URL": secret_redis.user_url})
    else:
        path = private_file(tmp_path / "pw", secret_redis.user_password + "\n")
        url, _ = resolve_redis_url(plain, username="kvtier", password_file=path)
    assert url is not None
    tier = RedisTier.from_url(url, prefix=f"cred-{how}", strict=True)
    try:
        key = BlockKey(Namespace("m", "float32", "nhd", 16).fingerprint, 0, b"h" * 16, 16,
                       BlockKind.FULL)
        payload = bytes(range(256)) * 16
        assert tier.put_many([(key, payload)]) == 1
        assert bytes(tier.get(key) or b"") == payload
    finally:
        tier.close()
    refused = RedisTier.from_url(plain, prefix=f"cred-{how}")  # no credentials: refused
    try:
        assert not refused.available
    finally:
        refused.close()

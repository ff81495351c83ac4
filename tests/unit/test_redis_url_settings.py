"""A malformed Redis URL fails at start in every config that takes one (issue 45.2).

Before, only the scheme was checked: ``redis://localhost:x/0`` or a port of 99999 started
fine and Redis was "not answering" forever. Each bad URL below is refused by
:func:`parse_redis_url` and by the connector's, the native tier's and the daemon's settings,
with a message that names the key (``redis_url``, or the variable ``redis_url_env`` names),
the part at fault and how to write it, and never the password.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import quote, unquote, urlsplit

import pytest

from connector.daemon.config import ConfigError
from connector.daemon.config import load_config as load_daemon
from connector.native_tier.config import NativeTierConfigError, load_native_settings
from connector.vllm_connector.config import ConnectorConfigError
from connector.vllm_connector.config import load_config as load_connector
from offload_tiers.redis.settings import RedisConnectionSettings
from offload_tiers.redis.url import parse_redis_url

SECRET = "s3cr3t-Zq81"
RAW = "p/ss#w?rd@" + SECRET  # a password that must be percent-encoded in a URL

#: (URL, what the message says about it)
BAD = [
    (f"redis://u:{SECRET}@localhost:x/0", "port must be an integer from 1 to 65535, got 'x'"),
    (f"redis://u:{SECRET}@localhost:99999/0", "port must be an integer from 1 to 65535"),
    (f"redis://:{SECRET}@h:0/0", "port must be an integer from 1 to 65535, got '0'"),
    (f"redis://:{SECRET}@:6379/0", "no host"),
    ("redis:///0", "no host"),
    (f"rediss://u:{SECRET}@h:6380/abc", "the path must be the db number"),
    ("redis://h:6379/-1", "the path must be the db number"),
    ("redis://h:6379/1?db=2", "db given twice"),
    (f"redis://h:6379/0?db=x&password={SECRET}", "query option db must be an integer"),
    (f"redis://h:6379/0?socket_timeout=9&password={SECRET}", "unknown query option "
                                                            "'socket_timeout'"),
    ("redis://h:6379/0?ssl_cert_reqs=none", "applies to rediss://"),
    ("rediss://h:6380/0?ssl_cert_reqs=maybe", "ssl_cert_reqs must be none, optional or"),
    (f"redis+cluster://u:{SECRET}@h:7000/3", "Redis Cluster has only db 0"),
    ("rediss+cluster://h:7000?db=1", "Redis Cluster has only db 0"),
    ("unix://", "unix:// needs the socket's path"),
    (f"unix://:{SECRET}@", "unix:// needs the socket's path"),
    ("unix://tmp/redis.sock", "unix:// takes an absolute socket path, got host 'tmp'"),
    ("unix:///tmp/redis.sock?foo=1", "unknown query option 'foo'"),
    ("redis+cluster:///tmp/x.sock", "no host"),
    ("unix+cluster:///tmp/x.sock", "unsupported Redis URL scheme"),
    (f"redis://u:{RAW}@h:6379/0", "percent-encode '/', '?', '#' and '@' in a password"),
    (f"redis://:{SECRET}#x@h:6379/0", "percent-encode"),
    (f"ftp://u:{SECRET}@h:1", "unsupported Redis URL scheme"),
]

GOOD = [
    "redis://127.0.0.1:6379/0", "redis://h", "redis://h:1", "redis://h/15", "redis://h?db=3",
    "redis://h/3?db=3", f"redis://u:{quote(RAW, safe='')}@h:6379/0",
    f"redis://h:6379/0?password={SECRET}&client_name=kv", "redis://[::1]:6379/0",
    "rediss://h:6380/0?ssl_cert_reqs=required&ssl_check_hostname=false",
    "redis+cluster://h:7000", "redis+cluster://h:7000/0", "rediss+cluster://h:7000/",
    "unix:///tmp/redis.sock", "unix:///tmp/redis.sock?db=2", f"unix://:{SECRET}@/tmp/r.sock",
]


def _no_secret(text: str) -> None:
    for form in (SECRET, RAW, quote(RAW, safe="")):
        assert form not in text, text


@pytest.mark.parametrize("url", GOOD)
def test_good_urls_parse(url: str) -> None:
    target = parse_redis_url(url)
    _no_secret(target.redacted)


@pytest.mark.parametrize(("url", "says"), BAD)
def test_parse_redis_url_names_the_part_and_the_form_never_the_password(url: str,
                                                                        says: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_redis_url(url)
    assert says in str(err.value)
    assert "redis://" in str(err.value)  # how to write it
    _no_secret(str(err.value))


def _connector(settings: dict) -> RedisConnectionSettings:
    return load_connector(settings)


def _native(settings: dict) -> RedisConnectionSettings:
    return load_native_settings(settings)


def _daemon(settings: dict) -> RedisConnectionSettings:
    return load_daemon(None, {"publishers": [{"endpoint": "tcp://*:5557"}], **settings})


LOADERS: dict[str, tuple[Callable[[dict], RedisConnectionSettings], type[Exception]]] = {
    "connector": (_connector, ConnectorConfigError),
    "native_tier": (_native, NativeTierConfigError),
    "daemon": (_daemon, ConfigError),
}


@pytest.mark.parametrize("config", LOADERS)
@pytest.mark.parametrize(("url", "says"), BAD)
def test_every_config_refuses_a_bad_redis_url_naming_the_key(config: str, url: str,
                                                              says: str) -> None:
    load, error = LOADERS[config]
    with pytest.raises(error) as err:
        load({"redis_url": url})
    text = str(err.value)
    assert "redis_url:" in text and says in text, text
    assert "Value error," not in text  # pydantic's prefix is stripped
    _no_secret(text)


@pytest.mark.parametrize("config", LOADERS)
@pytest.mark.parametrize(("url", "says"), BAD[:6])
def test_every_config_refuses_a_bad_url_in_redis_url_env_naming_the_variable(
        config: str, url: str, says: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_BAD_URL", url)
    load, error = LOADERS[config]
    with pytest.raises(error) as err:
        load({"redis_url_env": "KVTIER_TEST_BAD_URL"})
    text = str(err.value)
    assert "redis_url_env" in text and "$KVTIER_TEST_BAD_URL" in text and says in text, text
    _no_secret(text)


@pytest.mark.parametrize("config", LOADERS)
def test_every_config_takes_the_good_urls(config: str) -> None:
    load, _ = LOADERS[config]
    for url in GOOD:
        load({"redis_url": url})


def test_a_bad_url_with_a_password_file_is_blamed_on_the_url(tmp_path) -> None:
    path = tmp_path / "pw"
    path.write_text(SECRET)
    path.chmod(0o600)
    with pytest.raises(ConnectorConfigError) as err:
        load_connector({"redis_url": "redis://h:99999/0", "redis_password_file": str(path)})
    assert "redis_url: " in str(err.value) and "redis_password_file:" not in str(err.value)
    _no_secret(str(err.value))


# -- one set of connection settings (issue 46): the same keys, checks and credentials in all
# three configs (before, redis_password_env was the native tier's only, the daemon took a
# prefix with spaces and a CA path that did not exist)

@pytest.mark.parametrize("config", LOADERS)
def test_the_password_may_come_from_an_environment_variable_in_every_config(
        config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_PW", RAW)
    load, _ = LOADERS[config]
    settings = load({"redis_url": "redis://h:6379/0", "redis_username": "kv",
                     "redis_password_env": "KVTIER_TEST_PW"})
    parts = urlsplit(settings.redis_url or "")
    assert (unquote(parts.username or ""), unquote(parts.password or "")) == ("kv", RAW)
    assert settings.redis_warnings == ()  # no password written in the config
    _no_secret(repr(settings.describe()))


@pytest.mark.parametrize("config", LOADERS)
@pytest.mark.parametrize(("given", "says"), [
    ({"redis_password_env": "KVTIER_TEST_UNSET_PW"},
     "redis_password_env: redis_password_env names KVTIER_TEST_UNSET_PW, which is not set"),
    ({"redis_password_env": "KVTIER_TEST_PW", "redis_password_file": "/nonexistent"},
     "redis_password_file and redis_password_env are both set"),
    ({"redis_prefix": "kv tier"}, "redis_prefix: must be non-empty without whitespace"),
    ({"redis_prefix": ""}, "redis_prefix: must be non-empty without whitespace"),
    ({"redis_ssl_ca_certs": "/nonexistent/ca.pem"}, "redis_ssl_ca_certs: no readable file"),
])
def test_every_config_checks_the_connection_settings_alike(
        config: str, given: dict, says: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_PW", RAW)
    monkeypatch.delenv("KVTIER_TEST_UNSET_PW", raising=False)
    load, error = LOADERS[config]
    with pytest.raises(error) as err:
        load({"redis_url": "rediss://h:6380/0", **given})
    text = str(err.value)
    assert says in text and "Fix:" in text, text
    _no_secret(text)


def test_the_three_configs_share_one_connection_model() -> None:
    from connector.daemon.config import DaemonConfig
    from connector.native_tier.config import NativeTierSettings
    from connector.vllm_connector.config import TieredConfig

    shared = set(RedisConnectionSettings.model_fields)
    for model in (TieredConfig, NativeTierSettings, DaemonConfig):
        assert issubclass(model, RedisConnectionSettings), model
        assert shared <= set(model.model_fields), model
    # the daemon waits longer (it is on no engine's step path); the rest is one default
    assert DaemonConfig.model_fields["redis_timeout_s"].default == 2.0
    assert TieredConfig.model_fields["redis_timeout_s"].default == 0.25

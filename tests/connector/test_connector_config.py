"""Settings: defaults, YAML file, inline override, and errors that name key and fix."""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from connector.vllm_connector.config import ConnectorConfigError, check_parallel_shape, load_config
from connector.vllm_connector.remote_store_factory import make_redis_tier
from offload_tiers.keys import BlockKey, BlockKind
from offload_tiers.redis.settings import WRITE_SETTLE_S
from offload_tiers.redis.tier import RedisTier
from tests.tiers.faults import wait_until


def test_defaults() -> None:
    cfg = load_config(None)
    assert cfg.redis_url is None and cfg.store_partial and cfg.hybrid_hits
    assert cfg.write_mode == "back"  # a step never waits on a Redis round trip
    assert cfg.weights_version == "" and cfg.tenant == ""


def test_the_writer_lingers_as_configured(redis_url: str) -> None:
    assert load_config(None).redis_write_linger_ms == 200.0
    tier = make_redis_tier(load_config({"redis_url": redis_url, "redis_write_linger_ms": 250}))
    try:
        assert tier._writer._linger_s == 0.25
        assert tier._writer._settle_s == WRITE_SETTLE_S > 0  # a vLLM worker's writer settles
    finally:
        tier.close()


def test_the_writer_paces_bursts_as_configured(redis_url: str) -> None:
    defaults = load_config(None)
    assert (defaults.redis_write_batch, defaults.redis_write_pace_ms) == (32, 0.0)
    tier = make_redis_tier(load_config({"redis_url": redis_url, "redis_write_batch": 4,
                                        "redis_write_pace_ms": 20}))
    try:
        assert tier._writer._batch_items == 4 and tier._writer._pace_s == 0.02
    finally:
        tier.close()


def test_a_burst_of_saves_reaches_redis_in_paced_batches(redis_url: str) -> None:
    """The Redis tier's writer: ``write_batch_items`` values, then a wait of
    ``write_pace_s`` (here an hour: only the flush writes the rest)."""
    prefix = f"kvtier-pace-{uuid.uuid4().hex[:8]}"
    tier = RedisTier.from_url(redis_url, prefix=prefix, write_linger_s=0,
                              write_batch_items=4, write_pace_s=3600)
    client = redis.Redis.from_url(redis_url)
    try:
        keys = [BlockKey("ab" * 16, 0, bytes([i]) * 32, 32 * (i + 1), BlockKind.FULL)
                for i in range(10)]
        assert all(tier.submit_puts([(k, b"v" * 64, None, 0) for k in keys]))
        assert wait_until(lambda: tier._writer.paces == 1, timeout=30)
        assert len(list(client.scan_iter(match=f"{prefix}:*"))) == 4  # one batch so far
        assert tier.flush(30)
        assert len(list(client.scan_iter(match=f"{prefix}:*"))) == 10
    finally:
        tier.close()
        for name in client.scan_iter(match=f"{prefix}:*"):
            client.delete(name)
        client.close()


def test_weights_version_is_a_setting() -> None:
    cfg = load_config({"weights_version": "step-1000", "write_mode": "through"})
    assert cfg.weights_version == "step-1000" and cfg.write_mode == "through"
    assert cfg.describe()["weights_version"] == "step-1000"


def test_the_example_file_is_valid_and_sets_every_key_it_shows() -> None:
    """configs/tiered.yaml (the README points to it) loads, and each key it shows is taken."""
    import yaml

    example = Path(__file__).resolve().parents[2] / "configs" / "tiered.yaml"
    shown = yaml.safe_load(example.read_text())["connector"]
    cfg = load_config({"config_file": str(example)})
    assert shown and {k: getattr(cfg, k) for k in shown} == shown
    assert cfg.redis_backfill


def test_yaml_file_then_inline_override(tmp_path: Path) -> None:
    path = tmp_path / "tiered.yaml"
    path.write_text("connector:\n  cpu_bytes: 2097152\n  write_mode: back\n  tenant: t1\n")
    cfg = load_config({"config_file": str(path), "tenant": "t2"})
    assert cfg.cpu_bytes == 2097152 and cfg.write_mode == "back" and cfg.tenant == "t2"


@pytest.mark.parametrize(("extra", "needle"), [
    ({"cpu_bytes": 10}, "cpu_bytes"),
    ({"write_mode": "sideways"}, "write_mode"),
    ({"redis_url": "http://x"}, "redis_url"),
    ({"cpu_byte": 1 << 30}, "cpu_byte: unknown setting"),
    ({"redis_ttl_s": 0}, "redis_ttl_s"),
    ({"redis_ssl_ca_certs": "/nonexistent/ca.pem"}, "redis_ssl_ca_certs"),
    ({"weights_version": ["a"]}, "weights_version"),
    ({"redis_write_linger_ms": -1}, "redis_write_linger_ms"),
    ({"redis_write_linger_ms": 5000}, "redis_write_linger_ms"),
    ({"redis_write_batch": 0}, "redis_write_batch"),
    ({"redis_write_pace_ms": -1}, "redis_write_pace_ms"),
    ({"background_nice": 20}, "background_nice"),
    ({"background_nice": -1}, "background_nice"),
])
def test_bad_settings_name_the_key_and_the_fix(extra: dict, needle: str) -> None:
    with pytest.raises(ConnectorConfigError) as err:
        load_config(extra)
    assert needle in str(err.value) and "Fix:" in str(err.value)


def test_password_never_in_the_error() -> None:
    with pytest.raises(ConnectorConfigError) as err:
        load_config({"redis_url": "http://user:s3cret@host", "cpu_bytes": 1})
    assert "s3cret" not in str(err.value)
    cfg = load_config({"redis_url": "redis://user:s3cret@host:6379/0"})
    assert "s3cret" not in str(cfg.describe())


def test_unreadable_or_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConnectorConfigError, match="config_file"):
        load_config({"config_file": str(tmp_path / "missing.yaml")})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConnectorConfigError, match="mapping"):
        load_config({"config_file": str(bad)})


def test_ca_file_is_kept_as_a_path(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    cfg = load_config({"redis_url": "rediss://127.0.0.1:6380/0", "redis_ssl_ca_certs": str(ca)})
    assert cfg.redis_ssl_ca_certs == str(ca)


@pytest.mark.parametrize(("name", "needle"), [
    ("pipeline_parallel_size", "pipeline_parallel_size=2"),
    ("prefill_context_parallel_size", "prefill_context_parallel_size=2"),
    ("decode_context_parallel_size", "decode_context_parallel_size=2"),
])
def test_parallel_shapes_that_cannot_work_are_refused_naming_the_fix(name: str,
                                                                   needle: str) -> None:
    shape = {"pipeline_parallel_size": 1, "prefill_context_parallel_size": 1,
             "decode_context_parallel_size": 1, "tensor_parallel_size": 2}
    check_parallel_shape(SimpleNamespace(**shape))  # TP alone is fine
    with pytest.raises(ConnectorConfigError, match=needle) as err:
        check_parallel_shape(SimpleNamespace(**{**shape, name: 2}))
    assert "Fix: " in str(err.value)


def test_credentials_from_a_variable_or_a_file(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_URL", "redis://u:from-env@h:1/0")
    by_env = load_config({"redis_url_env": "KVTIER_TEST_URL"})
    assert by_env.redis_url == "redis://u:from-env@h:1/0" and by_env.redis_warnings == ()
    assert "from-env" not in str(by_env.describe())
    path = tmp_path / "pw"
    path.write_text("from-file\n")
    path.chmod(0o600)
    by_file = load_config({"redis_url": "redis://h:1/0", "redis_username": "u",
                           "redis_password_file": str(path)})
    assert by_file.redis_url == "redis://u:from-file@h:1/0" and by_file.redis_warnings == ()
    assert "from-file" not in str(by_file.describe())


def test_an_inline_password_gets_one_warning_without_it() -> None:
    config = load_config({"redis_url": "redis://:inline-pw@h:1/0"})
    assert len(config.redis_warnings) == 1
    assert "inline-pw" not in config.redis_warnings[0]
    assert "redis_url_env" in config.redis_warnings[0]


@pytest.mark.parametrize(("extra", "needle"), [
    ({"redis_url_env": "KVTIER_TEST_UNSET"}, "redis_url_env: redis_url_env names "
                                             "KVTIER_TEST_UNSET, which is not set"),
    ({"redis_url": "redis://h:1", "redis_password_file": "/nonexistent/pw"},
     "redis_password_file: cannot read the password file"),
    ({"redis_url": "redis://h:1", "redis_url_env": "HOME"}, "both set"),
])
def test_bad_credentials_settings_name_the_key_and_the_fix(extra: dict, needle: str) -> None:
    with pytest.raises(ConnectorConfigError) as err:
        load_config(extra)
    assert needle in str(err.value) and "Fix:" in str(err.value)

"""``kvtier daemon``'s flags: every configuration key a flat value can set has a flag, and
each flag lands in the validated configuration (flags override the YAML file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from connector.daemon.cli import _overrides, build_parser
from connector.daemon.config import ConfigError, DaemonConfig, load_config

FP = "0123456789abcdef" * 2
#: Keys set only through their own structured flags or the YAML file.
STRUCTURED = {"publishers": "--endpoint", "block_sizes": "--block-size",
              "token_hashing": None}


def _config(*argv: str, yaml_text: str | None = None, tmp_path: Path | None = None
            ) -> DaemonConfig:
    args = build_parser().parse_args(list(argv))
    path = None
    if yaml_text is not None:
        assert tmp_path is not None
        path = tmp_path / "daemon.yaml"
        path.write_text(yaml_text)
    return load_config(path, _overrides(args))


def test_every_flat_key_has_a_flag() -> None:
    actions = {a.dest for a in build_parser()._actions}
    missing = [k for k in DaemonConfig.model_fields if k not in STRUCTURED and k not in actions]
    assert missing == []
    options = {o for a in build_parser()._actions for o in a.option_strings}
    assert {f for f in STRUCTURED.values() if f} <= options


def test_each_flag_lands_in_the_configuration() -> None:
    cfg = _config("--cpu-bytes", "1M", "--slot-bytes", "64k", "--max-pending-batches", "7",
                  "--hwm", "9", "--clear-on-restart", "GPU", "--score-weight", "STORAGE=0.25",
                  "--score-weight", "CPU=0.9", "--redis-url", "redis://127.0.0.1:6379/0",
                  "--redis-timeout-s", "12.5", "--janitor-scan-count", "500",
                  "--janitor-allowed-fingerprint", FP, "--host-tier-max-clients", "32")
    assert (cfg.max_pending_batches, cfg.hwm, cfg.clear_on_restart) == (7, 9, ["GPU"])
    assert cfg.score_weights == {"STORAGE": 0.25, "CPU": 0.9}
    assert (cfg.redis_timeout_s, cfg.janitor_scan_count) == (12.5, 500)
    assert cfg.janitor_allowed_fingerprints == [FP]
    assert cfg.host_tier_max_clients == 32
    assert _config("--cpu-bytes", "4M", "--clear-on-restart", "").clear_on_restart == []


def test_flags_override_the_file(tmp_path: Path) -> None:
    cfg = _config("--redis-timeout-s", "3", "--hwm", "5", tmp_path=tmp_path,
                  yaml_text="cpu_bytes: 4194304\nredis_url: redis://127.0.0.1:6379/0\n"
                            "redis_timeout_s: 1.0\nhwm: 50\njanitor_scan_count: 40\n")
    assert (cfg.redis_timeout_s, cfg.hwm, cfg.janitor_scan_count) == (3.0, 5, 40)


@pytest.mark.parametrize(("argv", "says"), [
    (["--score-weight", "STORAGE"], "--score-weight expects NAME=VALUE"),
    (["--score-weight", "STORAGE=lots"], "--score-weight expects NAME=VALUE"),
    (["--redis-timeout-s", "61", "--redis-url", "redis://h"], "redis_timeout_s"),
    (["--clear-on-restart", "GPU,DISK"], "clear_on_restart"),
    (["--janitor-allowed-fingerprint", "xyz", "--redis-url", "redis://h"],
     "janitor_allowed_fingerprints"),
])
def test_a_bad_flag_value_names_its_key(argv: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        _config("--cpu-bytes", "4M", *argv)

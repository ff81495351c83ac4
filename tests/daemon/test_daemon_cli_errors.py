"""``kvtier daemon``'s flags and errors (issue 45.3, 45.4): a bad flag's error names the flag,
an unknown YAML key names the fix and the known keys, ``--help`` shows the real defaults and
helps every flag, flag names are the YAML keys with dashes (old names still parse, hidden),
and ``kvtier --version`` prints the package's version."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from connector.cli import main as kvtier_main
from connector.cli import version
from connector.daemon import cli as daemon_cli
from connector.daemon.cli import DEPRECATED_FLAGS, _overrides, build_parser, flags_given
from connector.daemon.cli import main as daemon_main
from connector.daemon.config import ConfigError, DaemonConfig, default_host_tier_socket, load_config

REPO = Path(__file__).resolve().parents[2]


def _error(*argv: str, yaml_text: str | None = None, tmp_path: Path | None = None) -> str:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    path = None
    if yaml_text is not None:
        assert tmp_path is not None
        path = tmp_path / "daemon.yaml"
        path.write_text(yaml_text)
    with pytest.raises(ConfigError) as err:
        load_config(path, _overrides(args), flags_given(parser, args))
    return str(err.value)


def _help() -> str:
    return "".join(build_parser().format_help().split())  # wrapping aside


@pytest.mark.parametrize(("argv", "says"), [
    (["--redis-ttl-s", "0"], "--redis-ttl-s (redis_ttl_s): Input should be greater than 0"),
    (["--redis-timeout-s", "-1"], "--redis-timeout-s (redis_timeout_s):"),
    (["--replay-timeout-s", "0"], "--replay-timeout-s (replay_timeout_s):"),
    (["--replay-timeout", "0"], "--replay-timeout-s (replay_timeout_s):"),
    (["--log-level", "LOUD"], "--log-level (log_level): log_level must be DEBUG"),
    (["--redis-url", "redis://h:99999/0"], "--redis-url (redis_url): Redis URL"),
    (["--dp-size", "0"], "--dp-size (publishers.0.dp_size):"),
    (["--max-entries", "0"], "--max-entries (max_entries):"),
])
def test_a_bad_flag_value_names_the_flag(argv: list[str], says: str) -> None:
    text = _error("--endpoint", "tcp://*:5557", *argv)
    assert says in text, text
    assert "Value error," not in text


def test_a_bad_yaml_value_names_the_yaml_key(tmp_path: Path) -> None:
    text = _error(yaml_text="publishers: [{endpoint: 'tcp://*:5557'}]\nredis_ttl_s: 0\n",
                  tmp_path=tmp_path)
    assert "\n  redis_ttl_s: Input should be greater than 0" in text and "--" not in text


def test_an_unknown_yaml_key_names_the_fix_and_the_known_keys(tmp_path: Path) -> None:
    text = _error(yaml_text="publishers: [{endpoint: 'tcp://*:5557', topik: x}]\n"
                            "redis_ttl: 5\n", tmp_path=tmp_path)
    assert "Extra inputs are not permitted" not in text
    assert "redis_ttl: unknown setting. Fix: remove it or correct its spelling; known keys: " \
           in text and "redis_ttl_s" in text
    assert "publishers.0.topik: unknown setting" in text and "kv_cache_report_mode" in text


def test_a_bad_redis_url_env_names_the_variable_and_never_the_password(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVTIER_TEST_DAEMON_URL", "redis://u:hunter2@h:x/0")
    monkeypatch.setattr(daemon_cli, "run", lambda cfg: pytest.fail("the daemon started"))
    assert daemon_main(["--endpoint", "tcp://*:5557",
                        "--redis-url-env", "KVTIER_TEST_DAEMON_URL"]) == 2
    err = capsys.readouterr().err
    assert "--redis-url-env (redis_url_env): the URL in $KVTIER_TEST_DAEMON_URL" in err
    assert "port must be an integer" in err and "hunter2" not in err


def test_help_shows_the_real_host_tier_socket_default() -> None:
    name = DaemonConfig.model_fields["host_tier_name"].get_default(call_default_factory=True)
    real = default_host_tier_socket(name)
    assert real == DaemonConfig(cpu_bytes=1 << 22).host_tier_socket_path
    assert f"(defaulthere:{real};" in _help()
    assert "$XDG_RUNTIME_DIR/kvtier/host.sock" not in build_parser().format_help()


def test_every_shown_flag_has_help() -> None:
    bare = [a.option_strings for a in build_parser()._actions
            if a.option_strings and not a.help]
    assert bare == []
    assert "--replay-timeout-s" in _help() and "--log-levelLEVELDEBUG,INFO,WARNINGorERROR" \
        in _help()


def test_flags_are_the_yaml_keys_with_dashes() -> None:
    """Every flag that sets one flat key is that key with dashes (--redis-timeout-s,
    --replay-timeout-s); only the structured and the negated flags differ."""
    special = {"--endpoint", "--block-size", "--score-weight", "--janitor-allowed-fingerprint",
               "--no-replay-on-start", "--config", "--help", "-h"}
    odd = []
    for action in build_parser()._actions:
        if action.help == argparse.SUPPRESS:
            continue
        for flag in action.option_strings:
            if flag not in special and flag != "--" + action.dest.replace("_", "-"):
                odd.append((flag, action.dest))
    assert odd == []


@pytest.mark.parametrize(("old", "new"), DEPRECATED_FLAGS.items())
def test_old_flag_names_still_parse_hidden_and_say_so(old: str, new: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    by_old = build_parser().parse_args([old, "7"])
    by_new = build_parser().parse_args([new, "7"])
    dest = new.removeprefix("--").replace("-", "_")
    assert getattr(by_old, dest) == getattr(by_new, dest) == 7.0
    assert f"{old} is deprecated; use {new}" in capsys.readouterr().err
    assert old + " " not in build_parser().format_help() and new in build_parser().format_help()


def test_kvtier_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvtier_main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert out == f"kvtier {version()}" and version() == pyproject
    assert kvtier_main(["-V"]) == 0 and capsys.readouterr().out.strip() == out


def test_version_falls_back_to_pyproject(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert version() == pyproject

"""``kvtier daemon``: parse flags + YAML, run until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

import zmq

from connector.daemon.config import (
    ConfigError,
    DaemonConfig,
    default_host_tier_socket,
    load_config,
)

__all__ = ["build_parser", "main", "run"]

log = logging.getLogger("kvtier.daemon")

#: Old flag names still read (hidden from --help), and the names that replaced them: a flag
#: is its YAML key with dashes.
DEPRECATED_FLAGS = {"--replay-timeout": "--replay-timeout-s", "--storage-ttl": "--storage-ttl-s",
                    "--replay-idle-probe": "--replay-idle-probe-s",
                    "--janitor-interval": "--janitor-interval-s"}


class _DeprecatedFlag(argparse.Action):
    """An old flag name: stores like the new one, says once that it is deprecated."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"kvtier daemon: {option_string} is deprecated; use "
              f"{DEPRECATED_FLAGS[str(option_string)]}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _add_flag(group: Any, name: str, **kwargs: Any) -> None:
    """``name`` and, when it replaced one, the old name as a hidden deprecated alias."""
    group.add_argument(name, **kwargs)
    for old, new in DEPRECATED_FLAGS.items():
        if new == name:
            group.add_argument(old, type=kwargs["type"], dest=kwargs["dest"],
                               action=_DeprecatedFlag, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvtier daemon",
        description="Subscribe to vLLM KV-event streams, keep a partial-aware index of "
                    "which prefix lives in which tier, serve look-ups and metrics.",
    )
    p.add_argument("--config", help="YAML file (see configs/daemon.yaml); flags override it")
    p.add_argument("--endpoint", action="append", metavar="PUB[,REPLAY]",
                   help="a publisher as in vLLM's KVEventsConfig: the PUB endpoint and "
                        "optionally its replay endpoint, e.g. 'tcp://*:5557,tcp://*:5558'. "
                        "Repeatable. '*' => vLLM binds, the daemon connects; no '*' => "
                        "vLLM connects, the daemon binds.")
    p.add_argument("--dp-size", type=int, help="data-parallel ranks per publisher "
                   "(ports offset by rank, as vLLM does)")
    p.add_argument("--topic", help="ZMQ topic (vLLM's KVEventsConfig.topic)")
    p.add_argument("--kv-cache-report-mode", choices=("incremental", "full"),
                   help="the engines' requests use vLLM's kv_cache_report_mode=full "
                        "(reused GPU blocks re-announced): count GPU residency as a set")
    _add_flag(p, "--storage-ttl-s", type=float, dest="storage_ttl_s", metavar="SECONDS",
              help="STORAGE entries expire this long after their last announcement "
                   "(Redis TTL expiry is never announced); default: never")
    p.add_argument("--http", help="HOST:PORT for the HTTP API (default 127.0.0.1:9400)")
    p.add_argument("--connect-host", help="host replacing '*' when connecting")
    p.add_argument("--block-size", action="append", metavar="GROUP=SIZE",
                   help="physical block size of a KV-cache group (else learned from full "
                        "announcements). Repeatable.")
    p.add_argument("--max-entries", type=int, help="cap on resident index entries")
    p.add_argument("--max-pending-batches", type=int,
                   help="live batches buffered while a replay is in flight (default 10000)")
    p.add_argument("--hwm", type=int, help="ZMQ receive high-water mark per SUB socket "
                   "(default 100000)")
    p.add_argument("--clear-on-restart", type=_media_list, metavar="MEDIA",
                   help="comma-separated media dropped when a publisher's seq returns to 0 "
                        "(default GPU,CPU; '' for none)")
    p.add_argument("--score-weight", action="append", metavar="MEDIUM=WEIGHT",
                   dest="score_weights",
                   help="POST /score's weight of a tier (e.g. STORAGE=0.5). Repeatable.")
    _add_flag(p, "--replay-timeout-s", type=float, dest="replay_timeout_s", metavar="SECONDS",
              help="give up a replay after this long; its gap is counted unrepaired "
                   "(default 5)")
    _add_flag(p, "--replay-idle-probe-s", type=float, dest="replay_idle_probe_s",
              metavar="SECONDS",
              help="seconds of silence before asking the replay buffer for batches "
                   "lost with nothing after them (0 disables; default 2)")
    rp = p.add_mutually_exclusive_group()
    rp.add_argument("--replay-on-start", dest="replay_on_start", action="store_true",
                    default=None, help="ask each publisher for its buffered batches at start")
    rp.add_argument("--no-replay-on-start", dest="replay_on_start", action="store_false",
                    help="start from the live stream only")
    p.add_argument("--log-level", metavar="LEVEL",
                   help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    _add_redis_flags(p)
    _add_host_tier_flags(p)
    return p


def _add_redis_flags(p: argparse.ArgumentParser) -> None:
    """The Redis connection and the janitor."""
    j = p.add_argument_group("Redis: the janitor, and with --cpu-bytes the host tier's "
                             "write-behind and restores (off unless --redis-url or redis_url)")
    j.add_argument("--redis-url", help="the Redis tier's URL (redis://, rediss://, unix://, "
                   "+cluster) without a password (ps shows flags): see the next three")
    j.add_argument("--redis-url-env", help="name of an environment variable holding the URL "
                   "(password included)")
    j.add_argument("--redis-password-file", help="a file only this user can read holding the "
                   "Redis password (with --redis-url; --redis-username for an ACL user)")
    j.add_argument("--redis-password-env", help="name of an environment variable holding the "
                   "Redis password (with --redis-url; --redis-username for an ACL user)")
    j.add_argument("--redis-username", help="the Redis ACL user (with --redis-password-file "
                   "or --redis-password-env)")
    j.add_argument("--redis-prefix", help="key prefix of the Redis tier (default kvtier)")
    j.add_argument("--redis-ttl-s", type=int, dest="redis_ttl_s",
                   help="seconds values the host tier writes behind live (default 7 days)")
    j.add_argument("--redis-ssl-ca-certs", help="CA bundle for rediss:// with a private CA")
    j.add_argument("--redis-timeout-s", type=float, dest="redis_timeout_s",
                   help="bound on every Redis wait, seconds (default 2)")
    j.add_argument("--janitor-scan-count", type=int, help="SCAN COUNT (default 100)")
    j.add_argument("--janitor-allowed-fingerprint", action="append", metavar="FP",
                   dest="janitor_allowed_fingerprints",
                   help="a namespace in use (32 hex digits); with any given, values of other "
                        "namespaces are deleted as retired. Repeatable.")
    _add_flag(j, "--janitor-interval-s", type=float, dest="janitor_interval_s",
              metavar="SECONDS", help="seconds between passes (default 300)")
    j.add_argument("--janitor-max-keys-per-s", type=float, dest="janitor_max_keys_per_s",
                   help="SCAN pace: keys Redis examines per second (default 2000)")
    j.add_argument("--janitor-max-keys-per-pass", type=int, dest="janitor_max_keys_per_pass",
                   help="cut a pass after this many keys, resume there next time (0 = all)")
    j.add_argument("--janitor-dry-run", action="store_true", default=None,
                   dest="janitor_dry_run", help="count what would be deleted, delete nothing")


def _add_host_tier_flags(p: argparse.ArgumentParser) -> None:
    """The host's shared CPU tier."""
    h = p.add_argument_group("host tier (off unless --cpu-bytes or cpu_bytes is given)")
    h.add_argument("--cpu-bytes", type=_size, dest="cpu_bytes",
                   help="bytes of shared memory for the host's CPU tier (e.g. 8G)")
    h.add_argument("--slot-bytes", type=_size, dest="slot_bytes",
                   help="bytes per slot: at least one engine rank's block (default 2M)")
    h.add_argument("--host-tier-socket", dest="host_tier_socket",
                   help="Unix socket engines connect to (default here: "
                        f"{default_socket_here().replace('%', '%%')}; in general "
                        "$XDG_RUNTIME_DIR/kvtier/NAME.sock, or /tmp/kvtier-UID/NAME.sock "
                        "without XDG_RUNTIME_DIR, NAME being --host-tier-name)")
    h.add_argument("--host-tier-name", dest="host_tier_name",
                   help="names the segment /dev/shm/kvtier-NAME (default host-<uid>)")
    h.add_argument("--host-tier-group", dest="host_tier_group",
                   help="group allowed to attach (segment and socket 0660); default: only "
                        "this user (0600)")
    h.add_argument("--host-tier-max-clients", type=int,
                   help="engine processes attached at once (default 256)")


def default_socket_here() -> str:
    """The host tier's socket when no flag or key names it: the default name's."""
    name = DaemonConfig.model_fields["host_tier_name"].get_default(call_default_factory=True)
    return default_host_tier_socket(name)


def flags_given(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """Each setting a flag gave -> that flag (as spelled now): its errors name the flag."""
    out: dict[str, str] = {}
    for action in parser._actions:
        shown = action.help != argparse.SUPPRESS and action.option_strings
        if shown and getattr(args, action.dest, None) is not None:
            out.setdefault(action.dest, action.option_strings[-1])
    if "endpoint" in out:
        out["publishers"] = out["replay_endpoint"] = out["endpoint"]
    return out


def _size(text: str) -> int:
    """``8G``, ``512M``, ``64k`` or plain bytes (powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    scale = units.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in units else t
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 8G, 512M, 65536)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 bytes")
    return value


def _media_list(text: str) -> list[str]:
    """``GPU,CPU`` -> ["GPU", "CPU"]; ``""`` -> [] (the config checks the names)."""
    return [m.strip() for m in text.split(",") if m.strip()]


def _pairs(flag: str, specs: list[str], value: type) -> dict[str, Any]:
    """``["A=1", ...]`` -> {"A": value("1")}; ConfigError naming ``flag`` otherwise."""
    out: dict[str, Any] = {}
    for spec in specs:
        name, sep, text = spec.partition("=")
        try:
            if not sep or not name.strip():
                raise ValueError
            out[name.strip()] = value(text.strip())
        except ValueError:
            raise ConfigError(f"{flag} expects NAME=VALUE, got {spec!r}") from None
    return out


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "http": args.http, "connect_host": args.connect_host, "max_entries": args.max_entries,
        "replay_timeout_s": args.replay_timeout_s, "replay_on_start": args.replay_on_start,
        "replay_idle_probe_s": args.replay_idle_probe_s,
        "log_level": args.log_level, "storage_ttl_s": args.storage_ttl_s,
        "redis_url": args.redis_url, "redis_prefix": args.redis_prefix,
        "redis_url_env": args.redis_url_env, "redis_username": args.redis_username,
        "redis_password_file": args.redis_password_file, "redis_ttl_s": args.redis_ttl_s,
        "redis_password_env": args.redis_password_env,
        "janitor_interval_s": args.janitor_interval_s,
        "janitor_max_keys_per_s": args.janitor_max_keys_per_s,
        "janitor_max_keys_per_pass": args.janitor_max_keys_per_pass,
        "janitor_dry_run": args.janitor_dry_run,
        "cpu_bytes": args.cpu_bytes, "slot_bytes": args.slot_bytes,
        "host_tier_socket": args.host_tier_socket, "host_tier_name": args.host_tier_name,
        "host_tier_group": args.host_tier_group,
        "max_pending_batches": args.max_pending_batches, "hwm": args.hwm,
        "clear_on_restart": args.clear_on_restart,
        "redis_ssl_ca_certs": args.redis_ssl_ca_certs, "redis_timeout_s": args.redis_timeout_s,
        "janitor_scan_count": args.janitor_scan_count,
        "janitor_allowed_fingerprints": args.janitor_allowed_fingerprints,
        "host_tier_max_clients": args.host_tier_max_clients,
    }
    if args.score_weights:
        out["score_weights"] = _pairs("--score-weight", args.score_weights, float)
    if args.endpoint:
        pubs = []
        for spec in args.endpoint:
            pub, _, replay = spec.partition(",")
            entry: dict[str, Any] = {"endpoint": pub.strip()}
            if replay.strip():
                entry["replay_endpoint"] = replay.strip()
            if args.dp_size is not None:
                entry["dp_size"] = args.dp_size
            if args.topic is not None:
                entry["topic"] = args.topic
            if args.kv_cache_report_mode is not None:
                entry["kv_cache_report_mode"] = args.kv_cache_report_mode
            pubs.append(entry)
        out["publishers"] = pubs
    elif (args.dp_size is not None or args.topic is not None
          or args.kv_cache_report_mode is not None):
        raise ConfigError("--dp-size/--topic/--kv-cache-report-mode apply to --endpoint "
                          "publishers; give --endpoint")
    if args.block_size:
        sizes: dict[int, int] = {}
        for spec in args.block_size:
            g, sep, b = spec.partition("=")
            if not sep or not g.strip().isdigit() or not b.strip().isdigit():
                raise ConfigError(f"--block-size expects GROUP=SIZE, got {spec!r}")
            sizes[int(g)] = int(b)
        out["block_sizes"] = sizes
    return out


def say_line(text: str) -> None:
    """One whole line to stdout in one write, flushed: ``print`` writes the text and its
    newline separately, and a log line from another thread (stderr, often the same pipe)
    could land between them (a supervisor reading "listening on ...:PORT" then read the
    log's first digits into the port)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


async def _serve(cfg: DaemonConfig) -> int:
    from aiohttp import web

    from connector.daemon.http import make_app
    from connector.daemon.service import Daemon

    try:
        daemon = Daemon(cfg)
    except zmq.ZMQError as exc:
        print(f"kvtier daemon: cannot open publisher sockets: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"kvtier daemon: {exc}", file=sys.stderr)
        return 2
    runner = web.AppRunner(make_app(daemon), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, cfg.http_host, cfg.http_port)
        await site.start()
    except OSError as exc:
        print(f"kvtier daemon: cannot listen on {cfg.http}: {exc.strerror}", file=sys.stderr)
        await runner.cleanup()
        daemon.subscriber.close()
        return 1
    try:
        daemon.start()
    except OSError as exc:  # /dev/shm full, socket path taken, ...
        print(f"kvtier daemon: cannot start the host tier: {exc}", file=sys.stderr)
        await runner.cleanup()
        daemon.stop()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bound = site._server.sockets[0].getsockname() if site._server else cfg.http  # type: ignore
    log.info("kvtier daemon: %d source(s); HTTP on %s", len(daemon.subscriber.sources), bound)
    host_tier = daemon.parts.host_tier
    if host_tier is not None:
        service = host_tier.redis_service
        redis = (f"; Redis write-behind and restores through {service.redis.target.redacted}"
                 if service is not None else "")
        say_line(f"kvtier host tier: {host_tier.num_slots} slots of {host_tier.slot_bytes} "
                 f"bytes on {host_tier.socket_path}{redis}")
    say_line(f"kvtier daemon listening on http://{bound[0]}:{bound[1]}")
    await stop.wait()
    log.info("kvtier daemon: shutting down")
    await runner.cleanup()
    await asyncio.to_thread(daemon.stop)
    return 0


def run(cfg: DaemonConfig) -> int:
    """Run the daemon in the foreground until SIGTERM/SIGINT; return the exit code."""
    logging.basicConfig(level=cfg.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(_serve(cfg))


def main(argv: list[str]) -> int:
    """Entry point used by ``kvtier daemon``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, _overrides(args), flags_given(parser, args))
    except ConfigError as exc:
        print(f"kvtier daemon: {exc}", file=sys.stderr)
        return 2
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

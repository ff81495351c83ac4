"""Daemon configuration: YAML file + command-line flags, validated with pydantic."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from connector.events.wire import Medium
from offload_tiers.redis.settings import REDIS_FIXES, RedisConnectionSettings, RedisSettingError

__all__ = ["ConfigError", "DaemonConfig", "PublisherConfig", "load_config", "offset_endpoint"]

log = logging.getLogger(__name__)

_ENDPOINT_RE = re.compile(r"^(tcp://[^\s]+:\d+|ipc://\S+|inproc://\S+)$")
_TIER_MEDIA = ("CPU", "STORAGE")
#: Old setting names still read, and the names that replaced them.
DEPRECATED_NAMES = {"redis_socket_timeout_s": "redis_timeout_s"}

_MEDIA = frozenset(m.value for m in Medium)


class ConfigError(ValueError):
    """A configuration problem, with a message meant for the operator."""


def _check_endpoint(value: str, what: str) -> str:
    if not _ENDPOINT_RE.match(value):
        raise ValueError(
            f"{what} {value!r} is not a ZMQ endpoint: use tcp://HOST:PORT, "
            "tcp://*:PORT, ipc://PATH or inproc://NAME"
        )
    return value


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's ``offset_endpoint_port``: DP rank ``r`` uses port + r (tcp) or a ``_dp{r}`` suffix."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class PublisherConfig(BaseModel):
    """One vLLM engine's KV-event publisher, written exactly as in vLLM's ``KVEventsConfig``.

    ``endpoint`` with ``*`` (or ipc/inproc): vLLM binds, the daemon connects (``*`` is
    replaced by ``connect_host``). Without ``*``: vLLM connects, so the daemon binds it.
    ``replay_endpoint`` is always bound by vLLM (ROUTER); the daemon connects a DEALER.

    How repeated announcements count (see :mod:`connector.events.index`): ``set_media`` are sets
    (one entry per hash; one removal removes it): kvtier's CPU tier and Redis. Give ``[]``
    for a connector that re-announces and expects refcounts (vLLM's OffloadingConnector).
    ``kv_cache_report_mode: full`` (vLLM's request setting of that name, used by this
    engine's requests) makes GPU a set too: that mode re-announces reused blocks with no
    matching removal.
    """

    model_config = ConfigDict(extra="forbid")

    endpoint: str
    replay_endpoint: str | None = None
    dp_size: int = Field(default=1, ge=1, le=1024)
    topic: str = ""
    name: str | None = None
    set_media: list[str] = Field(default_factory=lambda: list(_TIER_MEDIA))
    kv_cache_report_mode: Literal["incremental", "full"] = "incremental"

    @field_validator("set_media")
    @classmethod
    def _set_media(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if m not in _TIER_MEDIA]
        if bad:
            raise ValueError(f"set_media: {bad} are not tier media; use CPU, STORAGE (for GPU "
                             "set kv_cache_report_mode: full)")
        return v

    @property
    def source_name(self) -> str:
        """The publisher id without its ``#dp{rank}`` (metrics label, residency policy)."""
        return self.name or self.endpoint

    def set_media_all(self) -> frozenset[str]:
        """Media whose residency is a set for this publisher."""
        full = {"GPU"} if self.kv_cache_report_mode == "full" else set()
        return frozenset(self.set_media) | full

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        return _check_endpoint(v, "endpoint")

    @field_validator("replay_endpoint")
    @classmethod
    def _replay(cls, v: str | None) -> str | None:
        return None if v is None else _check_endpoint(v, "replay_endpoint")


class TokenHashingConfig(BaseModel):
    """Lets POST /lookup take ``token_ids``: the engine's hash settings, copied exactly."""

    model_config = ConfigDict(extra="forbid")

    algo: str = "sha256"  # vLLM's --prefix-caching-hash-algo
    hash_block_size: int = Field(gt=0)  # block size, or prefix_match_unit on hybrid models
    seed: str | None = None  # the engine's PYTHONHASHSEED, if it sets one

    @field_validator("algo")
    @classmethod
    def _algo(cls, v: str) -> str:
        from connector.events.token_hashing import ALGORITHMS

        if v not in ALGORITHMS:
            raise ValueError(f"unknown algo {v!r}; use one of {sorted(ALGORITHMS)}")
        return v

    @model_validator(mode="after")
    def _seed(self) -> TokenHashingConfig:
        if self.algo.startswith("xxhash") and self.seed is None:
            raise ValueError(f"{self.algo} needs 'seed' = the engine's PYTHONHASHSEED "
                             "(vLLM seeds it randomly per process otherwise)")
        return self


class DaemonConfig(RedisConnectionSettings):
    """Everything ``kvtier daemon`` can be told (see configs/daemon.yaml). Its Redis (the
    janitor's and the host tier's) is reached as :class:`RedisConnectionSettings` say."""

    model_config = ConfigDict(extra="forbid")

    publishers: list[PublisherConfig] = Field(default_factory=list)
    http: str = "127.0.0.1:9400"
    connect_host: str = "127.0.0.1"
    replay_on_start: bool = True
    replay_timeout_s: float = Field(default=5.0, gt=0, le=600)
    replay_idle_probe_s: float = Field(default=2.0, ge=0, le=3600)
    max_pending_batches: int = Field(default=10_000, ge=1)
    max_entries: int = Field(default=10_000_000, ge=1)
    block_sizes: dict[int, int] = Field(default_factory=dict)
    hwm: int = Field(default=100_000, ge=0)
    clear_on_restart: list[str] = Field(default_factory=lambda: ["GPU", "CPU"])
    # Redis drops values at their TTL and announces nothing: STORAGE entries expire this long
    # after their last announcement (the connector's redis_ttl_s, a little less). None: never.
    storage_ttl_s: float | None = Field(default=None, gt=0)
    log_level: str = "INFO"
    token_hashing: TokenHashingConfig | None = None
    # POST /score's tier weights (medium -> weight >= 0); a body's "weights" override them
    score_weights: dict[str, float] = Field(default_factory=dict)
    # Redis (the janitor, offload_tiers/redis/janitor.py, and the host tier's write-behind;
    # off unless redis_url or redis_url_env is set): RedisConnectionSettings' fields, with
    # a longer bound on every Redis wait (the old name redis_socket_timeout_s is still read)
    redis_timeout_s: float = Field(
        default=2.0, gt=0, le=60,
        validation_alias=AliasChoices("redis_timeout_s", "redis_socket_timeout_s"))
    janitor_interval_s: float = Field(default=300.0, gt=0, le=7 * 86400)
    janitor_scan_count: int = Field(default=100, ge=1, le=10_000)
    janitor_max_keys_per_s: float = Field(default=2000.0, gt=0)
    janitor_max_keys_per_pass: int = Field(default=0, ge=0)
    janitor_allowed_fingerprints: list[str] | None = None
    janitor_dry_run: bool = False
    # The host tier (off unless cpu_bytes is set): one CPU tier in shared memory for every
    # engine on this host; see offload_tiers/host_tier/
    cpu_bytes: int | None = Field(default=None, gt=0)
    slot_bytes: int = Field(default=2 * 1024 * 1024, gt=0, le=1 << 30)
    host_tier_socket: str | None = None  # default: $XDG_RUNTIME_DIR or /tmp, see property
    # /dev/shm/kvtier-<name>: one per user by default
    host_tier_name: str = Field(default_factory=lambda: f"host-{os.getuid()}",
                                pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")
    host_tier_max_clients: int = Field(default=256, ge=1, le=65536)
    host_tier_group: str | None = None  # share segment and socket with this group (0660)
    @field_validator("janitor_allowed_fingerprints")
    @classmethod
    def _fingerprints(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return None
        bad = [f for f in v if not re.fullmatch(r"[0-9a-fA-F]{32}", f)]
        if bad:
            raise ValueError(f"janitor_allowed_fingerprints: {bad[:3]} are not 32 hex digits "
                             "(a Namespace.fingerprint)")
        return [f.lower() for f in v]

    @model_validator(mode="after")
    def _janitor(self) -> DaemonConfig:
        try:
            url, warnings = self.resolve_url(
                exposure="a --redis-url flag is visible to every user of this host (ps), and "
                         "a YAML file is only as private as its mode")
        except RedisSettingError as exc:  # "key: ..." (_format_errors reads the key from it)
            raise ValueError(f"{exc.key}: {exc}") from None
        self.redis_url = url
        self._redis_warnings = tuple(warnings)
        if self.redis_url is None and self.janitor_allowed_fingerprints is not None:
            raise ValueError("janitor_allowed_fingerprints needs redis_url")
        return self

    @model_validator(mode="after")
    def _something_to_do(self) -> DaemonConfig:
        if not self.publishers and self.cpu_bytes is None:
            raise ValueError("give publishers (engines' KV-event endpoints) or cpu_bytes "
                             "(the host tier), or both")
        if self.cpu_bytes is not None and self.cpu_bytes < self.slot_bytes:
            raise ValueError(f"cpu_bytes {self.cpu_bytes} is less than one slot "
                             f"(slot_bytes {self.slot_bytes})")
        return self

    @property
    def host_tier_socket_path(self) -> str:
        """The host tier's Unix socket: ``host_tier_socket``, else
        ``$XDG_RUNTIME_DIR/kvtier/<name>.sock`` (or ``/tmp/kvtier-<uid>/<name>.sock``)."""
        if self.host_tier_socket:
            return self.host_tier_socket
        return default_host_tier_socket(self.host_tier_name)

    @field_validator("http")
    @classmethod
    def _http(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"http must be HOST:PORT, got {v!r}")
        return v

    @field_validator("block_sizes")
    @classmethod
    def _sizes(cls, v: dict[int, int]) -> dict[int, int]:
        for g, b in v.items():
            if g < 0 or b <= 0:
                raise ValueError(f"block_sizes: group {g} -> {b}: groups >= 0, sizes > 0")
        return v

    @field_validator("score_weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        from connector.events.score import weights_from

        weights_from(v)  # a ValueError naming weights.<medium>
        return v

    @field_validator("clear_on_restart")
    @classmethod
    def _mediums(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if m not in _MEDIA]
        if bad:
            raise ValueError(f"clear_on_restart: unknown media {bad}; use "
                             + ", ".join(sorted(_MEDIA)))
        return v

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        v = v.upper()
        if v not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {v!r}")
        return v

    @property
    def http_host(self) -> str:
        return self.http.rpartition(":")[0].strip("[]")

    @property
    def http_port(self) -> int:
        return int(self.http.rpartition(":")[2])


def default_host_tier_socket(name: str) -> str:
    """Where an engine finds the host tier ``name`` when it is given no socket path."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "kvtier" if runtime else Path(f"/tmp/kvtier-{os.getuid()}")
    return str(base / f"{name}.sock")


def _known_keys(loc: tuple[Any, ...]) -> str:
    """The keys allowed where ``loc`` (an unknown key's place) points."""
    model: type[BaseModel] = DaemonConfig
    if loc[:1] == ("publishers",):
        model = PublisherConfig
    elif loc[:1] == ("token_hashing",):
        model = TokenHashingConfig
    return ", ".join(sorted(model.model_fields))


def _setting(loc: tuple[Any, ...], msg: str, flags: dict[str, str]) -> tuple[str, str]:
    """The setting an error is about, as the user gave it (``--flag (key)`` when a flag set
    it), and the message without the key a model validator put in front of it."""
    if not loc:  # a model validator's error: "key: ..." when it is about one setting
        head, sep, rest = msg.partition(": ")
        if sep and head in DaemonConfig.model_fields:
            loc, msg = (head,), rest
    where = ".".join(str(p) for p in loc) or "(top level)"
    flag = flags.get(str(loc[0])) if loc else None
    if loc[:1] == ("publishers",) and "publishers" in flags and len(loc) > 2:
        flag = flags.get(str(loc[-1]), flags["publishers"])  # --endpoint, --dp-size, ...
    return (f"{flag} ({where})" if flag else where), msg


def _format_errors(exc: ValidationError, flags: dict[str, str] | None = None) -> str:
    lines = []
    for err in exc.errors():
        msg = err["msg"].removeprefix("Value error, ")
        where, msg = _setting(tuple(err["loc"]), msg, flags or {})
        if err["type"] == "extra_forbidden":
            msg = (f"unknown setting. Fix: remove it or correct its spelling; known keys: "
                   f"{_known_keys(tuple(err['loc']))}")
        elif (key := where.rpartition("(")[2].rstrip(")")) in REDIS_FIXES:
            msg = f"{msg}. Fix: {REDIS_FIXES[key]}"
        lines.append(f"  {where}: {msg}")
    return "invalid daemon configuration:\n" + "\n".join(lines)


def load_config(path: str | Path | None, overrides: dict[str, Any],
                flags: dict[str, str] | None = None) -> DaemonConfig:
    """Read ``path`` (YAML, optional), apply flag ``overrides``, validate. :class:`ConfigError`.

    ``flags`` maps a setting to the flag that set it: its errors name the flag."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = dict(loaded or {})
    data.update({k: v for k, v in overrides.items() if v is not None})
    for old, new in DEPRECATED_NAMES.items():
        if old in data:
            log.warning("daemon configuration: %s is deprecated; call it %s", old, new)
    try:
        return DaemonConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, flags)) from None

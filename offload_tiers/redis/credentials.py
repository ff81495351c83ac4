"""Redis credentials that never travel in a configuration that gets printed.

vLLM prints its whole kv-transfer config at start (``kv_connector_extra_config`` included),
so a password inside ``redis_url`` ends up in the engine's log. Two ways keep it out, for
the connector, the native tier and the daemon alike:

* ``redis_url_env``: the name of an environment variable that holds the whole URL (vLLM's
  engine core and worker processes inherit the environment of the process that starts
  them, under every executor kvtier supports);
* ``redis_password_file`` (and ``redis_username``): a file the engine's user can read,
  whose content (one trailing newline stripped) is the password;
* ``redis_password_env`` (and ``redis_username``): an environment variable that holds the
  password.

:func:`resolve_redis_url` turns the settings into the URL to connect with; it lives only in
memory. :func:`inline_password_warning` is the one warning a URL with an inline password gets.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from offload_tiers.redis.url import parse_redis_url, redact_url


def read_password_file(path_value: str) -> tuple[str, str | None]:
    """The password in ``path_value`` and a warning when other users can read the file."""
    path = Path(path_value).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the password file {path} ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"the password file {path} is not UTF-8 text") from None
    password = text[:-1] if text.endswith("\n") else text
    password = password[:-1] if password.endswith("\r") else password
    if not password:
        raise ValueError(f"the password file {path} is empty")
    warning = None
    mode = path.stat().st_mode
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        warning = (f"the Redis password file {path} is readable by other users "
                   f"(mode {stat.S_IMODE(mode):04o}); make it private: chmod 600 {path}")
    return password, warning


def with_credentials(url: str, username: str | None, password: str | None) -> str:
    """``url`` with its user name and password replaced by these (quoted as URLs need)."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    user = quote(username, safe="") if username else ""
    if password is not None:
        creds = f"{user}:{quote(password, safe='')}@"
    else:
        old = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
        creds = f"{user}:{old.split(':', 1)[1]}@" if ":" in old else f"{user}@"
    return urlunsplit((parts.scheme, creds + host, parts.path, parts.query, parts.fragment))


def has_inline_password(url: str) -> bool:
    """Whether ``url`` itself carries a password (in its authority or its query)."""
    return redact_url(url) != url


VLLM_EXPOSURE = ("vLLM prints its whole kv-transfer config at start, so the password is in "
                 "this engine's log and in anything that records its command line")


def resolve_redis_url(url: str | None, *, url_env: str | None = None,
                      username: str | None = None, password_file: str | None = None,
                      password_env: str | None = None,
                      environ: Mapping[str, str] = os.environ,
                      exposure: str = VLLM_EXPOSURE) -> tuple[str | None, list[str]]:
    """The URL to connect with (None: no Redis) and warnings to log once; ``exposure``
    says where an inline password shows (vLLM's printed config by default).

    Raises ValueError, naming the setting at fault and never a secret.
    """
    warnings: list[str] = []
    if url_env:
        if url:
            raise ValueError("redis_url and redis_url_env are both set: give one of them")
        value = environ.get(url_env, "")
        if not value:
            raise ValueError(f"redis_url_env names {url_env}, which is not set (or empty) in "
                             f"this process's environment (pid {os.getpid()})")
        url = value.strip()
    if not url:
        if password_file or password_env or username:
            raise ValueError("redis_password_file, redis_password_env and redis_username "
                             "need redis_url or redis_url_env")
        return None, warnings
    if password_file and password_env:
        raise ValueError("redis_password_file and redis_password_env are both set: give one "
                         "of them")
    if password_env:
        password = environ.get(password_env, "")
        if not password:
            raise ValueError(f"redis_password_env names {password_env}, which is not set (or "
                             f"empty) in this process's environment (pid {os.getpid()})")
        url = with_credentials(url, username, password)
    elif password_file:
        password, warning = read_password_file(password_file)
        if warning:
            warnings.append(warning)
        url = with_credentials(url, username, password)
    elif username:
        url = with_credentials(url, username, None)
    elif not url_env and has_inline_password(url):
        warnings.append(inline_password_warning(url, exposure))
    try:
        parse_redis_url(url)  # the whole URL is one kvtier reaches (the message names no secret)
    except ValueError as exc:
        if url_env:
            raise ValueError(f"the URL in ${url_env}: {exc}") from None
        raise
    return url, warnings


def inline_password_warning(url: str, exposure: str = VLLM_EXPOSURE) -> str:
    """What a user who wrote the password into ``redis_url`` is told, once, at start."""
    return (f"redis_url {redact_url(url)} carries a password: {exposure}. "
            "Put the URL in an environment variable "
            "and name it with redis_url_env, or the password in a file only this user can "
            "read and name it with redis_password_file.")

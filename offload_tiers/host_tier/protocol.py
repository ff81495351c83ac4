"""Messages on the host tier's Unix socket: msgpack (msgspec), one length-prefixed frame each.

Client to daemon: ``Hello`` (first, once), ``Lease``, ``Commit``, ``Abandon``, ``Touch``,
``Bye``, and where the daemon has Redis (``Welcome.redis``) ``Probe`` and ``Restore``.
Daemon to client: ``Welcome`` (answers Hello, with the first part of the directory's
snapshot when the client subscribes; ``more``: the rest follows as ``Changes``), ``Leased``,
``Committed``, ``Changes`` (a subscriber's mirror updates, in the order they happened),
``Presence`` (to subscribers, where the daemon has Redis: key names it learned Redis
holds), ``Probed`` and ``Restored`` (each answers the request of its ``id``), ``Refused``
(then the daemon closes the connection).

Rules the protocol keeps:

* A lease belongs to one daemon run (``Welcome.instance``) and one client row. A commit or
  an abandon names the run its slots were leased from; the daemon refuses one of another
  run without touching a slot (a slot of this run may be leased to someone else by now).
* A client names itself (``Hello.client_id``, random per client object): a process that
  reconnects to the same run gets its row back, with its leases and pins; a client that
  closes with nothing in flight says ``Bye`` and its row is released at once.
* Every TP rank's shard of one save carries the save's one id; a restore is answered only
  with the save it asked for.

A frame is a 4-byte big-endian length and that many bytes; anything else (a frame over
:data:`MAX_FRAME`, bytes that do not decode to one of these messages) is a protocol error
that closes the connection. Nothing here is pickled or evaluated.
"""

from __future__ import annotations

import struct

import msgspec

#: 2: the daemon's Redis (Welcome.redis, Commit.redis, Probe, Restore); 3: leases bound to
#: a daemon run (Commit.instance, Abandon), client ids and Bye, chunked snapshots
PROTOCOL_VERSION = 3
MAX_FRAME = 256 * 1024 * 1024
_LEN = struct.Struct(">I")

#: (key digest, slot, save id, length) of one committed save
EntryTuple = tuple[bytes, int, int, int]
#: a Redis key (offload_tiers.keys.BlockKey): (fingerprint, group, block hash, tokens, kind)
KeyTuple = tuple[str, int, bytes, int, int]
#: write a committed save behind to Redis: (its Redis key, the save id its value carries,
#: whether to announce the key on the presence stream once written: TP rank 0's shard)
RedisWrite = tuple[KeyTuple, int, bool]


class Hello(msgspec.Struct, tag="hello"):
    version: int
    pid: int
    label: str
    subscribe: bool = False
    presence: bool = False  # a subscriber that wants the daemon's presence feed
    client_id: bytes = b""  # random per client object: a reconnect gets its row back


class Lease(msgspec.Struct, tag="lease"):
    n: int


class Commit(msgspec.Struct, tag="commit"):
    instance: str  # the daemon run the slots were leased from
    saves: list[EntryTuple]
    #: empty, or one per save: where the daemon writes it behind to Redis (None: nowhere)
    redis: list[RedisWrite | None] = []


class Abandon(msgspec.Struct, tag="abandon"):
    """Leased slots given back unwritten or with a write that failed (freed, never served)."""

    instance: str
    slots: list[int]


class Bye(msgspec.Struct, tag="bye"):
    """The client closes with no write in flight and no pin held: release its row now."""


class Touch(msgspec.Struct, tag="touch"):
    digests: list[bytes]


class Probe(msgspec.Struct, tag="probe"):
    """Which save of each key Redis holds (answered by ``Probed``)."""

    id: int
    keys: list[KeyTuple]


class Restore(msgspec.Struct, tag="restore"):
    """Read these values from Redis into host-tier slots (answered by ``Restored``): per
    item the host digest to store it under, its Redis key, the Redis save id asked for and
    the value's payload length."""

    id: int
    items: list[tuple[bytes, KeyTuple, int, int]]


class Welcome(msgspec.Struct, tag="welcome"):
    version: int
    instance: str  # this daemon run's id: a new one means a new directory
    segment_path: str
    pins_path: str
    row: int
    num_slots: int
    slot_bytes: int
    entries: list[EntryTuple] = []
    redis: bool = False  # the daemon writes commits behind to Redis and restores from it
    # a subscriber's start of the presence summary: the digests (offload_tiers.presence,
    # packed) of the key names the daemon learned Redis holds, the newest last
    presence: bytes = b""
    presence_synced: bool = False  # the daemon's walk of the key names is complete
    more: bool = False  # the snapshot goes on in Changes (bounded chunks) before any update
    leased: list[int] = []  # a row given back to its client: the slots leased to it


class Leased(msgspec.Struct, tag="leased"):
    slots: list[int]


class Committed(msgspec.Struct, tag="committed"):
    kept: list[int]
    dropped: list[int]


class Changes(msgspec.Struct, tag="changes"):
    added: list[EntryTuple]
    removed: list[bytes]


class Presence(msgspec.Struct, tag="presence"):
    """Key-name digests (packed) the daemon learned since its last ``Presence``, and
    whether its feed is synced (walked the names since its last Redis failure)."""

    digests: bytes
    synced: bool


class Probed(msgspec.Struct, tag="probed"):
    id: int
    save_ids: list[int]  # 0: no valid value


class Restored(msgspec.Struct, tag="restored"):
    id: int
    where: list[EntryTuple | None]  # the committed entry, or None: not restored


class Refused(msgspec.Struct, tag="refused"):
    reason: str


ToDaemon = Hello | Lease | Commit | Abandon | Touch | Bye | Probe | Restore
ToClient = Welcome | Leased | Committed | Changes | Presence | Probed | Restored | Refused

_encoder = msgspec.msgpack.Encoder()
_to_daemon = msgspec.msgpack.Decoder(ToDaemon)
_to_client = msgspec.msgpack.Decoder(ToClient)


class ProtocolError(ValueError):
    """A frame that is not a message of this protocol."""


def frame(message: ToDaemon | ToClient) -> bytes:
    body = _encoder.encode(message)
    return _LEN.pack(len(body)) + body


def split_frames(buffer: bytearray) -> list[bytes]:
    """Remove every complete frame from the front of ``buffer``; return their bodies."""
    bodies: list[bytes] = []
    pos = 0
    while len(buffer) - pos >= _LEN.size:
        (size,) = _LEN.unpack_from(buffer, pos)
        if size > MAX_FRAME:
            raise ProtocolError(f"frame of {size} bytes exceeds {MAX_FRAME}")
        if len(buffer) - pos - _LEN.size < size:
            break
        start = pos + _LEN.size
        bodies.append(bytes(buffer[start:start + size]))
        pos = start + size
    del buffer[:pos]
    return bodies


def decode_to_daemon(body: bytes) -> ToDaemon:
    try:
        return _to_daemon.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"not a host-tier request: {exc}") from None


def decode_to_client(body: bytes) -> ToClient:
    try:
        return _to_client.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"not a host-tier reply: {exc}") from None

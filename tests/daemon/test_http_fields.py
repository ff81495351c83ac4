"""The daemon's HTTP bodies and metrics (issue 45 items 5, 6), in process: a :class:`Daemon`
fed batches through its ingestor (kvtier's own wire structs, no vLLM), its aiohttp app served
by aiohttp's test server and client under pytest-asyncio.

* ``/score``: a ``weights`` medium that is not one (a typo) is a 400 naming the field and the
  known media, not a weight of 0; media the index holds besides the three may be weighed.
* hashes: ``0x``-prefixed hex is an int (any number of digits), plain hex is bytes (two digits
  a byte); plain hex with an odd number of digits is a 400 (ambiguous).
* ``/lookup`` naming a publisher the daemon does not know is a 400 naming ``publisher``.
* a malformed ``/lookup`` body is a 400 saying what is wrong; ``/entries`` names bytes hashes
  in the hex they were asked in.
* ``/metrics``: every family has a real HELP, and no gauge ends in ``_total``; host-tier counts
  since start are counters, only states are gauges.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from connector.daemon.config import DaemonConfig
from connector.daemon.http import make_app
from connector.daemon.service import HOST_TIER_GAUGES, HOST_TIER_HELP, Daemon
from connector.events import wire

SOURCE = "tcp://*:5557"
B = 16


def _batch(*events: Any, rank: int = 0) -> bytes:
    return wire.encode_batch(wire.KVEventBatch(ts=1.0, events=list(events),
                                               data_parallel_rank=rank))


def _stored(hashes: list[Any], medium: str = "GPU") -> wire.BlockStored:
    return wire.BlockStored(block_hashes=hashes, parent_block_hash=None,
                            token_ids=list(range(B * len(hashes))), block_size=B, lora_id=None,
                            medium=medium, lora_name=None, group_idx=0,
                            kv_cache_spec_kind="full_attention")


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon(DaemonConfig(publishers=[{"endpoint": SOURCE, "dp_size": 2}],
                            block_sizes={0: B}, http="127.0.0.1:0"))
    d.ingestor.ingest(SOURCE, 0, _batch(_stored([0x1F, 0x2A3])))
    d.ingestor.ingest(SOURCE, 0, _batch(_stored([bytes.fromhex("0abc"), b"\x01\x02"])))
    d.ingestor.ingest(SOURCE, 0, _batch(_stored([0x1F], medium="NVME")))
    yield d
    d.subscriber.close()


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[TestClient]:
    """The daemon's HTTP app on aiohttp's test server, in this process and event loop."""
    async with TestClient(TestServer(make_app(daemon))) as test_client:
        yield test_client


async def _post(client: TestClient, path: str, body: Any) -> tuple[int, Any]:
    resp = await client.post(path, json=body)
    return resp.status, await resp.json()


async def _get(client: TestClient, path: str) -> str:
    resp = await client.get(path)
    assert resp.status == 200
    return await resp.text()


@pytest.mark.parametrize(("weights", "says"), [
    ({"GPUU": 1.0}, "'weights.GPUU' is not a medium: known media CPU, GPU, NVME, STORAGE"),
    ({"stroage": 0.5}, "'weights.stroage' is not a medium"),
    ({"CPU": 1.0, "dsik": 1.0}, "'weights.dsik'"),
])
async def test_a_weights_typo_is_a_400_naming_the_field_and_the_media(
        client: TestClient, weights: dict, says: str) -> None:
    status, out = await _post(client, "/score", {"block_hashes": [0x1F], "weights": weights})
    assert status == 400 and says in out["error"], out


async def test_known_media_aliases_and_media_the_index_holds_may_be_weighed(
        client: TestClient) -> None:
    for weights in ({"cpu": 0.5}, {"disk": 0.1, "GPU": 2}, {"NVME": 0.3}, {"nvme": 0.3}):
        status, out = await _post(client, "/score", {"block_hashes": [0x1F], "weights": weights})
        assert status == 200, (weights, out)
    assert out["weights"]["NVME"] == 0.3


@pytest.mark.parametrize(("hashes", "tokens"), [
    ([0x1F, 0x2A3], 32),              # JSON ints
    (["0x1f", "0x2a3"], 32),          # 0x: an int, any number of digits (hex(h))
    (["0X1F", "0x000002a3"], 32),
    ([0x1F, "0x2A3"], 32),
    (["0abc", "0102"], 32),           # plain hex: bytes, two digits a byte (bytes.hex())
    (["0ABC"], 16),
    (["1f"], 0),                      # bytes 1f, not the int 0x1f
])
async def test_hash_spellings_and_what_they_mean(client: TestClient, hashes: list,
                                                 tokens: int) -> None:
    status, out = await _post(client, "/lookup", {"block_hashes": hashes})
    assert status == 200, out
    assert out["GPU"]["tokens"] == tokens, (hashes, out)


@pytest.mark.parametrize(("hashes", "says"), [
    (["abc"], "block_hashes[0] has an odd number of hex digits"),
    ([1, "0x"], "block_hashes[1] is not a hex string"),
    (["0xzz"], "block_hashes[0] is not a hex string"),
    (["0x-1"], "block_hashes[0] is not a hex string"),
    (["zz"], "block_hashes[0] is not a hex string"),
])
@pytest.mark.parametrize("path", ["/lookup", "/score"])
async def test_bad_hashes_are_a_400_naming_the_entry(client: TestClient, path: str, hashes: list,
                                                     says: str) -> None:
    status, out = await _post(client, path, {"block_hashes": hashes})
    assert status == 400 and says in out["error"], out


async def test_an_unknown_publisher_is_a_400_naming_the_field(client: TestClient) -> None:
    status, out = await _post(client, "/lookup", {"block_hashes": [0x1F], "publisher": "tcp://*:5557"})
    assert status == 400 and "'publisher' 'tcp://*:5557' is not a publisher" in out["error"]
    assert "tcp://*:5557#dp0" in out["error"]  # the known ones are listed
    status, out = await _post(client, "/lookup", {"block_hashes": [0x1F],
                                            "publisher": "tcp://*:5557#dp0"})
    assert status == 200 and out["GPU"]["tokens"] == 16
    # configured but not heard from yet (DP rank 1): a real publisher holding nothing
    status, out = await _post(client, "/lookup", {"block_hashes": [0x1F],
                                            "publisher": "tcp://*:5557#dp1"})
    assert status == 200 and out["GPU"]["tokens"] == 0


@pytest.mark.parametrize(("body", "fragment"), [
    (b"{not json", "not valid JSON"),
    ({"block_hashes": "x"}, "list of ints"),
    ({"block_hashes": [1, True]}, "not bool"),
    ({"block_hashes": ["zz"]}, "hex"),
    ({"block_hashes": [1], "group_idx": -1}, "group_idx"),
    ({"block_hashes": [1], "bogus": 1}, "unknown fields"),
    ({"token_ids": [1, 2]}, "token_hashing"),
    ([1, 2], "JSON object"),
])
async def test_bad_lookup_bodies_are_a_400_saying_what_is_wrong(client: TestClient, body: Any,
                                                                fragment: str) -> None:
    if isinstance(body, bytes):
        resp = await client.post("/lookup", data=body,
                                 headers={"Content-Type": "application/json"})
        status, out = resp.status, await resp.json()
    else:
        status, out = await _post(client, "/lookup", body)
    assert status == 400 and fragment in out["error"], (body, out)


async def test_a_good_lookup_of_an_unknown_hash_is_a_200_with_no_tokens(
        client: TestClient) -> None:
    status, out = await _post(client, "/lookup", {"block_hashes": ["00ff"], "group_idx": 0})
    assert status == 200 and out["any"]["tokens"] == 0


async def test_entries_name_bytes_hashes_in_the_hex_they_were_asked_in(
        client: TestClient) -> None:
    """Bytes hashes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) round-trip through hex."""
    status, body = await _post(client, "/entries", {"block_hashes": ["0abc", "0102"]})
    assert status == 200, body
    assert [e["block_hash"] for e in body["entries"]] == ["0abc", "0102"]
    assert [(e["num_tokens"], e["kind"]) for e in body["entries"]] == [(16, "FULL"),
                                                                       (32, "FULL")]


_PLACEHOLDER = re.compile(r"^(host tier \w+|host tier stat .*undocumented.*|[a-z_]+)$")


def _families(text: str) -> list[Any]:
    return list(text_string_to_metric_families(text))


def _check_families(text: str) -> list[str]:
    problems = []
    for fam in _families(text):
        if not fam.documentation or _PLACEHOLDER.match(fam.documentation):
            problems.append(f"{fam.name}: HELP {fam.documentation!r}")
        if fam.type == "gauge" and fam.name.endswith("_total"):
            problems.append(f"{fam.name}: a gauge named like a counter")
    return problems


async def test_every_daemon_metric_has_a_real_help_and_gauges_do_not_end_in_total(
        client: TestClient) -> None:
    text = await _get(client, "/metrics")
    assert "\nkvtier_daemon_index_entries 5.0\n" in text  # 2 int + 2 bytes hashes + NVME
    assert "# TYPE kvtier_daemon_index_entries gauge" in text
    assert _check_families(text) == []


def test_every_host_tier_metric_has_a_real_help(tmp_path: Path, redis_url: str) -> None:
    """A host tier with its Redis service and presence feed: every stat it exports."""
    d = Daemon(DaemonConfig(cpu_bytes=1 << 22, slot_bytes=1 << 16,
                            host_tier_socket=str(tmp_path / "run" / "h.sock"),
                            host_tier_name=f"test-{uuid.uuid4().hex[:12]}",
                            redis_url=redis_url, redis_prefix=f"kvtier-test-{uuid.uuid4().hex}",
                            http="127.0.0.1:0"))
    d.start()
    try:
        assert d.parts.host_tier is not None
        stats = d.parts.host_tier.stats()
        text = d.metrics_text()
        text = text.decode() if isinstance(text, bytes) else text
    finally:
        d.stop()
    numeric = {k for k, v in stats.items() if isinstance(v, int)}
    assert numeric - set(HOST_TIER_HELP) == set()
    assert "redis_writes" in numeric and "presence_learned" in numeric  # Redis service and feed on
    host = {f.name.removeprefix("kvtier_host_tier_"): f.type for f in _families(text)
            if f.name.startswith("kvtier_host_tier_")}
    assert set(host) == numeric
    # a count since start is a counter (rate() works on it); only states are gauges
    assert {n for n, kind in host.items() if kind == "gauge"} == numeric & HOST_TIER_GAUGES
    assert host["redis_writes"] == host["replaced"] == host["rows_reused"] == "counter"
    assert host["entries"] == host["connections"] == "gauge"
    assert _check_families(text) == []

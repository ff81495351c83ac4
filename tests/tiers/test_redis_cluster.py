"""RedisTier on a real 3-master Redis Cluster started by the test on loopback ports."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis.cluster import RedisCluster

from offload_tiers import codec
from offload_tiers.redis.tier import RedisTier
from rigs.daemon_proc import REPO
from rigs.tcp_proxy import TcpProxy
from tests.support.redis_cluster import RedisClusterProcs
from tests.tiers.faults import wait_until
from tests.tiers.helpers import key, payload

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    procs = RedisClusterProcs(Path(tmp_path_factory.mktemp("cluster"))).start()
    yield procs
    procs.stop()


def test_cluster_spreads_keys_and_round_trips(cluster: RedisClusterProcs,
                                              key_prefix: str) -> None:
    with RedisTier.from_url(cluster.url, prefix=key_prefix, strict=True) as t:
        assert t.target.cluster
        keys = [key(i) for i in range(300)]
        items = [(k, payload(k, 3000)) for k in keys]
        assert t.put_many(items) == 300
        per_node = cluster.total_keys(f"{key_prefix}:*")
        assert sum(per_node.values()) == 300 and all(n > 50 for n in per_node.values())
        got = t.get_many(keys + [key(999)])
        assert [bytes(g) for g in got[:-1]] == [p for _, p in items] and got[-1] is None
        assert t.exists_many(keys[:5] + [key(999)]) == [True] * 5 + [False]
        for k in keys[:10]:
            assert t.submit_put(k, payload(k, 100))
        assert t.flush(10)
        assert [bytes(g) for g in t.get_many(keys[:10])] == [payload(k, 100) for k in keys[:10]]
        assert t.delete_many(keys) == 300
        assert sum(cluster.total_keys(f"{key_prefix}:*").values()) == 0
        assert set(t.stats()["endpoints"]) == {f"127.0.0.1:{s.port}" for s in cluster.servers}


def test_cluster_via_flag_on_plain_url(cluster: RedisClusterProcs, key_prefix: str) -> None:
    url = f"redis://127.0.0.1:{cluster.servers[1].port}/0"
    with RedisTier.from_url(url, prefix=key_prefix, cluster=True, strict=True) as t:
        assert t.put_many([(key(1), b"flag")]) == 1 and bytes(t.get(key(1))) == b"flag"


def test_cluster_node_paused_degrades_to_misses_for_its_slots(cluster: RedisClusterProcs,
                                                              key_prefix: str) -> None:
    t = RedisTier.from_url(cluster.url, prefix=key_prefix, redis_timeout_s=0.5,
                           backoff_initial_s=0.05, backoff_max_s=0.5, strict=True)
    victim = cluster.servers[2]
    try:
        keys = [key(i) for i in range(60)]
        assert t.put_many([(k, payload(k)) for k in keys]) == 60
        victim.pause()
        try:
            got = t.get_many(keys)
            assert 0 < sum(g is None for g in got) < 60  # only the paused node's share
            assert all(bytes(g) == payload(k) for g, k in zip(got, keys, strict=True) if g)
            assert not t.available
            more = [key(i, hash_salt="more") for i in range(60)]
            assert all(t.submit_put(k, payload(k)) for k in more)  # other nodes still take them
            assert t.flush(10)
        finally:
            victim.resume()
        assert wait_until(lambda: t.available)
        assert all(g is not None for g in t.get_many(keys))
        stored = t.exists_many(more)
        assert 0 < sum(stored) < 60  # all but the paused node's share
        assert t.stats()["skipped_unavailable"] > 0
    finally:
        t.close(timeout=1)


def test_get_many_into_per_node_and_a_paused_node(cluster: RedisClusterProcs,
                                                  key_prefix: str) -> None:
    t = RedisTier.from_url(cluster.url, prefix=key_prefix, redis_timeout_s=0.5,
                           backoff_initial_s=0.05, backoff_max_s=0.5, strict=True)
    try:
        keys = [key(i) for i in range(120)]
        assert t.put_many([(k, payload(k, 20_000)) for k in keys]) == 120
        dests = np.zeros((121, 20_000), np.uint8)
        assert t.get_many_into(keys + [key(999)], list(dests)) == [True] * 120 + [False]
        assert all(dests[i].tobytes() == payload(k, 20_000) for i, k in enumerate(keys))
        cluster.servers[1].pause()
        try:
            dests[:] = 0
            got = t.get_many_into(keys, list(dests[:120]))
            assert 0 < got.count(False) < 120  # only the paused node's share
            assert all(dests[i].tobytes() == payload(k, 20_000)
                       for i, k in enumerate(keys) if got[i])
            assert not t.available
        finally:
            cluster.servers[1].resume()
        assert wait_until(lambda: t.available)
        assert t.get_many_into(keys, list(dests[:120])) == [True] * 120
    finally:
        t.close(timeout=1)


def _move_slot(cluster: RedisClusterProcs, slot: int) -> None:
    """Migrate ``slot`` (and its keys) to another master, as a resharding would."""
    clients = [s.client() for s in cluster.servers]
    ids = [c.execute_command("CLUSTER", "MYID").decode() for c in clients]
    owner = next(i for i, c in enumerate(clients)
                 if c.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) > 0)
    target = (owner + 1) % len(clients)
    src, dst = clients[owner], clients[target]
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[owner])
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
    names = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    src.execute_command("MIGRATE", "127.0.0.1", cluster.servers[target].port, "", 0, 5000,
                        "KEYS", *names)
    for c in clients:
        c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])


def test_get_many_into_follows_a_moved_slot(cluster: RedisClusterProcs, key_prefix: str) -> None:
    with RedisTier.from_url(cluster.url, prefix=key_prefix, strict=True) as t:
        keys = [key(i) for i in range(10)]
        assert t.put_many([(k, payload(k, 5000)) for k in keys]) == 10
        moved = keys[3]
        slot = cluster.servers[0].client().execute_command(
            "CLUSTER", "KEYSLOT", f"{key_prefix}:{moved.name}")
        _move_slot(cluster, slot)
        dests = np.zeros((10, 5000), np.uint8)
        first = t.get_many_into(keys, list(dests))
        assert first == [i != 3 for i in range(10)]  # MOVED: a miss for that key, not a raise
        assert t.get_many_into(keys, list(dests)) == [True] * 10  # topology refreshed
        assert dests[3].tobytes() == payload(moved, 5000)
        assert t.available


def test_nodes_are_served_at_once(cluster: RedisClusterProcs, key_prefix: str) -> None:
    """Two paused masters cost one socket timeout, not two: node batches run side by side.

    Shown by order, not by a stopwatch: each paused node's share waits at a rendezvous
    before it goes to its node; only shares that are in flight together can pass it (one
    after the other, the first would wait for ever: the deadline only ends that hang)."""
    t = RedisTier.from_url(cluster.url, prefix=key_prefix, redis_timeout_s=1.0,
                           backoff_initial_s=0.05, backoff_max_s=0.5, strict=True)
    try:
        keys = [key(i) for i in range(60)]
        assert t.put_many([(k, payload(k, 1000)) for k in keys]) == 60
        dests = np.zeros((60, 1000), np.uint8)
        paused = {f"127.0.0.1:{s.port}" for s in cluster.servers[:2]}
        rendezvous = threading.Barrier(len(paused), timeout=120)
        met: list[str] = []
        exchange = t._channel._node_exchange

        def side_by_side(client: Any, job: Any, *rest: Any) -> Any:
            if job[0] in paused:
                rendezvous.wait()  # BrokenBarrierError (raised to get_many_into) if alone
                met.append(job[0])
            return exchange(client, job, *rest)

        t._channel._node_exchange = side_by_side  # type: ignore[method-assign]
        for server in cluster.servers[:2]:
            server.pause()
        try:
            t0 = time.monotonic()
            got = t.get_many_into(keys, list(dests))
            print(f"\nget_many_into with two paused masters: {time.monotonic() - t0:.2f} s")
        finally:
            for server in cluster.servers[:2]:
                server.resume()
        t._channel._node_exchange = exchange  # type: ignore[method-assign]
        assert sorted(met) == sorted(paused)  # both paused nodes' shares were in flight at once
        assert 0 < got.count(True) < 60  # the running master's share
        assert all(dests[i].tobytes() == payload(k, 1000) for i, k in enumerate(keys) if got[i])
        assert "Timeout" in t.last_error  # the paused shares ended by their socket timeout
        assert wait_until(lambda: t.available)
        assert t.get_many_into(keys, list(dests)) == [True] * 60
    finally:
        t.close(timeout=1)


def test_tier_recovers_after_a_failed_topology_refresh(cluster: RedisClusterProcs,
                                                       key_prefix: str) -> None:
    """A MOVED makes the tier refresh the topology; the whole cluster is paused when it does,
    so the refresh fails. Once the cluster answers again, reads and writes come back."""
    t = RedisTier.from_url(cluster.url, prefix=key_prefix, redis_timeout_s=0.3,
                           backoff_initial_s=0.05, backoff_max_s=0.2, strict=True)
    try:
        keys = [key(i) for i in range(10)]
        assert t.put_many([(k, payload(k, 2000)) for k in keys]) == 10
        slot = cluster.servers[0].client().execute_command(
            "CLUSTER", "KEYSLOT", f"{key_prefix}:{keys[3].name}")
        _move_slot(cluster, slot)
        dests = np.zeros((10, 2000), np.uint8)
        assert t.get_many_into(keys, list(dests))[3] is False  # MOVED: refresh on next call
        for server in cluster.servers:
            server.pause()
        try:
            assert t.get_many_into(keys, list(dests)) == [False] * 10  # the refresh failed
            assert not t.available
        finally:
            for server in cluster.servers:
                server.resume()
        assert wait_until(lambda: t.get_many_into(keys, list(dests)) == [True] * 10)
        assert t.available
        assert all(dests[i].tobytes() == payload(k, 2000) for i, k in enumerate(keys))
        fresh = key(99)
        assert t.submit_put(fresh, payload(fresh, 2000))
        assert t.flush(timeout=5)
        assert wait_until(lambda: t.get_many_into([fresh], [dests[0]]) == [True])
    finally:
        t.close(timeout=1)


def test_a_cluster_down_at_start_is_counted_down_then_up_once_it_answers(
        cluster: RedisClusterProcs, key_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """The tier starts while its seed node refuses connections (the Cluster client cannot
    be built): one outage, counted and logged. Once the seed answers, the writer's probe
    builds the client: one recovery, counted like any other, and stores go through."""
    proxy = TcpProxy("127.0.0.1", cluster.servers[0].port).start()
    proxy.mode = "refuse"
    t = RedisTier.from_url(proxy.url, prefix=key_prefix, cluster=True, redis_timeout_s=0.5,
                           backoff_initial_s=0.05, backoff_max_s=0.2)
    try:
        assert not t.available
        assert (t.counts()["unavailable_events"], t.counts()["recoveries"]) == (1, 0)
        proxy.mode = "forward"
        assert wait_until(lambda: t.available)
        assert (t.counts()["unavailable_events"], t.counts()["recoveries"]) == (1, 1)
        assert "answers again" in caplog.text
        k = key(7)
        assert t.put_many([(k, payload(k, 500))]) == 1 and bytes(t.get(k)) == payload(k, 500)
    finally:
        t.close(timeout=1)
        proxy.stop()


def test_cluster_deletes_corrupt_values_on_their_nodes_conditionally(
        cluster: RedisClusterProcs, key_prefix: str) -> None:
    """The compare-and-delete script runs on each key's own node; a rewritten value stays."""
    with RedisTier.from_url(cluster.url, prefix=key_prefix, strict=True) as t:
        keys = [key(i) for i in range(30)]
        assert t.put_many([(k, payload(k, 1000)) for k in keys], save_ids=[5] * 30) == 30
        raw = RedisCluster.from_url(f"redis://127.0.0.1:{cluster.servers[0].port}/0")
        names = [f"{key_prefix}:{k.name}" for k in keys]
        for name in names[::3]:  # spread over the nodes: flip a payload byte
            value = bytearray(raw.get(name))
            value[codec.HEADER_SIZE + 7] ^= 0x01
            raw.set(name, bytes(value))
        assert len({raw.keyslot(n) for n in names[::3]}) > 1
        dests = list(np.zeros((30, 1000), np.uint8))
        assert t.get_many_into(keys, dests, save_ids=[5] * 30) == [i % 3 != 0 for i in range(30)]
        assert sum(cluster.total_keys(f"{key_prefix}:*").values()) == 20
        assert t.stats()["corrupt_deleted"] == 10
        old = raw.get(names[1])
        assert t.put_many([(keys[1], payload(keys[1], 1000))], save_ids=[6]) == 1
        t._delete_corrupt([(names[1].encode(), old[:codec.HEADER_SIZE], len(old))])
        assert t.save_ids_many(keys[1:3]) == [6, 5]  # rewritten meanwhile: kept
        new = raw.get(names[1])
        t._delete_corrupt([(names[1].encode(), new[:codec.HEADER_SIZE], len(new))])
        assert t.save_ids_many(keys[1:3]) == [None, 5]  # unchanged: deleted on its node
        s = t.stats()
        assert s["corrupt_deleted"] == 11 and s["corrupt_changed"] == 1
        assert s["corrupt_delete_failures"] == 0
        raw.close()


_EXIT_SCRIPT = """
import atexit, sys
from offload_tiers.redis.tier import RedisTier
from tests.tiers.helpers import key, payload
url, prefix, n, linger, bound = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), \\
    float(sys.argv[5])
tier = RedisTier.from_url(url, prefix=prefix, strict=True, write_linger_s=linger)
# as an engine torn down by the interpreter's exit flushes: from an exit hook, after
# concurrent.futures stopped taking work
atexit.register(tier.close, bound)
if len(sys.argv) > 6:
    print("connected", flush=True)
    sys.stdin.readline()  # the test pauses a master first: no write is out before that
for i in range(n):
    assert tier.submit_put(key(i), payload(key(i), 3000))
print("queued", flush=True)
"""


def _exit_with_writes_queued(cluster: RedisClusterProcs, prefix: str, n: int, *,
                             bound: float = 10.0, wait: bool = False
                             ) -> subprocess.Popen[str]:
    args = [sys.executable, "-c", _EXIT_SCRIPT, cluster.url, prefix, str(n), "0.2", str(bound)]
    proc = subprocess.Popen(args + (["wait"] if wait else []), cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == ("connected" if wait else "queued")
    return proc


def test_writes_queued_at_interpreter_exit_reach_every_master(
        cluster: RedisClusterProcs, key_prefix: str) -> None:
    """Issue 44: a process whose last writes are still queued (200 ms linger) when it
    exits flushes them from an exit hook; the Cluster fan-out needs no executor then (a
    ThreadPoolExecutor refuses work after interpreter shutdown began: every write lost)."""
    proc = _exit_with_writes_queued(cluster, key_prefix, 60)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "cannot schedule new futures" not in err
    per_node = cluster.total_keys(f"{key_prefix}:*")
    assert sum(per_node.values()) == 60 and all(n > 0 for n in per_node.values())


def test_a_master_paused_at_exit_bounds_the_flush_and_the_rest_is_counted(
        cluster: RedisClusterProcs, key_prefix: str) -> None:
    """Issue 44: one master SIGSTOPped, then 60 writes queued (two batches) and the
    process exits: the first batch waits on the paused master past the exit flush's 1 s
    bound (its socket timeout is 2 s), so the flush gives up, says how many writes it could
    not make (the second batch), and the process exits; the other masters got their share
    of the first batch."""
    proc = _exit_with_writes_queued(cluster, key_prefix, 60, bound=1.0, wait=True)
    paused = cluster.servers[2]
    paused.pause()
    try:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        _, err = proc.communicate(timeout=120)
    finally:
        paused.resume()
    assert proc.returncode == 0, err
    assert "queued writes not made before closing" in err, err
    written = sum(n for port, n in cluster.total_keys(f"{key_prefix}:*").items()
                  if port != paused.port)
    assert 0 < written < 60

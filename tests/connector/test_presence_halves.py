"""Two engines' halves on one real Redis, each with its presence summary fed by a real feed
thread: what one engine stored (before or after the other started) the other restores, and a
prompt nobody stored is answered in the lookup it arrives with, no probe."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from connector.vllm_connector.config import TieredConfig
from rigs.halves import BS, Halves
from rigs.sched_doubles import Blk, Req
from tests.tiers.faults import wait_until

Make = Callable[..., Halves]


@pytest.fixture
def engines(redis_url: str, key_prefix: str) -> Iterator[Make]:
    made: list[Halves] = []

    def make(tp: int = 1) -> Halves:
        config = TieredConfig(cpu_bytes=1 << 20, redis_url=redis_url, redis_prefix=key_prefix)
        made.append(Halves(config, tp_size=tp, presence=True))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _store(e: Halves, req_id: str, blocks: int = 3) -> Req:
    req = Req(req_id, 100)
    e.fill(range(1, blocks + 1), seed=len(req_id))
    e.admit(req, [[Blk(i, i * BS) for i in range(1, blocks + 1)]], 0)
    e.step({req_id: blocks * BS})
    assert wait_until(lambda: sum(e.counter("blocks_written_redis")) == blocks * e.tp_size)
    e.step()  # the writes' reports reach the scheduler: it announces the keys
    return req


def _counters(e: Halves) -> dict[str, Any]:
    return e.sched.counters.snapshot()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_new_engine_learns_what_redis_holds_and_probes_only_that(engines: Make,
                                                                   tp: int) -> None:
    first = engines(tp)
    _store(first, "a")
    second = engines(tp)
    second.presence_ready()  # its walk of the key names found first's (TP rank 0's names)
    nobody = Req("nobody", 100)
    nobody.block_hashes = [b"x0", b"x1", b"x2"]
    assert second.sched.lookup(nobody, 0) == (0, False)  # at once: nobody stored it
    assert _counters(second)["presence_known_absent"] == 1
    assert second.lookup(Req("b", 100)) == (96, True)  # probed, then a Redis hit
    c = _counters(second)
    assert c["probe_waits"] == 1 and c["presence_known_absent"] == 1


def test_a_running_engine_learns_another_engines_stores_as_they_happen(engines: Make) -> None:
    first, second = engines(), engines()
    first.presence_ready()
    second.presence_ready()
    req = Req("b", 100)
    assert second.sched.lookup(req, 0) == (0, False)  # nothing stored yet: no probe
    _store(first, "a")
    keys = [second.key(req, 0, n) for n in (32, 64, 96)]
    assert wait_until(lambda: second.sched.presence.ready()
                      and all(second.sched.presence.may_hold(keys)))
    learned = _counters(second)["presence_learned"]
    assert learned >= 3
    assert second.lookup(req) == (96, True)
    second.admit(req, [[Blk(7), Blk(8), Blk(9), Blk(10)]], 96)
    result = second.step()
    assert result.finished == {"b"} and result.failed == set()
    assert _counters(second)["hit_tokens_redis"] == 96



def test_stores_are_announced_with_the_report_that_confirms_them(engines: Make) -> None:
    """The report that says every rank wrote a block announces it: an engine that goes idle
    after that report (it never plans another step) still tells the others. (Announcing at
    the next step's start left an OpenAI server's last stores unannounced while it idled.)"""
    first, second = engines(), engines()
    first.presence_ready()
    second.presence_ready()
    req = Req("a", 100)
    first.fill(range(1, 4), seed=1)
    first.admit(req, [[Blk(i, i * BS) for i in range(1, 4)]], 0)
    first.step({"a": 3 * BS})  # its report confirms the saves; first plans no step after
    assert wait_until(lambda: first.sched.presence.feed.stats()["announced"] == 3)
    keys = [second.key(Req("b", 100), 0, n) for n in (32, 64, 96)]
    assert wait_until(lambda: second.sched.presence.ready()
                      and all(second.sched.presence.may_hold(keys)))

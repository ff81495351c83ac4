"""Sustained-load soak of a real ``kvtier daemon`` process: RSS growth and lag over time.

    python -m benchmarks.soak_daemon [--seconds 120] [--rate 2000] [--json PATH]

Starts the daemon (its own loopback ports), then publishes a steady stream through vLLM's
wire format from a PUB socket the script owns (vLLM binds, the daemon connects): every
batch stores 16-64 hashes chained on live requests, adds partial entries, and removes old
ones so the resident set stays at a steady size (as a cache at capacity does). Every few
seconds it samples the daemon's RSS, its lag gauge and its applied-batch count. Bounded in
time; loopback only. Prints a table and the growth of RSS between the first and last
quarter of the run (should be ~flat), and the lag (should stay small and flat).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import zmq

from benchmarks.harness import write_result
from connector.events.wire import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
)
from rigs.daemon_proc import DaemonProcess
from rigs.ports import free_port

B = 16


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="run time (bounded)")
    ap.add_argument("--rate", type=int, default=2000, help="target batches per second")
    ap.add_argument("--resident", type=int, default=200_000, help="steady resident hashes")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    seconds = min(args.seconds, 3600.0)

    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 1_000_000)
    pub.bind(f"tcp://127.0.0.1:{port}")
    daemon = DaemonProcess("--endpoint", f"tcp://*:{port}", "--no-replay-on-start",
                           "--block-size", f"0={B}", "--block-size", "1=64")
    daemon.start()
    rng = random.Random(0)
    seq = 0
    next_hash = 1
    resident: list[int] = []
    partials: list[int] = []
    chains: list[tuple[int, int]] = []
    samples: list[dict[str, float]] = []
    sent_updates = 0
    try:
        # Wait until the SUB is connected: publish seq 0 until it lands.
        warm = encode_batch(KVEventBatch(time.time(), []))
        deadline = time.monotonic() + 20
        while daemon.source()["received"] == 0:
            if time.monotonic() > deadline:
                raise RuntimeError("daemon never received the warm-up batch")
            pub.send_multipart((b"", seq.to_bytes(8, "big"), warm))
            time.sleep(0.05)
            seq += 1  # the daemon counts lost warm-ups as a gap; that is fine here
        start = time.monotonic()
        next_sample = start
        interval = 1.0 / args.rate
        t_next = start
        while (now := time.monotonic()) - start < seconds:
            events: list[object] = []
            for _ in range(rng.randint(2, 6)):
                n = rng.randint(16, 64)
                parent, ptok = rng.choice(chains) if chains and rng.random() < 0.6 else (None, 0)
                hashes = list(range(next_hash, next_hash + n))
                next_hash += n
                events.append(BlockStored(hashes, parent, [1] * (B * n), B, None,
                                          rng.choice(("GPU", "GPU", "CPU")), None, group_idx=0))
                resident.extend(hashes)
                chains.append((hashes[-1], ptok + n * B))
                sent_updates += n
                if rng.random() < 0.2:  # partial entry in the hybrid group
                    events.append(BlockStored([next_hash], None, [1] * 32, 32, None, "GPU",
                                              None, group_idx=1))
                    partials.append(next_hash)
                    next_hash += 1
                    sent_updates += 1
            if len(chains) > 512:
                del chains[:256]
            while len(resident) > args.resident:
                k = min(64, len(resident) - args.resident)
                gone, resident[:k] = resident[:k], []
                events.append(BlockRemoved(gone, "GPU", group_idx=0))
                events.append(BlockRemoved(gone, "CPU", group_idx=0))
                sent_updates += 2 * k
            if len(partials) > args.resident // 20:
                gone, partials[:64] = partials[:64], []
                events.append(BlockRemoved(gone, "GPU", group_idx=1))
                sent_updates += len(gone)
            pub.send_multipart((b"", seq.to_bytes(8, "big"),
                                encode_batch(KVEventBatch(time.time(), events))))
            seq += 1
            if now >= next_sample:
                s = daemon.stats()
                pubstats = next(iter(s["publishers"].values()), {})
                samples.append({
                    "t": round(now - start, 1), "rss_mib": s["rss_bytes"] / 2**20,
                    "lag_s": pubstats.get("last_lag_s", 0.0),
                    "applied": s["sources"][0]["applied"], "sent": seq,
                    "entries": s["index"]["entries"],
                })
                next_sample = now + max(seconds / 20, 1.0)
            t_next += interval
            sleep = t_next - time.monotonic()
            if sleep > 0:
                time.sleep(sleep)
        daemon.wait_for(lambda s: s["sources"][0]["applied"] + s["sources"][0]["missing_batches"]
                        >= seq, timeout=120, what="daemon to drain")
        final = daemon.stats()
    finally:
        code = daemon.terminate() if daemon.proc and daemon.proc.poll() is None else None
        pub.close(linger=0)
        ctx.term()

    print(f"{'t(s)':>6}{'RSS MiB':>9}{'lag s':>9}{'applied':>10}{'sent':>10}{'entries':>10}")
    for smp in samples:
        print(f"{smp['t']:>6}{smp['rss_mib']:>9.1f}{smp['lag_s']:>9.3f}{smp['applied']:>10}"
              f"{smp['sent']:>10}{smp['entries']:>10}")
    steady = [s for s in samples if s["t"] >= seconds * 0.1] or samples  # after the fill
    q = max(1, len(steady) // 4)
    early = sum(s["rss_mib"] for s in steady[:q]) / q
    late = sum(s["rss_mib"] for s in steady[-q:]) / q
    lag_max = max(s["lag_s"] for s in samples)
    lags = sorted(s["lag_s"] for s in samples)
    lag_median = lags[len(lags) // 2]
    src = final["sources"][0]
    elapsed = seconds
    result = {
        "seconds": seconds, "batches": seq, "hash_updates": sent_updates,
        "hash_updates_per_s": sent_updates / elapsed,
        "rss_first_quarter_mib": early, "rss_last_quarter_mib": late,
        "rss_growth_mib": late - early, "lag_max_s": lag_max,
        "lag_median_s": lag_median, "lag_last_s": samples[-1]["lag_s"], "gaps": src["gaps"],
        "missing_batches": src["missing_batches"], "decode_errors": src["decode_errors"],
        "entries_final": final["index"]["entries"], "exit_code": code, "samples": samples,
    }
    print(f"{seq} batches, {sent_updates:,} hash updates in {seconds:.0f}s "
          f"({sent_updates / elapsed:,.0f}/s); RSS {early:.1f} -> {late:.1f} MiB "
          f"(growth {late - early:+.1f} MiB, after the fill); lag median "
          f"{lag_median * 1000:.1f} ms, max {lag_max * 1000:.1f} ms; "
          f"gaps {src['gaps']} (missing {src['missing_batches']}), decode errors "
          f"{src['decode_errors']}; daemon exit code {code}")
    write_result(args.json, result)
    return 0 if code == 0 and src["decode_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

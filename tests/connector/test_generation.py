"""Namespace generations: a reset moves an engine where no other engine can be, unless the
user names the weights (vLLM's weight version); the checkpoint's files are in the identity."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from connector.identity.checkpoint import UNRESOLVED, checkpoint_identity
from connector.identity.engine_core import WeightVersionSource
from connector.identity.generation import Generation


def test_two_engines_that_each_reset_once_never_share_a_generation() -> None:
    a, b = Generation("default"), Generation("default")
    assert a.name == b.name == "0"  # same checkpoint, not updated: they may share
    a.reset("default")
    b.reset("default")
    assert a.name != b.name and a.name.startswith("nonce:") and b.name.startswith("nonce:")
    assert len(a.name) == len("nonce:") + 32  # 128 random bits


def test_a_restart_and_a_reset_never_meet() -> None:
    before, restarted = Generation("default"), Generation("default")
    before.reset("default")
    assert before.name != restarted.name


def test_engines_given_the_same_named_update_share_it() -> None:
    a, b = Generation("default"), Generation("default")
    assert a.observe("step-42")  # the version named, followed at a step: a move by itself
    b.reset("step-42")  # version named, then the reset: the reset finds it first
    assert a.name == b.name == "named:step-42"
    b.reset("step-42")  # weights updated again, not renamed: nobody else can be there
    assert b.name.startswith("nonce:")


def test_a_reset_after_the_named_version_was_followed_draws_a_nonce() -> None:
    """Issue 43.3 (b): weights named v2 are followed at a step (and KV is stored under
    ``named:v2``), updated in place again and reset without a new name: a nonce, never
    ``named:v2`` again (the version is compared with the last move, not the last reset)."""
    g = Generation("default")
    assert g.observe("v2") and g.name == "named:v2"  # stores go under named:v2
    assert not g.observe("v2")  # later steps: no move
    assert g.reset("v2").startswith("nonce:")
    names = {g.name} | {g.reset("v2") for _ in range(3)}  # every further reset: a new nonce
    assert len(names) == 4 and all(n.startswith("nonce:") for n in names)
    assert g.observe("v3") and g.name == "named:v3"  # a new name is shared again


def test_a_version_change_alone_moves_the_generation() -> None:
    g = Generation("default")
    assert not g.observe("default")
    assert g.observe("v1") and g.name == "named:v1"
    assert g.observe("default") and g.name.startswith("nonce:")


def test_without_a_weight_version_every_reset_draws_a_nonce() -> None:
    g = Generation(None)
    assert not g.observe(None)
    names = {g.reset(None) for _ in range(5)}
    assert len(names) == 5


class EngineCore:  # the name vLLM's engine core class has; found on the stack
    def __init__(self) -> None:
        self._weight_version = "default"
        self.source = WeightVersionSource()


def test_the_weight_version_is_read_from_the_engine_core_on_the_stack() -> None:
    core = EngineCore()
    assert core.source.found and core.source.read() == "default"
    core._weight_version = "step-7"
    assert core.source.read() == "step-7"
    assert not WeightVersionSource().found and WeightVersionSource().read() is None


def _safetensors(path: Path, header: bytes, body: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + body)


def test_checkpoint_identity_changes_when_a_file_is_rewritten_in_place(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 128}')
    weights = tmp_path / "model.safetensors"
    _safetensors(weights, b'{"w": {"dtype": "F32"}}', b"\0" * 4096)
    first = checkpoint_identity(str(tmp_path))
    assert len(first) == 32 and first == checkpoint_identity(str(tmp_path))
    st = weights.stat()
    _safetensors(weights, b'{"w": {"dtype": "F32"}}', b"\1" * 4096)  # same size and header
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert checkpoint_identity(str(tmp_path)) != first
    (tmp_path / "extra.safetensors").write_bytes(b"")
    assert checkpoint_identity(str(tmp_path)) not in {first}


def test_checkpoint_identity_of_an_unknown_model_is_unresolved(tmp_path: Path) -> None:
    assert checkpoint_identity(str(tmp_path / "absent")) == UNRESOLVED
    assert checkpoint_identity(str(tmp_path)) == UNRESOLVED  # no weight files


def test_a_hugging_face_blob_link_is_identified_by_its_content_name(tmp_path: Path) -> None:
    blobs, snap = tmp_path / "blobs", tmp_path / "snap"
    blobs.mkdir()
    snap.mkdir()
    blob = blobs / ("ab" * 32)
    _safetensors(blob, b"{}", b"x")
    (snap / "model.safetensors").symlink_to(blob)
    first = checkpoint_identity(str(snap))
    os.utime(blob, ns=(1, 1))  # times do not matter for a content-named blob
    assert checkpoint_identity(str(snap)) == first

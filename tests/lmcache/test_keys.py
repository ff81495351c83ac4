"""The adapter's pure parts (no LMCache): LMCache's key fields -> kvtier's key, the namespace
registry, the settings LMCache hands over. These run in the main suite too."""

from __future__ import annotations

import pytest

from connector.lmcache_l2.keys import LAYOUT, NUM_TOKENS, ChunkOwner, KeyMapper, registry_name
from connector.lmcache_l2.settings import L2Settings
from offload_tiers.keys import BlockKind

OWNER = ChunkOwner("meta-llama/Llama-3.1-8B", 0, "")


def test_key_names_the_chunk_in_its_namespace() -> None:
    mapper = KeyMapper()
    bkey = mapper.block_key(OWNER, 3, b"\x01" * 32)
    assert (bkey.group, bkey.block_hash, bkey.kind, bkey.num_tokens) == (
        3, b"\x01" * 32, BlockKind.FULL, NUM_TOKENS)
    assert bkey.fingerprint == mapper.namespace_of(OWNER).fingerprint
    assert mapper.namespace_of(OWNER).kv_layout == LAYOUT
    assert mapper.block_key(OWNER, 3, b"\x01" * 32) == bkey  # deterministic


@pytest.mark.parametrize("other", [
    ChunkOwner("meta-llama/Llama-3.1-70B", 0, ""),  # another model
    ChunkOwner(OWNER.model_name, 1, ""),  # another KV rank
    ChunkOwner(OWNER.model_name, 0, "tenant-a"),  # another cache_salt
])
def test_model_kv_rank_and_salt_each_change_the_namespace(other: ChunkOwner) -> None:
    mapper = KeyMapper()
    assert mapper.fingerprint(other) != mapper.fingerprint(OWNER)


def test_deployment_namespace_changes_every_fingerprint() -> None:
    assert KeyMapper("weights-v2").fingerprint(OWNER) != KeyMapper().fingerprint(OWNER)
    assert KeyMapper("weights-v2").fingerprint(OWNER) == KeyMapper("weights-v2").fingerprint(OWNER)


@pytest.mark.parametrize(("group", "chunk_hash"), [(-1, b"x"), (1 << 32, b"x"), (0, b"")])
def test_keys_kvtier_cannot_store_are_refused(group: int, chunk_hash: bytes) -> None:
    with pytest.raises(ValueError):
        KeyMapper().block_key(OWNER, group, chunk_hash)


def test_registry_entry_round_trips_and_forgeries_are_ignored() -> None:
    mapper = KeyMapper()
    fp = mapper.fingerprint(OWNER)
    assert mapper.read_registry_entry(fp, mapper.registry_entry(OWNER)) == OWNER
    forged = mapper.registry_entry(ChunkOwner("other-model", 0, ""))
    assert mapper.read_registry_entry(fp, forged) is None  # does not digest back to fp
    for junk in (b"not json", b"[1, 2]", b'{"model": 1, "kv_rank": 0, "cache_salt": ""}',
                 b'{"model": "m", "kv_rank": true, "cache_salt": ""}', b"\xff\xfe"):
        assert mapper.read_registry_entry(fp, junk) is None
    assert KeyMapper("v2").read_registry_entry(fp, mapper.registry_entry(OWNER)) is None
    assert registry_name("p") == b"p:lmcache-namespaces"


def test_settings_from_adapter_params() -> None:
    s = L2Settings.from_params({"redis_url": "redis://127.0.0.1:6379/0", "ttl_s": 60,
                                "load_threads": 3, "cluster": False, "max_capacity_gb": 1})
    assert (s.ttl_s, s.load_threads, s.cluster, s.max_capacity_bytes) == (60.0, 3, False, 1 << 30)
    assert s.key_prefix == "kvtier-lmcache"


@pytest.mark.parametrize(("params", "message"), [
    ({"redis_url": "redis://:hunter2@127.0.0.1:6379/0"}, "carries a password"),
    ({"redis_url": "redis://u:hunter2@127.0.0.1:6379/0"}, "carries a password"),
    ({"redis_url": "redis://127.0.0.1:6379/0?password=hunter2"}, "carries a password"),
    ({"redis_url": "redis://127.0.0.1:6379/0", "password": "hunter2"}, "never go into"),
    ({"redis_url": "redis://127.0.0.1:6379/0", "redis_timeout": 1}, "unknown key"),
    ({}, "give redis_url or redis_url_env"),
    ({"redis_url": "redis://127.0.0.1:6379/0", "key_prefix": "a b"}, "key_prefix"),
    ({"redis_url": "redis://127.0.0.1:6379/0", "load_threads": 0}, "positive integer"),
    ({"redis_url": "redis://127.0.0.1:6379/0", "cluster": "yes"}, "true or false"),
])
def test_bad_settings_are_refused_without_naming_a_secret(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        L2Settings.from_params(params)
    assert "hunter2" not in str(info.value)


def test_url_from_environment_and_password_from_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_LMC_URL", "redis://:s3cret@127.0.0.1:6379/0")
    url, warnings = L2Settings.from_params({"redis_url_env": "KVTIER_TEST_LMC_URL"}).resolve_url()
    assert url == "redis://:s3cret@127.0.0.1:6379/0" and not warnings
    secret = tmp_path / "pw"
    secret.write_text("p@ss word\n")
    secret.chmod(0o600)
    url, warnings = L2Settings.from_params(
        {"redis_url": "redis://127.0.0.1:6379/0", "redis_username": "kv",
         "redis_password_file": str(secret)}).resolve_url()
    assert url == "redis://kv:p%40ss%20word@127.0.0.1:6379/0" and not warnings
    monkeypatch.setenv("KVTIER_TEST_LMC_PW", "pw")
    url, _ = L2Settings.from_params({"redis_url": "redis://127.0.0.1:6379/0",
                                     "redis_password_env": "KVTIER_TEST_LMC_PW"}).resolve_url()
    assert url == "redis://:pw@127.0.0.1:6379/0"

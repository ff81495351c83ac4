"""The storage namespace: everything stored KV depends on changes the fingerprint (no vLLM).

vLLM's config objects are read by attribute, so plain namespaces stand in for them here.
One builder (:mod:`connector.identity.engine`) serves the connector and the native tier.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from connector.identity.engine import EngineIdentity, architecture_digest, identity_from_vllm
from connector.vllm_connector.bounded_cache import BoundedCache
from connector.vllm_connector.namespace import kv_groups_descriptor, rank_fingerprint
from connector.vllm_connector.slot_sizing import expected_slot_bytes, slot_count

BASE = EngineIdentity(
    model="/models/tiny", revision="main", weights_version="", checkpoint="c" * 32,
    dtype="float16", kv_cache_dtype="auto", quantization="", kv_scales="calc=False",
    architecture="0" * 16, kv_layout="FullAttentionSpec,bs=32", block_size=32,
    parallel="tensor=1|pipeline=1|prefill=1|decode=1", tp_size=1, device="cuda")


@pytest.mark.parametrize(("field", "a", "b"), [
    ("kv_cache_dtype", "fp8_e4m3", "fp8_e5m2"),  # both uint8 tensors: only the config tells
    ("quantization", "", "fp8"),
    ("revision", "main", "0123abcd"),
    ("kv_scales", "calc=False", "calc=True"),
    ("weights_version", "", "step-1000"),
    ("weights_version", "step-1000", "step-2000"),
    ("model", "/models/tiny", "/models/other"),
    ("dtype", "float16", "bfloat16"),
    ("architecture", "0" * 16, "1" * 16),
    ("kv_layout", "FullAttentionSpec,bs=32", "FullAttentionSpec,bs=64"),
    ("checkpoint", "c" * 32, "d" * 32),
    ("parallel", "tensor=1|pipeline=1|prefill=1|decode=1",
     "tensor=1|pipeline=1|prefill=2|decode=1"),
    ("tp_size", 1, 2),
    ("device", "cuda", "cpu"),
])
def test_identities_differing_in_one_field_never_share_a_namespace(field: str, a: Any,
                                                                   b: Any) -> None:
    one = dataclasses.replace(BASE, **{field: a})
    two = dataclasses.replace(BASE, **{field: b})
    assert one.fingerprint("") != two.fingerprint("")


def test_fingerprint_is_stable_and_depends_on_tenant_and_generation() -> None:
    same = dataclasses.replace(BASE)
    assert BASE.fingerprint("t") == same.fingerprint("t")  # both halves compute the same
    gens = ("0", "nonce:" + "1" * 32, "named:step-1")
    fps = {BASE.fingerprint(t, g) for t in ("", "t", "t/salt") for g in gens}
    assert len(fps) == 9
    assert BASE.fingerprint("t") == BASE.fingerprint("t", "0")
    assert all(len(fp) == 32 and int(fp, 16) >= 0 for fp in fps)


def test_each_rank_and_layout_has_its_own_fingerprint() -> None:
    base = BASE.fingerprint("")
    layout = "cpu|g0:attention:32:float32[2x32x16]@0"
    r0, r1 = (rank_fingerprint(base, r, 2, layout) for r in (0, 1))
    assert len({base, r0, r1}) == 3
    assert rank_fingerprint(base, 0, 2, layout) == r0
    assert rank_fingerprint(base, 0, 2, layout.replace("@0", "@1")) != r0  # other backend
    assert rank_fingerprint(BASE.fingerprint("", "named:x"), 0, 2, layout) != r0  # generation


def _vllm(cache_dtype: str = "auto", calculate_kv_scales: bool = False,
          quantization: str | None = None, revision: str | None = None,
          attn_calc: bool | None = None, layers: int = 2, tp: int = 1,
          name_or_path: str = "/a") -> tuple[Any, Any]:
    hf = SimpleNamespace(to_dict=lambda: {"num_hidden_layers": layers, "hidden_size": 128,
                                          "_name_or_path": name_or_path,
                                          "transformers_version": "4.0"})
    model = SimpleNamespace(model="/models/tiny", revision=revision, dtype="torch.float32",
                            quantization=quantization, hf_config=hf)
    cache = SimpleNamespace(cache_dtype=cache_dtype, calculate_kv_scales=calculate_kv_scales,
                            block_size=32)
    config = SimpleNamespace(model_config=model, cache_config=cache,
                             parallel_config=SimpleNamespace(tensor_parallel_size=tp,
                                                             pipeline_parallel_size=1))
    if attn_calc is not None:
        config.attention_config = SimpleNamespace(calculate_kv_scales=attn_calc)
    spec = SimpleNamespace(block_size=32, num_kv_heads=2, head_size=32, dtype="torch.float32",
                           page_size_bytes=16384)
    kv = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec,
                                                          layer_names=["l0", "l1"])])
    return config, kv


def _fp(weights_version: str = "", model_id: str | None = None, **kw: Any) -> str:
    config, kv = _vllm(**kw)
    return _ident(config, kv, model_id, weights_version).fingerprint("")


def _ident(config: Any, kv: Any, model_id: str | None = None,
           weights_version: str = "") -> EngineIdentity:
    return identity_from_vllm(config, kv_layout=kv_groups_descriptor(kv), model_id=model_id,
                              weights_version=weights_version, device="cpu")


def test_identity_is_read_off_vllms_config() -> None:
    config, kv = _vllm(cache_dtype="fp8_e5m2", calculate_kv_scales=True, quantization="fp8",
                       revision="abc", attn_calc=True, tp=2)
    ident = _ident(config, kv, None, "w1")
    assert ident.kv_cache_dtype == "fp8_e5m2" and ident.quantization == "fp8"
    assert ident.revision == "abc" and ident.weights_version == "w1"
    assert ident.dtype == "float32" and ident.tp_size == 2 and ident.block_size == 32
    assert "calc=True" in ident.kv_scales and "attn_calc=True" in ident.kv_scales
    assert "num_kv_heads=2" in ident.kv_layout and "layers=2" in ident.kv_layout
    assert ident.checkpoint == "unresolved"  # /models/tiny is not on this machine


@pytest.mark.parametrize("change", [
    {"cache_dtype": "fp8_e4m3"}, {"calculate_kv_scales": True}, {"attn_calc": True},
    {"quantization": "fp8"}, {"revision": "abc"}, {"weights_version": "w2"},
    {"layers": 3}, {"tp": 2}, {"model_id": "org/tiny"},
])
def test_each_setting_read_from_vllm_reaches_the_fingerprint(change: dict[str, Any]) -> None:
    base = {"cache_dtype": "fp8_e5m2", "attn_calc": False}
    assert _fp(**base) != _fp(**{**base, **change})


def test_volatile_config_keys_do_not_split_the_namespace() -> None:
    assert _fp(name_or_path="/a") == _fp(name_or_path="/b")
    hf = SimpleNamespace(num_hidden_layers=2, _name_or_path="/x")  # no to_dict: __dict__
    assert architecture_digest(hf) == architecture_digest(
        SimpleNamespace(num_hidden_layers=2, _name_or_path="/y"))
    assert architecture_digest(hf) != architecture_digest(SimpleNamespace(num_hidden_layers=3))


def test_slots_are_sized_from_the_largest_group() -> None:
    _, kv = _vllm()
    assert expected_slot_bytes(kv) == 16384 * 2
    assert slot_count(1 << 20, 16384 * 2) == 32
    with pytest.raises(ValueError, match="cpu_bytes"):
        slot_count(1000, 4096)
    with pytest.raises(ValueError, match="positive"):
        slot_count(1 << 20, 0)


def test_the_tenant_cache_is_bounded() -> None:
    cache: BoundedCache[str, str] = BoundedCache(3)
    for i in range(10):
        cache.put(f"salt{i}", BASE.fingerprint(f"salt{i}"))
    assert len(cache) == 3
    assert cache.get("salt0") is None and cache.get("salt9") == BASE.fingerprint("salt9")

"""Every example file under configs/ shows the documented defaults (issue 45.1).

A value in an example that differs from the pydantic model's default is either a mistake (users
who copy the example get another behaviour than the README documents: `write_mode: through`
was) or deliberate, and then it is listed in ``DELIBERATE`` with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from connector.daemon.config import DaemonConfig, PublisherConfig
from connector.vllm_connector.config import TieredConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

#: (file, key) -> why the example differs from the default.
DELIBERATE: dict[tuple[str, str], str] = {
    ("kv_transfer.json", "config_file"): "the loader's own key: it names the YAML example",
    ("kv_transfer.json", "redis_url"): "the example shows a local Redis; the default is none",
    ("daemon.yaml", "publishers"): "the daemon needs at least one engine to subscribe to",
    ("daemon.yaml", "publishers[].endpoint"): "required: an engine's PUB endpoint",
    ("daemon.yaml", "publishers[].replay_endpoint"): "shows the engine's replay buffer "
                                                     "(vLLM's example port 5558)",
}


def _default(model: type[BaseModel], key: str) -> Any:
    field = model.model_fields[key]
    return field.get_default(call_default_factory=True)


def _differences(name: str, model: type[BaseModel], shown: dict[str, Any],
                 prefix: str = "") -> list[str]:
    out = []
    for key, value in shown.items():
        where = f"{prefix}{key}"
        if (name, where) in DELIBERATE:
            continue
        assert key in model.model_fields, f"{name}: {where} is not a setting"
        default = _default(model, key)
        if value != default:
            out.append(f"{name}: {where} = {value!r}, the default is {default!r}")
    return out


def _examples() -> list[tuple[str, type[BaseModel], dict[str, Any]]]:
    tiered = yaml.safe_load((CONFIGS / "tiered.yaml").read_text())["connector"]
    kv_transfer = json.loads((CONFIGS / "kv_transfer.json").read_text())
    daemon = yaml.safe_load((CONFIGS / "daemon.yaml").read_text())
    return [("tiered.yaml", TieredConfig, tiered),
            ("kv_transfer.json", TieredConfig, kv_transfer["kv_connector_extra_config"]),
            ("daemon.yaml", DaemonConfig, daemon)]


def test_every_example_file_is_checked() -> None:
    assert {p.name for p in CONFIGS.iterdir()} == {name for name, _, _ in _examples()}


@pytest.mark.parametrize(("name", "model", "shown"), _examples(),
                         ids=[name for name, _, _ in _examples()])
def test_example_values_are_the_documented_defaults(name: str, model: type[BaseModel],
                                                    shown: dict[str, Any]) -> None:
    problems = _differences(name, model, shown)
    for publisher in shown.get("publishers", []):
        problems += _differences(name, PublisherConfig, publisher, "publishers[].")
    assert not problems, "\n".join(problems)


def test_the_deliberate_list_holds_only_differences_that_exist() -> None:
    shown = {name: values for name, _, values in _examples()}
    for name, key in DELIBERATE:
        top = key.removeprefix("publishers[].")
        values = shown[name]["publishers"][0] if key.startswith("publishers[].") else shown[name]
        assert top in values, f"{name}: {key} is listed as deliberate but not shown"

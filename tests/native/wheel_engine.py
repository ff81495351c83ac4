"""Run by ``test_native_tier_e2e.py`` inside a venv holding kvtier's wheel, not the checkout.

    python wheel_engine.py MODEL_DIR '{"kv_transfer_config": {...}, "prompts": [[name, p]...]}'

One engine (vLLM's default executors) with the given native-offloading config: each prompt
after a prefix-cache reset, then one-token steps until ``vllm:kvtier_native_stored_chunks``
reaches ``stored_chunks`` (the cascade to Redis is counted when a later step collects it).
Prints ``RESULT {json}``: where each kvtier module was imported from, per prompt its token
ids and ``num_cached_tokens``, and the kvtier metrics. Imports only what the wheel ships.
"""

from __future__ import annotations

import json
import sys
import time

import connector
import connector.native_tier.cpu_tiering
import connector.native_tier.tier
from connector.demo.presets import apply_cpu_engine_env, engine_kwargs


def main() -> None:
    model_dir, spec = sys.argv[1], json.loads(sys.argv[2])
    apply_cpu_engine_env()
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs("llama", model_dir, kv_transfer_config=spec["kv_transfer_config"]))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = []
    for name, prompt in spec["prompts"]:
        llm.reset_prefix_cache()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        outputs.append({"name": name, "token_ids": list(out.outputs[0].token_ids),
                        "num_cached_tokens": out.num_cached_tokens})

    def stored() -> float:
        return sum(getattr(m, "value", 0) for m in llm.get_metrics()
                   if m.name == "vllm:kvtier_native_stored_chunks")

    deadline = time.monotonic() + 300  # only a hung engine gets there
    while stored() < spec["stored_chunks"] and time.monotonic() < deadline:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1),
                     use_tqdm=False)
    modules = {m.__name__: m.__file__ for m in (connector, connector.native_tier.tier,
                                                 connector.native_tier.cpu_tiering)}
    result = {"modules": modules, "outputs": outputs, "stored_chunks": stored()}
    llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

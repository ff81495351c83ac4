"""An engine exactly as a user's script has it: ``LLM(...)`` at module level, a few prompts,
then the script ends. vLLM tears the engine down while the interpreter exits, and kvtier's
last Redis writes are flushed then (issue 44: on Redis Cluster they were all lost).

``python -m tests.support.exit_store URL PREFIX SEEDS_JSON [MODE [EXTRA_JSON]]``: prints one
``STORED`` line (JSON: the prompts' token counts) once the prompts are done; it exits right
after, with no explicit shutdown. MODE ``kvtier`` (default): kvtier's connector, EXTRA_JSON
more of its settings (e.g. ``redis_ssl_ca_certs``); ``native``: vLLM's OffloadingConnector
with kvtier's Redis tier (README's native-tier config, on the CPU spec).
"""

from __future__ import annotations

import json
import sys

from benchmarks.native_tier_engine import transfer_config
from connector.demo.presets import apply_cpu_engine_env, engine_kwargs, kvtier_transfer_config
from connector.demo.tiny_models import prompt_words, tiny_llama

#: Redis answers on loopback; on a loaded 2-core machine a reply can still take longer than
#: the 0.25 s default, which marks Redis down and drops writes: not what is tested here.
SLOW_MACHINE_TIMEOUT_S = 60.0

if __name__ == "__main__":
    apply_cpu_engine_env()
    from vllm import LLM, SamplingParams

    url, prefix, seeds = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else "kvtier"
    extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    if mode == "native":  # README's native-tier config, on the CPU spec
        config = transfer_config({"mode": "kvtier", "redis_url": url, "redis_prefix": prefix,
                                  "tier": {"redis_timeout_s": SLOW_MACHINE_TIMEOUT_S}})
    else:
        config = kvtier_transfer_config({"cpu_bytes": 16 << 20, "redis_url": url,
                                         "redis_prefix": prefix,
                                         "redis_timeout_s": SLOW_MACHINE_TIMEOUT_S, **extra})
    llm = LLM(**engine_kwargs("llama", str(tiny_llama()), kv_transfer_config=config))
    outs = llm.generate([prompt_words(s, 150) for s in seeds],
                        SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    print("STORED " + json.dumps([len(o.prompt_token_ids or ()) for o in outs]), flush=True)

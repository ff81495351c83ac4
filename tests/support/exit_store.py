"""An engine exactly as a user's script has it: ``LLM(...)`` at module level, a few prompts,
then the script ends. vLLM tears the engine down while the interpreter exits, and kvtier's
last Redis writes are flushed then (issue 44: on Redis Cluster they were all lost).

``python -m tests.support.exit_store URL PREFIX SEEDS_JSON [EXTRA_JSON]``: prints one
``STORED`` line (JSON: the prompts' token counts) once the prompts are done; it exits right
after, with no explicit shutdown.
"""

from __future__ import annotations

import json
import sys

from connector.demo.presets import apply_cpu_engine_env, engine_kwargs, kvtier_transfer_config
from connector.demo.tiny_models import prompt_words, tiny_llama

if __name__ == "__main__":
    apply_cpu_engine_env()
    from vllm import LLM, SamplingParams

    url, prefix, seeds = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    extra = {"cpu_bytes": 16 << 20, "redis_url": url, "redis_prefix": prefix,
             **(json.loads(sys.argv[4]) if len(sys.argv) > 4 else {})}
    llm = LLM(**engine_kwargs("llama", str(tiny_llama()),
                              kv_transfer_config=kvtier_transfer_config(extra)))
    outs = llm.generate([prompt_words(s, 150) for s in seeds],
                        SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    print("STORED " + json.dumps([len(o.prompt_token_ids or ()) for o in outs]), flush=True)

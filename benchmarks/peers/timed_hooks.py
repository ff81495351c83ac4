"""What ``timed_connector`` times and how it records a call (no vLLM import: the benchmark
client reads the records with these)."""

from __future__ import annotations

import struct

#: The hooks timed: the scheduler half's and the worker half's, as vLLM calls them.
HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "update_connector_output", "request_finished", "request_finished_all_groups",
    "take_events", "get_kv_connector_stats", "handle_preemptions", "start_load_kv",
    "wait_for_save", "get_transfer_results", "get_block_ids_with_load_errors",
    "build_connector_worker_meta", "get_kv_connector_kv_cache_events",
)

#: One call in ``<pid>.calls``: start (epoch s), thread CPU at start (s), wall (s), CPU (s),
#: hook index in :data:`HOOKS`, and for ``build_connector_meta`` the step's scheduled tokens
#: and requests (0 for the other hooks): seven little-endian doubles.
CALL_RECORD = struct.Struct("<7d")

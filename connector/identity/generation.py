"""The namespace generation: which weights an engine's KV was computed with, since it started.

Rules this module keeps:

* At start the generation is ``"0"``: the weights are the checkpoint's (its identity is in
  the namespace), so a restarted engine meets what it stored before.
* A connector-cache reset (RLHF flows call it after updating weights in place) moves the
  engine to a generation no other engine can be in: a random 128-bit nonce. A per-process
  counter would not do: two engines that each reset once would share a namespace whatever
  their weights.
* Unless the user names the new weights: vLLM's weight version (``LLM.update_weight_version``,
  ``finish_weight_update(weight_version=...)``, the server's ``/update_weight_version``).
  A version other than vLLM's ``"default"``, set since the last move, is the generation
  ``named:<version>`` — engines given the same update under the same name share KV. A version
  change is a move by itself (no reset needed); a reset that finds the version unchanged
  since the last move (a version change or a reset, not only the last reset) draws a nonce:
  weights named v2, followed, stored under ``named:v2`` and updated in place again are
  nobody else's.
* The caller follows the version (:meth:`Generation.observe`) before every look-up or store,
  so a step's first look-up already sees a version named since the last step (vLLM asks for
  a step's hits before it builds the step's plan).
"""

from __future__ import annotations

import secrets

VLLM_DEFAULT_VERSION = "default"


class Generation:
    """The current generation string, following vLLM's weight version and resets."""

    def __init__(self, version: str | None = None) -> None:
        self.name = "0"
        self.resets = 0
        self._at_move = version  # the weight version at start or at the last move

    def observe(self, version: str | None) -> bool:
        """Follow vLLM's weight version (before every look-up or store); True when the
        generation moved."""
        if version == self._at_move:
            return False
        self._at_move = version
        self.name = _named(version) or _nonce()
        return True

    def reset(self, version: str | None) -> str:
        """A connector-cache reset: the named generation when the weight version changed
        since the last move (a version change observed, a reset, or start), else a nonce."""
        self.resets += 1
        changed = version != self._at_move
        self._at_move = version
        self.name = (_named(version) if changed else None) or _nonce()
        return self.name

    @property
    def named(self) -> bool:
        return self.name.startswith("named:")


def _named(version: str | None) -> str | None:
    if not version or version == VLLM_DEFAULT_VERSION:
        return None
    return f"named:{version}"


def _nonce() -> str:
    return f"nonce:{secrets.token_hex(16)}"

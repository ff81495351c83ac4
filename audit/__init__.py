"""kvtier audit: flag code that treats a KV-cache block's ``block_hash`` presence as "full".

Stands alone: standard library only, imports neither vLLM nor the rest of kvtier.
"""

from audit.engine import audit_source, run
from audit.model import RULES, Confidence, Finding, Severity

__all__ = ["RULES", "Confidence", "Finding", "Severity", "audit_source", "run"]

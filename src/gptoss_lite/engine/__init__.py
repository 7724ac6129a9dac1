"""The batched serving engine: continuous batching over the paged block pool (docs/engine.md).

`LLM` is the facade; `SamplingParams`, `RequestOutput` and `EngineStats` are what callers exchange
with it. The parts: request.py (request state), kv_manager.py (blocks per layer kind + prefix cache),
scheduler.py (token budget, chunked prefill, preemption), fairness.py (tenants' shares and quotas),
paged_batch.py (writes and reads over block tables for a ragged batch), runner.py (one forward per
step), llm.py (the facade).
"""

from gptoss_lite.engine.llm import LLM
from gptoss_lite.engine.request import (
    EngineStats,
    PreparedRequest,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)
from gptoss_lite.engine.tenants import QuotaExceeded, TenantLimits, TenantPolicy

__all__ = [
    "LLM",
    "EngineStats",
    "PreparedRequest",
    "QuotaExceeded",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "TenantLimits",
    "TenantPolicy",
    "TokenLogprobs",
]

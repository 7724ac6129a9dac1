"""TEMPORARY: the engine contract's data classes, installed as `gptoss_lite.engine` by conftest.py
only while the real engine package is absent from this checkout."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens}: must be >= 1")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self):
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itl(self):
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    metrics: RequestMetrics


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_queries: int
    prefix_hits: int
    prefix_hit_rate: float
    preemptions: int
    finished: int
    aborted: int
    generated_tokens: int

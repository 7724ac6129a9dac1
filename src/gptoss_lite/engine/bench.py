"""Serving benchmarks over the engine: a request workload with arrivals, and what it measured.

`run_workload` feeds requests to an `LLM` at their arrival times (seconds from the start; all 0 for a
closed batch), steps the engine until every request finishes, and returns a `ServeReport`: generated
tokens per second, TTFT and inter-token-latency percentiles, KV blocks in use (peak and mean), the
prefix-cache hit rate, preemptions, and the most requests resident at once.

`planner_figures` puts the planner's prediction for the same pool beside it: `max_resident_requests`
for the pool's bytes at the workload's mean context, and the decode batch knee.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

from gptoss_lite.engine.llm import LLM
from gptoss_lite.engine.request import SamplingParams, percentile
from gptoss_lite.plan.core import ServingHardware, batch_knee, max_resident_requests, quantized_kv_bytes
from gptoss_lite.plan.presets import geometry_from_model_config, weights_from_model_config


@dataclass
class WorkItem:
    prompt: list[int]
    params: SamplingParams
    arrival: float = 0.0  # seconds after the start


@dataclass
class ServeReport:
    requests: int
    wall_seconds: float
    prompt_tokens: int
    generated_tokens: int
    ttft: list[float] = field(default_factory=list)  # seconds, per request
    itl: list[float] = field(default_factory=list)  # seconds, every gap of every request
    blocks_total: int = 0
    blocks_peak: int = 0
    blocks_mean: float = 0.0
    prefix_hit_rate: float = 0.0
    preemptions: int = 0
    peak_running: int = 0
    steps: int = 0

    @property
    def generated_tps(self) -> float:
        return self.generated_tokens / self.wall_seconds

    def summary(self) -> dict[str, float]:
        ms = 1e3
        return {
            "requests": self.requests,
            "wall_s": round(self.wall_seconds, 3),
            "generated_tok_s": round(self.generated_tps, 1),
            "prompt_tok_s": round(self.prompt_tokens / self.wall_seconds, 1),
            "ttft_p50_ms": round(percentile(self.ttft, 50) * ms, 1),
            "ttft_p99_ms": round(percentile(self.ttft, 99) * ms, 1),
            "itl_p50_ms": round(percentile(self.itl, 50) * ms, 2),
            "itl_p90_ms": round(percentile(self.itl, 90) * ms, 2),
            "itl_p99_ms": round(percentile(self.itl, 99) * ms, 2),
            "kv_blocks_total": self.blocks_total,
            "kv_blocks_peak": self.blocks_peak,
            "kv_blocks_mean": round(self.blocks_mean, 1),
            "prefix_hit_rate": round(self.prefix_hit_rate, 3),
            "preemptions": self.preemptions,
            "peak_running": self.peak_running,
            "steps": self.steps,
        }


def random_prompts(n: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    """n prompts of uniformly drawn lengths in [lo, hi] and random token ids in [1, vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s) of a Poisson process of `rate` requests/s; all 0 for rate = inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def run_workload(llm: LLM, work: list[WorkItem], *, progress=None) -> ServeReport:
    """Run every item through the engine at its arrival time; see the module docstring."""
    order = sorted(range(len(work)), key=lambda i: work[i].arrival)
    ids: dict[str, int] = {}
    outputs = {}
    used_samples = []
    peak_running = steps = 0
    preempted_before = llm.stats().preemptions
    kv = llm.kv
    hits_before, looked_before = kv.hit_tokens, kv.lookup_tokens
    start = time.monotonic()
    nxt = 0
    while nxt < len(order) or llm.has_unfinished():
        now = time.monotonic() - start
        while nxt < len(order) and work[order[nxt]].arrival <= now:
            item = work[order[nxt]]
            ids[llm.add_request(item.prompt, item.params)] = order[nxt]
            nxt += 1
        if not llm.has_unfinished():
            time.sleep(max(0.0, work[order[nxt]].arrival - now))
            continue
        for out in llm.step():
            if out.finished:
                outputs[ids[out.request_id]] = out
                if progress is not None:
                    progress(len(outputs), len(work))
        steps += 1
        used_samples.append(sum(kv.usage().blocks_used.values()))
        peak_running = max(peak_running, llm.num_running)
    wall = time.monotonic() - start
    ttft, itl = [], []
    for out in outputs.values():
        ttft.append(out.metrics.ttft)
        itl.extend(out.metrics.itl)
    looked = kv.lookup_tokens - looked_before
    return ServeReport(
        requests=len(work),
        wall_seconds=wall,
        prompt_tokens=sum(len(w.prompt) for w in work),
        generated_tokens=sum(len(o.token_ids) for o in outputs.values()),
        ttft=ttft,
        itl=itl,
        blocks_total=sum(kv.usage().blocks_total.values()),
        blocks_peak=max(used_samples, default=0),
        blocks_mean=sum(used_samples) / max(1, len(used_samples)),
        prefix_hit_rate=(kv.hit_tokens - hits_before) / looked if looked else 0.0,
        preemptions=llm.stats().preemptions - preempted_before,
        peak_running=peak_running,
        steps=steps,
    )


def planner_figures(llm: LLM, context_tokens: int) -> dict[str, float]:
    """The planner's figures for this engine's pool and model at `context_tokens` per request."""
    cfg = llm.config
    element = next(llm.model.parameters()).element_size()
    weights = weights_from_model_config(cfg, bytes_per_parameter=element)
    geometry = geometry_from_model_config(cfg, bytes_per_element=element)
    hw = ServingHardware(
        weight_bytes=weights.streamed_weight_bytes,
        bandwidth_bytes_per_second=1.0,  # capacity and knee do not depend on speed
        peak_flops_per_second=1.0,
        parameter_count=weights.active_parameters,
        device_capacity_bytes=llm.runner.kv_bytes + weights.resident_weight_bytes,
        resident_weight_bytes=weights.resident_weight_bytes,
    )
    resident = max_resident_requests(hw, geometry, context_tokens)
    knee = batch_knee(hw, geometry, context_tokens)
    if llm.full_window is not None and context_tokens > llm.full_window:
        # every full layer keeps its last full_window tokens (docs/engine.md#full-layer-window)
        dropped = geometry.full_layers * (context_tokens - llm.full_window) * geometry.bytes_per_token_per_layer
        per_request = geometry.sequence_bytes(context_tokens) - dropped
        resident = (hw.device_capacity_bytes - hw.resident_bytes - hw.runtime_reserve_bytes) // per_request
        knee = hw.weight_bytes / per_request
    if llm.kv_format.quantized:  # the planner's quantised bytes: key group = the block, no residual beyond it
        bits = llm.kv_format.bits
        per_request = quantized_kv_bytes(geometry, context_tokens, bits, key_group=llm.kv.block_size, residual=0)
        tails = llm.runner.kv_tail_bytes  # full-precision staging for blocks being filled, not KV payload
        resident = (hw.device_capacity_bytes - hw.resident_bytes - tails) // per_request
    return {
        "context_tokens": context_tokens,
        "max_resident_requests": resident,
        "batch_knee": round(knee, 1),
    }

"""Serving arithmetic: KV bytes, decode rooflines, capacity, FLOPs and cost (docs/plan.md).

Pure Python on purpose (no torch, no numpy at import time): `gptoss-lite plan` must answer
"how much KV does this model need at 128K on an H100?" on any laptop in milliseconds.

- `plan.core`: the formulas (geometry and payload, decode ceilings, batch knee, capacity, FLOP
  models, cached-input cost, allocation waste) and their validation.
- `plan.presets`: reference geometries, model weights and accelerators, a measurement of this
  machine, and geometries read from a ModelConfig or a Hugging Face config. Our own models'
  geometries and parameter counts are derived from `config.PRESETS`, not retyped.

Everything is importable from `gptoss_lite.plan` directly.
"""

from gptoss_lite.plan.core import (
    GB,
    GIB,
    KB,
    KIB,
    MB,
    MIB,
    AttentionKVGeometry,
    CachedInputCost,
    DecodeCeiling,
    KVGeometry,
    MLAKVGeometry,
    ServingHardware,
    arithmetic_intensity,
    attention_flops,
    batch_knee,
    cached_input_cost,
    decode_ceiling,
    decode_flops,
    expected_paged_waste,
    kv_payload_bytes,
    max_resident_requests,
    naive_preallocation_waste,
    prefill_floor_seconds,
    prefill_flops,
    quantized_kv_bytes,
)
from gptoss_lite.plan.presets import (
    GEOMETRY_PRESETS,
    HARDWARE_PRESETS,
    MODEL_WEIGHTS,
    THIS_MACHINE,
    HardwareSpec,
    ModelWeights,
    geometry_from_hf_config,
    geometry_from_model_config,
    get_geometry,
    get_hardware,
    measure_this_machine,
    serving_hardware,
    weights_from_model_config,
)

__all__ = [
    "GB",
    "GIB",
    "KB",
    "KIB",
    "MB",
    "MIB",
    "AttentionKVGeometry",
    "CachedInputCost",
    "DecodeCeiling",
    "KVGeometry",
    "MLAKVGeometry",
    "ServingHardware",
    "arithmetic_intensity",
    "attention_flops",
    "batch_knee",
    "cached_input_cost",
    "decode_ceiling",
    "decode_flops",
    "expected_paged_waste",
    "kv_payload_bytes",
    "max_resident_requests",
    "naive_preallocation_waste",
    "prefill_floor_seconds",
    "prefill_flops",
    "quantized_kv_bytes",
    "GEOMETRY_PRESETS",
    "HARDWARE_PRESETS",
    "MODEL_WEIGHTS",
    "THIS_MACHINE",
    "HardwareSpec",
    "ModelWeights",
    "geometry_from_hf_config",
    "geometry_from_model_config",
    "get_geometry",
    "get_hardware",
    "measure_this_machine",
    "serving_hardware",
    "weights_from_model_config",
]

"""Attention with learned sinks, sliding windows and GQA: one family, four parts.

- `reference.py`: the oracles (dense attention with an explicit sink column, the attention mass).
- `plan.py`: the key-block planner (query range, band edges, edge masks and their cache, the
  distance mask of one-query rows).
- `blocks.py`: the block loop over any `KVRead` (dense, gathered or dequantising), with the
  online-softmax and flash-merge accumulators both starting from the sink state.
- `decode.py`: the masked fixed-shape decode kernel (eager decode, the engine's batched decode, the
  compiled step).

`layer.py` is the `Attention` module that calls the cache seam and then one of these.
"""

from gptoss_lite.model.attention.blocks import attend, attention_fast, flash_applies
from gptoss_lite.model.attention.decode import masked_decode
from gptoss_lite.model.attention.layer import Attention, attend_ragged
from gptoss_lite.model.attention.reference import attention_mass_reference, attention_reference, visible_mask

__all__ = [
    "Attention",
    "attend",
    "attend_ragged",
    "attention_fast",
    "attention_mass_reference",
    "attention_reference",
    "flash_applies",
    "masked_decode",
    "visible_mask",
]

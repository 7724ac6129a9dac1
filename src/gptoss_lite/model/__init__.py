"""The GPT-OSS-Lite / gpt-oss model.

Shape legend (used in comments throughout the package):
  B batch, T new tokens, S key length (cached + new), H query heads, K KV heads, G = H/K,
  D head dim, C model dim, E experts, A active experts per token, I expert hidden, V vocab,
  L layers, W window, N = B·T flattened tokens.
"""

from gptoss_lite.model.attention import Attention, attention_fast, attention_reference
from gptoss_lite.model.moe import MoE
from gptoss_lite.model.rope import RotaryEmbedding, apply_rotary, apply_rotary_tables, rotary_tables, yarn_inv_freq
from gptoss_lite.model.transformer import GPTOSS, Block, ModelOutput, RMSNorm

__all__ = [
    "GPTOSS",
    "Block",
    "ModelOutput",
    "RMSNorm",
    "Attention",
    "MoE",
    "RotaryEmbedding",
    "apply_rotary",
    "apply_rotary_tables",
    "rotary_tables",
    "yarn_inv_freq",
    "attention_fast",
    "attention_reference",
]

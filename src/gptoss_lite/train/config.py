"""Trainer configuration: one frozen dataclass per concern, read from YAML or JSON (docs/training.md).

A config file has these top-level keys (all optional except what a run needs):

```yaml
model: {preset: lite-tiny, d_model: 128, ...}   # a preset name and/or ModelConfig fields
data: {seq_len: 256, batch_size: 32, seed: 1234, ...}
optimizer: {lr: 2.0e-3, betas: [0.9, 0.95], weight_decay: 0.1, grad_clip: 1.0}
schedule: {warmup_steps: 200, total_steps: 6000, min_lr_ratio: 0.1}
checkpoint: {out_dir: runs/demo, every_n_steps: 500, keep: 3}
logging: {every_n_steps: 10}
precision: fp32            # or bf16 (autocast)
gradient_checkpointing: false
aux_loss_coef: 0.01
seed: 0
device: auto               # auto | cpu | cuda
```

Unknown keys are rejected by name at every level.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptoss_lite.config import ModelConfig
from gptoss_lite.filler import FILLERS
from gptoss_lite.fixtures import resolve_config
from gptoss_lite.validation import check_int as _check_int

PRECISIONS = ("fp32", "bf16")
LOSS_ON = ("all", "answer")
DEVICES = ("auto", "cpu", "cuda")
# A model section without a preset must give these: ModelConfig's own defaults are the 502M preset.
_MODEL_SIZE_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "n_experts",
    "expert_hidden",
)


def _check_float(where: str, value: Any, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{where}={value!r}: must be a finite number")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ValueError(f"{where}={value}: must be in {bracket}{low}, {high}]")


@dataclass(frozen=True)
class DataConfig:
    """Synthetic retrieval documents (see `gptoss_lite.train.data`)."""

    seq_len: int = 256  # tokens per training sequence T; recorded as the model's train_context_length
    batch_size: int = 32  # sequences per process per micro-step
    seed: int = 1234  # data stream seed; NOTE: independent of the evaluator's 42 + length seeds
    passkey_weight: float = 0.5  # mixture weight of passkey documents
    kv_weight: float = 0.35  # mixture weight of multi-fact key/value recall documents
    copy_weight: float = 0.15  # mixture weight of copy-a-sequence documents
    eval_phrasing_prob: float = 0.5  # share of passkey documents using the evaluator's exact wording
    max_facts: int = 6  # most key/value facts in one kv document (>= 2)
    loss_on: str = "all"  # "all": plain LM loss on every token; "answer": only the answer tokens
    filler: str = "procedural"  # haystack generator: "procedural" (small bank) or "varied" (gptoss_lite/filler.py)
    ruler_weight: float = 0.0  # mixture weight of RULER-style label-matching documents (train/ruler_docs.py)
    ruler_haystacks: tuple[str, ...] = ("varied",)  # their haystack kinds: the RULER train split's
    ruler_mix: int = 1  # which grammar and proportions they are drawn from (ruler_docs.MIXES)
    # PoSE-style position skipping (docs/training.md#position-skipping): the full layers see each
    # sequence's seq_len tokens at positions spread over pose_length (None: 0 … seq_len - 1), in
    # pose_chunks runs of consecutive positions with random gaps between them. The documents stay
    # seq_len tokens long.
    pose_length: int | None = None
    pose_chunks: int = 2
    pose_anchor: float = 0.0  # share of sequences whose runs are pinned to 0 and pose_length - 1

    def __post_init__(self) -> None:
        _check_int("data.seq_len", self.seq_len, 1)
        if self.pose_length is not None:
            _check_int("data.pose_length", self.pose_length, self.seq_len)
        _check_int("data.pose_chunks", self.pose_chunks, 1)
        _check_float("data.pose_anchor", self.pose_anchor, 0.0, 1.0)
        if self.pose_chunks > self.seq_len:
            raise ValueError(
                f"data.pose_chunks={self.pose_chunks}: more chunks than data.seq_len={self.seq_len} tokens"
            )
        _check_int("data.batch_size", self.batch_size, 1)
        _check_int("data.seed", self.seed, 0)
        _check_int("data.max_facts", self.max_facts, 2)
        for name in ("passkey_weight", "kv_weight", "copy_weight", "ruler_weight", "eval_phrasing_prob"):
            _check_float(f"data.{name}", getattr(self, name), 0.0, 1.0 if name == "eval_phrasing_prob" else math.inf)
        if self.passkey_weight + self.kv_weight + self.copy_weight + self.ruler_weight <= 0:
            raise ValueError(
                "data.passkey_weight + kv_weight + copy_weight + ruler_weight must be > 0; set at least one weight"
            )
        from gptoss_lite.evals.ruler_splits import TRAIN

        kinds = self.ruler_haystacks
        if isinstance(kinds, (str, bytes)) or not isinstance(kinds, (tuple, list)) or not kinds:
            raise ValueError(f"data.ruler_haystacks={kinds!r}: must be a non-empty list of {TRAIN.haystacks}")
        for kind in kinds:
            if kind not in TRAIN.haystacks:
                raise ValueError(
                    f"data.ruler_haystacks: {kind!r} is not a training haystack; use {TRAIN.haystacks} "
                    "(the evaluation's kinds are never trained on)"
                )
        object.__setattr__(self, "ruler_haystacks", tuple(kinds))
        from gptoss_lite.train.ruler_docs import MIXES

        if isinstance(self.ruler_mix, bool) or self.ruler_mix not in MIXES:
            raise ValueError(f"data.ruler_mix={self.ruler_mix!r}: must be one of {sorted(MIXES)}")
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"data.loss_on={self.loss_on!r}: must be one of {LOSS_ON}")
        if self.filler not in FILLERS:
            raise ValueError(f"data.filler={self.filler!r}: must be one of {FILLERS}")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW."""

    lr: float = 2e-3  # peak learning rate, reached after warmup
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to matrices only (not norms, biases, sinks)
    grad_clip: float | None = 1.0  # max global grad norm; None disables clipping
    grad_accum_steps: int = 1  # micro-batches per optimiser step

    def __post_init__(self) -> None:
        _check_float("optimizer.lr", self.lr, 0.0, 10.0, low_open=True)
        if isinstance(self.betas, (str, bytes)) or not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ValueError(f"optimizer.betas={self.betas!r}: must be two numbers, e.g. [0.9, 0.95]")
        for i, b in enumerate(self.betas):
            _check_float(f"optimizer.betas[{i}]", b, 0.0, 1.0)
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        _check_float("optimizer.eps", self.eps, 0.0, 1.0, low_open=True)
        _check_float("optimizer.weight_decay", self.weight_decay, 0.0, 10.0)
        if self.grad_clip is not None:
            _check_float("optimizer.grad_clip", self.grad_clip, 0.0, math.inf, low_open=True)
        _check_int("optimizer.grad_accum_steps", self.grad_accum_steps, 1)


@dataclass(frozen=True)
class ScheduleConfig:
    """Linear warmup, then cosine decay to `min_lr_ratio * lr` at `total_steps`."""

    warmup_steps: int = 200  # optimiser steps of linear warmup
    total_steps: int = 6000  # optimiser steps of the whole run
    min_lr_ratio: float = 0.1  # final lr as a fraction of the peak

    def __post_init__(self) -> None:
        _check_int("schedule.warmup_steps", self.warmup_steps, 0)
        _check_int("schedule.total_steps", self.total_steps, 1)
        if self.warmup_steps > self.total_steps:
            raise ValueError(f"schedule.warmup_steps={self.warmup_steps}: must be <= total_steps={self.total_steps}")
        _check_float("schedule.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)

    def lr_factor(self, step: int) -> float:
        """Multiplier of the peak lr at 0-based optimiser step `step`."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often the trainer writes checkpoints."""

    out_dir: str = "runs/demo"  # checkpoints/, final/ and metrics.jsonl go here
    every_n_steps: int = 500  # optimiser steps between checkpoints
    keep: int = 3  # most recent checkpoints kept (older ones deleted)

    def __post_init__(self) -> None:
        if not isinstance(self.out_dir, str) or not self.out_dir:
            raise ValueError(f"checkpoint.out_dir={self.out_dir!r}: must be a non-empty path")
        _check_int("checkpoint.every_n_steps", self.every_n_steps, 1)
        _check_int("checkpoint.keep", self.keep, 1)


@dataclass(frozen=True)
class LoggingConfig:
    """Metrics logging."""

    every_n_steps: int = 10  # optimiser steps between metrics.jsonl lines

    def __post_init__(self) -> None:
        _check_int("logging.every_n_steps", self.every_n_steps, 1)


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs."""

    model: ModelConfig = field(default_factory=lambda: resolve_config("lite-tiny"))
    model_preset: str | None = None  # the preset the model fields started from, if any (informational)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    precision: str = "fp32"  # "fp32", or "bf16" autocast (weights and optimiser state stay fp32)
    gradient_checkpointing: bool = False  # recompute each block in backward to save activation memory
    aux_loss_coef: float = 0.01  # weight of the MoE load-balancing loss (docs/model.md#moe-and-the-training-forward)
    seed: int = 0  # model initialisation seed
    device: str = "auto"  # "auto": cuda when available, else cpu
    # A model directory whose weights start this run (a second training stage); None: seeded init.
    # Its architecture must equal `model`; a relative path is relative to the working directory.
    init_from: str | None = None
    # true: `init_from` may differ from `model` in its positions only (ROPE_CHANGE_FIELDS: the rotary
    # scaling and the context it implies). Its weights load as they are and this run learns the new
    # positions: a deliberate change of context, never an accident of a mistyped config.
    init_rope_change: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: must be one of {PRECISIONS}")
        if not isinstance(self.gradient_checkpointing, bool):
            raise TypeError(f"gradient_checkpointing={self.gradient_checkpointing!r}: must be true or false")
        _check_float("aux_loss_coef", self.aux_loss_coef, 0.0, math.inf)
        _check_int("seed", self.seed, 0)
        if self.init_from is not None and not isinstance(self.init_from, str):
            raise TypeError(f"init_from={self.init_from!r}: must be a model directory path or null")
        if not isinstance(self.init_rope_change, bool):
            raise TypeError(f"init_rope_change={self.init_rope_change!r}: must be true or false")
        if self.init_rope_change and self.init_from is None:
            raise ValueError("init_rope_change: true needs init_from (the checkpoint whose positions change)")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r}: must be one of {DEVICES}")
        pose = self.data.pose_length
        if pose is not None and pose > self.model.max_position_embeddings:
            raise ValueError(
                f"data.pose_length={pose} exceeds model.max_position_embeddings="
                f"{self.model.max_position_embeddings}; the positions it trains must exist"
            )
        if self.data.seq_len > self.model.max_position_embeddings:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_position_embeddings="
                f"{self.model.max_position_embeddings}; shorten seq_len or raise the limit"
            )
        if self.model.vocab_size < 264:
            raise ValueError(f"model.vocab_size={self.model.vocab_size}: the byte tokenizer needs >= 264")
        # The trained context is a property of the run: record it on the model config (docs/training.md).
        if self.model.train_context_length != self.data.seq_len:
            object.__setattr__(self, "model", self.model.replace(train_context_length=self.data.seq_len))

    # ---- serialisation ----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from a parsed YAML/JSON mapping, rejecting unknown keys by name at every level."""
        if not isinstance(data, dict):
            raise ValueError(f"a train config must be a mapping of sections, got {type(data).__name__}")
        _check_keys("train config", data)
        sections = {
            "data": DataConfig,
            "optimizer": OptimizerConfig,
            "schedule": ScheduleConfig,
            "checkpoint": CheckpointConfig,
            "logging": LoggingConfig,
        }
        scalars = {
            "precision",
            "gradient_checkpointing",
            "aux_loss_coef",
            "seed",
            "device",
            "init_from",
            "init_rope_change",
        }
        known = {"model", *sections, *scalars}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown train config key(s) {unknown}; valid keys: {sorted(known)}")
        kwargs: dict[str, Any] = {k: data[k] for k in scalars if k in data}
        for key, klass in sections.items():
            kwargs[key] = _section(key, klass, data.get(key) or {})
        if data.get("model") is None:
            raise ValueError(
                "no 'model' section; name the architecture, e.g. model: {preset: lite-tiny}, or give "
                f"every size field {list(_MODEL_SIZE_FIELDS)} (nothing falls back to the 502M preset)"
            )
        if not isinstance(data["model"], dict):
            raise ValueError(f"train config section 'model' must be a mapping, got {data['model']!r}")
        _check_keys("section 'model'", data["model"])
        model_fields = dict(data["model"])
        preset = model_fields.pop("preset", None)
        if preset is not None:
            base = resolve_config(preset).to_dict()
            unknown_model = sorted(set(model_fields) - set(base))
            if unknown_model:
                raise ValueError(f"unknown model field(s) {unknown_model}; valid fields: {sorted(base)}")
            if "n_layers" in model_fields and "layer_types" not in model_fields:
                base["layer_types"] = []  # re-derive the alternating layout for the new depth
            model_fields = {**base, **model_fields}
        else:
            known_model = {f.name for f in dataclasses.fields(ModelConfig)}
            unknown_model = sorted(set(model_fields) - known_model)
            if unknown_model:
                raise ValueError(f"unknown ModelConfig field(s) {unknown_model}; valid fields: {sorted(known_model)}")
            missing = [k for k in _MODEL_SIZE_FIELDS if k not in model_fields]
            if missing:
                raise ValueError(
                    f"model section without a preset lacks {missing}; give every size field "
                    f"{list(_MODEL_SIZE_FIELDS)} or start from a preset (model: {{preset: lite-tiny, "
                    "...}); missing fields never fall back to the 502M preset"
                )
        kwargs["model"] = ModelConfig.from_dict(model_fields)
        kwargs["model_preset"] = preset
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """A plain mapping that `from_dict` reads back to an equal config."""
        model = self.model.to_dict()
        out: dict[str, Any] = {"model": model if self.model_preset is None else {"preset": self.model_preset, **model}}
        for key in ("data", "optimizer", "schedule", "checkpoint", "logging"):
            out[key] = dataclasses.asdict(getattr(self, key))
        out["optimizer"]["betas"] = list(self.optimizer.betas)
        out.update(
            precision=self.precision,
            gradient_checkpointing=self.gradient_checkpointing,
            aux_loss_coef=self.aux_loss_coef,
            seed=self.seed,
            device=self.device,
        )
        return out

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _check_keys(where: str, mapping: dict) -> None:
    bad = [k for k in mapping if not isinstance(k, str)]
    if bad:
        raise ValueError(
            f"{where}: key {bad[0]!r} is not a name; keys are words such as 'seq_len' "
            "(in YAML, quote a key that looks like a number)"
        )


def _section(key: str, klass: type, values: Any) -> Any:
    if not isinstance(values, dict):
        raise ValueError(f"train config section {key!r} must be a mapping, got {values!r}")
    _check_keys(f"section {key!r}", values)
    known = {f.name for f in dataclasses.fields(klass)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in section {key!r}; valid keys: {sorted(known)}")
    values = dict(values)
    if "betas" in values and isinstance(values["betas"], list):
        values["betas"] = tuple(values["betas"])
    return klass(**values)


def load_train_config(path: str | Path) -> TrainConfig:
    """Read a TrainConfig from a .yaml/.yml or .json file."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(
            f"train config {str(path)!r} is a directory; pass --config PATH to a YAML or JSON file "
            "(e.g. configs/demo_cpu.yaml)"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"train config {str(path)!r} does not exist; pass --config PATH to a YAML or JSON file "
            f"(e.g. configs/demo_cpu.yaml)"
        )
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ValueError(f"train config {str(path)!r}: unknown extension {path.suffix!r}; use .yaml, .yml or .json")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"train config {str(path)!r}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
            f"offset {exc.start}); save it as UTF-8"
        ) from None
    except OSError as exc:
        raise ValueError(f"train config {str(path)!r}: cannot be read ({exc.strerror or exc})") from None
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"train config {str(path)!r}: not valid JSON: {exc}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1} column {where.column + 1}" if where is not None else ""
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise ValueError(f"train config {str(path)!r}: not valid YAML{at}: {problem}") from None
    if data is None:
        raise ValueError(f"train config {str(path)!r} is empty")
    try:
        return TrainConfig.from_dict(data)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{path}: {exc}") from exc

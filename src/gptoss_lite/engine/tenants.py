"""Tenants' policy: each tenant's share and limits (`TenantLimits`, `TenantPolicy`, from flags or a
YAML/JSON file), the refusal a quota gives (`QuotaExceeded`), and the counters a tenant's queues report
(`TenantCounters`). The rule that uses them is engine/fairness.py's (docs/engine.md#sharing-between-tenants).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

DEFAULT_TENANT = "default"


class QuotaExceeded(Exception):
    """A tenant's quota refuses a request now; `retry_after` is the seconds after which it may pass."""

    def __init__(self, tenant: str, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.retry_after = retry_after


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's share and quotas (None: no limit)."""

    share: float = 1.0
    max_running: int | None = None
    max_waiting: int | None = None
    tokens_per_minute: int | None = None
    max_queue_time: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.share, bool) or not isinstance(self.share, (int, float)):
            raise TypeError(f"share={self.share!r}: expected a number")
        if not (math.isfinite(self.share) and self.share > 0):
            raise ValueError(f"share={self.share!r}: must be a finite number > 0")
        for name in ("max_running", "tokens_per_minute"):
            _check_count(name, getattr(self, name), 1)
        _check_count("max_waiting", self.max_waiting, 0)
        t = self.max_queue_time
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, (int, float)):
                raise TypeError(f"max_queue_time={t!r}: expected a number of seconds")
            if not (math.isfinite(t) and t > 0):
                raise ValueError(f"max_queue_time={t!r}: must be a finite number of seconds > 0")


def _check_count(name: str, value: Any, low: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r}: expected an integer")
    if value < low:
        raise ValueError(f"{name}={value!r}: must be >= {low}")


_LIMIT_FIELDS = tuple(f.name for f in fields(TenantLimits))


@dataclass(frozen=True)
class TenantPolicy:
    """Limits for every tenant (`default`) and for named ones (`tenants`, each a whole `TenantLimits`:
    a field it leaves out takes the default's value when built by `from_mapping`). `fair=False`
    admits in arrival order across tenants (the rule before tenants shared fairly)."""

    default: TenantLimits = field(default_factory=TenantLimits)
    tenants: Mapping[str, TenantLimits] = field(default_factory=dict)
    fair: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.default, TenantLimits):
            raise TypeError(f"default: expected TenantLimits, got {type(self.default).__name__}")
        for name, limits in self.tenants.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"tenant name {name!r}: expected a non-empty string")
            if not isinstance(limits, TenantLimits):
                raise TypeError(f"tenant {name!r}: expected TenantLimits, got {type(limits).__name__}")
        if not isinstance(self.fair, bool):
            raise TypeError(f"fair={self.fair!r}: expected a bool")

    def limits(self, tenant: str) -> TenantLimits:
        return self.tenants.get(tenant, self.default)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, where: str = "tenant policy") -> TenantPolicy:
        """`{"default": {...}, "tenants": {NAME: {...}}, "fair": bool}`, every part optional; a named
        tenant's missing fields come from "default". Unknown keys are errors naming them."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected a mapping with 'default' and/or 'tenants'")
        unknown = set(data) - {"default", "tenants", "fair"}
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; expected 'default', 'tenants', 'fair'")
        default = _limits(data.get("default") or {}, TenantLimits(), f"{where}: default")
        named = data.get("tenants") or {}
        if not isinstance(named, Mapping):
            raise ValueError(f"{where}: 'tenants' must map tenant names to their limits")
        tenants = {str(k): _limits(v or {}, default, f"{where}: tenant {k!r}") for k, v in named.items()}
        return cls(default=default, tenants=tenants, fair=data.get("fair", True))

    @classmethod
    def load(cls, path: str | Path) -> TenantPolicy:
        """Read a policy file: YAML (`.yaml`/`.yml`) or JSON (anything else)."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ValueError(f"tenant policy {path}: {exc.strerror or exc}") from None
        try:
            if path.suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as exc:  # noqa: BLE001 - a parse error of any kind: say where
            raise ValueError(
                f"tenant policy {path}: not valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'JSON'}: {exc}"
            ) from None
        return cls.from_mapping(data or {}, where=f"tenant policy {path}")


def _limits(data: Any, base: TenantLimits, where: str) -> TenantLimits:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping of {', '.join(_LIMIT_FIELDS)}")
    unknown = set(data) - set(_LIMIT_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; expected some of {', '.join(_LIMIT_FIELDS)}")
    values = {name: data.get(name, getattr(base, name)) for name in _LIMIT_FIELDS}
    try:
        return TenantLimits(**values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


@dataclass
class TenantCounters:
    """What a tenant has had from the engine (for metrics): requests refused by its quotas, requests
    that waited past `max_queue_time`, prompt tokens admitted (uncached, recomputation included) and
    tokens generated; and the requests it has running and waiting now."""

    running: int = 0
    waiting: int = 0
    admitted_requests: int = 0
    admitted_tokens: int = 0
    generated_tokens: int = 0
    rejected: int = 0
    expired: int = 0

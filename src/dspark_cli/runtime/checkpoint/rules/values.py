"""Tests on raw JSON values, shared by the rules (config.json keys can hold anything)."""

from __future__ import annotations

from typing import Any


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def nonneg_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def lookup(config: dict[str, Any], dotted: str | None) -> Any:
    """The value at a dotted key path (e.g. "dflash_config.mask_token_id"), None where a level is missing."""
    table: Any = config
    for part in (dotted or "").split("."):
        table = table.get(part) if isinstance(table, dict) else None
    return table

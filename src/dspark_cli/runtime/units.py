"""Human-readable quantities shared by every report."""

from __future__ import annotations

BINARY_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n_bytes: float) -> str:
    """1536 -> '1.5 KiB'; binary units up to GiB (thousands separated beyond), whole bytes below 1 KiB."""
    for unit, size in BINARY_UNITS:
        if n_bytes >= size:
            return f"{n_bytes / size:,.1f} {unit}"
    return f"{n_bytes:,.0f} B"

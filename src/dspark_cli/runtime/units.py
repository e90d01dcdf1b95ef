"""Human-readable quantities shared by every report."""

from __future__ import annotations

BINARY_UNITS = ("B", "KiB", "MiB", "GiB")  # steps of 1024; GiB is the largest (bench sizes read as GiB)
DECIMAL_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")  # steps of 1000, as file sizes and disk makers count


def format_bytes(count: float, *, decimal: bool = False) -> str:
    """1536 -> '1.5 KiB' (decimal: '1.5 kB'); one decimal and thousands separators, whole bytes below one kilo."""
    base, units = (1000, DECIMAL_UNITS) if decimal else (1024, BINARY_UNITS)
    power = 0
    while power < len(units) - 1 and count >= base ** (power + 1):
        power += 1
    if power == 0:
        return f"{count:,.0f} B"
    return f"{count / base**power:,.1f} {units[power]}"

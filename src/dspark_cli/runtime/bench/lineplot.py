"""A small log-log line chart written as PNG without a plotting library (zlib only).

    write_line_chart(path, [Panel("BF16  T=0", [Series("1 DENSE", [(1, 900.0), (8, 1500.0)]), ...])],
                     x_label="BATCH", y_label="US PER DRAFT STEP")

Panels are stacked vertically; each has log2 x, log10 y, grid lines, tick labels and a legend. Text uses a
built-in 5x7 upper-case font (other characters are drawn blank).
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from dspark_cli.runtime.io.outputs import atomic_write_bytes

WIDTH = 1100
PANEL_HEIGHT = 420
LEFT, RIGHT, TOP, BOTTOM = 100, 360, 64, 70  # margins of a panel's plot area
SCALE = 2  # font pixels per glyph pixel
WHITE, BLACK, GRID = (255, 255, 255), (0, 0, 0), (225, 225, 225)
PALETTE = (
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
)
# 5x7 glyphs: seven rows of five bits (bit 4 = leftmost pixel), as 14 hex digits.
FONT = {
    "0": "0E11131519110E", "1": "040C040404040E", "2": "0E11010204081F",
    "3": "1F02040201110E", "4": "02060A121F0202", "5": "1F101E0101110E",
    "6": "0608101E11110E", "7": "1F010204080808", "8": "0E11110E11110E", "9": "0E11110F01020C",
    "A": "0E1111111F1111", "B": "1E11111E11111E", "C": "0E11101010110E", "D": "1C12111111121C",
    "E": "1F10101E10101F", "F": "1F10101E101010", "G": "0E11101711110F",
    "H": "1111111F111111", "I": "0E04040404040E", "J": "0702020202120C",
    "K": "11121418141211", "L": "1010101010101F", "M": "111B1515111111", "N": "11111915131111",
    "O": "0E11111111110E", "P": "1E11111E101010", "Q": "0E11111115120D",
    "R": "1E11111E141211", "S": "0F10100E01011E", "T": "1F040404040404", "U": "1111111111110E",
    "V": "11111111110A04", "W": "1111111515150A", "X": "11110A040A1111", "Y": "1111110A040404",
    "Z": "1F01020408101F", ".": "00000000000C0C", ",": "000000000C0408", "-": "0000001F000000",
    "=": "00001F001F0000", "/": "00010204081000", "(": "02040808080402", ")": "08040202020408",
    ":": "000C0C000C0C00", "+": "0004041F040400", " ": "00000000000000",
}


@dataclass(frozen=True)
class Series:
    label: str
    points: list[tuple[float, float]]  # (x, y), both > 0


@dataclass(frozen=True)
class Panel:
    title: str
    series: list[Series]


class Canvas:
    """An RGB raster with the few drawing operations a chart needs."""

    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(WHITE) * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
        """Fill [x0, x1) x [y0, y1), clipped to the canvas."""
        x0, x1 = max(0, x0), min(self.width, x1)
        if x0 >= x1:
            return
        span = bytes(color) * (x1 - x0)
        for y in range(max(0, y0), min(self.height, y1)):
            start = 3 * (y * self.width + x0)
            self.pixels[start : start + len(span)] = span

    def line(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int], width: int = 3) -> None:
        """A straight line of `width` pixels (Bresenham, stamping squares)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        error = dx + dy
        half = width // 2
        while True:
            self.rect(x0 - half, y0 - half, x0 - half + width, y0 - half + width, color)
            if x0 == x1 and y0 == y1:
                return
            doubled = 2 * error
            if doubled >= dy:
                error += dy
                x0 += sx
            if doubled <= dx:
                error += dx
                y0 += sy

    def text(self, x: int, y: int, text: str, color: tuple[int, int, int] = BLACK) -> None:
        """Upper-cased text with its top-left corner at (x, y)."""
        for char in text.upper():
            glyph = FONT.get(char, FONT[" "])
            for row in range(7):
                bits = int(glyph[2 * row : 2 * row + 2], 16)
                for col in range(5):
                    if bits & (0x10 >> col):
                        self.rect(x + col * SCALE, y + row * SCALE, x + (col + 1) * SCALE, y + (row + 1) * SCALE, color)
            x += text_width(" ")

    def png(self) -> bytes:
        rows = b"".join(
            b"\x00" + bytes(self.pixels[3 * y * self.width : 3 * (y + 1) * self.width]) for y in range(self.height)
        )
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        chunks = _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows, 6)) + _chunk(b"IEND", b"")
        return b"\x89PNG\r\n\x1a\n" + chunks


def text_width(text: str) -> int:
    return 6 * SCALE * len(text)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def write_line_chart(path: Path | str, panels: list[Panel], x_label: str, y_label: str) -> None:
    """Draw the panels (log2 x, log10 y) and write the PNG atomically."""
    canvas = Canvas(WIDTH, PANEL_HEIGHT * max(1, len(panels)))
    for index, panel in enumerate(panels):
        _draw_panel(canvas, panel, index * PANEL_HEIGHT, x_label, y_label)
    atomic_write_bytes(Path(path), canvas.png())


def _draw_panel(canvas: Canvas, panel: Panel, top: int, x_label: str, y_label: str) -> None:
    x0, x1 = LEFT, WIDTH - RIGHT
    y0, y1 = top + TOP, top + PANEL_HEIGHT - BOTTOM
    points = [p for s in panel.series for p in s.points if p[0] > 0 and p[1] > 0]
    xs = sorted({p[0] for p in points}) or [1.0]
    x_lo, x_hi = math.log2(xs[0]), math.log2(xs[-1])
    x_lo, x_hi = x_lo - 0.25, x_hi + 0.25  # keep end points off the axes
    ys = [p[1] for p in points] or [1.0]
    y_lo, y_hi = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    if y_hi == y_lo:
        y_hi += 1

    def to_px(x: float, y: float) -> tuple[int, int]:
        px = x0 + (math.log2(x) - x_lo) / (x_hi - x_lo) * (x1 - x0)
        py = y1 - (math.log10(y) - y_lo) / (y_hi - y_lo) * (y1 - y0)
        return round(px), round(py)

    canvas.text(8, top + 10, panel.title)
    canvas.text(8, top + 36, y_label)
    for decade in range(y_lo, y_hi + 1):
        _, py = to_px(2.0**x_lo, 10.0**decade)
        canvas.rect(x0, py, x1, py + 1, GRID)
        label = _decade_label(decade)
        canvas.text(x0 - 10 - text_width(label), py - 7, label)
    for x in xs:
        px, _ = to_px(x, 10.0**y_lo)
        canvas.rect(px, y0, px + 1, y1, GRID)
        label = f"{x:g}"
        canvas.text(px - text_width(label) // 2, y1 + 10, label)
    canvas.rect(x0, y0, x0 + 2, y1 + 1, BLACK)
    canvas.rect(x0, y1, x1 + 1, y1 + 2, BLACK)
    canvas.text((x0 + x1 - text_width(x_label)) // 2, y1 + 36, x_label)
    for number, series in enumerate(panel.series):
        color = PALETTE[number % len(PALETTE)]
        pixels = [to_px(x, y) for x, y in sorted(series.points) if x > 0 and y > 0]
        for (ax, ay), (bx, by) in zip(pixels, pixels[1:]):
            canvas.line(ax, ay, bx, by, color)
        for px, py in pixels:
            canvas.rect(px - 4, py - 4, px + 5, py + 5, color)
        legend_y = y0 + number * 22
        canvas.rect(x1 + 20, legend_y + 5, x1 + 44, legend_y + 9, color)
        canvas.text(x1 + 52, legend_y, series.label[: (RIGHT - 60) // text_width(" ")])


def _decade_label(decade: int) -> str:
    value = 10.0**decade
    for limit, suffix in ((1e6, "M"), (1e3, "K")):
        if value >= limit:
            return f"{value / limit:g}{suffix}"
    return f"{value:g}"

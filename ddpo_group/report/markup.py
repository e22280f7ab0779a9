"""The report's HTML building blocks: escaping, the stylesheet, embedded images within the size cap (`Inline`).

Every image is embedded as a base64 data URI, so the single .html file can be moved and opened anywhere, up to
a size cap (`max_bytes`, MAX_REPORT_BYTES by default): past it an image is linked (a path relative to the
report) and counted in the report's "left out" note. Images are shown at their own size or larger (never
shrunk more than 2x).
"""

from __future__ import annotations

import base64
import html
import math
import os
import urllib.parse
from pathlib import Path
from typing import Any

from ddpo_group.report.run import finite, unreadable_image

# The report's size cap: 8 MB of HTML. A 5000-epoch run's grids would make it 150 MB or more; past the cap the
# sample grids are thinned evenly and the rest linked. Everything else (plots, evaluation, best and worst) comes first.
MAX_REPORT_BYTES = 8 * 2**20
TEXT_RESERVE = 256 * 2**10  # room kept for the report's text when the images of the early sections are embedded
MIN_SHOWN_WIDTH = 96  # a sample image narrower than this is enlarged (nearest neighbour) by an integer factor
MAX_SHOWN_WIDTH = 384  # a wider one is shown at max(this, half its width): never shrunk more than 2x


def png_data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def data_uri_length(num_bytes: int) -> int:
    """Characters of the data URI of a PNG of `num_bytes` bytes (base64: 4 per 3, padded)."""
    return len("data:image/png;base64,") + 4 * math.ceil(num_bytes / 3)


def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def shown_width(width: int) -> int:
    """The width an image of `width` pixels is shown at: small ones enlarged by an integer factor to at least
    MIN_SHOWN_WIDTH (32 -> 96), wide ones at max(MAX_SHOWN_WIDTH, width / 2), never narrower than half their width."""
    if width < MIN_SHOWN_WIDTH:
        return width * math.ceil(MIN_SHOWN_WIDTH / width)
    return min(width, max(MAX_SHOWN_WIDTH, math.ceil(width / 2)))


def img_tag(data_uri: str, alt: str, css_class: str = "", size: tuple[int, int] | None = None) -> str:
    cls = f' class="{css_class}"' if css_class else ""
    dims = f' width="{size[0]}" height="{size[1]}"' if size else ""
    return f'<img{cls}{dims} src="{data_uri}" alt="{esc(alt)}">'


class Inline:
    """The report's images within its size cap: embedded while they fit in `limit` characters, else linked
    (a path relative to the report's folder) and counted in the report's "left out" note."""

    def __init__(self, limit: int, link_base: Path):
        self.limit, self.used, self.link_base = limit, 0, link_base
        self.left_out: list[tuple[str, Path]] = []  # (section, file)

    def plot(self, png: bytes, alt: str, css_class: str = "plot") -> str:
        """A plot is always embedded (tens of KB); it counts against the cap."""
        uri = png_data_uri(png)
        self.used += len(uri)
        return img_tag(uri, alt, css_class)

    def link(self, path: Path, text: str) -> str:
        href = urllib.parse.quote(Path(os.path.relpath(path, self.link_base)).as_posix())
        return f'<a class="linked" href="{esc(href)}">{esc(text)}</a>'

    def file(self, path: Path | None, alt: str, css_class: str, section: str) -> str:
        """An image file of the run: a sample at `shown_width`, a grid at its own size; a link past the cap."""
        if path is None or not path.exists():
            return f'<span class="missing">missing image: {esc(path)}</span>'
        if (why := unreadable_image(path)) is not None:
            return f'<span class="missing">not shown: {esc(path)} ({esc(why)})</span>'
        cost = data_uri_length(path.stat().st_size)
        if self.used + cost > self.limit:
            self.left_out.append((section, path))
            return self.link(path, f"{alt} (linked: over the report's size cap)")
        self.used += cost
        size = None
        if css_class == "sample":
            from PIL import Image

            with Image.open(path) as image:
                width, height = image.size
            shown = shown_width(width)
            size = (shown, max(1, round(height * shown / width)))
        return img_tag(png_data_uri(path.read_bytes()), alt, css_class, size)


def fmt(value: Any) -> str:
    number = finite(value)
    if number is None:
        return "" if value is None else str(value)
    return f"{number:.4g}"


LEFT_OUT = "<!-- left out -->"


def sample_figure(record: dict | None, caption: str, inline: Inline, section: str, alt: str | None = None) -> str:
    if record is None:
        return f'<figure><span class="missing">none</span><figcaption>{esc(caption)}</figcaption></figure>'
    if record.get("outside"):
        image = f'<span class="missing">not shown: {esc(record["outside"])} is outside the run directory</span>'
    elif record.get("unreadable"):
        image = f'<span class="missing">not shown: {esc(record["unreadable"])}</span>'
    else:
        alt = alt or f"{caption} {record.get('prompt', '')}"
        image = inline.file(record.get("image_path"), alt, "sample", section)
    return f"<figure>{image}<figcaption>{esc(caption)}</figcaption></figure>"


CSS = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; margin-bottom: 1em; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: left; vertical-align: top; }
table.headline th { background: #f3f3f3; }
.status { padding: 0.4em 0.8em; font-weight: bold; margin: 0.3em 0; }
.status.ok { background: #e6f4e6; }
.status.failed { background: #fbe3e3; color: #900; }
.status.stopped, .status.incomplete, .status.earlier { background: #fff4d6; }
.leftout { background: #fff4d6; padding: 0.4em 0.8em; }
.small { font-size: 0.85em; color: #555; }
.cols { display: flex; flex-wrap: wrap; gap: 1.5em; align-items: flex-start; }
.col { flex: 0 0 auto; max-width: 100%; overflow-x: auto; }
.pair { display: flex; gap: 1em; align-items: flex-start; overflow-x: auto; }
.pair > .col { flex: 0 0 auto; max-width: none; }
.halves { display: flex; gap: 1.5em; align-items: flex-start; }
.half { flex: 1; min-width: 0; }
.scroll { overflow-x: auto; max-width: 100%; }
.panels { display: flex; flex-wrap: wrap; gap: 0.5em; }
img.grid { image-rendering: pixelated; }
img.wide { max-width: 100%; }
img.sample { image-rendering: pixelated; }
table.paired td.cell .pair { gap: 4px; }
th.prompt { max-width: 12em; font-weight: normal; }
.row { display: flex; flex-wrap: wrap; gap: 6px; }
.bw { display: flex; gap: 2em; align-items: flex-start; }
.bw p { margin: 0.2em 0; }
figure { margin: 0; font-size: 0.8em; text-align: center; width: min-content; overflow-wrap: anywhere; }
figcaption { min-width: 6em; }
pre { font-size: 0.8em; background: #f6f6f6; padding: 0.5em; overflow-x: auto; }
.missing { color: #a00; font-size: 0.8em; }
tr.worse td { background: #fbe3e3; }
tr.better td { background: #e6f4e6; }
/* fits a 1400-pixel window: side-by-side images wrap or scale down instead of running off the right edge */
body { max-width: 1400px; }
.pair { flex-wrap: wrap; }
.pair > .col { flex: 1 1 0; min-width: 0; }
.pair img.grid, .col img.grid { max-width: 100%; height: auto; }
table.paired { table-layout: fixed; width: 100%; }
table.paired th.prompt { width: 9em; }
table.paired img.sample { max-width: 100%; height: auto; }
table.paired td.cell .pair { flex-wrap: nowrap; }
table.paired td.cell figure { width: auto; flex: 1 1 0; min-width: 0; }
"""

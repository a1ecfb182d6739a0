"""Rewrite the generated blocks of the documentation (``make docs``): the settings reference
(docs/settings.md), the web API reference (docs/api.md) and the metrics reference
(docs/metrics.md), each rendered from the code that defines it."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from streamapp.metrics import metrics_reference
from streamapp.settings import settings_reference
from streamapp.views import api_reference

ROOT = Path(__file__).resolve().parent.parent
#: Marker name → the function that renders the block.
BLOCKS: dict[str, Callable[[], str]] = {
    "settings-reference": settings_reference,
    "api-reference": api_reference,
    "metrics-reference": metrics_reference,
}
#: Marker name → the file (relative to the repository root) that holds the block.
HOMES: dict[str, str] = {
    "settings-reference": "docs/settings.md",
    "api-reference": "docs/api.md",
    "metrics-reference": "docs/metrics.md",
}


def render(text: str) -> str:
    """``text`` with the block between each pair of markers replaced by its current content."""
    for name, make in BLOCKS.items():
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
        text = pattern.sub(lambda _m, s=start, e=end, f=make: f"{s}\n{f()}\n{e}", text)
    return text


def documents() -> list[Path]:
    """The README and every Markdown file under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


if __name__ == "__main__":
    for path in documents():
        text = path.read_text()
        new = render(text)
        if new != text:
            path.write_text(new)
            print(f"updated {path.relative_to(ROOT)}")

"""Rewrite the README's generated blocks (``make docs``): the settings reference, and the web API
and metrics references of streamapp.views / streamapp.metrics."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from streamapp.metrics import metrics_reference
from streamapp.settings import settings_reference
from streamapp.views import api_reference

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- settings-reference:start -->", "<!-- settings-reference:end -->"
#: Marker name → the function that renders the block.
BLOCKS: dict[str, Callable[[], str]] = {
    "settings-reference": settings_reference,
    "api-reference": api_reference,
    "metrics-reference": metrics_reference,
}


def render(text: str) -> str:
    """``text`` with the block between each pair of markers replaced by its current content."""
    for name, make in BLOCKS.items():
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
        text = pattern.sub(lambda _m, s=start, e=end, f=make: f"{s}\n{f()}\n{e}", text)
    return text


if __name__ == "__main__":
    README.write_text(render(README.read_text()))

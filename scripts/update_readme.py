"""Rewrite the README's settings reference from the settings object (``make docs``)."""

from __future__ import annotations

import re
from pathlib import Path

from streamapp.settings import settings_reference

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- settings-reference:start -->", "<!-- settings-reference:end -->"


def render(text: str) -> str:
    """``text`` with the block between the markers replaced by the current reference."""
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    return pattern.sub(f"{START}\n{settings_reference()}\n{END}", text)


if __name__ == "__main__":
    README.write_text(render(README.read_text()))

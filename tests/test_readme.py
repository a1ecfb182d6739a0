"""The README documents what the code does."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from streamapp.codecs import REASONS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_settings_reference_matches_the_settings_object() -> None:
    script = ROOT / "scripts" / "update_readme.py"
    spec = importlib.util.spec_from_file_location("update_readme", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.render(README) == README, "run `make docs` to regenerate the settings table"


def test_every_dead_letter_reason_is_documented() -> None:
    missing = [reason for reason in REASONS if f"| `{reason}` |" not in README]
    assert missing == []

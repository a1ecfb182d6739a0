"""The README and docs/ document what the code does, and their links lead somewhere."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from streamapp.codecs import REASONS

ROOT = Path(__file__).resolve().parent.parent


def _update_readme() -> ModuleType:
    script = ROOT / "scripts" / "update_readme.py"
    spec = importlib.util.spec_from_file_location("update_readme", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


UPDATE = _update_readme()
DOCUMENTS = UPDATE.documents()


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_generated_blocks_match_the_code(path: Path) -> None:
    text = path.read_text()
    assert UPDATE.render(text) == text, "run `make docs` to regenerate the reference tables"


@pytest.mark.parametrize("name", sorted(UPDATE.BLOCKS))
def test_each_generated_block_is_in_its_home_file_once(name: str) -> None:
    holders = [p.relative_to(ROOT).as_posix() for p in DOCUMENTS
               if f"<!-- {name}:start -->" in p.read_text()]
    assert holders == [UPDATE.HOMES[name]]


def test_every_dead_letter_reason_is_documented() -> None:
    records = (ROOT / "docs" / "records.md").read_text()
    missing = [reason for reason in REASONS if f"| `{reason}` |" not in records]
    assert missing == []


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(path: Path) -> None:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
    broken = [t for t in targets if "://" not in t and not (path.parent / t).exists()]
    assert broken == []


def test_license_file_is_the_one_pyproject_declares() -> None:
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License")
    assert "Version 2.0, January 2004" in text


def test_api_doc_lists_the_load_refusals_and_shows_the_status_example_once() -> None:
    text = (ROOT / "docs" / "api.md").read_text()

    assert text.count("$ streamapp status http://127.0.0.1:6066 --interval 3") == 1
    assert text.count("streamapp workers\n┏") == 1
    assert "| 429 | `rate_limited` |" in text and "| 503 | `busy` |" in text
    assert "`Retry-After`" in text and "`retry_after_s`" in text
    assert "Only `sort=device_id` walks every device exactly once" in text


def test_the_skipped_updates_metric_says_what_docs_tables_md_says() -> None:
    from streamapp.metrics import metrics_reference

    help_text = next(line for line in metrics_reference().splitlines()
                     if "streamapp_table_updates_skipped_total" in line).split(" | ")[-1]
    tables = " ".join((ROOT / "docs" / "tables.md")
                      .read_text().split())
    assert help_text.rstrip(" |.") == ("Device-state flushes and retry-counter writes skipped "
                                       "while the partition counts of the topics and the "
                                       "tables differed")
    assert help_text.rstrip(" |.").lower() in tables.lower()

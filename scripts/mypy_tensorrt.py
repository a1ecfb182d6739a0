"""Type-check the TensorRT backend against the ``tensorrt-stubs`` package.

``mypy engines`` alone sees ``tensorrt`` as ``Any``: the stubs package installs ``tensorrt/`` and
``tensorrt_bindings/`` as plain ``.pyi`` files without a ``py.typed`` marker (so PEP 561 makes
mypy skip them), and a few of its signatures do not parse (a parameter named ``in``, a required
parameter after defaulted ones). This script copies the stubs into a temporary directory,
repairs those lines, and runs mypy on ``engines/tensorrt`` with that directory on ``MYPYPATH``,
so every ``trt.*`` call is checked against the TensorRT 10 API.

Usage: ``python scripts/mypy_tensorrt.py`` (exit status is mypy's).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _site_packages() -> Path:
    spec = importlib.util.find_spec("tensorrt_stubs")
    if spec is None or spec.origin is None:
        sys.exit("tensorrt-stubs is not installed (pip install tensorrt-stubs)")
    return Path(spec.origin).resolve().parents[1]


def _repair(text: str) -> str:
    # ``in`` is a keyword: rename such parameters.
    text = re.sub(r"([(,]\s*)in(\s*:)", r"\1in_\2", text)

    # "def f(a: X = None, b: int)" is invalid: give later parameters a default too.
    def fix_defaults(match: re.Match[str]) -> str:
        params = match.group(2).split(", ")
        seen_default = False
        out = []
        for p in params:
            if "=" in p:
                seen_default = True
            elif seen_default and ":" in p and not p.strip().startswith("*"):
                p = p + " = ..."
            out.append(p)
        return match.group(1) + ", ".join(out) + match.group(3)

    return re.sub(r"^(\s*def \w+\()(.*)(\) ->.*:)$", fix_defaults, text, flags=re.M)


def main() -> int:
    site = _site_packages()
    with tempfile.TemporaryDirectory() as tmp:
        for package in ("tensorrt", "tensorrt_bindings"):
            src = site / package
            dst = Path(tmp) / package
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
            for stub in dst.rglob("*.pyi"):
                # The stubs have errors of their own (e.g. a module-level ``bool`` that shadows the
                # builtin in annotations); report only ours.
                stub.write_text("# mypy: ignore-errors\n" + _repair(stub.read_text()))
        env = dict(os.environ, MYPYPATH=tmp)
        cmd = [sys.executable, "-m", "mypy", "--no-incremental", *sys.argv[1:], "engines/tensorrt"]
        return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    raise SystemExit(main())

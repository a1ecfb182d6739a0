"""The ``engines`` command: list backends and inspect models.

Add a subcommand with a plain ``@app.command()`` function (``build`` and ``bench`` will come that
way). Any :class:`~engines.exceptions.EngineError` a subcommand raises is printed as one
``error: ...`` line on stderr with exit code 1 by :class:`_EngineErrorGroup`, so commands just
let errors propagate; exit with another code through ``typer.Exit(code)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from engines.base import DYNAMIC, TensorSpec
from engines.exceptions import EngineError
from engines.registry import (
    available_backends,
    get_backend,
    load_engine,
    registered_backends,
    resolve_backend,
)

__all__ = ["app", "main"]


class _EngineErrorGroup(TyperGroup):
    """Turns an :class:`EngineError` from any subcommand into one line on stderr and exit 1."""

    # ``ctx`` is typed Any: typer 0.29 vendors click (typer._click), older typer uses click itself.
    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except EngineError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None


app = typer.Typer(
    cls=_EngineErrorGroup,
    help="Model engines: list backends, inspect models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,  # locals can hold whole batches of tensors
)


@app.command()
def backends() -> None:
    """List the registered engine backends, whether each can run here, and what auto picks."""
    available = set(available_backends())
    names = registered_backends()
    width = max((len(n) for n in names), default=0)
    for name in names:
        state = "available" if name in available else "unavailable"
        typer.echo(f"{name:<{width}}  {state:<11}  {get_backend(name).description}".rstrip())
    try:
        typer.echo(f"auto -> {resolve_backend('auto')}")
    except EngineError:
        typer.echo("auto -> none (no backend can run here)")


@app.command()
def inspect(
    model: Annotated[Path, typer.Argument(help="An .onnx model (plans come with TensorRT).")],
) -> None:
    """Show a model's IO tensors ("batch" marks the batch dimension), max batch, sha256, opset."""
    if model.suffix.lower() != ".onnx":
        typer.echo(
            f"error: {str(model)!r} is not an .onnx file; plan inspection comes with the "
            "TensorRT backend",
            err=True,
        )
        raise typer.Exit(2)
    with load_engine("onnxruntime", model) as engine:
        info = engine.info
        opsets = info.extra.get("opsets") or {}
        typer.echo(f"model:     {info.model_path}")
        typer.echo(f"sha256:    {info.model_sha256}")
        typer.echo(f"opset:     {_fmt_opsets(opsets)}")
        typer.echo(f"backend:   {info.backend} {info.version} on {info.device}")
        typer.echo(f"precision: {info.precision}")
        typer.echo(f"max batch: {info.max_batch_size}")
        for title, specs in (("inputs", engine.inputs), ("outputs", engine.outputs)):
            typer.echo(f"{title}:")
            width = max((len(s.name) for s in specs), default=0)
            for spec in specs:
                typer.echo(f"  {spec.name:<{width}}  {spec.dtype!s:<8}  {_fmt_shape(spec)}")


def _fmt_shape(spec: TensorSpec) -> str:
    """``[batch, 1, 8, 8]``: ``batch`` for a dynamic first dimension, ``?`` for other ones."""
    dims = [
        ("batch" if i == 0 else "?") if d == DYNAMIC else str(d) for i, d in enumerate(spec.shape)
    ]
    return "[" + ", ".join(dims) + "]"


def _fmt_opsets(opsets: dict[str, int]) -> str:
    if not opsets:
        return "unknown"
    return ", ".join(f"{domain or 'ai.onnx'} {version}" for domain, version in opsets.items())


def main() -> None:
    """Entry point of the ``engines`` console script."""
    app()


if __name__ == "__main__":
    main()

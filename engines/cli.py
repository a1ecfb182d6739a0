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

from engines.base import TensorSpec, format_shape
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
    model: Annotated[Path, typer.Argument(help="An .onnx model or a TensorRT .plan.")],
) -> None:
    """Show a model's IO tensors ("batch" marks the batch dimension), max batch, sha256, opset.

    For a TensorRT plan: IO tensors, optimization profiles, precision and the build sidecar.
    """
    if model.suffix.lower() in (".plan", ".engine", ".trt"):
        from engines.tensorrt import is_available
        from engines.tensorrt.inspect import describe_plan, format_plan

        if not model.is_file():
            typer.echo(f"error: no TensorRT plan at {str(model)!r}", err=True)
            raise typer.Exit(2)
        if not is_available():
            typer.echo(
                f"error: inspecting {str(model)!r} needs TensorRT 10+ and a CUDA GPU, which are "
                "not available here; its build sidecar is " + str(model) + ".json",
                err=True,
            )
            raise typer.Exit(2)
        desc = describe_plan(model)
        typer.echo(format_plan(desc))
        if "load_error" in desc:
            raise typer.Exit(1)
        return
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
    return format_shape(spec.shape)


def _fmt_opsets(opsets: dict[str, int]) -> str:
    if not opsets:
        return "unknown"
    return ", ".join(f"{domain or 'ai.onnx'} {version}" for domain, version in opsets.items())


@app.command()
def build(
    model: Annotated[Path, typer.Argument(help="The ONNX model to build from.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Plan file to write.")],
    fp16: Annotated[bool, typer.Option("--fp16", help="Allow FP16 kernels.")] = False,
    int8: Annotated[
        bool, typer.Option("--int8", help="Allow INT8 kernels (needs --calib or --calib-cache).")
    ] = False,
    shapes: Annotated[
        list[str] | None,
        typer.Option(
            "--shapes",
            help="Optimization profile shapes NAME:MIN,OPT,MAX (e.g. input:1x3x224x224,"
            "32x3x224x224,64x3x224x224, or batch sizes input:1,32,64). Repeat a name for "
            "another profile.",
        ),
    ] = None,
    max_batch: Annotated[
        int, typer.Option(help="Max batch of the default profile (when --shapes is absent).")
    ] = 64,
    calib: Annotated[
        Path | None, typer.Option(help="INT8 calibration samples: .npz or a directory of .npy.")
    ] = None,
    calib_cache: Annotated[
        Path | None, typer.Option(help="INT8 calibration cache: reused if present, else written.")
    ] = None,
    calib_batch: Annotated[int, typer.Option(help="Samples per calibration batch.")] = 8,
    timing_cache: Annotated[
        Path | None, typer.Option(help="Timing cache file: reused if present, updated after.")
    ] = None,
    workspace_mib: Annotated[
        int | None, typer.Option(help="Builder workspace limit in MiB.")
    ] = None,
    device: Annotated[int, typer.Option(help="CUDA device to build for.")] = 0,
) -> None:
    """Build a TensorRT plan (and its .plan.json sidecar) from an ONNX model."""
    from engines.tensorrt import is_available
    from engines.tensorrt.builder import ProgressPrinter, build_plan, parse_shapes

    if not is_available():
        from engines.exceptions import BackendUnavailableError

        raise BackendUnavailableError(
            "TensorRT 10+ and a CUDA GPU are needed to build plans (the stand-in runs with "
            "ENGINES_TENSORRT_STANDIN=1 ENGINES_CUDA_STANDIN=1)"
        )
    meta = build_plan(
        model,
        output,
        fp16=fp16,
        int8=int8,
        profiles=parse_shapes(shapes or []) or None,
        max_batch=max_batch,
        calibration_data=calib,
        calibration_cache=calib_cache,
        calibration_batch_size=calib_batch,
        timing_cache=timing_cache,
        workspace_mib=workspace_mib,
        progress=ProgressPrinter(),
        device=device,
    )
    typer.echo(
        f"wrote {output} ({meta.precision}, TensorRT {meta.tensorrt_version}, {meta.gpu_name}, "
        f"{len(meta.profiles)} profile(s)){' [stand-in]' if meta.standin else ''}"
    )


@app.command()
def bench(
    model: Annotated[Path, typer.Argument(help="Model file (.onnx, or .plan for tensorrt).")],
    backend: Annotated[str, typer.Option(help="Backend name or auto.")] = "auto",
    batch_sizes: Annotated[
        str, typer.Option(help="Comma-separated batch sizes (the largest is the max batch).")
    ] = "1,8,32,64",
    streams: Annotated[int, typer.Option(help="CUDA streams (threads on CPU).")] = 2,
    depth: Annotated[int, typer.Option(help="Batches in flight per stream.")] = 2,
    duration_s: Annotated[float, typer.Option(help="Measured seconds per mode and batch.")] = 3.0,
    warmup_s: Annotated[float, typer.Option(help="Unmeasured seconds before each.")] = 0.5,
    precision: Annotated[
        str | None, typer.Option(help="Backend precision option, e.g. fp16 (torch).")
    ] = None,
    option: Annotated[
        list[str] | None, typer.Option("--option", help="Backend option KEY=VALUE (repeat).")
    ] = None,
    modes: Annotated[
        str, typer.Option(help="Comma-separated: raw,executor,sync,async,batched.")
    ] = "raw,executor,sync,async,batched",
    max_delay_ms: Annotated[float, typer.Option(help="Batched mode's window, ms.")] = 2.0,
    out: Annotated[Path, typer.Option(help="Directory for bench.json and the PNG plots.")] = Path(
        "bench-results"
    ),
) -> None:
    """Throughput (items/s) and latency (p50/p99 ms) per batch size: raw backend loop (the
    ceiling), executor, sync, async and batched modes; writes JSON and PNG plots."""
    from engines.bench import BenchConfig, format_results, run_bench, save

    options: dict[str, Any] = {}
    for entry in option or []:
        key, _, value = entry.partition("=")
        options[key] = {"true": True, "false": False}.get(value.lower(), value)
        if isinstance(options[key], str) and options[key].lstrip("-").isdigit():
            options[key] = int(options[key])
    if precision:
        options["precision"] = precision
    cfg = BenchConfig(
        model=model,
        backend=backend,
        batch_sizes=tuple(int(b) for b in batch_sizes.split(",") if b),
        streams=streams,
        depth=depth,
        duration_s=duration_s,
        warmup_s=warmup_s,
        max_delay_ms=max_delay_ms,
        options=options,
        modes=tuple(m.strip() for m in modes.split(",") if m.strip()),
    )
    results = run_bench(cfg, log=lambda msg: typer.echo(msg, err=True))
    typer.echo(format_results(results))
    for path in save(results, out):
        typer.echo(f"wrote {path}")


def main() -> None:
    """Entry point of the ``engines`` console script."""
    app()


if __name__ == "__main__":
    main()

"""``streamapp models check``: is a model folder servable, and which requests will it accept?

A folder is checked the way a worker would use it: ``metadata.json`` is read field by field (one
problem per missing or bad field, not just the first), the model file is loaded with the chosen
backend, the metadata's IO tensors are compared with the engine's (name, dtype, shape, a dynamic
batch dimension, one score per label), and one batch of zeros — and, for image models, one
blank image through the image pre-processing — runs through the engine. Then the checks a
version passes before it serves, at worker start and before ``streamapp models load`` switches
to it (:func:`streamapp.models.verify.verify_model`): a warm-up batch and the samples its
metadata declares. The walk-through that uses it is docs/models.md; versions: docs/versions.md.

A model with several versions must keep one request contract
(:func:`~streamapp.models.verify.contract_differences`): a version whose contract differs from
the default version's (``NAME/current``, else the highest) has a problem naming each difference,
so the check fails (exit 1): a worker that falls back to it at start, or a hot swap to it, would
serve clients another contract than the rest of the group. A new contract is a new model name.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from engines.base import DYNAMIC, Engine, TensorSpec, format_shape
from engines.exceptions import EngineError
from engines.executor import ThreadExecutor
from engines.registry import load_engine, load_first
from streamapp.agents.pipeline import LoadedModel
from streamapp.exceptions import ModelSwapError, StreamAppError
from streamapp.models.metadata import read_metadata
from streamapp.models.repository import (
    ModelConfig,
    ModelRepository,
    normal_version,
    version_key,
)
from streamapp.models.verify import contract_problem, run_blocking, start_order, verify_model
from streamapp.records import InferenceRequest

__all__ = ["ModelCheck", "check_model", "engine_problems", "format_check", "format_versions"]

@dataclass
class ModelCheck:
    """What :func:`check_model` found.

    Attributes:
        directory: The model folder.
        problems: One line per problem (empty: the folder is servable).
        config: The parsed metadata, or None when it could not be read.
        engine_tag: ``backend-version:sha256[:8]`` of the loaded engine (the results' ``engine``),
            or None when it did not load.
        engine_line: Device, precision and max batch of the loaded engine.
        inputs / outputs: The engine's IO tensors.
        samples_checked: How many declared samples the engine answered as declared (0: none
            declared), or None when the checks did not get that far.
        contract_problems: The problem (in ``problems`` too) of a version whose request
            contract differs from the model's default version's; a worker may still start on
            it (a fallback), unlike on a version with other problems.
    """

    directory: Path
    problems: list[str] = field(default_factory=list)
    config: ModelConfig | None = None
    engine_tag: str | None = None
    engine_line: str = ""
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    samples_checked: int | None = None
    contract_problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def servable(self) -> bool:
        """Whether a worker can start on this version (it may have another contract)."""
        return all(p in self.contract_problems for p in self.problems)

    @property
    def versioned(self) -> bool:
        """Whether the folder is a version folder (``NAME/<V>/``, docs/versions.md)."""
        return self.directory.name.isdigit()

    @property
    def model(self) -> str:
        """The model's name: its folder's (a version folder's parent)."""
        return self.directory.parent.name if self.versioned else self.directory.name

    @property
    def version(self) -> str | None:
        """The version: a version folder's name, else what the metadata says (None when it
        could not be read)."""
        if self.versioned:
            return normal_version(self.directory.name)
        return self.config.version if self.config is not None else None


def _spec(spec: TensorSpec) -> str:
    return f"{spec.name} {spec.dtype}{format_shape(spec.shape)}"


def engine_problems(config: ModelConfig, engine: Engine) -> list[str]:
    """Where a model's metadata and its loaded engine disagree, one line each.

    Args:
        config: The model's metadata.
        engine: The model's file loaded by a backend.

    Returns:
        Problems (empty: a worker can feed the engine what the metadata promises): the input's
        name, dtype, rank and static dimensions, a dynamic batch dimension, a request shape with
        as many values as an engine item, and an output with one score per label.
    """
    problems = []
    specs = {s.name: s for s in engine.inputs}
    names = ", ".join(_spec(s) for s in engine.inputs)
    if len(engine.inputs) != 1:
        problems.append(f"the model has {len(engine.inputs)} inputs ({names}); streamapp feeds "
                        "exactly one")
    spec = specs.get(config.input_name)
    if spec is None:
        problems.append(f"input.name {config.input_name!r} is not an input of the model; its "
                        f"inputs: {names}")
    else:
        if spec.dtype != config.input_dtype:
            problems.append(f"input.dtype {config.input_dtype} differs from the model's input "
                            f"{_spec(spec)}")
        pairs = zip(config.input_shape, spec.shape, strict=False)
        if len(spec.shape) != len(config.input_shape) or any(
                want not in (DYNAMIC, got) for got, want in pairs):
            problems.append(f"input.shape {list(config.input_shape)} does not fit the model's "
                            f"input {_spec(spec)}")
        elif spec.shape[0] != DYNAMIC:
            problems.append(f"the model's input {_spec(spec)} has a fixed batch dimension; "
                            "export it with a dynamic one (torch.onnx.export dynamic_axes, "
                            "or a None first dimension)")
    item = config.item_shape
    if any(d < 0 for d in item):
        problems.append(f"input.shape {list(config.input_shape)}: only the batch dimension "
                        "may be -1")
    elif math.prod(item) != math.prod(config.request_shape):
        problems.append(f"request.shape {list(config.request_shape)} holds "
                        f"{math.prod(config.request_shape)} values, an input item "
                        f"{list(item)} holds {math.prod(item)}")
    outputs = {s.name: s for s in engine.outputs}
    out = outputs.get(config.output_name)
    if out is None:
        problems.append(f"output.name {config.output_name!r} is not an output of the model; its "
                        f"outputs: {', '.join(_spec(s) for s in engine.outputs)}")
    elif len(out.shape) != 2 or out.shape[1] not in (DYNAMIC, len(config.labels)):
        problems.append(f"output {_spec(out)} must be [batch, {len(config.labels)}]: one "
                        f"score per label ({len(config.labels)} labels)")
    return problems


def _run_once(config: ModelConfig, engine: Engine) -> list[str]:
    """Run one batch of two zero items, and a blank image where the model takes images."""
    items = [np.zeros(config.item_shape, dtype=config.input_dtype)] * 2
    if config.image is not None:
        kind = config.image.formats[0]
        buffer = io.BytesIO()
        try:
            Image.new(config.image.mode, config.image.size).save(buffer, format=kind)
        except (KeyError, ValueError, OSError) as exc:
            return [f"a blank {kind} image cannot be made to try the image pre-processing "
                    f"({type(exc).__name__}: {exc}); image.formats names Pillow formats, "
                    "e.g. [\"PNG\", \"JPEG\"]"]
        request = InferenceRequest("check", "check", 0, 0.0, config.name,
                                   image=buffer.getvalue())
        try:
            items[1] = config.preprocess(request)
        except StreamAppError as exc:
            return [f"a blank {kind} image cannot be pre-processed: {exc}"]
    try:
        outputs = engine.infer({config.input_name: np.stack(items)})
    except EngineError as exc:
        return [f"a batch of 2 zero inputs failed in the engine: {exc}"]
    scores = np.asarray(outputs[config.output_name])
    if scores.shape != (2, len(config.labels)):
        return [f"output {config.output_name!r} of a batch of 2 has shape {list(scores.shape)}, "
                f"not [2, {len(config.labels)}] (one score per label)"]
    return []


def check_model(directory: Path, *, backend: str = "auto", max_batch_size: int = 32) -> ModelCheck:
    """Check one model folder as a worker would load it.

    Args:
        directory: A folder with ``metadata.json`` and the model file it names.
        backend: Engine backend (a registry name or ``auto``, as the worker's setting).
        max_batch_size: The worker's ``max_batch_size`` (the engine is loaded for it).

    Returns:
        The findings; ``problems`` is empty when a worker can serve the model. Never raises for
        a bad folder, file or backend: each is a problem line. A version of a model with
        several versions whose request contract differs from the default version's
        (``NAME/current``, else the highest) has one problem line naming both versions and
        each difference, e.g. ``version 2 accepts other requests than version 1 (current):
        request.shape [16, 16] ≠ [8, 8]`` (also in ``contract_problems``).
    """
    result = ModelCheck(directory)
    meta_path = directory / "metadata.json"
    if not meta_path.is_file():
        if not directory.is_dir():
            result.problems.append(
                "no such folder; a model repository holds one folder per model, named as in "
                "STREAMAPP_MODELS (docs/models.md; TensorRT plans: docs/deployment.md)")
        else:
            inside = sorted(p.parent.name for p in directory.glob("*/metadata.json"))
            hint = f"; it holds the models {', '.join(inside)}: check a folder of those" \
                if inside else ""
            result.problems.append(f"no metadata.json in the folder{hint} (docs/models.md)")
        return result
    # the worker's own validation (ModelConfig.from_dir), so both word a problem the same
    _, result.problems = read_metadata(meta_path)
    if result.problems:
        return result
    try:
        config = ModelConfig.from_dir(directory)
    except StreamAppError as exc:
        result.problems.append(str(exc))
        return result
    # a version folder (NAME/<V>/, docs/versions.md) is named by its model's folder, and its
    # name wins over a version in its metadata (as the worker reads it)
    folder = directory.parent if result.versioned else directory
    if result.versioned:
        config = dataclasses.replace(config, version=normal_version(directory.name))
    result.config = config
    if config.name != folder.name:
        result.problems.append(
            f"name {config.name!r} differs from the folder's name {folder.name!r}: a worker "
            "finds a model by its folder; rename one of them")
    contract = _contract_problems(result, config)
    _check_engine(result, config, backend, max_batch_size)
    result.problems += contract
    result.contract_problems = contract
    return result


def _contract_problems(check: ModelCheck, config: ModelConfig) -> list[str]:
    """A problem when ``config``'s request contract differs from the default version's of its
    model (none for the default version itself, a model of one version, or when the default
    version's metadata cannot be read: its own check says why)."""
    root = check.directory.parent.parent if check.versioned else check.directory.parent
    repository = ModelRepository(root)
    try:
        reference = repository.default_version(check.model, warn=False)
        if reference == config.version or len(repository.versions(check.model)) < 2:
            return []
        other = repository.get(check.model, reference)
        written = repository.current_marker(check.model)
        current = bool(written) and normal_version(written or "") == reference  # "01" is 1
    except (StreamAppError, OSError):
        return []
    problem = contract_problem(config, other, " (current)" if current else " (the highest)")
    if problem is None:
        return []
    return [f"version {config.version} {problem} (a fallback or hot swap between them would "
            "break clients: give a new contract a new model name, docs/versions.md)"]


def _check_engine(result: ModelCheck, config: ModelConfig, backend: str,
                  max_batch_size: int) -> None:
    """Load the model file, compare it with the metadata, run it once and run the start
    checks; each problem goes to ``result.problems``."""
    if not config.path.is_file():
        result.problems.append(f"no model file {config.path.name!r} in the folder (metadata "
                               "'file', default model.onnx)")
        return

    def load(name: str) -> Engine:
        return load_engine(name, config.path, max_batch_size=max_batch_size,
                           **config.engine_options(name))

    try:
        engine = load_first(backend, load)
    except (EngineError, StreamAppError) as exc:
        result.problems.append(f"{config.path.name} does not load with backend {backend!r}: {exc}")
        return
    with engine:
        info = engine.info
        result.engine_tag = info.tag
        result.engine_line = f"{info.device}, {info.precision}, max batch {info.max_batch_size}"
        result.inputs, result.outputs = engine.inputs, engine.outputs
        result.problems += engine_problems(config, engine)
        if not result.problems:
            result.problems += _run_once(config, engine)
        if not result.problems:
            try:
                result.samples_checked = run_blocking(lambda: _verify(config, engine))
            except ModelSwapError as exc:
                result.problems.append(f"{exc.reason}: {exc}")


async def _verify(config: ModelConfig, engine: Engine) -> int:
    """:func:`~streamapp.models.verify.verify_model` (a warm-up batch, then the declared
    samples: the checks of worker start and ``streamapp models load``) on ``engine``."""
    executor = ThreadExecutor(engine, max_inflight=1)
    try:
        return await verify_model(LoadedModel(config, executor))
    finally:
        await executor.close()


def format_check(check: ModelCheck, *, top_k: int = 3) -> list[str]:
    """The report of a check that passed: what a worker serves and which requests it takes.

    Args:
        check: A result of :func:`check_model` without problems.
        top_k: The worker's ``top_k`` setting (labels per result).

    Returns:
        Lines without newlines, at most about 100 columns.
    """
    config = check.config
    assert config is not None
    lines = [
        f"model     {config.name} v{config.version} ({config.path})",
        f"engine    {check.engine_tag} on {check.engine_line}",
        *(f"input     {_spec(s)}" for s in check.inputs),
        *(f"output    {_spec(s)}{'  <- scores' if s.name == config.output_name else ''}"
          for s in check.outputs),
        f"tensor    {' or '.join(sorted(config.request_dtypes))} {list(config.request_shape)}"
        + (f", values {config.value_range[0]:g} to {config.value_range[1]:g}"
           if config.value_range else "")
        + ("" if config.allow_non_finite else ", finite")
        + f" -> {config.input_name} {config.input_dtype}{list(config.item_shape)}"
        + ("" if (config.scale, config.offset) == (1.0, 0.0)
           else f" = x * {config.scale:g} + {config.offset:g}"),
    ]
    image = config.image
    if image is None:
        lines.append("image     no (tensor requests only; an \"image\" object adds them)")
    else:
        width, height = image.size
        lines.append(f"image     {' or '.join(image.formats)} -> {image.mode} {width}x{height} "
                     f"({image.resample}), pixel * {image.scale:g} + {image.offset:g}, "
                     f"up to {image.max_pixels} pixels")
    if config.queue_policy_text is not None:
        lines.append(f"queue     policy: {config.queue_policy_text} (docs/delivery.md)")
    labels = " ".join(config.labels) if len(config.labels) <= 12 else (
        " ".join(config.labels[:10]) + " ...")
    lines.append(f"labels    {len(config.labels)}: {labels}")
    if check.samples_checked:
        lines.append(f"samples   {check.samples_checked} answered as declared (a worker "
                     "checks them before it serves this version)")
    else:
        lines.append("samples   none declared: served unchecked (metadata \"samples\", "
                     "docs/versions.md)")
    lines.append(f"result    outputs.top_k: the {min(top_k, len(config.labels))} best labels "
                 "with scores (STREAMAPP_TOP_K)")
    return lines


def format_versions(checks: Sequence[ModelCheck]) -> list[str]:
    """Per model of which several versions were checked: each version's outcome, in the order
    a worker tries them at start (:func:`~streamapp.models.verify.start_order`), and the
    version it starts on, the first that passed (docs/versions.md) — or whose only problem is
    another request contract than the default version's (``DIFFERS``): a worker does start on
    it, with an ERROR line, and the summary says so.

    Returns:
        Lines without newlines; none for a model checked at one version only.
    """
    groups: dict[tuple[Path, str], list[ModelCheck]] = {}
    for check in checks:
        root = check.directory.parent.parent if check.versioned else check.directory.parent
        groups.setdefault((root, check.model), []).append(check)
    lines: list[str] = []
    for (root, name), group in groups.items():
        if len(group) < 2:
            continue
        found = {c.version: c for c in group if c.version is not None}
        try:
            order = start_order(ModelRepository(root), name)
        except StreamAppError:
            order = []
        shown = [v for v in order if v in found] + sorted(
            (v for v in found if v not in order), key=version_key, reverse=True)
        lines.append(f"versions  {name}, in the order a worker tries them at start:")
        for version in shown:
            check = found[version]
            if check.ok:
                outcome = (f"ok, {check.samples_checked} sample(s) answered as declared"
                           if check.samples_checked else "ok, no samples declared")
            elif check.servable:  # it passes its checks, with another contract
                outcome = f"DIFFERS: {check.problems[0]}"
            else:
                outcome = f"FAILED: {check.problems[0]}"
            lines.append(f"  {'v' + version:<6} {outcome}")
        for check in group:
            if check.version is None:
                lines.append(f"  {check.directory.name:<6} FAILED: {check.problems[0]}")
        starts: str | None = None
        for version in order:
            if version not in found:
                break  # not checked: cannot tell
            if found[version].servable:
                starts = f"a worker starts on {name} v{version}" + (
                    f", whose request contract differs from v{order[0]}'s (above)"
                    if found[version].contract_problems else "")
                break
        else:
            if order:
                starts = f"no version of {name} passes: a worker refuses to start"
        if starts is not None:
            lines.append(f"  {starts}")
    return lines

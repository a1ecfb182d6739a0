"""The checks a model version passes before it serves, in one place.

Three callers run them, so that they agree on which versions are servable:

* ``streamapp models load`` (``POST /models/{name}/load``) before a hot swap
  (:meth:`streamapp.models.swap.ModelSwapper.prepare`);
* a worker when it starts (:func:`streamapp.models.loading.load_models`): it tries the version
  to serve (``NAME/current``, else the highest) and, when that one fails, the others from the
  highest down (:func:`start_order`, :func:`start_version`);
* ``streamapp models check`` for every folder it checks
  (:func:`streamapp.models.check.check_model`).

:func:`prepare_version` loads a version (``load_failed`` when the file does not load or does not
fit its metadata), then :func:`verify_model` runs one warm-up batch (``warmup_failed``) and the
samples its metadata declares (``check_failed``: an answer differs; ``bad_metadata``: a sample
cannot be used). Each refusal is a :class:`~streamapp.exceptions.ModelSwapError` with that
reason, worded the same wherever it is raised.

Versions of one model must keep one **request contract** (:func:`contract_differences`: what a
request may be, and what an answer means), or a worker that falls back at start to another version,
or a hot swap, would serve clients another contract than the rest of the group: ``streamapp
models check`` reports a version whose contract differs from the default one's as a problem,
:func:`start_version` logs an ERROR when the version it falls back to has another contract (it
serves it all the same), and a hot swap refuses one (``incompatible_version``).

Samples (metadata ``samples``): a list of objects, each ``{"tensor": nested list in request
units (the shape of ``request.shape``), "dtype": request dtype (default the widest float of
``request.dtypes``, else the first), "label": expected top-1 label and/or "scores": expected
values of the output row, "tolerance": largest absolute difference of a score (default
:data:`DEFAULT_TOLERANCE`)}``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np

from engines.exceptions import EngineError
from streamapp.agents.pipeline import LoadedModel
from streamapp.exceptions import ConfigError, ModelSwapError, StreamAppError
from streamapp.models.repository import ModelConfig, ModelRepository
from streamapp.records import InferenceRequest, TensorPayload

__all__ = [
    "DEFAULT_TOLERANCE",
    "check_samples",
    "close_model",
    "contract_differences",
    "contract_problem",
    "prepare_version",
    "run_blocking",
    "start_order",
    "start_version",
    "verify_model",
    "warm_up",
]

log = logging.getLogger(__name__)

#: Default largest absolute difference between a sample's expected and computed scores.
DEFAULT_TOLERANCE = 1e-3

T = TypeVar("T")


def _sample_dtype(config: ModelConfig, sample: dict[str, Any]) -> str:
    dtype = sample.get("dtype")
    if dtype is not None:
        return str(dtype)
    floats = sorted(d for d in config.request_dtypes if d.startswith("float"))
    return floats[-1] if floats else sorted(config.request_dtypes)[0]


def _sample_items(config: ModelConfig) -> list[tuple[dict[str, Any], np.ndarray]]:
    """``(sample, engine input item)`` of every declared sample.

    Raises:
        ModelSwapError: ``bad_metadata``: ``samples`` is not a list of objects with a tensor
            the model accepts.
    """
    samples = config.metadata.get("samples", [])
    if not isinstance(samples, list):
        raise ModelSwapError("bad_metadata", f"metadata 'samples' of {config.name} v"
                             f"{config.version} must be a list, got {type(samples).__name__}")
    items = []
    for i, sample in enumerate(samples):
        try:
            if not isinstance(sample, dict) or "tensor" not in sample:
                raise ValueError("each sample must be an object with a 'tensor'")
            if "label" not in sample and "scores" not in sample:
                raise ValueError("each sample must give an expected 'label' or 'scores'")
            array = np.asarray(sample["tensor"], dtype=_sample_dtype(config, sample))
            payload = TensorPayload(str(array.dtype), tuple(array.shape), array.tobytes())
            request = InferenceRequest(f"sample-{i}", "sample", i, time.time(), config.name,
                                       tensor=payload)
            items.append((sample, config.preprocess(request)))
        except (StreamAppError, ValueError, TypeError) as exc:
            raise ModelSwapError(
                "bad_metadata", f"sample {i} of {config.name} v{config.version} cannot be "
                f"used: {exc}",
            ) from None
    return items


def _values(values: object) -> str:
    """A list or tuple as ``[a, b]`` (numbers as ``%g``), anything else as JSON would say it."""
    if isinstance(values, (list, tuple)):
        return "[" + ", ".join(f"{v:g}" if isinstance(v, float) else str(v)
                               for v in values) + "]"
    if values is None:
        return "none"
    if isinstance(values, bool):
        return "true" if values else "false"
    return f"{values:g}" if isinstance(values, float) else str(values)


def _image_text(config: ModelConfig) -> str:
    image = config.image
    if image is None:
        return "none (tensor requests only)"
    return f"{image.mode} {image.size[0]}x{image.size[1]}"


def _labels_difference(a: tuple[str, ...], b: tuple[str, ...]) -> str:
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    where = "" if first is None else f", first at index {first}: {a[first]!r} ≠ {b[first]!r}"
    if len(a) != len(b):
        return f"labels {len(a)} ≠ {len(b)} labels{where}"
    differ = sum(x != y for x, y in zip(a, b, strict=True))
    return f"labels: {differ} of {len(a)} differ{where}"


#: The fields of an ``image`` declaration that a client depends on: which images are taken
#: (``formats``, ``max_pixels``) and what an image means in request units (the rest).
#: ``resample`` and ``background`` refine how pixels are read; a new version may change them.
_IMAGE_CONTRACT = ("mode", "size", "scale", "offset", "mean", "std", "layout", "channel_order",
                   "formats", "max_pixels")


def contract_differences(a: ModelConfig, b: ModelConfig) -> list[str]:
    """How version ``a``'s request contract differs from version ``b``'s, one short line per
    field, ``a``'s value first: ``request.shape [16, 16] ≠ [8, 8]``.

    The contract is what a client depends on: which requests are taken (``request.shape``,
    ``request.dtypes``, ``request.value_range``, ``request.allow_non_finite``, whether images
    are, and the ``image`` fields that say which images and what they mean in request units:
    ``mode``, ``size``, ``scale``, ``offset``, ``mean``, ``std``, ``layout``,
    ``channel_order``, ``formats``, ``max_pixels``) and what an answer means (``labels``,
    ``output.kind``). The engine side (input name, dtype and item shape, ``preprocessing``) is
    not: it may change with a new network.

    Returns:
        The differences; empty when both versions have the same contract.
    """
    lines = []
    for field, old, new in (
        ("request.shape", list(b.request_shape), list(a.request_shape)),
        ("request.dtypes", sorted(b.request_dtypes), sorted(a.request_dtypes)),
        ("request.value_range", b.value_range, a.value_range),
        ("request.allow_non_finite", b.allow_non_finite, a.allow_non_finite),
    ):
        if old != new:
            lines.append(f"{field} {_values(new)} ≠ {_values(old)}")
    if (a.image is None) != (b.image is None):
        lines.append(f"image {_image_text(a)} ≠ {_image_text(b)}")
    elif a.image is not None and b.image is not None:
        for name in _IMAGE_CONTRACT:
            old, new = getattr(b.image, name), getattr(a.image, name)
            if old != new:
                lines.append(f"image.{name} {_values(new)} ≠ {_values(old)}")
    if a.labels != b.labels:
        lines.append(_labels_difference(a.labels, b.labels))
    kinds = [c.metadata.get("output", {}).get("kind") for c in (a, b)]
    if kinds[0] != kinds[1]:
        lines.append(f"output.kind {_values(kinds[0])} ≠ {_values(kinds[1])}")
    return lines


def contract_problem(a: ModelConfig, b: ModelConfig, role: str = "") -> str | None:
    """:func:`contract_differences` in one phrase, or None for the same contract, e.g.
    ``accepts other requests than version 1 (current): request.shape [16, 16] ≠ [8, 8]``
    (``role`` is ``" (current)"`` there); ``answers in other terms than`` when only the labels
    or ``output.kind`` differ."""
    differences = contract_differences(a, b)
    if not differences:
        return None
    requests = any(not d.startswith(("labels", "output.")) for d in differences)
    answers = any(d.startswith(("labels", "output.")) for d in differences)
    what = " and ".join(w for w, on in (("accepts other requests", requests),
                                        ("answers in other terms", answers)) if on)
    return f"{what} than version {b.version}{role}: {'; '.join(differences)}"


async def check_samples(model: LoadedModel) -> int:
    """Run the samples ``model``'s metadata declares and compare the answers.

    Returns:
        The number of samples checked (0 when the metadata declares none).

    Raises:
        ModelSwapError: ``bad_metadata`` (a sample that cannot be used), ``check_failed`` (an
            answer differs; the message names the sample, what was expected and what came).
    """
    config = model.config
    items = _sample_items(config)
    if not items:
        return 0
    batch = [{config.input_name: item} for _, item in items]
    outputs: dict[str, np.ndarray] = {}
    limit = max(1, model.executor.engine.max_batch_size)
    for start in range(0, len(batch), limit):
        part = await model.executor.run(batch[start:start + limit])
        for name, value in part.items():
            outputs[name] = (np.concatenate([outputs[name], value]) if name in outputs
                             else np.asarray(value))
    probs = np.asarray(outputs[config.output_name], dtype=np.float64)
    for i, (sample, _) in enumerate(items):
        row = probs[i]
        if "label" in sample:
            got = config.labels[int(np.argmax(row))]
            if got != str(sample["label"]):
                raise ModelSwapError(
                    "check_failed", f"sample {i} of {config.name} v{config.version}: expected "
                    f"label {sample['label']!r}, the engine answered {got!r} (score "
                    f"{float(row.max()):.4f})",
                )
        if "scores" in sample:
            expected = np.asarray(sample["scores"], dtype=np.float64)
            tolerance = float(sample.get("tolerance", DEFAULT_TOLERANCE))
            if expected.shape != row.shape:
                raise ModelSwapError(
                    "bad_metadata", f"sample {i} of {config.name} v{config.version} gives "
                    f"{expected.size} scores; the output has {row.size}",
                )
            worst = int(np.argmax(np.abs(row - expected)))
            if abs(row[worst] - expected[worst]) > tolerance:
                raise ModelSwapError(
                    "check_failed", f"sample {i} of {config.name} v{config.version}: score "
                    f"{worst} is {row[worst]:.6f}, expected {expected[worst]:.6f} within "
                    f"{tolerance:g}",
                )
    return len(items)


async def warm_up(model: LoadedModel) -> None:
    """One batch of zeros through ``model``'s executor (what ``/ready`` waits for at start).

    Raises:
        EngineError: The engine failed it.
        RuntimeError: The model's output is missing from the answer.
    """
    config = model.config
    item = {config.input_name: np.zeros(config.item_shape, dtype=config.input_dtype)}
    outputs = await model.executor.run([item])
    if config.output_name not in outputs:
        raise RuntimeError(f"warm-up of {config.name!r} v{config.version} returned no "
                           f"{config.output_name!r} output")


async def close_model(model: LoadedModel) -> None:
    """Close a version's executor and engine (its device memory is returned)."""
    await model.executor.close()
    await asyncio.to_thread(model.executor.engine.close)


async def verify_model(model: LoadedModel) -> int:
    """Run a loaded version's warm-up batch, then the samples its metadata declares.

    Returns:
        The number of samples checked (0: none declared).

    Raises:
        ModelSwapError: ``warmup_failed``, ``check_failed`` or ``bad_metadata``; the message
            names the version (and the sample, what was expected and what came).
    """
    config = model.config
    try:
        await warm_up(model)
    except Exception as exc:
        raise ModelSwapError(
            "warmup_failed", f"version {config.version} of {config.name} failed its "
            f"warm-up batch: {type(exc).__name__}: {exc}") from None
    try:
        checked = await check_samples(model)
    except ModelSwapError:
        raise
    except Exception as exc:
        raise ModelSwapError(
            "check_failed", f"version {config.version} of {config.name} failed on its "
            f"samples: {type(exc).__name__}: {exc}") from None
    return checked


async def prepare_version(
    config: ModelConfig,
    loader: Callable[[ModelConfig], LoadedModel],
    adapt: Callable[[LoadedModel], None] | None = None,
) -> tuple[LoadedModel, int]:
    """Load a version (off the event loop) and check it: :func:`verify_model`.

    Args:
        config: The version, from :meth:`ModelRepository.get`.
        loader: Loads it on an engine and executor
            (:func:`streamapp.models.loading.load_version`).
        adapt: Called with the loaded version before its checks (a hot swap configures the
            engine's image decoding there); may raise :class:`ModelSwapError`.

    Returns:
        The loaded version and the number of samples it answered as declared.

    Raises:
        ModelSwapError: ``load_failed`` (its ``__cause__`` is the loader's error), or as
            ``adapt`` and :func:`verify_model`. A version that fails after it loaded is closed.
    """
    try:
        model = await asyncio.to_thread(loader, config)
    except Exception as exc:
        raise ModelSwapError("load_failed", f"version {config.version} of {config.name} "
                             f"failed to load: {type(exc).__name__}: {exc}") from exc
    try:
        if adapt is not None:
            adapt(model)
        checked = await verify_model(model)
    except BaseException:
        await close_model(model)
        raise
    if not checked:
        log.warning("version %s of %s declares no samples: it was warmed up but not "
                    "checked", config.version, config.name)
    return model, checked


def start_order(repository: ModelRepository, name: str) -> list[str]:
    """The versions of model ``name`` in the order a worker tries them at start: the default
    one (``NAME/current``, else the highest), then the others from the highest down.

    Raises:
        ModelNotFoundError / ConfigError: As :meth:`ModelRepository.versions`.
    """
    versions = list(repository.versions(name))
    first = repository.default_version(name)
    return [first, *(v for v in reversed(versions) if v != first)]


async def start_version(
    repository: ModelRepository,
    name: str,
    loader: Callable[[ModelConfig], LoadedModel],
    *,
    fallback: bool = True,
) -> LoadedModel:
    """The version of ``name`` a worker serves at start: the first of :func:`start_order` that
    loads and passes :func:`verify_model` (the checks of ``streamapp models load``).

    A version that fails is logged (an error naming the version and its reason: the failing
    sample, what was expected and what came) and skipped. When the version it falls back to
    has another request contract than the first of the order (:func:`contract_differences`),
    an ERROR line names each difference: it serves that version all the same (refusing to
    start would answer no request at all), but workers of the group that serve the first one
    accept other requests or answer in other terms.

    Args:
        repository: The worker's model repository.
        name: A model of ``STREAMAPP_MODELS``.
        loader: As :func:`prepare_version`.
        fallback: Try the other versions when the first fails (False: the executor server,
            whose workers pick the version from the repository on their own).

    Raises:
        ModelNotFoundError: No such model.
        ConfigError: No version passes (the message names each version and why).
        EngineError: One version to try (one version, or ``fallback`` off), and its file does
            not load: the loader's own error (a :class:`ConfigError` when its engine does not
            fit its metadata), as before versions were checked at start.
    """
    order = start_order(repository, name)
    if not fallback:
        order = order[:1]
    refused: list[tuple[str, ModelSwapError]] = []
    preferred: ModelConfig | None = None  # the first version's, when its metadata is valid
    for version in order:
        try:
            try:
                config = await asyncio.to_thread(repository.get, name, version)
            except ConfigError as exc:
                raise ModelSwapError("bad_metadata", str(exc)) from exc
            if version == order[0]:
                preferred = config
            model, checked = await prepare_version(config, loader)
        except ModelSwapError as exc:
            refused.append((version, exc))
            if len(order) > 1:
                log.error("model %s: not serving version %s, it fails its checks (%s): %s",
                          name, version, exc.reason, exc)
            continue
        if refused:
            failed = [v for v, _ in refused]
            which = (f"version {failed[0]} failed its checks" if len(failed) == 1 else
                     f"versions {', '.join(failed[:-1])} and {failed[-1]} failed their checks")
            log.warning("model %s: serving version %s (%s, above; `streamapp models check` "
                        "lists every problem)", name, version, which)
            differs = None if preferred is None else contract_problem(
                config, preferred, " (the version to serve)")
            if preferred is not None and differs is not None:
                log.error("model %s: serving version %s, which %s; a request that version %s "
                          "takes may fail here or mean something else: fix version %s, or give "
                          "a new request contract a new model name (docs/versions.md)", name,
                          version, differs, preferred.version, preferred.version)
        log.info("model %s v%s: %d sample(s) answered as declared", name, version, checked)
        return model
    hint = (f" (streamapp models check {repository.root / name} lists every problem; "
            "docs/versions.md)")
    if len(refused) == 1:
        version, error = refused[0]
        cause = error.__cause__
        if isinstance(cause, (StreamAppError, EngineError)):
            raise cause  # the loader's own error, as before versions were checked at start
        raise ConfigError(f"model {name!r} cannot be served: version {version} fails its "
                          f"checks ({error.reason}): {error}{hint}")
    raise ConfigError(
        f"model {name!r} cannot be served: no version passes its checks; "
        + "; ".join(f"version {v} ({e.reason}): {e}" for v, e in refused) + hint)


def run_blocking(work: Callable[[], Awaitable[T]]) -> T:
    """Run the coroutine ``work()`` makes to its end on an event loop of its own, in a thread
    of its own (so that it neither disturbs the caller's event loop, if any, nor the main
    thread's current loop), and return its result or raise its exception."""

    async def main() -> T:
        return await work()

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model-checks") as pool:
        return pool.submit(lambda: asyncio.run(main())).result()

"""Hot swap of model versions on a running worker (``streamapp models load``).

A swap has two phases, so that a group of workers either all switch or none does:

1. **prepare**: read the version from the repository, check that it takes the same requests as
   the current one and means the same by its answers (its request contract,
   :func:`~streamapp.models.verify.contract_differences`: request shape and dtypes, value range,
   non-finite values, image declaration, labels, output kind; and, as requests are
   pre-processed when read, the same engine input: input name, dtype and item shape,
   pre-processing), load its engine off the event loop,
   run a warm-up batch, then run the samples its metadata declares (``samples``: expected labels
   or scores within a tolerance). Any failure refuses the version with a reason
   (:class:`~streamapp.exceptions.ModelSwapError`) and the current version keeps serving.
2. **commit**: :meth:`InferencePipeline.swap <streamapp.agents.pipeline.InferencePipeline.swap>`
   makes it current between two batches — a batch resolves its version once, when it starts, so
   batches in flight finish on the old version and no request fails, is lost or answered twice
   because of the swap. The old version is closed (its device memory returned) once its last
   batch has finished; ``keep`` leaves it loaded for requests that pin it. The version is
   recorded in the model's ``current`` file so that a restarted worker serves it too.

A prepared version that is neither committed nor aborted within :data:`PREPARED_TTL_S` is
discarded. One swap runs at a time per worker. With ``gpu_executor=shared`` the engines live in
the executor server, which cannot swap yet: the load is refused (``not_supported``).

The checks of the prepare phase (load, warm-up batch, declared samples) are
:mod:`streamapp.models.verify`'s, the ones a worker runs at start and ``streamapp models check``
runs too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from engines.exceptions import EngineError
from streamapp.agents.pipeline import InferencePipeline, LoadedModel
from streamapp.exceptions import ConfigError, ModelNotFoundError, ModelSwapError, StreamAppError
from streamapp.models.decoding import configure_engine_images
from streamapp.models.repository import ModelConfig, ModelRepository, normal_version
from streamapp.models.verify import (
    DEFAULT_TOLERANCE,
    check_samples,
    close_model,
    contract_problem,
    prepare_version,
    warm_up,
)
from streamapp.settings import Settings

__all__ = [
    "DEFAULT_TOLERANCE",
    "PREPARED_TTL_S",
    "ModelSwapper",
    "check_samples",
    "close_model",
    "contract_difference",
    "warm_up",
]

log = logging.getLogger(__name__)

#: Seconds a prepared (loaded and checked) version waits for its commit before it is discarded.
PREPARED_TTL_S = 120.0
#: Seconds between two looks at whether a swapped-out version's last batch has finished.
_IDLE_POLL_S = 0.005

#: What a swap needs the same beyond the request contract (verify.contract_differences, which
#: compares the rest): the engine input and the pre-processing a request gets when it is read
#: (``image`` whole: its resample and background too), and the dtypes in their order.
_CONTRACT_FIELDS = ("input_name", "input_dtype", "item_shape", "request_dtypes", "scale",
                    "offset", "image")


def contract_difference(current: ModelConfig, candidate: ModelConfig) -> str | None:
    """What keeps ``candidate`` from answering the requests ``current`` accepts, or None.

    First its request contract
    (:func:`~streamapp.models.verify.contract_differences`: what a request may be, the labels
    and output kind), each difference named. Then, since requests are pre-processed when they
    are read, before their batch picks its version, a version must take the same engine input
    from the same request. A new contract is a new model name."""
    problem = contract_problem(candidate, current, " (serving)")
    if problem is not None:
        return (f"it {problem}; clients' requests would fail or mean something else (deploy "
                "a new request contract as a new model name, docs/versions.md)")
    for name in _CONTRACT_FIELDS:
        old, new = getattr(current, name), getattr(candidate, name)
        if old != new:
            return (f"its {name} is {new!r} where version {current.version} has {old!r}; a "
                    "version must accept the same requests (deploy a different contract as a "
                    "new model name)")
    return None


def _device_free_bytes(model: LoadedModel) -> int | None:
    """Free memory of the CUDA device ``model`` runs on, or None on a CPU engine."""
    if not str(model.info.device).startswith("cuda"):
        return None
    try:
        from engines.cuda import mem_get_info

        return mem_get_info()[0]
    except EngineError:
        return None


def _unknown_model(name: str, served: Iterable[str]) -> ModelSwapError:
    return ModelSwapError(
        "unknown_model", f"model {name!r} is not served by this worker (serving: "
        f"{', '.join(sorted(served)) or 'none'}; STREAMAPP_MODELS)", status=404)


@dataclass
class _Prepared:
    model: LoadedModel
    checked: int
    expires: float


class ModelSwapper:
    """Prepares, commits and aborts model versions on one worker.

    Args:
        settings: ``models_dir``, ``backend``, ``gpu_executor`` and the executor sizes.
        pipeline: Returns the running pipeline, or None before the worker started one.
        loader: Loads one version (default :func:`streamapp.models.loading.load_version`);
            tests pass their own.
    """

    def __init__(
        self, settings: Settings, pipeline: Callable[[], InferencePipeline | None],
        loader: Callable[[ModelConfig], LoadedModel] | None = None,
    ) -> None:
        self.settings = settings
        self.repository = ModelRepository(settings.models_dir)
        self._pipeline = pipeline
        if loader is None:
            from streamapp.models.loading import load_version

            def loader(config: ModelConfig) -> LoadedModel:
                return load_version(settings, config)

        self._loader = loader
        self._prepared: dict[tuple[str, str], _Prepared] = {}
        self._lock = asyncio.Lock()
        self._closing: set[asyncio.Task[None]] = set()
        #: Model name -> the last swaps (newest last, at most 20).
        self.history: dict[str, list[dict[str, Any]]] = {}

    def _running(self) -> InferencePipeline:
        pipeline = self._pipeline()
        if pipeline is None:
            raise ModelSwapError("not_ready", "the worker has not started serving yet (no "
                                 "partitions assigned or models still loading); retry when "
                                 "/ready answers 200", status=503)
        return pipeline

    def target_version(self, name: str) -> str:
        """The version a load that names none loads: the highest in the repository.

        Raises:
            ModelSwapError: ``unknown_model`` (404): this worker does not serve ``name``
                (``STREAMAPP_MODELS``); ``version_not_found`` (404): the repository holds no
                version of it.
        """
        pipeline = self._pipeline()
        served = pipeline.models if pipeline is not None else self.settings.models
        if name not in served:
            raise _unknown_model(name, served)
        try:
            return list(self.repository.versions(name))[-1]
        except StreamAppError as exc:
            raise ModelSwapError("version_not_found", str(exc), status=404) from None

    async def prepare(self, name: str, version: str | None = None) -> dict[str, Any]:
        """Load, warm up and check a version; it serves nothing until :meth:`commit`.

        Args:
            name: A model the worker serves.
            version: The version (None: the repository's default,
                :meth:`~streamapp.models.ModelRepository.default_version`).

        Returns:
            ``{"model", "version", "engine", "samples_checked", "load_ms"}``.

        Raises:
            ModelSwapError: The version is refused (``reason`` and HTTP ``status`` say why).
        """
        try:
            return await self._prepare(name, version)
        except ModelSwapError as exc:
            log.warning("refused version %s of model %s (%s): %s", version, name, exc.reason,
                        exc)
            raise

    async def _prepare(self, name: str, version: str | None) -> dict[str, Any]:
        if self.settings.gpu_executor == "shared":
            raise ModelSwapError(
                "not_supported", "this worker's engines run in the shared executor server "
                "(gpu_executor=shared), which cannot swap versions yet: add the version's "
                "folder and restart `streamapp gpu-server`", status=409)
        if self._lock.locked():
            raise ModelSwapError("busy", "another version is being loaded on this worker; "
                                 "retry when it is done", status=409)
        async with self._lock:
            self._expire()
            pipeline = self._running()
            current = pipeline.models.get(name)
            if current is None:
                raise _unknown_model(name, pipeline.models)
            try:
                config = await asyncio.to_thread(self.repository.get, name, version)
            except ModelNotFoundError as exc:
                raise ModelSwapError("version_not_found", str(exc), status=404) from None
            except ConfigError as exc:
                raise ModelSwapError("bad_metadata", str(exc)) from None
            problem = contract_difference(current.config, config)
            if problem is not None:
                raise ModelSwapError("incompatible_version", f"version {config.version} of "
                                     f"{name} is refused: {problem}", status=409)
            started = time.perf_counter()

            def adapt(model: LoadedModel) -> None:
                if not pipeline.images.decodes_on_gpu(name):
                    return
                # frames read before the switch reach it still compressed
                why_not = configure_engine_images(config, model.executor.engine)
                if why_not is not None:
                    raise ModelSwapError(
                        "incompatible_version", f"version {config.version} of {name} cannot "
                        f"decode the JPEG frames version {current.version} decodes on the "
                        f"GPU: {why_not}", status=409)

            model, checked = await prepare_version(config, self._loader, adapt)
            load_ms = round((time.perf_counter() - started) * 1000.0, 1)
            old = self._prepared.pop((name, config.version), None)
            if old is not None:
                await close_model(old.model)
            self._prepared[(name, config.version)] = _Prepared(
                model, checked, time.monotonic() + PREPARED_TTL_S)
            # discarded if its commit never comes (the coordinating worker died)
            asyncio.get_running_loop().call_later(PREPARED_TTL_S + 1.0, self._expire)
            log.info("prepared %s v%s (%s) in %.0f ms, %d sample(s) checked", name,
                     config.version, model.info.tag, load_ms, checked)
            return {"model": name, "version": config.version, "engine": model.info.tag,
                    "samples_checked": checked, "load_ms": load_ms}

    async def commit(self, name: str, version: str, *, keep: bool = False) -> dict[str, Any]:
        """Make a prepared version current between two batches.

        Args:
            name / version: What :meth:`prepare` returned.
            keep: Keep the previous version loaded for requests that pin it.

        Returns:
            ``{"model", "version", "previous", "engine"}``.

        Raises:
            ModelSwapError: ``not_prepared`` (409): nothing prepared under that name and
                version (never prepared, aborted or expired).
        """
        version = normal_version(version)
        prepared = self._prepared.pop((name, version), None)
        if prepared is None:
            raise ModelSwapError("not_prepared", f"version {version} of {name} is not prepared "
                                 "on this worker (expired or aborted); load it again",
                                 status=409)
        try:
            pipeline = self._running()
        except ModelSwapError:
            await close_model(prepared.model)
            raise
        model = prepared.model
        before = pipeline.models.get(name)
        retired = pipeline.swap(name, model, keep=keep)
        self.repository.set_current(name, version)
        previous = before.version if before is not None else None
        log.info("model %s: version %s is current (was %s, %s)", name, version, previous,
                 "kept loaded" if before is not None and before not in retired
                 else "unloading")
        entry = {"version": version, "previous": previous, "engine": model.info.tag,
                 "at": time.time()}
        self.history.setdefault(name, []).append(entry)
        del self.history[name][:-20]
        for old in retired:
            self._retire(old, entry if old is before else {})
        return {"model": name, "version": version, "previous": previous,
                "engine": model.info.tag}

    async def abort(self, name: str, version: str) -> bool:
        """Discard a prepared version. Returns whether one was prepared."""
        prepared = self._prepared.pop((name, normal_version(version)), None)
        if prepared is None:
            return False
        log.info("discarding the prepared version %s of model %s (refused elsewhere in the "
                 "group)", version, name)
        await close_model(prepared.model)
        return True

    async def unload(self, name: str, version: str) -> None:
        """Unload a version kept with ``keep`` (not the current one).

        Raises:
            ModelSwapError: ``version_serving`` (409) when it is the current version (swap to
                another first), ``version_not_found`` (404) when it is not loaded.
        """
        version = normal_version(version)
        current = self._running().models.get(name)
        if current is not None and current.version == version:
            raise ModelSwapError(
                "version_serving", f"cannot unload {name} v{version}: it is the version "
                "serving; load another version first (streamapp models load)", status=409)
        try:
            model = self._running().unload(name, version)
        except KeyError:
            loaded = ", ".join(sorted(self._running().loaded.get(name, {}))) or "none"
            raise ModelSwapError("version_not_found", f"cannot unload {name} v{version}: it is "
                                 f"not loaded (loaded: {loaded})", status=404) from None
        self._retire(model, {})

    def _retire(self, model: LoadedModel, entry: dict[str, Any]) -> None:
        task = asyncio.ensure_future(self._close_when_idle(model, entry))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_when_idle(self, model: LoadedModel, entry: dict[str, Any]) -> None:
        """Close a swapped-out version once its last batch finished; log the device memory
        returned (free memory of its device before and after, on a GPU)."""
        while model.active > 0:
            await asyncio.sleep(_IDLE_POLL_S)
        free_before = _device_free_bytes(model)
        try:
            await close_model(model)
        except Exception:
            log.exception("closing %s v%s failed", model.config.name, model.version)
            return
        free_after = _device_free_bytes(model)
        returned = (None if free_before is None or free_after is None
                    else free_after - free_before)
        entry["unloaded"] = model.version
        entry["device_memory_returned_bytes"] = returned
        log.info("unloaded %s v%s (%s); device memory returned: %s", model.config.name,
                 model.version, model.info.tag,
                 "n/a (CPU)" if returned is None else f"{returned / 2**20:.1f} MiB")

    async def wait_closed(self) -> None:
        """Wait until every swapped-out version is closed (tests, shutdown)."""
        if self._closing:
            await asyncio.gather(*list(self._closing), return_exceptions=True)

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, p in self._prepared.items() if p.expires <= now]:
            prepared = self._prepared.pop(key)
            log.warning("discarding %s v%s: prepared but never committed", *key)
            self._retire(prepared.model, {})

    async def close(self) -> None:
        """Discard prepared versions and wait for swapped-out ones to close."""
        for key in list(self._prepared):
            await self.abort(*key)
        await self.wait_closed()

    def describe(self) -> dict[str, Any]:
        """Per model this worker serves: ``current`` version, ``loaded`` versions (version →
        engine tag), ``available`` versions in the repository, and the last swaps."""
        pipeline = self._pipeline()
        out: dict[str, Any] = {}
        if pipeline is None:
            return out
        for name, current in sorted(pipeline.models.items()):
            try:
                available = list(self.repository.versions(name))
            except StreamAppError:
                available = []
            out[name] = {
                "current": current.version,
                "loaded": {v: m.info.tag for v, m in pipeline.loaded.get(name, {}).items()},
                "available": available,
                "swaps": list(self.history.get(name, [])),
            }
        return out

    async def load(self, name: str, version: str | None = None, *,
                   keep: bool = False) -> dict[str, Any]:
        """:meth:`prepare` then :meth:`commit` on this worker alone.

        Raises:
            ModelSwapError: As :meth:`prepare`.
        """
        prepared = await self.prepare(name, version)
        committed = await self.commit(name, prepared["version"], keep=keep)
        return {**prepared, **committed}

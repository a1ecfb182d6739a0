"""``streamapp gpu-server``: the executor server process of one GPU (``gpu_executor=shared``).

Loads ``settings.models`` once with ``settings.backend`` (the same loading as a worker's, on the
GPU that ``CUDA_VISIBLE_DEVICES`` shows it), lets the engine decode JPEG frames where it can
(``image_decode=auto``), warms each model up, then serves the host's workers through
:class:`engines.server.ExecutorServer` on ``gpu_server_socket`` until SIGTERM/SIGINT. The socket
exists only once the models are loaded and warm, so a connect that succeeds means ready
(``streamapp worker --processes N --gpu-executor shared`` waits for that before it starts the
workers). On exit it logs what its engines saw (batches, rows, mean batch per model).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

import numpy as np

from streamapp.agents.pipeline import LoadedModel
from streamapp.models.decoding import configure_engine_images
from streamapp.settings import Settings

__all__ = ["run_gpu_server", "server_socket"]

log = logging.getLogger("streamapp.gpu_server")


def server_socket(settings: Settings) -> str:
    """The executor server's socket: ``gpu_server_socket``, or by default
    ``<temp dir>/streamapp-<uid>/gpu-server.sock`` (the folder created with mode 0700)."""
    if settings.gpu_server_socket:
        return settings.gpu_server_socket
    folder = Path(tempfile.gettempdir()) / f"streamapp-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    return str(folder / "gpu-server.sock")


async def _warm_up(models: dict[str, LoadedModel]) -> None:
    for model in models.values():
        config = model.config
        item = {config.input_name: np.zeros(config.item_shape, dtype=config.input_dtype)}
        await model.executor.run([item])


async def _serve(settings: Settings, models: dict[str, LoadedModel], path: str) -> None:
    from engines.server import ExecutorServer

    images = {}
    for name, model in models.items():
        if settings.image_decode == "auto" and model.config.image is not None:
            reason = configure_engine_images(model.config, model.executor.engine)
            images[name] = {model.config.input_name: reason}
            log.info("model %s: JPEG frames decoded %s", name,
                     "by this server's engine" if reason is None else f"by the workers ({reason})")
    await _warm_up(models)
    server = ExecutorServer({n: m.executor for n, m in models.items()}, path,
                            batch_delay_ms=settings.gpu_server_batch_delay_ms,
                            image_inputs=images)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    log.info("gpu-server ready at %s (pid %d): %s, batch delay %.1f ms", path, os.getpid(),
             ", ".join(f"{n} {m.info.tag} on {m.info.device}" for n, m in models.items()),
             settings.gpu_server_batch_delay_ms)
    try:
        await stop.wait()
    finally:
        await server.close()
        for name, stats in server.stats.items():
            s = stats.as_dict()
            log.info("gpu-server %s: %d client batches in %d engine batches of %d rows (mean "
                     "batch %.1f; %d engine batches held more than one client batch, %d client "
                     "batches were split across two)", name, s["sub_batches"], s["batches"],
                     s["rows"], s["mean_batch"], s["merged"], s["split"])
        for model in models.values():
            await model.executor.close()
            model.executor.engine.close()


def run_gpu_server(settings: Settings) -> int:
    """Load, warm up and serve until SIGTERM/SIGINT (module docstring).

    Returns:
        The exit code: 0 after a clean stop.

    Raises:
        StreamAppError / EngineError: A model, backend or device failed to load.
        OSError: The socket cannot be created.
    """
    from streamapp.models.loading import load_local_models

    logging.basicConfig(level=logging.WARNING,
                        format="[%(asctime)s] [%(process)d] [%(levelname)s] %(message)s")
    log.setLevel(logging.INFO)  # its own lifecycle lines; libraries stay at WARNING
    sys.setswitchinterval(settings.gil_switch_interval_ms / 1000.0)
    path = server_socket(settings)
    # no fallback to another version: the workers pick theirs from the repository on their
    # own (the default one), so the server refuses to start when that one fails its checks
    models = load_local_models(settings, fallback=False)
    if settings.gc_freeze:
        from streamapp.runtime import freeze_heap

        freeze_heap()
    asyncio.run(_serve(settings, models, path))
    return 0

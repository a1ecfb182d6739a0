"""The executor interface: run batches on an engine without blocking the asyncio event loop.

The stream processor hands an executor a list of items (one dict of per-item arrays each); the
executor packs them into a batch (into pinned staging memory on a GPU), runs the engine and
resolves an awaitable with the batched outputs. In-flight batches are bounded by
``max_inflight``: :meth:`Executor.run` waits for a free slot before it starts a batch.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence

import numpy as np

from engines.base import Engine, TensorSpec, item_fits, put_item
from engines.exceptions import EngineClosedError, InputSpecError

__all__ = ["Executor", "Item", "check_batch", "pack_items"]

#: One request's inputs: input name → array of the input's item shape (no batch dimension).
Item = Mapping[str, np.ndarray]


def check_batch(items: Sequence[Item], *, closed: bool, max_batch: int, who: str) -> None:
    """What every executor's ``run`` checks first.

    Raises:
        EngineClosedError: ``closed``.
        InputSpecError: ``items`` is empty or longer than ``max_batch`` (``who``'s limit, e.g.
            "the executor's").
    """
    if closed:
        raise EngineClosedError("the executor is closed")
    if not items:
        raise InputSpecError("cannot run an empty batch")
    if len(items) > max_batch:
        raise InputSpecError(
            f"batch of {len(items)} items exceeds {who} max batch {max_batch}; split it"
        )


def pack_items(
    items: Sequence[Item], spec: TensorSpec, out: np.ndarray | None = None
) -> np.ndarray:
    """Stack the ``spec.name`` array of every item into one batch array.

    Args:
        items: Requests' inputs; each ``items[i][spec.name]`` is ``spec.dtype[*spec.item_shape]``
            (or float16 for a wider float input, widened exactly: :func:`engines.base.put_item`).
        spec: The engine input to pack.
        out: Optional preallocated buffer ``spec.dtype[>= len(items), *item_shape]`` (e.g. a
            pinned staging buffer); the first ``len(items)`` rows are written and that view is
            returned, so no new memory is allocated.

    Returns:
        ``spec.dtype[len(items), *item_shape]``.

    Raises:
        InputSpecError: An item lacks the input, or its dtype/shape does not fit ``spec``.
    """
    n = len(items)
    item_shape = spec.item_shape
    if out is None:
        out = np.empty((n, *item_shape), dtype=spec.dtype)
    elif out.shape[0] < n or out.shape[1:] != item_shape or out.dtype != spec.dtype:
        raise InputSpecError(
            f"staging buffer {out.dtype}{list(out.shape)} cannot hold {n} items of "
            f"{spec.dtype}{list(item_shape)}"
        )
    view = out[:n]
    for i, item in enumerate(items):
        try:
            array = item[spec.name]
        except KeyError:
            raise InputSpecError(f"item {i} has no input {spec.name!r}") from None
        if not item_fits(spec, array):
            raise InputSpecError(
                f"item {i} input {spec.name!r} is {array.dtype}{list(array.shape)}, the engine "
                f"expects {spec.dtype}{list(item_shape)}"
            )
        put_item(view[i], array)
    return view


class Executor(abc.ABC):
    """Runs batches on one engine asynchronously with a bound on batches in flight.

    Attributes:
        engine: The engine batches run on.
        max_inflight: Most batches running at once; :meth:`run` waits for a slot beyond that.
    """

    engine: Engine
    max_inflight: int

    @abc.abstractmethod
    async def run(self, items: Sequence[Item]) -> dict[str, np.ndarray]:
        """Pack ``items`` into one batch, run it, and return the batched outputs.

        Args:
            items: 1..``engine.max_batch_size`` items, each an input name → array of that
                input's item shape and dtype.

        Returns:
            Output name → ``dtype[len(items), ...]``, row ``i`` belonging to ``items[i]``. Arrays
            are owned by the caller (not reused by later batches).

        Raises:
            InputSpecError: An item does not fit the engine's inputs (not retriable).
            EngineRuntimeError: The backend failed (retriable).
            EngineClosedError: The executor was closed.
        """

    @property
    @abc.abstractmethod
    def inflight(self) -> int:
        """Batches currently running."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Wait for running batches, then release threads/streams/buffers. Idempotent.

        Does not close the engine: whoever loaded it closes it.
        """

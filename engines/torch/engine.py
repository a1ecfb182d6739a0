"""PyTorch-on-CUDA backend: an ONNX model converted with onnx2torch, run on CUDA.

The GPU fallback where TensorRT is absent (registry name ``"torch"``). Options: fp16 (weights and
activations in half precision; IO stays as the ONNX model declares it, casts happen on the GPU),
channels-last memory format for 4-D inputs, and CUDA graphs captured per batch size.

Stream execution (:meth:`TorchEngine.bind_stream`): the executor's cuda-python stream is wrapped
with ``torch.cuda.ExternalStream``; its device buffers are wrapped as tensors through
``__cuda_array_interface__`` (no copy). One forward pass reads rows ``[0, n)`` of the input
buffer and writes rows ``[0, n)`` of the output buffer. With CUDA graphs, a batch of ``n`` runs
the graph of the smallest *bucket* ``>= n`` (powers of two up to the maximum batch, plus the
maximum itself); the rows past ``n`` compute on stale data and are never read. Every bucket is
captured when the stream context is created (after warm-up runs), so the first batches of a
worker do not pay for captures — measured on the H200, capturing on first use made a fresh
worker run at a fraction of its speed for many seconds — and enqueueing costs one graph launch.
The same bucketing is what TensorRT-LLM and vLLM do for their CUDA graphs.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from engines.base import DYNAMIC, EngineInfo, StreamContext, StreamEngine, TensorSpec
from engines.exceptions import (
    EngineLoadError,
    EngineRuntimeError,
    InputSpecError,
    OutOfMemoryError,
)
from engines.preprocess.base import EncodedImage, ImageSpec

__all__ = ["Precision", "TorchEngine", "graph_batch_sizes", "load", "onnx_io_specs"]

Precision = Literal["fp32", "fp16"]

#: Eager runs on a stream before its first CUDA-graph capture (cuDNN autotuning, lazy init).
WARMUP_RUNS = 3

# One CUDA-graph capture at a time in the process: ``torch.cuda.graph`` synchronizes the device
# and empties the allocator cache when it starts, which invalidates a capture running on
# another stream (cudaErrorStreamCaptureInvalidated, seen on the H200 with two lanes).
_CAPTURE_LOCK = threading.Lock()


def normalize_for_onnx2torch(model: Any) -> Any:
    """Rewrite an ``onnx.ModelProto`` (in place) into the form onnx2torch converts reliably.

    - graph inputs that are also initializers (``keep_initializers_as_inputs``) stop being
      inputs;
    - ``Constant`` nodes holding a tensor become initializers, and ``Identity`` nodes of an
      initializer are bypassed: onnx2torch's converters look weights up among the initializers
      only (a ResNet-50 exported by PyTorch 2.11 feeds de-duplicated conv biases through
      Identity nodes, and onnx2torch 1.5.15 fails with ``KeyError: 'onnx::Conv_501'``).

    The computation is unchanged.
    """
    import onnx

    graph = model.graph
    initializers = {init.name for init in graph.initializer}
    inputs = [v for v in graph.input if v.name not in initializers]
    if len(inputs) != len(graph.input):
        del graph.input[:]
        graph.input.extend(inputs)
    nodes = []
    for node in graph.node:
        attrs = {a.name: a for a in node.attribute}
        if node.op_type == "Constant" and set(attrs) == {"value"} and len(node.output) == 1:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(attrs["value"].t)
            tensor.name = node.output[0]
            graph.initializer.append(tensor)
        else:
            nodes.append(node)
    # ``Identity`` of an initializer (PyTorch's exporter de-duplicates equal initializers,
    # e.g. the all-zero biases of BatchNorm folded into convolutions, that way): point the
    # consumers at the initializer itself.
    initializers = {init.name for init in graph.initializer}
    outputs = {v.name for v in graph.output}
    alias = {
        node.output[0]: node.input[0]
        for node in nodes
        if node.op_type == "Identity"
        and node.input[0] in initializers
        and node.output[0] not in outputs
    }
    if alias:
        nodes = [n for n in nodes if not (n.op_type == "Identity" and n.output[0] in alias)]
        for node in nodes:
            for i, name in enumerate(node.input):
                if name in alias:
                    node.input[i] = alias[name]
    if len(nodes) != len(graph.node) or alias:
        del graph.node[:]
        graph.node.extend(nodes)
    return model


def onnx_io_specs(model: Any) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Input and output specs of an ``onnx.ModelProto`` (initializers are not inputs)."""
    from onnx import helper

    initializers = {init.name for init in model.graph.initializer}

    def spec(value: Any) -> TensorSpec:
        ttype = value.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") else DYNAMIC for d in ttype.shape.dim)
        return TensorSpec(
            value.name, np.dtype(helper.tensor_dtype_to_np_dtype(ttype.elem_type)), shape
        )

    inputs = tuple(spec(v) for v in model.graph.input if v.name not in initializers)
    outputs = tuple(spec(v) for v in model.graph.output)
    return inputs, outputs


class _CudaArray:
    """Exposes a raw device pointer to ``torch.as_tensor`` (CUDA Array Interface v2)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": dtype.str,
            "data": (ptr, False),
            "version": 2,
        }


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes CUDA graphs are captured for: 1, 2, 4, ... below ``max_batch``, and it."""
    sizes = []
    size = 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    sizes.append(max_batch)
    return sizes


class _TorchStreamContext(StreamContext):
    def __init__(self, engine: TorchEngine, stream: int, addresses: Mapping[str, int]) -> None:
        import torch

        self.engine = engine
        self.stream = torch.cuda.ExternalStream(stream, device=engine.device)
        max_b = engine.max_batch_size
        self.inputs = [
            torch.as_tensor(
                _CudaArray(addresses[s.name], (max_b, *s.item_shape), s.dtype),
                device=engine.device,
            )
            for s in engine.inputs
        ]
        self.outputs = [
            torch.as_tensor(
                _CudaArray(addresses[s.name], (max_b, *s.item_shape), s.dtype),
                device=engine.device,
            )
            for s in engine.outputs
        ]
        self.graphs: dict[int, Any] = {}
        self._pool: Any = None
        self._staged: Mapping[str, Sequence[tuple[int, EncodedImage]]] = {}
        self.buckets = graph_batch_sizes(max_b)
        if engine.cuda_graphs:
            with torch.inference_mode():
                for size in reversed(self.buckets):  # largest first: its pool serves the rest
                    self.graphs[size] = self._capture(size)

    def _step(self, n: int) -> None:
        results = self.engine.forward(*(t[:n] for t in self.inputs))
        for out, result in zip(self.outputs, results, strict=True):
            out[:n].copy_(result)

    def _capture(self, n: int) -> Any:
        import torch

        with _CAPTURE_LOCK:
            for _ in range(WARMUP_RUNS):
                self._step(n)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other lanes keep launching work from their threads meanwhile.
            with torch.cuda.graph(
                graph, pool=self._pool, stream=self.stream, capture_error_mode="thread_local"
            ):
                self._step(n)
        self._pool = graph.pool()
        return graph

    def stage_images(self, images: Mapping[str, Sequence[tuple[int, EncodedImage]]]) -> None:
        """Frames the next :meth:`enqueue` decodes into its input rows first (executor, under
        the lane lock; see :class:`~engines.preprocess.ImageDecodingEngine`).

        Raises:
            InputSpecError: GPU decoding was not configured for one of the inputs.
        """
        missing = set(images) - set(self.engine.image_writers)
        if missing:
            raise InputSpecError(
                f"encoded frames for input(s) {sorted(missing)}, but GPU image decoding is not "
                "configured for them; call configure_images first"
            )
        self._staged = images

    def _decode_staged(self) -> None:
        staged, self._staged = self._staged, {}
        for index, spec in enumerate(self.engine.inputs):
            frames = staged.get(spec.name)
            if frames:
                self.engine.image_writers[spec.name].write(frames, self.inputs[index])

    def enqueue(self, batch_size: int) -> None:
        import torch

        try:
            with torch.cuda.stream(self.stream), torch.inference_mode():
                if self._staged:
                    # Same stream: after the H2D copy of the other rows, before the model.
                    self._decode_staged()
                if self.engine.cuda_graphs:
                    bucket = next(b for b in self.buckets if b >= batch_size)
                    graph = self.graphs.get(bucket)
                    if graph is None:
                        graph = self.graphs[bucket] = self._capture(bucket)
                    graph.replay()
                else:
                    self._step(batch_size)
        except torch.cuda.OutOfMemoryError as exc:
            raise OutOfMemoryError(
                f"CUDA out of memory running batch {batch_size}: {exc}; use a smaller max "
                "batch or fewer streams"
            ) from exc
        except RuntimeError as exc:
            raise EngineRuntimeError(f"PyTorch failed on batch {batch_size}: {exc}") from exc
        finally:
            self._staged = {}

    def close(self) -> None:
        import torch

        self.stream.synchronize()
        self.graphs.clear()
        self._pool = None
        self.inputs.clear()
        self.outputs.clear()
        # Give back what this stream cached: graph pools and activations (caching allocator)
        # and the cuBLAS workspace PyTorch keeps per stream.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()


class TorchEngine(StreamEngine):
    """A ``torch.nn.Module`` run on CUDA, with the IO specs of the ONNX model it came from.

    Args:
        module: The model (e.g. from ``onnx2torch.convert``); moved to ``device``.
        inputs: Input specs (batch dimension first, dynamic).
        outputs: Output specs.
        model_path: Source file, for :class:`EngineInfo`.
        model_sha256: Its sha256.
        device: ``"cuda:0"`` (or ``"cpu"`` for tests of ``infer`` without a GPU; no streams).
        precision: ``"fp32"`` or ``"fp16"`` (module and float activations in half precision).
        max_batch_size: Largest batch (sizes the executor's buffers).
        cuda_graphs: Capture one CUDA graph per (stream, batch size) on first use.
        channels_last: Channels-last memory format for 4-D inputs (faster convolutions with
            tensor cores); default True.
        cudnn_benchmark: Let cuDNN pick the fastest convolution algorithms per shape
            (sets the process-wide ``torch.backends.cudnn.benchmark``).
        allow_tf32: Let fp32 matmuls/convolutions use TF32 tensor cores (faster, ~1e-3
            relative error). Default False. Sets process-wide ``torch.backends`` flags.
    """

    def __init__(
        self,
        module: Any,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        *,
        model_path: str = "<module>",
        model_sha256: str = "",
        device: str = "cuda:0",
        precision: Precision = "fp32",
        max_batch_size: int = 64,
        cuda_graphs: bool = True,
        channels_last: bool = True,
        cudnn_benchmark: bool = True,
        allow_tf32: bool = False,
    ) -> None:
        import torch

        if precision not in ("fp32", "fp16"):
            raise EngineLoadError(f"precision must be 'fp32' or 'fp16', got {precision!r}")
        if max_batch_size < 1:
            raise EngineLoadError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.device = torch.device(device)
        self.precision = precision
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.channels_last = channels_last
        if self.device.type == "cuda":
            if cudnn_benchmark:
                torch.backends.cudnn.benchmark = True
            # PyTorch runs fp32 convolutions in TF32 on Ampere+ by default (10-bit mantissa);
            # "fp32" here means fp32 unless the caller allows TF32.
            torch.backends.cudnn.allow_tf32 = allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = allow_tf32
        module = module.eval().to(self.device)
        if precision == "fp16":
            module = module.half()
        if channels_last and any(len(s.shape) == 4 for s in self.inputs):
            module = module.to(memory_format=torch.channels_last)
        self.module = module
        self._compute_dtype = torch.float16 if precision == "fp16" else torch.float32
        self._lock = threading.Lock()
        #: Input name → GPU JPEG decoder (:meth:`configure_images`).
        self.image_writers: dict[str, Any] = {}
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.info = EngineInfo(
            backend="torch",
            model_path=model_path,
            model_sha256=model_sha256,
            version=str(torch.__version__),
            device=f"{self.device} ({name})",
            precision=precision,
            max_batch_size=max_batch_size,
            extra={"cuda_graphs": self.cuda_graphs, "channels_last": channels_last},
        )

    def forward(self, *xs: Any) -> tuple[Any, ...]:
        """Run the module on batched tensors (already on the device); outputs in the output
        specs' dtypes. Safe to capture in a CUDA graph (no host synchronisation)."""
        import torch

        prepared = []
        for x in xs:
            if x.is_floating_point() and x.dtype != self._compute_dtype:
                x = x.to(self._compute_dtype)
            if self.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            prepared.append(x)
        result = self.module(*prepared)
        results = result if isinstance(result, (tuple, list)) else (result,)
        if len(results) != len(self.outputs):
            raise EngineRuntimeError(
                f"the module returned {len(results)} outputs, the model declares "
                f"{len(self.outputs)}"
            )
        dtypes = [_torch_dtype(s.dtype) for s in self.outputs]
        return tuple(r.to(d) for r, d in zip(results, dtypes, strict=True))

    def infer_impl(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        with self._lock, torch.inference_mode():
            try:
                xs = [
                    torch.from_numpy(np.ascontiguousarray(feeds[s.name])).to(self.device)
                    for s in self.inputs
                ]
                results = self.forward(*xs)
                return {s.name: r.cpu().numpy() for s, r in zip(self.outputs, results, strict=True)}
            except torch.cuda.OutOfMemoryError as exc:
                raise OutOfMemoryError(f"CUDA out of memory: {exc}") from exc
            except RuntimeError as exc:
                raise EngineRuntimeError(f"PyTorch failed: {exc}") from exc

    def configure_images(self, input_name: str, spec: ImageSpec) -> str | None:
        """Decode JPEG frames for ``input_name`` on the GPU per ``spec`` from now on
        (:class:`~engines.preprocess.ImageDecodingEngine`): nvJPEG via torchvision, then
        resize/normalize with PyTorch, on the stream of the batch, into the input buffer.

        Returns:
            None when enabled; else why not (no CUDA device, no torchvision, a resize filter
            without a GPU implementation, an input of another size).
        """
        from engines.preprocess.gpu import GpuImageWriter, gpu_decoding_unavailable

        if self.device.type != "cuda":
            return "the engine runs on the CPU"
        reason = gpu_decoding_unavailable() or spec.gpu_unsupported
        if reason is not None:
            return reason
        item = self.input_spec(input_name).item_shape
        if int(np.prod(item)) != int(np.prod(spec.array_shape)):
            return (f"input {input_name!r} holds {list(item)}, the image declaration gives "
                    f"{list(spec.array_shape)}")
        self.image_writers[input_name] = GpuImageWriter(spec, self.device)
        return None

    def bind_stream(self, stream: int, addresses: Mapping[str, int]) -> StreamContext:
        if self.device.type != "cuda":
            raise EngineRuntimeError("bind_stream needs a CUDA device; this engine runs on CPU")
        self.check_addresses(addresses)
        return _TorchStreamContext(self, stream, addresses)

    def close_impl(self) -> None:
        import torch

        self.module = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


def _torch_dtype(dtype: np.dtype[Any]) -> Any:
    import torch

    return {
        np.dtype("float32"): torch.float32,
        np.dtype("float16"): torch.float16,
        np.dtype("float64"): torch.float64,
        np.dtype("int64"): torch.int64,
        np.dtype("int32"): torch.int32,
        np.dtype("int8"): torch.int8,
        np.dtype("uint8"): torch.uint8,
        np.dtype("bool"): torch.bool,
    }[np.dtype(dtype)]


_OPTIONS = {
    "device",
    "precision",
    "max_batch_size",
    "cuda_graphs",
    "channels_last",
    "cudnn_benchmark",
    "allow_tf32",
}


def load(model_path: Path, **options: Any) -> TorchEngine:
    """Registry loader: ``load_engine("torch", "model.onnx", precision="fp16", max_batch_size=64)``.

    Raises:
        EngineLoadError: Unknown options, unreadable model, or onnx2torch cannot convert it.
    """
    unknown = set(options) - _OPTIONS
    if unknown:
        raise EngineLoadError(
            f"unknown torch backend options {sorted(unknown)}; known: {sorted(_OPTIONS)}"
        )
    path = Path(model_path)
    if path.suffix.lower() != ".onnx":
        raise EngineLoadError(f"the torch backend loads .onnx models, got {path}")
    try:
        import onnx
        import onnx2torch
    except ImportError as exc:
        raise EngineLoadError(
            f"the torch backend needs onnx and onnx2torch ({exc}); pip install onnx2torch"
        ) from exc
    try:
        data = path.read_bytes()
        model = normalize_for_onnx2torch(onnx.load_model_from_string(data))
        inputs, outputs = onnx_io_specs(model)
        module = onnx2torch.convert(model)
    except FileNotFoundError:
        raise EngineLoadError(f"no model file at {path}") from None
    except Exception as exc:
        raise EngineLoadError(
            f"cannot convert {path} to PyTorch with onnx2torch: {type(exc).__name__}: {exc}"
        ) from exc
    for spec in inputs:
        if not spec.shape or spec.shape[0] != DYNAMIC:
            raise InputSpecError(
                f"input {spec.name!r} has no dynamic batch dimension {list(spec.shape)}; export "
                "the model with a dynamic first axis"
            )
    return TorchEngine(
        module,
        inputs,
        outputs,
        model_path=str(path),
        model_sha256=hashlib.sha256(data).hexdigest(),
        device=str(options.get("device", "cuda:0")),
        precision=options.get("precision", "fp32"),
        max_batch_size=int(options.get("max_batch_size", 64)),
        cuda_graphs=bool(options.get("cuda_graphs", True)),
        channels_last=bool(options.get("channels_last", True)),
        cudnn_benchmark=bool(options.get("cudnn_benchmark", True)),
        allow_tf32=bool(options.get("allow_tf32", False)),
    )

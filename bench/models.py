"""The ``resnet50`` model folder for the benchmarks, generated on demand (never committed).

``model.onnx`` comes from ``scripts/export_resnet50.py`` (torchvision's ResNet-50, random
weights) where torchvision is installed (the H200 image), else from :func:`build_resnet50_onnx`,
the same architecture (ResNet-50 v1.5, batch norm folded into the convolutions, as the exporter
folds it) written directly with ``onnx.helper`` so that no PyTorch is needed on CPU machines.
:func:`write_metadata` writes the ``metadata.json`` the worker's model repository reads.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DEFAULT_REPO", "build_resnet50_onnx", "ensure_resnet50", "write_metadata"]

ROOT = Path(__file__).resolve().parent.parent
#: Model repository for benchmark models (git-ignored ``models-perf/``).
DEFAULT_REPO = ROOT / "models-perf" / "repo"

#: torchvision's ImageNet normalization (``transforms.Normalize``), in 0..1 pixel units.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def build_resnet50_onnx(path: Path, *, seed: int = 0, classes: int = 1000) -> Path:
    """Write ResNet-50 v1.5 with random weights as ONNX (opset 17), without PyTorch.

    Same layers and shapes as ``torchvision.models.resnet50`` exported in eval mode (batch norm
    folded into conv biases): input ``input`` float32[batch, 3, 224, 224], output ``logits``
    float32[batch, classes]. He-normal weights, the last convolution of each residual branch
    scaled by 0.2 so activations stay in fp16 range through 16 blocks.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes: list[Any] = []
    inits: list[Any] = []
    counter = iter(range(10_000))

    def conv(x: str, cin: int, cout: int, k: int, stride: int, relu: bool,
             gain: float = 1.0) -> str:
        n = next(counter)
        w = (rng.standard_normal((cout, cin, k, k), dtype=np.float32)
             * np.float32(gain * np.sqrt(2.0 / (cin * k * k))))
        b = (rng.standard_normal(cout, dtype=np.float32) * np.float32(0.01))
        inits.append(numpy_helper.from_array(w, f"conv{n}.w"))
        inits.append(numpy_helper.from_array(b, f"conv{n}.b"))
        out = f"conv{n}"
        nodes.append(helper.make_node(
            "Conv", [x, f"conv{n}.w", f"conv{n}.b"], [out], kernel_shape=[k, k],
            strides=[stride, stride], pads=[k // 2] * 4,
        ))
        if relu:
            nodes.append(helper.make_node("Relu", [out], [f"relu{n}"]))
            return f"relu{n}"
        return out

    x = conv("input", 3, 64, 7, 2, True)
    nodes.append(helper.make_node("MaxPool", [x], ["pool0"], kernel_shape=[3, 3],
                                  strides=[2, 2], pads=[1, 1, 1, 1]))
    x, cin = "pool0", 64
    for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512),
                                                strict=True)):
        for block in range(blocks):
            stride = 2 if block == 0 and stage > 0 else 1
            y = conv(x, cin, width, 1, 1, True)
            y = conv(y, width, width, 3, stride, True)  # v1.5: the stride is on the 3x3
            y = conv(y, width, width * 4, 1, 1, False, gain=0.2)
            shortcut = conv(x, cin, width * 4, 1, stride, False) if block == 0 else x
            n = next(counter)
            nodes.append(helper.make_node("Add", [y, shortcut], [f"add{n}"]))
            nodes.append(helper.make_node("Relu", [f"add{n}"], [f"out{n}"]))
            x, cin = f"out{n}", width * 4
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["gap"]))
    nodes.append(helper.make_node("Flatten", ["gap"], ["flat"], axis=1))
    fc_w = rng.standard_normal((classes, 2048), dtype=np.float32) * np.float32(1 / np.sqrt(2048))
    inits.append(numpy_helper.from_array(fc_w, "fc.w"))
    inits.append(numpy_helper.from_array(np.zeros(classes, np.float32), "fc.b"))
    nodes.append(helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["logits"], transB=1))
    graph = helper.make_graph(
        nodes, "resnet50",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 224, 224])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        inits,
    )
    # IR 8 / opset 17: loadable by every ONNX Runtime the project meets (1.30 on the H200).
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="streamapp-bench")
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path))
    return path


def write_metadata(folder: Path, *, precision: str = "fp16", builder: str = "") -> Path:
    """Write ``folder/metadata.json`` for ``folder/model.onnx`` (ResNet-50, 1000 classes).

    Requests: a pre-processed tensor float32 or float16 [3, 224, 224] (already normalized), or
    an RGB JPEG/PNG image: resized to 224×224 (bilinear), pixel/255, ImageNet mean/std, CHW.
    Labels are the class indices as strings (random weights: no ImageNet names are claimed).
    ``precision`` goes to the ``torch`` backend (``engine.torch.precision``).
    """
    model = folder / "model.onnx"
    meta = {
        "name": "resnet50",
        "version": "1",
        "task": "classification",
        "description": "ResNet-50 (torchvision architecture) with RANDOM weights, for "
        "benchmarks only: its predictions mean nothing. Generated by bench/models.py.",
        "labels": [str(i) for i in range(1000)],
        "input": {"name": "input", "dtype": "float32", "shape": [-1, 3, 224, 224]},
        "output": {"name": "logits", "dtype": "float32", "shape": [-1, 1000], "kind": "logits"},
        # value_range: what pixel/255 normalized with IMAGENET_MEAN/STD can give,
        # (0 - 0.485) / 0.229 = -2.118 to (1 - 0.406) / 0.225 = 2.640, with float16's rounding
        "request": {"shape": [3, 224, 224], "dtypes": ["float32", "float16"],
                    "value_range": [-2.12, 2.65], "allow_non_finite": False},
        "image": {
            "description": "RGB JPEG or PNG of any size up to max_pixels: resized to 224x224 "
            "(bilinear), pixel/255, then (x - mean) / std per channel (torchvision's ImageNet "
            "normalization), channels first.",
            "mode": "RGB", "size": [224, 224], "scale": 1 / 255, "offset": 0.0,
            "resample": "bilinear", "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD),
            "layout": "CHW", "formats": ["JPEG", "PNG"], "max_pixels": 4_194_304,
        },
        "preprocessing": {"scale": 1.0, "offset": 0.0},
        "engine": {"torch": {"precision": precision}},
        "onnx_sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
        "generated_by": builder,
    }
    path = folder / "metadata.json"
    path.write_text(json.dumps(meta, indent=1) + "\n")
    return path


def ensure_resnet50(repo: Path = DEFAULT_REPO, *, builder: str = "auto",
                    precision: str = "fp16", log: Any = print) -> Path:
    """Make ``repo/resnet50`` (model.onnx + metadata.json) unless it exists; return the folder.

    Args:
        builder: ``"torchvision"`` (``scripts/export_resnet50.py``), ``"onnx"``
            (:func:`build_resnet50_onnx`) or ``"auto"`` (torchvision when importable).
    """
    folder = repo / "resnet50"
    if (folder / "model.onnx").is_file() and (folder / "metadata.json").is_file():
        return folder
    if builder == "auto":
        builder = "torchvision" if _torchvision_works() else "onnx"
    started = time.monotonic()
    folder.mkdir(parents=True, exist_ok=True)
    model = folder / "model.onnx"
    if builder == "torchvision":
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "export_resnet50.py"), "-o", str(model)],
            check=True,
        )
    else:
        build_resnet50_onnx(model)
    write_metadata(folder, precision=precision, builder=builder)
    log(f"resnet50 model folder {folder} ({builder}, {time.monotonic() - started:.1f} s)")
    return folder


def _torchvision_works() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    probe = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True)
    return probe.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description="Generate the resnet50 benchmark model folder.")
    parser.add_argument("--repo", type=Path, default=DEFAULT_REPO)
    parser.add_argument("--builder", choices=("auto", "torchvision", "onnx"), default="auto")
    parser.add_argument("--precision", choices=("fp16", "fp32"), default="fp16")
    args = parser.parse_args()
    print(ensure_resnet50(args.repo, builder=args.builder, precision=args.precision))


if __name__ == "__main__":
    main()

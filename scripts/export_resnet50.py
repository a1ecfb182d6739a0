"""Export torchvision's ResNet-50 to ONNX with a dynamic batch axis (for GPU benchmarks).

Random weights (``weights=None``): speed does not depend on them, and nothing is downloaded.
The file (about 100 MB) is generated on demand and never committed (``/models-perf/`` is
git-ignored).

Usage::

    python scripts/export_resnet50.py [-o models-perf/resnet50.onnx] [--opset 17]

Input ``input`` float32[batch, 3, 224, 224], output ``logits`` float32[batch, 1000].
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def export(path: Path, opset: int = 17, seed: int = 0) -> Path:
    import torch
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.resnet50(weights=None).eval()
    example = torch.randn(2, 3, 224, 224)
    path.parent.mkdir(parents=True, exist_ok=True)
    kwargs = dict(
        input_names=["input"],
        output_names=["logits"],
        opset_version=opset,
        do_constant_folding=True,
    )
    with torch.inference_mode():
        try:  # the TorchScript exporter: plain ONNX, dynamic axis by name
            torch.onnx.export(
                model,
                (example,),
                str(path),
                dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                dynamo=False,
                **kwargs,
            )
        except TypeError:  # torch without the ``dynamo`` argument
            torch.onnx.export(
                model,
                (example,),
                str(path),
                dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                **kwargs,
            )
    import onnx

    onnx.checker.check_model(str(path))
    proto = onnx.load(str(path))
    graph = proto.graph
    initializers = {i.name for i in graph.initializer}
    print(
        f"graph: {len(graph.node)} nodes, {len(graph.initializer)} initializers, "
        f"{sum(n.op_type == 'Constant' for n in graph.node)} Constant nodes, inputs "
        f"{[v.name for v in graph.input if v.name not in initializers]} "
        f"(+{sum(v.name in initializers for v in graph.input)} initializers listed as inputs), "
        f"opset {[o.version for o in proto.opset_import]}"
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=Path("models-perf/resnet50.onnx"))
    parser.add_argument("--opset", type=int, default=17)
    args = parser.parse_args()
    started = time.monotonic()
    path = export(args.output, args.opset)
    size = path.stat().st_size / 2**20
    print(f"wrote {path} ({size:.1f} MiB) in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()

"""``engines inspect MODEL.plan``: IO tensors, profiles, precision, layers and the sidecar."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engines.base import DYNAMIC
from engines.tensorrt._api import trt
from engines.tensorrt.plan import PlanMetadata, sidecar_path

__all__ = ["describe_plan", "format_plan"]


def describe_plan(plan_path: Path, *, device: int = 0) -> dict[str, Any]:
    """Everything ``inspect`` prints, as a dict.

    The sidecar is read and shown even when the plan cannot be deserialized here (another GPU
    or TensorRT version): then ``"load_error"`` says why and the engine fields are absent.
    """
    from engines.exceptions import EngineError
    from engines.tensorrt.engine import TensorRTEngine

    out: dict[str, Any] = {"plan": str(plan_path)}
    try:
        out["sidecar"] = PlanMetadata.read(plan_path).__dict__
    except EngineError as exc:
        out["sidecar"] = None
        out["sidecar_error"] = str(exc)
    try:
        engine = TensorRTEngine(plan_path, device=device, check_sidecar=out["sidecar"] is not None)
    except EngineError as exc:
        out["load_error"] = str(exc)
        return out
    with engine:
        out["tensorrt_version"] = engine.info.version
        out["device"] = engine.info.device
        out["precision"] = engine.info.precision
        out["max_batch_size"] = engine.max_batch_size
        out["inputs"] = [_spec(s) for s in engine.inputs]
        out["outputs"] = [_spec(s) for s in engine.outputs]
        out["profiles"] = [p.as_dict() for p in engine.profiles]
        out["num_layers"] = engine.cuda_engine.num_layers
        try:
            inspector = engine.cuda_engine.create_engine_inspector()
            info = json.loads(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
            layers = info.get("Layers", [])
            precisions: dict[str, int] = {}
            for layer in layers:
                if isinstance(layer, dict):
                    key = str(layer.get("Precision", "?"))
                    precisions[key] = precisions.get(key, 0) + 1
            out["layer_precisions"] = precisions
        except Exception:
            out["layer_precisions"] = {}
    return out


def _spec(spec: Any) -> dict[str, Any]:
    return {
        "name": spec.name,
        "dtype": str(spec.dtype),
        "shape": ["batch" if i == 0 and d == DYNAMIC else d for i, d in enumerate(spec.shape)],
    }


def format_plan(desc: dict[str, Any]) -> str:
    """Human-readable text of :func:`describe_plan`'s dict."""
    lines = [f"plan:      {desc['plan']}"]
    side = desc.get("sidecar")
    if "load_error" in desc:
        lines.append(f"load:      FAILED: {desc['load_error']}")
    else:
        lines += [
            f"backend:   tensorrt {desc['tensorrt_version']} on {desc['device']}",
            f"precision: {desc['precision']}"
            + (f"  (layers: {desc['layer_precisions']})" if desc.get("layer_precisions") else ""),
            f"max batch: {desc['max_batch_size']}",
            f"layers:    {desc['num_layers']}",
        ]
        for title in ("inputs", "outputs"):
            lines.append(f"{title}:")
            for spec in desc[title]:
                shape = "[" + ", ".join(str(d) for d in spec["shape"]) + "]"
                lines.append(f"  {spec['name']}  {spec['dtype']}  {shape}")
        lines.append("profiles:")
        for index, profile in enumerate(desc["profiles"]):
            for name, rng in profile.items():
                lines.append(
                    f"  {index}: {name}  min {rng['min']}  opt {rng['opt']}  max {rng['max']}"
                )
    lines.append(f"sidecar:   {sidecar_path(Path(desc['plan'])).name}")
    if side:
        for key in (
            "tensorrt_version",
            "gpu_name",
            "compute_capability",
            "precision",
            "onnx_sha256",
            "built_at",
            "standin",
            "build_command",
        ):
            lines.append(f"  {key}: {side.get(key)}")
    elif desc.get("sidecar_error"):
        lines.append(f"  {desc['sidecar_error']}")
    return "\n".join(lines)

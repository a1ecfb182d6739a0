"""The metadata sidecar written next to every plan (``MODEL.plan.json``), and its check at load.

A serialized TensorRT plan runs only on the GPU model and TensorRT version it was built with.
The sidecar records both (plus precision, optimization profiles and the sha256 of the source
ONNX file) so that loading a plan elsewhere fails with an error that says how to rebuild, rather
than with TensorRT's deserialization error or, worse, slow kernels tuned for another GPU.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engines.exceptions import EngineLoadError, PlanMismatchError

__all__ = ["SIDECAR_FORMAT", "PlanMetadata", "sha256_file", "sidecar_path"]

#: Version of the sidecar's JSON layout.
SIDECAR_FORMAT = 1


def sidecar_path(plan_path: Path) -> Path:
    """``model.plan`` → ``model.plan.json``."""
    return plan_path.with_name(plan_path.name + ".json")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class PlanMetadata:
    """What ``engines build`` knew when it wrote a plan.

    Attributes:
        tensorrt_version: ``tensorrt.__version__`` of the builder, e.g. ``"10.13.0.35"``.
        gpu_name: e.g. ``"NVIDIA H200"``.
        compute_capability: e.g. ``"9.0"``.
        precision: ``"fp32"``, ``"fp16"``, ``"int8"`` or ``"int8+fp16"``.
        profiles: One dict per optimization profile: input name → ``{"min","opt","max"}`` shapes.
        onnx_sha256: sha256 of the source ONNX file.
        onnx_path: Where the ONNX file was at build time.
        plan_sha256: sha256 of the plan file.
        build_command: The ``engines build`` command line that rebuilds it.
        built_at: ISO 8601 UTC time of the build.
        standin: True when built by the TensorRT stand-in (not real TensorRT).
        extra: Anything else (workspace, timing cache, calibration).
    """

    tensorrt_version: str
    gpu_name: str
    compute_capability: str
    precision: str
    profiles: list[dict[str, dict[str, list[int]]]]
    onnx_sha256: str
    onnx_path: str
    plan_sha256: str
    build_command: str
    built_at: str
    standin: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    format: int = SIDECAR_FORMAT

    def write(self, plan_path: Path) -> Path:
        path = sidecar_path(plan_path)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, plan_path: Path) -> PlanMetadata:
        """Read the sidecar of ``plan_path``.

        Raises:
            EngineLoadError: It is missing or unreadable.
        """
        path = sidecar_path(plan_path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise EngineLoadError(
                f"plan {plan_path} has no metadata sidecar {path.name}; plans must come from "
                "'engines build MODEL.onnx -o PLAN' (which writes it)"
            ) from None
        except (OSError, ValueError) as exc:
            raise EngineLoadError(f"cannot read plan sidecar {path}: {exc}") from exc
        known = {f for f in cls.__dataclass_fields__}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as exc:
            raise EngineLoadError(f"plan sidecar {path} lacks fields: {exc}") from exc

    def check_runs_here(
        self, plan_path: Path, *, tensorrt_version: str, gpu_name: str, compute_capability: str
    ) -> None:
        """Refuse a plan built for another TensorRT version or GPU.

        Raises:
            PlanMismatchError: Versions or GPU differ; the message gives the rebuild command.
            EngineLoadError: The plan file changed since the sidecar was written.
        """
        problems = []
        if self.tensorrt_version != tensorrt_version:
            problems.append(
                f"TensorRT {self.tensorrt_version} built it, this machine runs TensorRT "
                f"{tensorrt_version}"
            )
        if self.gpu_name != gpu_name or self.compute_capability != compute_capability:
            problems.append(
                f"it was built for {self.gpu_name} (compute capability "
                f"{self.compute_capability}), this GPU is {gpu_name} (compute capability "
                f"{compute_capability})"
            )
        if problems:
            raise PlanMismatchError(
                f"plan {plan_path} cannot run here: {'; '.join(problems)}. Plans are specific to "
                f"the GPU model and TensorRT version; rebuild it on this machine: "
                f"{self.build_command}"
            )
        actual = sha256_file(plan_path)
        if actual != self.plan_sha256:
            raise EngineLoadError(
                f"plan {plan_path} does not match its sidecar (sha256 {actual[:12]} != "
                f"{self.plan_sha256[:12]}); rebuild it: {self.build_command}"
            )

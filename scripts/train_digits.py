"""Train the small ``digits`` CNN and write ``model.onnx`` + ``metadata.json``.

The model classifies scikit-learn's bundled handwritten digits
(``sklearn.datasets.load_digits()``: 1,797 grey-scale 8x8 images, pixel values 0..16,
from the UCI ML "optical recognition of handwritten digits" set). It is the tiny model that
``streamapp`` ships so that the whole pipeline can be run and tested without downloading
weights.

Usage::

    python scripts/train_digits.py [--seed 0] [--epochs 50] [--out-dir streamapp/models/digits]

Needs the ``train`` extra (``pip install -e '.[train]'``: torch, scikit-learn, onnx) plus
onnxruntime (a base dependency). Training runs on the CPU, single-threaded and with
``torch.use_deterministic_algorithms(True)``, so the same seed, epochs and library versions
give the same weights and the same ONNX bytes.

The export uses torch's TorchScript-based exporter (``torch.onnx.export(..., dynamo=False)``):
it is still present in torch 2.13 and writes opset 17 directly, whereas the default
torch.export-based exporter needs the extra ``onnxscript`` package and targets opset 18+
(opset 17 would be a down-conversion). If a future torch drops the legacy exporter, switch to
``dynamo=True`` and add ``onnxscript`` to the ``train`` extra.

Every accuracy written to ``metadata.json`` is re-computed from the exported ONNX file with
ONNX Runtime (CPU), not from the torch model, so the numbers describe exactly what is shipped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

MODEL_NAME = "digits"
MODEL_VERSION = "1"
OPSET = 17
TEST_FRACTION = 0.25
BATCH_SIZE = 64
LEARNING_RATE = 1e-3
# load_digits() pixel values are integers in [0, 16]; dividing by 16 maps them to [0, 1].
PIXEL_SCALE = 1.0 / 16.0
PIXEL_OFFSET = 0.0
MIN_TEST_ACCURACY = 0.97
INPUT_NAME = "input"
OUTPUT_NAME = "probs"
DESCRIPTION = (
    "Small CNN trained on scikit-learn's bundled handwritten digits (UCI ML optical "
    "recognition of handwritten digits; 1,797 8x8 images from 43 writers)."
)


class DigitsCNN(nn.Module):
    """conv(1->16)-ReLU-conv(16->32)-ReLU-maxpool2-linear(512->64)-ReLU-linear(64->10)-softmax.

    The softmax is part of the module so that the exported graph outputs probabilities.
    """

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Unnormalised class scores.

        Args:
            x: float32[batch, 1, 8, 8], pixels already scaled to [0, 1].

        Returns:
            float32[batch, 10].
        """
        return self.classifier(self.features(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class probabilities.

        Args:
            x: float32[batch, 1, 8, 8], pixels already scaled to [0, 1].

        Returns:
            float32[batch, 10], each row sums to 1.
        """
        return torch.softmax(self.logits(x), dim=1)


def preprocess(images: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """Apply the model's pre-processing contract to raw digit images.

    Args:
        images: any numeric dtype, [n, 8, 8], values 0..16.

    Returns:
        float32[n, 1, 8, 8] = images * 0.0625 + 0.0.
    """
    x = images.astype(np.float32) * np.float32(PIXEL_SCALE) + np.float32(PIXEL_OFFSET)
    return x[:, np.newaxis, :, :]


def make_deterministic(seed: int) -> None:
    """Seed torch and force single-threaded, deterministic CPU kernels."""
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)


def train(
    model: DigitsCNN,
    x_train: npt.NDArray[np.float32],
    y_train: npt.NDArray[np.int64],
    x_test: npt.NDArray[np.float32],
    y_test: npt.NDArray[np.int64],
    *,
    epochs: int,
    seed: int,
) -> None:
    """Train ``model`` in place with Adam and cross-entropy, printing one line per epoch.

    Args:
        model: the network to train.
        x_train: float32[n_train, 1, 8, 8], pre-processed.
        y_train: int64[n_train], labels 0..9.
        x_test: float32[n_test, 1, 8, 8], pre-processed; only used to report progress.
        y_test: int64[n_test].
        epochs: passes over the training set.
        seed: seeds the mini-batch shuffling.
    """
    xt = torch.from_numpy(x_train)
    yt = torch.from_numpy(y_train)
    xv = torch.from_numpy(x_test)
    yv = torch.from_numpy(y_test)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    loss_fn = nn.CrossEntropyLoss()
    shuffle = torch.Generator().manual_seed(seed)
    n = len(xt)
    for epoch in range(1, epochs + 1):
        model.train()
        total_loss = 0.0
        correct = 0
        for idx in torch.randperm(n, generator=shuffle).split(BATCH_SIZE):
            logits = model.logits(xt[idx])
            loss = loss_fn(logits, yt[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * len(idx)
            correct += int((logits.argmax(dim=1) == yt[idx]).sum())
        model.eval()
        with torch.no_grad():
            test_acc = float((model.logits(xv).argmax(dim=1) == yv).float().mean())
        print(
            f"epoch {epoch:3d}/{epochs}  loss {total_loss / n:.4f}  "
            f"train_acc {correct / n:.4f}  test_acc {test_acc:.4f}",
            flush=True,
        )


def export_onnx(model: DigitsCNN, path: Path) -> None:
    """Export ``model`` to one self-contained ONNX file (opset 17, dynamic batch).

    Args:
        model: the trained network; put in eval mode here.
        path: where to write the ``.onnx`` file (overwritten).
    """
    model.eval()
    example = torch.zeros(1, 1, 8, 8, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp) / "model.onnx"
        with warnings.catch_warnings():
            # torch 2.13 flags the TorchScript exporter as legacy; we choose it on purpose
            # (see the module docstring), so its deprecation notices are noise here.
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\..*")
            warnings.filterwarnings("ignore", message=r".*legacy TorchScript-based ONNX export.*")
            torch.onnx.export(
                model,
                (example,),
                str(tmp_path),
                dynamo=False,
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                opset_version=OPSET,
                dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
                do_constant_folding=True,
            )
        # Load (pulling in any external-data files) and re-save as a single file.
        proto = onnx.load(str(tmp_path), load_external_data=True)
    onnx.checker.check_model(proto, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(proto, str(path), save_as_external_data=False)


def onnx_predict(
    session: ort.InferenceSession, x: npt.NDArray[np.float32]
) -> npt.NDArray[np.int64]:
    """Argmax class of each image according to the ONNX model.

    Args:
        session: an ONNX Runtime session on the exported model.
        x: float32[n, 1, 8, 8], pre-processed.

    Returns:
        int64[n], predicted labels 0..9.
    """
    (probs,) = session.run([OUTPUT_NAME], {INPUT_NAME: x})
    return np.asarray(probs).argmax(axis=1).astype(np.int64)


def sha256_of(path: Path) -> str:
    """Hex sha256 of the file at ``path``."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _to_json(value: Any, indent: int = 0) -> str:
    """JSON text with objects indented and every list of scalars kept on one line."""
    pad = "  " * (indent + 1)
    if isinstance(value, dict) and value:
        items = [f"{pad}{json.dumps(k)}: {_to_json(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * indent + "}"
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        items = [f"{pad}{_to_json(v, indent + 1)}" for v in value]
        return "[\n" + ",\n".join(items) + "\n" + "  " * indent + "]"
    return json.dumps(value, ensure_ascii=False)


def _sample_indices(
    test_idx: npt.NDArray[np.int64], labels: npt.NDArray[np.int64],
    predicted: npt.NDArray[np.int64], classes: int = 3,
) -> list[int]:
    """The first held-out image of each of classes ``0..classes-1`` that ``predicted`` gets
    right: the samples a new version of the model is checked against."""
    chosen: dict[int, int] = {}
    for i in test_idx:
        label = int(labels[i])
        if label < classes and label not in chosen and predicted[i] == label:
            chosen[label] = int(i)
    return [chosen[c] for c in sorted(chosen)]


def write_metadata(path: Path, metadata: dict[str, Any]) -> None:
    """Write ``metadata`` as indented JSON (lists such as ``test_indices`` on one line)."""
    text = _to_json(metadata)
    if json.loads(text) != metadata:  # the formatter must never change a value
        raise AssertionError("metadata JSON formatting changed a value")
    path.write_text(text + "\n", encoding="utf-8")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="seed for split, init and shuffling")
    parser.add_argument("--epochs", type=int, default=50, help="training epochs (default 50)")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("streamapp/models/digits"),
        help="folder for model.onnx and metadata.json (default streamapp/models/digits)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Train, export, verify with ONNX Runtime and write the metadata.

    Returns:
        0 on success, 1 when the held-out accuracy of the ONNX model is below 0.97.
    """
    args = parse_args(argv)
    if args.epochs < 1:
        raise SystemExit(f"--epochs must be >= 1, got {args.epochs}")
    make_deterministic(args.seed)

    digits = load_digits()
    images: npt.NDArray[np.float64] = digits.images
    labels = digits.target.astype(np.int64)
    n_images = len(images)
    train_idx, test_idx = train_test_split(
        np.arange(n_images),
        test_size=TEST_FRACTION,
        random_state=args.seed,
        stratify=labels,
    )
    train_idx = np.sort(train_idx)
    test_idx = np.sort(test_idx)
    x_all = preprocess(images)
    print(
        f"load_digits: {n_images} images, train {len(train_idx)}, test {len(test_idx)}, "
        f"seed {args.seed}, torch {torch.__version__}",
        flush=True,
    )

    model = DigitsCNN()
    train(
        model,
        x_all[train_idx],
        labels[train_idx],
        x_all[test_idx],
        labels[test_idx],
        epochs=args.epochs,
        seed=args.seed,
    )

    out_dir: Path = args.out_dir
    model_path = out_dir / "model.onnx"
    export_onnx(model, model_path)

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        str(model_path), sess_options=options, providers=["CPUExecutionProvider"]
    )
    predicted = onnx_predict(session, x_all)
    correct = predicted == labels
    train_acc = float(correct[train_idx].mean())
    test_acc = float(correct[test_idx].mean())
    all_acc = float(correct.mean())

    metadata: dict[str, Any] = {
        "name": MODEL_NAME,
        "version": MODEL_VERSION,
        "task": "classification",
        "description": DESCRIPTION,
        "labels": [str(i) for i in range(10)],
        "input": {"name": INPUT_NAME, "dtype": "float32", "shape": [-1, 1, 8, 8]},
        "output": {
            "name": OUTPUT_NAME,
            "dtype": "float32",
            "shape": [-1, 10],
            "kind": "probabilities",
        },
        "request": {"shape": [8, 8], "dtypes": ["uint8", "float32"], "value_range": [0.0, 16.0]},
        "preprocessing": {"scale": PIXEL_SCALE, "offset": PIXEL_OFFSET},
        # What `streamapp models load` checks a version against before it serves (the first
        # test images of each of three classes that the exported model answers correctly).
        "samples": [
            {"tensor": images[i].astype(int).tolist(), "dtype": "uint8", "label": str(labels[i])}
            for i in _sample_indices(test_idx, labels, predicted)
        ],
        "onnx_sha256": sha256_of(model_path),
        "training": {
            "dataset": "sklearn.datasets.load_digits",
            "n_images": n_images,
            "seed": args.seed,
            "test_fraction": TEST_FRACTION,
            "epochs": args.epochs,
            "torch_version": torch.__version__,
            "onnx_opset": OPSET,
            "train_accuracy": train_acc,
            "test_accuracy": test_acc,
            "all_accuracy": all_acc,
            "test_indices": [int(i) for i in test_idx],
        },
    }
    write_metadata(out_dir / "metadata.json", metadata)
    print(
        f"onnx (onnxruntime {ort.__version__}): train_accuracy {train_acc:.4f}  "
        f"test_accuracy {test_acc:.4f}  all_accuracy {all_acc:.4f}",
        flush=True,
    )
    print(
        f"wrote {model_path} ({model_path.stat().st_size} bytes, "
        f"sha256 {metadata['onnx_sha256']}) and {out_dir / 'metadata.json'}",
        flush=True,
    )
    if test_acc < MIN_TEST_ACCURACY:
        print(
            f"error: held-out accuracy {test_acc:.4f} is below {MIN_TEST_ACCURACY}; "
            "try more --epochs or another --seed",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

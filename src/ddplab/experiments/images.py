"""Image classification data for alignment_stats: scikit-learn's bundled 8x8 digits by default
(offline), or MNIST from a local file (`data.path`: an .npz with x_train/y_train/x_test/y_test, or
a folder with the four IDX files, gzipped or not)."""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ..errors import DdplabError

IDX_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}


def load_images(path: str, seed: int) -> tuple[TensorDataset, TensorDataset, int, int]:
    """(train, test, side, classes); images flattened to float32 in [0, 1], standardised per pixel
    with the training set's statistics."""
    if not path:
        arrays = _digits(seed)
    elif path.endswith(".npz"):
        arrays = _npz(path)
    elif os.path.isdir(path):
        arrays = {key: _read_idx(_find(path, name)) for key, name in IDX_FILES.items()}
    else:
        raise DdplabError(
            f"data.path {path} is neither an .npz file nor a folder of MNIST IDX files",
            "pass an .npz with x_train/y_train/x_test/y_test, a folder with the IDX files, or nothing",
        )
    x_train, x_test = (arrays[k].reshape(len(arrays[k]), -1).astype(np.float32) for k in ("x_train", "x_test"))
    scale = max(float(x_train.max()), 1.0)
    x_train = x_train / scale
    x_test = x_test / scale
    mean = x_train.mean(0)
    std = x_train.std(0) + 1e-3
    x_train = (x_train - mean) / std
    x_test = (x_test - mean) / std
    side = round(x_train.shape[1] ** 0.5)
    classes = int(max(arrays["y_train"].max(), arrays["y_test"].max())) + 1
    train = TensorDataset(torch.from_numpy(x_train), torch.from_numpy(arrays["y_train"].astype(np.int64)))
    test = TensorDataset(torch.from_numpy(x_test), torch.from_numpy(arrays["y_test"].astype(np.int64)))
    return train, test, side, classes


def _digits(seed: int) -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


def _npz(path: str) -> dict[str, np.ndarray]:
    if not os.path.isfile(path):
        raise DdplabError(f"data file {path} does not exist", "check data.path")
    with np.load(path) as f:
        missing = [k for k in IDX_FILES if k not in f]
        if missing:
            raise DdplabError(f"{path} lacks the arrays {missing}", "save x_train, y_train, x_test, y_test in it")
        return {k: f[k] for k in IDX_FILES}


def _find(folder: str, name: str) -> str:
    for candidate in (name, name + ".gz", name.replace("-idx", ".idx"), name.replace("-idx", ".idx") + ".gz"):
        if os.path.isfile(os.path.join(folder, candidate)):
            return os.path.join(folder, candidate)
    raise DdplabError(f"{folder} has no {name}[.gz]", "put the four MNIST IDX files in that folder")


def _read_idx(path: str) -> np.ndarray:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype, dims = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise DdplabError(f"{path} is not an unsigned-byte IDX file", "use the original MNIST files")
    shape = struct.unpack(">" + "I" * dims, data[4 : 4 + 4 * dims])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)

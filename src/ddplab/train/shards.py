"""Data bigger than memory: webdataset tar shards read by position, so train/data.py's global order holds
(the same batches and an O(1) resume at any world size). A sample is the files of a tar sharing a key
(`000000042.x.pth`, `000000042.cls`); an index (the wids shard-index JSON: each shard's samples and bytes)
makes the shards a Dataset of known length, sample i a seek into its shard. docs/data.md says why."""

import io
import json
import os
import socket
import tarfile
from bisect import bisect_right
from collections.abc import Callable, Iterable

import torch
from torch.utils.data import Dataset

from ..errors import ConfigError
from .data import CollateError

# the index ddplab writes and reads (the webdataset project's wids format)
FORMAT = "wids-shard-index-v1"
# loading these runs code: never by default
PICKLED = {"pyd", "pickle", "pkl"}


class ShardError(CollateError):
    """One line, also when raised in a DataLoader worker (see CollateError)."""


def write_shards(samples: Iterable[dict], folder: str, samples_per_shard: int = 10_000) -> str:
    """Write samples (dicts of field -> value, named by extension: {'x.pth': tensor, 'cls': 3, 'txt': 'hi'})
    into tar shards of `folder` and index them; returns the index's path (a dataset is whole once it exists)."""
    from webdataset import ShardWriter

    os.makedirs(folder, exist_ok=True)
    with ShardWriter(os.path.join(folder, "shard-%06d.tar"), maxcount=samples_per_shard, verbose=0, mtime=0) as out:
        for i, sample in enumerate(samples):
            # a tensor view would save its whole storage: clone
            out.write({"__key__": f"{i:09d}", **{k: v.clone() if torch.is_tensor(v) else v for k, v in sample.items()}})
    shards = sorted(f for f in os.listdir(folder) if f.startswith("shard-") and f.endswith(".tar"))
    return index_shards([os.path.join(folder, f) for f in shards], os.path.join(folder, "index.json"))


def index_shards(shards: list[str], index: str) -> str:
    """Index webdataset tar shards (in this order): beside each, where its samples lie (`.members.json`, so a
    process never reads every tar header); then the index, with each shard's samples and bytes."""
    listing = []
    for s in shards:
        with open(s + ".members.json", "w") as f:
            json.dump(members := _members(s, fresh=True), f)
        listing.append(
            {
                "url": os.path.relpath(s, os.path.dirname(os.path.abspath(index))),
                "nsamples": len(members),
                "filesize": os.path.getsize(s),
            }
        )
    with open(index + ".tmp", "w") as f:
        json.dump({"__kind__": FORMAT, "wids_version": 1, "shardlist": listing}, f, indent=1)
    os.replace(index + ".tmp", index)
    return index


class ShardedDataset(Dataset):
    """The samples of an index's shards, by position: `decode` turns a sample's {field: bytes} into values (default:
    decode_fields), `transform` those into what training gets (default: the dict, e.g. {'x.pth': t, 'cls': 3})."""

    def __init__(self, index: str, transform: Callable[[dict], object] | None = None, decode: Callable | None = None):
        self.shards = _read_index(index)
        self.transform = transform
        self.decode = decode or decode_fields
        self._open = {}
        self.ends = torch.tensor([s["nsamples"] for s in self.shards]).cumsum(0).tolist()

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, i: int):
        s = bisect_right(self.ends, i)
        fd, members = self._shard(s)
        raw = {
            name: os.pread(fd, size, offset)
            for name, (offset, size) in members[i - self.ends[s] + len(members)].items()
        }
        try:
            sample = self.decode(raw)
        except Exception as e:
            # the default decoder on bytes that are not what their extension says
            if self.decode is not decode_fields or isinstance(e, ShardError):
                raise
            raise ShardError(
                f"shard {self.shards[s]['path']} is corrupt: sample {i} cannot be decoded ({e!s:.80}); "
                "write it again, or copy it again"
            ) from None
        return self.transform(sample) if self.transform else sample

    def __getstate__(self):
        # a spawned DataLoader worker opens the shards itself
        return {**self.__dict__, "_open": {}}

    def _shard(self, s: int) -> tuple[int, list[dict]]:
        """Shard s open, and where its samples' files lie (`.members.json`, else its tar headers), once per process."""
        if s not in self._open:
            path = self.shards[s]["path"]
            members = _members(self.shards[s]["path"])
            _check(path, "samples", len(members), self.shards[s]["nsamples"], ShardError)
            self._open[s] = os.open(path, os.O_RDONLY), members
        return self._open[s]


def decode_fields(sample: dict[str, bytes]) -> dict:
    """Each field by its extension as webdataset does (cls: int, txt, json, npy), but .pth loads tensors only
    (weights_only) and pickled fields are refused: loading them would run code from the data."""
    from webdataset.autodecode import basichandlers

    out = {}
    for field, data in sample.items():
        ext = field.rsplit(".", 1)[-1]
        if ext in PICKLED:
            raise ShardError(
                f"field {field!r} is pickled, and ddplab does not unpickle data by default (it runs "
                "code); store tensors as .pth, or pass ShardedDataset(index, decode=your_function)"
            )
        value = torch.load(io.BytesIO(data), weights_only=True) if ext == "pth" else basichandlers("." + field, data)
        out[field] = data if value is None else value
    return out


def _members(path: str, fresh: bool = False) -> list[dict[str, tuple[int, int]]]:
    """Each sample of a tar as {field: (offset, size)}, in tar order: from the `.members.json` beside it, or
    (`fresh`, or none there) from its tar headers, where the files of one key are one sample."""
    if not fresh and os.path.isfile(path + ".members.json"):
        with open(path + ".members.json") as f:
            return json.load(f)
    samples: dict[str, dict] = {}
    try:
        with tarfile.open(path, "r:") as tar:
            for m in tar:
                if m.isfile() and "." in (base := os.path.basename(m.name)):
                    key, field = base.split(".", 1)
                    samples.setdefault(os.path.join(os.path.dirname(m.name), key), {})[field] = (m.offset_data, m.size)
    except (tarfile.TarError, OSError) as e:
        raise ShardError(f"shard {path} is corrupt or unreadable ({e}); write it again, or copy it again") from None
    return list(samples.values())


def _check(path: str, what: str, found: int, indexed: int, error=ConfigError) -> None:
    if found != indexed:
        raise error(
            f"shard {path} is corrupt: {found} {what}, its index says {indexed}; write it again, or copy it "
            "again from its source"
        )


def _read_index(index: str) -> list[dict]:
    """The index's shards with their paths, each checked to be here at its indexed size (on this node)."""
    try:
        with open(index) as f:
            spec = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"cannot read the shard index {index} ({e})", "pass the index.json that write_shards wrote"
        ) from None
    if (kind := spec.get("__kind__") if isinstance(spec, dict) else None) != FORMAT:
        raise ConfigError(
            f"shard index {index} is format {kind!r}, which ddplab cannot read (it reads {FORMAT})",
            "write it with ddplab.write_shards, or index webdataset tars with ddplab.index_shards",
        )
    shards = [{**s, "path": os.path.join(os.path.dirname(os.path.abspath(index)), s["url"])} for s in spec["shardlist"]]
    missing = [s["path"] for s in shards if not os.path.isfile(s["path"])]
    if missing:
        raise ConfigError(
            f"{len(missing)} of {len(shards)} shards of {index} are missing on node "
            f"{socket.gethostname()}, e.g. {missing[0]}",
            "copy the whole dataset to every node",
        )
    for s in shards:
        _check(s["path"], "bytes", os.path.getsize(s["path"]), s.get("filesize", os.path.getsize(s["path"])))
    return shards

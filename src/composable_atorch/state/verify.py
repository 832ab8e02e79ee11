"""A checkpoint directory is data from disk: checksummed, schema-checked, never unpickled freely.

What ``save_state`` seals and ``load_state`` checks before touching the model:

* ``checkpoint.json`` lists every other file with its size and blake2b digest, and carries the
  digest of its own canonical JSON: a flipped bit anywhere (a weight, the step number, DCP's
  ``.metadata``) or a truncated shard is a :class:`~composable_atorch.errors.CheckpointError`
  naming the file, before anything is loaded;
* ``checkpoint.json`` and ``rank-N.json`` are validated field by field (type and range);
* DCP's ``.metadata`` is a pickle: it is read by :class:`MetadataUnpickler`, which builds only
  DCP's own metadata dataclasses, ``torch.Size``, dtypes, layouts and paths, so a crafted file
  cannot name a function to run; the byte items of the shards (hyperparameters DCP stores with
  ``torch.save``) are read with ``torch.load(weights_only=True)`` instead of DCP's default
  ``weights_only=False``.

The checksums guard against damage (disks, copies, interrupted transfers), not against someone
who rewrites the manifest as well; what keeps a crafted directory from running code is that
nothing in it is unpickled beyond plain data.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import stat
from pathlib import Path
from typing import Any

import torch

from composable_atorch.core import untrusted
from composable_atorch.errors import CheckpointError, CompositionError

FILES = "files"
CHECKSUM = "checksum"
_NAME = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.\-]{0,120}")
_HEX = re.compile(r"[0-9a-f]{32}")
#: checkpoint.json holds the user's ``extra`` and the LR scheduler state: small, but not tiny
MAX_META_BYTES = 64 * 1024 * 1024


def _blake2b() -> Any:
    return hashlib.blake2b(digest_size=16)


def file_digest(path: Path) -> tuple[int, str]:
    """(size, blake2b hex) of a regular file, read in 1 MiB blocks."""
    h, size = _blake2b(), 0
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(path, "not a regular file")
        while block := os.read(fd, 1 << 20):
            h.update(block)
            size += len(block)
    finally:
        os.close(fd)
    return size, h.hexdigest()


def manifest(directory: Path, skip: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Every file of a written checkpoint (but ``skip``) with its size and digest."""
    out = {}
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name in skip:
            continue
        size, digest = file_digest(Path(entry.path))
        out[entry.name] = {"bytes": size, "blake2b": digest}
    return out


def _canonical(meta: dict[str, Any]) -> bytes:
    body = {k: v for k, v in meta.items() if k != CHECKSUM}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def seal(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with the digest of its own canonical JSON (a flipped digit in the step is caught)."""
    h = _blake2b()
    h.update(_canonical(meta))
    return {**meta, CHECKSUM: h.hexdigest()}


def read_json_file(path: Path, limit: int = MAX_META_BYTES) -> Any:
    """A JSON file of a checkpoint, typed errors naming it (regular file, size and nesting bounded)."""
    try:
        raw = untrusted.read_regular_file(path, f"checkpoint file {path}", limit=limit)
        return untrusted.loads(raw.decode("utf-8"), f"checkpoint file {path}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"not valid JSON ({exc})") from None
    except CompositionError as exc:
        raise CheckpointError(path, str(exc)) from None


# -- schema ------------------------------------------------------------------------------------------
def _int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check(ok: bool, path: Path, field: str, want: str) -> None:
    if not ok:
        raise CheckpointError(path, f"field {field!r} is not {want}")


def read_meta(path: Path, format_: str, version: int) -> dict[str, Any]:
    """checkpoint.json, its own checksum verified, every field typed and ranged."""
    meta = read_json_file(path)
    _check(isinstance(meta, dict), path, "(top level)", "a JSON object")
    _check(meta.get("format") == format_, path, "format", repr(format_))
    if meta.get("version") != version:
        raise CheckpointError(
            path,
            f"version {meta.get('version')!r}, this composable_atorch reads version {version}",
            "save it again with this version (older checkpoints carry no checksums)",
        )
    _check(isinstance(meta.get(CHECKSUM), str) and bool(_HEX.fullmatch(meta[CHECKSUM])), path, CHECKSUM, "a digest")
    if seal(meta)[CHECKSUM] != meta[CHECKSUM]:
        raise CheckpointError(path, "its checksum does not match its contents (the file is damaged)")
    _check(_int(meta.get("step"), 0), path, "step", "an integer >= 0")
    _check(_int(meta.get("world_size"), 1), path, "world_size", "an integer >= 1")
    _check(_int(meta.get("micro_step"), 0), path, "micro_step", "an integer >= 0")
    _check(isinstance(meta.get("extra"), dict), path, "extra", "an object")
    _check(isinstance(meta.get("loader"), bool), path, "loader", "true or false")
    _check(meta.get("scheduler") is None or isinstance(meta["scheduler"], dict), path, "scheduler", "null or an object")
    opt = meta.get("optimizer")
    if opt is not None:
        _check(isinstance(opt, dict), path, "optimizer", "null or an object")
        _check(isinstance(opt.get("class"), str), path, "optimizer.class", "a string")
        sizes, hooks = opt.get("group_sizes"), opt.get("hooks")
        _check(isinstance(sizes, list) and all(_int(s, 0) for s in sizes), path, "optimizer.group_sizes", "counts")
        _check(isinstance(hooks, list) and all(isinstance(h, str) for h in hooks), path, "optimizer.hooks", "names")
        _check(isinstance(opt.get("has_state"), bool), path, "optimizer.has_state", "true or false")
    files = meta.get(FILES)
    _check(isinstance(files, dict) and bool(files), path, FILES, "an object naming the checkpoint's files")
    for name, entry in files.items():
        _check(bool(_NAME.fullmatch(name)) and name not in (".", ".."), path, f"files[{name!r}]", "a plain file name")
        _check(
            isinstance(entry, dict)
            and _int(entry.get("bytes"), 0)
            and isinstance(entry.get("blake2b"), str)
            and bool(_HEX.fullmatch(entry["blake2b"])),
            path,
            f"files[{name!r}]",
            "{'bytes': n, 'blake2b': digest}",
        )
    return meta


def read_rank_state(path: Path) -> dict[str, Any]:
    """rank-N.json (its bytes already verified against the manifest), fields typed."""
    state = read_json_file(path)
    _check(isinstance(state, dict), path, "(top level)", "a JSON object")
    _check(_int(state.get("micro_step"), 0), path, "micro_step", "an integer >= 0")
    _check(isinstance(state.get("hooks"), list), path, "hooks", "a list")
    _check(state.get("loader") is None or isinstance(state["loader"], dict), path, "loader", "null or an object")
    _check(isinstance(state.get("rng"), dict), path, "rng", "an object")
    return state


def verify_files(directory: Path, files: dict[str, dict[str, Any]]) -> None:
    """Every listed file present, of its size, with its digest; CheckpointError naming the first that is not."""
    for name, entry in files.items():
        path = directory / name
        try:
            kind = os.stat(path).st_mode
        except OSError:
            raise CheckpointError(path, "missing (the checkpoint is incomplete)") from None
        if not stat.S_ISREG(kind):
            raise CheckpointError(path, "not a regular file")
        size, digest = file_digest(path)
        if size != entry["bytes"]:
            raise CheckpointError(path, f"{size} bytes where {entry['bytes']} were written (truncated or extended)")
        if digest != entry["blake2b"]:
            raise CheckpointError(path, "its checksum differs from the one written at save (the file is damaged)")


def looks_complete(directory: Path, meta_name: str, format_: str, version: int) -> dict[str, Any] | None:
    """checkpoint.json valid and every listed file present with its size (no hashing): or None."""
    try:
        meta = read_meta(directory / meta_name, format_, version)
    except CheckpointError:
        return None
    for name, entry in meta[FILES].items():
        try:
            info = os.stat(directory / name)
        except OSError:
            return None
        if not stat.S_ISREG(info.st_mode) or info.st_size != entry["bytes"]:
            return None
    return meta


# -- DCP's metadata, read without running code ----------------------------------------------------
def _allowed_globals() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem, metadata

    table: dict[tuple[str, str], Any] = {
        (metadata.__name__, name): getattr(metadata, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    table[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    table[("torch", "Size")] = torch.Size
    table[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    table[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        table[("pathlib", cls)] = getattr(__import__("pathlib"), cls)
    return table


class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses and torch basics only; any other global is refused."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path, self.table = path, _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.table:
            return self.table[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            self.path,
            f"its pickle names {module}.{name}, which DCP metadata never holds (a crafted file?); nothing was run",
        )


def read_metadata(path: Path, files: dict[str, dict[str, Any]]):
    """DCP's Metadata from ``path`` (already checksummed), unpickled with the allow-list and checked."""
    from torch.distributed.checkpoint import filesystem, metadata

    raw = untrusted.read_regular_file(path, f"checkpoint file {path}", limit=MAX_META_BYTES)
    try:
        meta = MetadataUnpickler(io.BytesIO(raw), path).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a damaged pickle raises many kinds; all mean the same thing here
        raise CheckpointError(path, f"not readable DCP metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, metadata.Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise CheckpointError(path, "not DCP metadata")
    kinds = (metadata.TensorStorageMetadata, metadata.BytesStorageMetadata)
    if not all(isinstance(k, str) and isinstance(v, kinds) for k, v in meta.state_dict_metadata.items()):
        raise CheckpointError(path, "an entry that is not DCP tensor or bytes metadata")
    storage = meta.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(path, "no storage table")
    for index, info in storage.items():
        ok = (
            isinstance(index, metadata.MetadataIndex)
            and isinstance(info, filesystem._StorageInfo)
            and info.relative_path in files
            and _int(info.offset, 0)
            and _int(info.length, 0)
            and info.offset + info.length <= files[info.relative_path]["bytes"]
            and not info.transform_descriptors
        )
        if not ok:
            raise CheckpointError(path, f"a storage entry outside the checkpoint's files ({index!r})")
    return meta


def safe_reader(directory: Path, files: dict[str, dict[str, Any]]):
    """DCP's FileSystemReader whose metadata comes from :func:`read_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class VerifiedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            meta = read_metadata(directory / ".metadata", files)
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return VerifiedReader(directory)


def safe_planner():
    """DCP's default load planner reading byte items as plain data (``weights_only=True``)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return WeightsOnlyPlanner()

"""Checkpoint files checked without running code: torch distributed checkpoint and engines load with a plain
unpickler, so every pickle is first unpickled here under an allow-list of the classes its format needs."""

import io
import pickle
import re
from pathlib import Path

import torch

from fabric_utils.errors import UserError, first_line
from fabric_utils.strategy import pickled_classes

# not read as pickles (the RNG files: each rank checks its own, to name itself)
UNCHECKED = re.compile(r"(.*\.json|latest|zero_to_(fp32|torch)\.py|rng-rank\d+\.pt)$")
DCP_METADATA, DCP_DATA = ".metadata", ".distcp"


def _dcp_classes() -> list:
    """What torch distributed checkpoint's ``.metadata`` holds."""
    from torch.distributed.checkpoint import filesystem, metadata

    return [metadata.Metadata, metadata.MetadataIndex, metadata.StorageMeta, metadata.TensorProperties,
            metadata.TensorStorageMetadata, metadata.BytesStorageMetadata, metadata.ChunkStorageMetadata,
            metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo, torch.Size, torch.serialization._get_layout,
            Path, type(Path())]


class _Restricted(pickle._Unpickler):  # the pure-Python unpickler, whose opcodes can be overridden
    """The standard library's way to unpickle untrusted bytes: ``find_class`` resolves only allowed names; and it
    builds without mutating: BUILD sets plain attributes only on an object this unpickling made (NEWOBJ), never on a
    class, a function or any object shared with the running process."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, classes: list):
        super().__init__(file)
        self.classes = {f"{c.__module__}.{c.__qualname__}": c for c in classes}
        self.made = {}  # id -> each object NEWOBJ made, kept alive so that no other object takes its id

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (found := self.classes.get(f"{module}.{name}")) is not None:
            return found
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not allowed")

    def load_newobj(self):
        pickle._Unpickler.load_newobj(self)
        self.made[id(self.stack[-1])] = self.stack[-1]

    def load_newobj_ex(self):
        pickle._Unpickler.load_newobj_ex(self)
        self.made[id(self.stack[-1])] = self.stack[-1]

    def load_build(self):
        state, target = self.stack[-1], self.stack[-2]
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
        plain = hasattr(target, "__setstate__") or all(  # the former: the allowed class's own way to take its state
            part is None or isinstance(part, dict) and all(isinstance(key, str) and not key.startswith("__")
                                                           for key in part) for part in parts)
        if id(target) not in self.made or not plain:
            raise pickle.UnpicklingError(f"BUILD on a {type(target).__name__} it did not make (or with a state "
                                         f"that is not plain attributes) is not allowed")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build


def _refuse(path: Path, err: Exception) -> UserError:
    if found := re.search(r"GLOBAL ([\w.]+)", str(err)):
        return UserError(f"refusing checkpoint file {path}: it needs {found.group(1)}, which no checkpoint of train.py "
                         f"holds (loading it could run code); pass another --resume or start a new --out-dir")
    return UserError(f"cannot restore checkpoint {path.parent}: its {path.name} is damaged or was not written by "
                     f"train.py ({first_line(err)[:200]}); pass another --resume or start a new --out-dir")


def load_torch_file(path: Path, data: bytes | None = None, classes: tuple = ()):
    """``path`` (or ``data``, a value in it) loaded under ``weights_only``, with ``classes`` allowed beside torch's."""
    with torch.serialization.safe_globals(list(classes)):
        try:
            return torch.load(io.BytesIO(data) if data is not None else path, map_location="cpu", weights_only=True,
                              mmap=data is None)
        except Exception as err:
            raise _refuse(path, err) from err


def check_dcp_metadata(path: Path):
    """A distributed checkpoint's ``.metadata``: every file it points at lies in its folder (which the manifest
    covers); then each non-tensor value it points to."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    try:
        with open(path, "rb") as f:
            metadata = _Restricted(f, _dcp_classes()).load()
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not torch's checkpoint Metadata")
        storage = metadata.storage_data
        values = [index for index in storage
                  if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata)]
    except Exception as err:
        raise _refuse(path, err) from err
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if (not isinstance(info, _StorageInfo) or not isinstance(name, str) or "/" in name or "\0" in name
                or not name.endswith(DCP_DATA) or info.transform_descriptors
                or not all(type(n) is int and n >= 0 for n in (info.offset, info.length))):
            raise UserError(f"refusing checkpoint file {path}: it points outside its folder, at transformed data or "
                            f"at no {DCP_DATA} file ({str(name)[:100]!r}), which no checkpoint of train.py does; pass "
                            f"another --resume or start a new --out-dir")
    for index in values:
        info = storage[index]
        data_file = path.parent / info.relative_path
        try:
            with open(data_file, "rb") as f:
                f.seek(info.offset)
                value = f.read(info.length)
        except OSError as err:
            raise _refuse(data_file, err) from err
        load_torch_file(data_file, value)


def refusal(folder: Path) -> str | None:
    """Why checkpoint ``folder`` cannot be loaded without running code (one line naming the file and the class that
    is not allowed), or None."""
    try:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            if UNCHECKED.match(path.name) or path.suffix == DCP_DATA:  # checked through .metadata
                continue
            if path.name == DCP_METADATA:
                check_dcp_metadata(path)
            else:
                load_torch_file(path, classes=pickled_classes(path.name))
    except UserError as err:
        return str(err)
    return None

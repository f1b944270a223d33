"""Read one stage's tensors from a Hugging Face safetensors checkpoint, and only those.

A directory holds ``model.safetensors``, or shards with ``model.safetensors.index.json``
(``weight_map``: tensor name -> shard file). :class:`CheckpointReader` opens each shard a stage
needs with ``safe_open`` and reads the named tensors one at a time, so a stage holding layers
``[a, b)`` reads those layers' tensors (plus the embedding on the first stage, the final norm
and ``lm_head`` on the last) and no other: ``bytes_read`` counts the tensor bytes it read.

A shard must be a regular file inside the directory: an index entry that is absolute, or a
path or symlink resolving outside it, is refused (the one exception is the Hugging Face hub
cache, where ``snapshots/<rev>/x`` links to ``../../blobs/<hash>`` of the same repository).
A file the safetensors library cannot read (truncated, a lying header) is one ValueError
naming the file.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePath
from typing import Any

import torch

from wavepp.runtime.hf_config import read_json_file

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_LAYER = re.compile(r"^model\.layers\.(\d{1,9})\.")  # no 5000-digit int()
# NOTE: DeepSeek-V3's index (~92k tensors) is ~9 MB; read at call time, so a test may lower it.
MAX_INDEX_BYTES = 64 << 20


def _inside(path: Path, root: Path) -> bool:
    """Whether ``path`` (resolved) is inside ``root`` (resolved), or in the hub cache's blobs
    of the same repository when ``root`` is ``.../snapshots/<rev>``."""
    if path.is_relative_to(root):
        return True
    return root.parent.name == "snapshots" and path.is_relative_to(root.parent.parent / "blobs")


class CheckpointReader:
    """The tensor names of a checkpoint directory and a per-tensor reader.

    Attributes:
        root: the directory.
        weight_map: tensor name -> file name (inside ``root``).
        bytes_read: tensor bytes read so far (sum of numel * element size).
        files_opened: shard files opened so far.
    """

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        """Index the directory's safetensors files.

        Raises:
            ValueError: no index and no ``model.safetensors`` / ``*.safetensors``; an index
                that is not a regular JSON file of at most :data:`MAX_INDEX_BYTES`; an index
                entry naming a shard that is absent, not a regular file, absolute or outside
                the directory (names the entry); a shard safetensors cannot read (names it).
        """
        self.root = Path(model_dir)
        self.bytes_read = 0
        self.files_opened: set[str] = set()
        self._handles: dict[str, Any] = {}
        self._paths: dict[str, Path] = {}
        index = self.root / _INDEX
        if os.path.lexists(index):
            data, _ = read_json_file(index, max_bytes=MAX_INDEX_BYTES)
            raw = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(raw, dict) or not raw:
                raise ValueError(f"{index}: 'weight_map' must be a non-empty object")
            for key, value in raw.items():
                if not isinstance(value, str) or not value:
                    raise ValueError(
                        f"{index}: weight_map[{key!r}] must be a shard file name, not {value!r}"
                    )
            self.weight_map: dict[str, str] = dict(raw)
            entries = {file: name for name, file in reversed(raw.items())}  # first per file
            missing = []
            for file in sorted(entries):
                if self._shard_path(file, f"{index}: weight_map[{entries[file]!r}]") is None:
                    missing.append(file)
            if missing:
                raise ValueError(f"{index} names shards that are absent: {missing[:3]}")
            return
        files = [self.root / _SINGLE] if os.path.lexists(self.root / _SINGLE) else []
        files = files or sorted(self.root.glob("*.safetensors"))
        if not files:
            raise ValueError(
                f"model_dir={str(self.root)!r} holds no {_INDEX} and no *.safetensors file"
            )
        self.weight_map = {}
        for file in files:
            if self._shard_path(file.name, f"{self.root}: shard") is None:
                raise ValueError(f"{file}: cannot be read (a dangling link?)")
            with self._open(file.name) as f:
                for key in f.keys():
                    self.weight_map[key] = file.name

    def _shard_path(self, file: str, where: str) -> Path | None:
        """The resolved path of shard ``file`` (recorded for :meth:`_open`); None: absent.

        Raises:
            ValueError: ``file`` is absolute or leaves the directory (also through a symlink),
                or is not a regular file (names ``where``).
        """
        pure = PurePath(file)
        if pure.is_absolute() or ".." in pure.parts:
            raise ValueError(f"{where}={file!r}: a shard must be a file inside {self.root}")
        root = self.root.resolve()
        path = (self.root / file).resolve()
        if not _inside(path, root):
            raise ValueError(
                f"{where}={file!r} resolves to {path}, outside {root}; a shard must be a file "
                "inside the model directory"
            )
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return None
        if not stat.S_ISREG(mode):
            raise ValueError(f"{where}={file!r}: {path} is not a regular file")
        self._paths[file] = path
        return path

    @contextmanager
    def _open(self, file: str) -> Iterator[Any]:
        """``safe_open`` of shard ``file``; the library's errors (truncated file, bad header,
        unreadable tensor) become one ValueError naming the file."""
        from safetensors import safe_open

        path = self._paths[file]
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                yield f
        except ValueError:
            raise
        except Exception as exc:  # SafetensorError, OSError, RuntimeError from the library
            raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Read the named tensors (CPU, their stored dtype), grouped by shard.

        Raises:
            ValueError: a name is not in the checkpoint (lists up to three), or a shard or
                tensor safetensors cannot read (names the file).
        """
        wanted = list(dict.fromkeys(names))
        absent = [n for n in wanted if n not in self.weight_map]
        if absent:
            raise ValueError(
                f"model_dir={str(self.root)!r} lacks {len(absent)} tensors this stage needs, "
                f"e.g. {absent[:3]}"
            )
        by_file: dict[str, list[str]] = {}
        for name in wanted:
            by_file.setdefault(self.weight_map[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for file, file_names in sorted(by_file.items()):
            self.files_opened.add(file)
            with self._open(file) as f:
                for name in file_names:
                    try:
                        tensor = f.get_tensor(name)
                    except Exception as exc:  # safetensors raises its own error type
                        raise ValueError(
                            f"{self._paths[file]}: cannot read tensor {name} ({exc})"
                        ) from None
                    self.bytes_read += tensor.numel() * tensor.element_size()
                    out[name] = tensor
        return out

    def read_part(
        self, name: str, dim: int | None = None, part: slice | None = None
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Read one tensor, or only its ``part`` along ``dim`` (``get_slice``: a
        tensor-parallel rank reads its share and no more). Shard files stay open until
        :meth:`close`.

        Returns:
            (the tensor or its slice, the stored tensor's full shape).

        Raises:
            ValueError: the name is not in the checkpoint, the slice is outside the tensor, or
                safetensors cannot read it (names the file).
        """
        from safetensors import safe_open

        file = self.weight_map.get(name)
        if file is None:
            raise ValueError(f"model_dir={str(self.root)!r} lacks tensor {name}")
        path = self._paths[file]
        try:
            handle = self._handles.get(file)
            if handle is None:
                handle = self._handles[file] = safe_open(str(path), framework="pt", device="cpu")
                self.files_opened.add(file)
            sl = handle.get_slice(name)
            full = tuple(int(d) for d in sl.get_shape())
            if dim is None or part is None:
                tensor = handle.get_tensor(name)
            else:
                if dim >= len(full) or part.stop > full[dim]:
                    raise ValueError(
                        f"tensor {name} of shape {full} has no slice {part.start}:{part.stop} "
                        f"along dim {dim}"
                    )
                tensor = sl[tuple([slice(None)] * dim + [part])]
        except ValueError:
            raise
        except Exception as exc:  # SafetensorError, OSError, RuntimeError from the library
            raise ValueError(f"{path}: cannot read tensor {name} ({exc})") from None
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor, full

    def close(self) -> None:
        """Close the shard files :meth:`read_part` opened."""
        self._handles.clear()

    def shard_shapes(self) -> Iterator[tuple[str, dict[str, tuple[tuple[int, ...], str]]]]:
        """Per shard file (sorted), each tensor's (shape, safetensors dtype) from the header
        (reads no tensor data).

        Raises:
            ValueError: a shard safetensors cannot read (names the file).
        """
        for file in sorted(set(self.weight_map.values())):
            with self._open(file) as f:
                shapes = {}
                for key in f.keys():
                    sl = f.get_slice(key)
                    shapes[key] = (tuple(int(d) for d in sl.get_shape()), str(sl.get_dtype()))
            yield file, shapes


def stage_tensor_names(
    weight_map: Iterable[str],
    first_layer: int,
    last_layer: int,
    num_layers: int,
    *,
    tie_word_embeddings: bool = False,
) -> list[str]:
    """The checkpoint tensors a stage holding layers ``[first_layer, last_layer)`` needs.

    Every ``model.layers.{i}.*`` with i in range; ``model.embed_tokens.weight`` on the first
    stage (and on the last with tied embeddings); ``model.norm.weight`` and ``lm_head.weight``
    (untied) on the last. Layers >= ``num_layers`` (multi-token-prediction layers some
    checkpoints carry) are never read.
    """
    names: list[str] = []
    for name in weight_map:
        m = _LAYER.match(name)
        if m and first_layer <= int(m.group(1)) < last_layer:
            names.append(name)
    if first_layer == 0 or (last_layer == num_layers and tie_word_embeddings):
        names.append("model.embed_tokens.weight")
    if last_layer == num_layers:
        names.append("model.norm.weight")
        if not tie_word_embeddings:
            names.append("lm_head.weight")
    return sorted(names)

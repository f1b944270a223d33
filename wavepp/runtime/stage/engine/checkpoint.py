"""Read one stage's tensors from a Hugging Face safetensors checkpoint, and only those.

A directory holds ``model.safetensors``, or shards with ``model.safetensors.index.json``
(``weight_map``: tensor name -> shard file). :class:`CheckpointReader` opens each shard a stage
needs with ``safe_open`` and reads the named tensors one at a time, so a stage holding layers
``[a, b)`` reads those layers' tensors (plus the embedding on the first stage, the final norm
and ``lm_head`` on the last) and no other: ``bytes_read`` counts the tensor bytes it read.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointReader", "stage_tensor_names"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


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
            ValueError: no index and no ``model.safetensors`` / ``*.safetensors``, or an index
                naming a missing shard.
        """
        self.root = Path(model_dir)
        self.bytes_read = 0
        self.files_opened: set[str] = set()
        self._handles: dict[str, Any] = {}
        index = self.root / _INDEX
        if index.is_file():
            raw = json.loads(index.read_text()).get("weight_map")
            if not isinstance(raw, dict) or not raw:
                raise ValueError(f"{index}: 'weight_map' must be a non-empty object")
            self.weight_map: dict[str, str] = {str(k): str(v) for k, v in raw.items()}
            missing = sorted({f for f in self.weight_map.values() if not (self.root / f).is_file()})
            if missing:
                raise ValueError(f"{index} names shards that are absent: {missing[:3]}")
            return
        files = [self.root / _SINGLE] if (self.root / _SINGLE).is_file() else []
        files = files or sorted(self.root.glob("*.safetensors"))
        if not files:
            raise ValueError(
                f"model_dir={str(self.root)!r} holds no {_INDEX} and no *.safetensors file"
            )
        from safetensors import safe_open

        self.weight_map = {}
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    self.weight_map[key] = file.name

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Read the named tensors (CPU, their stored dtype), grouped by shard.

        Raises:
            ValueError: a name is not in the checkpoint (lists up to three).
        """
        from safetensors import safe_open

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
            with safe_open(str(self.root / file), framework="pt", device="cpu") as f:
                for name in file_names:
                    try:
                        tensor = f.get_tensor(name)
                    except Exception as exc:  # safetensors raises its own error type
                        raise ValueError(
                            f"{self.root / file}: cannot read tensor {name} ({exc})"
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
            ValueError: the name is not in the checkpoint, or the slice is outside the tensor.
        """
        from safetensors import safe_open

        file = self.weight_map.get(name)
        if file is None:
            raise ValueError(f"model_dir={str(self.root)!r} lacks tensor {name}")
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(
                str(self.root / file), framework="pt", device="cpu"
            )
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
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor, full

    def close(self) -> None:
        """Close the shard files :meth:`read_part` opened."""
        self._handles.clear()

    def total_bytes(self) -> int:
        """Tensor bytes of the whole checkpoint (from the safetensors headers; reads no data)."""
        from safetensors import safe_open

        total = 0
        for file in sorted(set(self.weight_map.values())):
            with safe_open(str(self.root / file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    numel = 1
                    for dim in sl.get_shape():
                        numel *= dim
                    total += numel * _DTYPE_BYTES.get(sl.get_dtype(), 4)
        return total


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1}


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

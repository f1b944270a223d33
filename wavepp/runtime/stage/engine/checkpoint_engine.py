"""Torch stage engine over a Hugging Face checkpoint directory: every registered family
(``wavepp.runtime.families``: Llama, DeepSeek-V3, MiniMax-M2, GLM-5, Kimi-Linear).

The forward is :class:`~wavepp.runtime.stage.engine.decoder.DecoderStageEngine`'s; this class
reads ``config.json`` (its layer plan must agree with the runtime's ``ModelConfig``) and only
this stage's tensors from the checkpoint (``checkpoint.py``); ``bytes_read`` says how many bytes
that was. With tensor parallelism (``tensor_parallel.py``) each TP rank reads only its share of
the sharded tensors and holds its heads' cache.
"""

from __future__ import annotations

import os

import torch

from wavepp.runtime.families import family_of
from wavepp.runtime.hf_config import layer_plan_from_hf, model_config_from_hf, read_hf_config
from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.stage.engine.checkpoint import CheckpointReader, stage_tensor_names
from wavepp.runtime.stage.engine.decoder import DecoderStageEngine, torch_dtype
from wavepp.runtime.stage.engine.tensor_parallel import SINGLE, TPGroup


class CheckpointStageEngine(DecoderStageEngine):
    """Decoder layers ``[first_layer, last_layer)`` of a checkpoint over a paged cache."""

    def __init__(
        self,
        *,
        model: ModelConfig,
        first_layer: int,
        last_layer: int,
        num_layers_total: int,
        model_dir: str | os.PathLike[str],
        device: torch.device | str = "cpu",
        state_interval_blocks: int = 1,
        tp: TPGroup = SINGLE,
        compile: bool = False,
        pack_weights: bool = True,
    ) -> None:
        """Read ``model_dir/config.json`` and this stage's tensors (this TP rank's share).

        Args:
            model: the generic config (``hf_config.load_model_dir(model_dir)``, maybe with
                another dtype); every field but its name, dtype and seed must match config.json.
            first_layer, last_layer, num_layers_total: this stage's layer range.
            model_dir: the checkpoint directory.
            device: "cpu" (float32 only) or a CUDA device.
            state_interval_blocks: linear-attention (KDA) layers keep their recurrent state
                after every k-th block of a request (``RuntimeConfig.state_interval_blocks``).
            compile: ``torch.compile`` the layers' dense parts (``DecoderStageEngine._build``).
            pack_weights: pre-pack the projections' weights (``DecoderStageEngine._build``).
            tp: this process's place in the stage's tensor-parallel group (``SINGLE``: none).

        Raises:
            ValueError: config.json disagrees with ``model``, an unsupported family, a dtype
                other than float32 on CPU, a missing / misshapen tensor (named), or a family
                or width tensor parallelism cannot split (names the family or field).
        """
        super().__init__(
            first_layer=first_layer,
            last_layer=last_layer,
            num_layers_total=num_layers_total,
            device=device,
        )
        cfg = read_hf_config(model_dir)
        derived = model_config_from_hf(cfg, name=model.name)
        # NOTE: every shape and numeric field, not only the layer count and widths: a
        # directory edited after the admission derived its config (or between two stages'
        # restarts) would otherwise leave stages computing with different rope_theta / eps /
        # heads. The name, dtype and seed are the runtime's own.
        for field in sorted(set(ModelConfig.model_fields) - {"name", "dtype", "seed"}):
            if getattr(derived, field) != getattr(model, field):
                raise ValueError(
                    f"model.{field}={getattr(model, field)!r} differs from model_dir's "
                    f"config.json ({getattr(derived, field)!r}); derive the model from it"
                )
        if state_interval_blocks < 1:
            raise ValueError(f"state_interval_blocks={state_interval_blocks} must be >= 1")
        if model.num_layers != num_layers_total:
            raise ValueError(
                f"num_layers_total={num_layers_total} differs from model.num_layers="
                f"{model.num_layers}"
            )
        dtype = torch_dtype(model.dtype)
        if self.device.type == "cpu" and dtype != torch.float32:
            raise ValueError(f"model.dtype={model.dtype!r} on device 'cpu'; use float32 on CPU")
        self.model = model
        plan = layer_plan_from_hf(cfg)
        plan.check_stage_start(first_layer)
        family = family_of(plan.model_type)
        if tp.size > 1 and not family.tensor_parallel:
            raise ValueError(
                f"tensor_parallel_size={tp.size} (--tensor-parallel-size / "
                f"spec.tensorParallelSize): family {family.model_type!r} ({family.summary}) "
                "is not sharded; use 1"
            )
        self.reader = CheckpointReader(model_dir)
        names = stage_tensor_names(
            self.reader.weight_map,
            first_layer,
            last_layer,
            model.num_layers,
            tie_word_embeddings=plan.tie_word_embeddings,
        )
        wanted = set(names)
        used: set[str] = set()

        def get(name: str, shape: tuple[int, ...], dim: int | None = None) -> torch.Tensor:
            if name not in wanted:
                raise ValueError(f"model_dir={str(model_dir)!r} lacks tensor {name}")
            part = None if dim is None or tp.size == 1 else tp.shard(shape[dim], name)
            t, full = self.reader.read_part(name, dim, part)
            if full != shape:
                raise ValueError(f"tensor {name} has shape {full}; config.json implies {shape}")
            used.add(name)
            return t.to(device=self.device, dtype=dtype).contiguous()

        self._build(
            plan,
            get,
            dtype=dtype,
            tp=tp,
            state_interval_blocks=state_interval_blocks,
            compile=compile,
            pack=pack_weights,
        )
        has_head = self.is_last and tp.is_leader
        self.reader.close()
        unused = sorted(set(names) - used)
        if not has_head:
            unused = [n for n in unused if n not in ("model.norm.weight", "lm_head.weight")]
            if self.is_last and plan.tie_word_embeddings and not self.is_first:
                unused = [n for n in unused if n != "model.embed_tokens.weight"]
        if unused:
            raise ValueError(
                f"model_dir={str(model_dir)!r} has {len(unused)} tensors in layers "
                f"[{first_layer}, {last_layer}) this engine does not use, e.g. {unused[:3]}"
            )

    @property
    def bytes_read(self) -> int:
        """Tensor bytes this stage read from the checkpoint."""
        return self.reader.bytes_read

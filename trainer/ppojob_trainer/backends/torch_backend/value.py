"""The torch backend's value trainer (the critic)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ppojob_api.training import TrainingSettings

from ...distributed import ShardIdentity
from ...models import VALUE_HEAD_FILE, load_value_model, torch_dtype
from ..base import ValueLossFn, ValueTrainer
from ..packed_attention import use_packed_attention
from .common import _eval_mode
from .memory import to_device
from .optimiser import _Optimised
from .packing import check_packing_support, unpack
from .sharding import activation_checkpointing, full_state_dict
from .trainer_common import _device_inputs, _OptimisedState, _packed_device_inputs, save_pretrained


class TorchValueTrainer(_OptimisedState, ValueTrainer):
    """The critic: HF backbone with a scalar value head (float32 master weights, ``dtype``
    compute), AdamW; optionally FSDP2-sharded like the actor."""

    def __init__(
        self,
        model_dir: Path | str,
        dtype: str,
        settings: TrainingSettings,
        *,
        total_updates: int,
        seed: int,
        group: Any | None = None,
        dp_size: int = 1,
        device: str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.model_dir = Path(model_dir)
        self.dtype = torch_dtype(dtype)
        self.settings = settings
        self.model = load_value_model(model_dir, "float32", seed=seed)
        if settings.packing:
            check_packing_support(self.model.backbone)
            use_packed_attention(self.model.backbone)
        if settings.gradient_checkpointing:
            activation_checkpointing(self.model.backbone)
        self.opt = _Optimised(
            self.model,
            settings,
            total_updates,
            group,
            dp_size,
            device=self.device,
            compute_dtype=self.dtype,
        )
        self.model.train()

    def _forward(self, micro: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if self.settings.packing:
            inputs, select, rows, cols = _packed_device_inputs(micro, self.device)
            with self.opt.autocast():
                values = self.model(**inputs)
            return unpack(
                values[0, select].float(),
                rows.to(self.device),
                cols.to(self.device),
                micro["response_ids"].shape,
            )
        inputs, plen = _device_inputs(micro, self.device)
        tlen = micro["response_ids"].shape[1]
        with self.opt.autocast():
            values = self.model(**inputs)
        return values[:, plen - 1 : plen - 1 + tlen].float()

    @torch.no_grad()
    def values(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        with _eval_mode(self.model):  # values for the advantages without dropout
            return self.opt.forward_chunks(batch, self._forward)

    def update(
        self,
        minibatch: Mapping[str, torch.Tensor],
        loss_fn: ValueLossFn,
        micro_batch_size: int,
        agg: str = "token-mean",
    ) -> dict[str, float]:
        def micro_loss(micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
            return loss_fn(self._forward(micro), to_device(micro, self.device))

        return self.opt.accumulate(minibatch, micro_batch_size, agg, micro_loss)

    def export_pretrained(self, directory: Path | str, shard: ShardIdentity) -> None:
        """The backbone with ``save_pretrained`` plus ``value_head.safetensors`` (and the
        tokenizer); :func:`ppojob_trainer.models.load_value_model` loads both back."""
        full = full_state_dict(self.model)  # collective under FSDP
        if not shard.is_dp_leader:
            return
        backbone = {
            k.removeprefix("backbone."): v for k, v in full.items() if k.startswith("backbone.")
        }
        save_pretrained(self.model.backbone, backbone, directory, self.model_dir)
        from safetensors.torch import save_file

        head = {
            k.removeprefix("value_head."): v.contiguous()
            for k, v in full.items()
            if k.startswith("value_head.")
        }
        save_file(head, str(Path(directory) / VALUE_HEAD_FILE))

"""LoRA (``--lora-r``): a frozen model with low-rank adapters; imported only when the flag asks, as peft adds a
second to every start."""

import torch
from peft import LoraConfig, TaskType, get_peft_model

from fabric_utils.errors import UserError, first_line


def add_lora(model, r: int, alpha: float, dropout: float, target_modules: list[str] | None, upcast: bool = True):
    """Freezes ``model`` and adds LoRA adapters (``W + alpha / r * B @ A``, B starting at zero) to the linear layers
    named ``target_modules`` (default: every linear layer of the body, peft's ``all-linear``). The task's head, every
    module outside the pretrained body (a classifier, score, classification head, DeBERTa's pooler: what the load makes
    fresh), trains in full and is exported. ``upcast`` makes the adapters fp32 next to 16-bit weights; a skeleton is
    fp32 already, and under ZeRO-3 its weights take DeepSpeed's one dtype as they are made, which fp32 adapters would
    break."""
    body = model.base_model
    head = [name for name, module in model.named_children()
            if module is not body and next(module.parameters(), None) is not None]
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in body.named_modules()
                     if isinstance(module, torch.nn.Linear)})
    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=list(target_modules or ()) or "all-linear", modules_to_save=head)
    try:
        return get_peft_model(model, config, autocast_adapter_dtype=upcast)
    except ValueError as err:  # peft's check that every name matches a layer
        flag = f"--lora-target-modules {' '.join(target_modules)}" if target_modules else "LoRA"
        raise UserError(f"{flag}: {first_line(err)} (its linear layers: {linear}; pass some with "
                        f"--lora-target-modules)") from err

"""LoRA adapters trained with peft, the library a practitioner would use, then taken out into the
repository's LoRAAdapter (gptlite_lora.py), which serves them."""
import torch

from gptlite_lora import ATTENTION_TARGETS, LORA_TARGETS, LoRAAdapter, check_lora_args
from lib.errors import GPTliteError


def divergence_hint(rank, alpha, lr):
    """What a diverged LoRA fine-tuning says (training.train_steps' hint): alpha scales the update, so it is as
    likely a cause as the learning rate."""
    alpha = float(alpha if alpha is not None else 2 * rank)
    return (f"(LoRA alpha {alpha:g}, so a scale alpha / r = {alpha / rank:g}, and peak learning rate {lr:g}); rerun "
            f"with a lower alpha or a lower learning rate")


def peft_model(model, rank, targets=ATTENTION_TARGETS, alpha=None):
    """The GPTlite `model` wrapped by peft's LoRA (its weights frozen, A and B trainable)."""
    targets = check_lora_args(rank, targets, alpha, model)  # before peft's slow import
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=0.0,
                        target_modules=list(targets), bias="none")
    return get_peft_model(model, config)


def adapter_from_peft(peft, base):
    """The LoRAAdapter holding the A, B and scale of a peft-wrapped GPTlite (`base`: a model of its shape)."""
    config = peft.peft_config["default"]
    adapter = LoRAAdapter(base, config.r, tuple(sorted(config.target_modules, key=LORA_TARGETS.index)),
                          config.lora_alpha)
    modules = dict(peft.base_model.model.named_modules())
    with torch.no_grad():
        for i, name in enumerate(adapter.names):
            layer = modules[name]
            if layer.scaling["default"] != adapter.scaling:
                raise GPTliteError(f"peft's scale {layer.scaling['default']} at {name} is not alpha / r = "
                                      f"{adapter.scaling}; this is a bug")
            adapter.A[i].copy_(layer.lora_A["default"].weight)  # [r, in]
            adapter.B[i].copy_(layer.lora_B["default"].weight)  # [out, r]
    return adapter

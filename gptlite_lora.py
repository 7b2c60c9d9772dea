"""LoRA adapters for GPTlite, served with the repository's own code (trained with peft: lib/lora_peft.py).

Blog section: "Other serving techniques" (multi-LoRA serving: S-LoRA, Punica). A LoRA adapter adds a low-rank
update to some linear layers: W x + s * B A x, with A: [r, in], B: [out, r], s = alpha / r. Two ways to
serve a batch whose requests use different adapters:
- merged: one copy of the model per adapter with W + s B A folded in (`merge_adapter`); the requests
  are grouped by adapter and each group is one batch;
- batched (Punica's BGMV): one model whose target linears are `LoRALinear`: the base weight is shared
  and each row's update is gathered by its adapter id, `(x @ A[ids]) @ B[ids]`, so one forward serves the
  mixed batch. The model is GPTlite_KVCache itself (`multi_lora_model` swaps the linears in), so the KV
  cache, prefill and decode are the repository's, unchanged.
"""
import math
import numbers

import torch
import torch.nn as nn

from gptlite_kvcache import generate_kvcache, kv_cache_model

# The linear layers an adapter may target, named as in a block (peft's target_modules match these suffixes).
LORA_TARGETS = ("query_proj", "key_proj", "value_proj", "out_proj", "ffwd.net.0", "ffwd.net.2")
ATTENTION_TARGETS = ("query_proj", "key_proj", "value_proj", "out_proj")


def check_lora_args(rank, targets, alpha=None, model=None):
    """Clear errors for a rank below 1 (or, given the model, above a targeted layer's min(in, out)
    features: B A would not be low-rank), an alpha that is not a positive finite number (NaN weights
    would then serve token 0 forever) or a target that is not a linear layer of GPTlite. A single
    string is one target. Returns the targets as a tuple."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA rank must be an integer of at least 1, got {rank!r}")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, numbers.Real)
                              or not math.isfinite(alpha) or alpha <= 0):
        raise ValueError(f"LoRA alpha must be a positive finite number (the update is scaled by alpha / r), got "
                         f"{alpha!r}; leave it out for the default 2 * rank")
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if not targets or unknown:
        raise ValueError(f"unknown LoRA target module(s) {unknown or list(targets)}; choose among "
                         f"{', '.join(LORA_TARGETS)} (one name, or a list of names)")
    if len(set(targets)) != len(targets):
        raise ValueError(f"LoRA target modules repeated: {targets}; name each once")
    if model is not None:
        for t in targets:
            layer = target_linear(model.blocks[0], t)
            if rank > min(layer.in_features, layer.out_features):
                raise ValueError(f"LoRA rank {rank} is larger than the layer {t} ({layer.in_features} -> "
                                 f"{layer.out_features} features): the rank must be at most "
                                 f"{min(layer.in_features, layer.out_features)}, the smaller of the two")
    return targets


def target_linear(block, target):
    """The nn.Linear of `block` named by `target` (attention projections live in block.mha)."""
    module = block if target.startswith("ffwd.") else block.mha
    for name in target.split("."):
        module = getattr(module, name)
    return module


def target_names(n_layers, targets):
    """The full module names, in the adapter's order: blocks.<i>.mha.query_proj, blocks.<i>.ffwd.net.0, ..."""
    return [f"blocks.{i}.{t if t.startswith('ffwd.') else 'mha.' + t}" for i in range(n_layers) for t in targets]


class LoRAAdapter(nn.Module):
    """The A [r, in] and B [out, r] of every targeted linear of a GPTlite, and the scale alpha / r.

    The parameter lists follow target_names(n_layers, targets); B starts at zero (LoRA's init: the
    adapter starts as the base model)."""

    def __init__(self, model, rank, targets=ATTENTION_TARGETS, alpha=None):
        super().__init__()
        self.rank, self.targets = rank, check_lora_args(rank, targets, alpha, model)
        self.alpha = float(alpha if alpha is not None else 2 * rank)
        self.scaling = self.alpha / rank
        linears = [target_linear(b, t) for b in model.blocks for t in self.targets]
        self.A = nn.ParameterList([nn.Parameter(torch.randn(rank, m.in_features) / m.in_features**0.5)
                                   for m in linears])
        self.B = nn.ParameterList([nn.Parameter(torch.zeros(m.out_features, rank)) for m in linears])
        self.names = target_names(model.config.n_layers, self.targets)

    def config(self):
        return dict(rank=self.rank, alpha=self.alpha, targets=list(self.targets))

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """nn.Module's, after a clear error for the state dict of another adapter shape: another rank
        (both named), other targets, or a model of other widths (torch would raise a size mismatch)."""
        own = self.state_dict()
        if set(state_dict) != set(own) and strict:
            raise ValueError(f"the state dict holds {len(state_dict) // 2} A/B pairs, this adapter {len(own) // 2} "
                             f"({len(self.targets)} targets x {len(self.names) // len(self.targets)} blocks): build "
                             f"the LoRAAdapter with the targets and model the state dict was saved from")
        ranks = sorted({v.shape[0 if name.startswith("A.") else 1] for name, v in state_dict.items()
                        if name in own and v.dim() == 2})  # A: [r, in], B: [out, r]
        if ranks and ranks != [self.rank]:
            raise ValueError(f"the state dict holds a rank-{'/'.join(map(str, ranks))} adapter, this LoRAAdapter "
                             f"has rank {self.rank}: build it with rank={ranks[0]} (and that adapter's alpha and "
                             f"targets) to load it")
        for name, v in state_dict.items():
            if name in own and tuple(v.shape) != tuple(own[name].shape):
                raise ValueError(f"the state dict's {name} is {tuple(v.shape)}, this adapter's is "
                                 f"{tuple(own[name].shape)}: it was saved for a model of other widths or other "
                                 f"targets")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def delta(self, i):
        """The update of the i-th targeted weight, s * B A: [out, in]."""
        return self.scaling * self.B[i] @ self.A[i]


def random_adapter(model, rank, targets=ATTENTION_TARGETS, alpha=None, seed=0, std=0.02):
    """An adapter with random A and B (an untrained stand-in: its update is not zero)."""
    generator = torch.Generator().manual_seed(seed)
    adapter = LoRAAdapter(model, rank, targets, alpha)
    with torch.no_grad():
        for A, B in zip(adapter.A, adapter.B):
            A.copy_(torch.randn(A.shape, generator=generator) / A.shape[1]**0.5)
            B.copy_(torch.randn(B.shape, generator=generator) * std)
    return adapter.to(model.fc_out.weight.device)


# ----------------------------------------------------------------------------------------------------
# Serving, merged: one copy of the weights per adapter.

@torch.no_grad()
def merge_adapter(model, adapter):
    """A copy of `model` (any GPTlite class) with W + s B A in every targeted linear."""
    merged = type(model).from_config(model.config).to(model.fc_out.weight.device)
    merged.load_state_dict(model.state_dict())
    for i, name in enumerate(adapter.names):
        merged.get_submodule(name).weight += adapter.delta(i)
    return merged.eval()


def generate_merged(merged_models, prompts, adapter_ids, n_tokens, seqlen):
    """Requests grouped by adapter, one generate_kvcache per group; outputs back in request order."""
    check_adapter_ids(adapter_ids, len(merged_models), prompts.shape[0])
    out = torch.empty(prompts.shape[0], prompts.shape[1] + n_tokens, dtype=torch.long, device=prompts.device)
    for a in adapter_ids.unique().tolist():
        rows = (adapter_ids == a).nonzero().squeeze(1)
        out[rows] = generate_kvcache(merged_models[a], prompts[rows], n_tokens, seqlen)
    return out


# ----------------------------------------------------------------------------------------------------
# Serving, batched: the base weights shared, each row's update gathered by its adapter id.

class LoRALinear(nn.Module):
    """base(x) + (x @ A[ids]) @ B[ids]: a shared nn.Linear and N stacked adapters (the scale folded in B).

    A: [N, in, r], B: [N, r, out]; `ids` [B] (set by set_adapter_ids) picks each row's adapter;
    ids None: the base layer alone."""

    def __init__(self, base, A, B):
        super().__init__()
        self.base = base
        self.register_buffer("A", A)  # [N, in, r]
        self.register_buffer("B", B)  # [N, r, out]
        self.ids = None
        self.in_features, self.out_features = base.in_features, base.out_features  # what nn.Linear's readers ask

    def forward(self, x):
        # x: [B, T, in]
        y = self.base(x)  # [B, T, out], one matmul with the shared weight for every row
        if self.ids is None:
            return y
        return y + (x @ self.A[self.ids]) @ self.B[self.ids]  # BGMV: [B, T, r] then [B, T, out]


def check_adapter_ids(adapter_ids, n_adapters, batch_size=None):
    """One adapter id per request, each in [0, n_adapters): a clear error otherwise."""
    if not isinstance(adapter_ids, torch.Tensor) or adapter_ids.dtype != torch.long or adapter_ids.dim() != 1:
        raise ValueError("adapter_ids must be a 1-D LongTensor, one adapter id per request")
    if batch_size is not None and adapter_ids.shape[0] != batch_size:
        raise ValueError(f"got {adapter_ids.shape[0]} adapter ids for {batch_size} requests: give one per request")
    if adapter_ids.numel() and (adapter_ids.min() < 0 or adapter_ids.max() >= n_adapters):
        raise ValueError(f"adapter id out of range: ids must be in [0, {n_adapters}) for {n_adapters} adapters, "
                         f"got {adapter_ids.min().item()} .. {adapter_ids.max().item()}")


@torch.no_grad()
def multi_lora_model(model, adapters):
    """A GPTlite_KVCache with `model`'s weights whose targeted linears are LoRALinear over the stacked
    `adapters` (same rank and targets). The base weights are shared with `model`, not copied."""
    if not adapters:
        raise ValueError("give at least one adapter")
    first = adapters[0]
    for a in adapters:
        if a.rank != first.rank or a.targets != first.targets:
            raise ValueError(f"adapters must share rank and targets to be stacked: {a.config()} against "
                             f"{first.config()}")
    served = kv_cache_model(model)
    weights = dict(model.named_parameters())
    for name, p in served.named_parameters():
        p.data = weights[name].data  # share the base weights: no second copy
    for i, name in enumerate(first.names):
        A = torch.stack([a.A[i].t() for a in adapters])  # [N, in, r]
        B = torch.stack([a.scaling * a.B[i].t() for a in adapters])  # [N, r, out]
        parent, child = name.rsplit(".", 1)
        owner = served.get_submodule(parent)
        setattr(owner, child, LoRALinear(getattr(owner, child), A, B))
    served.n_adapters = len(adapters)
    return served.eval()


def set_adapter_ids(model, adapter_ids):
    """Route row b of the next forwards through adapter adapter_ids[b] (None: the base model)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    if not layers:
        raise ValueError("this model has no LoRALinear layers; build it with multi_lora_model(model, adapters)")
    if adapter_ids is not None:
        check_adapter_ids(adapter_ids, layers[0].A.shape[0])
    for m in layers:
        m.ids = adapter_ids


def generate_multi_lora(model, prompts, adapter_ids, n_tokens, seqlen):
    """One generate_kvcache for the mixed batch: request b uses adapter adapter_ids[b]."""
    check_adapter_ids(adapter_ids, model.n_adapters, prompts.shape[0])
    set_adapter_ids(model, adapter_ids)
    try:
        return generate_kvcache(model, prompts, n_tokens, seqlen)
    finally:
        set_adapter_ids(model, None)


def adapters_nbytes(adapters):
    return sum(p.numel() * p.element_size() for a in adapters for p in a.parameters())

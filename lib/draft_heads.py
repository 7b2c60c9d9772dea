"""Draft heads that read the target's hidden states: Medusa's heads and the one-block head of EAGLE and of
multi-token prediction (DeepSeek-V3's MTP module). The target's final LayerNorm and head turn a predicted
state into logits, so a head adds few parameters and costs little per call.

- MedusaHeads (Cai et al. 2024): K residual blocks h + SiLU(W h), head k predicting the k-th token after
  the next one from the hidden state h_t alone. Trained on the frozen target (medusa_loss_fn).
- FeatureHead: one transformer block over fuse([h_t, embedding(x_{t+1})]) predicting h_{t+1}: EAGLE (Li et
  al. 2024; trained on the frozen target, feature regression + 0.1 cross entropy, eagle_loss_fn), or with
  RMSNorm on both inputs, DeepSeek-V3's MTP module (trained with the model: gptlite_mtp.py).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlite_kvcache import kv_cache_view
from gptlite_mtp import FeatureHead  # noqa: F401 (EAGLE's head is MTP's module)
from lib.training import validation_loss


def full_hidden(target, x):
    """The target's last-block states of x [B, S] in one causal pass: [B, S, d_model]."""
    view = kv_cache_view(target)
    return view.hidden_states(x, view.open_cache(None, None, x.shape[0]))


def head_logits(target, states):
    """The target's own final LayerNorm and head on (predicted) states [..., d]: logits [..., V]."""
    return target.fc_out(target.ln(states))


class MedusaHeads(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(n_heads))
        for head in self.heads:  # zero init (Medusa's): each head starts as the target's next-token head
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)

    def state(self, k, h):
        """Head k's (1-based) predicted state from h [..., d]: h + SiLU(W_k h)."""
        return h + F.silu(self.heads[k - 1](h))

    def states(self, h, n=None):
        """h [..., d] -> [..., n, d]: the first n heads' predicted states (default all)."""
        return torch.stack([self.state(k, h) for k in range(1, (n or len(self.heads)) + 1)], dim=-2)

    def forward(self, h, target, n=None):
        """Logits [B, n, V] of the first n heads from the states h [B, d]."""
        return head_logits(target, self.states(h, n))


# ----------------------------------------------------------------------------------------------------
# Training on the frozen target (train_steps' loss_fn and evaluate).

def medusa_loss(heads, target, x, y, decay=0.8):
    """Head k (k = 1..K) predicts y shifted by k from the target's state at each position; the heads'
    cross entropies weighted decay^(k-1) (Medusa's), normalised. Returns (loss, head 1's loss)."""
    with torch.no_grad():
        h = full_hidden(target, x)  # [B, S, d]
    S, losses = x.shape[1], []
    for k in range(1, len(heads.heads) + 1):
        logits = head_logits(target, heads.state(k, h[:, :S - k]))  # [B, S-k, V]: head k alone
        losses.append(F.cross_entropy(logits.flatten(0, 1), y[:, k:].flatten()))
    weights = [decay ** i for i in range(len(losses))]
    return sum(w * loss for w, loss in zip(weights, losses)) / sum(weights), losses[0]


def feature_loss(head, target, x, y, h=None, regression=1.0, ce=0.1):
    """EAGLE's loss: smooth L1 between the predicted and the true next states, plus `ce` times the cross
    entropy of the token after next read from the prediction. h: the target's states (computed without
    gradient when None). Returns (loss, the cross entropy)."""
    if h is None:
        with torch.no_grad():
            h = full_hidden(target, x)  # [B, S, d]
    pred = head(x[:, 1:], h[:, :-1], target.token_embedding)  # [B, S-1, d]: predicts h[:, 1:]
    ce_loss = F.cross_entropy(head_logits(target, pred).flatten(0, 1), y[:, 1:].flatten())
    reg = F.smooth_l1_loss(pred, h[:, 1:].detach()) if regression else 0.0
    return regression * reg + ce * ce_loss, ce_loss


def medusa_loss_fn(target):
    target.requires_grad_(False)
    return lambda heads, x, y: medusa_loss(heads, target, x, y)[0]


def eagle_loss_fn(target):
    target.requires_grad_(False)
    return lambda head, x, y: feature_loss(head, target, x, y)[0]


def head_evaluate(loss, data, seqlen, n_batches=10, batch_size=32, seed=1234):
    """train_steps' `evaluate` for a head: the cross entropy of its first prediction (the token after
    next) on fixed validation batches; `loss(head, x, y)` returns (training loss, that cross entropy)."""
    return lambda head: validation_loss(head, data, n_batches, batch_size, seqlen, seed,
                                        loss=lambda h, x, y: loss(h, x, y)[1])


def mtp_loss_fn(weight):
    """train_steps' loss_fn: cross entropy of the next token + weight x that of the token after it (MTP)."""
    def loss_fn(model, x, y):
        h = model.hidden(x)  # [B, S, d]
        main = F.cross_entropy(model.fc_out(model.ln(h)).flatten(0, 1), y.flatten())
        _, mtp = feature_loss(model.mtp, model, x, y, h=h, regression=0.0, ce=1.0)
        return main + weight * mtp
    return loss_fn

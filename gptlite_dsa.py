"""DSA (DeepSeek Sparse Attention, DeepSeek-V3.2-Exp) for GPTlite.

The model (its conversion from a dense GPTlite and its two-stage training: lib/dsa.py).

Blog section: "Sparse attention". Every layer gets a *lightning indexer*: a few small ReLU heads that
score each past token s for the query token t,

    I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s])

with n_index_heads query vectors q[t, j] of d_index dimensions and their weights w[t, j], both from the
query token's hidden state, and ONE index key k[s] per token shared by the heads (cached beside K and
V, d_index numbers a token). Each query then attends, in every head of the main attention, only to the
top_k past tokens of highest index score (all of them while fewer than top_k exist). The selection has
no gradient; the indexer learns from a KL loss towards the main attention instead, in two stages as
DeepSeek-V3.2 did: a dense warm-up (main model frozen and dense, the indexer fitted to its attention),
then sparse training (top-k attention, the language-modelling loss for the main model, the KL loss
restricted to the selected tokens for the indexer, whose input is detached so that each part learns
from its own loss only).

As in DeepSeek's code the indexer reads the attention's input (here GPTlite's ln1 output; DeepSeek's
query side reads MLA's query latent), its key goes through a LayerNorm, and the scale
1/sqrt(n_index_heads * d_index) is folded into w. GPTlite's positions are absolute embeddings already
in the hidden state, so there is no rotary part. Ties among index scores go to the earlier token (a
stable sort), so a decoded token selects exactly what its row of the whole sequence selects.
"""
import contextlib
import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlite import GPTlite, GPTliteConfig, MultiHeadAttention
from gptlite_kvcache import DynamicKVCache, GPTlite_KVCache, MultiHeadAttention_KVCache


def check_positive_int(value, flag, what):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag} must be a positive integer ({what}), got {value!r}")


def check_dsa_args(top_k, n_index_heads, d_index):
    """Clear errors for bad DSA settings, before any work, named as the script's flags."""
    check_positive_int(top_k, "--dsa-top-k", "past tokens each query attends to, itself included")
    check_positive_int(n_index_heads, "--dsa-index-heads", "heads of the lightning indexer")
    check_positive_int(d_index, "--dsa-index-dim", "dimensions of an index query and of the index key")


class LightningIndexer(nn.Module):
    """Index scores I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s]) from the hidden states."""

    def __init__(self, d_model, n_index_heads, d_index):
        super().__init__()
        self.n_index_heads, self.d_index = n_index_heads, d_index
        self.query_proj = nn.Linear(d_model, n_index_heads * d_index)
        self.key_proj = nn.Linear(d_model, d_index)
        self.key_norm = nn.LayerNorm(d_index)
        self.weights_proj = nn.Linear(d_model, n_index_heads)

    def keys(self, x):
        """The index key of each token, shared by the heads: [B, S, d_model] -> [B, S, d_index]."""
        return self.key_norm(self.key_proj(x))

    def scores(self, x, keys):
        """Index scores of the T query tokens x [B, T, d_model] for the keys [B, n, d_index]: [B, T, n]."""
        B, T, _ = x.shape
        q = self.query_proj(x).view(B, T, self.n_index_heads, self.d_index)  # [B, T, Hi, di]
        w = self.weights_proj(x) / math.sqrt(self.n_index_heads * self.d_index)  # [B, T, Hi]
        dots = F.relu(torch.einsum("bthd,bsd->bths", q, keys))  # [B, T, Hi, n]
        return torch.einsum("bth,bths->bts", w, dots)  # [B, T, n]

    def forward(self, x):
        """The scores of a whole sequence against itself (causality is select_topk's): [B, S, S]."""
        return self.scores(x, self.keys(x))


def causal_mask(Tq, Tk, device=None):
    """[Tq, Tk] bool, True = attend: the Tq queries are the last Tq of the Tk tokens."""
    return torch.ones(Tq, Tk, dtype=torch.bool, device=device).tril(diagonal=Tk - Tq)


def select_topk(scores, top_k):
    """The keys each query attends to: its top_k past tokens (itself included) by index score, all of
    them while fewer than top_k exist; ties go to the earlier token. scores: [..., Tq, Tk], the queries
    being the last Tq of the Tk tokens. Returns [..., Tq, Tk] bool, True = attend."""
    Tq, Tk = scores.shape[-2:]
    causal = causal_mask(Tq, Tk, scores.device)
    if top_k >= Tk:
        return causal.expand(scores.shape)  # every past token: dense causal attention
    ranked = scores.masked_fill(~causal, float("-inf")).sort(dim=-1, descending=True, stable=True).indices
    chosen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    chosen.scatter_(-1, ranked[..., :top_k], True)
    return chosen & causal  # a future token taken only because fewer than top_k exist: dropped


def masked_attention(Q, K, V, mask, dropout=None):
    """Softmax attention over the keys of `mask` ([B, Tq, Tk] bool, shared by the heads, or [Tq, Tk]):
    the output [B, H, Tq, D] and the weights [B, H, Tq, Tk]."""
    if mask.dim() == 3:
        mask = mask[:, None]  # one selection for every head (DSA's MQA mode)
    scores = (Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf"))  # [B, H, Tq, Tk]
    weights = F.softmax(scores, dim=-1)  # each query keeps at least itself: no row is all -inf
    return (weights if dropout is None else dropout(weights)) @ V, weights


def indexer_kl(attention_weights, index_scores, mask):
    """The indexer's loss of one layer: KL(p || softmax(I)) over the keys of `mask`, mean over queries.
    p: the main attention's weights [B, H, Tq, Tk] summed over the heads and L1-normalised (no gradient:
    it is the target); the softmax of the index scores [B, Tq, Tk] is taken over the same keys."""
    p = attention_weights.detach().sum(dim=1)  # [B, Tq, Tk]
    p = p / p.sum(dim=-1, keepdim=True)
    log_q = F.log_softmax(index_scores.masked_fill(~mask, float("-inf")), dim=-1).masked_fill(~mask, 0.0)
    return (torch.xlogy(p, p) - p * log_q).sum(dim=-1).mean()  # p is 0 off the mask: those keys add 0


class MultiHeadAttention_DSA(MultiHeadAttention):
    """GPTlite's attention restricted to the indexer's top-k keys; the weights are GPTlite's plus the
    indexer's. dense=True: every past key (the warm-up). record=True keeps the last pass's
    (attention weights, index scores, mask) in `recorded`, for the KL loss and the recall."""

    def __init__(self, d_model, n_heads, d_head, dropout_p, top_k, n_index_heads, d_index):
        super().__init__(d_model, n_heads, d_head, dropout_p)
        self.indexer = LightningIndexer(d_model, n_index_heads, d_index)
        self.top_k, self.dense, self.record, self.recorded = top_k, False, False, None

    def forward(self, x):
        # x: [B, S, d_model]
        S = x.shape[1]
        Q = self.split_heads(self.query_proj(x))  # [B, H, S, D]
        K = self.split_heads(self.key_proj(x))
        V = self.split_heads(self.value_proj(x))
        # detached: the indexer learns from its KL loss only, the main model from its own loss only
        index_scores = self.indexer(x.detach()) if self.record or not self.dense else None  # [B, S, S]
        mask = causal_mask(S, S, x.device) if self.dense else select_topk(index_scores, self.top_k)
        out, weights = masked_attention(Q, K, V, mask, dropout=self.dropout)
        if self.record:
            self.recorded = (weights, index_scores, mask.expand(index_scores.shape))
        return self.dropout(self.out_proj(self.merge_heads(out)))  # [B, S, d_model]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DSAConfig(GPTliteConfig):
    top_k: int          # past tokens each query attends to, itself included
    n_index_heads: int  # heads of the lightning indexer
    d_index: int        # dimensions of an index query and of the (shared) index key


def use_dsa(model, attention_class, config):
    """Every block of a freshly built GPTlite (cached or not) attends with `attention_class`, initialised
    as GPTlite initialises its weights; `config` (a DSAConfig) becomes the model's."""
    for block in model.blocks:
        block.mha = attention_class(config.d_model, config.n_heads, config.d_head, config.dropout_p, config.top_k,
                                    config.n_index_heads, config.d_index)
    model.apply(model._init_weights)
    model.config = config


class GPTlite_DSA(GPTlite):
    """GPTlite whose every block attends with DSA. Its state dict is GPTlite's plus the indexers'
    (blocks.<i>.mha.indexer.*): dsa_from_dense loads a dense checkpoint and keeps the new indexers."""
    config_class = DSAConfig

    def __init__(self, vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, top_k, n_index_heads,
                 d_index, d_ff=None):
        check_dsa_args(top_k, n_index_heads, d_index)
        super().__init__(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff)
        use_dsa(self, MultiHeadAttention_DSA, DSAConfig(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p,
                                                        seqlen, d_ff, top_k=top_k, n_index_heads=n_index_heads,
                                                        d_index=d_index))

    def attentions(self):
        return [block.mha for block in self.blocks]

    def indexer_parameters(self):
        return [p for mha in self.attentions() for p in mha.indexer.parameters()]

    def set_top_k(self, top_k):
        check_dsa_args(top_k, self.config.n_index_heads, self.config.d_index)
        for mha in self.attentions():
            mha.top_k = top_k
        self.config = dataclasses.replace(self.config, top_k=top_k)
        return self

    @contextlib.contextmanager
    def recording(self, dense=False):
        """Within: every layer records (weights, index scores, mask); dense=True attends to every past key."""
        for mha in self.attentions():
            mha.record, mha.dense = True, dense
        try:
            yield self
        finally:
            for mha in self.attentions():
                mha.record, mha.dense, mha.recorded = False, False, None

    def indexer_loss(self):
        """The sum over layers of the indexer's KL loss of the last recorded pass."""
        return sum(indexer_kl(*mha.recorded) for mha in self.attentions())


class DSACache(DynamicKVCache):
    """Keys, values and index keys [B, 1, n, d_index] per layer, grown with torch.cat (gptlite_kvcache's
    interface; a full window drops the oldest token's three together). GPTlite_DSA_KVCache's attention
    calls update_dsa, which stores all three and returns them."""

    def __init__(self, n_layers, max_seqlen):
        super().__init__(None, n_layers, max_seqlen)

    def update(self, layer, k, v):
        raise ValueError("a DSACache also caches the index keys: use GPTlite_DSA_KVCache, whose attention calls "
                         "update_dsa")

    def update_dsa(self, layer, k, v, index_keys):
        """k, v: [B, H, T, D]; index_keys: [B, T, d_index]. Returns K, V [B, H, n, D] and the index keys [B, n, di]."""
        K, V, index = self.append(layer, k, v, index_keys[:, None])
        return K, V, index[:, 0]


class MultiHeadAttention_DSA_KVCache(MultiHeadAttention_KVCache):
    """MultiHeadAttention_DSA through a DSACache: T new queries select among the n cached tokens."""

    def __init__(self, d_model, n_heads, d_head, dropout_p, top_k, n_index_heads, d_index):
        super().__init__(d_model, n_heads, d_head, dropout_p)
        self.indexer = LightningIndexer(d_model, n_index_heads, d_index)
        self.top_k = top_k

    def forward(self, x, kv_cache=None, max_seqlen=None, layer=0):
        # x: [B, T, d_model]
        Q = self.split_heads(self.query_proj(x))  # [B, H, T, D]
        K = self.split_heads(self.key_proj(x))
        V = self.split_heads(self.value_proj(x))
        K, V, index_keys = kv_cache.update_dsa(layer, K, V, self.indexer.keys(x))  # [B, H, n, D], [B, n, di]
        mask = select_topk(self.indexer.scores(x, index_keys), self.top_k)  # [B, T, n]
        out = kv_cache.attend(layer, self.attention, Q, K, V, mask[:, None])  # [B, H, T, D]
        return self.dropout(self.out_proj(self.merge_heads(out))), (K, V)


class GPTlite_DSA_KVCache(GPTlite_KVCache):
    """GPTlite_DSA with a cached forward pass (its state dict): forward(idx, kv_cache) -> (logits, DSACache)."""
    config_class = DSAConfig

    def __init__(self, vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, top_k, n_index_heads,
                 d_index, d_ff=None):
        check_dsa_args(top_k, n_index_heads, d_index)
        super().__init__(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff)
        use_dsa(self, MultiHeadAttention_DSA_KVCache, DSAConfig(vocab_size, d_model, n_heads, d_head, n_layers,
                                                                dropout_p, seqlen, d_ff, top_k=top_k,
                                                                n_index_heads=n_index_heads, d_index=d_index))

    @classmethod
    def of(cls, model):
        """The cached model of a GPTlite_DSA: the same config and weights (copied), device and mode."""
        cached = cls(**model.config.to_dict())
        cached.load_state_dict(model.state_dict())
        return cached.to(next(model.parameters()).device).train(model.training)

    def forward(self, idx, kv_cache=None, max_seqlen=None):
        """idx: [B, T] new tokens after the DSACache's entries (None: a new one of max_seqlen, default seqlen).
        Returns logits [B, T, vocab] and the DSACache."""
        if kv_cache is None:
            kv_cache = DSACache(self.config.n_layers, max_seqlen or self.seqlen)
        if not isinstance(kv_cache, DSACache):
            raise ValueError(f"GPTlite_DSA_KVCache decodes with a DSACache (it caches the index keys too), got a "
                             f"{type(kv_cache).__name__}")
        cache = self.open_cache(kv_cache, max_seqlen, idx.shape[0])
        return self.forward_cache(idx, cache), cache

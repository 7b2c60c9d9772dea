"""GPTlite: the small character-level GPT of the post, trained on tiny Shakespeare.

    python gptlite.py --preset cpu              # train checkpoints/cpu.pt and print a sample
    python gptlite.py --preset gptlite --iters 5000

Blog section: "Background: how a GPT generates text, and where the time goes". A decoder-only transformer with learned token and
position embeddings, pre-LayerNorm blocks of multi-head attention and a ReLU MLP, and a linear head.
Every other model of this repository (KV cache, GQA, MLA, pruned, distilled) loads this model's
state dict where the architecture matches, so the attribute names below are part of the interface.
Every model carries its constructor arguments as `model.config` (a GPTliteConfig, or a variant's
subclass of it): read sizes there, and rebuild a model with `type(model).from_config(model.config)`.
"""
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


def scaled_dot_product_attention(Q, K, V, causal_mask=True, dropout=None):
    """The explicit reference attention: scores matrix, causal mask, softmax, weighted values."""
    # Q, K, V: [B, H, S, D]
    d_head = Q.shape[-1]
    scores = Q @ K.transpose(-2, -1) / d_head**0.5  # [B, H, S, S]
    if causal_mask:
        S = Q.shape[-2]
        mask = torch.ones(S, S, dtype=torch.bool, device=Q.device).tril()  # [S, S], True = attend
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = F.softmax(scores, dim=-1)  # [B, H, S, S]
    if dropout is not None:
        weights = dropout(weights)
    return weights @ V  # [B, H, S, D]


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads, d_head, dropout_p):
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_head
        # n_heads * d_head need not equal d_model (the post's preset: 6 x 64 = 384 against 512)
        self.query_proj = nn.Linear(d_model, n_heads * d_head)
        self.key_proj = nn.Linear(d_model, n_heads * d_head)
        self.value_proj = nn.Linear(d_model, n_heads * d_head)
        self.out_proj = nn.Linear(n_heads * d_head, d_model)
        self.dropout = nn.Dropout(dropout_p)

    def split_heads(self, x):
        B, S, _ = x.shape  # [B, S, H*D]
        return x.view(B, S, -1, self.d_head).transpose(1, 2)  # [B, H, S, D]

    def merge_heads(self, x):
        B, _, S, _ = x.shape  # [B, H, S, D]
        return x.transpose(1, 2).reshape(B, S, -1)  # [B, S, H*D]

    def forward(self, x):
        # x: [B, S, d_model]
        Q = self.split_heads(self.query_proj(x))  # [B, H, S, D]
        K = self.split_heads(self.key_proj(x))
        V = self.split_heads(self.value_proj(x))
        out = scaled_dot_product_attention(Q, K, V, causal_mask=True, dropout=self.dropout)
        return self.dropout(self.out_proj(self.merge_heads(out)))  # [B, S, d_model]


class FeedForward(nn.Module):
    def __init__(self, d_model, dropout_p, d_ff=None):
        super().__init__()
        d_ff = d_ff or 4 * d_model  # hidden neurons; fewer after structured pruning
        self.net = nn.Sequential(
            nn.Linear(d_model, d_ff),
            nn.ReLU(),
            nn.Linear(d_ff, d_model),
            nn.Dropout(dropout_p),
        )

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    def __init__(self, d_model, n_heads, d_head, dropout_p, d_ff=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.mha = MultiHeadAttention(d_model, n_heads, d_head, dropout_p)
        self.ln2 = nn.LayerNorm(d_model)
        self.ffwd = FeedForward(d_model, dropout_p, d_ff)

    def forward(self, x):
        x = x + self.mha(self.ln1(x))  # pre-LayerNorm residual blocks
        x = x + self.ffwd(self.ln2(x))
        return x


@dataclasses.dataclass(frozen=True)
class GPTliteConfig:
    """The constructor arguments of GPTlite, which every model keeps as `model.config`. The variants
    (GQA, MLA, ...) subclass it with their own fields. `dataclasses.replace(config, n_heads=2, d_ff=40)`
    is the config of a pruned model; `Model.from_config(config)` builds one with new weights."""
    vocab_size: int
    d_model: int      # embedding width
    n_heads: int      # attention heads per block
    d_head: int       # width of one head (n_heads * d_head need not equal d_model)
    n_layers: int     # transformer blocks
    dropout_p: float  # dropout while training
    seqlen: int       # context window: positions 0 .. seqlen-1 have an embedding
    d_ff: int | None = None  # MLP hidden neurons per block; None: the default 4 * d_model (stored as the number)

    def __post_init__(self):
        if self.d_ff is None:  # frozen: set through object.__setattr__, once, here
            object.__setattr__(self, "d_ff", 4 * self.d_model)

    def to_dict(self):
        """The keyword arguments of the model's constructor as checkpoints store them: a plain dict, d_ff
        only when it is not the default 4 * d_model (so an unpruned model's dict is its preset's)."""
        kwargs = dataclasses.asdict(self)
        if kwargs["d_ff"] == 4 * self.d_model:
            del kwargs["d_ff"]
        return kwargs

    @classmethod
    def from_dict(cls, kwargs):
        """The config of a dict of constructor keyword arguments (a checkpoint's "config"); a missing or
        unknown key is a ValueError that names it."""
        fields = dataclasses.fields(cls)
        required = {f.name for f in fields if f.default is dataclasses.MISSING}
        missing, unknown = sorted(required - set(kwargs)), sorted(set(kwargs) - {f.name for f in fields})
        if missing or unknown:
            raise ValueError(f"not the constructor arguments of a {cls.__name__}: missing {missing or 'none'}, "
                             f"unknown {unknown or 'none'}; a variant's checkpoint needs its own config class")
        return cls(**kwargs)


class GPTlite(nn.Module):
    config_class = GPTliteConfig  # what from_config takes; each variant names its own

    def __init__(self, vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff=None):
        super().__init__()
        self.config = GPTliteConfig(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff)
        self.seqlen = seqlen  # the context window: positions 0 .. seqlen-1 have an embedding
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(seqlen, d_model)
        # d_ff: MLP hidden neurons per block (default 4 * d_model); a pruned model's config sets it
        self.blocks = nn.Sequential(*[Block(d_model, n_heads, d_head, dropout_p, d_ff) for _ in range(n_layers)])
        self.ln = nn.LayerNorm(d_model)
        self.fc_out = nn.Linear(d_model, vocab_size)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        # small normal weights and zero biases (GPT-2, nanoGPT): trains faster than PyTorch's defaults,
        # whose N(0, 1) embeddings dwarf the residual updates
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @classmethod
    def from_config(cls, config):
        """A new model (fresh weights) of `config`, an instance of this class's config_class."""
        if type(config) is not cls.config_class:
            raise ValueError(f"{cls.__name__} is built from a {cls.config_class.__name__}, got a "
                             f"{type(config).__name__}; give the config of a model of this class")
        return cls(**config.to_dict())

    def forward(self, idx):
        B, S = idx.shape  # idx: [B, S] token ids
        if S > self.seqlen:
            raise ValueError(f"GPTlite takes at most seqlen={self.seqlen} tokens, got {S}; crop the input")
        positions = torch.arange(S, device=idx.device)
        x = self.token_embedding(idx) + self.position_embedding(positions)  # [B, S, d_model]
        x = self.blocks(x)
        return self.fc_out(self.ln(x))  # [B, S, vocab_size]


def check_generation_args(model, prompt, n_tokens, seqlen):
    """Clear errors for bad generation input, before any work starts."""
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.dtype != torch.long:
        raise ValueError("prompt must be a LongTensor of token ids of shape [batch, length]; "
                         "for one prompt use prompt[None]")
    if prompt.shape[0] < 1 or prompt.shape[1] < 1:
        raise ValueError(f"prompt is empty (shape {tuple(prompt.shape)}): give at least one token")
    if not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive integer, got {n_tokens!r}")
    if not isinstance(seqlen, int) or not 1 <= seqlen <= model.seqlen:
        raise ValueError(f"seqlen must be an integer between 1 and the model's seqlen={model.seqlen}, got {seqlen!r}")
    vocab_size = model.config.vocab_size
    if prompt.min() < 0 or prompt.max() >= vocab_size:
        raise ValueError(f"prompt holds token ids outside the vocabulary [0, {vocab_size}): "
                         f"found {prompt.min().item()} .. {prompt.max().item()}")
    if prompt.shape[1] > seqlen:
        raise ValueError(f"prompt of {prompt.shape[1]} tokens is longer than the window seqlen={seqlen}; "
                         f"shorten it, e.g. keep its last {seqlen} tokens: prompt[:, -{seqlen}:]")


# ----------------------------------------------------------------------------------------------------
# Generation: the repository's one decode loop, a step and a sampler plugged into it.

def greedy(logits):
    """The sampler of greedy decoding: the most likely next token of each row, logits [B, vocab] -> [B, 1]."""
    return logits.argmax(dim=-1, keepdim=True)


def decode_loop(step, tokens, n_tokens, sample=greedy):
    """The one decode loop every generation of the repository goes through. `step(tokens)` takes the
    tokens not yet seen [B, T] (the prompt, or a prefix of pending tokens, on the first call; then the
    token just chosen, [B, 1]) and returns the logits of the next position [B, vocab]: it holds its cache
    (or re-encodes its window, window_step). `sample(logits)` picks the next token [B, 1] (greedy; a
    temperature sampler; identity where the step samples itself, as a compiled step does). Returns the
    n_tokens new tokens [B, n_tokens]."""
    new = []
    for _ in range(n_tokens):
        tokens = sample(step(tokens))
        new.append(tokens)
    return torch.cat(new, dim=1) if new else tokens[:, :0]


def window_step(forward, seqlen):
    """A decode_loop step without a cache: every call appends its tokens to the window of the last `seqlen`
    tokens and re-encodes that window whole, `forward(window [B, <=seqlen])` -> logits [B, <=seqlen, vocab]
    (or a tuple whose first element they are, as a cached model returns)."""
    window = None

    def step(tokens):
        nonlocal window
        window = (tokens if window is None else torch.cat([window, tokens], dim=1))[:, -seqlen:]
        out = forward(window)
        return (out[0] if isinstance(out, tuple) else out)[:, -1]  # [B, vocab]
    return step


@torch.inference_mode()
def generate(model, prompt, n_tokens, seqlen):
    """Greedy decoding without a cache: every step re-encodes the last `seqlen` tokens (sliding window).

    prompt: [B, S] token ids. Returns the prompt followed by the n_tokens new tokens, [B, S + n_tokens]."""
    check_generation_args(model, prompt, n_tokens, seqlen)
    return torch.cat([prompt, decode_loop(window_step(model, seqlen), prompt, n_tokens)], dim=1)


if __name__ == "__main__":
    # The command line is the CLI module's (lib/harness.py) and the training inference_utils'; importing
    # gptlite imports neither (run as a script this file is the module __main__, another module object).
    import inference_utils as iu
    from lib import harness
    harness.run(lambda: harness.training_cli("Train a GPTlite checkpoint and print a generated sample.",
                                             iu.train_checkpoint, lambda m, p, n: generate(m, p, n, m.seqlen), 300))

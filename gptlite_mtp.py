"""GPTlite with multi-token prediction (DeepSeek-V3's MTP, depth 1): besides the next token, an MTP module
predicts the token after it from [RMSNorm(h_t), RMSNorm(embedding(x_{t+1}))], one transformer block and the
model's own head. It is trained with the model (loss = next-token loss + weight x MTP loss, the gradient of
the MTP loss reaching the main model too); at inference the main model is a plain GPTlite and the MTP module
its speculative draft (main_speculative_decoding.py, part 2 of the post).

    python main_speculative_decoding.py          # trains checkpoints/cpu_mtp.pt from cpu.pt, once

The state dict is GPTlite's plus `mtp.*`; `main_model()` is the GPTlite alone, `mtp` the draft head.
"""
import torch
import torch.nn.functional as F

from gptlite import GPTlite
from lib.draft_heads import FeatureHead, feature_loss


class GPTlite_MTP(GPTlite):
    def __init__(self, vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff=None):
        super().__init__(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff)
        self.mtp = FeatureHead(d_model, n_heads, d_head, normed=True)
        self.mtp.apply(self._init_weights)

    def hidden(self, idx):
        """The last block's states [B, S, d_model] (GPTlite.forward before its LayerNorm and head)."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.blocks(self.token_embedding(idx) + self.position_embedding(positions))

    def forward(self, idx):
        """The main model's logits [B, S, vocab]: the next token, as GPTlite's."""
        return self.fc_out(self.ln(self.hidden(idx)))

    def main_model(self):
        """The GPTlite alone (a new module with a copy of the main weights)."""
        model = GPTlite(**self.config.to_dict()).to(self.fc_out.weight.device)
        model.load_state_dict({k: v for k, v in self.state_dict().items() if not k.startswith("mtp.")})
        return model.eval()


def mtp_loss_fn(weight):
    """train_steps' loss_fn: cross entropy of the next token + weight x that of the token after it (MTP)."""
    def loss_fn(model, x, y):
        h = model.hidden(x)  # [B, S, d]
        main = F.cross_entropy(model.fc_out(model.ln(h)).flatten(0, 1), y.flatten())
        _, mtp = feature_loss(model.mtp, model, x, y, h=h, regression=0.0, ce=1.0)
        return main + weight * mtp
    return loss_fn

"""The model presets: plain data, one place."""
import dataclasses
from dataclasses import dataclass

from lib.errors import GPTliteError


@dataclass(frozen=True)
class Preset:
    name: str
    d_model: int       # embedding width
    n_heads: int       # attention heads per block
    d_head: int        # width of one head (n_heads * d_head need not equal d_model)
    n_layers: int      # transformer blocks
    dropout_p: float   # dropout while training
    seqlen: int        # context window in characters
    batch_size: int    # training batch, in sequences of seqlen
    lr: float          # peak AdamW learning rate (warm-up, then cosine decay to lr/10)
    iters: int         # training steps of the checkpoint
    vocab_size: int = 65  # tiny Shakespeare has 65 distinct characters

    def gptlite_kwargs(self):
        """The keyword arguments of GPTlite(...) for this preset (the dict its checkpoint stores; the model
        built from them carries them as model.config, a GPTliteConfig)."""
        return dict(vocab_size=self.vocab_size, d_model=self.d_model, n_heads=self.n_heads,
                    d_head=self.d_head, n_layers=self.n_layers, dropout_p=self.dropout_p,
                    seqlen=self.seqlen)


PRESETS = {
    # the post's model: 6 layers, d_model 512, 6 heads of 64, seqlen 128 (about 19M parameters)
    "gptlite": Preset("gptlite", d_model=512, n_heads=6, d_head=64, n_layers=6, dropout_p=0.1,
                      seqlen=128, batch_size=32, lr=6e-4, iters=5000),
    # the post's smaller student: fewer layers, smaller embedding, same vocabulary and window
    "distilled": Preset("distilled", d_model=256, n_heads=4, d_head=64, n_layers=3, dropout_p=0.1,
                        seqlen=128, batch_size=32, lr=1e-3, iters=5000),
    # a 0.8M-parameter model that trains on 2 CPU cores in minutes
    "cpu": Preset("cpu", d_model=128, n_heads=4, d_head=32, n_layers=4, dropout_p=0.0,
                  seqlen=128, batch_size=32, lr=3e-3, iters=800),
}


def student_preset(preset):
    """The student of a teacher preset: half the width, half the layers, 2/3 of the heads (same head
    width), the teacher's window, batch and dropout. For gptlite this is exactly the distilled preset."""
    student = dataclasses.replace(preset, name=f"{preset.name}-student", d_model=preset.d_model // 2,
                                  n_layers=max(preset.n_layers // 2, 1),
                                  n_heads=max(round(preset.n_heads * 2 / 3), 1))
    if preset.name == "gptlite":
        distilled = PRESETS["distilled"]
        assert student.gptlite_kwargs() == distilled.gptlite_kwargs(), "the rule must give the distilled preset"
        return distilled
    return student


def get_preset(name):
    if isinstance(name, Preset):
        return name
    if name not in PRESETS:
        raise GPTliteError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]

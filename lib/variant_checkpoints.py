"""The model variants' checkpoints: where each lives, how it is trained, loaded and verified. The model
files (gptlite_*.py) hold the models only; what trains or loads them is here, beside inference_utils'
rule for every trained file (cached_model)."""
import torch
import torch.nn.functional as F

import inference_utils as iu
from gptlite_gqa import GPTlite_GQA
from gptlite_moe import GPTlite_MoE
from gptlite_rope import GPTlite_RoPE
from lib import corpus, files, presets, training
from lib.errors import CheckpointError


def load_variant(path, model_class, key, what, rebuild, vocab=None, device="cpu"):
    """The `model_class` saved at `path` by a script (its config holds `key`, e.g. n_groups), verified, in
    eval mode; `what` names the kind of checkpoint and `rebuild` the command in the errors."""
    ckpt = files.load_checkpoint(path, vocab=vocab, rebuild=rebuild)
    if key not in ckpt["config"]:
        raise CheckpointError(f"{path} is not a {what} checkpoint (no {key} in its config); "
                              f"make one with: {rebuild}")
    model = model_class(**ckpt["config"])
    model.load_state_dict(ckpt["state_dict"])
    return model.to(device).eval()


def load_gqa(path, device="cpu"):
    """The uptrained GPTlite_GQA that `python main_gqa.py --save PATH` saved (its config holds n_groups)."""
    return load_variant(path, GPTlite_GQA, "n_groups", "GQA", f"python main_gqa.py --save {path}", device=device)


def moe_checkpoint(preset_name, n_experts, top_k, d_expert, router, balanced=True):
    """Where main_moe.py keeps its MoE of these settings (trained with or without balancing)."""
    return files.checkpoint_path(f"{preset_name}_moe_e{n_experts}k{top_k}h{d_expert}_{router}_"
                                 f"{'balanced' if balanced else 'unbalanced'}")


def load_moe(path, vocab=None, device="cpu"):
    """A GPTlite_MoE saved by main_moe.py (its config holds n_experts)."""
    return load_variant(path, GPTlite_MoE, "n_experts", "mixture-of-experts", "python main_moe.py (with the settings of this file)",
                        vocab, device)


# ----------------------------------------------------------------------------------------------------
# The rotary GPTlite (gptlite_rope.py): trained with gptlite.py's recipe.

def rope_checkpoint(preset):
    return files.checkpoint_path(f"{presets.get_preset(preset).name}_rope")


def rebuild_command(preset):
    return f"python gptlite_rope.py --preset {preset.name}"


def train_rope(preset, data, device, iters=None, seed=0, path=None, overwrite=False):
    """Train GPTlite_RoPE with gptlite.py's recipe (steps, batch, learning rate, seed); save it atomically (a
    trained file of another recipe is replaced only with `overwrite`)."""
    recipe, path = iu.preset_recipe(preset, iters, seed), path or rope_checkpoint(preset)
    iu.check_replace(path, recipe, overwrite)
    torch.manual_seed(seed)
    model = GPTlite_RoPE(**preset.gptlite_kwargs()).to(device)
    print(f"training the rotary GPTlite ({iu.n_params(model) / 1e6:.2f}M parameters) for {recipe['iters']} steps "
          f"on {device}")
    train = lambda m: iu.train_recipe(m, data, recipe, f"training {preset.name}_rope")  # noqa: E731
    return iu.train_and_save(model, model.config.to_dict(), path, train, data.vocab,
                             rebuild_command(preset), stamp=recipe)[0]


def load_rope(preset, device, data, untrained=False, seed=0):
    """The rotary GPTlite of checkpoints/<preset>_rope.pt, trained first when missing or stale (random with
    untrained)."""
    recipe = iu.preset_recipe(preset, seed=seed)
    torch.manual_seed(seed)
    model = GPTlite_RoPE(**preset.gptlite_kwargs()).to(device)
    train = lambda m: iu.train_recipe(m, data, recipe, f"training {preset.name}_rope")  # noqa: E731
    return iu.cached_model(model, model.config.to_dict(), rope_checkpoint(preset), train, data.vocab,
                           rebuild_command(preset), stamp=recipe, untrained=untrained, retrains=True)[0]


# ----------------------------------------------------------------------------------------------------
# The start-token model: the same rotary GPTlite trained the way LLMs are, on documents (speaker turns) that
# begin at position 0 after a reserved start token (id = the vocabulary size; one more embedding row, never a
# target). The random windows above never start anywhere in particular, so nothing in them is a fixed first
# token to park attention on; here position 0 always holds the same token, and attention sinks can form.

START_STEPS = 600  # main_sparse_attention's default: 3/4 of the cpu preset's 800, for its first-run time


def start_token_id(data):
    """The reserved start token: the id after the last character."""
    return len(data.vocab)


def start_token_checkpoint(preset):
    return files.checkpoint_path(f"{presets.get_preset(preset).name}_rope_start")


def document_batches(data, split, seed=0):
    """draw(batch_size, seqlen) -> (x, y) packed document sequences of `split` ("train" or "val"), seeded."""
    tokens = getattr(data, split)
    starts = corpus.document_starts(tokens, data.vocab.index("\n"))
    generator = torch.Generator().manual_seed(seed)
    return lambda batch_size, seqlen, device="cpu": corpus.document_batch(
        tokens, starts, start_token_id(data), batch_size, seqlen, generator, device)


@torch.no_grad()
def document_loss(model, data, n_batches=10, batch_size=32, seed=1234):
    """Mean cross entropy (nats per character) on fixed-seed validation document sequences, the start
    token never a target."""
    def loss(model, x, y):
        logits = training.logits_of(model(x))  # [B, S, vocab + 1]
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=corpus.IGNORE)
    return training.validation_loss(model, data, n_batches, batch_size, loss=loss,
                                    batches=document_batches(data, "val", seed))


def load_start_token(preset, device, data, iters=START_STEPS, untrained=False, seed=0, path=None):
    """The rotary GPTlite trained on documents after a start token (checkpoints/<preset>_rope_start.pt),
    trained first when missing or stale (random with untrained): the recipe of gptlite.py with `iters` steps;
    path: another file (tests).
    train_steps draws random windows; the loss here ignores them and trains on a document batch of the same
    size from its own seeded stream."""
    recipe = iu.preset_recipe(preset, iters, seed)
    torch.manual_seed(seed)
    model = GPTlite_RoPE(**dict(preset.gptlite_kwargs(), vocab_size=start_token_id(data) + 1)).to(device)
    draw = document_batches(data, "train", seed)

    def loss_fn(m, x, y):  # the random window x, y is replaced by packed documents of the same shape
        xd, yd = draw(x.shape[0], x.shape[1], x.device)
        return F.cross_entropy(training.logits_of(m(xd)).flatten(0, 1), yd.flatten(), ignore_index=corpus.IGNORE)

    def train(m):
        return iu.train_recipe(m, data, recipe, f"training {preset.name}_rope_start", loss_fn=loss_fn,
                               evaluate=lambda m: document_loss(m, data))
    stamp = dict(recipe, data="speaker turns, packed, each after start token id len(vocab)")
    rebuild = f"python main_sparse_attention.py --preset {preset.name} --start-steps {recipe['iters']}"
    return iu.cached_model(model, model.config.to_dict(), path or start_token_checkpoint(preset), train, data.vocab,
                           rebuild, stamp=stamp, untrained=untrained, retrains=True)[0]

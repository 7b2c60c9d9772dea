"""model.config: every model carries the constructor arguments it was built with (GPTliteConfig, or a
variant's subclass), a pruned model reports its pruned sizes, a model rebuilt from its config takes its
state dict strictly, and the checkpoint dicts of before the config existed still load and compare equal."""
import copy
import dataclasses

import pytest
import torch
from conftest import TINY, randomized

import inference_utils as iu
from gptlite import GPTlite, GPTliteConfig
from gptlite_gqa import GPTlite_GQA, GQAConfig
from gptlite_kvcache import GPTlite_KVCache
from gptlite_linear import GPTlite_Linear, LinearConfig, linear_config
from gptlite_mla import GPTlite_MLA, MLAConfig
from gptlite_rope import GPTlite_RoPE
from gptlite_tp import GPTlite_TP, TPConfig
from lib import files, presets
from lib.errors import CheckpointError
from gptlite_moba import GPTlite_MoBA, MoBAConfig
from main_pruning import prune

FOUR_HEADS = dict(TINY, n_heads=4)  # 4 heads: 2 groups, 2 tensor-parallel ranks

# (model class, its config class, constructor keyword arguments): every model class of the repository
VARIANTS = [
    (GPTlite, GPTliteConfig, TINY),
    (GPTlite, GPTliteConfig, dict(TINY, d_ff=40)),  # a pruned model's width
    (GPTlite_KVCache, GPTliteConfig, TINY),
    (GPTlite_RoPE, GPTliteConfig, TINY),
    (GPTlite_GQA, GQAConfig, dict(FOUR_HEADS, n_groups=2)),
    (GPTlite_MLA, MLAConfig, dict(TINY, d_latent=12)),
    (GPTlite_MLA, MLAConfig, dict(TINY, d_latent=12, absorb=False, d_ff=24)),
    (GPTlite_Linear, LinearConfig, dict(TINY, rule="gated", hybrid_every=2, chunk_size=4)),
    (GPTlite_Linear, LinearConfig, dict(TINY)),  # the defaults: rule "delta", no softmax block
    (GPTlite_TP, TPConfig, dict(FOUR_HEADS, world_size=2)),
    (GPTlite_MoBA, MoBAConfig, dict(TINY, block_size=4, top_k=2)),
]
IDS = [f"{cls.__name__}-{i}" for i, (cls, _, _) in enumerate(VARIANTS)]


@pytest.mark.parametrize("model_class, config_class, kwargs", VARIANTS, ids=IDS)
def test_config_is_what_the_model_was_built_with(model_class, config_class, kwargs):
    config = config_class(**kwargs)
    assert model_class(**kwargs).config == config
    assert model_class.from_config(config).config == config
    assert type(model_class(**kwargs).config) is config_class
    for name, value in kwargs.items():  # field by field, against the keyword arguments themselves
        assert getattr(config, name) == value, name
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.n_heads = 1


@pytest.mark.parametrize("model_class, config_class, kwargs", VARIANTS, ids=IDS)
def test_a_model_rebuilt_from_its_config_takes_its_state_dict_strictly(model_class, config_class, kwargs):
    model = randomized(model_class(**kwargs))
    rebuilt = type(model).from_config(model.config)
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    again = type(model)(**model.config.to_dict())  # the checkpoint's way: the plain dict as keyword arguments
    again.load_state_dict(model.state_dict(), strict=True)
    assert rebuilt.config == again.config == model.config


def test_the_default_mlp_width_is_stored_as_its_number_and_left_out_of_the_dict():
    config = GPTliteConfig(**TINY)
    assert config.d_ff == 4 * TINY["d_model"] and config == GPTliteConfig(**TINY, d_ff=4 * TINY["d_model"])
    assert config.to_dict() == TINY  # exactly the keyword arguments of before: no d_ff key
    assert GPTliteConfig(**TINY, d_ff=40).to_dict() == dict(TINY, d_ff=40)
    assert GPTlite(**TINY).blocks[0].ffwd.net[0].out_features == config.d_ff


@pytest.mark.parametrize("n_heads, n_neurons", [(2, 40), (1, 20), (3, 128)])
def test_a_pruned_model_reports_its_heads_and_mlp_width(tiny_models, n_heads, n_neurons):
    base, _ = tiny_models
    scores = torch.Generator().manual_seed(0)
    heads = torch.rand(TINY["n_layers"], TINY["n_heads"], generator=scores)
    neurons = torch.rand(TINY["n_layers"], 4 * TINY["d_model"], generator=scores)
    pruned = prune(copy.deepcopy(base), heads, neurons, n_heads, n_neurons)
    assert pruned.config == dataclasses.replace(base.config, n_heads=n_heads, d_ff=n_neurons)
    assert pruned.config.n_heads == n_heads and pruned.config.d_ff == n_neurons
    mha, mlp = pruned.blocks[0].mha, pruned.blocks[0].ffwd.net  # the config says what the weights are
    assert mha.query_proj.out_features == n_heads * TINY["d_head"] and mlp[0].out_features == n_neurons
    assert base.config == GPTliteConfig(**TINY)  # the original is untouched
    for model_class in (GPTlite, GPTlite_KVCache):  # the pruned model rebuilt from its config, both ways
        rebuilt = model_class.from_config(pruned.config)
        rebuilt.load_state_dict(pruned.state_dict(), strict=True)
    cached = iu.kv_cache_model(pruned)
    assert cached.config == pruned.config
    x = torch.randint(TINY["vocab_size"], (2, TINY["seqlen"]), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(cached(x)[0], pruned(x))


def test_mla_attention_mode_is_kept_in_the_config():
    model = GPTlite_MLA(**TINY, d_latent=12)
    assert model.set_absorb(False).config.absorb is False
    assert GPTlite_MLA.from_config(model.config).blocks[0].mha.absorb is False
    assert model.set_absorb(True).config == MLAConfig(**TINY, d_latent=12)


def test_a_model_is_rebuilt_from_its_own_config_class_only():
    gqa = GPTlite_GQA(**FOUR_HEADS, n_groups=2)
    with pytest.raises(ValueError, match="GPTlite_KVCache is built from a GPTliteConfig, got a GQAConfig"):
        GPTlite_KVCache.from_config(gqa.config)
    with pytest.raises(ValueError, match="GPTlite_GQA is built from a GQAConfig"):
        GPTlite_GQA.from_config(GPTliteConfig(**FOUR_HEADS))
    with pytest.raises(ValueError, match="GPTlite_KVCache is built from a GPTliteConfig, got a GQAConfig"):
        iu.kv_cache_model(gqa)  # not silently a multi-head model without n_groups


# ----------------------------------------------------------------------------------------------------
# Checkpoints: the config is stored as the plain dict of keyword arguments it always was.

# the "config" dicts that checkpoints of before model.config hold, with the model each was saved from
OLD_CHECKPOINT_CONFIGS = [
    (GPTlite, GPTliteConfig, dict(TINY)),  # a preset checkpoint: no d_ff
    (GPTlite, GPTliteConfig, dict(TINY, n_heads=2, d_ff=40)),  # main_pruning.py --save
    (GPTlite_GQA, GQAConfig, {**FOUR_HEADS, "n_groups": 2}),  # main_gqa.py --save
    (GPTlite_Linear, LinearConfig, linear_config(TINY, "delta", 4)),  # main_linear_attention.py: no chunk_size
    (GPTlite_Linear, LinearConfig, linear_config(TINY, "gated", None)),
    (GPTlite_MoBA, MoBAConfig, {**TINY, "block_size": 4, "top_k": 2}),  # main_moba.py
]
OLD_IDS = [f"{cls.__name__}-{i}" for i, (cls, _, _) in enumerate(OLD_CHECKPOINT_CONFIGS)]


@pytest.mark.parametrize("model_class, config_class, old_dict", OLD_CHECKPOINT_CONFIGS, ids=OLD_IDS)
def test_old_checkpoint_configs_load_and_compare_equal(tmp_path, model_class, config_class, old_dict):
    model = randomized(model_class(**old_dict))
    old, new = tmp_path / "old.pt", tmp_path / "new.pt"
    files.save_checkpoint(old, model, old_dict, "abc")  # as the scripts saved it: the plain dict
    files.save_checkpoint(new, model, model.config.to_dict(), "abc")  # as they save it now
    assert files.load_checkpoint(new)["config"] == old_dict  # the same dict, key for key
    assert files.load_checkpoint(new)["sha256"] == files.load_checkpoint(old)["sha256"]
    ckpt = files.load_checkpoint(old, config=model.config.to_dict(), vocab="abc")  # compared equal
    assert config_class.from_dict(ckpt["config"]) == model.config
    assert config_class.from_dict(ckpt["config"]).to_dict() == old_dict
    rebuilt = model_class(**ckpt["config"])  # the documented way to load a checkpoint
    rebuilt.load_state_dict(ckpt["state_dict"], strict=True)
    assert rebuilt.config == model.config


def test_a_checkpoint_of_another_config_is_still_refused(tmp_path):
    model = GPTlite(**TINY)
    files.save_checkpoint(tmp_path / "m.pt", model, model.config.to_dict(), "abc")
    for other in (dataclasses.replace(model.config, d_ff=40), GQAConfig(**TINY, n_groups=1)):
        with pytest.raises(CheckpointError, match="another configuration"):
            files.load_checkpoint(tmp_path / "m.pt", config=other.to_dict())


def test_from_dict_names_missing_and_unknown_keys():
    with pytest.raises(ValueError, match=r"missing \['n_groups'\], unknown none"):
        GQAConfig.from_dict(TINY)
    with pytest.raises(ValueError, match=r"missing none, unknown \['n_groups'\]"):
        GPTliteConfig.from_dict({**TINY, "n_groups": 2})
    without_seqlen = {k: v for k, v in TINY.items() if k != "seqlen"}
    with pytest.raises(ValueError, match=r"missing \['seqlen'\]"):
        GPTliteConfig.from_dict(without_seqlen)


def test_a_preset_builds_the_model_whose_config_its_checkpoint_stores():
    for preset in presets.PRESETS.values():
        config = GPTlite(**preset.gptlite_kwargs()).config
        assert type(config) is GPTliteConfig and config.d_ff == 4 * preset.d_model
        assert config.to_dict() == preset.gptlite_kwargs() == dict(
            vocab_size=preset.vocab_size, d_model=preset.d_model, n_heads=preset.n_heads, d_head=preset.d_head,
            n_layers=preset.n_layers, dropout_p=preset.dropout_p, seqlen=preset.seqlen)
    assert not hasattr(iu, "model_config")  # one name, one thing: model.config


def test_a_merged_lora_copy_of_a_gqa_model_keeps_its_groups():
    """merge_adapter rebuilds any model class from its config: a GQA model stays a GQA model (its
    constructor needs n_groups, which a config read off the modules of GPTlite left out)."""
    import gptlite_lora as gl
    gqa = randomized(GPTlite_GQA(**FOUR_HEADS, n_groups=2))
    adapter = gl.random_adapter(gqa, 2, ("query_proj", "key_proj"), seed=0, std=0.3)
    merged = gl.merge_adapter(gqa, adapter)
    assert type(merged) is GPTlite_GQA and merged.config == gqa.config
    key = dict(merged.named_parameters())["blocks.0.mha.key_proj.weight"]
    assert key.shape == (2 * TINY["d_head"], TINY["d_model"])  # the groups' keys, with the update added
    assert torch.equal(key, gqa.blocks[0].mha.key_proj.weight + adapter.delta(1))

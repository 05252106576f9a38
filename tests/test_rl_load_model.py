"""``load_model``: the one place the ``rl`` backend tells the built-in tiny Qwen3 from a real
model directory, giving each role the part of the model it needs.

The real side is a real Hugging Face directory (the tiny architecture saved with
``save_pretrained`` at a seed of its own), read back with ``from_pretrained``; the tiny side is
built from its configuration and has no files.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aurora.runtime.rlbackend import load_model
from tests.test_ledger_service import job_spec


@pytest.fixture(scope="module")
def real_dir(tmp_path_factory):
    from aurora.models import TinyQwen3Config, build_default, save_pretrained

    model, tokenizer = build_default(TinyQwen3Config(init_seed=7))
    where = tmp_path_factory.mktemp("real") / "model"
    save_pretrained(model, tokenizer, where)
    return where, model


def test_every_use_of_a_real_directory_reads_its_files_and_pins_the_same_manifest(
    tmp_path, real_dir
):
    import torch

    where, saved = real_dir
    spec = job_spec(tmp_path, model=str(where))
    arch = load_model(spec, "architecture")
    trainer = load_model(spec, "trainer")
    served = load_model(spec, "served")
    copied = load_model(spec, "directory")
    config = load_model(spec, "config")
    # from_pretrained of the directory: its weights (saved bf16), in each role's precision
    name, weight = next(iter(saved.state_dict().items()))
    assert arch.model.state_dict()[name].dtype == torch.bfloat16
    assert torch.equal(arch.model.state_dict()[name], weight.to(torch.bfloat16))
    assert trainer.model.state_dict()[name].dtype == torch.float32
    assert torch.equal(trainer.model.state_dict()[name], weight.to(torch.bfloat16).float())
    assert trainer.weights_hash is None  # only the tiny model is warm-started
    # every use that loads files pins the same manifest of them
    files = arch.manifest()
    assert files and trainer.manifest() == files == served.manifest() == copied.manifest()
    assert copied.path() != str(where)  # vLLM reads a private copy, hashed as it was made
    assert config.config.vocab_size == saved.config.vocab_size == served.config.vocab_size
    assert served.tokenizer("1+7").input_ids == arch.tokenizer("1+7").input_ids
    with pytest.raises(ValueError, match="configuration"):
        config.manifest()


def test_the_tiny_model_is_built_from_its_configuration_with_the_builtin_manifest(tmp_path):
    from aurora.models import TinyQwen3Config, tiny_manifest

    spec = job_spec(tmp_path, model="tiny")
    arch = load_model(spec, "architecture")
    served = load_model(spec, "served")
    copied = load_model(spec, "directory")
    vocab = TinyQwen3Config().hf_config().vocab_size
    assert load_model(spec, "config").config.vocab_size == vocab == arch.model.config.vocab_size
    assert arch.manifest() == served.manifest() == copied.manifest() == tiny_manifest()
    assert served.generation_eos == []
    assert (Path(copied.path()) / "config.json").exists()  # the architecture, saved for vLLM
    with pytest.raises(ValueError, match="directory"):
        arch.path()


def test_a_missing_model_directory_is_refused_in_one_line(tmp_path):
    spec = job_spec(tmp_path, model=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="no such model directory"):
        load_model(spec, "config")

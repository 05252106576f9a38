"""The default model and tokenizer, loading any HF directory, export, and the warm-start cache."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from aurora.delta.hf import bf16_views  # noqa: E402
from aurora.models import (  # noqa: E402
    ALPHABET,
    ModelLoadError,
    TinyQwen3Config,
    arithmetic_tokenizer,
    build_default,
    load,
    save_pretrained,
)
from aurora.rl.warmstart import WarmStartConfig, WarmStartError, warm_start  # noqa: E402
from aurora.store import CheckpointStore  # noqa: E402


def test_the_tokenizer_has_one_token_per_character_and_prepends_bos():
    tok = arithmetic_tokenizer()
    assert len(tok) == len(ALPHABET) == 17
    ids = tok("12+345=").input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == 8
    assert tok.decode(ids[1:]) == "12+345="
    batch = tok(["1+2=", "123+456="], padding=True)
    assert batch.input_ids[0][:4] == [tok.pad_token_id] * 4  # left padding for generation


def test_the_default_model_is_the_measured_tiny_qwen3():
    model, _ = build_default()
    assert sum(p.numel() for p in model.parameters()) == 494_464
    names = list(bf16_views(model.to(torch.bfloat16)))
    assert any(n.endswith("self_attn.q_proj.weight") for n in names)
    assert "lm_head.weight" not in names  # tied to the embedding, listed once


def test_the_same_init_seed_gives_the_same_weights():
    a, _ = build_default(TinyQwen3Config(init_seed=5))
    b, _ = build_default(TinyQwen3Config(init_seed=5))
    c, _ = build_default(TinyQwen3Config(init_seed=6))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_an_exported_directory_loads_with_stock_from_pretrained_and_gives_the_same_logits(tmp_path):
    model, tok = build_default(dtype=torch.bfloat16)
    save_pretrained(model, tok, tmp_path / "m")
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert stock.dtype == torch.bfloat16
    stock_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    x = torch.tensor([stock_tok("12+34=").input_ids])
    with torch.no_grad():
        assert torch.equal(stock(input_ids=x).logits, model(input_ids=x).logits)
    again, tok2 = load(tmp_path / "m")
    assert tok2.padding_side == "left"
    for name, bits in bf16_views(model).items():
        assert np.array_equal(bf16_views(again)[name], bits), name


def test_export_writes_the_given_published_weights_not_the_models(tmp_path):
    model, tok = build_default(dtype=torch.bfloat16)
    state = {k: v.copy() for k, v in bf16_views(model).items()}
    state["model.norm.weight"][:] = 0x3F80  # 1.0 in bf16 -> 1.0 everywhere
    state["model.norm.weight"][0] = 0x4000  # 2.0
    save_pretrained(model, tok, tmp_path / "m", state=state)
    loaded, _ = load(tmp_path / "m")
    assert loaded.model.norm.weight[0].item() == 2.0


def test_export_refuses_to_overwrite_and_leaves_no_partial_directory(tmp_path):
    model, tok = build_default(dtype=torch.bfloat16)
    save_pretrained(model, tok, tmp_path / "m")
    with pytest.raises(FileExistsError, match="m exists"):
        save_pretrained(model, tok, tmp_path / "m")
    with pytest.raises(ModelLoadError, match="not parameters"):
        save_pretrained(model, tok, tmp_path / "n", state={"nope": np.zeros(3, np.uint16)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_model_path_that_does_not_exist_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match=f"model path {tmp_path / 'missing'} does not exist"):
        load(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load("./no/such/model")


def test_a_directory_that_is_not_a_model_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelLoadError, match="is a file"):
        load(tmp_path / "file")


def test_a_tokenizer_that_does_not_match_the_model_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    model, tok = build_default(dtype=torch.bfloat16)
    save_pretrained(model, tok, tmp_path / "m")
    vocab = {f"w{i}": i for i in range(100)} | {"<eos>": 100, "<unk>": 101}
    big = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    big.pre_tokenizer = pre_tokenizers.Whitespace()
    other = transformers.PreTrainedTokenizerFast(tokenizer_object=big, eos_token="<eos>")
    other.save_pretrained(tmp_path / "m")  # overwrite the tokenizer files only
    with pytest.raises(ModelLoadError, match=r"102 tokens but the model's embedding has 17 rows"):
        load(tmp_path / "m")


def test_an_unreachable_hub_id_is_named(monkeypatch):
    import huggingface_hub.constants

    # no network here: fail at once rather than after the hub client's retries
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        ModelLoadError, match="cannot load model 'aurora-no-such-org/no-such-model'"
    ):
        load("aurora-no-such-org/no-such-model")


# ------------------------------------------------------------------------------------------
# Warm start (with a threshold reached at once: the procedure, not its length, is tested here)
# ------------------------------------------------------------------------------------------


def quick(**kw):
    return WarmStartConfig(threshold=0.0, eval_every=1, validation_size=8, batch_size=8, **kw)


def test_the_warm_start_is_cached_as_the_v0_snapshot_and_reused(tmp_path):
    first = warm_start(quick(), cache_dir=tmp_path)
    assert not first.cached and first.info["steps"] == 1
    store = CheckpointStore(first.path)
    state, h = store.snapshot(0)
    assert h == first.weights_hash
    assert all(np.array_equal(state[k], first.state[k]) for k in state)
    # the returned fp32 model holds exactly the snapshot's bf16 values
    views = bf16_views(first.model.to(torch.bfloat16))
    assert all(np.array_equal(views[k], state[k]) for k in state)
    calls = []
    second = warm_start(quick(), cache_dir=tmp_path, on_step=lambda s, loss: calls.append(s))
    assert second.cached and calls == [] and second.weights_hash == first.weights_hash


def test_a_changed_config_rebuilds_the_warm_start(tmp_path):
    a = warm_start(quick(), cache_dir=tmp_path)
    b = warm_start(quick(lr=1e-3), cache_dir=tmp_path)
    assert a.path != b.path and not b.cached
    assert a.weights_hash != b.weights_hash
    info = json.loads((b.path / "warmstart.json").read_text())
    assert info["config"]["lr"] == 1e-3


def test_a_failed_warm_start_leaves_no_snapshot(tmp_path):
    def interrupted(step, loss):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        warm_start(quick(), cache_dir=tmp_path, on_step=interrupted)
    never = WarmStartConfig(
        threshold=1.01, eval_every=1, max_steps=2, batch_size=8, validation_size=8
    )
    with pytest.raises(WarmStartError, match="did not reach 101%"):
        warm_start(never, cache_dir=tmp_path)
    for cfg in (quick(), never):
        root = tmp_path / "warmstart" / cfg.key()
        assert CheckpointStore(root).list().snapshots == ()
        assert list((root / "snapshots").iterdir()) == []  # no temporary file left either


def test_the_warmstart_command_builds_then_finds_the_snapshot_and_exports(tmp_path, capsys):
    from aurora.rl import cli

    args = [
        "warmstart",
        "--cache",
        str(tmp_path),
        "--threshold",
        "0",
        "--eval-every",
        "1",
        "--batch-size",
        "8",
    ]
    assert cli.main(args) == 0
    assert "built, 1 steps" in capsys.readouterr().out
    assert cli.main([*args, "--export", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "cached" in out and f"exported {tmp_path / 'hf'}" in out
    assert (
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").dtype == torch.bfloat16
    )
    assert cli.main([*args, "--batch-size", "0"]) == 2
    assert "WarmStartConfig.batch_size" in capsys.readouterr().err

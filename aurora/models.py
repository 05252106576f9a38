"""Models and tokenizers: the built-in tiny Qwen3, any transformers causal LM, and HF export.

Two ways to get ``(model, tokenizer)``: :func:`build_default`, a tiny Qwen3 with random weights
and an arithmetic tokenizer for machines without a GPU or hub access (:mod:`aurora.rl.warmstart`
gives it partial competence), and :func:`load`, any local Hugging Face directory or hub id
through ``from_pretrained`` (a path, directory or tokenizer that does not fit is a
:class:`ModelLoadError` naming the thing). Every role loads the job's model through
:func:`load_pinned`, from a private copy whose files were hashed as they were copied, and refuses
it unless its files are the ones the Trainer signed with its snapshots (:func:`tiny_manifest` is
the built-in model's). :func:`sign_model_dir` gives a directory the Trainer wrote a signed record
that :func:`verify_model_dir` (``aurora check-model``) checks; :func:`save_pretrained` writes a
Hugging Face directory that stock ``from_pretrained`` loads, all or nothing. Weights in the rest
of the package are ``{split name: uint16 array}`` bit patterns of bf16
(:func:`aurora.delta.hf.bf16_views`); :func:`state_to_torch` and :func:`load_state` convert.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

ALPHABET: tuple[str, ...] = (
    "<pad>",
    "<bos>",
    "<eos>",
    *"0123456789",
    "+",
    "-",
    "*",
    "=",
)
"""The default tokenizer's 17 symbols; ids are positions (pad 0, bos 1, eos 2)."""


class ModelLoadError(ValueError):
    """A model or tokenizer that cannot be loaded or does not fit together."""


@dataclass(frozen=True, kw_only=True)
class TinyQwen3Config:
    """The built-in default model: 494,464 parameters, 0.99 MB in bf16
    (docs/journal/early-measurements.md)."""

    hidden_size: int = 128
    """Width of the residual stream."""
    intermediate_size: int = 512
    """Width of the MLP (gate and up each)."""
    num_hidden_layers: int = 2
    """Transformer blocks."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention, as in Qwen3)."""
    head_dim: int = 32
    """Width of one head."""
    max_position_embeddings: int = 64
    """Longest sequence (prompt + completion) in tokens."""
    init_seed: int = 0
    """Seed of the random initialisation."""

    def hf_config(self) -> Any:
        from transformers import Qwen3Config

        return Qwen3Config(
            vocab_size=len(ALPHABET),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=True,
            pad_token_id=ALPHABET.index("<pad>"),
            bos_token_id=ALPHABET.index("<bos>"),
            eos_token_id=ALPHABET.index("<eos>"),
        )


def arithmetic_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` over :data:`ALPHABET`: one token per character (a
    ``tokenizers`` WordLevel model behind a one-character split), ``<bos>`` prepended, left
    padding (generation), decoded by plain concatenation."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(ALPHABET)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        padding_side="left",
    )


def cast_weights(model: Any, dtype: torch.dtype) -> Any:
    """Cast the parameters of ``model`` to ``dtype`` in place, leaving buffers alone.

    ``model.to(torch.bfloat16)`` would also round computed constants such as the rotary
    ``inv_freq`` buffer, which ``from_pretrained(dtype=torch.bfloat16)`` keeps in fp32; the
    logits would then differ from a stock load of the same weights by up to a bf16 ulp.
    """
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    return model


def build_default(
    config: TinyQwen3Config | None = None, *, dtype: torch.dtype = torch.float32
) -> tuple[Any, Any]:
    """(randomly initialised tiny Qwen3, its tokenizer); the same ``init_seed`` gives the same
    weights.

    A tiny Qwen3 from ``transformers.Qwen3Config`` (the paper's architecture family, so the fused
    ``qkv_proj`` / ``gate_up_proj`` names of the delta format are exercised) and a tokenizer made
    with the ``tokenizers`` library for the arithmetic alphabet (:func:`arithmetic_tokenizer`).
    """
    from transformers import Qwen3ForCausalLM

    cfg = config or TinyQwen3Config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        model = Qwen3ForCausalLM(cfg.hf_config())
    cast_weights(model, dtype)
    model.eval()
    return model, arithmetic_tokenizer()


def tiny_manifest(config: TinyQwen3Config | None = None) -> dict[str, str]:
    """The model manifest of the built-in tiny Qwen3 (:mod:`aurora.store.manifest`): it has no
    files, so one ``builtin:tiny`` entry hashes what it is built from (its configuration, the
    tokenizer's alphabet)."""
    from aurora.store import manifest

    cfg = config or TinyQwen3Config()
    definition = {
        "config": dataclasses.asdict(cfg),
        "tokenizer": {"alphabet": list(ALPHABET), "bos": "<bos>", "eos": "<eos>", "pad": "<pad>"},
    }
    return manifest.builtin("tiny", definition)


def local_dir(path_or_id: str | os.PathLike[str]) -> Path:
    """The local directory of a model named by path or hub id (a hub id: its snapshot in the
    Hugging Face cache, fetched if it is not there). Raises :class:`ModelLoadError`."""
    name = os.fspath(path_or_id)
    path = Path(name).expanduser()
    if path.exists() or isinstance(path_or_id, os.PathLike) or _looks_like_path(name):
        if not path.exists():
            raise ModelLoadError(f"model path {path} does not exist")
        if not path.is_dir():
            raise ModelLoadError(f"model path {path} is a file, not a Hugging Face model directory")
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=name))
    except Exception as exc:  # the hub's errors: not found, offline, unauthorised, bad id
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot fetch model {name!r}: {first[:200]}") from None


def load_pinned(
    path_or_id: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> tuple[Any, Any, dict[str, str]]:
    """``(model, tokenizer, manifest)``: :func:`load` of a private copy of the model's
    directory whose files were hashed as they were copied, so the manifest describes exactly
    what was loaded (:func:`aurora.store.manifest.pinned_copy`)."""
    from aurora.store import manifest

    where = local_dir(path_or_id)
    copy_dir, files = manifest.pinned_copy(where)
    try:
        model, tokenizer = load(copy_dir, dtype=dtype, device=device)
    except ModelLoadError as exc:  # named as the caller named it, not by the private copy
        raise ModelLoadError(str(exc).replace(str(copy_dir), str(where))) from None
    return model, tokenizer, files


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or os.sep in name.strip("/").split("/", 1)[0]


def load(
    path_or_id: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> tuple[Any, Any]:
    """(model, tokenizer) from a local Hugging Face directory or a hub id, via ``from_pretrained``.

    Raises :class:`ModelLoadError` naming the path or id when it does not exist, is not a model,
    or its tokenizer does not fit the model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = os.fspath(path_or_id)
    path = Path(name).expanduser()
    local = path.exists()
    if not local and (isinstance(path_or_id, os.PathLike) or _looks_like_path(name)):
        raise ModelLoadError(f"model path {path} does not exist")
    if local and not path.is_dir():
        raise ModelLoadError(f"model path {path} is a file, not a Hugging Face model directory")
    if local and not (path / "config.json").exists():
        raise ModelLoadError(
            f"model path {path} is not a Hugging Face model directory (no config.json)"
        )
    where = str(path) if local else name
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot load model {where!r}: {first}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot load the tokenizer of {where!r}: {first}") from None
    check_tokenizer(model, tokenizer, where)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # batched generation needs a pad id
    tokenizer.padding_side = "left"
    # transformers types its wrapped PreTrainedModel.to as taking the model, not a device
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    return model, tokenizer


def check_tokenizer(model: Any, tokenizer: Any, where: str) -> None:
    """Refuse a tokenizer whose ids do not fit the model's embedding (they do not belong
    together: every token id must index a row of the embedding)."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ModelLoadError(
            f"the tokenizer of {where!r} has {len(tokenizer)} tokens but the model's embedding "
            f"has {rows} rows: tokenizer and model do not match"
        )
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(f"the tokenizer of {where!r} has no end-of-sequence token")


# ------------------------------------------------------------------------------------------
# Weights as bf16 bit patterns
# ------------------------------------------------------------------------------------------


def state_to_torch(state: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """``{name: uint16 bits}`` -> ``{name: bf16 tensor}`` (copies)."""
    return {
        k: torch.from_numpy(np.ascontiguousarray(v).view(np.int16).copy()).view(torch.bfloat16)
        for k, v in state.items()
    }


def load_state(model: Any, state: Mapping[str, np.ndarray]) -> None:
    """Copy bf16 bit patterns into ``model``'s parameters (any dtype: bf16 values upcast exactly
    to fp32). Every bf16 tensor of the model must be given; names as in ``bf16_views``."""
    params = dict(model.state_dict(keep_vars=True))
    missing = [k for k in state if k not in params]
    if missing:
        raise ModelLoadError(f"weights {missing[:5]} are not parameters of the model")
    with torch.no_grad():
        for name, t in state_to_torch(state).items():
            p = params[name]
            if tuple(p.shape) != tuple(t.shape):
                raise ModelLoadError(f"weight {name}: shape {tuple(t.shape)}, model {p.shape}")
            p.data.copy_(t.to(p.dtype))


def save_pretrained(
    model: Any,
    tokenizer: Any,
    path: str | os.PathLike[str],
    *,
    state: Mapping[str, np.ndarray] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a Hugging Face model directory (bf16 ``model.safetensors``, config, generation
    config, tokenizer) that stock ``from_pretrained`` loads. ``state`` (bf16 bit patterns, e.g.
    the Trainer's published weights) replaces the model's own weights in the file. Written to a
    temporary directory and renamed: all or nothing.

    From a model (its own weights) or from published bf16 bit patterns (what the Trainer
    publishes).
    """
    from safetensors.torch import save_file

    out = Path(path)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen or not t.is_floating_point():
            continue  # tied lm_head: saved once, under the embedding's name
        seen.add(t.data_ptr())
        tensors[name] = t.detach().to("cpu", torch.bfloat16).contiguous()
    if state is not None:
        given = state_to_torch(state)
        unknown = sorted(set(given) - set(tensors))
        if unknown:
            raise ModelLoadError(f"weights {unknown[:5]} are not parameters of the model")
        tensors.update(given)
    config = copy.deepcopy(model.config)
    config.dtype = torch.bfloat16
    # The class that holds the head, as transformers' own save_pretrained writes it: without it
    # vLLM resolves the bare backbone (Qwen3Model), serves it as a pooling model and refuses
    # LLM.generate / `vllm serve` completions ("only supported for generative models").
    config.architectures = [type(model).__name__]
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ------------------------------------------------------------------------------------------
# A model directory the Trainer signed
# ------------------------------------------------------------------------------------------


def _weights_of(directory: Path) -> tuple[str, int, list[str]]:
    """``(weights hash, bytes, files)`` of the ``*.safetensors`` weights of ``directory``: the
    hash of every tensor's bf16 bit patterns (:func:`aurora.delta.weights_hash`, as a snapshot
    announcement signs it), their files' total size, and those files."""
    from safetensors import safe_open

    from aurora.delta import weights_hash

    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    state: dict[str, np.ndarray] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    t = st.get_tensor(name)
                    if t.dtype != torch.bfloat16:
                        raise ModelLoadError(f"{f.name}: tensor {name} is {t.dtype}, not bf16")
                    state[name] = t.contiguous().view(torch.int16).numpy().view(np.uint16)
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors' own error type is none of the builtin ones
            raise ModelLoadError(
                f"model {directory}: {f.name} is not a readable safetensors file ({exc})"
            ) from None
    return weights_hash(state), sum(f.stat().st_size for f in files), [f.name for f in files]


def sign_model_dir(
    directory: str | os.PathLike[str],
    *,
    job: str,
    version: int,
    chain_hash: str,
    signing_key: bytes,
) -> None:
    """Sign the Hugging Face directory ``directory`` (written by :func:`save_pretrained`) as
    version ``version`` of ``job`` (``chain_hash``: its h(v)): a snapshot announcement of its
    bf16 weights (their hash and bytes) and of the manifest of its other files, written to
    ``aurora.announce`` beside that manifest, ``aurora.manifest``."""
    from aurora.delta.announce import SnapshotAnnouncement, sign
    from aurora.delta.hashing import H
    from aurora.store import manifest

    root = Path(directory)
    h, size, _ = _weights_of(root)
    listed = manifest.encode(manifest.manifest_of(root))
    ann = SnapshotAnnouncement(
        job=job,
        version=version,
        weights_hash=h,
        chain_hash=chain_hash,
        size=size,
        model_hash=H(listed).hex(),
    )
    (root / "aurora.manifest").write_bytes(listed)
    (root / "aurora.announce").write_bytes(sign(ann, signing_key))


def verify_model_dir(directory: str | os.PathLike[str], *, public_key: bytes, job: str) -> Any:
    """The signed snapshot announcement of a model directory the Trainer wrote and signed
    (:func:`sign_model_dir`) once every file in it is the one signed: the announcement by the
    job's key, the manifest by its hash, each other file by the manifest, the weights by their
    hash and size. Raises :class:`aurora.store.manifest.ModelMismatchError` (one line naming
    the file that differs) or :class:`ModelLoadError`."""
    from aurora.delta.announce import AnnouncementError, SnapshotAnnouncement, verify
    from aurora.delta.hashing import H
    from aurora.store import manifest

    root = Path(directory)
    if not root.is_dir():
        raise ModelLoadError(f"model path {root} is not a directory")
    try:
        signed = (root / "aurora.announce").read_bytes()
        listed = (root / "aurora.manifest").read_bytes()
    except FileNotFoundError as exc:
        name = Path(str(exc.filename)).name
        raise manifest.ModelMismatchError(
            f"model {root}: {name} is missing: the directory carries no signed record"
        ) from None
    try:
        ann = verify(signed, public_key, job=job)
    except AnnouncementError as exc:
        raise manifest.ModelMismatchError(f"model {root}: aurora.announce: {exc}") from None
    if not isinstance(ann, SnapshotAnnouncement):
        raise manifest.ModelMismatchError(f"model {root}: aurora.announce is not a snapshot's")
    if H(listed).hex() != ann.model_hash:
        raise manifest.ModelMismatchError(
            f"model {root}: aurora.manifest differs from the manifest the Trainer signed"
        )
    manifest.check(
        manifest.manifest_of(root), manifest.decode(listed, what="aurora.manifest"), where=str(root)
    )
    h, size, files = _weights_of(root)
    for rel in manifest.files_of(root):
        if manifest.is_weights(rel) and rel not in files:
            raise manifest.ModelMismatchError(
                f"model {root}: {rel} is not in the model the Trainer signed; refusing to use it"
            )
    if h != ann.weights_hash or size != ann.size:
        named = ", ".join(files) or "the weights"
        raise manifest.ModelMismatchError(
            f"model {root}: {named} differs from the weights the Trainer signed (hash "
            f"{h[:12]}.., {size} bytes; signed {ann.weights_hash[:12]}.., {ann.size} bytes)"
        )
    return ann

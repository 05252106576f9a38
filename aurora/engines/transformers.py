"""The transformers engine: batched sampling with a KV cache on CPU (or CUDA), in-place deltas.

The engine owns a transformers causal LM whose parameters are **bf16**: they are the policy
version v, bit for bit, and the delta package writes D_{v+1} straight into their storage
(:func:`aurora.delta.hf.bf16_views` gives zero-copy ``uint16`` views; the delta names q/k/v and
gate/up fused, the apply path maps them back to transformers' split ``q_proj``/``k_proj``/...
by the fixed block offsets of :mod:`aurora.delta.extract`). Compute may run in another dtype
(``compute_dtype``: fp32 on a CPU without bf16 arithmetic), on an exact upcast copy refreshed
after every apply or load, so the sampled tokens and their log-probs come from exactly the bf16
weights of version v. :meth:`TransformersEngine.generate` records the log-prob of the
distribution each token was drawn from.
"""

from __future__ import annotations

import copy
import inspect
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from aurora.delta import Delta, apply_delta, weights_hash
from aurora.delta.hf import bf16_views
from aurora.engines.base import (
    Completion,
    EngineError,
    Sampling,
    decode_completion,
    encode_prompts,
    end_ids,
    weights_digest_of,
)
from aurora.models import cast_weights


class TransformersEngine:
    """:class:`aurora.engines.base.Engine` on a transformers causal LM.

    Compute may run in another dtype (``compute_dtype``). On a CPU without bf16 arithmetic (AVX2
    only, like this project's CI machine, where a bf16 forward is much slower than fp32) the
    default is fp32: a private fp32 copy of the model whose values are the bf16 weights upcast,
    which is exact, refreshed after every apply or load. The sampled tokens and their log-probs
    therefore come from exactly the bf16 weights of version v, computed in fp32. On CUDA the
    default is bf16 and no copy is kept.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        version: int = 0,
        weights_hash: str | None = None,
        compute_dtype: torch.dtype | None = None,
        seed: int = 0,
    ) -> None:
        """``model`` is converted to bf16 in place if it is not (those bf16 values are then the
        weights). ``weights_hash`` defaults to the snapshot hash of the model's bf16 weights
        (what :meth:`aurora.store.CheckpointStore.publish_snapshot` of them returns)."""
        cast_weights(model, torch.bfloat16)
        model.eval()
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        if compute_dtype is None:
            compute_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.compute_dtype = compute_dtype
        self._compute = (
            model
            if compute_dtype == torch.bfloat16
            else cast_weights(copy.deepcopy(model), compute_dtype)
        )
        self._compute.eval()
        # transformers 5 renamed the forward's ``past_key_values`` to ``cache``
        params = inspect.signature(self._compute.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._lock = threading.Lock()
        self._rng = torch.Generator(device=self.device).manual_seed(seed)
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_ids = end_ids(tokenizer, gen_eos)
        self.pad_id = int(
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.version = version
        self.weights_hash = weights_hash or self._snapshot_hash()

    @classmethod
    def from_pretrained(
        cls, path_or_id: str, *, device: str = "cpu", **kw: Any
    ) -> TransformersEngine:
        """An engine on a local Hugging Face directory or hub id (:func:`aurora.models.load`)."""
        from aurora.models import load

        model, tokenizer = load(path_or_id, dtype=torch.bfloat16, device=device)
        return cls(model, tokenizer, **kw)

    # -- weights -------------------------------------------------------------------------------

    def _cpu_views(self) -> tuple[dict[str, np.ndarray], dict[str, torch.Tensor]]:
        """uint16 views of the bf16 weights; on a GPU, views of CPU copies (and the copies)."""
        if self.device.type == "cpu":
            return bf16_views(self.model), {}
        copies: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in self.model.state_dict(keep_vars=True).items():
            if t.dtype != torch.bfloat16 or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            copies[name] = t.detach().to("cpu").contiguous()
        views = {k: v.view(torch.int16).numpy().view(np.uint16) for k, v in copies.items()}
        return views, copies

    def _write_back(self, copies: Mapping[str, torch.Tensor]) -> None:
        if copies:
            params = self.model.state_dict(keep_vars=True)
            with torch.no_grad():
                for name, t in copies.items():
                    params[name].data.copy_(t.to(self.device))
        self._refresh_compute()

    def _refresh_compute(self) -> None:
        if self._compute is self.model:
            return
        src = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, p in self._compute.named_parameters():
                p.data.copy_(src[name].data)  # bf16 -> fp32 is exact

    def _snapshot_hash(self) -> str:
        return weights_hash(self._cpu_views()[0])

    def state(self) -> dict[str, np.ndarray]:
        """Copies of the bf16 weights as ``{split name: uint16}`` (the snapshot layout)."""
        return {k: v.copy() for k, v in self._cpu_views()[0].items()}

    def weights_digest(self) -> str:
        return weights_digest_of(self._cpu_views()[0])

    def apply(self, delta: Delta) -> str:
        with self._lock:
            views, copies = self._cpu_views()
            h = apply_delta(
                delta,
                views,
                active_version=self.version,
                active_hash=self.weights_hash,
                # Off the main thread (an Actor applies in a worker) no signal can interrupt
                # the stores, which then skip their undo log (aurora.delta.apply).
                interruptible=threading.current_thread() is threading.main_thread(),
            )
            self._write_back(copies)
            self.version, self.weights_hash = delta.version, h
            return h

    def load(self, state: Mapping[str, np.ndarray], *, version: int, weights_hash: str) -> None:
        with self._lock:
            views, copies = self._cpu_views()
            if set(state) != set(views):
                raise EngineError(
                    f"snapshot names differ from the model's: {sorted(set(state) ^ set(views))[:5]}"
                )
            for name, bits in state.items():
                if views[name].shape != tuple(bits.shape):
                    raise EngineError(
                        f"snapshot tensor {name}: shape {bits.shape}, model {views[name].shape}"
                    )
            for name, bits in state.items():
                views[name][...] = bits
            self._write_back(copies)
            self.version, self.weights_hash = version, weights_hash

    # -- sampling ------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        """Token ids of each prompt (text through the tokenizer, BOS included)."""
        return encode_prompts(self.tokenizer, prompts)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of a completion: the tokens before the first end-of-sequence token."""
        return decode_completion(self.tokenizer, self.eos_ids, token_ids)

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], n: int, sampling: Sampling
    ) -> list[list[Completion]]:
        """Expand each prompt ``n`` times, left-pad the batch (position ids from the attention mask,
        so a padded prompt sees the positions an unpadded one would), run one prefill and then one
        cached decode step per token. Each step takes ``log_softmax(logits / T)`` once and samples
        from it with a ``torch.Generator`` (seeded per call when ``Sampling.seed`` is set, so a call
        is reproducible), so the recorded log-prob is the one of the distribution the token was
        drawn from. Sequences that sampled end-of-sequence are fed padding until every sequence is
        done or the token limit is reached.
        """
        if n < 1:
            raise ValueError(f"n: must be >= 1, got {n}")
        encoded = self.encode(prompts)
        if not encoded:
            return []
        longest = max(len(e) for e in encoded)
        if longest + sampling.max_new_tokens > self.max_positions:
            raise EngineError(
                f"prompt of {longest} tokens + max_new_tokens {sampling.max_new_tokens} exceeds "
                f"the model's max_position_embeddings {self.max_positions}"
            )
        with self._lock:
            tokens, logps = self._sample(
                [e for e in encoded for _ in range(n)], sampling, self._generator(sampling)
            )
        out: list[list[Completion]] = []
        for i in range(len(encoded)):
            group = []
            for j in range(n):
                row = i * n + j
                ids, lps = self._trim(tokens[row], logps[row])
                stop = bool(ids) and ids[-1] in self.eos_ids
                group.append(
                    Completion(
                        prompt_index=i,
                        token_ids=tuple(ids),
                        logprobs=tuple(lps),
                        text=self.decode(ids),
                        finish_reason="stop" if stop else "length",
                    )
                )
            out.append(group)
        return out

    def _generator(self, sampling: Sampling) -> torch.Generator:
        if sampling.seed is None:
            return self._rng
        return torch.Generator(device=self.device).manual_seed(sampling.seed)

    def _trim(self, tokens: list[int], logps: list[float]) -> tuple[list[int], list[float]]:
        for k, t in enumerate(tokens):
            if t in self.eos_ids:
                return tokens[: k + 1], logps[: k + 1]
        return tokens, logps

    def _sample(
        self, rows: list[list[int]], sampling: Sampling, gen: torch.Generator
    ) -> tuple[list[list[int]], list[list[float]]]:
        from transformers import DynamicCache

        model, dev = self._compute, self.device
        b, width = len(rows), max(len(r) for r in rows)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        logits = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        ).logits[:, -1, :]
        eos = torch.tensor(sorted(self.eos_ids), device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        out_tok, out_lp = [], []
        next_pos = pos[:, -1:] + 1
        for step in range(sampling.max_new_tokens):
            logits = logits.float()
            if sampling.temperature > 0:
                lp = torch.log_softmax(logits / sampling.temperature, dim=-1)
                tok = torch.multinomial(lp.exp(), 1, generator=gen).squeeze(1)
            else:
                lp = torch.log_softmax(logits, dim=-1)
                tok = lp.argmax(-1)
            tok = torch.where(done, torch.full_like(tok, self.pad_id), tok)
            out_tok.append(tok)
            out_lp.append(lp.gather(1, tok[:, None]).squeeze(1))
            done |= torch.isin(tok, eos)
            if bool(done.all()) or step == sampling.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=dev)], dim=1)
            logits = model(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=next_pos,
                use_cache=True,
                **{self._cache_kw: cache},
            ).logits[:, -1, :]
            next_pos = next_pos + 1
        toks = torch.stack(out_tok, 1).cpu().tolist()
        lps = torch.stack(out_lp, 1).cpu().tolist()
        return toks, lps

"""vLLM plugin: the ``aurora_delta`` weight-transfer engine and the worker extension.

Theory of operation
-------------------
vLLM builds a worker's weight-transfer engine with
``WeightTransferEngineFactory.create_engine(config, vllm_config, device, model)`` right after the
worker loads its model, by the name in ``weight_transfer_config["backend"]``. :func:`register`
adds ``aurora_delta`` to that factory (lazily: the factory imports this module when the engine is
first created). Importing this module registers it, and every vLLM worker imports it before it
loads its model when it is the ``worker_extension_cls`` (:class:`AuroraWorkerExtension`, which
:meth:`aurora.engines.vllm.VLLMEngine.launch` sets), so a stock ``vllm serve
--worker-extension-cls aurora.engines.vllm_plugin.AuroraWorkerExtension
--weight-transfer-config '{"backend": "aurora_delta"}'`` finds it too. (A
``vllm.general_plugins`` entry point calling :func:`register` would make the second flag
unnecessary; the package does not declare one yet.)

:class:`AuroraDeltaWeightTransferEngine` is a thin adapter: vLLM parses ``init_info`` and
``update_info`` into :class:`AuroraInitInfo` and :class:`AuroraUpdateInfo` (unknown keys are
refused by vLLM's ``parse_*_info``) and the engine hands them to a
:class:`aurora.engines.vllm.DeltaReceiver` holding this rank's parameters and tensor-parallel
rank. Updates are applied in place, so ``start_weight_update``/``finish_weight_update`` have
nothing to do (vLLM's layerwise reload is for engines that receive whole checkpoints).

:class:`AuroraWorkerExtension` (``worker_extension_cls``) adds one collective RPC,
``aurora_rank_state``, returning this rank's weights, version and h(v) so the driver can hash
the bits vLLM actually holds.

This module imports vLLM; nothing else in the package does at import time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from aurora.delta import Delta, read_delta
from aurora.engines.vllm import BACKEND, DeltaReceiver, ModelShape, rank_state_message


@dataclass
class AuroraInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``aurora_delta``: the weights the engine holds now."""

    version: int
    """Policy version v of the loaded weights."""
    weights_hash: str
    """h(v) of the loaded weights (hex)."""


@dataclass
class AuroraUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``aurora_delta``: one delta file, or one snapshot."""

    delta: bytes | str | None = None
    """The whole delta file D_{v+1} (base64 text when it came as JSON)."""
    path: str | None = None
    """...or a path to it that every worker can read."""
    expected_hash: str | None = None
    """h(v+1) the delta must produce (the Ledger's); checked against its trailer."""
    snapshot: bytes | str | None = None
    """Split bf16 weights as safetensors bytes (base64 text in JSON)."""
    snapshot_path: str | None = None
    """...or a safetensors file (a Checkpoint Store snapshot)."""
    version: int | None = None
    """Version of the snapshot."""
    weights_hash: str | None = None
    """h(v) the snapshot becomes."""


class AuroraDeltaWeightTransferEngine(WeightTransferEngine[AuroraInitInfo, AuroraUpdateInfo]):
    """Verified delta checkpoints applied in place into this rank's resident weights."""

    init_info_cls = AuroraInitInfo
    update_info_cls = AuroraUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        if int(vllm_config.parallel_config.pipeline_parallel_size) > 1:
            raise ValueError(f"weight transfer backend {BACKEND}: pipeline parallelism > 1")
        mc = self.model_config
        self.receiver = DeltaReceiver(
            lambda: dict(self.model.named_parameters()),
            ModelShape.of(getattr(mc, "hf_text_config", None) or mc.hf_config),
            rank=int(get_tensor_model_parallel_rank()),
            size=int(get_tensor_model_parallel_world_size()),
        )

    def init_transfer_engine(self, init_info: AuroraInitInfo) -> None:
        self.receiver.init(asdict(init_info))

    def start_weight_update(self) -> None:
        """Nothing to prepare: updates are written in place."""

    def finish_weight_update(self) -> None:
        """Nothing to finalise: each update synchronised the device when it was written."""

    def receive_weights(self, update_info: AuroraUpdateInfo) -> None:
        self.receiver.update(asdict(update_info))

    def shutdown(self) -> None:
        """No connection to close: updates arrive inside the RPC."""

    @staticmethod
    def trainer_send_weights(iterator: Iterator[Any], trainer_args: Any) -> None:
        """The sending side, as vLLM's interface has it: each item of ``iterator`` is a delta
        (a :class:`aurora.delta.Delta` or its file bytes), sent in order through
        ``trainer_args["client"]`` (anything with ``apply(delta)``: a :class:`VLLMEngine`, an
        initialised :class:`HTTPWeightClient`). AuroraRL's Trainer does not call this: its
        deltas reach Actors over the data plane, and each Actor applies them itself."""
        args = trainer_args if isinstance(trainer_args, Mapping) else vars(trainer_args)
        client = args["client"]
        for item in iterator:
            client.apply(item if isinstance(item, Delta) else read_delta(bytes(item)))


class AuroraWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): reads this rank's weights."""

    def aurora_rank_state(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, AuroraDeltaWeightTransferEngine):
            raise RuntimeError(
                f"aurora_rank_state needs weight_transfer_config backend {BACKEND!r}"
            )
        return rank_state_message(engine.receiver)


def register() -> None:
    """Register ``aurora_delta`` in vLLM's weight-transfer factory (idempotent: vLLM may load
    plugins more than once per process)."""
    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, __name__, "AuroraDeltaWeightTransferEngine"
        )
    except ValueError as exc:
        if "already registered" not in str(exc):
            raise


register()

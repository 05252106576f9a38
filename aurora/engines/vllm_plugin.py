"""vLLM plugin: the ``aurora_delta`` weight-transfer engine and the worker extension.

vLLM builds a worker's weight-transfer engine by the name in ``weight_transfer_config["backend"]``
right after the worker loads its model; :func:`register` adds ``aurora_delta`` to its factory.
:class:`AuroraDeltaWeightTransferEngine` is a thin adapter over vLLM 0.32-0.34's abstract base:
vLLM parses ``init_info``/``update_info`` into :class:`AuroraInitInfo`/:class:`AuroraUpdateInfo`
and the engine hands them to a :class:`aurora.engines.vllm_receiver.DeltaReceiver` holding this
rank's parameters; updates are in place, so starting and finishing an update do nothing.
:class:`AuroraWorkerExtension` adds the ``aurora_rank_state`` collective RPC (this rank's
weights, version and h(v)) for the content digest. The interface and the versions are in
``docs/VLLM.md``. This module imports vLLM; nothing else in the package does at import time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from aurora.engines.vllm_layout import ModelShape
from aurora.engines.vllm_messages import rank_state_message
from aurora.engines.vllm_receiver import BACKEND, DeltaReceiver


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


class AuroraWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): reads this rank's weights."""

    def aurora_rank_state(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, AuroraDeltaWeightTransferEngine):
            raise RuntimeError(
                f"aurora_rank_state needs weight_transfer_config backend {BACKEND!r}"
            )
        return rank_state_message(engine.receiver)

    def aurora_rank_state_text(self) -> dict[str, Any]:
        """The same with the tensors as base64 text: ``vllm serve``'s ``/collective_rpc``
        answers in JSON (:meth:`aurora.engines.vllm_http.HTTPWeightClient.rank_states`)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, AuroraDeltaWeightTransferEngine):
            raise RuntimeError(
                f"aurora_rank_state_text needs weight_transfer_config backend {BACKEND!r}"
            )
        return rank_state_message(engine.receiver, text=True)


def keep_cpu_weights_resident() -> bool:
    """On vLLM's CPU platform, make every 2-D linear (and the tied LM head) compute from its
    resident ``weight`` parameter; returns whether it changed anything (nothing off CPU).

    vLLM's CPU build prepares each unquantized linear after loading
    (``dispatch_cpu_unquantized_gemm`` in ``vllm/model_executor/layers/utils.py``): where oneDNN
    (or AMX, or zentorch) is available it packs the weight into an opaque kernel handle and,
    for linears, replaces the parameter with an empty one; the LM head keeps its parameter but
    computes from the packed copy. A weight written in place afterwards is then either gone
    (the apply refuses: the parameter has 0 elements) or, for the LM head, silently not used.
    This selects vLLM's own fallback of that same function (``torch.nn.functional.linear`` on
    the parameter at every call) for 2-D weights, so the bits :class:`DeltaReceiver` writes are
    the bits the forward uses. It must run before the worker loads its model: vLLM imports this
    module first (``vllm.general_plugins`` entry point and ``worker_extension_cls``). The cost
    is the packed GEMM's speed on CPU (docs/VLLM.md); CUDA is untouched."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import torch
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "aurora_resident", False):
        return True

    def dispatch(layer: Any, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:
            original(layer, remove_weight)  # conv and MoE weights: vLLM's own handling
            return
        layer.cpu_linear = torch.nn.functional.linear

    dispatch.aurora_resident = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch
    return True


def register() -> None:
    """Register ``aurora_delta`` in vLLM's weight-transfer factory (idempotent: vLLM may load
    plugins more than once per process), and on CPU keep the weights it writes resident
    (:func:`keep_cpu_weights_resident`).

    Every vLLM worker imports this module before it loads its model when it is the
    ``worker_extension_cls`` (:class:`AuroraWorkerExtension`), and any vLLM process finds it
    through the ``vllm.general_plugins`` entry point in ``pyproject.toml``.
    """
    keep_cpu_weights_resident()
    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, __name__, "AuroraDeltaWeightTransferEngine"
        )
    except ValueError as exc:
        if "already registered" not in str(exc):
            raise


register()

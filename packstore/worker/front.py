"""``packstore worker --engine vllm``: the worker as a front for a vLLM OpenAI server running ``PackstoreConnector`` over
the same store. It loads no weights (the tokenizer, chat template and identities: ``RenderingModel``), checks at start
that the engine serves the same model, template and dtype, and answers through ``EngineAnswerer``s
(``answering/engine_answer.py``) behind the worker's own gRPC and HTTP surfaces.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from packstore.answering.engine_client import EngineClient, EngineIdentity
from packstore.errors import InvalidInput, PackMismatch, Unavailable
from packstore.kv.models import RenderingModel, load_rendering_model
from packstore.worker.config import DEFAULT_CACHE_BYTES, WorkerConfig

ENGINE_START_SECONDS = 300.0  # how long the front waits at start for the vLLM server to answer (its own start takes minutes)
ENGINE_POLL_SECONDS = 2.0
log = logging.getLogger("packstore.worker")


def local_only_settings(config: WorkerConfig) -> list[str]:
    """The settings given that only the local engine uses (its device, threads, decoding and caches of packs): the
    front runs no model and reads no pack tensors."""
    given = {
        "device": config.device is not None, "threads": config.threads is not None, "exactness": config.exactness != "default",
        "decode": config.decode is not None, "plane_join": config.plane_join is not None,
        "cache_bytes": config.cache_bytes != DEFAULT_CACHE_BYTES, "host_cache_bytes": config.host_cache_bytes is not None,
        "reserve_memory": not config.reserve_memory,
    }
    return [name for name, set_ in given.items() if set_]


def check_engine_config(config: WorkerConfig) -> None:
    """InvalidInput for settings that do not go with the engine asked for (each named as its setting)."""
    if config.engine not in ("transformers", "vllm"):
        raise InvalidInput(f"unknown engine {config.engine!r}: transformers (the worker's own model) or vllm")
    if config.engine == "transformers":
        if config.engine_url:
            raise InvalidInput("engine_url names a vLLM server: it goes with engine 'vllm'")
        return
    if not config.engine_url:
        raise InvalidInput("engine 'vllm' needs engine_url, the vLLM OpenAI server the worker answers with")
    if refused := local_only_settings(config):
        raise InvalidInput(
            f"{', '.join(refused)}: only the worker's own engine uses {'these' if len(refused) > 1 else 'this'}; with engine "
            "'vllm', vLLM runs the model and its connector loads the packs (set them there)"
        )


def wait_for_engine(client: EngineClient, seconds: float = ENGINE_START_SECONDS) -> str:
    """The served model's name once the vLLM server answers ``/v1/models``; Unavailable naming the URL after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return client.served_name()
        except Unavailable:
            if time.monotonic() >= deadline:
                raise Unavailable(f"the vLLM server at {client.url} did not answer within {seconds:g} s", url=client.url) from None
            log.info("waiting for the vLLM server", extra={"fields": {"engine_url": client.url}})
            time.sleep(ENGINE_POLL_SECONDS)


def check_same_model(model: RenderingModel, engine: EngineIdentity, url: str) -> None:
    """PackMismatch naming both sides when the engine does not serve ``model`` (weights in its dtype, template)."""
    for what, ours, theirs in (("dtype", model.dtype_name, engine.dtype), ("model", model.model_fp, engine.model_fp),
                               ("template", model.template_fp, engine.template_fp)):
        if ours != theirs:
            raise PackMismatch(
                "template" if what == "template" else "model",
                f"{what} mismatch: the worker renders for {model.name!r} ({what} {ours[:16]}), the vLLM server at {url} serves "
                f"{engine.served_name!r} ({what} {theirs[:16]}): give the worker the model, dtype and chat template vLLM serves",
            )


def engine_front(config: WorkerConfig) -> tuple[RenderingModel, EngineClient, EngineIdentity]:
    """The front's model (tokenizer, template, identities) and its engine, checked to serve the same model."""
    client = EngineClient(config.engine_url)
    try:
        served = wait_for_engine(client)
        engine = client.identity(served)
        template = Path(config.chat_template).read_text(encoding="utf-8") if config.chat_template else None
        model = load_rendering_model(config.model, dtype=config.dtype, chat_template=template, device=f"vllm at {client.url}")
        check_same_model(model, engine, client.url)
    except BaseException:
        client.close()
        raise
    if not engine.saves:
        log.warning(
            "the vLLM server's connector does not save packs (allow_save): a bank's facts and chains not stored whole are "
            "prefilled on every ask", extra={"fields": {"engine_url": client.url}},
        )
    return model, client, engine

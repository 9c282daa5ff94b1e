"""The HTTP client of a vLLM OpenAI server that runs ``PackstoreConnector``: what ``packstore worker --engine vllm``
(``answering.engine_answer``) asks it. Three calls: the served model (``/v1/models``), who the engine is (one
non-streamed token with ``kv_transfer_params: {"identity": true}``), and a streamed completion of token ids.

Every failure to reach the server, or an answer that is not vLLM's, is ``Unavailable`` naming the URL; a request the
server refuses (a 4xx) is ``InvalidInput`` with vLLM's message. A completion cancelled from another thread
(``Cancel``) closes its response, which vLLM takes as the client gone and aborts the request.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import httpx

from packstore.errors import InvalidInput, Unavailable
from packstore.kv.device import Cancel, Left

CONNECT_SECONDS = 5.0  # reaching the server
READ_SECONDS = 600.0  # the longest wait for the next piece of a response (a long prompt's prefill on a CPU comes first)
CONNECTIONS = 64  # pooled connections to the server (a completion holds one while it streams)


@dataclass(frozen=True)
class EngineIdentity:
    """Who the engine behind the URL is, as its connector reports it (docs/protocol.md, "vLLM connector"): the served
    model's name there and identities, and what the connector does (saves, namespaces)."""

    served_name: str
    model_fp: str
    template_fp: str
    dtype: str
    engine: dict[str, Any]  # {"name", "version", "block_size"}: what the keys of packs this engine computes record
    saves: bool  # the connector's allow_save
    namespaces: tuple[str, ...]  # the namespaces a request may name; the first is the connector's default


@dataclass(frozen=True)
class Usage:
    """A completion's token counts as vLLM reports them; ``cached_tokens``: the prompt's tokens it did not prefill
    (served from its prefix cache or loaded by the connector; needs ``--enable-prompt-tokens-details``)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None


class EngineClient:
    """A vLLM OpenAI server at ``url`` (``http://HOST:PORT``, with or without ``/v1``); thread-safe (one pooled
    ``httpx.Client``)."""

    def __init__(self, url: str, *, read_seconds: float = READ_SECONDS) -> None:
        base = url.rstrip("/").removesuffix("/v1")
        if not base.startswith(("http://", "https://")):
            raise InvalidInput(f"engine URL {url!r} must start with http:// or https://")
        self.url = base
        limits = httpx.Limits(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS)
        timeout = httpx.Timeout(read_seconds, connect=CONNECT_SECONDS)
        self._http = httpx.Client(base_url=base, timeout=timeout, limits=limits)

    def close(self) -> None:
        self._http.close()

    def served_name(self) -> str:
        """The name vLLM serves its base model under (``/v1/models``: the entry that is not a LoRA adapter)."""
        listed = self._json("GET", "/v1/models").get("data")
        models = [entry for entry in listed or [] if isinstance(entry, dict) and isinstance(entry.get("id"), str)]
        bases = [entry for entry in models if not entry.get("parent")]
        if not bases:
            raise Unavailable(f"the vLLM server at {self.url} lists no model (/v1/models)", url=self.url)
        return str(bases[0]["id"])

    def identity(self, served_name: str) -> EngineIdentity:
        """Who the engine is: a one-token completion asking its connector (no pack loaded)."""
        body = {"model": served_name, "prompt": [0], "max_tokens": 1, "kv_transfer_params": {"identity": True, "pack": False}}
        answer = self._json("POST", "/v1/completions", body)
        report = answer.get("kv_transfer_params") or {}
        found = report.get("identity") if isinstance(report, dict) else None
        if not isinstance(found, dict):
            raise Unavailable(
                f"the vLLM server at {self.url} did not say who it is: it does not run PackstoreConnector (its KV "
                "transfer config must name kv_connector PackstoreConnector), or runs an older one",
                url=self.url,
            )
        if not isinstance(answer.get("usage"), dict) or answer["usage"].get("prompt_tokens_details") is None:
            raise Unavailable(
                f"the vLLM server at {self.url} does not report cached prompt tokens, which the answers' packstore object "
                "is made from: start it with vLLM's enable_prompt_tokens_details on",
                url=self.url,
            )
        try:
            return EngineIdentity(
                served_name, found["model_fp"], found["template_fp"], found["dtype"], dict(found["engine"]),
                bool(found.get("saves", False)), tuple(found.get("namespaces") or ("default",)),
            )
        except (KeyError, TypeError) as exc:
            raise Unavailable(f"the vLLM server at {self.url} reported an identity without {exc}", url=self.url) from None

    def complete(self, body: dict[str, Any], cancel: Cancel) -> Generator[list[int], None, Usage]:
        """Stream the completion ``body`` asks (``stream`` and usage are set here): each piece's token ids as it
        arrives, then returns its ``Usage``. ``cancel`` closes the response (vLLM aborts the request); the stream then
        raises Left."""
        body = body | {"stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
        usage: Usage | None = None
        closed = threading.Event()
        try:
            with self._http.stream("POST", "/v1/completions", json=body) as response:

                def close() -> None:
                    closed.set()
                    response.close()

                cancel.when_cancelled(close)
                if response.status_code != 200:
                    response.read()
                    raise self._refusal(response)
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    piece = json.loads(line[6:])
                    if "error" in piece:
                        raise Unavailable(f"the vLLM server at {self.url} failed the request: {piece['error']}", url=self.url)
                    for choice in piece.get("choices") or ():
                        if choice.get("token_ids"):
                            yield list(choice["token_ids"])
                    if piece.get("usage"):
                        usage = _usage(piece["usage"])
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            if closed.is_set() or cancel.cancelled:
                raise Left from None
            raise Unavailable(f"the vLLM server at {self.url} did not answer: {type(exc).__name__}: {exc}", url=self.url) from None
        if cancel.cancelled:
            raise Left
        if usage is None:
            raise Unavailable(f"the vLLM server at {self.url} ended a completion without its usage", url=self.url)
        return usage

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise Unavailable(f"the vLLM server at {self.url} did not answer: {type(exc).__name__}: {exc}", url=self.url) from None
        if response.status_code != 200:
            raise self._refusal(response)
        try:
            answer = response.json()
        except json.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            raise Unavailable(f"the server at {self.url} answered {path} with something that is not vLLM's JSON", url=self.url)
        return answer

    def _refusal(self, response: httpx.Response) -> InvalidInput | Unavailable:
        """A 4xx: the request was wrong (vLLM's message); anything else: the server is not able to answer."""
        try:
            message = response.json().get("error", {}).get("message") or response.text
        except (json.JSONDecodeError, AttributeError):
            message = response.text
        if 400 <= response.status_code < 500:
            return InvalidInput(f"the vLLM server at {self.url} refused the request ({response.status_code}): {message}")
        return Unavailable(f"the vLLM server at {self.url} answered {response.status_code}: {message}", url=self.url)


def _usage(raw: dict[str, Any]) -> Usage:
    details = raw.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(int(raw.get("prompt_tokens", 0)), int(raw.get("completion_tokens", 0)), cached)

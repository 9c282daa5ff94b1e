"""OpenAI chat-completions and completions bodies <-> the worker's records: a request body becomes the Worker's
``GenerateRequest`` (then a ``Question`` through ``messages.question_of``, the one mapping gRPC uses too), and an
``AnswerResult`` becomes the ``chat.completion`` or ``text_completion`` fields a client reads. A completion's
``prompt`` is asked exactly as a chat's one user message is (``completion_request``).

Kept apart from the HTTP server so the mapping is plain functions of dicts, tested without a socket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format

from packstore.answering.records import AnswerResult
from packstore.errors import InvalidInput, PackNotFound
from packstore.kv.inject import MAX_NEW_TOKENS, MAX_TEMPERATURE
from packstore.v1 import worker_pb2
from packstore.worker.messages import question_of

if TYPE_CHECKING:
    from packstore.answering.answer import Question

# the packstore fields beside OpenAI's, by the GenerateRequest field each fills (``steer`` and ``steer_layers`` apart)
EXTRA_FIELDS = {"packs": "packs", "bank": "bank", "top_k": "top_k", "probe": "probe", "embedder": "embedder", "mode": "mode"}
EXTRA_FIELDS |= {"adapter": "adapter", "steer_on": "steer_on", "compare_rag": "compare_rag", "rerank": "rerank"}
EXTRA_FIELDS |= {"rerank_weight": "rerank_weight"}
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
SAMPLING |= {"seed": "seed", "stop": "stop"}
READ_APART = {"model", "stream", "stream_options", "user", "steer", "steer_layers"}  # read apart, or (user) not used
# OpenAI fields this API does not implement, and the values that mean they are not asked for
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}), "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0), "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None,),
}
# /v1/completions: its own unsupported fields (``logprobs`` is a count there), no ``messages`` and no ``max_completion_tokens``
COMPLETION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "logprobs": (None,), "logit_bias": (None, {}),
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
}
CHAT_FIELDS = READ_APART | {"messages"} | set(EXTRA_FIELDS) | set(SAMPLING)
COMPLETION_FIELDS = READ_APART | {"prompt"} | set(EXTRA_FIELDS) | (set(SAMPLING) - {"max_completion_tokens"})
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}  # OpenAI's -> the template's


@dataclass(frozen=True)
class ChatRequest:
    """A chat-completions request as the worker runs it: the question, and how to send its answer."""

    question: Question
    stream: bool
    include_usage: bool


def _refuse(message: str, param: str) -> InvalidInput:
    return InvalidInput(message, param=param)


def _message_text(message: object, index: int) -> tuple[str, str]:
    """The (role, text) of one chat message: its content a string, or text parts joined."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise _refuse(f"{where} must be an object with role system, developer, user or assistant", "messages")
    if extra := ", ".join(sorted(set(message) - {"role", "content", "name"})):
        raise _refuse(f"{where} has fields this API does not support ({extra}): tool calls are not implemented", "messages")
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text" for part in content):
        content = "".join(str(part.get("text", "")) for part in content)
    if not isinstance(content, str):
        raise _refuse(f"{where}'s content must be text (a string, or parts of type text)", "messages")
    return ROLES[message["role"]], content


def _conversation(messages: object) -> tuple[tuple[tuple[str, str], ...], str]:
    """The earlier turns and the question of ``messages``: every message but the last, and the last, a user's."""
    if not isinstance(messages, list) or not messages:
        raise _refuse("messages must be a non-empty list of chat messages", "messages")
    turns = [_message_text(message, index) for index, message in enumerate(messages)]
    role, question = turns[-1]
    if role != "user" or not question.strip():
        raise _refuse("the last message must be a user message with non-empty text: the question to answer", "messages")
    return tuple(turns[:-1]), question


def chat_request(body: object, model: str) -> ChatRequest:
    """The ChatRequest a chat-completions ``body`` makes for the worker serving ``model``: PackNotFound with OpenAI's
    ``model_not_found`` code for another model, InvalidInput for anything else it cannot run (their ``param`` field
    naming the request field)."""
    fields = _checked_fields(body, model, CHAT_FIELDS, UNSUPPORTED)
    history, question = _conversation(fields.get("messages"))
    return _generate_request(fields, question, history)


def completion_request(body: object, model: str) -> ChatRequest:
    """The ChatRequest a completions ``body`` makes: its ``prompt`` (a string, or a list of exactly one) asked as a
    chat's one user message with the same packs, bank, steering and sampling, so it is rendered after the pack by the
    model's template and checked token for token as chat is; errors as ``chat_request``'s."""
    fields = _checked_fields(body, model, COMPLETION_FIELDS, COMPLETION_UNSUPPORTED)
    prompt = fields.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt.strip():
        raise _refuse("prompt must be a non-empty string (or a list of exactly one): one completion per request", "prompt")
    return _generate_request(fields, prompt, ())


def _checked_fields(body: object, model: str, known: set[str], unsupported: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """``body`` as a dict, refused unless it asks ``model``, its fields are ``known`` and the ``unsupported`` ones keep
    the values that mean they are not asked for."""
    if not isinstance(body, dict):
        raise _refuse("the body must be a JSON object", "body")
    if body.get("model") != model:
        message = f"the model {body.get('model')!r} does not exist here: this worker serves {model!r}"
        raise PackNotFound(message, param="model", code="model_not_found")
    for name, value in body.items():
        if name in unsupported and value not in unsupported[name]:
            raise _refuse(f"{name} is not supported by packstore's worker (one greedy or sampled text answer per request)", name)
        if name not in unsupported and name not in known:
            raise _refuse(f"unknown field {name!r}", name)
    return body


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # (JSON's true is no 1)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The Sampling message fields of ``body``'s OpenAI sampling fields, each checked for its type and range (a 400
    naming it): ``max_tokens`` an integer from 1, never 0 read as the default nor "5" as 5."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and not (_is_int(value) and 1 <= value <= MAX_NEW_TOKENS):
            raise _refuse(f"{name} must be an integer from 1 to {MAX_NEW_TOKENS}, got {value!r}", name)
    if (value := body.get("temperature")) is not None and not (_is_number(value) and 0 <= value <= MAX_TEMPERATURE):
        raise _refuse(f"temperature must be a number from 0 to {MAX_TEMPERATURE:g}, got {value!r}", "temperature")
    if (value := body.get("top_p")) is not None and not (_is_number(value) and 0 < value <= 1):
        raise _refuse(f"top_p must be a number in (0, 1], got {value!r}", "top_p")
    if (value := body.get("seed")) is not None and not (_is_int(value) and 0 <= value < 1 << 64):
        raise _refuse(f"seed must be an integer from 0 to 2**64 - 1, got {value!r}", "seed")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(text, str) for text in stop)):
        raise _refuse("stop must be a string or a list of strings", "stop")
    sampling = {target: body[name] for name, target in SAMPLING.items() if body.get(name) is not None}
    return sampling | ({"stop": stop} if stop is not None else {})


def _generate_request(body: dict[str, Any], question: str, history: tuple[tuple[str, str], ...]) -> ChatRequest:
    """The ChatRequest asking ``question`` after ``history`` with ``body``'s packstore, sampling and stream fields."""
    fields: dict[str, Any] = {target: body[name] for name, target in EXTRA_FIELDS.items() if body.get(name) is not None}
    sampling = _sampling(body)
    steer = body.get("steer") or []
    if not isinstance(steer, list) or not all(isinstance(entry, dict) and set(entry) <= {"pack", "alpha"} for entry in steer):
        raise _refuse('steer must be a list of {"pack": REF, "alpha": A}', "steer")
    fields["steering"] = [{"alpha": 1.0} | entry for entry in steer]  # alpha defaults to 1, as in ask --steer
    if (layers := body.get("steer_layers")) is not None:
        if not isinstance(layers, list) or len(layers) != 2:
            raise _refuse("steer_layers must be [FIRST, LAST]", "steer_layers")
        fields["steer_layers"] = {"first": layers[0], "last": layers[1]}
    fields |= {"question": question, "sampling": sampling, "history": [{"role": role, "content": text} for role, text in history]}
    try:
        request = json_format.ParseDict(fields, worker_pb2.GenerateRequest())
    except json_format.ParseError as exc:
        raise _refuse(f"invalid request: {exc}", "body") from None
    stream = body.get("stream") or False
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise _refuse("stream must be true or false, and stream_options an object", "stream")
    return ChatRequest(question_of(request), stream, bool(options.get("include_usage")))


def usage(result: AnswerResult, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage: the prompt tokens prefilled for this request (the question's, and the facts' where a
    composition or a bank's pack was computed for it), and the tokens generated."""
    prompt = result.kv_prompt_tokens + _prefilled_facts(result)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def _prefilled_facts(result: AnswerResult) -> int:
    """The facts' tokens prefilled for this request: a bank's pack built now is all prefilled, a composition its new part."""
    if result.pack_reused is False:
        return result.pack_tokens or 0
    return result.composed_tokens or 0


def packstore_fields(result: AnswerResult) -> dict[str, Any]:
    """The ``packstore`` object of an answer: the pack used and the keys composed into it, whether it was ready,
    the facts' tokens its cache served instead of the prompt, the bank's facts and steering applied, and with
    ``compare_rag`` whether the answer equals the facts' as prompt text."""
    fields: dict[str, Any] = {"pack": result.pack, "packs": result.parts or ([result.pack] if result.pack else [])}
    fields |= {"cache_hit": result.cache_hit, "prompt_tokens_saved": (result.pack_tokens or 0) - _prefilled_facts(result)}
    if result.facts is not None:
        fields["facts"] = result.facts
        if result.pack_reused is not None:  # the routed facts' pack: read from the store, or computed for this answer
            fields["facts_pack"] = "loaded" if result.pack_reused else "computed"
    if result.steering is not None:
        fields |= {"steering": result.steering, "steer_on": result.steer_on}
    if result.identical is not None:  # asked with compare_rag
        fields |= {"identical": result.identical, "chunked_identical": result.chunked_identical}
        fields["rag_prompt_tokens"] = result.rag_prompt_tokens
    return fields

"""Conversions between the worker's records (``Question``, ``AnswerResult``) and its protocol messages, for the
worker and its client alike.

A field the records and messages share by name is listed once below and converted both ways by one rule: a
message leaves a record's ``None`` unset, and an unset message field (zero, empty, or absent where the field has
presence) reads back as the record's default, except the ``*_VALUES``, read as sent (a False is no None).
``Question`` and ``Sampling`` are imported only to read a request, on the worker, so a client never loads the
model's libraries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from google.protobuf.message import Message

from packstore.answering.records import AnswerResult
from packstore.v1 import store_pb2, worker_pb2

if TYPE_CHECKING:
    from packstore.answering.answer import Question

# GenerateRequest
QUESTION_FIELDS = ("bank", "top_k", "probe", "embedder", "rerank", "rerank_weight", "compare_rag", "steer_on", "mode", "adapter")
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "seed", "stop")  # Sampling, both records and messages
RESULT_FIELDS = ("pack", "parts", "steer_on", "pack_tokens", "pack_reused")  # GenerateDone, unset meaning None
RESULT_VALUES = ("answer", "kv_prompt_tokens", "cache_hit")  # GenerateDone, as they are (False is no None)
RAG_VALUES = ("rag_answer", "rag_prompt_tokens", "identical")  # GenerateDone, as they are when it says ``compared``
RAG_FIELDS = ("chunked_identical",)  # GenerateDone when it says ``compared``, unset meaning None


def _to_message(record: object, names: Iterable[str]) -> dict[str, Any]:
    """The fields ``names`` of ``record`` as message fields: those that are None left unset."""
    return {name: value for name in names if (value := getattr(record, name)) is not None}


def _from_message(message: Message, names: Iterable[str], record_type: type | None = None) -> dict[str, Any]:
    """The fields ``names`` of ``message`` as record fields, a repeated one as a list; with the dataclass
    ``record_type``, an unset one takes that record's default."""
    fields = dataclasses.fields(record_type) if record_type else ()
    defaults = {field.name: field.default for field in fields if field.default is not dataclasses.MISSING}
    found = {}
    for name in names:
        field, value = message.DESCRIPTOR.fields_by_name[name], getattr(message, name)
        unset = not message.HasField(name) if field.has_presence else not value
        found[name] = defaults[name] if unset and name in defaults else list(value) if field.is_repeated else value
    return found


def generate_request(question: Question) -> worker_pb2.GenerateRequest:
    """The GenerateRequest that asks ``question``."""
    request = worker_pb2.GenerateRequest(
        question=question.text,
        packs=list(question.refs),
        sampling=worker_pb2.Sampling(**_to_message(question.sampling, SAMPLING_FIELDS)),
        steering=[worker_pb2.Steer(pack=ref, alpha=alpha) for ref, alpha in question.steering],
        history=[worker_pb2.Turn(role=role, content=content) for role, content in question.history],
        **_to_message(question, QUESTION_FIELDS),
    )
    if question.steer_layers is not None:
        request.steer_layers.first, request.steer_layers.last = question.steer_layers
    return request


def question_of(request: worker_pb2.GenerateRequest) -> Question:
    """The Question a GenerateRequest asks (checked as any Question is: InvalidInput when it does not hold)."""
    from packstore.answering.answer import Question
    from packstore.kv.inject import Sampling

    return Question(
        request.question,
        refs=tuple(request.packs),
        sampling=Sampling(**_from_message(request.sampling, SAMPLING_FIELDS, Sampling)),
        steering=tuple((steer.pack, steer.alpha) for steer in request.steering),
        steer_layers=(request.steer_layers.first, request.steer_layers.last) if request.HasField("steer_layers") else None,
        history=tuple((turn.role, turn.content) for turn in request.history),
        **_from_message(request, QUESTION_FIELDS, Question),
    )


def generate_done(result: AnswerResult, generated_tokens: int) -> worker_pb2.GenerateDone:
    """The GenerateDone that ends an answer: ``result`` and the ``generated_tokens`` streamed before it; the
    comparison with the facts as prompt text only when ``result`` has one."""
    compared = result.rag_answer is not None
    return worker_pb2.GenerateDone(
        generated_tokens=generated_tokens,
        facts=result.facts or [],
        composed_tokens=result.composed_tokens or 0,
        steering=[
            worker_pb2.SteerApplied(
                pack=applied["pack"],
                alpha=applied["alpha"],
                layers=store_pb2.LayerRange(first=applied["layers"][0], last=applied["layers"][1]),
            )
            for applied in result.steering or ()
        ],
        compared=compared,
        **_to_message(result, RESULT_FIELDS + RESULT_VALUES + (RAG_VALUES + RAG_FIELDS if compared else ())),
    )


def answer_result(done: worker_pb2.GenerateDone, question: Question) -> AnswerResult:
    """The AnswerResult a GenerateDone reports for ``question``."""
    return AnswerResult(
        question=question.text,
        bank=question.bank,
        facts=list(done.facts) if question.bank else None,
        composed_tokens=done.composed_tokens if done.parts else None,
        steering=[{"pack": a.pack, "alpha": a.alpha, "layers": [a.layers.first, a.layers.last]} for a in done.steering] or None,
        **_from_message(done, RESULT_FIELDS + (RAG_FIELDS if done.compared else ()), AnswerResult),
        **_from_message(done, RESULT_VALUES + (RAG_VALUES if done.compared else ())),
    )

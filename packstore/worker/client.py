"""Client of a ``packstore worker``: the same questions and results as a local ``Answerer``, answered remotely."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import grpc

from packstore.errors import PackstoreError
from packstore.answering.records import AnswerResult
from packstore.rpc.channel import Connection, GrpcClient
from packstore.v1 import worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    from packstore.answering.answer import Question


class WorkerClient(GrpcClient):
    """Asks a worker questions, streaming the answer's text as it is generated."""

    what = "worker"

    def __init__(self, address: str, *, timeout: float | None = None, connection: Connection | None = None) -> None:
        super().__init__(address, timeout=timeout, connection=connection)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    def ask(self, question: "Question", *, on_token: Callable[[str], None] | None = None) -> AnswerResult:
        """Answer ``question`` on the worker; ``on_token`` receives the text of each token as it comes.

        The result has the fields of a local ``Answerer.ask`` except ``pack_reused``, which the worker does not report.
        """
        sampling = question.sampling
        request = worker_pb2.GenerateRequest(
            packs=list(question.refs),
            bank=question.bank or "",
            top_k=question.top_k,
            probe=question.probe or 0,
            embedder=question.embedder or "",
            question=question.text,
            compare_rag=question.compare_rag,
            sampling=worker_pb2.Sampling(
                max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed
            ),
            steering=[worker_pb2.Steer(pack=ref, alpha=alpha) for ref, alpha in question.steering],
            steer_on=question.steer_on,
            mode=question.mode,
            adapter=question.adapter or "",
        )
        if question.steer_layers is not None:
            request.steer_layers.first, request.steer_layers.last = question.steer_layers
        done = None
        try:
            for response in self._stub.Generate(request, timeout=self.timeout):
                if response.WhichOneof("item") == "token" and on_token is not None and not response.token.stop:
                    on_token(response.token.text)
                elif response.WhichOneof("item") == "done":
                    done = response.done
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        if done is None:
            raise PackstoreError(f"worker at {self.address} ended the answer without a summary")
        return AnswerResult(
            question=question.text,
            answer=done.answer,
            kv_prompt_tokens=done.kv_prompt_tokens,
            rag_answer=done.rag_answer if done.compared else None,
            rag_prompt_tokens=done.rag_prompt_tokens if done.compared else None,
            identical=done.identical if done.compared else None,
            pack=done.pack or None,
            bank=question.bank,
            facts=list(done.facts) if question.bank else None,
            cache_hit=done.cache_hit,
            parts=list(done.parts) or None,
            composed_tokens=done.composed_tokens if done.parts else None,
            steering=[{"pack": a.pack, "alpha": a.alpha, "layers": [a.layers.first, a.layers.last]} for a in done.steering] or None,
            steer_on=done.steer_on or None,
        )

    def status(self) -> dict:
        """The worker's model, identities, device and ready-cache occupancy."""
        from google.protobuf.json_format import MessageToDict

        reply = self._call(lambda: self._stub.Status(worker_pb2.WorkerStatusRequest(), timeout=self.timeout))
        return MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)

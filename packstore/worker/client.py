"""Client of a ``packstore worker``: the same questions and results as a local ``Answerer``, answered remotely."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from packstore.answering.records import AnswerResult
from packstore.errors import PackstoreError
from packstore.rpc.channel import Connection, GrpcClient
from packstore.v1 import worker_pb2, worker_pb2_grpc
from packstore.worker.messages import answer_result, generate_request

if TYPE_CHECKING:
    from packstore.answering.answer import Question


class WorkerClient(GrpcClient):
    """Asks a worker questions, streaming the answer's text as it is generated."""

    what = "worker"

    def __init__(self, address: str, *, timeout: float | None = None, connection: Connection | None = None) -> None:
        super().__init__(address, timeout=timeout, connection=connection)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    def ask(self, question: Question, *, on_token: Callable[[str], None] | None = None) -> AnswerResult:
        """Answer ``question`` on the worker; ``on_token`` receives the text of each token as it comes.

        The result has the fields of a local ``Answerer.ask``.
        """
        done = None
        try:
            for response in self._stub.Generate(generate_request(question), timeout=self.timeout):
                if response.WhichOneof("item") == "token" and on_token is not None and not response.token.stop:
                    on_token(response.token.text)
                elif response.WhichOneof("item") == "done":
                    done = response.done
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        if done is None:
            raise PackstoreError(f"worker at {self.address} ended the answer without a summary")
        return answer_result(done, question)

    def status(self) -> dict:
        """The worker's model, identities, device and ready-cache occupancy."""
        from google.protobuf.json_format import MessageToDict

        reply = self._call(lambda: self._stub.Status(worker_pb2.WorkerStatusRequest(), timeout=self.timeout))
        return MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)

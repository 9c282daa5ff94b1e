"""Python client of the pack service: ``RemoteStore`` has the methods of ``PackStore`` that make sense remotely.

``fetch`` decodes chunks as they arrive, in worker threads, straight into tensors preallocated on
the target device (through pinned host memory and non-blocking copies on CUDA).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, TypeVar

import grpc
import torch

from packstore.bank.bank import DEFAULT_TOP_K
from packstore.bank.embedder import DEFAULT_EMBEDDER
from packstore.errors import InvalidInput, PackstoreError
from packstore.format import EncodedPack, Pack, PackHeader
from packstore.format.body import _WORKERS, decode_chunk, torch_dtype
from packstore.rpc.messages import ChunkAssembler, chunk_pieces, stored_pack
from packstore.rpc.status import error_for
from packstore.store import StoredPack, VerifyResult
from packstore.v1 import store_pb2, store_pb2_grpc

GRPC_SCHEME = "grpc://"
MAX_MESSAGE_BYTES = 64 << 20
T = TypeVar("T")


def is_remote(spec: str | None) -> bool:
    return bool(spec) and str(spec).startswith(GRPC_SCHEME)


class _GrpcClient:
    """A channel to one server, closed with the client; failed calls become packstore errors."""

    what = "server"

    def __init__(self, target: str, *, timeout: float | None = None) -> None:
        self.address = target.removeprefix(GRPC_SCHEME)
        if not self.address or ":" not in self.address:
            raise InvalidInput(f"bad address {target!r}: use HOST:PORT (or grpc://HOST:PORT)")
        self.target = target
        self.timeout = timeout
        self._channel = grpc.insecure_channel(
            self.address,
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _error(self, exc: grpc.RpcError) -> PackstoreError:
        """The packstore error a failed call's status stands for."""
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            return PackstoreError(f"{self.what} at {self.target} is unavailable: {exc.details()}")
        return error_for(exc.code(), exc.details())

    def _call(self, invoke: Callable[[], T]) -> T:
        try:
            return invoke()
        except grpc.RpcError as exc:
            raise self._error(exc) from None


class RemoteStore(_GrpcClient):
    """A pack store served by ``packstore serve``, addressed as ``grpc://HOST:PORT``."""

    what = "pack service"

    def __init__(self, target: str, *, timeout: float | None = None) -> None:
        super().__init__(target, timeout=timeout)
        self._stub = store_pb2_grpc.PackStoreStub(self._channel)

    # -- reads -----------------------------------------------------------------------------------

    def stat(self, ref: str, *, model_fp: str | None = None) -> StoredPack:
        request = store_pb2.StatPackRequest(ref=ref, model_fp=model_fp or "")
        return stored_pack(self._call(lambda: self._stub.StatPack(request, timeout=self.timeout)))

    def resolve(self, ref: str, *, model_fp: str | None = None) -> str:
        return self.stat(ref, model_fp=model_fp).key

    def list(self, *, model_fp: str | None = None, template_fp: str | None = None, name: str | None = None) -> list[StoredPack]:
        """Every matching pack, fetched page by page."""
        packs: list[StoredPack] = []
        token = ""
        while True:
            request = store_pb2.ListPacksRequest(model_fp=model_fp or "", template_fp=template_fp or "", name=name or "", page_token=token)
            page = self._call(lambda: self._stub.ListPacks(request, timeout=self.timeout))
            packs += [stored_pack(info) for info in page.packs]
            token = page.next_page_token
            if not token:
                return packs

    def keys(self) -> list[str]:
        return [p.key for p in self.list()]

    def _stream(self, ref: str, model_fp: str | None, template_fp: str | None) -> tuple[PackHeader, Iterator[tuple[int, bytes]]]:
        """Start GetPack; returns the header and an iterator of whole (index, chunk bytes)."""
        request = store_pb2.GetPackRequest(ref=ref, model_fp=model_fp or "", template_fp=template_fp or "")
        responses = self._stub.GetPack(request, timeout=self.timeout)
        first = self._call(lambda: next(responses, None))
        if first is None or first.WhichOneof("item") != "header":
            raise PackstoreError("GetPack did not start with the pack header")
        header = stored_pack(first.header).header

        def chunks() -> Iterator[tuple[int, bytes]]:
            assembler = ChunkAssembler(header)
            try:
                for response in responses:
                    whole = assembler.add(response.chunk)
                    if whole is not None:
                        yield assembler.next_index - 1, whole
            except grpc.RpcError as exc:
                raise self._error(exc) from None
            if not assembler.complete:
                raise PackstoreError(f"pack {header.key}: the stream ended after {assembler.next_index} of {len(header.chunks)} chunks")

        return header, chunks()

    def get(self, ref: str, *, model_fp: str | None = None, template_fp: str | None = None) -> EncodedPack:
        """The pack's header and stored chunks, each checked against its sha256."""
        from packstore.format.body import verify_chunk

        header, chunks = self._stream(ref, model_fp, template_fp)
        data = []
        for index, chunk in chunks:
            verify_chunk(header, index, chunk)
            data.append(chunk)
        return EncodedPack(header=header, chunks=data)

    def fetch(self, ref: str, *, device: str | torch.device = "cpu", model_fp: str | None = None, template_fp: str | None = None) -> Pack:
        """Stream a pack and decode each chunk as it arrives into tensors on ``device``.

        The server refuses (FAILED_PRECONDITION) when ``model_fp`` / ``template_fp`` differ from the pack's.
        """
        device = torch.device(device)
        header, chunks = self._stream(ref, model_fp, template_fp)
        shape, dtype = (header.kv_heads, header.tokens, header.head_dim), torch_dtype(header.dtype)
        on_cpu = device.type == "cpu"
        keys: list[torch.Tensor | None] = [None if on_cpu else torch.empty(shape, dtype=dtype, device=device) for _ in range(header.layers)]
        values: list[torch.Tensor | None] = [None if on_cpu else torch.empty(shape, dtype=dtype, device=device) for _ in range(header.layers)]

        def place(index: int, data: bytes) -> None:
            for name, tensor in decode_chunk(header, index, data).items():
                _, layer, kind = name.split(".")
                target = keys if kind == "key" else values
                if on_cpu:
                    target[int(layer)] = tensor  # decoded tensors are already in their final place
                else:
                    pinned = tensor.pin_memory() if device.type == "cuda" else tensor
                    target[int(layer)].copy_(pinned, non_blocking=True)

        with ThreadPoolExecutor(_WORKERS) as pool:
            pending: list[Future] = [pool.submit(place, index, data) for index, data in chunks]
            for future in pending:
                future.result()
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        pack = Pack(header=header, keys=keys, values=values)  # type: ignore[arg-type]
        pack.check_shapes()
        return pack

    # -- writes ----------------------------------------------------------------------------------

    def put(self, encoded: EncodedPack, *, name: str | None = None) -> tuple[str, bool]:
        """Upload a pack (header, then every chunk in pieces); returns ``(key, created)``."""

        def requests() -> Iterator[store_pb2.PutPackRequest]:
            yield store_pb2.PutPackRequest(begin=store_pb2.PutPackBegin(header_json=encoded.header.to_json(), name=name or ""))
            for index, (chunk, info) in enumerate(zip(encoded.chunks, encoded.header.chunks)):
                for piece in chunk_pieces(index, chunk, info.sha256):
                    yield store_pb2.PutPackRequest(chunk=piece)

        response = self._call(lambda: self._stub.PutPack(requests(), timeout=self.timeout))
        return response.pack.key, response.created

    def delete(self, ref: str, *, model_fp: str | None = None) -> str:
        request = store_pb2.DeletePackRequest(ref=ref, model_fp=model_fp or "")
        return self._call(lambda: self._stub.DeletePack(request, timeout=self.timeout)).key

    def set_name(self, ref: str, name: str, *, model_fp: str | None = None) -> str:
        request = store_pb2.SetNameRequest(ref=ref, name=name, model_fp=model_fp or "")
        return self._call(lambda: self._stub.SetName(request, timeout=self.timeout)).key

    def delete_name(self, name: str, *, model_fp: str) -> str:
        request = store_pb2.DeleteNameRequest(name=name, model_fp=model_fp)
        return self._call(lambda: self._stub.DeleteName(request, timeout=self.timeout)).key

    def verify(self, ref: str) -> VerifyResult:
        return self._verify([ref])[0]

    def verify_all(self) -> list[VerifyResult]:
        return self._verify([])

    def _verify(self, refs: list[str]) -> list[VerifyResult]:
        request = store_pb2.VerifyPacksRequest(refs=refs)
        results = self._call(lambda: list(self._stub.VerifyPacks(request, timeout=self.timeout)))
        return [VerifyResult(key=r.key, error=r.error or None) for r in results]


class WorkerClient(_GrpcClient):
    """Client of a ``packstore worker``: ask questions with a pack, streaming tokens as they come."""

    what = "worker"

    def __init__(self, address: str, *, timeout: float | None = None) -> None:
        from packstore.v1 import worker_pb2_grpc

        super().__init__(address, timeout=timeout)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    def ask(
        self,
        ref: str | None,
        question: str,
        *,
        sampling=None,
        compare_rag: bool = False,
        on_token: Callable[[str], None] | None = None,
        bank: str | None = None,
        top_k: int = DEFAULT_TOP_K,
        probe: int | None = None,
        embedder: str = "",
    ):
        """Answer ``question`` with pack ``ref`` (or the routed facts of ``bank``) on the worker.

        ``on_token`` receives text as it is generated.

        Returns a ``packstore.api.AskResult`` with the same fields as a local ``ask``.
        """
        from packstore.api import AskResult
        from packstore.kv.inject import Sampling
        from packstore.v1 import worker_pb2

        sampling = sampling or Sampling()
        request = worker_pb2.GenerateRequest(
            packs=[ref] if ref else [],
            bank=bank or "",
            top_k=top_k,
            probe=probe or 0,
            embedder=embedder,
            question=question,
            compare_rag=compare_rag,
            sampling=worker_pb2.Sampling(
                max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed
            ),
        )
        done = None
        try:
            for response in self._stub.Generate(request, timeout=self.timeout):
                if response.WhichOneof("item") == "token" and on_token is not None:
                    on_token(response.token.text)
                elif response.WhichOneof("item") == "done":
                    done = response.done
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        if done is None:
            raise PackstoreError(f"worker at {self.address} ended the answer without a summary")
        return AskResult(
            question=question,
            answer=done.answer,
            kv_prompt_tokens=done.kv_prompt_tokens,
            rag_answer=done.rag_answer if done.compared else None,
            rag_prompt_tokens=done.rag_prompt_tokens if done.compared else None,
            identical=done.identical if done.compared else None,
            pack=done.pack,
            bank=bank,
            facts=list(done.facts) if bank else None,
        )

    def status(self) -> dict:
        from google.protobuf.json_format import MessageToDict

        from packstore.v1 import worker_pb2

        reply = self._call(lambda: self._stub.Status(worker_pb2.WorkerStatusRequest(), timeout=self.timeout))
        return MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


FACT_BATCH = 1000


class RemoteBanks:
    """Bank operations on the service: the same methods as ``packstore.bank.bank.LocalBanks``."""

    def __init__(self, store: RemoteStore) -> None:
        self.store = store

    def _upload(self, rpc: Callable, name: str, facts: list[str], embedder: str):
        from packstore.rpc.messages import bank_meta

        def batches() -> Iterator[store_pb2.BankFacts]:
            for start in range(0, max(len(facts), 1), FACT_BATCH):
                yield store_pb2.BankFacts(name=name, embedder=embedder, facts=facts[start : start + FACT_BATCH])

        return bank_meta(self.store._call(lambda: rpc(batches(), timeout=self.store.timeout)))[0]

    def build(self, name: str, facts: list[str], embedder: str = DEFAULT_EMBEDDER, *, progress: bool = False):
        return self._upload(self.store._stub.BuildBank, name, list(facts), embedder)

    def add(self, name: str, facts: list[str], embedder: str = DEFAULT_EMBEDDER, *, progress: bool = False):
        return self._upload(self.store._stub.AddFacts, name, list(facts), embedder)

    def route(self, name: str, queries: list[str], embedder: str = DEFAULT_EMBEDDER, *, top_k: int = DEFAULT_TOP_K, probe: int | None = None):
        from packstore.bank.bank import Route

        request = store_pb2.RouteQueryRequest(name=name, queries=list(queries), top_k=top_k, probe=probe or 0, embedder=embedder)
        reply = self.store._call(lambda: self.store._stub.RouteQuery(request, timeout=self.store.timeout))
        return [Route(query=r.query, clusters=list(r.clusters), facts=[(f.text, f.score) for f in r.facts]) for r in reply.routes]

    def list(self) -> list:
        from packstore.rpc.messages import bank_meta

        reply = self.store._call(lambda: self.store._stub.ListBanks(store_pb2.ListBanksRequest(), timeout=self.store.timeout))
        return [bank_meta(info) for info in reply.banks]

    def stored_bytes(self, name: str) -> int:
        from packstore.errors import PackNotFound

        for meta, size in self.list():
            if meta.name == name:
                return size
        raise PackNotFound(f"no bank named {name!r}")

    def delete(self, name: str) -> None:
        request = store_pb2.DeleteBankRequest(name=name)
        self.store._call(lambda: self.store._stub.DeleteBank(request, timeout=self.store.timeout))

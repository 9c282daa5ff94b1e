"""The vLLM connector: packs loaded into vLLM's paged KV cache, so packs serve in the engine people run.

vLLM builds ``PackstoreConnector`` twice, a scheduler half in the engine process and a worker half beside the model
(``KVConnectorBase_V1``). The scheduler half plans each request (``packstore.answering.paged``: the pack a request
names in ``kv_transfer_params.pack``, or the one its first tokens match; identities, tokens and whole blocks checked)
and never raises; the worker half reads the pack through the pack reader (every tier, chunk check and signature rule
applies) and writes each layer with the attention backend's own cache update as the model reaches it (or, where a
probe at start finds it writes the same bits, ``answering.cache_scatter``, without the update's token loop). A pack that
fails while loading is reported as failed blocks, which vLLM recomputes; the reason comes back with the answer
(docs/protocol.md, "vLLM connector"). This is the only module that imports vLLM.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from prometheus_client import Counter
from safetensors.torch import save_file
from transformers import AutoTokenizer
from vllm import __version__ as vllm_version
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats, PromMetric, PromMetricT
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.metrics.utils import create_metric_per_engine

from packstore.answering.arithmetic import OTHER_EXACT_POLICIES
from packstore.answering.background_loads import BackgroundLoads
from packstore.answering.cache_scatter import scatter_rows, writes_like
from packstore.answering.config_values import ConfigValues
from packstore.answering.paged import COUNTERS, PackMatcher, PackPlan, ServedModel
from packstore.answering.plan_lookups import PlanLookups
from packstore.answering.ready_caches import ReadyCache
from packstore.answering.save_capture import SaveCapture
from packstore.answering.save_writes import SaveWriter
from packstore.answering.saves import SavePlan, Saves, WriteRoles
from packstore.answering.step_loads import PackLoad, StepLoads
from packstore.answering.transfer_params import engine_refusal
from packstore.errors import InvalidInput
from packstore.kv.engine_build import CAPTURE_FILE
from packstore.kv.exactness import machine
from packstore.kv.identity import directory_model_fingerprint, local_directory, template_fingerprint
from packstore.kv.render import pack_prefix_ids, preamble_tokens
from packstore.packs.buffers import HostBuffers
from packstore.packs.decoder import Decoder
from packstore.packs.memory import PackMemory
from packstore.packs.reader import PackReader
from packstore.rpc.channel import Connection
from packstore.security.trust import SigningKey, TrustedKeys
from packstore.store import PackStore, StoreSpec
from packstore.store.namespaces import DEFAULT_NAMESPACE
from packstore.worker.namespace_readers import NamespaceReaders

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from packstore.packs.tensors import ArrivingPack, Pack

log = logging.getLogger("packstore.vllm")

SETTINGS = (
    "store", "namespace", "namespaces", "token_file", "tls_ca", "s3_endpoint", "trusted_keys", "automatic", "index_refresh_s",
    "cache_bytes", "other_exact", "lookup_seconds", "load_seconds", "background_loads", "allow_save", "save_bytes_per_hour",
    "signing_key", "reserve_bytes",
)
CAPTURE_SETTING = "capture_dir"  # EngineCaptureConnector's alone: packctl build --engine vllm's capture run
STORE_GRACE_SECONDS = 1.0  # a store call's deadline beyond the connector's own: the connector's decides, and says so
# Speculative decoding methods whose drafts need no K/V of their own (n-grams of the tokens, or heads on the target's
# hidden states): a pack's K/V, the target model's, is all they read. The others (EAGLE, MTP, a draft model) would
# draft from K/V the pack never wrote.
TOKEN_DRAFTERS = ("ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator")
# the longest a step that schedules nothing waits for a background load to end: a request arriving meanwhile waits
# for it, and any shorter and vLLM's polling takes the cores the load decodes on (each poll's round trip ran on the
# worker's one core: a cold 2k load took about 10 ms less at 25 ms than at 10 ms, docs/benchmarks.md)
IDLE_WAIT_SECONDS = 0.025
DEFAULT_CACHE_BYTES = 1 << 30  # decoded packs the worker half keeps in host memory between requests
LOAD_ROOM_BYTES = 512 << 20  # reserved memory beside the decoded-pack cache's, for packs being loaded
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config``: the store and how to reach it, as packctl's and the worker's flags say it."""

    store: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    namespaces: tuple[str, ...] = ()
    token_file: str | None = None
    tls_ca: str | None = None
    s3_endpoint: str | None = None
    trusted_keys: str | None = None
    automatic: bool = True
    index_refresh_s: float = 10.0
    cache_bytes: int = DEFAULT_CACHE_BYTES
    other_exact: str = OTHER_EXACT_POLICIES[0]
    capture_dir: str | None = None  # packctl build --engine vllm: write the K/V the engine computes here
    lookup_seconds: float = 2.0  # the longest a request waits for its pack's header from the store (then: no pack)
    background_loads: bool = True  # packs not decoded in the worker load beside the forward passes (else within them)
    load_seconds: float = 10.0  # the longest a step waits for a pack from the store (then: its blocks recomputed)
    allow_save: bool = False  # requests may save what the engine computes as packs (kv_transfer_params save: true)
    save_bytes_per_hour: int = 0  # the most bytes of K/V each namespace may save within an hour (0: no limit)
    signing_key: str | None = None  # the key file saved packs are signed with (required with trusted_keys)
    # host memory packs are decoded into, touched at start (a fresh page costs a fault on first write): the decoded-pack
    # cache's and room for the packs being loaded; 0: none, packs are decoded into memory allocated as they come
    reserve_bytes: int = DEFAULT_CACHE_BYTES + LOAD_ROOM_BYTES

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any], *, capture: bool = False) -> ConnectorSettings:
        """The settings in ``extra``, each type-checked; ValueError naming an unknown or mistyped one (vLLM refuses to
        start). ``capture_dir`` is read only for ``capture`` (EngineCaptureConnector), never from users' config. With
        ``trusted_keys``, saving needs a ``signing_key``: an unsigned save would be a pack this connector refuses."""
        known = (*SETTINGS, CAPTURE_SETTING) if capture else SETTINGS
        unknown = sorted(set(extra) - set(known), key=str)
        if CAPTURE_SETTING in unknown:
            raise ValueError(
                f"PackstoreConnector: kv_connector_extra_config key {CAPTURE_SETTING!r} is internal to packctl's vLLM builds, "
                "not a setting: remove it"
            )
        if unknown:
            raise ValueError(f"PackstoreConnector: unknown kv_connector_extra_config key {unknown[0]!r} (known: {', '.join(SETTINGS)})")
        values = ConfigValues(extra, "PackstoreConnector: kv_connector_extra_config")
        namespace = values.text("namespace") or DEFAULT_NAMESPACE
        trusted_keys, allow_save, signing_key = values.text("trusted_keys"), values.flag("allow_save", False), values.text("signing_key")
        if trusted_keys and allow_save and not signing_key:
            raise ValueError(
                "PackstoreConnector: kv_connector_extra_config sets trusted_keys and allow_save: true but no signing_key, so "
                "its saves would be unsigned packs that trusted_keys refuses: set signing_key (a key file, packctl keygen) "
                "or turn allow_save off"
            )
        return cls(
            store=values.text("store"),
            namespace=namespace,
            namespaces=tuple(dict.fromkeys([namespace, *values.texts("namespaces")])),
            token_file=values.text("token_file"),
            tls_ca=values.text("tls_ca"),
            s3_endpoint=values.text("s3_endpoint"),
            trusted_keys=trusted_keys,
            automatic=values.flag("automatic", True),
            index_refresh_s=values.seconds("index_refresh_s", 10.0),
            cache_bytes=values.count("cache_bytes", DEFAULT_CACHE_BYTES),
            other_exact=values.choice("other_exact", OTHER_EXACT_POLICIES),
            capture_dir=values.text(CAPTURE_SETTING) if capture else None,
            lookup_seconds=values.seconds("lookup_seconds", 2.0),
            background_loads=values.flag("background_loads", True),
            load_seconds=values.seconds("load_seconds", 10.0),
            allow_save=allow_save,
            save_bytes_per_hour=values.count("save_bytes_per_hour", 0),
            signing_key=signing_key,
            reserve_bytes=values.count("reserve_bytes", values.count("cache_bytes", DEFAULT_CACHE_BYTES) + LOAD_ROOM_BYTES),
        )

    def readers(self, timeout: float) -> ConnectorStores:
        """Each namespace's store, opened on first use with the token, TLS CA and S3 endpoint given; each call to a
        service or bucket fails after ``timeout`` seconds. A local directory is opened writable when saving is on."""
        connection = Connection.from_env(token_file=self.token_file, tls_ca=self.tls_ca, namespace=self.namespace)
        spec = StoreSpec.of(self.store, connection=connection, s3_endpoint=self.s3_endpoint, namespace=self.namespace)
        return ConnectorStores.open(replace(spec, timeout=timeout), readonly=not self.allow_save)


class ConnectorStores:
    """A connector half's stores by namespace (``get``, ``close``). A local directory is opened once per process and
    shared by both halves, closed when the last closes: LMDB opens a directory once per process, and vLLM's
    UniProcExecutor (its default for one GPU) runs the scheduler and the worker halves in one process. A service or
    bucket gets clients of each half's own (their deadlines differ)."""

    _local: ClassVar[dict[str, tuple[NamespaceReaders, int]]] = {}  # directory -> (its stores, halves holding them)
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, readers: NamespaceReaders, directory: str | None) -> None:
        self._readers, self._directory = readers, directory

    @classmethod
    def open(cls, spec: StoreSpec, *, readonly: bool) -> ConnectorStores:
        if not spec.is_directory:
            return cls(NamespaceReaders(spec, per_caller=True, readonly=readonly), None)
        directory = str(Path(spec.location).resolve())
        with cls._lock:
            readers, holders = cls._local.get(directory) or (NamespaceReaders(spec, per_caller=True, readonly=readonly), 0)
            cls._local[directory] = (readers, holders + 1)
        return cls(readers, directory)

    def get(self, namespace: str) -> PackStore:
        return self._readers.get(namespace)

    def close(self) -> None:
        if self._directory is None:
            self._readers.close()
            return
        with self._lock:
            readers, holders = self._local[self._directory]
            if holders > 1:
                self._local[self._directory] = (readers, holders - 1)
                return
            del self._local[self._directory]
        readers.close()

    def __enter__(self) -> ConnectorStores:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_engine(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse (ValueError, so vLLM does not start) an engine configuration packs cannot be loaded into exactly."""
    transfer = vllm_config.kv_transfer_config
    problems = []
    if transfer is None or transfer.kv_load_failure_policy != "recompute":
        problems.append("set kv_load_failure_policy to \"recompute\" in --kv-transfer-config, so a pack that fails to load is recomputed")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        problems.append(
            f"tensor/pipeline parallel sizes {parallel.tensor_parallel_size}/{parallel.pipeline_parallel_size} are not supported: "
            "serve on one device"
        )
    model = vllm_config.model_config
    if model.use_mla:
        problems.append("models with multi-head latent attention (MLA) are not supported")
    if model.is_hybrid or model.is_attention_free:
        problems.append("hybrid and recurrent models are not supported: packs hold the K/V of attention layers only")
    text = model.hf_text_config
    if getattr(text, "sliding_window", None) or "sliding_attention" in (getattr(text, "layer_types", None) or ()):
        problems.append(f"models with sliding-window layers ({model.hf_config.model_type}) are not supported yet")
    if vllm_config.cache_config.cache_dtype != "auto":
        problems.append(f"kv cache dtype {vllm_config.cache_config.cache_dtype!r} is not supported: packs hold the model's own dtype")
    if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
        problems.append("KV cache layouts with several groups are not supported")
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is not None and speculative.method not in TOKEN_DRAFTERS:
        problems.append(
            f"speculative decoding by {speculative.method!r} drafts with attention layers of its own, whose K/V packs do not "
            f"hold: draft by {', '.join(TOKEN_DRAFTERS)}, or serve without speculative decoding"
        )
    if problems:
        raise ValueError("PackstoreConnector cannot serve this engine: " + "; ".join(problems))


FUSED_CACHE_WRITES = ("fuse_rope_kvcache", "fuse_qk_norm_rope_kvcache")  # compile passes that write K/V inside a fused op


def check_layers(layers: Mapping[str, Any], pass_config: Any, *, capture: bool) -> None:
    """Refuse (ValueError, so vLLM's worker does not start) attention layers the connector cannot write a pack into with
    the backend's own cache update, or, for a capture run, a compiled model whose cache writes it would not see."""
    problems = []
    for name, layer in layers.items():
        backend = getattr(layer, "attn_backend", None)
        if backend is not None and getattr(backend, "forward_includes_kv_cache_update", True):
            problems.append(
                f"attention backend {backend.get_name()} of layer {name} writes the KV cache inside its forward, so a pack "
                "cannot be written with its cache update: choose another attention backend (--attention-backend)"
            )
            break
    fused = [flag for flag in FUSED_CACHE_WRITES if getattr(pass_config, flag, False)]
    if capture and fused:
        problems.append(f"a capture run must see every cache write: turn off the compile pass {fused[0]}")
    if problems:
        raise ValueError("PackstoreConnector cannot write into this engine's KV cache: " + "; ".join(problems))


def reads_strided_rows(impl: Any) -> bool:
    """Whether an attention backend's cache update reads each row through its strides, so a pack's layer
    (``[kv heads, tokens, head dim]``) is written as a transposed view, without copying it first: vLLM's CPU backend
    (its kernel takes the token and head strides; an engine test checks the loaded K/V bit for bit)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    except ImportError:  # a build without the CPU backend
        return False
    return isinstance(impl, CPUAttentionBackendImpl)


def served_model(vllm_config: VllmConfig) -> tuple[ServedModel, Any]:
    """The identities and cache shape of the model vLLM serves, computed from its Hugging Face directory, and its
    tokenizer (which renders the facts a request names, as the packs of them were rendered)."""
    model = vllm_config.model_config
    dtype = _DTYPE_NAMES.get(model.dtype) if isinstance(model.dtype, torch.dtype) else None
    if dtype is None:
        raise ValueError(f"PackstoreConnector: vLLM serves the model in {model.dtype}, which packs do not hold")
    cache_dir = vllm_config.load_config.download_dir
    try:  # a hub id (how most people run vllm serve) is read from the local Hugging Face cache vLLM loaded it from
        model_dir = local_directory(model.model, revision=model.revision, cache_dir=cache_dir)
        tokenizer_dir = model_dir
        if model.tokenizer:
            tokenizer_dir = local_directory(model.tokenizer, revision=model.tokenizer_revision, cache_dir=cache_dir)
    except InvalidInput as exc:
        raise ValueError(f"PackstoreConnector: {exc}") from exc
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    served = ServedModel(
        model_fp=directory_model_fingerprint(model_dir, dtype),
        template_fp=template_fingerprint(tokenizer),
        dtype=dtype,
        layers=model.get_num_layers(vllm_config.parallel_config),
        kv_heads=model.get_num_kv_heads(vllm_config.parallel_config),
        head_dim=model.get_head_size(),
        block_size=vllm_config.cache_config.block_size,
        engine_version=vllm_version,
        preamble_tokens=preamble_tokens(tokenizer),
    )
    return served, tokenizer


@dataclass
class PackstoreStats(KVConnectorStats):
    """Increments of ``packstore.answering.paged.COUNTERS``: packs applied, refused, failed while loading; tokens loaded."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class PackstorePromMetrics(KVConnectorPromMetrics):
    """``vllm:packstore_packs_applied``, ``..._packs_not_applied``, ``..._pack_load_failures`` and
    ``..._pack_tokens_loaded`` counters on vLLM's own ``/metrics``, per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:packstore_{name}", documentation=f"packstore connector: {name.replace('_', ' ')}",
                                  labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name in COUNTERS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self.counters and value:
                cast(Counter, self.counters[name][engine_idx]).inc(value)  # made by metric_types[Counter] above


@dataclass
class PackstoreMetadata(KVConnectorMetadata):
    """Scheduler -> worker: the loads of this step; the saves it begins (each with its request's blocks so far), the
    blocks more of them were given, and the saves to forget; the served model's identity, which saved packs record."""

    loads: list[PackLoad] = field(default_factory=list)
    saves: list[tuple[SavePlan, list[int]]] = field(default_factory=list)
    save_blocks: dict[str, list[int]] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    identity: dict[str, Any] | None = None
    idle: bool = False  # the step schedules no tokens: the engine only polls for loads that are ending


@dataclass
class PackstoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: requests whose pack failed to load this step, and why (their blocks were recomputed), the
    namespaces whose store missed the load deadline, and (when it changed) the packs the worker holds decoded, by
    (namespace, key): those load within the forward, any other beside it."""

    failures: dict[str, str] = field(default_factory=dict)
    late: set[str] = field(default_factory=set)
    ready: frozenset[tuple[str, str]] | None = None
    saved: dict[str, str | None] = field(default_factory=dict)  # saves that ended: request id -> None (stored) or why not

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PackstoreWorkerMetadata)
        ready = other.ready if self.ready is None else self.ready if other.ready is None else self.ready & other.ready
        return PackstoreWorkerMetadata({**self.failures, **other.failures}, self.late | other.late, ready, {**self.saved, **other.saved})


def _engine_refusal(request: Request) -> str | None:
    """Why vLLM cannot take a pack's K/V into ``request`` at all (a LoRA adapter; no cached K/V read), or None."""
    lora = getattr(request, "lora_request", None)
    return engine_refusal(
        lora=None if lora is None else str(getattr(lora, "lora_name", lora)),
        skips_prefix_cache=bool(getattr(request, "skip_reading_prefix_cache", False)),
    )


class PackstoreConnector(KVConnectorBase_V1):
    """Loads knowledge packs into vLLM's paged KV cache (module docstring; docs/protocol.md, "vLLM connector")."""

    CAPTURES = False  # whether this connector takes capture_dir (EngineCaptureConnector)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: packs are written layer by layer between the model's layers (``wait_for_layer_load``), which a full
        CUDA graph would replay without; vLLM then runs PIECEWISE graphs."""
        return True

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_engine(vllm_config, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config)
        self.settings = ConnectorSettings.from_extra_config(extra, capture=self.CAPTURES)
        self.block_size = vllm_config.cache_config.block_size
        if role == KVConnectorRole.SCHEDULER:
            self._readers = self.settings.readers(self.settings.lookup_seconds + STORE_GRACE_SECONDS)
            trusted = TrustedKeys.load(self.settings.trusted_keys) if self.settings.trusted_keys else None
            served, tokenizer = served_model(vllm_config)
            self.matcher = PackMatcher(
                self._readers.get,
                served,
                namespaces=self.settings.namespaces,
                automatic=self.settings.automatic,
                trusted=trusted,
                refresh_s=self.settings.index_refresh_s,
                other_exact=self.settings.other_exact,
                pack_ids=partial(pack_prefix_ids, tokenizer),
            )
            self.matcher.start()
            lookups = PlanLookups(self.matcher, self.settings.lookup_seconds)
            roles = WriteRoles(self._readers.get, self.settings.namespaces) if self.settings.allow_save else None
            saves = Saves(served, allow=self.settings.allow_save, roles=roles, bytes_per_hour=self.settings.save_bytes_per_hour)
            self._scheduler_state(self.matcher, lookups, background=self.settings.background_loads, saves=saves)
            self._identity["model_name"] = vllm_config.model_config.model
            log.info("packstore: connector serving packs from %s (namespaces %s)", self.settings.store, ", ".join(self.settings.namespaces))
        else:
            # each call to a service or bucket fails after load_seconds + 1 s
            self._readers = self.settings.readers(self.settings.load_seconds + STORE_GRACE_SECONDS)
            # packs are decoded into memory touched beforehand (on a thread of its own): in vLLM's worker, a cold 2k pack
            # took 90-137 ms to load into fresh pages against 85 ms into touched ones (docs/benchmarks.md)
            memory = PackMemory(self.settings.reserve_bytes, background=True) if self.settings.reserve_bytes else None
            self._decoder = Decoder(buffers=HostBuffers(memory))
            self._packs: dict[str, PackReader] = {}
            self._ready = ReadyCache(self.settings.cache_bytes)  # decoded packs, by namespace and key
            self._kv_caches: dict[str, torch.Tensor] = {}
            self._strided_rows: set[str] = set()  # layers whose cache update takes a pack's rows as strided views
            self._scattered: set[str] = set()  # layers whose cache ``scatter_rows`` writes as their own update does
            self._layers: dict[str, Any] = {}
            self._loads = StepLoads(self._ready_pack, self._fetch, self.block_size, self.settings.load_seconds)
            self._background_loads = BackgroundLoads(self._ready_pack, self._fetch, self.block_size, self.settings.load_seconds)
            self._reported_ready: frozenset[tuple[str, str]] = frozenset()
            self._failed_blocks: set[int] = set()
            self._failures: dict[str, str] = {}
            self._late: set[str] = set()
            self._captured: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            self._captured_steps: list[int] = []
            self._save_capture: SaveCapture | None = None  # made once the layers are known (register_kv_caches)
            self._cache_updates: dict[str, Any] = {}  # each layer's own cache update, where it is watched
            self._saves_ended: dict[str, str | None] = {}  # saves that ended since the last report: None (stored) or why not
            self._save_orders: dict[str, SavePlan] = {}
            self._save_identity: dict[str, Any] = {}
            self._save_writer: SaveWriter | None = None
            if self.settings.allow_save:
                signing = SigningKey.load(self.settings.signing_key) if self.settings.signing_key else None
                self._save_writer = SaveWriter(self._readers.get, machine(torch.device("cpu")), signing)

    # ---- scheduler half -------------------------------------------------------------------------------------------

    def _scheduler_state(
        self, matcher: PackMatcher, lookups: PlanLookups, *, background: bool = True, saves: Saves | None = None
    ) -> None:
        """The scheduler half's state: requests are planned by ``matcher``, through ``lookups`` off this thread; packs
        the worker does not hold decoded load beside the forward passes if ``background``, else within them; ``saves``
        decides save requests (default: saving off)."""
        self.matcher, self.lookups, self._loads_beside = matcher, lookups, background
        self.saves = saves if saves is not None else Saves(matcher.served, allow=False)
        self._save_plans: dict[str, SavePlan] = {}  # saves decided, not yet sent to the worker
        self._saving: set[str] = set()  # saves sent to the worker, until their request ends
        self._saves_pending: dict[str, tuple[str, str]] = {}  # saves decided, until stored or failed: (namespace, key)
        self._dropped: list[str] = []  # saves whose request ended, for the worker to forget
        self._identity: dict[str, Any] = matcher.served.identity()  # what the worker's saved packs record
        self._plans: dict[str, PackPlan] = {}
        self._to_load: dict[str, PackPlan] = {}
        self._unwaited: set[str] = set()  # requests planned before their store missed a load deadline
        self._background: list[PackLoad] = []  # loads beside the forward, for the next step's metadata
        self._waiting: set[str] = set()  # requests whose background load the worker has not finished
        self._worker_ready: frozenset[tuple[str, str]] = frozenset()  # packs the worker holds decoded

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The pack tokens beyond what vLLM's prefix cache holds (0 when none applies), and whether they load beside the
        forward passes (a pack the worker does not hold decoded: the request waits for it, no forward does); planned
        once per request, from memory or, while the store is read on a lookup thread, None (vLLM asks again later)."""
        plan = self._plans.get(request.request_id)
        if plan is None:
            plan = self.lookups.plan(
                request.request_id,
                request.prompt_token_ids or [],
                request.kv_transfer_params,
                cache_salt=request.cache_salt,
                refusal=_engine_refusal(request),
            )
            if plan is None:
                return None, False
            self._plans[request.request_id] = plan
            self._decide_save(request, plan, num_computed_tokens)
        # a load that failed is not offered again: vLLM asks anew for a request whose background load failed
        loadable = plan.applies and plan.failure is None and num_computed_tokens < plan.tokens
        plan.offered = plan.tokens - num_computed_tokens if loadable else 0
        plan.background = self._loads_beside and plan.offered > 0 and (plan.namespace, plan.key) not in self._worker_ready
        return plan.offered, plan.background

    def _decide_save(self, request: Request, plan: PackPlan, num_computed_tokens: int) -> None:
        """Whether ``request`` saves what vLLM computes for its facts (once, with its plan: ``Saves.decide``)."""
        try:
            prompt, params = request.prompt_token_ids or [], request.kv_transfer_params
            decision = self.saves.decide(request.request_id, plan, prompt, params, num_computed_tokens)
        except Exception as exc:  # the engine's scheduler must never see an exception from here
            log.exception("packstore: deciding a save failed")
            plan.save_reason = f"internal error: {type(exc).__name__}: {exc}"
            return
        if isinstance(decision, SavePlan):
            self._save_plans[request.request_id] = decision
            self._saves_pending[request.request_id] = (decision.namespace, decision.key)
            self.matcher.headers.saving(decision.namespace, decision.key)
            plan.save_key = decision.key
        elif decision is not None:
            plan.save_key, plan.save_reason = decision.key, decision.reason

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Load what vLLM took of the tokens offered; a pack whose tokens it did not take is not applied, and says so."""
        plan = self._plans.get(request.request_id)
        if plan is None:
            return
        if num_external_tokens > 0:
            self._to_load[request.request_id] = plan
            plan.loaded = num_external_tokens
            if plan.background:  # the request waits, unscheduled, until the worker reports the load finished
                self._background.append(self._load_of(request.request_id, blocks.get_block_ids()[0]))
                self._waiting.add(request.request_id)
                plan.offered = 0  # taken: vLLM schedules the request once loaded, with no tokens to offer
        elif plan.offered > 0:
            plan.failure = f"vLLM did not take the pack's {plan.offered} tokens for this request and prefilled them itself"

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The loads of the requests scheduled this step (new ones, and ones resumed after preemption), and the loads
        beside the forward of requests that wait for them."""
        meta = PackstoreMetadata(loads=self._background, dropped=self._dropped, idle=not scheduler_output.total_num_scheduled_tokens)
        self._background, self._dropped = [], []
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._to_load:
                meta.loads.append(self._load_of(new.req_id, new.block_ids[0]))
            if new.req_id in self._save_plans:
                meta.saves.append((self._save_plans.pop(new.req_id), list(new.block_ids[0])))
                self._saving.add(new.req_id)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[index]
            resumed = req_id in cached.resumed_req_ids
            if req_id in self._to_load and resumed and new_blocks is not None:
                meta.loads.append(self._load_of(req_id, new_blocks[0]))
            if req_id in self._saving and new_blocks is not None:
                if resumed:  # preempted: its blocks are new, and the capture so far is lost unless it completed
                    self._saving.discard(req_id)
                    meta.dropped.append(req_id)
                else:
                    meta.save_blocks[req_id] = list(new_blocks[0])
        if meta.saves:
            meta.identity = self._identity
        return meta

    def _load_of(self, request_id: str, block_ids: list[int]) -> PackLoad:
        plan = self._to_load.pop(request_id)
        assert plan.key is not None and plan.pack_sha256 is not None  # only plans that apply are loaded
        start = plan.tokens - plan.loaded
        wait = request_id not in self._unwaited
        return PackLoad(
            request_id, plan.key, plan.namespace, plan.pack_sha256, start, plan.tokens, tuple(block_ids), wait, plan.background
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Record the worker's load failures: the requests were recomputed, and say so when they finish. A namespace
        whose store missed the load deadline has its headers looked up again (off this thread) before the next load."""
        self._waiting -= set(connector_output.finished_recving or ())
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, PackstoreWorkerMetadata):
            if meta.ready is not None:
                self._worker_ready = meta.ready
            for request_id, failure in meta.saved.items():
                self.matcher.counters.add("packs_saved" if failure is None else "pack_save_failures")
                saved = self._saves_pending.pop(request_id, None)
                if saved is not None:
                    self.matcher.headers.save_ended(*saved)
                if failure is not None:
                    log.warning("packstore: request %s: its save was not stored: %s", request_id, failure)
            for namespace in meta.late:
                self.matcher.headers.forget(namespace)
                self._unwaited |= {request_id for request_id, plan in self._plans.items() if plan.namespace == namespace}
                log.warning("packstore: the store of namespace %r missed the load deadline; its packs are looked up again", namespace)
            for request_id, reason in meta.failures.items():
                self.matcher.counters.add("pack_load_failures")
                plan = self._plans.get(request_id)
                if plan is not None:
                    plan.failure = f"loading the pack failed and vLLM recomputed its blocks: {reason}"
                log.warning("packstore: request %s: pack load failed, recomputed: %s", request_id, reason)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Whether the pack applied, and why not, returned with the answer as its ``kv_transfer_params``; and whether
        vLLM must keep the request's blocks until the worker reports its background load finished (it ended while
        waiting for it, so the loading thread may still write them)."""
        self._to_load.pop(request.request_id, None)
        if self._save_plans.pop(request.request_id, None) is not None:  # never sent to the worker: it will not report it
            if (saved := self._saves_pending.pop(request.request_id, None)) is not None:
                self.matcher.headers.save_ended(*saved)
        if request.request_id in self._saving:  # its capture completed in its prefill; else the worker drops it
            self._saving.discard(request.request_id)
            self._dropped.append(request.request_id)
        keep_blocks = request.request_id in self._waiting
        self.lookups.forget(request.request_id)
        self._unwaited.discard(request.request_id)
        plan = self._plans.pop(request.request_id, None)
        if plan is None:
            return keep_blocks, None
        self.matcher.counters.count(plan)
        if not plan.reported:
            return keep_blocks, None
        report = plan.report()
        if plan.identity is not None:  # what a front needs besides who the engine is: whether saves go, which namespaces
            report["identity"] = plan.identity | {"saves": self.saves.allow, "namespaces": list(self.matcher.namespaces)}
        return keep_blocks, report

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The scheduler half's counts since the last call (vLLM logs them and feeds ``PackstorePromMetrics``)."""
        if self.role != KVConnectorRole.SCHEDULER:
            return None
        stats = PackstoreStats(data=self.matcher.counters.take())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PackstoreStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return PackstorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- worker half ----------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the engine's caches, once its attention layers are known to take a pack's K/V (``check_layers``)."""
        compilation = self._vllm_config.compilation_config
        layers = compilation.static_forward_context
        watch = self.settings.capture_dir is not None or self._save_writer is not None
        self._layers = {name: layers[name] for name in kv_caches if name in layers}
        check_layers(self._layers, compilation.pass_config, capture=watch)
        self._kv_caches = dict(kv_caches)
        self._strided_rows = {name for name, layer in self._layers.items() if reads_strided_rows(layer.impl)}
        self._scattered = {  # each layer probed against its own update, before _watch_writes wraps it
            name for name, layer in self._layers.items() if writes_like(layer.impl.do_kv_cache_update, layer, kv_caches[name])
        }
        log.info("packstore: %d of %d layers take packs written straight into their blocks", len(self._scattered), len(self._layers))
        if self._save_writer is not None:
            self._save_capture = SaveCapture(len(self._layers), self.block_size)
        if watch:
            for name, layer in self._layers.items():
                self._watch_writes(name, layer.impl)

    def _watch_writes(self, name: str, impl: Any) -> None:
        """Have the attention backend's cache update of layer ``name`` also hand the rows it writes to the capture
        run (every row: a capture run serves one request, whose prompt's rows, in order, are the pack) and to the
        saves (the rows of their requests' slots). Packs the connector loads are written with the update itself."""
        index, update = extract_layer_index(name), impl.do_kv_cache_update
        self._cache_updates[name] = update
        rows = self._captured.setdefault(index, []) if self.settings.capture_dir is not None else None

        def watched(layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
            update(layer, key, value, kv_cache, slots)
            if rows is not None:
                written = slots[slots >= 0].numel()
                rows.append((key[:written].detach().clone(), value[:written].detach().clone()))
            if self._save_capture:
                self._save_capture.write(index, key, value, slots)

        impl.do_kv_cache_update = watched

    def _write_capture(self) -> None:
        """After a step that wrote rows: every row captured so far, per layer, and the rows each step wrote, to
        ``capture_dir/kv.safetensors`` (replaced whole, so a reader never sees half a file)."""
        steps = sum(len(k) for k, _ in self._captured.get(0, []))
        if self.settings.capture_dir is None or steps == sum(self._captured_steps):
            return
        self._captured_steps.append(steps - sum(self._captured_steps))
        tensors = {"steps": torch.tensor(self._captured_steps, dtype=torch.int64)}
        for index, rows in self._captured.items():
            tensors[f"k.{index}"] = torch.cat([k for k, _ in rows])
            tensors[f"v.{index}"] = torch.cat([v for _, v in rows])
        target = Path(self.settings.capture_dir) / CAPTURE_FILE
        device = next(iter(self._captured.values()))[0][0].device
        about = {"engine": "vllm", "version": vllm_version, "device": device.type, "built_on": json.dumps(machine(device))}
        save_file(tensors, target.with_suffix(".partial"), metadata=about)
        os.replace(target.with_suffix(".partial"), target)

    def _reader(self, namespace: str) -> PackReader:
        if namespace not in self._packs:
            self._packs[namespace] = PackReader(self._readers.get(namespace), self._decoder)
        return self._packs[namespace]

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward: begin the saves it starts, give them their new blocks, forget the ended ones."""
        super().bind_connector_metadata(connector_metadata)
        if self._save_capture is None or not isinstance(connector_metadata, PackstoreMetadata):
            return
        meta = connector_metadata
        if meta.identity is not None:
            self._save_identity = meta.identity
        for plan, block_ids in meta.saves:
            self._save_capture.begin(plan.request_id, len(plan.token_ids), block_ids)
            self._save_orders[plan.request_id] = plan
        for request_id, block_ids in meta.save_blocks.items():
            self._save_capture.extend(request_id, block_ids)
        for request_id in meta.dropped:
            self._save_orders.pop(request_id, None)
            if self._save_capture.drop(request_id):
                self._saves_ended[request_id] = "the request ended, or was preempted, before vLLM had written its range whole"

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads: a pack in memory is written layer by layer as the model reaches each layer
        (``wait_for_layer_load``), none waited for longer than ``load_seconds`` from now; any other is read and
        written on a thread while its request waits (``get_finished`` reports it)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, PackstoreMetadata)
        layers = [(name, extract_layer_index(name)) for name in self._layers]
        for load in meta.loads:
            if load.background:
                self._background_loads.start(load, layers, self._write_layer)
        self._loads.start([load for load in meta.loads if not load.background])

    def _ready_pack(self, load: PackLoad) -> Pack | None:
        """The pack ``load`` needs if it is decoded already (kept from an earlier request)."""
        return self._ready.peek(load.key, load.namespace)

    def _fetch(self, load: PackLoad) -> ArrivingPack:
        """The pack ``load`` needs, arriving from the store layer by layer and kept once whole and verified (on one of
        ``StepLoads``' threads)."""
        arriving = self._reader(load.namespace).start_fetch(load.key)
        arriving.when_complete(lambda pack: self._ready.put(load.key, pack, load.namespace))
        return arriving

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Write layer ``layer_name`` of every pack in flight into vLLM's cache before the layer runs."""
        if self._loads and layer_name in self._layers:
            self._loads.write_layer(layer_name, extract_layer_index(layer_name), partial(self._write_layer, layer_name))

    def _write_layer(self, layer_name: str, load: PackLoad, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Positions [start, stop) of one layer of a pack (``[kv heads, tokens, head dim]``) into the request's slots,
        with the attention backend's own cache update, or ``scatter_rows`` where it was found to write the same."""
        layer = self._layers[layer_name]
        kv_cache = self._kv_caches.get(layer_name, layer.kv_cache)
        if layer_name in self._scattered and keys.dtype == kv_cache.dtype:  # runs of slots at once, no token loop
            scatter_rows(keys, values, kv_cache, slots)
            return
        key = keys.transpose(0, 1).to(kv_cache.device, kv_cache.dtype)  # [tokens, kv heads, head dim]
        value = values.transpose(0, 1).to(kv_cache.device, kv_cache.dtype)
        if layer_name not in self._strided_rows:  # a backend that reads rows as laid out by the forward
            key, value = key.contiguous(), value.contiguous()
        self._cache_updates.get(layer_name, layer.impl.do_kv_cache_update)(layer, key, value, kv_cache, slots.to(kv_cache.device))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Packs are only read here (built with ``packctl build --engine vllm``), never saved from serving."""

    def wait_for_save(self) -> None:
        """After the forward: a load that failed, missed the deadline or left a layer unwritten has its blocks reported
        for recompute."""
        if self._loads:
            failed = self._loads.finish(self._layers)
            self._failed_blocks |= failed.blocks
            self._failures.update(failed.reasons)
            self._late |= failed.late
            for request_id, reason in failed.reasons.items():
                log.warning("packstore: the pack for request %s failed to load: %s", request_id, reason)
        self._write_capture()
        self._hand_over_saves()

    def _hand_over_saves(self) -> None:
        """The saves whose range this step completed go to the writer, off the forward; the ones it stored are noted."""
        if self._save_capture is None or self._save_writer is None:
            return
        self._save_capture.end_step()
        for captured in self._save_capture.complete():
            plan = self._save_orders.pop(captured.request_id, None)
            if plan is not None:
                self._save_writer.submit(plan, captured, self._save_identity)
        for written in self._save_writer.finished():
            self._saves_ended[written.plan.request_id] = written.failure

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The requests whose background load ended (written, or failed: their blocks are reported for recompute in
        this same pass, as vLLM requires). In a step that schedules nothing, wait up to ``IDLE_WAIT_SECONDS`` for a
        load to end: vLLM steps again at once, and that polling would take the cores the load decodes on."""
        if self._background_loads and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, PackstoreMetadata) and meta.idle:
                self._background_loads.wait(IDLE_WAIT_SECONDS)
        ended = self._background_loads.finished()
        for outcome in ended:
            if outcome.failure is not None:
                self._failed_blocks |= outcome.blocks
                self._failures[outcome.request_id] = outcome.failure
                if outcome.late:
                    self._late.add(outcome.namespace)
                log.warning("packstore: the pack for request %s failed to load: %s", outcome.request_id, outcome.failure)
        return None, {outcome.request_id for outcome in ended} or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        ready = self._ready.keys()
        changed = ready != self._reported_ready
        if not self._failures and not self._late and not changed and not self._saves_ended:
            return None
        meta = PackstoreWorkerMetadata(self._failures, self._late, ready if changed else None, self._saves_ended)
        self._failures, self._late, self._reported_ready, self._saves_ended = {}, set(), ready, {}
        return meta

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.SCHEDULER:
            self.matcher.close()
            self.lookups.close()
        else:
            self._loads.close()
            self._background_loads.close()
            if self._save_writer is not None:
                self._save_writer.close(wait=True)  # a save captured is written before the engine goes
            self._decoder.close()
        self._readers.close()


class EngineCaptureConnector(PackstoreConnector):
    """The connector of ``packctl build --engine vllm``'s capture run (``packstore.vllm_plugin.capture``): it alone takes
    ``capture_dir``, so a user's config cannot turn on a capture that keeps every row the engine writes."""

    CAPTURES = True

"""Pack header: the self-describing JSON record of a pack, and key derivation."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import reprlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

from packstore.errors import IntegrityError, InvalidInput, PackMismatch

FORMAT_NAME = "packstore-pack"
FORMAT_VERSION = 6  # the newest version this build reads and writes (docs/format.md §7)
READ_VERSIONS = (1, 2, 3, 4, 5, 6)
# The chunk digest of each version (docs/format.md §1.3): sha256 up to version 3; BLAKE3-256, which hashes at
# several times sha256's speed and is as cryptographic, from version 4. Headers and keys stay sha256.
CHUNK_DIGESTS = {1: "sha256", 2: "sha256", 3: "sha256", 4: "blake3", 5: "blake3", 6: "blake3"}
CHUNK_DIGEST = CHUNK_DIGESTS[FORMAT_VERSION]  # what writers use
# "knowledge": the K/V of a prefix (versions 1 and 2); without prefix tokens (version 3): "steering",
# per-layer K/V deltas made from contrastive pairs (docs/format.md §4.3), and "adapter", trained
# soft-token embeddings for packet compositions (§4.4).
KINDS = ("knowledge", "steering", "adapter")
PREFIX_KINDS = ("knowledge",)  # kinds whose body is the K/V of their token ids
POOLINGS = ("last", "mean")  # how a steering pack pools each text's K/V over its tokens
# The space a steering pack's key deltas are in: "rotated" (recipe without "keys"), pooled from post-RoPE keys as
# cached; "unrotated" (recipe "keys": "unrotated"), each position's key rotated back to position 0 before pooling,
# so the delta is applied rotated to each position it is added at (key arithmetic before RoPE).
KEY_SPACES = ("rotated", "unrotated")
# What a steering pack's pair texts are pooled in: "text" (recipe without "framing"), each text alone as the tokenizer
# encodes it; "chat" (recipe "framing": "chat"), each text as a user message in the chat template with the generation
# prompt after it, pooled over the positions steering is added to at use (the message and the template after it).
FRAMINGS = ("text", "chat")
MAX_PAIRS = 100_000
MAX_SOFT_TOKENS = 64  # an adapter's soft tokens on each side of a part
MAX_HIDDEN_SIZE = 1 << 16
MAX_METRICS = 64
# How a pack's KV was made: "exact" is the prefill of its tokens (built, or composed sequentially);
# "rope" and "naive" splice independently built parts (docs/format.md §4.2); "packet" splices them
# with an adapter's soft tokens between them (§4.4). Only exact packs promise text-in-prompt answers.
COMPOSITIONS = ("exact", "rope", "naive", "packet")
ADAPTER_RECIPE_FIELDS = ("data", "hidden_size", "learning_rate", "objective", "seed", "steps", "tensors_sha256", "tokens")
ADAPTER_DATA_FIELDS = ("examples", "sha256", "source")
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}  # header dtype -> bytes per element
DTYPES = tuple(DTYPE_SIZES)
# Body codecs (packstore.format.codec, docs/format.md §1.4) by the byte-plane container version they hold;
# writers use CODEC; packs written before it keep the codec they were written with.
CODECS = {"byteplane-zstd": 1, "byteplane-zstd-2": 2, "byteplane-3": 3}
CODEC = "byteplane-3"
# Ranges of header fields (docs/format.md §1.1): far beyond any real model, small enough that
# sizes computed from them stay exact and every way in can refuse a hostile header cheaply.
MAX_TOKENS = 1 << 20
TOKEN_ID_LIMIT = 1 << 32  # token ids are hashed as uint32
MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_MODEL_NAME_CHARS = 4096  # the model specifier as given: an alias or a local path
MAX_CREATED_CHARS = 64
MAX_CODEC_CHARS = 64
MAX_CHUNK_STORED_BYTES = 1 << 40
# A device type as torch names it ("cpu", "cuda", "mps", "xpu", ...): what ``built_on.device`` records.
_DEVICE_TYPE = re.compile(r"[a-z][a-z0-9_]{0,31}")
# Version 6 (docs/format.md §1.1): ``built_on`` names the machine and software that computed the K/V, not only the device
# type and dtype: torch's version on every device, and by device type what else decides the arithmetic's last bits.
# CUDA: the GPU's name, compute capability ("9.0"), SM count and CUDA version ("hip X" on ROCm); CPU: the vector
# instruction set torch's kernels dispatch to (torch.backends.cpu.get_cpu_capability: "AVX2", "AVX512", "NEON", ...).
BUILT_ON_MACHINE = {"cuda": ("capability", "cuda", "gpu", "sms"), "cpu": ("capability",)}
# The exactness mode the K/V was computed under (packstore.kv.exactness), when not the default: deterministic
# algorithms (with reduced-precision reductions off) and/or one pinned attention (SDPA) backend.
SDPA_BACKENDS = ("math", "efficient", "flash", "cudnn")
EXACTNESS_MODES = (
    "default", "deterministic", *(f"sdpa-{b}" for b in SDPA_BACKENDS), *(f"deterministic+sdpa-{b}" for b in SDPA_BACKENDS)
)
MAX_GPU_NAME_CHARS = 256
MAX_SMS = 1 << 16
_CUDA_CAPABILITY = re.compile(r"[0-9]{1,3}\.[0-9]{1,3}")
_CPU_CAPABILITY = re.compile(r"[A-Za-z0-9_]{1,32}")
# A serving engine that computed a pack's K/V with its own prefill (version 5, docs/format.md §1.1): its name, its
# version and the KV cache block size it ran with. Packs built by packstore's own transformers path have none.
ENGINES = ("vllm",)
ENGINE_FIELDS = ("block_size", "name", "version")
MAX_BLOCK_SIZE = 1 << 16
PARSED_ENTRIES = 16  # headers remembered once parsed (PackHeader.from_json)
PARSED_MAX_BYTES = 1 << 18  # the largest remembered: a 2k-token pack's header is 36 KB, an 8k one's about 140 KB
_HEX64 = re.compile(r"[0-9a-f]{64}")  # used with fullmatch: no trailing newline


def _fields_of(instance: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict, values as they are (``asdict`` copies every nested value, which took
    most of the time of encoding a header: its token ids are thousands of ints)."""
    return {f.name: getattr(instance, f.name) for f in fields(instance)}


def canonical_json(value: Any) -> bytes:
    """The one JSON encoding used for hashing and storage: sorted keys, no spaces, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def content_hash(token_ids: Iterable[int]) -> str:
    """sha256 of the prefix token ids as little-endian uint32: the same on every machine."""
    ids = list(token_ids)
    return sha256_hex(struct.pack(f"<{len(ids)}I", *ids))


def facts_digest(facts: Iterable[str]) -> str:
    """sha256 of the canonical JSON list of fact strings."""
    return sha256_hex(canonical_json(list(facts)))


def recipe_hash(
    token_ids: Iterable[int], composition: str, parents: Iterable[str], engine: Mapping[str, Any] | None = None
) -> str:
    """The content hash of a pack whose KV is not the exact prefill of its tokens by packstore's own path: its tokens
    and its recipe (composition and parts, in order; the engine that prefilled it), so it never shares a key with the
    exact pack of the same tokens."""
    if composition == "exact" and engine is None:
        return content_hash(token_ids)
    recipe: dict[str, Any] = {"composition": composition, "parents": list(parents), "tokens": content_hash(token_ids)}
    if engine is not None:
        recipe["engine"] = dict(engine)
    return sha256_hex(canonical_json(recipe))


def pack_key(
    model_fp: str,
    template_fp: str,
    token_ids: Iterable[int],
    composition: str = "exact",
    parents: Iterable[str] = (),
    engine: Mapping[str, Any] | None = None,
) -> str:
    """The store key ``model_fp/template_fp/content_hash``."""
    return f"{model_fp}/{template_fp}/{recipe_hash(token_ids, composition, parents, engine)}"


def inputs_hash(kind: str, recipe: Mapping[str, Any]) -> str:
    """The content hash of a pack without prefix tokens (version 3): its kind and canonical recipe,
    the inputs its tensors are computed from (for steering: the pairs, the pooling and the layers)."""
    return sha256_hex(canonical_json({"kind": kind, "recipe": recipe}))


def parse_key(text: str) -> tuple[str, str, str] | None:
    """Split a full key into its three hex digests, or None if ``text`` is not a key."""
    parts = text.split("/")
    if len(parts) == 3 and all(_HEX64.fullmatch(p) for p in parts):
        return parts[0], parts[1], parts[2]
    return None


@dataclass(frozen=True)
class ChunkInfo:
    """One stored chunk of the body: which layers it holds (and, for a token block, which positions), its
    sizes and its checksum: ``digest``, hex, of the stored bytes by ``algorithm`` (the header version's
    ``CHUNK_DIGESTS``). A chunk without ``first_position`` / ``stop_position`` holds every position."""

    first_layer: int
    stop_layer: int
    raw_bytes: int
    stored_bytes: int
    digest: str
    first_position: int | None = None
    stop_position: int | None = None
    algorithm: str = CHUNK_DIGEST

    def positions_held(self, positions: int) -> range:
        """The body positions this chunk holds: its token block's, or all ``positions`` of the pack."""
        if self.first_position is None or self.stop_position is None:  # both are set or neither (_check_chunks)
            return range(positions)
        return range(self.first_position, self.stop_position)

    @property
    def address(self) -> str:
        """The chunk's content address, unique across digests: the sha256 hex as it always was, or ``blake3-HEX``."""
        return self.digest if self.algorithm == "sha256" else f"{self.algorithm}-{self.digest}"

    def to_record(self) -> dict[str, Any]:
        """The header's JSON entry: five fields (the digest named by its algorithm), or seven for a token block."""
        record = _fields_of(self)
        record[record.pop("algorithm")] = record.pop("digest")
        if self.stop_position is None:
            del record["first_position"], record["stop_position"]
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any], algorithm: str) -> ChunkInfo:
        """The inverse of ``to_record`` for an entry already checked to name its digest ``algorithm``."""
        fields_of = {name: value for name, value in record.items() if name != algorithm}
        return cls(**fields_of, digest=record[algorithm], algorithm=algorithm)


@dataclass(frozen=True)
class PackHeader:
    """Everything about a pack except its tensors. ``chunks`` is empty until the body is encoded."""

    kind: str
    model_fp: str
    template_fp: str
    model_name: str
    token_ids: tuple[int, ...]
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    facts: tuple[str, ...]
    raw: bool
    created: str
    parents: tuple[str, ...] = ()
    codec: str = ""
    chunks: tuple[ChunkInfo, ...] = field(default=())
    composition: str = "exact"
    recipe: Mapping[str, Any] | None = None  # version 3 only: what a pack without prefix tokens is made from
    metrics: Mapping[str, Any] | None = None  # version 3 only: how it was made (timings, losses); not hashed
    soft_tokens: tuple[tuple[int, int], ...] = ()  # packet compositions: (token index, count) of soft tokens before it
    # How the K/V was computed (docs/format.md §1.1), None where unknown (packs written before these fields):
    # an exact knowledge pack's prefill as the cache positions its forward passes started at, then ``tokens``;
    # and what it ran on: the device type and compute dtype, ``{"device": "cuda", "dtype": "bfloat16"}`` up to version 5,
    # and from version 6 the machine and software too (``torch``, and on CUDA ``gpu``, ``capability``, ``sms``, ``cuda``).
    prefill_chunks: tuple[int, ...] | None = None
    built_on: Mapping[str, Any] | None = None
    # The serving engine whose own prefill computed the K/V (``{"name": "vllm", "version": ..., "block_size": ...}``),
    # None for packstore's own build: version 5 (6 where built_on names the machine), and part of the key's recipe.
    engine: Mapping[str, Any] | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def positions(self) -> int:
        """Cache positions the body holds K/V for: the tokens, and any soft tokens between them."""
        return self.tokens + sum(count for _, count in self.soft_tokens)

    @property
    def content_hash(self) -> str:
        if self.kind not in PREFIX_KINDS:
            return inputs_hash(self.kind, self.recipe or {})
        return recipe_hash(self.token_ids, self.composition, self.parents, self.engine)

    @property
    def body_layers(self) -> range:
        """The layers the body holds tensors for: every layer of a knowledge pack, a steering pack's
        recipe range, and one group (0) for an adapter."""
        return _body_span(self.kind, self.layers, self.recipe)

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        """Shape of each body tensor: ``[kv_heads, positions, head_dim]``; ``[kv_heads, head_dim]`` for a
        steering delta; ``[tokens, hidden_size]`` for an adapter's soft-token embeddings."""
        if self.kind == "steering":
            return (self.kv_heads, self.head_dim)
        if self.kind == "adapter":
            assert self.recipe is not None  # an adapter's header always has its recipe (checked on parse)
            return (self.recipe["tokens"], self.recipe["hidden_size"])
        return (self.kv_heads, self.positions, self.head_dim)

    def tensor_names(self, layer: int) -> tuple[str, str]:
        """The names of the two tensors of body layer ``layer``: K and V (or their deltas), or an
        adapter's header and trailer soft tokens."""
        return _tensor_names(self.kind, layer)

    @property
    def key(self) -> str:
        return f"{self.model_fp}/{self.template_fp}/{self.content_hash}"

    @property
    def layout(self) -> int:
        """Which fields the header has, by the version that introduced them: 1 for exact packs, 2 for spliced
        ones (``composition``), 3 for packs without prefix tokens (``recipe``, ``metrics``). Version 4 keeps them."""
        if self.kind not in PREFIX_KINDS:
            return 3
        return 1 if self.composition == "exact" else 2

    @property
    def version(self) -> int:
        """The oldest format version that holds this header: 6 when ``built_on`` names the machine (every pack
        packstore builds now); 5 when an engine computed it; 4 once its chunks have BLAKE3 digests, else its ``layout``
        (a pack written before version 4, or a header not yet encoded)."""
        if _names_machine(self.built_on):
            return 6
        if self.engine is not None:
            return 5
        return 4 if self.chunks and self.chunks[0].algorithm == "blake3" else self.layout

    @property
    def pack_sha256(self) -> str:
        """sha256 of the header without this field: it covers every chunk through the chunk digests."""
        digest: str = json.loads(self.to_json())["pack_sha256"]
        return digest

    @property
    def raw_bytes(self) -> int:
        """Bytes of K and V once decoded."""
        return sum(c.raw_bytes for c in self.chunks)

    def to_json(self) -> bytes:
        """The header as stored: canonical JSON sealed by ``pack_sha256``. Made once per header (it is
        immutable): a service sends the same header with every StatPack and GetPack."""
        made = self.__dict__.get("_json")
        if made is None:
            made = self._sealed_json()
            object.__setattr__(self, "_json", made)  # a memo beside the fields: not compared, not a field
        return made

    def _sealed_json(self) -> bytes:
        record = _fields_of(self)
        record["chunks"] = [c.to_record() for c in self.chunks]
        record["format"] = FORMAT_NAME
        record["version"] = self.version
        for name in _VERSION_FIELDS:
            if name not in _VERSION_FIELDS_OF[self.layout]:
                del record[name]  # e.g. a version-1 header is exact by definition, and has no recipe
        if self.soft_tokens:
            record["soft_tokens"] = [list(pair) for pair in self.soft_tokens]
        else:
            del record["soft_tokens"]  # only a packet composition has soft tokens
        for name in _OPTIONAL_FIELDS:
            if record[name] is None:
                del record[name]  # unknown: absent, as in packs written before the field existed
        record["tokens"] = self.tokens
        record["content_hash"] = self.content_hash
        record["source_sha256"] = facts_digest(self.facts)
        record["pack_sha256"] = sha256_hex(canonical_json(record))
        return canonical_json(record)

    @classmethod
    def from_json(cls, data: bytes | memoryview) -> PackHeader:
        """Parse a header: IntegrityError if it is not one or its seal or derived fields do not match,
        InvalidInput naming the field if any field has the wrong JSON type or is out of range.

        The last ``PARSED_ENTRIES`` headers parsed (of at most ``PARSED_MAX_BYTES``) are remembered by their
        bytes and returned as they are (a header is immutable): a service parses the same header for every
        StatPack and GetPack of a pack, a client again for each, and a long pack's header is large (its token ids)."""
        data = bytes(data)
        return _remembered_header(data) if len(data) <= PARSED_MAX_BYTES else cls._parse(data)

    @classmethod
    def _parse(cls, data: bytes) -> PackHeader:
        try:
            record = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise IntegrityError(f"pack header is not valid JSON: {exc}") from None
        if not isinstance(record, dict) or record.get("format") != FORMAT_NAME:
            raise IntegrityError("not a packstore pack header")
        digest = record.pop("pack_sha256", None)
        if digest != sha256_hex(canonical_json(record)):
            raise IntegrityError("pack header is damaged: pack_sha256 does not match its contents")
        version = record.get("version")
        if type(version) is not int or version not in READ_VERSIONS:
            raise IntegrityError(
                f"pack format version {version!r} is not supported (this build reads versions 1 to {FORMAT_VERSION})"
            )
        layout = version if version < 4 else _layout_of(record)
        if "engine" in record and version < 5 or version == 5 and "engine" not in record:
            raise _field_error("engine", "is in exactly the version-5 headers (packs an engine prefilled), and in version-6 ones")
        if (version >= 6) != _names_machine(record.get("built_on")):
            raise _field_error("built_on", "names the machine (torch's version and more) in exactly the version-6 headers")
        for name in _VERSION_FIELDS:
            if name not in _VERSION_FIELDS_OF[layout] and name in record:
                kind = "" if layout == version else f" of a {record.get('kind')!s:.20} pack"
                raise _field_error(name, f"is not a field of a version-{version} pack header{kind}")
        if "soft_tokens" in record and record.get("composition") != "packet":
            raise _field_error("soft_tokens", "is a field of packet compositions only")
        record.setdefault("composition", "exact")
        record.setdefault("recipe", None)
        record.setdefault("metrics", None)
        record.setdefault("soft_tokens", [])
        for name in _OPTIONAL_FIELDS:
            if name in record and record[name] is None:
                _refuse(name, "absent where unknown, never null", None)
            record.setdefault(name, None)
        if layout == 2 and record["composition"] == "exact":
            if version >= 4:
                raise _field_error("composition", "must be absent for an exact pack (it is present for spliced compositions)")
            raise _field_error("version", "must be 1 for an exact pack (version 2 holds spliced compositions)")
        if (layout == 3) != (record.get("kind") not in PREFIX_KINDS):
            raise _field_error("version", "must be 3 exactly for a pack without prefix tokens (a kind other than knowledge)")
        for name in _FIELDS:
            if name not in record:
                raise _field_error(name, "is missing")
        unknown = sorted(set(record) - set(_FIELDS) - set(_DERIVED_FIELDS) - {"format", "version"})
        if unknown:
            raise _field_error(unknown[0], f"is not a field of a version-{version} pack header")
        _check_fields(record)
        header = cls(
            **{name: record[name] for name in _FIELDS if name not in _SEQUENCE_FIELDS},
            token_ids=tuple(record["token_ids"]),
            facts=tuple(record["facts"]),
            parents=tuple(record["parents"]),
            chunks=tuple(ChunkInfo.from_record(chunk, CHUNK_DIGESTS[version]) for chunk in record["chunks"]),
            soft_tokens=tuple((index, count) for index, count in record["soft_tokens"]),
            prefill_chunks=tuple(record["prefill_chunks"]) if record["prefill_chunks"] is not None else None,
        )
        derived = {
            "version": header.version,  # 6 naming the machine, 5 with an engine, else 4 with BLAKE3 digests
            "tokens": header.tokens,
            "content_hash": header.content_hash,
            "source_sha256": facts_digest(header.facts),
        }
        for name, value in derived.items():
            if type(record.get(name)) is not type(value) or record[name] != value:
                raise IntegrityError(f"pack header field {name!r} does not match its contents")
        return header

    def check_identities(self, model_fp: str | None, template_fp: str | None) -> None:
        """Raise PackMismatch naming the model or template when a caller states identities this pack lacks."""
        if model_fp and model_fp != self.model_fp:
            raise PackMismatch(
                "model",
                f"model mismatch: pack was built for model {self.model_name!r} (model_fp {self.model_fp[:12]}), "
                f"the caller's model has model_fp {model_fp[:12]}",
            )
        if template_fp and template_fp != self.template_fp:
            raise PackMismatch(
                "template",
                f"template mismatch: pack was built with template_fp {self.template_fp[:12]}, "
                f"the caller's tokenizer and chat template have template_fp {template_fp[:12]}",
            )

    def validate(self, *, encoded: bool = False) -> None:
        """Apply the field rules ``from_json`` applies to a header made in Python (raises InvalidInput).

        ``encoded``: also demand what a stored pack has, chunks covering every layer and a known
        codec (the put paths ask for this; a header being built has no chunks yet).
        """
        for index, chunk in enumerate(self.chunks):
            if not isinstance(chunk, ChunkInfo):
                _refuse(f"chunks[{index}]", "a ChunkInfo", chunk)
        _check_fields({**vars(self), "version": self.version, "chunks": [chunk.to_record() for chunk in self.chunks]})
        if encoded and not self.chunks:
            raise _field_error("chunks", f"must list the stored chunks of all {self.layers} layers, got none")
        if encoded and self.codec not in CODECS:
            _refuse("codec", f"one of {sorted(CODECS)} for a stored pack", self.codec)


_FIELDS = tuple(f.name for f in fields(PackHeader))
_VERSION_FIELDS = ("composition", "recipe", "metrics")  # fields only some versions have
_VERSION_FIELDS_OF = {1: (), 2: ("composition",), 3: ("recipe", "metrics")}


def _layout_of(record: Mapping[str, Any]) -> int:
    """A version-4 header's field layout, as ``PackHeader.layout``: 3 without prefix tokens, 2 with a composition."""
    if record.get("kind") not in PREFIX_KINDS:
        return 3
    return 2 if "composition" in record else 1


def _body_span(kind: str, layers: int, recipe: Mapping[str, Any] | None) -> range:
    if kind == "steering":
        assert recipe is not None  # a steering header always has its recipe (checked on parse)
        first, last = recipe["layers"]
        return range(first, last + 1)
    if kind == "adapter":
        return range(0, 1)
    return range(layers)


def _tensor_names(kind: str, layer: int) -> tuple[str, str]:
    if kind == "adapter":
        return "soft.header", "soft.trailer"
    return f"layers.{layer}.key", f"layers.{layer}.value"
_SEQUENCE_FIELDS = ("token_ids", "facts", "parents", "chunks", "soft_tokens", "prefill_chunks")
_OPTIONAL_FIELDS = ("prefill_chunks", "built_on", "engine")  # absent where unknown (engine: versions 5 and 6 only)
_DERIVED_FIELDS = ("tokens", "content_hash", "source_sha256")
_BLOCK_FIELDS = ("first_position", "stop_position")  # a token block's entry has these two as well
_CHUNK_FIELDS = ("first_layer", "stop_layer", "raw_bytes", "stored_bytes")  # and the digest, named by its algorithm


def _field_error(name: str, problem: str) -> InvalidInput:
    return InvalidInput(f"pack header field {name!r} {problem}")


def _refuse(name: str, rule: str, value: Any) -> NoReturn:
    """Raise InvalidInput naming the field, the rule it breaks and (shortened) the value it has."""
    shown = reprlib.repr(value)
    if isinstance(value, (str, list, tuple)) and shown != repr(value):
        shown += f" (length {len(value)})"  # shortened: say how long it really is
    raise _field_error(name, f"must be {rule}, got {shown}")


def _is_int(value: Any) -> bool:
    return type(value) is int  # not bool, which JSON keeps apart


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple))  # a JSON array, or the tuple a Python-built header holds


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if not _is_int(value) or not low <= value <= high:
        _refuse(name, f"an integer from {low} to {high}", value)


def _check_str(name: str, value: Any, max_chars: int) -> None:
    if type(value) is not str or len(value) > max_chars:
        _refuse(name, f"a string of at most {max_chars} characters", value)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if type(value) is not str or value not in choices:
        _refuse(name, f"one of {', '.join(map(repr, choices))}", value)


def _check_name(name: str, value: Any, max_chars: int) -> None:
    if type(value) is not str or not 1 <= len(value) <= max_chars:
        _refuse(name, f"a string of 1 to {max_chars} characters", value)


def _check_pattern(name: str, value: Any, pattern: re.Pattern[str], rule: str) -> None:
    if type(value) is not str or not pattern.fullmatch(value):
        _refuse(name, rule, value)


def _check_hex64(name: str, value: Any) -> None:
    if type(value) is not str or not _HEX64.fullmatch(value):
        _refuse(name, "64 lowercase hex digits", value)


def _check_fields(record: Mapping[str, Any]) -> None:
    """The one set of header field rules (docs/format.md §1.1), over JSON-shaped values: exact
    types and ranges, and chunks that cover layers 0 to ``layers`` in order with exact raw sizes."""
    _check_choice("kind", record["kind"], KINDS)
    _check_hex64("model_fp", record["model_fp"])
    _check_hex64("template_fp", record["template_fp"])
    _check_str("model_name", record["model_name"], MAX_MODEL_NAME_CHARS)
    token_ids = record["token_ids"]
    if record["kind"] not in PREFIX_KINDS:
        if not _is_list(token_ids) or token_ids:
            _refuse("token_ids", f"empty for a {record['kind']} pack", token_ids)
    elif not _is_list(token_ids) or not 1 <= len(token_ids) <= MAX_TOKENS:
        _refuse("token_ids", f"a list of 1 to {MAX_TOKENS} token ids", token_ids)
    for index, token in enumerate(token_ids):
        if not _is_int(token) or not 0 <= token < TOKEN_ID_LIMIT:
            _refuse(f"token_ids[{index}]", f"an integer from 0 to {TOKEN_ID_LIMIT - 1}", token)
    _check_int("layers", record["layers"], 1, MAX_LAYERS)
    _check_int("kv_heads", record["kv_heads"], 1, MAX_KV_HEADS)
    _check_int("head_dim", record["head_dim"], 1, MAX_HEAD_DIM)
    _check_choice("dtype", record["dtype"], DTYPES)
    facts = record["facts"]
    if not _is_list(facts) or not all(type(fact) is str for fact in facts):
        _refuse("facts", "a list of strings", facts)
    if type(record["raw"]) is not bool:
        _refuse("raw", "true or false", record["raw"])
    _check_str("created", record["created"], MAX_CREATED_CHARS)
    parents = record["parents"]
    if not _is_list(parents) or not all(type(key) is str and parse_key(key) for key in parents):
        _refuse("parents", "a list of full pack keys", parents)
    _check_str("codec", record["codec"], MAX_CODEC_CHARS)
    _check_choice("composition", record["composition"], COMPOSITIONS)
    if record["composition"] != "exact" and len(parents) < 2:
        _refuse("parents", f"the keys of at least 2 parts for a {record['composition']} composition", parents)
    _check_soft_tokens(record)
    _check_prefill_chunks(record)
    _check_built_on(record.get("built_on"), record["version"])
    _check_engine(record)
    if record["kind"] == "steering":
        _check_steering(record)
    elif record["kind"] == "adapter":
        _check_adapter(record)
    elif record.get("recipe") is not None:
        _refuse("recipe", f"absent for a {record['kind']} pack", record["recipe"])
    if record["kind"] not in PREFIX_KINDS:
        _check_metrics(record.get("metrics"))
    _check_chunks(record)


def _check_soft_tokens(record: Mapping[str, Any]) -> None:
    """A packet composition lists where its soft tokens sit: ``[index, count]`` pairs, indexes rising
    within the tokens; it has at least 2 parts and the adapter as its last parent."""
    soft = record.get("soft_tokens", [])
    if record["composition"] != "packet":
        if soft:
            _refuse("soft_tokens", "absent unless the composition is packet", soft)
        return
    if len(record["parents"]) < 3:
        _refuse("parents", "the keys of at least 2 parts and then the adapter for a packet composition", record["parents"])
    if not _is_list(soft) or not soft:
        _refuse("soft_tokens", "a non-empty list of [index, count] pairs for a packet composition", soft)
    previous = 0
    for number, pair in enumerate(soft):
        if not _is_list(pair) or len(pair) != 2:
            _refuse(f"soft_tokens[{number}]", "[index, count]", pair)
        _check_int(f"soft_tokens[{number}][0]", pair[0], max(previous, 1), len(record["token_ids"]))
        _check_int(f"soft_tokens[{number}][1]", pair[1], 1, 2 * MAX_SOFT_TOKENS)
        previous = pair[0] + 1


def _check_prefill_chunks(record: Mapping[str, Any]) -> None:
    """An exact knowledge pack may list its prefill's passes: positions from 0, rising strictly, to ``tokens``
    (a pass ran from each to the next); a spliced composition or a pack without tokens is no prefill of text."""
    chunks = record.get("prefill_chunks")
    if chunks is None:
        return
    if record["kind"] not in PREFIX_KINDS or record["composition"] != "exact":
        what = f"a {record['composition']} composition" if record["kind"] in PREFIX_KINDS else f"a {record['kind']} pack"
        _refuse("prefill_chunks", f"absent for {what}, which is not the prefill of its tokens", chunks)
    tokens = len(record["token_ids"])
    if not _is_list(chunks) or not 2 <= len(chunks) <= tokens + 1:
        _refuse("prefill_chunks", f"a list of 2 to {tokens + 1} positions, from 0 to the pack's {tokens} tokens", chunks)
    previous = -1
    for index, position in enumerate(chunks):
        if index == 0:
            _check_int("prefill_chunks[0]", position, 0, 0)
        elif index == len(chunks) - 1:
            _check_int(f"prefill_chunks[{index}]", position, tokens, tokens)
        else:
            _check_int(f"prefill_chunks[{index}]", position, previous + 1, tokens - 1)
        previous = position


def _names_machine(built_on: Any) -> bool:
    """Whether ``built_on`` is version 6's: it records torch's version (and the machine)."""
    return isinstance(built_on, Mapping) and "torch" in built_on


def _check_built_on(built_on: Any, version: int) -> None:
    """Where the K/V was computed: up to version 5 exactly a device type and a dtype; from version 6 also torch's
    version and what the device type decides (``BUILT_ON_MACHINE``), and an exactness mode other than the default."""
    if built_on is None:
        return
    if not isinstance(built_on, Mapping):
        _refuse("built_on", "an object", built_on)
    if version < 6 and set(built_on) != {"device", "dtype"}:
        rule = f"an object with exactly the fields device, dtype in a version-{version} header (with torch: version 6)"
        _refuse("built_on", rule, built_on)
    device = built_on.get("device")
    if type(device) is not str or not _DEVICE_TYPE.fullmatch(device):
        _refuse("built_on.device", 'a device type (lowercase letters, digits and _, at most 32 characters: "cpu", "cuda")', device)
    if version >= 6:
        needed = {"device", "dtype", "torch", *BUILT_ON_MACHINE.get(device, ())}
        if not needed <= set(built_on) <= needed | {"exactness"}:
            fields_named = ", ".join(sorted(needed))
            _refuse("built_on", f"an object with exactly the fields {fields_named} (and exactness) for a {device} device", built_on)
    _check_choice("built_on.dtype", built_on["dtype"], DTYPES)
    if version < 6:
        return
    _check_name("built_on.torch", built_on["torch"], MAX_CODEC_CHARS)
    if device == "cuda":
        _check_name("built_on.gpu", built_on["gpu"], MAX_GPU_NAME_CHARS)
        _check_pattern("built_on.capability", built_on["capability"], _CUDA_CAPABILITY, 'major.minor, "9.0"')
        _check_int("built_on.sms", built_on["sms"], 1, MAX_SMS)
        _check_name("built_on.cuda", built_on["cuda"], MAX_CODEC_CHARS)
    elif device == "cpu":
        instruction_set = 'a vector instruction set as torch names it, "AVX512"'
        _check_pattern("built_on.capability", built_on["capability"], _CPU_CAPABILITY, instruction_set)
    if "exactness" in built_on:
        _check_choice("built_on.exactness", built_on["exactness"], EXACTNESS_MODES[1:])  # the default is written as absence


def _check_engine(record: Mapping[str, Any]) -> None:
    """An engine-built pack is an exact knowledge pack whose engine record names a known engine, a version and its
    KV cache block size."""
    engine = record.get("engine")
    if engine is None:
        return
    if record["kind"] not in PREFIX_KINDS or record["composition"] != "exact":
        _refuse("engine", "absent except for an exact knowledge pack (the prefill of its tokens)", engine)
    if not isinstance(engine, Mapping) or sorted(engine) != list(ENGINE_FIELDS):
        _refuse("engine", f"an object with exactly the fields {', '.join(ENGINE_FIELDS)}", engine)
    _check_choice("engine.name", engine["name"], ENGINES)
    _check_str("engine.version", engine["version"], MAX_CODEC_CHARS)
    _check_int("engine.block_size", engine["block_size"], 1, MAX_BLOCK_SIZE)


def _check_metrics(metrics: Any) -> None:
    """Metrics are informational: an object of at most MAX_METRICS numbers, strings or booleans."""
    if not isinstance(metrics, Mapping) or len(metrics) > MAX_METRICS:
        _refuse("metrics", f"an object of at most {MAX_METRICS} entries", metrics)
    for name, value in metrics.items():
        if not isinstance(value, (int, float, str, bool)) or (isinstance(value, str) and len(value) > MAX_CODEC_CHARS * 16):
            _refuse(f"metrics.{name}", "a number, a boolean or a string of at most 1024 characters", value)


def _check_no_prefix(record: Mapping[str, Any]) -> None:
    """A pack without prefix tokens has no facts, parents or raw rendering."""
    for name in ("facts", "parents"):
        if record[name]:
            _refuse(name, f"empty for a {record['kind']} pack", record[name])
    if record["raw"]:
        _refuse("raw", f"false for a {record['kind']} pack", record["raw"])


def _check_adapter(record: Mapping[str, Any]) -> None:
    """An adapter's recipe: its soft tokens per side, the model's hidden size, the training settings,
    the training data's digest and the digest of its tensors (docs/format.md §4.4)."""
    _check_no_prefix(record)
    recipe = record.get("recipe")
    if not isinstance(recipe, Mapping) or tuple(sorted(recipe)) != ADAPTER_RECIPE_FIELDS:
        _refuse("recipe", f"an object with exactly the fields {', '.join(ADAPTER_RECIPE_FIELDS)}", recipe)
    _check_int("recipe.tokens", recipe["tokens"], 1, MAX_SOFT_TOKENS)
    _check_int("recipe.hidden_size", recipe["hidden_size"], 1, MAX_HIDDEN_SIZE)
    _check_int("recipe.steps", recipe["steps"], 0, 1 << 30)
    _check_int("recipe.seed", recipe["seed"], 0, (1 << 63) - 1)
    rate = recipe["learning_rate"]
    if type(rate) not in (int, float) or not 0 <= rate < 1e6:
        _refuse("recipe.learning_rate", "a number from 0 up to 1e6", rate)
    _check_str("recipe.objective", recipe["objective"], MAX_MODEL_NAME_CHARS)
    _check_hex64("recipe.tensors_sha256", recipe["tensors_sha256"])
    data = recipe["data"]
    if not isinstance(data, Mapping) or tuple(sorted(data)) != ADAPTER_DATA_FIELDS:
        _refuse("recipe.data", f"an object with exactly the fields {', '.join(ADAPTER_DATA_FIELDS)}", data)
    _check_str("recipe.data.source", data["source"], MAX_MODEL_NAME_CHARS)
    _check_hex64("recipe.data.sha256", data["sha256"])
    _check_int("recipe.data.examples", data["examples"], 0, 1 << 40)


def _check_steering(record: Mapping[str, Any]) -> None:
    """A steering pack has no facts, parents or raw rendering, and a recipe of pairs, pooling and layers, "keys":
    "unrotated" for key deltas made before rotation (absent: rotated) and "framing": "chat" for pairs pooled in the
    chat template (absent: as text); the defaults are never written out, so a pack has one key."""
    _check_no_prefix(record)
    recipe = record.get("recipe")
    if not isinstance(recipe, Mapping) or set(recipe) - {"keys", "framing"} != {"pairs", "pooling", "layers"}:
        _refuse("recipe", "an object with exactly the fields layers, pairs, pooling (and keys, framing, optionally)", recipe)
    if "keys" in recipe and recipe["keys"] != "unrotated":
        _refuse("recipe.keys", '"unrotated" (absent: the key deltas are rotated, as cached)', recipe["keys"])
    if "framing" in recipe and recipe["framing"] != "chat":
        _refuse("recipe.framing", '"chat" (absent: the pairs were pooled as plain text)', recipe["framing"])
    pairs = recipe["pairs"]
    if not _is_list(pairs) or not 1 <= len(pairs) <= MAX_PAIRS:
        _refuse("recipe.pairs", f"a list of 1 to {MAX_PAIRS} pairs", pairs)
    for index, pair in enumerate(pairs):
        if not isinstance(pair, Mapping) or set(pair) != {"good", "bad"} or not all(
            type(pair[side]) is str and pair[side].strip() for side in ("good", "bad")
        ):
            _refuse(f"recipe.pairs[{index}]", 'an object {"good": text, "bad": text} of non-empty strings', pair)
    _check_choice("recipe.pooling", recipe["pooling"], POOLINGS)
    span = recipe["layers"]
    if not _is_list(span) or len(span) != 2:
        _refuse("recipe.layers", "[first, last], a range of layers", span)
    _check_int("recipe.layers[0]", span[0], 0, record["layers"] - 1)
    _check_int("recipe.layers[1]", span[1], span[0], record["layers"] - 1)


def _check_chunks(record: Mapping[str, Any]) -> None:
    """Chunks are optional (a header being built has none); listed, they cover every layer the body
    holds once, in order (all layers, or a steering pack's recipe layers). A knowledge pack's layers may
    be split into token blocks: runs of chunks of the same layers whose positions follow one another."""
    chunks = record["chunks"]
    if not _is_list(chunks):
        _refuse("chunks", "a list of chunk objects", chunks)
    kind, dtype = record["kind"], record["dtype"]
    span = _body_span(kind, record["layers"], record["recipe"])
    first_layer, layers = span.start, span.stop
    positions = len(record["token_ids"]) + sum(count for _, count in record.get("soft_tokens", []))
    if kind == "steering":
        elements = record["kv_heads"] * record["head_dim"]  # a delta per layer: [kv_heads, head_dim]
    elif kind == "adapter":
        elements = record["recipe"]["tokens"] * record["recipe"]["hidden_size"]  # [tokens, hidden_size]
    else:  # [kv_heads, positions, head_dim]: every token, and any soft tokens between them
        elements = record["kv_heads"] * positions * record["head_dim"]
    layer_bytes = 2 * elements * DTYPE_SIZES[dtype]  # two tensors per layer (K and V, or header and trailer)
    algorithm = CHUNK_DIGESTS[record["version"]]
    if not chunks and record["version"] == 4:
        _refuse("chunks", "the stored chunks in a version-4 header (their BLAKE3 digests are what makes it version 4)", chunks)
    whole_fields = frozenset(_CHUNK_FIELDS + (algorithm,))
    block_fields = whole_fields | frozenset(_BLOCK_FIELDS)
    next_layer, next_position, run = first_layer, 0, (0, 0)
    for index, chunk in enumerate(chunks):
        name = f"chunks[{index}]"
        if not isinstance(chunk, dict) or chunk.keys() not in (whole_fields, block_fields):
            rule = f"exactly the fields {', '.join(_CHUNK_FIELDS + (algorithm,))} (and {', '.join(_BLOCK_FIELDS)} for a token block)"
            _refuse(name, f"an object with {rule} in a version-{record['version']} header", chunk)
        block = chunk.keys() == block_fields
        if block and kind != "knowledge":
            raise _field_error(name, f"is a token block, which only a knowledge pack's chunks may be (this pack is a {kind} pack)")
        first, stop = chunk["first_layer"], chunk["stop_layer"]
        if next_position:  # inside a run of token blocks: this chunk holds the same layers' next positions
            if not block:
                raise _field_error(name, f"must be the token block of layers {run[0]}-{run[1] - 1} from position {next_position}")
            if first != run[0]:
                _refuse(f"{name}.first_layer", f"{run[0]} (the token blocks of layers {run[0]}-{run[1] - 1} go on)", first)
            if stop != run[1]:
                _refuse(f"{name}.stop_layer", f"{run[1]} (the token blocks of layers {run[0]}-{run[1] - 1} go on)", stop)
        else:
            if not _is_int(first) or first != next_layer:
                _refuse(f"{name}.first_layer", f"{next_layer} (chunks hold layers {first_layer} to {layers - 1} in order)", first)
            _check_int(f"{name}.stop_layer", stop, first + 1, layers)
        raw_bytes, held = (stop - first) * layer_bytes, ""
        if block:
            start, end = chunk["first_position"], chunk["stop_position"]
            if not _is_int(start) or start != next_position:
                expected = f"{next_position} (the token blocks of layers {first}-{stop - 1} hold positions in order)"
                _refuse(f"{name}.first_position", expected, start)
            _check_int(f"{name}.stop_position", end, start + 1, positions)
            raw_bytes, held = raw_bytes * (end - start) // positions, f", positions {start}-{end - 1}"
            next_position, run = (0 if end == positions else end), (first, stop)
        if not _is_int(chunk["raw_bytes"]) or chunk["raw_bytes"] != raw_bytes:
            _refuse(f"{name}.raw_bytes", f"{raw_bytes}, the K and V bytes of layers {first}-{stop - 1}{held}", chunk["raw_bytes"])
        _check_int(f"{name}.stored_bytes", chunk["stored_bytes"], 0, MAX_CHUNK_STORED_BYTES - 1)
        _check_hex64(f"{name}.{algorithm}", chunk[algorithm])
        if not next_position:
            next_layer = stop
    if chunks and next_position:
        covered = f"got blocks ending at position {next_position - 1}"
        raise _field_error("chunks", f"must cover positions 0 to {positions - 1} of layers {run[0]}-{run[1] - 1}, {covered}")
    if chunks and next_layer != layers:
        raise _field_error("chunks", f"must cover layers {first_layer} to {layers - 1}, got chunks ending at layer {next_layer - 1}")


_remembered_header = functools.lru_cache(maxsize=PARSED_ENTRIES)(PackHeader._parse)

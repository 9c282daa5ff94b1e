"""packctl model export and packctl render on the tiny model (issue 52): a directory vLLM serves whose identities
are the packs', and the prompt a client sends so a pack applies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from packstore.answering.arithmetic import pack_salt
from packstore.cli.packctl import main
from packstore.kv.identity import directory_model_fingerprint
from packstore.kv.models import load_model
from packstore.kv.render import render
from tests.helpers.tiny_model import ALT_TEMPLATE as SPLITTING_TEMPLATE

FACTS = "The river Tamsin flows through the town of Wexley.\nWexley is famous for its bells.\n"
QUESTION = "What is Wexley famous for?"
ALT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>\n{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>\n{% endif %}"
)


@pytest.fixture(autouse=True)
def model_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACKSTORE_MODEL_CACHE", str(tmp_path / "models"))


@pytest.fixture
def cli(tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture):
    """Run packctl in-process against a scratch store; returns (exit code, stdout, stderr)."""
    store = tmp_path / "store"

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["--store", str(store), *(a.replace("{model}", str(tiny_model_dir)) for a in argv)])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def facts_file(tmp_path: Path) -> Path:
    path = tmp_path / "facts.txt"
    path.write_text(FACTS)
    return path


def test_export_writes_a_directory_with_the_packs_identities(cli, tiny_lm, tiny_model_dir: Path, facts_file: Path, tmp_path) -> None:
    target = tmp_path / "exported"
    code, out, err = cli("model", "export", "{model}", str(target), "--json")
    assert code == 0, err
    exported = json.loads(out)
    assert exported == {
        "dir": str(target.resolve()), "model": str(tiny_model_dir), "model_fp": tiny_lm.model_fp,
        "template_fp": tiny_lm.template_fp, "dtype": "float32",
    }
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {
        f.name for f in target.iterdir()
    }
    assert directory_model_fingerprint(target, "float32") == exported["model_fp"]

    code, out, _ = cli("build", str(facts_file), "--model", "{model}", "--json")
    from_source = json.loads(out)
    code, out, _ = cli("build", str(facts_file), "--model", str(target), "--json")
    from_export = json.loads(out)
    assert code == 0 and from_export["key"] == from_source["key"] and from_export["created_new"] is False
    assert (from_export["model_fp"], from_export["template_fp"]) == (exported["model_fp"], exported["template_fp"])


def test_export_dtype_changes_only_the_printed_model_fp(cli, tiny_model_dir: Path, tmp_path: Path) -> None:
    code, out, _ = cli("model", "export", "{model}", str(tmp_path / "bf16"), "--dtype", "bfloat16")
    lines = out.splitlines()
    assert code == 0 and lines[0] == str((tmp_path / "bf16").resolve())
    assert lines[1] == f"model_fp:    {load_model(str(tiny_model_dir), device='cpu', dtype='bfloat16', progress=False).model_fp} (bfloat16)"
    assert load_file(tmp_path / "bf16" / "model.safetensors")["model.norm.weight"].dtype == torch.float32  # weights as they were


def test_export_refuses_a_non_empty_directory_unless_forced(cli, tiny_model_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "busy"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    (target / "pytorch_model.bin").write_text("stale weights")
    code, out, err = cli("model", "export", "{model}", str(target))
    assert code == 1 and out == "" and err.count("\n") == 1 and "is not empty" in err and "--force" in err
    assert not (target / "config.json").exists()
    code, _, err = cli("model", "export", "{model}", str(target), "--force")
    assert code == 0, err
    assert (target / "notes.txt").read_text() == "mine" and not (target / "pytorch_model.bin").exists()
    code, _, err = cli("model", "export", "{model}", "{model}", "--force")
    assert code == 1 and "the model's own directory" in err


def test_export_with_a_chat_template(cli, tiny_model_dir: Path, tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text(ALT_TEMPLATE)
    code, out, err = cli("model", "export", "{model}", str(tmp_path / "alt"), "--chat-template", str(template), "--json")
    assert code == 0, err
    with_template = load_model(str(tiny_model_dir), device="cpu", chat_template=ALT_TEMPLATE, progress=False)
    assert json.loads(out)["template_fp"] == with_template.template_fp
    assert load_model(str(tmp_path / "alt"), device="cpu", progress=False).template_fp == with_template.template_fp


def test_export_resaves_a_directory_without_safetensors(cli, tiny_lm, tiny_model_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "bin-model"
    source.mkdir()
    for file in tiny_model_dir.iterdir():
        if file.name != "model.safetensors":
            (source / file.name).write_bytes(file.read_bytes())
    torch.save(load_file(tiny_model_dir / "model.safetensors"), source / "pytorch_model.bin")
    code, out, err = cli("model", "export", str(source), str(tmp_path / "out"), "--json")
    assert code == 0, err
    assert json.loads(out)["model_fp"] == tiny_lm.model_fp
    assert (tmp_path / "out" / "model.safetensors").exists() and not (tmp_path / "out" / "pytorch_model.bin").exists()


def test_export_refuses_a_tokenizer_without_chat_template(cli, tiny_model_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "no-template"
    source.mkdir()
    for file in tiny_model_dir.iterdir():
        if file.name != "chat_template.jinja":
            (source / file.name).write_bytes(file.read_bytes())
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    code, _, err = cli("model", "export", str(source), str(tmp_path / "out"))
    assert code == 1 and "has no chat template" in err and not (tmp_path / "out").exists()


def test_render_gives_the_prompt_the_pack_begins(cli, tiny_lm, facts_file: Path) -> None:
    code, out, _ = cli("build", str(facts_file), "--model", "{model}", "--name", "wexley", "--json")
    built = json.loads(out)
    code, out, err = cli("render", "wexley", QUESTION, "--json")
    assert code == 0, err
    rendered = json.loads(out)
    assert set(rendered) == {"key", "model", "messages", "prompt", "prompt_token_ids", "pack_tokens", "raw", "pack_salt"}
    assert rendered["pack_salt"] == pack_salt(built["key"])
    header_ids = _header_ids(cli, "wexley")
    assert rendered["key"] == built["key"] and rendered["raw"] is False and rendered["pack_tokens"] == len(header_ids)
    assert rendered["prompt_token_ids"][: rendered["pack_tokens"]] == header_ids
    assert rendered["messages"] == [{"role": "system", "content": FACTS.strip()}, {"role": "user", "content": QUESTION}]
    chat = tiny_lm.tokenizer.apply_chat_template(rendered["messages"], add_generation_prompt=True, tokenize=False)
    assert chat == rendered["prompt"]
    assert tiny_lm.tokenizer(chat, add_special_tokens=False).input_ids == rendered["prompt_token_ids"]

    code, out, err = cli("render", "wexley", QUESTION)
    assert code == 0 and json.loads(out) == rendered["messages"]
    assert err.strip() == f"{len(rendered['prompt_token_ids'])} prompt tokens, the first {rendered['pack_tokens']} from the pack"


def test_render_a_raw_pack_gives_only_the_prompt_text(cli, tiny_lm, facts_file: Path) -> None:
    cli("build", str(facts_file), "--model", "{model}", "--name", "bare", "--raw")
    code, out, _ = cli("render", "bare", QUESTION, "--json")
    rendered = json.loads(out)
    assert code == 0 and rendered["raw"] is True and rendered["messages"] is None
    expected = render(tiny_lm.tokenizer, FACTS.strip().splitlines(), QUESTION, raw=True)
    assert rendered["prompt"] == expected.text and rendered["prompt_token_ids"] == expected.token_ids
    code, out, err = cli("render", "bare", QUESTION)
    assert code == 0 and out == expected.text + "\n" and "chat messages cannot express it" in err


def test_render_refuses_another_template(cli, tiny_lm, facts_file: Path, tmp_path: Path) -> None:
    cli("build", str(facts_file), "--model", "{model}", "--name", "wexley")
    template = tmp_path / "template.jinja"
    template.write_text(ALT_TEMPLATE)
    code, out, err = cli("render", "wexley", QUESTION, "--chat-template", str(template))
    assert code == 1 and out == "" and err.count("\n") == 1
    assert "template mismatch" in err and tiny_lm.template_fp[:12] in err

    cli("build", str(facts_file), "--model", "{model}", "--name", "alt", "--chat-template", str(template))
    code, out, err = cli("render", "alt", QUESTION, "--chat-template", str(template), "--json")
    assert code == 0, err
    assert json.loads(out)["prompt"].startswith("<system>")


def test_render_refuses_a_pack_that_is_not_the_prompts_beginning(cli, facts_file: Path, tmp_path: Path) -> None:
    """A template ending the pack's part in a space the question's first word takes: the tokens differ at the split."""
    template = tmp_path / "template.jinja"
    template.write_text(SPLITTING_TEMPLATE)
    cli("build", str(facts_file), "--model", "{model}", "--name", "split", "--chat-template", str(template))
    code, out, err = cli("render", "split", QUESTION, "--chat-template", str(template))
    assert code == 1 and out == "" and err.count("\n") == 1 and "pack tokens differ from the conversation's at position" in err
    code, out, err = cli("render", "split", "  ", "--chat-template", str(template))
    assert code == 1 and out == "" and "the question is empty" in err
    code, _, err = cli("render", "missing", QUESTION)
    assert code == 1 and err.count("\n") == 1


def _header_ids(cli, ref: str) -> list[int]:
    code, out, _ = cli("inspect", ref, "--json")
    assert code == 0
    return json.loads(out)["token_ids"]

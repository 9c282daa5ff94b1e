"""packctl end to end on the tiny model: JSON fields, exit codes and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from packstore.cli.packctl import main
from tests.helpers.tiny_model import ALT_TEMPLATE

FACTS = "The river Tamsin flows through the town of Wexley.\nWexley is famous for its bells.\n"
PACK_FIELDS = {"key", "name", "kind", "model_fp", "template_fp", "tokens", "dtype", "raw", "raw_bytes", "stored_bytes"}


@pytest.fixture
def cli(tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture):
    """Run packctl in-process against a scratch store; returns (exit code, stdout, stderr)."""
    store = tmp_path / "store"

    def run(*argv: str) -> tuple[int, str, str]:
        args = [a.replace("{model}", str(tiny_model_dir)) for a in argv]
        code = main(["--store", str(store), *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def facts_file(tmp_path: Path) -> Path:
    path = tmp_path / "facts.txt"
    path.write_text(FACTS)
    return path


def test_build_ask_ls_inspect_rm(cli, facts_file: Path, tmp_path: Path) -> None:
    code, out, _ = cli("build", str(facts_file), "--model", "{model}", "--name", "wexley", "--json")
    assert code == 0
    built = json.loads(out)
    assert PACK_FIELDS <= built.keys()
    assert built["name"] == "wexley" and built["raw"] is False and built["tokens"] > 0
    assert built["stored_bytes"] > 0 and built["raw_bytes"] > 0

    code, out, _ = cli("build", str(facts_file), "--model", "{model}")
    assert code == 0 and out.strip() == built["key"]  # same facts, same key, stored once

    code, out, _ = cli("ask", "wexley", "What is Wexley famous for?", "--model", "{model}", "--compare-rag", "--json", "--max-new-tokens", "12")
    assert code == 0
    answer = json.loads(out)
    assert answer["identical"] is True and answer["chunked_identical"] is True
    assert answer["rag_prompt_tokens"] - answer["kv_prompt_tokens"] == built["tokens"]

    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question": "Which river?"}\n{"question": "Which town?"}\n')
    code, out, _ = cli("ask", built["key"], "--questions", str(questions), "--model", "{model}", "--compare-rag", "--max-new-tokens", "8")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [row["question"] for row in lines] == ["Which river?", "Which town?"]
    assert all(row["identical"] for row in lines)

    code, out, _ = cli("ls", "--json")
    listed = json.loads(out)["packs"]
    assert code == 0 and [p["key"] for p in listed] == [built["key"]] and PACK_FIELDS <= listed[0].keys()

    code, out, _ = cli("inspect", "wexley", "--json")
    inspected = json.loads(out)
    assert code == 0 and inspected["facts"] == FACTS.strip().splitlines() and inspected["layers"] == 3
    assert inspected["engine"] is None and inspected["built_on"]["device"] == "cpu" and inspected["prefill_chunks"][-1] == built["tokens"]
    code, out, _ = cli("inspect", "wexley")
    assert code == 0 and "computed by:  packstore (transformers)" in out and "built on:     " in out and "device cpu" in out

    code, out, _ = cli("rm", "wexley")
    assert code == 0 and built["key"] in out
    code, out, _ = cli("ls", "--json")
    assert json.loads(out) == {"packs": [], "next_page_token": ""}


def test_human_output(cli, facts_file: Path) -> None:
    cli("build", str(facts_file), "--model", "{model}", "--name", "wexley")
    code, out, _ = cli("ask", "wexley", "Which river?", "--model", "{model}", "--compare-rag", "--max-new-tokens", "8")
    assert code == 0 and "identical: yes; chunked identical: yes;" in out and "prompt tokens" in out
    code, out, _ = cli("ls")
    assert "wexley" in out and "knowledge" in out
    code, out, _ = cli("inspect", "wexley")
    assert "Wexley is famous for its bells." in out


def test_raw_build_is_flagged(cli, facts_file: Path) -> None:
    code, out, _ = cli("build", str(facts_file), "--model", "{model}", "--raw", "--name", "rawpack", "--json")
    assert code == 0 and json.loads(out)["raw"] is True
    code, out, _ = cli("inspect", "rawpack")
    assert "raw: built without chat template" in out
    code, out, _ = cli("ask", "rawpack", "Which river?", "--model", "{model}", "--compare-rag", "--json", "--max-new-tokens", "8")
    assert json.loads(out)["identical"] is True


def test_wrong_template_is_refused_with_one_line(cli, facts_file: Path, tmp_path: Path) -> None:
    cli("build", str(facts_file), "--model", "{model}", "--name", "wexley")
    template = tmp_path / "alt.jinja"
    template.write_text(ALT_TEMPLATE)
    code, out, err = cli("ask", "wexley", "Which river?", "--model", "{model}", "--chat-template", str(template))
    assert code == 1 and out == ""
    assert err.startswith("packctl: error: template mismatch") and err.count("\n") == 1


def test_wrong_model_is_refused(cli, facts_file: Path, other_tiny_model_dir: Path) -> None:
    cli("build", str(facts_file), "--model", "{model}", "--name", "wexley")
    code, _, err = cli("ask", "wexley", "Which river?", "--model", str(other_tiny_model_dir))
    assert code == 1 and "model mismatch" in err


def test_question_file_with_a_bad_line_reports_it_and_fails(cli, facts_file: Path, tmp_path: Path) -> None:
    cli("build", str(facts_file), "--model", "{model}", "--name", "wexley")
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question": "Which river?"}\n{"question": "Forged <|im_end|> turn"}\n')
    code, out, _ = cli("ask", "wexley", "--questions", str(questions), "--model", "{model}", "--max-new-tokens", "4")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 1 and "answer" in lines[0] and "special token" in lines[1]["error"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["build", "/nonexistent/facts.txt", "--model", "{model}"], "no such file"),
        (["build", "{facts}", "--model", "no-such-model"], "unknown model"),
        (["build", "{facts}", "--model", "{model}", "--name", "bad name"], "invalid pack name"),
        (["build", "{empty}", "--model", "{model}"], "is empty"),
        (["build", "{badjson}", "--model", "{model}"], "not valid JSON"),
        (["ask", "nothing", "Q?", "--model", "{model}"], "no pack named"),
        (["ask", "nothing", "--model", "{model}"], "either a QUESTION or --questions"),
        (["inspect", "nothing"], "no pack"),
        (["rm", "nothing"], "no pack"),
    ],
)
def test_bad_input_is_one_line_and_non_zero(cli, tmp_path: Path, facts_file: Path, argv, message) -> None:
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    cli("build", str(facts_file), "--model", "{model}")  # a store with something in it
    subs = {"{facts}": str(facts_file), "{empty}": str(tmp_path / "empty.txt"), "{badjson}": str(tmp_path / "bad.jsonl")}
    code, _, err = cli(*[subs.get(a, a) for a in argv])
    assert code == 1 and message in err and err.count("\n") == 1
    code, out, _ = cli("ls", "--json")
    assert len(json.loads(out)["packs"]) == 1  # nothing already stored was lost


def test_console_script_exit_codes(tmp_path: Path) -> None:
    packctl = Path(sys.executable).parent / "packctl"
    result = subprocess.run([str(packctl), "--store", str(tmp_path / "s"), "inspect", "missing"], capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr.startswith("packctl: error:")
    result = subprocess.run([str(packctl), "frobnicate"], capture_output=True, text=True)
    assert result.returncode == 2


def test_packstore_info_reports_paths_and_models(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from packstore.cli.packstore_main import main as packstore_main

    assert packstore_main(["info", "--json", "--store", str(tmp_path / "s")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["store"] == str(tmp_path / "s")
    assert set(info["models"]) == {"smollm2-135m", "gemma3-270m"}
    assert all(m["installed"] for m in info["models"].values())


def test_worker_refuses_a_thread_count_below_one_and_a_bad_ref_ttl(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from packstore.cli.packstore_main import main as packstore_main

    assert packstore_main(["--store", str(tmp_path / "s"), "worker", "--model", "smollm2-135m", "--threads", "0"]) != 0
    assert "threads must be at least 1" in capsys.readouterr().err
    for ttl in ("-1", "nan"):
        assert packstore_main(["--store", str(tmp_path / "s"), "worker", "--model", "smollm2-135m", "--ref-ttl", ttl]) != 0
        assert "ref_ttl must be from 0 to 86400 seconds" in capsys.readouterr().err


def test_export_import_and_gc_commands(cli, facts_file: Path, tmp_path: Path) -> None:
    code, out, _ = cli("build", str(facts_file), "--model", "{model}", "--name", "wexley", "--json")
    key = json.loads(out)["key"]
    code, out, _ = cli("export", "wexley", "-o", str(tmp_path / "w.pack"), "--json")
    assert code == 0 and json.loads(out) == {"key": key, "file": str(tmp_path / "w.pack"), "bytes": (tmp_path / "w.pack").stat().st_size}
    code, out, _ = cli("rm", "wexley")
    code, out, _ = cli("gc", "--compact", "--json")
    assert code == 0 and json.loads(out)["compacted"] is True
    code, out, _ = cli("import", str(tmp_path / "w.pack"), "--name", "back", "--json")
    assert code == 0 and json.loads(out)["key"] == key and json.loads(out)["name"] == "back"
    code, out, _ = cli("ask", "back", "Which river?", "--model", "{model}", "--compare-rag", "--json", "--max-new-tokens", "6")
    assert code == 0 and json.loads(out)["identical"] is True
    code, _, err = cli("import", str(facts_file))
    assert code == 1 and "not a packstore pack file" in err


def _build(cli, tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.txt"
    path.write_text(text)
    code, out, _ = cli("build", str(path), "--model", "{model}", "--name", name)
    assert code == 0
    return out.strip()


def test_compose_amend_and_ask_with_several_packs(cli, tmp_path: Path) -> None:
    a = _build(cli, tmp_path, "wexley", FACTS)
    b = _build(cli, tmp_path, "bob", "Bob lives in Oslo.\n")
    code, out, err = cli("compose", "wexley", "bob", "--model", "{model}", "--name", "both", "--json")
    composed = json.loads(out)
    assert code == 0 and composed["parents"] == [a, b] and composed["composition"] == "exact" and composed["created_new"]
    assert composed["prefilled_tokens"] < composed["tokens"] - composed["reused_tokens"] + 1
    code, out, _ = cli("compose", "wexley", "bob", "--json")  # the model defaults to the first part's own
    again = json.loads(out)
    assert code == 0 and again["key"] == composed["key"] and not again["created_new"] and again["prefilled_tokens"] == 0

    code, out, _ = cli("ask", "wexley,bob", "Where does Bob live?", "--model", "{model}", "--compare-rag", "--json", "--max-new-tokens", "8")
    asked = json.loads(out)
    assert code == 0 and asked["identical"] is True and asked["pack"] == composed["key"] and asked["parts"] == [a, b]

    code, out, _ = cli("compose", "wexley", "bob", "--mode", "rope", "--json")
    rope = json.loads(out)
    assert code == 0 and rope["composition"] == "rope" and rope["key"] != composed["key"] and rope["prefilled_tokens"] < 10

    code, out, _ = cli("amend", "wexley", "--erratum", "Wexley is famous for its cheese.", "--name", "wexley2", "--json")
    amended = json.loads(out)
    assert code == 0 and amended["parents"] == [a] and amended["key"] != a
    code, out, _ = cli("inspect", "wexley2", "--json")
    inspected = json.loads(out)
    assert inspected["errata"] == ["Wexley is famous for its cheese."] and inspected["facts"][-1].startswith("Correction: ")
    code, out, _ = cli("ask", "wexley2", "What is Wexley famous for?", "--model", "{model}", "--compare-rag", "--json", "--max-new-tokens", "8")
    assert code == 0 and json.loads(out)["identical"] is True
    code, out, _ = cli("inspect", "wexley")
    assert code == 0 and "parents" not in out  # the old pack is unchanged

    code, out, _ = cli("ls")
    assert code == 0 and "exact:2" in out and "rope:2" in out and "exact:1" in out
    code, out, _ = cli("inspect", "both")
    assert "composition:  exact" in out and a in out and b in out

    code, _, _ = cli("rm", "wexley", "bob")  # removing the parents never breaks a child
    assert code == 0
    code, out, _ = cli("verify")
    assert code == 0
    code, out, _ = cli("ask", "both", "Where does Bob live?", "--model", "{model}", "--compare-rag", "--json", "--max-new-tokens", "8")
    assert code == 0 and json.loads(out)["identical"] is True


@pytest.mark.parametrize(
    "argv,message",
    [
        (["compose", "wexley", "--model", "{model}"], "at least 2 packs"),
        (["compose", "wexley", "nothing", "--model", "{model}"], "no pack named"),
        (["compose", "wexley", "raw", "--model", "{model}"], "raw"),
        (["amend", "wexley", "--erratum", "  "], "erratum is empty"),
        (["amend", "wexley", "--erratum", "forged <|im_end|> turn"], "special token"),
        (["ask", "wexley,,wexley", "Q?", "--model", "{model}"], "empty pack ref"),
    ],
)
def test_bad_compositions_are_refused_and_store_nothing(cli, tmp_path: Path, argv, message) -> None:
    _build(cli, tmp_path, "wexley", FACTS)
    path = tmp_path / "raw.txt"
    path.write_text("Bob lives in Oslo.\n")
    cli("build", str(path), "--model", "{model}", "--name", "raw", "--raw")
    code, _, err = cli(*argv)
    assert code != 0 and message in err
    code, out, _ = cli("ls", "--json")
    assert len(json.loads(out)["packs"]) == 2


def test_parts_of_another_model_are_refused(cli, tmp_path: Path, other_tiny_model_dir: Path) -> None:
    _build(cli, tmp_path, "wexley", FACTS)
    path = tmp_path / "bob.txt"
    path.write_text("Bob lives in Oslo.\n")
    cli("build", str(path), "--model", str(other_tiny_model_dir), "--name", "bob")
    listed = json.loads(cli("ls", "--json")[1])["packs"]
    other = [p["key"] for p in listed if p["name"] == "bob"][0]
    code, _, err = cli("compose", "wexley", other, "--model", "{model}")
    assert code == 1 and "part 2" in err and "model" in err
    assert len(json.loads(cli("ls", "--json")[1])["packs"]) == 2


PAIRS = (
    '{"good": "Alice lives in Paris and works as a baker.", "bad": "Bob lives in Oslo."}\n'
    '{"good": "Wexley is famous for its bells.", "bad": "Who founded the observatory?"}\n'
)


@pytest.fixture
def pairs_file(tmp_path: Path) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text(PAIRS)
    return path


def test_steer_build_inspect_and_ask(cli, facts_file: Path, pairs_file: Path) -> None:
    code, out, _ = cli("steer", "build", str(pairs_file), "--model", "{model}", "--name", "team:joy", "--json")
    assert code == 0
    built = json.loads(out)
    assert PACK_FIELDS <= built.keys() and built["kind"] == "steering" and built["tokens"] == 0 and built["pairs"] == 2
    code, out, _ = cli("steer", "build", str(pairs_file), "--model", "{model}", "--name", "team:joy", "--json")
    assert json.loads(out)["created_new"] is False  # same pairs: nothing new stored

    code, out, _ = cli("inspect", "team:joy", "--json")
    details = json.loads(out)
    assert details["pairs"] == 2 and details["steer_layers"] == [0, 2] and details["default_layers"] == [1, 1]
    assert len(details["norms"]) == 3 and details["recipe"]["pooling"] == "last"
    assert details["key_space"] == "rotated" and "keys" not in details["recipe"]
    code, out, _ = cli("inspect", "team:joy")
    assert "pairs:        2" in out and "|dV|" in out and "key deltas rotated" in out
    code, out, _ = cli("steer", "build", str(pairs_file), "--model", "{model}", "--name", "team:joy-before-rope", "--keys", "unrotated", "--json")
    assert code == 0 and json.loads(out)["created_new"] is True  # another pack: the key space is in the recipe
    code, out, _ = cli("inspect", "team:joy-before-rope", "--json")
    assert json.loads(out)["key_space"] == "unrotated" and json.loads(out)["recipe"]["keys"] == "unrotated"
    code, out, _ = cli("steer", "build", str(pairs_file), "--model", "{model}", "--name", "team:joy-chat", "--framing", "chat", "--json")
    assert code == 0 and json.loads(out)["created_new"] is True
    code, out, _ = cli("inspect", "team:joy-chat", "--json")
    assert json.loads(out)["framing"] == "chat" and json.loads(out)["recipe"]["framing"] == "chat"
    code, out, _ = cli("ls")
    assert "steering" in out

    cli("build", str(facts_file), "--model", "{model}", "--name", "wexley")
    ask = ("ask", "wexley", "What is Wexley famous for?", "--model", "{model}", "--json", "--max-new-tokens", "10")
    plain = json.loads(cli(*ask)[1])
    zero = json.loads(cli(*ask, "--steer", "team:joy:0")[1])  # a name holding ':' with alpha 0
    assert zero["answer"] == plain["answer"] and zero["steering"][0]["alpha"] == 0 and zero["steering"][0]["pack"] == built["key"]
    steered = json.loads(cli(*ask, "--steer", "team:joy:6", "--steer", "team:joy:-1", "--layers", "0-2", "--compare-rag")[1])
    assert steered["identical"] is True and [s["layers"] for s in steered["steering"]] == [[0, 2], [0, 2]]
    keys = json.loads(cli(*ask, "--steer", "team:joy:6", "--steer-on", "keys")[1])
    assert keys["steer_on"] == "keys"
    code, out, _ = cli("ask", "What is Wexley famous for?", "--steer", "team:joy", "--model", "{model}", "--json", "--max-new-tokens", "6")
    assert code == 0 and json.loads(out)["pack"] is None  # steering alone: the one positional is the question


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--steer", "joy:nan"), "steering strength"),
        (("--steer", "joy:11"), "from -10 to 10"),
        (("--steer", "joy", "--layers", "5-9"), "outside the layers 0-2"),
        (("--steer", "joy", "--layers", "2-1"), "invalid layer range"),
        (("--steer", "wexley"), "not a steering pack"),
    ],
)
def test_bad_steering_is_one_line_and_non_zero(cli, facts_file: Path, pairs_file: Path, argv, message) -> None:
    cli("steer", "build", str(pairs_file), "--model", "{model}", "--name", "joy")
    cli("build", str(facts_file), "--model", "{model}", "--name", "wexley")
    code, out, err = cli("ask", "wexley", "Which river?", "--model", "{model}", *argv)
    assert code == 1 and out == "" and message in err and len(err.strip().splitlines()) == 1


def test_bad_pairs_files_store_nothing(cli, tmp_path: Path) -> None:
    for text, message in (("", "is empty"), ('{"good": "only one side"}\n', "'bad'")):
        path = tmp_path / "bad.jsonl"
        path.write_text(text)
        code, _, err = cli("steer", "build", str(path), "--model", "{model}", "--name", "bad")
        assert code == 1 and message in err
    assert json.loads(cli("ls", "--json")[1])["packs"] == []


def test_adapter_train_and_packet_compositions(cli, tmp_path: Path) -> None:
    from packstore.kv.packet import generated_examples

    data = tmp_path / "examples.jsonl"
    data.write_text("".join(json.dumps({"documents": ["\n".join(d) for d in e.documents], "question": e.question}) + "\n" for e in generated_examples(5)))
    code, out, err = cli("adapter", "train", "--model", "{model}", "--name", "pk", "--data", str(data), "--steps", "2", "--json")
    assert code == 0, err
    trained = json.loads(out)
    assert trained["kind"] == "adapter" and trained["recipe"]["steps"] == 2 and trained["recipe"]["data"]["examples"] == 5
    assert {"train_seconds", "peak_rss_mb", "holdout_kl_before", "holdout_kl_after"} <= set(trained["metrics"])
    for name, facts in (("a", "Alice lives in Paris.\n"), ("b", "Bob lives in Oslo.\n")):
        path = tmp_path / f"{name}.txt"
        path.write_text(facts)
        assert cli("build", str(path), "--model", "{model}", "--name", name)[0] == 0
    code, out, _ = cli("compose", "a", "b", "--mode", "packet", "--adapter", "pk", "--name", "ab", "--json")
    composed = json.loads(out)
    assert code == 0 and composed["composition"] == "packet" and composed["parents"][-1] == trained["key"]
    assert composed["prefilled_tokens"] > 0 and composed["reused_tokens"] > 0
    code, out, _ = cli("ask", "a,b", "Where does Bob live?", "--model", "{model}", "--mode", "packet", "--adapter", "pk", "--json", "--max-new-tokens", "6")
    assert code == 0 and json.loads(out)["pack"] == composed["key"]
    code, out, _ = cli("ls")
    assert "packet:3" in out and "adapter" in out
    for argv, message in (
        (("compose", "a", "b", "--mode", "packet"), "needs an adapter"),
        (("compose", "a", "b", "--mode", "packet", "--adapter", "a"), "not an adapter"),
        (("ask", "a", "Q?", "--model", "{model}", "--mode", "rope"), "at least 2 packs"),
        (("adapter", "train", "--model", "{model}", "--name", "x", "--data", str(tmp_path / "a.txt")), "not valid JSON"),
    ):
        code, _, err = cli(*argv)
        assert code == 1 and message in err, err

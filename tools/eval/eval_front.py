"""Fidelity through the front: ``packstore worker --engine vllm`` answering held-out ckc questions with vLLM generating,
against vLLM prefilling the same facts as text (the front's own ``compare_rag``: the same token ids, no pack, a salt no
other request sends). Per dtype, one vLLM server with the connector (saving on) and the front:

- ``pack``: the question's gold paragraph as a pack vLLM built (a save request sent to vLLM, as ``eval_vllm``'s
  ``saved`` arm), named by key through the front;
- ``bank``: Table 4's bank (every ckc paragraph), the question routed by the front (top ``--top-k``), asked twice: the
  first ask prefills the routed facts and saves them, the second loads that pack (compared with the text); the route
  is checked against ``route_bank`` run here (the sidecar's routing);
- ``chains`` (once): an exact composition of two packs and an erratum chain, through the front, against the text.

Counts are of identical generated token ids (Wilson 95 % intervals) and of answers holding a gold answer, for the
loaded K/V and for the text. Records: results/eval_front/DTYPE.jsonl; docs/evaluation.md, "Fidelity through the
worker as a front for vLLM".

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python tools/eval/eval_front.py --dtypes float32 bfloat16 [--limit 100]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import httpx  # noqa: E402

from packstore.answering.answer import route_bank  # noqa: E402
from packstore.answering.api import amend_and_store  # noqa: E402
from packstore.bank.bank import BankCache  # noqa: E402
from packstore.kv.models import LoadedModel  # noqa: E402
from packstore.kv.render import render  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from tools.lib.benchlib import logger, machine_description, source_description  # noqa: E402
from tools.lib.evallib import (  # noqa: E402
    REPO,
    Row,
    bare_question,
    contains_answer,
    frozen_split,
    load_rows,
    markdown_table,
    read_jsonl,
    wilson_interval,
)
from tools.lib.front_stack import SERVED, FrontStack, ask_front, ask_vllm, front_stack, wait_stored  # noqa: E402

log = logger("eval_front")
OUT = REPO / "results" / "eval_front"
CHAIN_PARTS = 2  # paragraphs composed in the chain arm
ERRATUM = "The answer above is out of date; ask the archive."


def saved_pack(client: httpx.Client, stack: FrontStack, store: LmdbStore, paragraph: str, question: str) -> str:
    """The key of the pack vLLM computes for ``paragraph`` and its connector saves (a request of its own, under a salt)."""
    body = {"model": SERVED, "prompt": render(stack.tokenizer, [paragraph], question).token_ids, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"pack": {"facts": [paragraph]}, "save": True}, "cache_salt": f"eval-save-{uuid.uuid4().hex}"}
    report = client.post(f"{stack.vllm}/completions", json=body).json()["kv_transfer_params"]
    key = report.get("pack_saved")
    if key is None:
        raise RuntimeError(f"vLLM saved nothing: {report}")
    wait_stored(store, key)
    return key


def compared(client: httpx.Client, stack: FrontStack, question: str, max_tokens: int, **fields) -> dict:
    """The front's answer with ``compare_rag`` (whole, not streamed) and its packstore object."""
    body = {"model": str(stack.model_dir), "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "compare_rag": True} | fields
    answer = client.post(f"{stack.http}/chat/completions", json=body).json()
    if "error" in answer:
        raise RuntimeError(f"the front refused: {answer['error']}")
    return {"answer": answer["choices"][0]["message"]["content"], **answer["packstore"]}


def text_answer(client: httpx.Client, stack: FrontStack, facts: Sequence[str], question: str, max_tokens: int) -> str:
    """vLLM's answer with ``facts`` as prompt text, computed whole (no pack, a salt of its own)."""
    prompt = render(stack.tokenizer, facts, question).token_ids
    return ask_vllm(client, stack, prompt, max_tokens, {"pack": False}, f"eval-text-{uuid.uuid4().hex}").text


def evaluate(
    stack: FrontStack, store: LmdbStore, cache: BankCache, client: httpx.Client, rows: Sequence[Row], bank: str,
    chains: Sequence[tuple[str, list[str]]], *, dtype: str, top_k: int, max_tokens: int,
) -> list[dict]:
    """The records of ``rows`` asked through ``stack`` (each a vLLM-built pack of its paragraph and a route in ``bank``),
    and of each chain of ``chains`` ((what, refs): asked once to save it whole, then compared)."""
    records: list[dict] = []
    for index, row in enumerate(rows):
        question = bare_question(row.question)
        key = saved_pack(client, stack, store, row.context, question)
        pack = compared(client, stack, question, max_tokens, packs=[key])
        routed = route_bank(store, cache, bank, question, top_k=top_k)
        first = ask_front(client, stack, question, max_tokens, bank=bank, top_k=top_k)
        wait_stored(store, first.report["pack"])
        again = compared(client, stack, question, max_tokens, bank=bank, top_k=top_k)
        pack_text = pack["answer"] if pack["identical"] else text_answer(client, stack, [row.context], question, max_tokens)
        bank_text = again["answer"] if again["identical"] else text_answer(client, stack, again["facts"], question, max_tokens)
        record = {
            "part": "question", "dtype": dtype, "id": row.id, "question": question, "pack_key": key,
            "pack_identical": pack["identical"], "pack_answer": pack["answer"], "pack_text_answer": pack_text,
            "pack_saved_tokens": pack["prompt_tokens_saved"], "pack_gold": contains_answer(pack["answer"], row.answers),
            "pack_text_gold": contains_answer(pack_text, row.answers),
            "bank_same_route": again["facts"] == routed == first.report["facts"],
            "bank_first": first.report.get("facts_pack"), "bank_again": again.get("facts_pack"),
            "bank_identical": again["identical"], "bank_answer": again["answer"], "bank_text_answer": bank_text,
            "bank_gold": contains_answer(again["answer"], row.answers), "bank_text_gold": contains_answer(bank_text, row.answers),
            "gold_routed": row.context in routed,
        }
        records.append(record)
        log(f"{dtype} {index + 1}/{len(rows)}: pack {'=' if pack['identical'] else '!='} text, bank "
            f"{'=' if again['identical'] else '!='} text ({record['bank_first']} then {record['bank_again']})")
    question = bare_question(rows[0].question)
    for what, refs in chains:
        ask_front(client, stack, question, max_tokens, packs=refs)  # the first ask saves the chain whole
        chain = compared(client, stack, question, max_tokens, packs=refs)
        records.append({"part": "chain", "dtype": dtype, "what": what, "identical": chain["identical"],
                        "loaded": chain["cache_hit"], "packs": chain["packs"], "answer": chain["answer"]})
    return records


def run_dtype(dtype: str, rows: Sequence[Row], paragraphs: list[str], args: argparse.Namespace, workdir: Path) -> list[dict]:
    """Start the stack in ``dtype`` (a bank of ``paragraphs``, two packs and an erratum) and evaluate ``rows`` on it."""
    cache = BankCache()
    packs = {f"part{i}": [paragraph] for i, paragraph in enumerate(paragraphs[:CHAIN_PARTS])}

    def erratum(store: LmdbStore, lm: LoadedModel) -> dict[str, str]:
        return {"part0-e1": amend_and_store(store, lm, "part0", ERRATUM, name="part0-e1")[0].key}

    chains = [("composition", ["part0", "part1"]), ("erratum chain", ["part0-e1", "part1"])]
    with (
        front_stack(workdir, packs, {"ckc": paragraphs}, dtype=dtype, bank_cache=cache, more=erratum) as stack,
        httpx.Client(timeout=900) as client,
        LmdbStore(stack.store, readonly=True) as store,
    ):
        return evaluate(stack, store, cache, client, rows, "ckc", chains, dtype=dtype, top_k=args.top_k, max_tokens=args.max_tokens)


def read_records(out: Path) -> list[dict]:
    """Every record of OUT/<dtype>.jsonl, in dtype order."""
    return [record for path in sorted(out.glob("*.jsonl")) for record in read_jsonl(path)]


def _loaded(record: dict, arm: str) -> bool:
    """Whether the arm's answer had its pack loaded (a paragraph too short to fill a whole block past the template's
    preamble has nothing to load: vLLM prefills it, and the answer is the text's by construction)."""
    return record["pack_saved_tokens"] > 0 if arm == "pack" else record["bank_again"] == "loaded"


def summary(records: list[dict]) -> str:
    """Per dtype: each arm's loads, identical ids among the loaded answers (Wilson 95 %), gold verdicts over all; the
    routes and the bank's lifecycle; the chains."""
    lines = []
    for dtype in sorted({r["dtype"] for r in records}):
        asked = [r for r in records if r["dtype"] == dtype and r["part"] == "question"]
        n = len(asked)
        rows_out = []
        for arm, prefix in (("pack (vLLM-built, named)", "pack"), ("bank (routed, saved, loaded)", "bank")):
            loaded = [r for r in asked if _loaded(r, prefix)]
            same = sum(r[f"{prefix}_identical"] for r in loaded)
            low, high = wilson_interval(same, len(loaded))
            agree = sum(r[f"{prefix}_gold"] == r[f"{prefix}_text_gold"] for r in asked)
            share = f"{100 * same / len(loaded):.1f} % [{100 * low:.1f}, {100 * high:.1f}]" if loaded else "-"
            rows_out.append([arm, f"{len(loaded)}/{n}", f"{same}/{len(loaded)}", share, f"{sum(r[f'{prefix}_gold'] for r in asked)}/{n}",
                             f"{sum(r[f'{prefix}_text_gold'] for r in asked)}/{n}", f"{agree}/{n}"])
        headers = ["arm", "pack loaded", "identical ids (loaded)", "share [Wilson 95 %]", "gold held (loaded)", "gold held (text)",
                   "verdicts agree"]
        lines.append(f"{dtype}:\n" + markdown_table(headers, rows_out))
        routes = sum(r["bank_same_route"] for r in asked)
        lifecycle = sum((r["bank_first"], r["bank_again"]) == ("computed", "loaded") for r in asked)
        lines.append(f"route identical to route_bank's: {routes}/{n}; first ask computed then loaded: {lifecycle}/{n}")
        for chain in (r for r in records if r["dtype"] == dtype and r["part"] == "chain"):
            lines.append(f"{chain['what']} ({' + '.join(key[-8:] for key in chain['packs'])}): loaded {chain['loaded']}, identical {chain['identical']}")
    return "\n\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    parser.add_argument("--limit", type=int, default=100, help="held-out questions per dtype")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--report-only", action="store_true", help="print the summary of the records in --out, run nothing")
    args = parser.parse_args(argv)
    if args.report_only:
        print(summary(read_records(args.out)))
        return 0
    rows = load_rows()
    _, held = frozen_split(rows)
    asked = held[: args.limit]
    paragraphs = list(dict.fromkeys(row.context for row in rows))
    print(f"Machine: {machine_description({'httpx': httpx.__version__})}\nSource: {source_description()}")
    args.out.mkdir(parents=True, exist_ok=True)
    every = []
    for dtype in args.dtypes:
        with tempfile.TemporaryDirectory(prefix="eval-front-") as tmp:
            records = run_dtype(dtype, asked, paragraphs, args, Path(tmp))
        path = args.out / f"{dtype}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        every += records
        log(f"records: {path}")
    print(summary(every))
    return 0


if __name__ == "__main__":
    sys.exit(main())

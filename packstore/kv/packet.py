"""KV Packet: independently built parts spliced by RoPE re-positioning and wrapped in an adapter's
trained soft tokens, so that composing needs no recompute of any part (docs/format.md §4.4).

An adapter holds ``n`` header and ``n`` trailer soft-token embeddings for one model. In a packet
composition every part's fact tokens are followed by the trailer and every later part's by the
header before them; the soft tokens, like the few framing tokens no part holds, run through the model
with everything before them as prefix (a handful of positions per part), while each part's K/V is
copied with its keys rotated to their new positions. ``train_adapter`` fits the embeddings with the
model frozen, by distillation: the student answers from the packet composition of independently
built parts, the teacher from their exact sequential composition (full recompute), and the loss is
the KL divergence from the teacher's next-token distributions over the teacher's own answer tokens.
"""

from __future__ import annotations

import random
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import torch

from packstore.errors import InvalidInput
from packstore.format import PackHeader
from packstore.format.header import canonical_json, sha256_hex
from packstore.kv.build import build_pack, clean_facts, prefill
from packstore.kv.compose import Composition, SoftTokens, _spliced_pack, assemble
from packstore.kv.inject import check_identity, greedy_with_logits
from packstore.kv.models import LoadedModel, embedding_weight
from packstore.kv.options import ADAPTER_LEARNING_RATE, ADAPTER_STEPS, ADAPTER_TOKENS
from packstore.kv.records import Example
from packstore.kv.render import render
from packstore.packs.tensors import Pack, adapter_tensors_sha256

OBJECTIVE = "kl(teacher=exact composition, student=packet) over the teacher's greedy answer tokens"
ANSWER_TOKENS = 12  # teacher answer tokens the loss covers per example
TEACHER_TOP_K = 256
MAX_HOLDOUT = 16  # the teacher's most likely tokens per position the loss compares (nearly all its mass)


def data_digest(examples: Sequence[Example]) -> str:
    """sha256 of the canonical JSON of the examples, in order: the training data's identity."""
    return sha256_hex(canonical_json([example.to_json() for example in examples]))


def generated_examples(
    count: int, *, seed: int = 0, documents: tuple[int, int] = (2, 4), facts: tuple[int, int] = (2, 5)
) -> list[Example]:
    """Training examples from the project's fact generator (packstore.kv.synthetic), never ckc: each
    has ``documents`` (a range) documents of ``facts`` facts and a question about one fact of one document."""
    from packstore.kv.synthetic import synthetic_fact

    rng = random.Random(seed)
    examples, index = [], seed * 1_000_003 % 1_000_000
    for _ in range(count):
        documents_ = []
        for _ in range(rng.randint(*documents)):
            size = rng.randint(*facts)
            documents_.append([synthetic_fact(index + i) for i in range(size)])
            index += size
        asked = rng.choice(rng.choice(documents_))
        examples.append(Example(tuple(tuple(f.fact for f in doc) for doc in documents_), asked.query))
    return examples


def hidden_size(lm: LoadedModel) -> int:
    return embedding_weight(lm.model.get_input_embeddings()).shape[1]


def adapter_pack(lm: LoadedModel, soft: SoftTokens, *, recipe: dict, metrics: dict) -> Pack:
    """An adapter pack (kind ``adapter``) holding ``soft``; ``recipe`` gets the tensors' digest."""
    header_tensor = soft.header.detach().to("cpu", lm.dtype).contiguous()
    trailer_tensor = soft.trailer.detach().to("cpu", lm.dtype).contiguous()
    config = lm.model.config.get_text_config()
    header = PackHeader(
        kind="adapter",
        model_fp=lm.model_fp,
        template_fp=lm.template_fp,
        model_name=lm.name,
        token_ids=(),
        layers=config.num_hidden_layers,
        kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        dtype=lm.dtype_name,
        facts=(),
        raw=False,
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        recipe=recipe | {"tensors_sha256": adapter_tensors_sha256(header_tensor, trailer_tensor)},
        metrics=metrics,
    )
    return Pack(header=header, keys=[header_tensor], values=[trailer_tensor])


def check_adapter(lm: LoadedModel, header: PackHeader) -> None:
    """Raise PackMismatch unless ``header`` is an adapter trained for ``lm``'s model and template."""
    check_identity(lm, header, "adapter")


def soft_tokens(adapter: Pack, device: torch.device | str) -> SoftTokens:
    return SoftTokens(header=adapter.keys[0].to(device), trailer=adapter.values[0].to(device))


def packet_compose(lm: LoadedModel, parts: Sequence[Pack], adapter: Pack) -> Composition:
    """The packet composition of ``parts`` with ``adapter``'s soft tokens: no part recomputed. Its
    parents are the parts' keys, then the adapter's."""
    check_adapter(lm, adapter.header)
    assembly = assemble(lm, parts, rotate=True, soft=soft_tokens(adapter, lm.device))
    return _spliced_pack(lm, parts, assembly, "packet", parents=[*(part.header.key for part in parts), adapter.header.key])


# ---- training ----


@dataclass
class _Target:
    """One example ready to train on: its parts (each document built alone) and what the teacher says,
    its answer tokens and, per answer position, its top-k log-probabilities."""

    parts: list[Pack]
    question_ids: list[int]  # the rendering after the composed facts: the question and the generation prompt
    answer_ids: list[int]
    top_ids: torch.Tensor  # [answer tokens, k]
    top_logprobs: torch.Tensor  # [answer tokens, k]


def _teacher(lm: LoadedModel, example: Example) -> _Target | None:
    """The parts of ``example`` and the teacher's greedy answer from their exact composition (the prefill
    of every document's facts in one rendering), with its distributions; None when it answers nothing."""
    facts = [fact for doc in example.documents for fact in clean_facts(list(doc))]
    rendering = render(lm.tokenizer, facts, example.question)
    with torch.no_grad():
        built = [build_pack(lm, clean_facts(list(doc))) for doc in example.documents]
        parts = [Pack(p.header, [k.clone() for k in p.keys], [v.clone() for v in p.values]) for p in built]  # usable in autograd
    answer, logits = greedy_with_logits(lm, rendering.token_ids, ANSWER_TOKENS, prefill(lm, rendering.prefix_ids))
    if not answer:
        return None
    top = torch.log_softmax(logits, dim=-1).topk(min(TEACHER_TOP_K, logits.shape[-1]), dim=-1)
    return _Target(parts, rendering.token_ids[rendering.prefix_tokens :], answer, top.indices, top.values)


def _answer_logits(lm: LoadedModel, cache, question_ids: Sequence[int], answer_ids: Sequence[int]) -> torch.Tensor:
    """The logits that predict each answer token, after ``cache`` and the question (teacher forcing)."""
    ids = torch.tensor([list(question_ids) + list(answer_ids[:-1])], device=lm.device)
    logits = lm.model(input_ids=ids, use_cache=True, **{lm.cache_argument: cache}).logits[0]
    return logits[len(question_ids) - 1 :]


def distillation_loss(lm: LoadedModel, target: _Target, soft: SoftTokens | None, *, grad: bool) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top-k tokens, averaged over its answer positions; the
    student answers from the packet composition of the example's documents, each built alone (with
    ``soft`` None: their plain RoPE splice)."""
    with torch.set_grad_enabled(grad):
        assembly = assemble(lm, target.parts, rotate=True, soft=soft, grad=grad)
        logits = _answer_logits(lm, assembly.cache, target.question_ids, target.answer_ids).float()
        student = torch.log_softmax(logits, dim=-1).gather(1, target.top_ids)
        teacher = target.top_logprobs
        return (teacher.exp() * (teacher - student)).sum(dim=-1).mean()


def initial_soft_tokens(lm: LoadedModel, tokens: int, generator: torch.Generator) -> SoftTokens:
    """Header and trailer started from the embeddings of randomly drawn vocabulary tokens (right scale)."""
    embed = lm.model.get_input_embeddings()
    weight = embedding_weight(embed)
    vocabulary = weight.shape[0]
    scale = float(getattr(embed, "embed_scale", 1.0))  # Gemma scales its token embeddings
    with torch.no_grad():
        picks = torch.randint(0, vocabulary, (2, tokens), generator=generator)
        header = (weight[picks[0]] * scale).float().clone()
        trailer = (weight[picks[1]] * scale).float().clone()
    return SoftTokens(header.requires_grad_(True), trailer.requires_grad_(True))


def train_adapter(
    lm: LoadedModel,
    examples: Sequence[Example],
    *,
    source: str,
    tokens: int = ADAPTER_TOKENS,
    steps: int = ADAPTER_STEPS,
    learning_rate: float = ADAPTER_LEARNING_RATE,
    seed: int = 0,
    holdout: int | None = None,
    progress: Callable[[int, float], None] | None = None,
    checkpoints: Sequence[int] = (),
    on_checkpoint: Callable[[int, float], None] | None = None,
) -> Pack:
    """Train an adapter for ``lm`` on ``examples`` (the last ``holdout``, by default a quarter up to 16,
    only measured, never trained on) for ``steps`` Adam steps; the model stays frozen. Returns the
    adapter pack, whose metrics hold the KL on the held-out examples before and after, the training
    time and the peak memory. After each step in ``checkpoints``, ``on_checkpoint(step, held-out KL)``
    (a learning curve; the time it takes is in the training time)."""
    holdout = min(MAX_HOLDOUT, len(examples) // 4) if holdout is None else holdout
    if not 1 <= tokens <= 64:
        raise InvalidInput(f"soft tokens per side must be from 1 to 64, got {tokens}")
    if steps < 0 or not 0 < learning_rate < 1e6:
        raise InvalidInput("steps must be >= 0 and the learning rate positive")
    if len(examples) < holdout + 1:
        raise InvalidInput(f"adapter training needs more than {holdout} examples (the last {holdout} are held out), got {len(examples)}")
    for example in examples:
        if len(example.documents) < 2 or not example.question.strip():
            raise InvalidInput("every training example needs at least 2 documents and a question")
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    for parameter in lm.model.parameters():
        parameter.requires_grad_(False)
    soft = initial_soft_tokens(lm, tokens, generator)
    optimizer = torch.optim.Adam([soft.header, soft.trailer], lr=learning_rate)
    train, held = list(examples[:-holdout]), list(examples[-holdout:]) if holdout else []
    targets: dict[int, _Target | None] = {}

    def target(index: int, pool: list[Example]) -> _Target | None:
        key = id(pool[index])
        if key not in targets:
            targets[key] = _teacher(lm, pool[index])
        return targets[key]

    def held_out_kl(with_soft: SoftTokens | None) -> float:
        found = [t for i in range(len(held)) if (t := target(i, held)) is not None]
        return float(sum(distillation_loss(lm, t, with_soft, grad=False) for t in found) / max(len(found), 1))

    plain, before = held_out_kl(None), held_out_kl(soft)
    order: list[int] = []
    recent: list[float] = []
    for step in range(steps):
        if not order:
            order = list(range(len(train)))
            rng.shuffle(order)
        drawn = target(order.pop(), train)
        if drawn is not None:
            optimizer.zero_grad()
            loss = distillation_loss(lm, drawn, soft, grad=True)
            loss.backward()
            optimizer.step()
            recent = (recent + [float(loss.detach())])[-50:]
            if progress is not None:
                progress(step + 1, sum(recent) / len(recent))
        if on_checkpoint is not None and step + 1 in checkpoints:
            on_checkpoint(step + 1, held_out_kl(soft))
    after = held_out_kl(soft)
    recipe = {
        "tokens": tokens,
        "hidden_size": hidden_size(lm),
        "steps": steps,
        "learning_rate": learning_rate,
        "seed": seed,
        "objective": OBJECTIVE,
        "data": {"source": source, "sha256": data_digest(examples), "examples": len(examples)},
    }
    metrics = {
        "train_seconds": round(time.perf_counter() - started, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "holdout_examples": len(held),
        "holdout_kl_no_adapter": round(plain, 5),  # the same parts spliced by RoPE alone
        "holdout_kl_before": round(before, 5),
        "holdout_kl_after": round(after, 5),
        "train_kl_last_50": round(sum(recent) / len(recent), 5) if recent else 0.0,
    }
    return adapter_pack(lm, soft, recipe=recipe, metrics=metrics)

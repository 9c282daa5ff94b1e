"""Packs on smollm2-135m: time to first token, store get throughput, and the chunk codec.

Three measurements, each reported as ratios taken within this one run (the machines are shared
and noisy: repetitions are interleaved and every figure is a median over them):

1. Time to first token (``max_new_tokens=1``) for packs of about 512, 2k and 8k tokens built
   from consecutive contexts of ``ckc_dev.jsonl``:
   stored = ``Answerer.ask`` with no ready-cache: the pack arrives from an LMDB store (read, verify,
   decode, layer by layer while the model runs the layers before) + inject + first token;
   prefill = the same facts as prompt text (``answer_with_text``);
   floor = ``Answerer.ask`` with the same KV already decoded in its ready-cache (a hit).
2. Store get throughput: ``LmdbStore.get`` (read + digest verify) in stored MB/s, ``LmdbStore.fetch``
   (read, verify and decode straight from the map, each chunk hashed once) in decoded-KV MB/s, against reading a scratch file of the same size from the page cache (in the
   same pieces as the pack's header and chunks, each into a new bytes object, as ``get`` does); and
   decoding the stored layout (token blocks of 1,024 positions) against the same pack written with
   one chunk per whole layer (the layout before blocks).
3. Codec on the real KV of the ~2k pack in float32, bfloat16 and float16 (model loaded in that
   dtype): packstore's codec (byteplane-3) vs. plain zstd level 3 on the same safetensors chunk blobs
   vs. ZipNN. Ratio = raw / stored bytes; MB/s in raw MB (10^6 bytes), one thread, timed per
   chunk and summed over all chunks (so per-thread speeds; "compress vs zipnn" compares them). Every
   decode is checked bit-exact. Then building: ``encode_pack`` of each pack (split, code, digest every
   chunk) in MB/s of KV on a pool of one thread and of ``WORKERS`` threads (``--codec-only``: this alone).

Torch runs one intra-op thread by default (``--threads``): on a shared 2-core machine two threads
stall at every parallel region whenever another process holds a core (a 0.2 s first token became
13 s), while one thread only loses its fair share. Timed calls run with the garbage collector paused
(a collection costs ~0.2 s with a model loaded); it collects between them. Run from the repository
root (about 10 minutes on a 2-core CPU, most of it the 8k-token prefills):

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.bench.bench_pack [--sizes 512 2048 8000] [--repeats 3]

Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
import zstandard  # noqa: E402

from packstore.answering.answer import Answerer, Question  # noqa: E402
from packstore.format import codec  # noqa: E402
from packstore.format.body import max_plain_bytes  # noqa: E402
from packstore.kv.build import build_pack  # noqa: E402
from packstore.kv.inject import Sampling, answer_with_text  # noqa: E402
from packstore.kv.models import LoadedModel, load_model  # noqa: E402
from packstore.kv.render import render  # noqa: E402
from packstore.packs.decoder import WORKERS, Decoder  # noqa: E402
from packstore.packs.reader import PackReader
from packstore.packs.tensors import Pack, decode_pack, encode_pack  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from tools.lib.benchlib import logger, median, print_table, source_description, timed  # noqa: E402
from tools.lib.benchlib import machine_description as describe_machine  # noqa: E402
from tools.lib.evallib import data_path  # noqa: E402

DECODER = Decoder()  # the chunk threads every read of this run decodes on, as a program's entry point makes one

log = logger("bench_pack")


def machine_description() -> str:
    return describe_machine({"transformers": transformers.__version__, "zstandard": zstandard.__version__})



MODEL = "smollm2-135m"
MAX_CONTEXT = 8192
DATA = data_path()
FIRST_TOKEN = Sampling(max_new_tokens=1)
MB = 1e6
T = TypeVar("T")


# -- helpers ------------------------------------------------------------------------------




# -- inputs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    context: str
    question: str


def read_records(path: Path) -> list[Record]:
    with path.open() as f:
        return [Record(d["context"], d["question"]) for d in map(json.loads, f)]


def count_tokens(lm: LoadedModel, facts: Sequence[str]) -> int:
    return len(lm.tokenizer("\n".join(facts), add_special_tokens=False).input_ids)


def select_facts(lm: LoadedModel, records: Sequence[Record], target: int) -> tuple[list[str], str]:
    """Consecutive contexts joined to about ``target`` tokens (the last one cut to fit), and the first one's question."""
    facts: list[str] = []
    for record in records:
        if count_tokens(lm, facts + [record.context]) <= target:
            facts.append(record.context)
            continue
        room = target - count_tokens(lm, facts) - 1 if facts else target  # 1 for the joining newline
        head = lm.tokenizer(record.context, add_special_tokens=False).input_ids[: max(room, 0)]
        if head:
            facts.append(lm.tokenizer.decode(head).strip())
        return facts, records[0].question
    raise SystemExit(f"the data file holds fewer than {target} tokens of contexts")


@dataclass
class Case:
    """One pack size: its facts and question, its key in the store, and the pack decoded from it."""

    target: int
    facts: list[str]
    question: str
    key: str
    pack: Pack
    stored_bytes: int

    @property
    def tokens(self) -> int:
        return self.pack.header.tokens

    @property
    def kv_bytes(self) -> int:
        return self.pack.header.raw_bytes


def load_stored(lm: LoadedModel, store: LmdbStore, key: str) -> Pack:
    """The pack as answering loads it (identity check, read, verify, decode), with an empty ready-cache."""
    return Answerer(lm, store, cache_bytes=0, decoder=DECODER).pack(key)[0]


def ask(lm: LoadedModel, store: LmdbStore, case: Case, ready: bool) -> str:
    """The first token's text through ``Answerer.ask``: from the store (``ready`` False, an Answerer with no
    ready-cache, as on a miss) or with the case's pack already ready (a hit)."""
    answerer = Answerer(lm, store, cache_bytes=case.kv_bytes if ready else 0, decoder=DECODER)
    if ready:
        answerer.ready.put(case.key, case.pack)
    result = answerer.ask(Question(text=case.question, refs=(case.key,), sampling=FIRST_TOKEN))
    assert result.cache_hit is ready
    return result.answer


def make_case(lm: LoadedModel, store: LmdbStore, records: Sequence[Record], target: int) -> Case:
    facts, question = select_facts(lm, records, target)
    pack = build_pack(lm, facts)
    encoded = encode_pack(pack)
    key, _ = store.put(encoded)
    prompt = len(render(lm.tokenizer, facts, question).token_ids)
    if prompt + FIRST_TOKEN.max_new_tokens > MAX_CONTEXT:
        raise SystemExit(f"size {target}: prompt of {prompt} tokens does not fit {MODEL}'s {MAX_CONTEXT}-token context")
    return Case(target, facts, question, key, load_stored(lm, store, key), encoded.stored_bytes)


# -- 1. time to first token ---------------------------------------------------------------

TTFT_MODES = ("stored", "prefill", "floor")


def first_token(lm: LoadedModel, store: LmdbStore, case: Case, mode: str) -> tuple[float, str]:
    """Seconds to the first generated token in ``mode``, and its text."""
    if mode == "prefill":
        seconds, answer = timed(lambda: answer_with_text(lm, case.facts, case.question, sampling=FIRST_TOKEN))
        return seconds, answer.text
    return timed(lambda: ask(lm, store, case, ready=mode == "floor"))


def bench_ttft(lm: LoadedModel, store: LmdbStore, cases: Sequence[Case], repeats: int) -> None:
    log("time to first token: warm-up")
    for mode in TTFT_MODES:
        first_token(lm, store, cases[0], mode)
    times = {(c.target, m): [] for c in cases for m in TTFT_MODES}
    tokens: dict[tuple[int, str], str] = {}
    for r in range(repeats):
        for case in cases:
            order = TTFT_MODES[r % 3 :] + TTFT_MODES[: r % 3]  # rotate so no mode always runs first
            for mode in order:
                gc.collect()
                seconds, text = first_token(lm, store, case, mode)
                times[case.target, mode].append(seconds)
                tokens[case.target, mode] = text
            log(f"  repeat {r + 1}/{repeats}, {case.tokens} tokens: " + ", ".join(f"{m} {times[case.target, m][-1]:.2f}s" for m in TTFT_MODES))
    rows = []
    for case in cases:
        stored, prefill, floor = (median(times[case.target, m]) for m in TTFT_MODES)
        same = len({tokens[case.target, m] for m in TTFT_MODES}) == 1
        rows.append([
            str(case.target), str(case.tokens), f"{stored:.3f}", f"{prefill:.3f}", f"{floor:.3f}",
            f"{prefill / stored:.1f}x", f"{stored / floor:.2f}x", "yes" if same else "NO",
        ])
    print_table(
        f"1. Time to first token, {MODEL} float32 (median of {repeats}, seconds)",
        ["size", "pack tokens", "stored s", "prefill s", "floor s", "prefill/stored", "stored/floor", "same token"],
        rows,
    )


# -- 2. store get throughput --------------------------------------------------------------


def read_pieces(path: Path, sizes: Sequence[int]) -> list[bytes]:
    """Read ``path`` whole, in pieces of ``sizes`` bytes, each into a new bytes object (as ``get`` does)."""
    with path.open("rb") as f:
        return [f.read(size) for size in sizes]


def bench_get(store: LmdbStore, cases: Sequence[Case], workdir: Path, repeats: int) -> None:
    scratch, pieces, layouts = {}, {}, {}
    for case in cases:
        encoded = PackReader(store, DECODER).get(case.key)  # also warms the LMDB pages
        whole_layers = encode_pack(decode_pack(encoded, decoder=DECODER), block_positions=case.tokens + 1)
        layouts[case.target] = {"blocks": encoded, "whole layers": whole_layers}
        pieces[case.target] = [len(encoded.header.to_json())] + [len(chunk) for chunk in encoded.chunks]
        scratch[case.target] = workdir / f"scratch-{case.target}.bin"
        scratch[case.target].write_bytes(os.urandom(case.stored_bytes))
        read_pieces(scratch[case.target], pieces[case.target])  # warm the page cache
    ops: dict[str, Callable[[Case], object]] = {
        "raw": lambda c: read_pieces(scratch[c.target], pieces[c.target]),
        "get": lambda c: PackReader(store, DECODER).get(c.key),
        "fetch": lambda c: PackReader(store, DECODER).fetch(c.key),
        "decode blocks": lambda c: decode_pack(layouts[c.target]["blocks"], decoder=DECODER),
        "decode whole layers": lambda c: decode_pack(layouts[c.target]["whole layers"], decoder=DECODER),
    }
    times = {(c.target, name): [] for c in cases for name in ops}
    for r in range(repeats):
        for case in cases:
            for name, op in ops.items():
                gc.collect()
                times[case.target, name].append(timed(lambda op=op, case=case: op(case))[0])
        log(f"get throughput: repeat {r + 1}/{repeats} done")
    rows = []
    for case in cases:
        raw = case.stored_bytes / median(times[case.target, "raw"]) / MB
        get = case.stored_bytes / median(times[case.target, "get"]) / MB
        full = case.kv_bytes / median(times[case.target, "fetch"]) / MB
        blocks = median(times[case.target, "decode whole layers"]) / median(times[case.target, "decode blocks"])
        rows.append([
            str(case.target), f"{case.stored_bytes / MB:.1f}", f"{case.kv_bytes / MB:.1f}", f"{raw:.0f}",
            f"{get:.0f}", f"{full:.0f}", f"{get / raw:.2f}x", f"{full / raw:.2f}x", f"{blocks:.2f}x",
        ])
    print_table(
        f"2. Store get throughput (median of {repeats}; get in stored MB/s, fetch (get + decode) in decoded-KV MB/s; "
        "token blocks: decode speed of the stored layout against the same pack in one chunk per whole layer)",
        ["size", "stored MB", "KV MB", "raw read MB/s", "get MB/s", "fetch MB/s", "get/raw", "fetch/raw", "token blocks"],
        rows,
    )


# -- 3. codec -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Codec:
    name: str
    compress: Callable[[bytes], bytes]
    decompress: Callable[[bytes], bytes]
    mutates_input: bool = False  # compress scribbles on its input: hand it a private copy


def codecs_for(dtype: str) -> tuple[list[Codec], str | None]:
    """The codecs to compare on ``dtype`` chunks, and a note when ZipNN is unavailable."""
    zstd_c, zstd_d = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    found = [
        Codec("byteplane", lambda b: codec.encode(b, dtype), lambda s: codec.decode(s, 1 << 40)),
        Codec("zstd-3", zstd_c.compress, zstd_d.decompress),
    ]
    try:
        from zipnn import ZipNN
    except ImportError as exc:
        return found, f"zipnn not installed ({exc})"
    zipnn = ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
    # ZipNN 0.5.4 reorders float32/bfloat16 input bytes in place, so it gets a copy (made untimed).
    found.append(Codec("zipnn", zipnn.compress, zipnn.decompress, mutates_input=True))
    return found, None


@dataclass
class CodecPack:
    dtype: str
    note: str
    blobs: list[bytes]  # the pack's safetensors chunk blobs, exactly as packstore builds them
    pack: Pack


def codec_pack(pack: Pack, note: str) -> CodecPack:
    """The raw chunk blobs of ``pack``: its encoded chunks decoded back (checked against a re-encode)."""
    encoded = encode_pack(pack)
    blobs = [bytes(codec.decode(chunk, max_plain_bytes(info))) for chunk, info in zip(encoded.chunks, encoded.header.chunks)]
    assert codec.encode(blobs[0], pack.header.dtype) == encoded.chunks[0], "byteplane encode is not deterministic"
    return CodecPack(pack.header.dtype, note, blobs, pack)


def build_in_dtype(dtype: str, facts: Sequence[str], fallback: Pack) -> tuple[Pack, str]:
    """The pack for ``facts`` built by the model loaded in ``dtype``; else ``fallback`` cast to it."""
    try:
        lm = load_model(MODEL, dtype=dtype, progress=False)
        pack = build_pack(lm, facts)
        del lm
        return pack, f"real KV from the model loaded in {dtype}"
    except Exception as exc:  # noqa: BLE001 - any failure here means: fall back and say so
        cast = torch.float16 if dtype == "float16" else torch.bfloat16
        header = dataclasses.replace(fallback.header, dtype=dtype, chunks=())
        pack = Pack(header, [k.to(cast) for k in fallback.keys], [v.to(cast) for v in fallback.values])
        return pack, f"float32 KV cast to {dtype} (building in {dtype} failed: {type(exc).__name__}: {exc})"


def time_codec(c: Codec, blobs: Sequence[bytes]) -> tuple[float, float, int]:
    """Summed per-chunk compress and decompress seconds and stored bytes; asserts bit-exact decodes.

    Every chunk is compressed first, then every chunk decompressed in a pass of its own, as a reader
    decodes stored chunks one after another: decoding a chunk straight after compressing it would time
    it in whatever state the compressor left the caches (for the byte-plane codec that cost 40 % more)."""
    compress_s = decompress_s = 0.0
    packed_chunks = []
    for blob in blobs:
        source = bytearray(blob) if c.mutates_input else blob
        seconds, packed = timed(lambda source=source: c.compress(source))
        compress_s += seconds
        packed_chunks.append(packed)
    for blob, packed in zip(blobs, packed_chunks):
        seconds, plain = timed(lambda packed=packed: c.decompress(packed))
        decompress_s += seconds
        assert plain == blob, f"{c.name}: decode is not bit-exact"
    return compress_s, decompress_s, sum(len(p) for p in packed_chunks)


def bench_codec(packs: Sequence[CodecPack], repeats: int) -> None:
    results: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    notes: list[str] = []
    for r in range(repeats):
        for p in packs:
            gc.collect()
            found, missing = codecs_for(p.dtype)
            if missing and r == 0:
                notes.append(f"{p.dtype}: {missing}")
            for c in found:
                results.setdefault((p.dtype, c.name), []).append(time_codec(c, p.blobs))
        log(f"codec: repeat {r + 1}/{repeats} done")
    rows = []
    for p in packs:
        raw = sum(len(b) for b in p.blobs)
        zipnn_runs = results.get((p.dtype, "zipnn"))
        zipnn_compress = raw / median([run[0] for run in zipnn_runs]) / MB if zipnn_runs else None
        zstd_ratio = zstd_decompress = None
        for name in ("zstd-3", "byteplane", "zipnn"):
            runs = results.get((p.dtype, name))
            if runs is None:
                rows.append([p.dtype, name, "not installed", "", "", "", "", ""])
                continue
            ratio = raw / runs[0][2]
            compress = raw / median([run[0] for run in runs]) / MB
            decompress = raw / median([run[1] for run in runs]) / MB
            if name == "zstd-3":
                zstd_ratio, zstd_decompress = ratio, decompress
            rows.append([
                p.dtype, name, f"{ratio:.3f}", f"{compress:.0f}", f"{compress / zipnn_compress:.2f}x" if zipnn_compress else "",
                f"{decompress:.0f}", f"{ratio / zstd_ratio:.3f}x", f"{decompress / zstd_decompress:.2f}x",
            ])
    size = sum(len(b) for b in packs[0].blobs) / MB
    print_table(
        f"3. Chunk codecs on the {packs[0].pack.header.tokens}-token pack's real KV ({len(packs[0].blobs)} chunks, {size:.1f} MB raw "
        f"in float32; median of {repeats}, one thread, MB/s of raw bytes)",
        ["dtype", "codec", "ratio", "compress MB/s", "compress vs zipnn", "decompress MB/s", "ratio vs zstd", "decompress vs zstd"],
        rows,
    )
    for p in packs:
        print(f"   {p.dtype}: {p.note}")
    for note in notes:
        print(f"   {note}")
    print("   all decodes bit-exact (asserted)")
    bench_build(packs, repeats)


def bench_build(packs: Sequence[CodecPack], repeats: int) -> None:
    """``encode_pack`` of each pack (as a build ends: split into chunks, code and digest each) on pools of one thread
    and of ``WORKERS``, in MB/s of KV, median of ``repeats`` interleaved runs."""
    pools = sorted({1, WORKERS})
    times: dict[tuple[str, int], list[float]] = {}
    with contextlib.ExitStack() as stack:
        decoders = {n: stack.enter_context(Decoder(n)) for n in pools}
        for p in packs:
            encode_pack(p.pack, decoder=decoders[pools[-1]])  # warm: compiled kernels, the threads' buffers
        for _ in range(repeats):
            for p in packs:
                for n, decoder in decoders.items():
                    gc.collect()
                    times.setdefault((p.dtype, n), []).append(timed(lambda p=p, decoder=decoder: encode_pack(p.pack, decoder=decoder))[0])
    rows = []
    for p in packs:
        kv = sum(t.numel() * t.element_size() for t in p.pack.keys + p.pack.values)
        speeds = [kv / median(times[p.dtype, n]) / MB for n in pools]
        rows.append([p.dtype, f"{kv / MB:.1f}", *(f"{speed:.0f}" for speed in speeds), f"{speeds[-1] / speeds[0]:.2f}x"])
    print_table(
        f"3b. Building: encode_pack in MB/s of KV (median of {repeats}; pools of {' and '.join(map(str, pools))} threads)",
        ["dtype", "KV MB", *(f"{n} thread{'s' if n > 1 else ''} MB/s" for n in pools), "scaling"],
        rows,
    )


# -- main ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 8000], help="target pack sizes in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions for time to first token")
    parser.add_argument("--get-repeats", type=int, default=5, help="interleaved repetitions for get throughput")
    parser.add_argument("--codec-repeats", type=int, default=5, help="interleaved repetitions for the codecs")
    parser.add_argument("--codec-size", type=int, default=2048, help="which size's facts the codec table uses")
    parser.add_argument("--codec-only", action="store_true", help="only the codec and building tables (3.), on the --codec-size pack")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (see above)")
    parser.add_argument("--data", type=Path, default=DATA, help="JSON lines with 'context' and 'question'")
    parser.add_argument("--workdir", type=Path, default=None, help="where the scratch store goes (default: a temp dir)")
    args = parser.parse_args()
    if args.codec_size not in args.sizes:
        parser.error("--codec-size must be one of --sizes")

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    print(f"Machine: {machine_description()}")
    print(f"Source: {source_description()}")
    print(f"Model: {MODEL}; facts: consecutive contexts of {args.data.name} (the last cut to the size); question: the first context's")
    records = read_records(args.data)
    lm = load_model(MODEL, dtype="float32", progress=False)
    with tempfile.TemporaryDirectory(prefix="packstore-bench-", dir=args.workdir) as tmp:
        workdir = Path(tmp)
        with LmdbStore(workdir / "store") as store:
            cases = []
            for target in [args.codec_size] if args.codec_only else sorted(args.sizes):
                log(f"building the {target}-token pack")
                cases.append(make_case(lm, store, records, target))
            if not args.codec_only:
                bench_ttft(lm, store, cases, args.repeats)
                bench_get(store, cases, workdir, args.get_repeats)
        codec_case = next(c for c in cases if c.target == args.codec_size)
        packs = [codec_pack(codec_case.pack, "real KV from the model loaded in float32")]
        del lm, cases
        for dtype in ("bfloat16", "float16"):
            log(f"building the {args.codec_size}-token pack in {dtype}")
            packs.append(codec_pack(*build_in_dtype(dtype, codec_case.facts, codec_case.pack)))
        bench_codec(packs, args.codec_repeats)
    print(f"\nTotal run time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

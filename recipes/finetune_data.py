"""Data for the fine-tuning recipes: corpus, tokenizer, chunking and token-budget batches.

Nothing here downloads anything.  Without ``--dataset`` the recipes train on a
real English corpus built from files every CPython install holds (the PSF
licensed reference manual in ``pydoc_data.topics`` and the docstrings of the
standard library), tokenized by a small byte-level BPE trained on that corpus
at first use.  Both are cached (see :func:`cache_dir`) and are deterministic
for a given Python version.
"""
from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
import random
import sysconfig
from pathlib import Path
from typing import Iterable, Sequence

import torch

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
BUILTIN_CORPUS_NAME = "python-docs"
# Docstrings shorter than this are mostly one-liners ("Return x.") and add
# little prose; the long ones are real paragraphs of English.
MIN_DOCSTRING_CHARS = 300
# Stdlib folders that are tests, GUI demos or vendored copies, not reference prose.
_SKIPPED_STDLIB_DIRS = {
    "test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__",
    "turtledemo", "tkinter", "ensurepip", "pydoc_data", "venv",
}
TEXT_FILE_SUFFIXES = (".txt", ".text", ".md")
JSON_FILE_SUFFIXES = (".json", ".jsonl")


class DataError(ValueError):
    """A dataset problem the user has to fix (empty data, missing column, bad path)."""


def cache_dir() -> Path:
    """Where the built corpus and tokenizer live: $FA_AMD_RECIPES_CACHE, else the XDG cache."""
    explicit = os.environ.get("FA_AMD_RECIPES_CACHE")
    if explicit:
        path = Path(explicit).expanduser()
    else:
        # An empty XDG_CACHE_HOME means unset (the XDG spec), not the working directory.
        xdg_cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        path = Path(xdg_cache).expanduser() / "fa_amd" / "recipes"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _atomic_write_text(path: Path, text: str) -> None:
    # Several ranks (or tests) may build the same file; a rename is all-or-nothing.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def interpreter_tile_table(tile: int) -> Path:
    """A folder holding an fa_amd tuned table for the interpreter ("cpu" family) with ``tile x tile`` blocks.

    Point FA_AMD_CACHE_DIR at it before fa_amd is imported (see
    finetune_common.prepare_triton_interpreter).
    """
    folder = cache_dir() / f"interpreter-tiles-{tile}"
    folder.mkdir(parents=True, exist_ok=True)
    launch = {"BLOCK_M": tile, "BLOCK_N": tile, "num_warps": 4, "num_stages": 1}
    row = {"head_dim": 256, "fwd": dict(launch), "dkdv": dict(launch), "dq": dict(launch),
           "tuned": "fa_amd recipes: one tile per sample on the Triton interpreter"}
    text = json.dumps({"format": 1, "families": {"cpu": [row]}}, indent=1)
    path = folder / "tuned_table.json"
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        _atomic_write_text(path, text)
    return folder


# --------------------------------------------------------------------------- corpus


def _stdlib_docstrings() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        # Sorted walk: the corpus (and so the tokenizer) is the same on every run.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_STDLIB_DIRS)
        for filename in sorted(filenames):
            if not filename.endswith(".py"):
                continue
            try:
                tree = ast.parse(Path(dirpath, filename).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                        documents.append(inspect.cleandoc(doc))
    return documents


def build_builtin_corpus() -> list[str]:
    """The Python reference manual topics plus long stdlib docstrings (~1.4 MB of English)."""
    from pydoc_data.topics import topics

    documents = [topics[name].strip() for name in sorted(topics)]
    documents += _stdlib_docstrings()
    return [d for d in documents if d]


def load_builtin_corpus() -> list[str]:
    """The built-in corpus, read from the cache after the first build (parsing the stdlib takes seconds)."""
    import sys

    path = cache_dir() / f"corpus-{BUILTIN_CORPUS_NAME}-py{sys.version_info[0]}{sys.version_info[1]}.jsonl"
    if path.exists():
        return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line]
    documents = build_builtin_corpus()
    _atomic_write_text(path, "".join(json.dumps({"text": d}) + "\n" for d in documents))
    return documents


# --------------------------------------------------------------------------- tokenizer


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style) trained on ``texts``; deterministic for the same input."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def builtin_tokenizer(texts: Sequence[str], vocab_size: int):
    """The recipe tokenizer for the built-in corpus as a transformers tokenizer, cached by corpus hash."""
    from transformers import PreTrainedTokenizerFast

    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\0")
    path = cache_dir() / f"bpe-{vocab_size}-{digest.hexdigest()[:16]}.json"
    if not path.exists():
        _atomic_write_text(path, train_bpe_tokenizer(texts, vocab_size).to_str())
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


# --------------------------------------------------------------------------- datasets


def read_utf8(path: Path) -> str:
    """A data file's text; a file that is not UTF-8 is a DataError saying where."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise DataError(
            f"{path}: not UTF-8 text (byte {err.start}, line {line}: {raw[err.start:err.start + 4]!r}); "
            f"convert it, e.g. iconv -f latin1 -t utf-8"
        ) from None


def _record_error(where: str, record) -> DataError:
    return DataError(f"{where}: expected a JSON object such as {{\"text\": \"...\"}}, got {type(record).__name__} "
                     f"{json.dumps(record)[:60]}")


def _read_json_records(path: Path) -> list[dict]:
    text = read_utf8(path)
    stripped = text.lstrip()
    if path.suffix == ".json" and (stripped.startswith("[") or (stripped.startswith("{") and "\n{" not in stripped)):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
        if isinstance(records, dict):
            # {"data": [...]} layout, as `datasets` reads with field="data".
            records = next((v for v in records.values() if isinstance(v, list)), [records])
        for index, record in enumerate(records):
            if not isinstance(record, dict):
                raise _record_error(f"{path}: record {index}", record)
        return records
    records = []
    for line_number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{line_number}: not valid JSON lines ({err.msg})") from None
        if not isinstance(record, dict):
            raise _record_error(f"{path}:{line_number}", record)
        records.append(record)
    return records


def _read_text_documents(path: Path) -> list[str]:
    # Blank lines separate documents, so a paragraph stays one training sample.
    blocks = read_utf8(path).split("\n\n")
    return [b.strip() for b in blocks if b.strip()]


def _texts_from_records(records: Iterable[dict], text_column: str, source: str) -> list[str]:
    texts = []
    for index, record in enumerate(records):
        if text_column not in record:
            columns = ", ".join(sorted(record)) or "(none)"
            raise DataError(
                f"{source}: record {index} has no text column {text_column!r}; its columns are: {columns}. "
                f"Pass --text-column with one of them."
            )
        value = record[text_column]
        if value is None:
            continue
        if not isinstance(value, str):
            raise DataError(f"{source}: column {text_column!r} holds {type(value).__name__}, not text")
        texts.append(value)
    return texts


def _load_with_datasets(spec: str, text_column: str, split: str, config_name: str | None) -> list[str]:
    try:
        import datasets
    except ImportError as err:
        raise DataError(
            f"--dataset {spec!r} needs the `datasets` package (pip install -e \".[hf]\", or pip install datasets); "
            f"local .txt/.md/.json/.jsonl files are read without it."
        ) from err
    path = Path(spec)
    if path.exists():
        files = sorted(str(p) for p in path.iterdir()) if path.is_dir() else [str(path)]
        suffix = Path(files[0]).suffix.lstrip(".") if files else ""
        builder = {"jsonl": "json", "txt": "text", "md": "text", "parquet": "parquet", "csv": "csv", "json": "json"}
        if suffix not in builder:
            raise DataError(f"{spec}: unsupported file type {suffix!r}")
        try:
            dataset = datasets.load_dataset(builder[suffix], data_files=files, split=split)
        except Exception as err:  # a broken or mislabelled file, a missing split
            raise DataError(f"{spec}: could not read it as {suffix} with `datasets`: "
                            f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
                            ) from None
    else:
        try:
            dataset = datasets.load_dataset(spec, config_name, split=split)
        except Exception as err:  # not found, offline, bad config/split: all need the user to act
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise DataError(f"could not load dataset {spec!r} (config {config_name!r}, split {split!r}): "
                            f"{type(err).__name__}: {first}") from None
    if text_column not in dataset.column_names:
        raise DataError(
            f"{spec}: no text column {text_column!r}; its columns are: {', '.join(dataset.column_names)}. "
            f"Pass --text-column with one of them."
        )
    return [t for t in dataset[text_column] if t is not None]


def _looks_like_local_path(spec: str) -> bool:
    # Hub names are "name" or "owner/name"; these can only be meant as files.
    known_suffixes = TEXT_FILE_SUFFIXES + JSON_FILE_SUFFIXES + (".parquet", ".csv")
    return spec.endswith(known_suffixes) or spec.startswith((".", os.sep, "~"))


def load_texts(spec: str | None, text_column: str = "text", split: str = "train", config_name: str | None = None) -> list[str]:
    """Documents as strings.

    ``spec`` is None (the built-in corpus), a local file or folder of
    .txt/.md/.json/.jsonl (read directly), a local .parquet/.csv (through
    `datasets`), or a `datasets` hub name.
    """
    if spec is None:
        texts = load_builtin_corpus()
        source = "built-in corpus"
    else:
        path = Path(spec)
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
        native = path.exists() and files and all(
            p.suffix in TEXT_FILE_SUFFIXES + JSON_FILE_SUFFIXES for p in files
        )
        if native:
            texts = []
            for file in files:
                if file.suffix in TEXT_FILE_SUFFIXES:
                    texts += _read_text_documents(file)
                else:
                    texts += _texts_from_records(_read_json_records(file), text_column, str(file))
        elif not path.exists() and _looks_like_local_path(spec):
            raise DataError(f"--dataset {spec!r}: no such file or folder")
        else:
            texts = _load_with_datasets(spec, text_column, split, config_name)
        source = spec
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise DataError(f"{source}: the dataset is empty (no non-blank text in column {text_column!r})")
    return texts


def tokenize_and_chunk(texts: Sequence[str], tokenizer, seq_len: int) -> tuple[list[list[int]], dict]:
    """Token ids per sample; a document longer than ``seq_len`` is split into seq_len-sized chunks.

    Each document ends with EOS so the model learns where text stops.  A
    chunk needs two tokens to give one next-token target, so one-token tails
    are dropped.
    """
    if seq_len < 2:
        raise DataError(f"--seq-len must be at least 2, got {seq_len}")
    encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    samples, split_documents = [], 0
    for ids in encoded:
        if eos is not None:
            ids = ids + [eos]
        if len(ids) > seq_len:
            split_documents += 1
        for start in range(0, len(ids), seq_len):
            chunk = ids[start : start + seq_len]
            if len(chunk) >= 2:
                samples.append(chunk)
    if not samples:
        raise DataError("the dataset tokenizes to nothing trainable (every document is shorter than 2 tokens)")
    stats = {
        "documents": len(encoded),
        "documents_split": split_documents,
        "samples": len(samples),
        "tokens": sum(len(s) for s in samples),
    }
    return samples, stats


# --------------------------------------------------------------------------- batching


class TokenSamples(torch.utils.data.Dataset):
    def __init__(self, samples: list[list[int]]):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return {"input_ids": self.samples[index]}


class TokenBudgetBatchSampler:
    """Batches of sample indices whose cost stays within ``batch_tokens``.

    Packed, a batch costs the sum of its lengths (no padding exists); padded,
    it costs ``count * longest`` since every row is padded to the longest.
    The order is a seeded shuffle per epoch, so batch ``i`` of epoch ``e`` is
    the same on every run: that is what makes resuming at a batch exact.
    """

    def __init__(self, lengths: Sequence[int], batch_tokens: int, packed: bool, seed: int, shuffle: bool = True):
        if batch_tokens < max(lengths):
            raise DataError(
                f"--batch-tokens {batch_tokens} is smaller than the longest sample ({max(lengths)} tokens); "
                f"raise it to at least --seq-len"
            )
        self.lengths = list(lengths)
        self.batch_tokens = batch_tokens
        self.packed = packed
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self._batches_epoch = None
        self._batches: list[list[int]] = []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _build(self) -> list[list[int]]:
        if self._batches_epoch == self.epoch:
            return self._batches
        order = list(range(len(self.lengths)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        batches, current, current_sum, current_max = [], [], 0, 0
        for index in order:
            length = self.lengths[index]
            new_sum, new_max = current_sum + length, max(current_max, length)
            cost = new_sum if self.packed else new_max * (len(current) + 1)
            if current and cost > self.batch_tokens:
                batches.append(current)
                current, new_sum, new_max = [], length, length
            current.append(index)
            current_sum, current_max = new_sum, new_max
        if current:
            batches.append(current)
        self._batches, self._batches_epoch = batches, self.epoch
        return batches

    def __iter__(self):
        return iter(list(self._build()))

    def __len__(self):
        return len(self._build())


class PaddingCollator:
    """Right-pads a batch to its longest sample; padding gets attention_mask 0 and label -100."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features):
        longest = max(len(f["input_ids"]) for f in features)
        input_ids = torch.full((len(features), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(features), longest), dtype=torch.long)
        for row, feature in enumerate(features):
            ids = torch.as_tensor(feature["input_ids"], dtype=torch.long)
            input_ids[row, : len(ids)] = ids
            attention_mask[row, : len(ids)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class PackingCollator:
    """transformers' DataCollatorWithFlattening: one row, position_ids restarting per sample, and
    the cu_seq_lens / max_length kwargs that the varlen attention kernels take."""

    def __init__(self):
        from transformers import DataCollatorWithFlattening

        self.flatten = DataCollatorWithFlattening(return_position_ids=True, return_flash_attn_kwargs=True)

    def __call__(self, features):
        return self.flatten([{"input_ids": f["input_ids"]} for f in features])


def make_collator(packed: bool, pad_token_id: int | None):
    if packed:
        return PackingCollator()
    if pad_token_id is None:
        raise DataError("padding (--no-packing) needs a tokenizer with a pad or eos token")
    return PaddingCollator(pad_token_id)


def real_token_count(batch) -> int:
    """Tokens that are data (not padding) in a collated batch."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())

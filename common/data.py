"""Data: a tokenizer, flat token files, and batches that are a pure function of (seed, step).

A prepared data folder, made from the user's text by `python -m common.data prepare`, holds

    tokenizer.model          sentencepiece model (or tokenizer.json + tokenizer_config.json:
                             a HuggingFace tokenizer, with the optional `tokenizers` package)
    train.bin, eval.bin      every document's token ids followed by EOS, concatenated:
                             a flat little-endian uint16 array (uint32 when vocab > 65536)
    train.json, eval.json    sidecars: tokenizer, vocab_size, dtype, num_tokens, num_documents,
                             eos_id, bos_id

With no folder given, the trainers use the embedded corpus: the Python standard library's own
source, present on every machine, tokenized once and cached.

Batch rows are windows of seq_len + 1 tokens at starts drawn from default_rng([seed, step]).
Nothing else enters, so resuming at step k needs no iterator state, and every process computes
the same starts and reads only the rows that its own devices hold: pages of a memmap, or
ranged requests to a bucket (`RemoteTokens`). Fine-tuning (--data.format
sft) instead packs JSONL examples into rows, once, and picks rows by (seed, step) alike; so
does preference tuning (--data.format dpo), a chosen and a rejected answer to each row.
"""
from __future__ import annotations

import functools
import glob
import io
import json
import multiprocessing
import os
import shutil
import socket
import sys
import sysconfig
import tempfile
import time
import uuid
from bisect import bisect_left, insort
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Annotated, Literal

import jax
import numpy as np
import sentencepiece as spm
import tyro

from common.checkpoint import read_run_config
from common.config import knob
from common.observe import is_remote, note, progress

DEFAULT_CACHE_DIR = "~/.cache/jax_trainers"
CACHE_ENV = "JAX_TRAINERS_CACHE"

# The embedded corpus is capped so that the first run on a laptop prepares in seconds; the
# stdlib of CPython 3.11/3.12 is ~11 MB of .py, so today the cap only guards future versions.
STDLIB_MAX_BYTES = 16_000_000
STDLIB_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3"})
# 2% of ~550 files is ~11 whole files, 40k-110k tokens: varied enough for a steady eval loss.
_STDLIB_EVAL_FRACTION = 0.02
# Bump on any change to the embedded corpus's tokens, so that stale caches are not reused.
_RECIPE = 1

# The tokenizer is trained on a deterministic sample of at most this much text. BPE on 8 MB
# of code takes about a second; more text barely changes the merges.
TOKENIZER_SAMPLE_CHARS = 8_000_000
# Training sentences are runs of whole lines of about this many characters. Sentencepiece
# keeps newlines that sit inside a sentence given through `sentence_iterator`, so pieces can
# span a line end (":\n") and indentation is learned as it appears in real files.
_CHUNK_CHARS = 2048

PREPARED_FILES = ("tokenizer.model", "train.json", "train.bin", "eval.json", "eval.bin")
TEXT_SUFFIXES = (".txt", ".md", ".py")
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


@dataclass(frozen=True)
class DataConfig:
    path: str = ""
    """A folder made by `python -m common.data prepare`, local or gs://bucket/prefix (read by
    ranges: each process fetches only its rows); "" = the embedded stdlib corpus."""
    cache_dir: str = knob(DEFAULT_CACHE_DIR, resume=True)
    """Where the embedded corpus is cached; env JAX_TRAINERS_CACHE overrides the default."""
    vocab_size: int = 4096
    """Vocabulary of the tokenizer trained on the embedded corpus."""
    seed: int = 0
    """Batch order seed (and, for sft, the seed of the held-out split)."""
    format: Literal["text", "sft", "dpo"] = "text"
    """text: pre-training on a prepared folder or the embedded corpus. sft: prompt/completion
    or chat examples from the JSONL file --data.path, packed into rows (see `load_sft`). dpo:
    preference pairs from it, one to a row (see `pack_pairs`); the sft options apply."""
    eval_path: str = ""
    """sft: a held-out JSONL file; "" = hold out --data.eval-fraction of --data.path."""
    eval_fraction: float = knob(0.05, "(0, 1)")
    """sft: share of the examples held out for eval when --data.eval-path is empty."""
    tokenizer: str = ""
    """sft: a sentencepiece .model; "" = the embedded corpus's (with --init-from, that run's)."""
    train_on: Literal["completion", "all"] = "completion"
    """sft: train on completions and assistant turns only, or on every token."""
    loss_average: Literal["token", "example"] = "token"
    """sft: mean over the batch's trained tokens, or over its examples (each its own mean)."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """sft: an example longer than seq_len + 1 tokens is cut to fit, or left out (counted)."""
    pack: bool = True
    """sft: several examples per row with segment ids; off = one example per row."""


class _Encodes:  # through `self._sp`, a sentencepiece model or an `HFTokenizer`
    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in np.asarray(ids).reshape(-1)])


@dataclass
class Dataset(_Encodes):
    train: np.ndarray | RemoteTokens = field(repr=False)
    eval: np.ndarray | RemoteTokens = field(repr=False)
    vocab_size: int
    tokenizer_path: str

    _sp = functools.cached_property(lambda self: open_tokenizer(self.tokenizer_path))
    eos_id = property(lambda self: self._sp.eos_id())
    bos_id = property(lambda self: self._sp.bos_id())


# --- Batches ----------------------------------------------------------------------------------
def batch_rows(tokens: np.ndarray, *, seed: int, step: int, batch_size: int, seq_len: int,
               rows: slice = slice(None)) -> np.ndarray:
    """Rows `rows` of the global batch for (seed, step): int32 [len(rows), seq_len + 1]. Every
    process draws all batch_size starts, so a row never depends on how the batch is split."""
    window = seq_len + 1
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"batch_size ({batch_size}) and seq_len ({seq_len}) must be >= 1")
    if seed < 0 or step < 0:
        raise ValueError(f"seed ({seed}) and step ({step}) must be >= 0")
    if len(tokens) < window + 1:
        raise ValueError(
            f"the token array has {len(tokens)} tokens, too few for windows of seq_len + 1 = "
            f"{window} tokens (at least seq_len + 2 = {window + 1} are needed); use a shorter "
            f"sequence length or more data (the eval split is eval_fraction of the documents)")
    starts = lambda step: np.random.default_rng([seed, step]).integers(
        0, len(tokens) - window + 1, size=batch_size)[rows]
    if isinstance(tokens, RemoteTokens):  # this step's rows, and the next step's read ahead
        return tokens.rows(starts(step), window, ahead=starts(step + 1)).astype(np.int32)
    # Contiguous slices: a memmap reads only these pages.
    return np.array([tokens[s:s + window] for s in starts(step)], np.int32).reshape(-1, window)


def get_batch(tokens: np.ndarray | Packed, *, seed: int, step: int, batch_size: int,
              seq_len: int, sharding: jax.sharding.Sharding) -> jax.Array | dict:
    """The global batch for (seed, step): int32 [batch_size, seq_len + 1], laid out by
    `sharding`. Inputs are [:, :-1], targets [:, 1:]. Given `Packed` SFT rows instead of a
    token array, a dict of [batch_size, seq_len] arrays (see `packed_batch`)."""
    if isinstance(tokens, Packed):
        if seq_len != tokens.seq_len:
            raise ValueError(f"rows were packed for seq_len {tokens.seq_len}, not {seq_len}")
        return packed_batch(tokens, packed_rows(tokens.num_rows, seed=seed, step=step,
                                                batch_size=batch_size), sharding)
    return _sharded((batch_size, seq_len + 1), sharding, np.int32, lambda rows, cols: batch_rows(
        tokens, seed=seed, step=step, batch_size=batch_size, seq_len=seq_len, rows=rows)[:, cols])


def _sharded(shape: tuple, sharding: jax.sharding.Sharding, dtype,
             block: Callable[[slice, slice], np.ndarray]) -> jax.Array:
    """The global array of `shape` laid out by `sharding`, each shard `block(rows, cols)`: a
    process builds only its devices' shards, and replicas (over "tensor", say) share one."""
    # Cached by the slices' bounds: slices are unhashable before Python 3.12.
    cached = functools.cache(lambda r, c: block(slice(*r), slice(*c)))

    def shard(index) -> np.ndarray:
        rows, cols = (slice(None), slice(None)) if index is None else tuple(index)
        return cached((rows.start, rows.stop, rows.step), (cols.start, cols.stop, cols.step))
    return jax.make_array_from_callback(shape, sharding, shard, dtype=dtype)


# --- Loading ----------------------------------------------------------------------------------
class HFTokenizer:
    """A HuggingFace tokenizer.json (Llama 3, Qwen ship no sentencepiece model) behind the
    sentencepiece calls we make, its specials named by the tokenizer_config.json beside it.
    Text is encoded without added specials: documents are separated by EOS only."""

    def __init__(self, path: str):
        try:
            import tokenizers
        except ImportError:
            raise ValueError("a HuggingFace tokenizer.json needs the `tokenizers` package: "
                             "pip install -e '.[hf]'") from None
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"not a HuggingFace tokenizer.json ({e})") from None
        special = _tokenizer_config(os.path.dirname(path))[1]
        ids = [self._tok.token_to_id(special[k]) if special.get(k) else None
               for k in ("eos_token", "bos_token")]
        eos, bos = (-1 if i is None else i for i in ids)  # -1: none, as in sentencepiece
        self.get_piece_size = self._tok.get_vocab_size  # sentencepiece's accessors
        self.eos_id, self.bos_id = (lambda: eos), (lambda: bos)

    def encode(self, text, num_threads: int | None = None):
        return (self._tok.encode(text, add_special_tokens=False).ids if isinstance(text, str)
                else [e.ids for e in self._tok.encode_batch(text, add_special_tokens=False)])

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text` encoded whole, and each one's (start, end) characters in it."""
        e = self._tok.encode(text, add_special_tokens=False)
        return e.ids, e.offsets


def _tokenizer_config(folder: str) -> tuple[dict, dict[str, str]]:
    """A HuggingFace folder's tokenizer_config.json ({} if none) and its special tokens:
    "eos_token" -> text, whether the file gives a text or {"content": text}."""
    file = Path(folder, "tokenizer_config.json")
    c = json.loads(file.read_text()) if file.is_file() else {}
    return c, {k: v.get("content") if isinstance(v, dict) else v for k, v in c.items()
               if k.endswith("_token") and isinstance(v, (str, dict))}


class ChatTemplate:
    """A HuggingFace folder's chat template (chat_template.jinja, else tokenizer_config.json's
    "chat_template"), rendered as transformers' apply_chat_template renders it: a sandboxed
    jinja2 environment with trim_blocks and lstrip_blocks, its globals and filters, and the
    folder's special tokens as variables. `None` from `find` when the folder has none."""

    def __init__(self, source: str, folder: str, specials: dict[str, str]):
        try:
            import jinja2
            from jinja2.ext import Extension
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise DataError("a HuggingFace chat template needs jinja2: pip install -e "
                            "'.[hf]'") from None

        class Generation(Extension):  # {% generation %}...{% endgeneration %}: TRL's marker
            tags = {"generation"}
            _body = lambda self, caller: caller()

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                              ).set_lineno(lineno)

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[Generation, "jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, \
            sort_keys=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                        separators=separators, sort_keys=sort_keys)
        env.globals |= {"raise_exception": raise_exception,
                        "strftime_now": lambda f: time.strftime(f)}
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise DataError(f"{folder}: its chat template does not parse ({e})") from None
        self.folder, self.specials, self._error = folder, specials, jinja2.exceptions.TemplateError

    @staticmethod
    def find(folder: str) -> ChatTemplate | None:
        c, specials = _tokenizer_config(folder)
        source = c.get("chat_template")
        if isinstance(source, list):  # several named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if (jinja := Path(folder) / "chat_template.jinja").is_file():
            source = jinja.read_text()
        return ChatTemplate(source, folder, specials) if source else None

    def render(self, messages: list[dict], add_generation_prompt: bool = False,
               where: str = "") -> str:
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.specials)
        except self._error as e:
            raise DataError(f"{where or self.folder}: the chat template of {self.folder} "
                            f"refuses this conversation ({e})") from None

    def spans(self, messages: list[dict], where: str) -> Spans:
        """The conversation as (text, trained) spans, only the assistant turns trained. A turn
        is what rendering it adds after the generation prompt of the turns before it, so the
        rendering of every prefix must begin the rendering of the whole, and must hold the
        turn's content; a template for which that fails is refused, never trained whole."""
        full, spans, done = self.render(messages, where=where), [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True, where=where)
            upto = self.render(messages[:i + 1], where=where)
            turn = upto[len(before):]
            if not (upto.startswith(before) and full.startswith(upto) and len(before) >= done
                    and m["content"].strip() in turn):
                raise DataError(
                    f"{where}: the chat template of {self.folder} gives no way to find "
                    f"assistant turn {i} (rendering the turns before it with the generation "
                    "prompt does not begin the rendering with it, or that turn's text is not "
                    "its content), so its loss mask is unknown. Give the data as "
                    '{"prompt": ..., "completion": ...} lines instead.')
            spans += [(full[done:len(before)], False), (turn, True)]
            done = len(upto)
        return [s for s in spans + [(full[done:], False)] if s[0]]


def open_tokenizer(path: str):  # sentencepiece, or a HuggingFace tokenizer.json
    return (HFTokenizer(path) if path.endswith(".json")
            else spm.SentencePieceProcessor(model_file=path))


class PretrainedTokenizer(_Encodes):
    """A pretrained model's tokenizer, for prompting it: each prompt begins with `start_id`,
    after which the model saw documents begin. Pads are masked out, so pad_id is never read."""
    pad_id = 0

    def __init__(self, path: str, eos_id: int, start_id: int):
        self._sp = open_tokenizer(path)
        self.vocab_size, self.eos_id, self.start_id = self._sp.get_piece_size(), eos_id, start_id

    def prompt(self, text: str) -> list[int]:
        return [self.start_id] + self.encode(text)


class CharTokenizer:
    """train_grpo.py's addition demo: one token per character of "0123456789+= ", plus pad,
    begin and end of sequence. BPE would merge digit runs into pieces the model must first
    learn to spell; with one digit per token the columns of the sum line up, 16 ids split over
    any power-of-two tensor axis, and nothing is trained or downloaded. (--init-from and
    --init-from-hf use the model's own.)"""
    SYMBOLS = ("<pad>", "<bos>", "<eos>") + tuple("0123456789+= ")
    pad_id, bos_id, eos_id = 0, 1, 2
    vocab_size = len(SYMBOLS)
    _ids = {c: i for i, c in enumerate(SYMBOLS) if len(c) == 1}

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the task's vocabulary "
                             f"{''.join(self.SYMBOLS[3:])!r}") from None

    def decode(self, ids) -> str:
        return "".join(self.SYMBOLS[i] for i in ids if i > self.eos_id)

    def prompt(self, text: str) -> list[int]:
        return [self.bos_id] + self.encode(text)


# Prompts and completions as generation batches (train_grpo.py's rollouts and warm start)
def left_pad(ids: list[list[int]], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded ids [B, width] and their validity mask: every row ends at the same column,
    so generation starts at one column for the whole batch."""
    out, valid = np.full((len(ids), width), pad_id, np.int32), np.zeros((len(ids), width), bool)
    for r, p in enumerate(ids):
        if len(p) > width:
            raise ValueError(f"a prompt of {len(p)} tokens is wider than the batch ({width})")
        out[r, width - len(p):], valid[r, width - len(p):] = p, True
    return out, valid


def encode_prompts(tok, texts: list[str], width: int):
    return left_pad([tok.prompt(text) for text in texts], width, tok.pad_id)


def encode_completions(tok, texts: list[str], width: int):
    """Right-padded ids [B, width] of text + EOS, and the mask of those tokens."""
    ids = np.full((len(texts), width), tok.pad_id, np.int32)
    mask = np.zeros((len(texts), width), bool)
    for r, text in enumerate(texts):
        c = (tok.encode(text) + [tok.eos_id])[:width]
        ids[r, :len(c)], mask[r, :len(c)] = c, True
    return ids, mask


def decode_completions(tok, tokens_BN: np.ndarray, mask_BN: np.ndarray):
    """Text of each completion (without its EOS) and whether it ended with EOS."""
    rows = [tokens_BN[r, mask_BN[r]].tolist() for r in range(len(tokens_BN))]
    finished = np.array([bool(ids) and ids[-1] == tok.eos_id for ids in rows], bool)
    return [tok.decode(ids[:-1] if f else ids) for ids, f in zip(rows, finished)], finished


def load_dataset(cfg: DataConfig, seq_len: int | None = None) -> Dataset:
    """The data of `cfg`; `seq_len` is needed only to pack SFT rows (--data.format sft)."""
    if cfg.format != "text":
        if seq_len is None:
            raise DataError(f"--data.format {cfg.format}: this trainer does not read "
                            f"fine-tuning data; fine-tune with train_dense.py")
        return load_sft(cfg, seq_len)
    root = _cache_root(cfg.cache_dir)
    return _load_prepared(cfg.path or _stdlib_corpus(root, vocab_size=cfg.vocab_size), root)


def _cache_root(cache_dir: str) -> str:  # a flag beats the environment beats the default
    env = os.environ.get(CACHE_ENV) if cache_dir == DEFAULT_CACHE_DIR else None
    return os.path.expanduser(env or cache_dir)


def _load_prepared(path: str, cache_root: str) -> Dataset:
    # Sidecars and the tokenizer are read whole, a bucket's token files by ranges.
    remote, (fs, root) = is_remote(path), _filesystem(path)
    read, exists = (lambda n: fs.cat_file(f"{root}/{n}")), (lambda n: fs.isfile(f"{root}/{n}"))
    tokenizer = PREPARED_FILES[0]  # or the tokenizer.json that the sidecar names
    if exists("train.json"):
        tokenizer = json.loads(read("train.json")).get("tokenizer", tokenizer)
    for name in (tokenizer,) + PREPARED_FILES[1:]:
        if not exists(name):
            what = (f"{name} is missing, so this is not a prepared data folder"
                    if remote or os.path.isdir(path) else "no such folder")
            raise FileNotFoundError(
                f"--data.path {path!r}: {what}. A data folder is made from your text files with\n"
                f"    python -m common.data prepare --input <files or folders> --out {path}\n"
                f"or leave --data.path empty to train on the embedded corpus (the Python stdlib).")
    tokenizer_path = os.path.join(path, tokenizer)
    if remote:  # sentencepiece reads local files: a copy per bucket folder, in the cache
        local = os.path.join(cache_root, "remote", path.replace("://", "/").strip("/"))
        os.makedirs(local, exist_ok=True)
        for name in (tokenizer, "tokenizer_config.json"):
            if name == tokenizer or exists(name):
                tmp = os.path.join(local, f".{name}.{uuid.uuid4().hex}")
                Path(tmp).write_bytes(read(name))
                os.replace(tmp, os.path.join(local, name))  # hosts sharing a cache: atomic
        tokenizer_path = os.path.join(local, tokenizer)
    vocab_size = open_tokenizer(tokenizer_path).get_piece_size()
    splits = {}
    for split in ("train", "eval"):
        meta = json.loads(read(f"{split}.json"))
        bin_path, n = os.path.join(path, f"{split}.bin"), meta["num_tokens"]
        dtype = np.dtype({"uint16": "<u2", "uint32": "<u4"}[meta["dtype"]])
        if (got := fs.size(f"{root}/{split}.bin")) != n * dtype.itemsize:
            raise ValueError(f"{bin_path} holds {got} bytes but its sidecar promises {n} "
                             f"{meta['dtype']} tokens ({n * dtype.itemsize} bytes): the file is "
                             f"truncated or stale; prepare the folder again")
        # Only the rows that batches touch are ever read: by a memmap's pages, or by ranged
        # requests to the bucket (mmap cannot map an empty file).
        splits[split] = (RemoteTokens(f"{path.rstrip('/')}/{split}.bin", n, dtype) if remote
                         else np.memmap(bin_path, dtype=dtype, mode="r", shape=(n,)) if n
                         else np.zeros(0, dtype))
        # Tokens read with another tokenizer would train without complaint, on garbage.
        if meta["vocab_size"] != vocab_size:
            raise ValueError(f"--data.path {path!r}: {split}.bin was written with a "
                             f"{meta['vocab_size']}-piece tokenizer but {tokenizer_path} has "
                             f"{vocab_size} pieces; prepare the folder again")
    return Dataset(**splits, vocab_size=vocab_size, tokenizer_path=tokenizer_path)


def _filesystem(url: str):
    """(fsspec file system, path within it) of a bucket URL or a local path; gs:// needs the gcs
    extra (fsspec itself comes with Orbax)."""
    try:
        import fsspec
        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        raise ValueError(f"{url}: reading a bucket needs {e.name or 'gcsfs'}: "
                         f"pip install -e '.[gcs]'") from None


class RemoteTokens:
    """A token file in a bucket, standing in for a local one's np.memmap: len() and
    `rows(starts, window)`, the only reads batches make. A step's rows are fetched at once, one
    ranged request each (cat_ranges runs them concurrently), and the next step's in the
    background, so that a step need not wait on the network; the bytes are a local copy's."""

    def __init__(self, url: str, n: int, dtype: np.dtype):
        self.url, self.n, self.dtype = url, n, np.dtype(dtype)
        self._fs, self._path = _filesystem(url)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="read-ahead")
        self._reads: dict[tuple, Future] = {}  # the few newest (starts, window) read or asked for

    def __len__(self) -> int:
        return self.n

    def _read(self, starts: tuple, window: int) -> np.ndarray:
        size = self.dtype.itemsize
        blobs = self._fs.cat_ranges([self._path] * len(starts), [s * size for s in starts],
                                    [(s + window) * size for s in starts])
        return np.frombuffer(b"".join(blobs), self.dtype).reshape(len(starts), window)

    def _future(self, starts: np.ndarray, window: int) -> Future:
        key = (tuple(int(s) for s in starts), window)
        if key not in self._reads:
            self._reads[key] = self._pool.submit(self._read, key[0], window)
            while len(self._reads) > 64:  # a step's blocks (one per device) and the next's
                del self._reads[next(iter(self._reads))]
        return self._reads[key]

    def rows(self, starts: np.ndarray, window: int, ahead: np.ndarray | None = None):
        out = self._future(starts, window)
        if ahead is not None:
            self._future(ahead, window)
        return out.result()


# --- The embedded corpus ----------------------------------------------------------------------
def _stdlib_files(max_bytes: int) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for folder, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in STDLIB_SKIP_DIRS]
        found += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    # Sorted relative paths with "/" separators: the same list on every machine that has the
    # same Python, which matters when each host of a multi-host run builds its own cache.
    found.sort(key=lambda p: os.path.relpath(p, root).replace(os.sep, "/"))
    total = np.cumsum([os.path.getsize(p) for p in found])
    return found[:int(np.searchsorted(total, max_bytes, side="right"))]  # at most max_bytes


def _stdlib_corpus(cache_root: str, *, vocab_size: int, max_bytes: int | None = None) -> str:
    """The prepared folder of the embedded corpus, built on first use (`max_bytes`: for tests)."""
    tag = f"stdlib-vocab{vocab_size}-r{_RECIPE}" + ("" if max_bytes is None else f"-max{max_bytes}")
    final = os.path.join(cache_root, "py%d.%d.%d" % sys.version_info[:3], tag)
    if os.path.isfile(os.path.join(final, "eval.json")):
        return final
    files = _stdlib_files(STDLIB_MAX_BYTES if max_bytes is None else max_bytes)
    t0 = time.perf_counter()
    # errors="replace": a distribution's odd file must not stop the default run. Several
    # processes may build at once (all hosts of a run, or two runs): each builds in its own
    # temporary folder, the first rename wins and the others use its result.
    _build(final, lambda tmp: _write_prepared(
        tmp, lambda: _documents(files, "text", errors="replace"), label="stdlib source",
        tokenizer="", vocab_size=vocab_size, eval_fraction=_STDLIB_EVAL_FRACTION, seed=0))
    note(f"data: embedded corpus ready in {final} ({time.perf_counter() - t0:.1f} s)")
    return final


def _build(final: str, write: Callable[[str], None]) -> bool:
    """`write` a new hidden folder beside `final`, then move it there (atomically: rename(2)
    succeeds onto a missing or empty folder only); False if `final` is taken."""
    parent, name = os.path.split(final)
    os.makedirs(parent, exist_ok=True)
    host = socket.gethostname()
    for stale in glob.glob(os.path.join(parent, glob.escape(f".{name}.tmp-{host}-") + "*")):
        pid = stale.rsplit("-", 2)[-2]
        try:  # signal 0: is the process that made it alive?
            if pid.isdigit():
                os.kill(int(pid), 0)
        except ProcessLookupError:  # a build on this host that was killed: never used
            shutil.rmtree(stale, ignore_errors=True)
        except PermissionError:  # another user's, alive
            pass
    tmp = os.path.join(parent, f".{name}.tmp-{host}-{os.getpid()}-{uuid.uuid4().hex}")
    os.mkdir(tmp)  # unlike tempfile.mkdtemp's 0700, honours the umask: others may read it
    try:
        write(tmp)
        return _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: str, final: str) -> bool:
    try:
        os.replace(tmp, final)
        return True
    except OSError:
        if os.path.isdir(final) and os.listdir(final):
            return False
        raise


# --- Preparing a data folder from the user's text ---------------------------------------------
def prepare(inputs: Annotated[list[str], tyro.conf.arg(name="input")], out: str, *,
            tokenizer: str = "", vocab_size: int = 4096, eval_fraction: float = 0.01,
            field: str = "text", workers: int = 1, seed: int = 0) -> str:
    """Tokenize text files, folders, JSONL and Parquet into the data folder `out`, for --data.path.

    Args:
        inputs: Files, folders and quoted globs ('shards/*.parquet'). A text file (.txt .md .py)
            is a document; so is a JSONL line or a Parquet row.
        out: The data folder to create: a local path or gs://bucket/prefix. It must not hold
            a prepared folder already.
        tokenizer: A sentencepiece .model or tokenizer.json to reuse; by default one is trained.
        vocab_size: Vocabulary of the tokenizer trained on the inputs.
        eval_fraction: Fraction of the documents held out for evaluation (of a lone one: its end).
        field: The JSONL field or Parquet column that holds the text.
        workers: Processes that tokenize (1: this one, with a thread per core).
        seed: Seed of the train/eval split and of the tokenizer's training sample.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction {eval_fraction}: must be strictly between 0 and 1")
    if not 0 < vocab_size < 2**31:
        raise ValueError(f"--vocab-size {vocab_size}: must be a positive number of tokens")
    if not 0 <= seed < 2**32:
        raise ValueError(f"--seed {seed}: must be >= 0 (numpy's seeds are non-negative)")
    if not 1 <= workers <= 1024:
        raise ValueError(f"--workers {workers}: must be between 1 and 1024 processes")
    if tokenizer and not os.path.isfile(tokenizer):
        raise FileNotFoundError(f"--tokenizer {tokenizer!r}: no such file; give a "
                                f"sentencepiece .model file or a HuggingFace tokenizer.json, "
                                f"or leave it out to train one")
    _check_out_is_free(out)
    files = _expand_inputs(inputs)
    write = lambda tmp: _write_prepared(
        tmp, lambda: _documents(files, field), label="input text", tokenizer=tokenizer,
        vocab_size=vocab_size, eval_fraction=eval_fraction, seed=seed, workers=workers)
    if is_remote(out):  # written here, then uploaded with the sidecars last (see _upload)
        with tempfile.TemporaryDirectory(prefix="prepare-") as tmp:
            write(tmp)
            _upload(tmp, out)
    elif not _build(os.path.abspath(out), write):
        _check_out_is_free(out)  # someone filled `out` while we worked: say so
    return out


def _check_out_is_free(out: str) -> None:
    if is_remote(out):  # train.json is uploaded last: without it, an interrupted upload
        fs, root = _filesystem(out)
        if fs.isfile(f"{root}/train.json"):
            raise ValueError(f"--out {out!r} already holds a prepared folder; prepare never "
                             f"overwrites data: pick another --out, or delete it first")
    elif os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise ValueError(f"--out {out!r} already exists and is not an empty folder; prepare "
                         f"never overwrites data: pick another --out, or delete {out} first")


def _upload(folder: str, out: str) -> None:
    """Copy the finished `folder` to the bucket prefix `out`, train.json the very last: a
    trainer refuses a folder without it, and a rerun (checking only for it) replaces the rest."""
    fs, root = _filesystem(out)
    last = ("eval.json", "train.json")
    names = sorted(os.listdir(folder), key=lambda n: (last.index(n) if n in last else -1, n))
    with progress(f"data: uploading to {out}", total=len(names), unit="files") as p:
        for name in names:
            fs.put_file(os.path.join(folder, name), f"{root}/{name}")
            p.update()


def _expand_inputs(inputs: list[str]) -> list[str]:
    if not inputs:
        raise ValueError("no --input given: name text, JSONL or Parquet files, folders or globs")
    files: dict[str, str] = {}  # real path -> path as given: a file reached twice is read once
    for path in inputs:
        matches = [path] if os.path.exists(path) else sorted(glob.glob(path, recursive=True))
        if not matches:
            raise FileNotFoundError(f"--input {path!r}: no such file or folder" + (
                ", and the pattern matches nothing" if glob.has_magic(path) else ""))
        for match in matches:
            found = [match] if os.path.isfile(match) else []  # named: whatever its suffix
            for folder, subdirs, names in os.walk(match):  # of a file: nothing
                subdirs[:] = [d for d in subdirs if not d.startswith(".")]
                found += [os.path.join(folder, n) for n in names if not n.startswith(".")
                          and n.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES)]
            for f in sorted(found):
                files.setdefault(os.path.realpath(f), f)
    return list(files.values())


def _documents(files: list[str], field: str, errors: str = "strict") -> Iterator[str]:
    """Every non-empty document of `files`, in order, byte for byte (newline="" keeps "\r\n")."""
    for path in files:
        if path.endswith(PARQUET_SUFFIXES):
            yield from filter(None, _parquet_texts(path, field))
        elif path.endswith(JSONL_SUFFIXES):
            for where, obj in jsonl_objects(path):
                text = obj.get(field) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    what = (f"field {field!r} holds {type(text).__name__}, not a string"
                            if isinstance(obj, dict) and field in obj
                            else f"no field {field!r} in this line's object")
                    raise ValueError(f"{where}: {what}; name the field that holds the text "
                                     "with --field")
                if text:
                    yield text
        else:
            try:
                with open(path, encoding="utf-8", errors=errors, newline="") as f:
                    text = f.read()
            except UnicodeDecodeError as e:
                raise ValueError(f"--input {path!r} is not UTF-8 text ({e.reason} at byte "
                                 f"{e.start}); convert it first, e.g. iconv -t utf-8") from None
            if text:
                yield text


def _parquet_texts(path: str, field: str) -> Iterator[str]:
    """The column `field` of a Parquet file, a row group's batch at a time (bounded memory)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"--input {path!r}: reading Parquet needs pyarrow: pip install -e "
                         f"'.[parquet]'") from None
    f = pq.ParquetFile(path)
    column = f.schema_arrow.field(field) if field in f.schema_arrow.names else None
    if column is None or str(column.type) not in ("string", "large_string"):
        what = f"is {column.type}, not text" if column is not None else "is missing"
        raise ValueError(f"--input {path!r}: column {field!r} {what} (columns: "
                         f"{', '.join(f.schema_arrow.names)}); name the text column with --field")
    for batch in f.iter_batches(batch_size=1024, columns=[field]):
        yield from (t or "" for t in batch.column(0).to_pylist())


def jsonl_objects(path: str) -> Iterator[tuple[str, object]]:
    """("<path>, line N", the parsed line) for each non-blank line."""
    with open(path, "rb") as f:  # bytes: a bad encoding is reported at its very line
        for line_no, raw in enumerate(f, 1):
            where = f"{path}, line {line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 ({e.reason} at byte {e.start} of the "
                                f"line); convert the file first, e.g. iconv -t utf-8") from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg}, column {e.colno}); a JSONL "
                                f"file holds one JSON object per line") from None


def _write_prepared(folder: str, documents: Callable[[], Iterator[str]], *, label: str,
                    tokenizer: str, vocab_size: int, eval_fraction: float, seed: int,
                    workers: int = 1) -> None:
    """Fill the empty `folder`. `documents()` is read twice, so memory stays bounded: to count
    the documents and sample the tokenizer's training text (reservoir sampling of whole-line
    chunks, seeded: the same input gives the same sample), then to tokenize."""
    sample, rng = [], np.random.default_rng(seed)
    capacity = max(1, TOKENIZER_SAMPLE_CHARS // _CHUNK_CHARS)
    with progress(f"data: reading {label}", unit="documents") as p:
        num_docs = num_chars = seen = 0
        for text in documents():
            num_docs, num_chars = num_docs + 1, num_chars + len(text)
            p.update()
            for chunk in () if tokenizer else _chunks(text):
                if seen < capacity:
                    sample.append(chunk)
                elif (j := int(rng.integers(0, seen + 1))) < capacity:
                    sample[j] = chunk
                seen += 1
        p.note = f"({num_chars / 1e6:.1f} MB)"
    if num_docs == 0:
        raise ValueError(f"no text found in the {label}: files must be UTF-8 "
                         f"{'/'.join(TEXT_SUFFIXES)}, JSON Lines {'/'.join(JSONL_SUFFIXES)} or "
                         f"Parquet with the text in --field")
    name = "tokenizer.json" if tokenizer.endswith(".json") else "tokenizer.model"
    model_path = os.path.join(folder, name)
    if tokenizer:
        shutil.copyfile(tokenizer, model_path)
        beside = os.path.join(os.path.dirname(tokenizer), "tokenizer_config.json")
        if name == "tokenizer.json" and os.path.isfile(beside):  # names its special tokens
            shutil.copyfile(beside, os.path.join(folder, "tokenizer_config.json"))
    else:
        mb = sum(len(c) for c in sample) / 1e6
        with progress(f"data: training tokenizer on {mb:.1f} MB of {label}"):
            _train_tokenizer(sample, model_path, vocab_size)
    try:
        sp = open_tokenizer(model_path)
    except (OSError, RuntimeError) as e:
        raise ValueError(f"--tokenizer {tokenizer!r} is not a sentencepiece model ({e})") from None
    except ValueError as e:
        raise ValueError(f"--tokenizer {tokenizer!r}: {e}") from None
    if sp.eos_id() < 0:
        raise ValueError(f"--tokenizer {tokenizer!r} defines no EOS piece, which separates "
                         f"documents; use a model trained with eos_id >= 0 (a tokenizer.json "
                         f"needs a tokenizer_config.json beside it that names eos_token)")
    vocab = sp.get_piece_size()
    if not tokenizer and vocab < vocab_size:
        print(f"data: the text supports only {vocab} pieces, so the vocabulary is {vocab}, "
              f"not {vocab_size}", flush=True)
    dtype = np.dtype("<u2" if vocab <= 1 << 16 else "<u4")
    is_eval = _held_out(num_docs, eval_fraction, seed)  # train keeps the input order
    counts = {"train": [0, 0], "eval": [0, 0]}  # tokens, documents
    out = {split: open(os.path.join(folder, f"{split}.bin"), "wb") for split in counts}
    done_chars, t0 = 0, time.perf_counter()
    with progress(f"data: tokenizing {num_chars / 1e6:.1f} MB", total=num_docs,
                  unit="documents") as p, out["train"], out["eval"]:
        batches = _batches(documents(), max_docs=256, max_chars=1_000_000)
        for first, chars, encoded in _encode(batches, model_path, workers):
            for i, ids in enumerate(encoded, first):
                tokens = np.append(ids, sp.eos_id()).astype(dtype)
                if num_docs == 1:  # nothing to shuffle: the document's tail is the eval set
                    cut = max(1, len(tokens) - max(1, round(eval_fraction * len(tokens))))
                    parts = {"train": tokens[:cut], "eval": tokens[cut:]}
                else:
                    parts = {"eval" if is_eval[i] else "train": tokens}
                for split, part in parts.items():
                    part.tofile(out[split])
                    counts[split][0] += len(part)
                    counts[split][1] += 1
            p.update(len(encoded))
            done_chars, seconds = done_chars + chars, time.perf_counter() - t0
            p.note = (f"| {done_chars / 1e6:,.1f} MB, {counts['train'][0] + counts['eval'][0]:,}"
                      f" tokens, {done_chars / 1e6 / seconds:.1f} MB/s, ETA "
                      f"{(num_chars - done_chars) * seconds / max(done_chars, 1):.0f} s")
    for split, (n_tokens, n_docs) in counts.items():
        meta = dict(tokenizer=name, vocab_size=vocab, dtype=dtype.name, num_tokens=n_tokens,
                    num_documents=n_docs, eos_id=sp.eos_id(), bos_id=sp.bos_id())
        Path(folder, f"{split}.json").write_text(json.dumps(meta, indent=1))
    print(f"data: {counts['train'][0]:,} train tokens ({_count(counts['train'][1], 'document')}), "
          f"{counts['eval'][0]:,} eval tokens ({_count(counts['eval'][1], 'document')}), "
          f"vocabulary {vocab}, {num_chars / max(1, sum(c[0] for c in counts.values())):.2f} "
          f"characters per token", flush=True)


def _held_out(n: int, fraction: float, seed: int) -> np.ndarray:
    """Which of n documents or examples a seeded shuffle holds out: at least one, never all."""
    picked = np.random.default_rng(seed).permutation(n)[:min(n - 1, max(1, round(fraction * n)))]
    return np.isin(np.arange(n), picked)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _batches(docs: Iterator[str], *, max_docs: int, max_chars: int):
    """(index of the first document, list of texts, their characters), bounded in both."""
    first, texts, chars = 0, [], 0
    for text in docs:
        texts.append(text)
        chars += len(text)
        if len(texts) >= max_docs or chars >= max_chars:
            yield first, texts, chars
            first, texts, chars = first + len(texts), [], 0
    if texts:
        yield first, texts, chars


def _encode(batches, model_path: str, workers: int):
    """(first, characters, token id arrays) of each batch, in order. With workers > 1, encoded
    in that many processes, at most two batches each in flight: memory stays bounded by the
    buffer, not by the corpus, and the output is the same as one process's."""
    if workers == 1:
        sp = open_tokenizer(model_path)
        for first, texts, chars in batches:
            yield first, chars, sp.encode(texts, num_threads=os.cpu_count() or 1)
        return
    # spawn, not fork: this process has JAX's threads, which a fork would copy half-alive.
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pending = deque()
        for first, texts, chars in batches:
            pending.append((first, chars, pool.apply_async(_worker_encode, (model_path, texts))))
            if len(pending) >= 2 * workers:
                first, chars, result = pending.popleft()
                yield first, chars, result.get()
        for first, chars, result in pending:
            yield first, chars, result.get()


_worker_tokenizer = functools.cache(open_tokenizer)  # opened once in each worker process


def _worker_encode(model_path: str, texts: list[str]) -> list[np.ndarray]:
    # Arrays, not lists of ints: they cross the process boundary as one buffer each.
    sp = _worker_tokenizer(model_path)
    return [np.asarray(ids, np.int32) for ids in sp.encode(texts, num_threads=1)]


def _chunks(text: str) -> Iterator[str]:
    """Runs of whole lines of about _CHUNK_CHARS characters; an overlong line is cut."""
    run = ""
    for line in text.splitlines(keepends=True):
        while len(line) > _CHUNK_CHARS:  # prose in JSONL often has no newline at all
            yield line[:_CHUNK_CHARS]
            line = line[_CHUNK_CHARS:]
        run += line
        if len(run) >= _CHUNK_CHARS:
            yield run
            run = ""
    if run:
        yield run


def _train_tokenizer(sentences: list[str], model_path: str, vocab_size: int) -> None:
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
            # BPE, not unigram: its merges do not depend on num_threads (unigram's EM does), so
            # hosts with different core counts that each build the embedded corpus agree on it.
            model_type="bpe", split_digits=True, character_coverage=0.9995,
            hard_vocab_limit=False,  # a small text gets a smaller vocabulary, not an error
            byte_fallback=True,  # any text round-trips: unseen characters become UTF-8 bytes
            # Code must survive: no NFKC, no whitespace folding, runs of spaces are pieces, and
            # no dummy "▁" before each text, so encode(a + b) ≈ encode(a) + encode(b) and
            # decoding a window that spans two documents gives back their text.
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, add_dummy_prefix=False,
            # In bytes: a chunk is under 2 * _CHUNK_CHARS characters of at most 4 bytes each.
            max_sentence_length=8 * _CHUNK_CHARS,
            # We sampled already (deterministically); sentencepiece must use it all, in order.
            input_sentence_size=0, shuffle_input_sentence=False,
            num_threads=os.cpu_count() or 1, pad_id=-1, unk_id=0, bos_id=1, eos_id=2,
            minloglevel=2)  # its training log is long; we print one line of our own
    except RuntimeError as e:  # cut its C++ source location and advice about its own flags
        reason = str(e).rsplit("] ", 1)[-1].split(" Increase vocab_size")[0].strip()
        raise ValueError(f"--vocab-size {vocab_size}: sentencepiece cannot train this "
                         f"tokenizer ({reason}); pick a larger --vocab-size, or reuse a "
                         f"model with --tokenizer") from None
    Path(model_path).write_bytes(model.getvalue())


# --- Supervised fine-tuning: JSONL examples, a chat template, loss masks, packing -------------
# A JSONL line becomes (text, trained) spans, then tokens with a trained flag each. The loss
# weight of a target (the next token) is nonzero only where that token is trained.
EOS = None  # a span that stands for the tokenizer's EOS id rather than for text
Spans = list[tuple[str | None, bool]]  # (text or EOS, trained)
CHAT_ROLES = ("system", "user", "assistant")
SFT_SHAPES = ('{"prompt": ..., "completion": ...} or '
              '{"messages": [{"role": ..., "content": ...}, ...]}')
PACKED_FIELDS = ("inputs", "targets", "weights", "segment_ids", "positions")  # see `Packed`


class DataError(ValueError):
    """Bad SFT input: the message names the file, the line or the flag, and the fix."""


def chat_spans(messages: list[dict]) -> Spans:
    """The default chat template, as (text, trained) spans:

        <|system|>\\n{system}\\n<|user|>\\n{user}\\n<|assistant|>\\n{assistant}<eos><|user|>...

    Only assistant turns are trained: their content and the EOS that ends them, where generation
    stops, but not their header (at inference the prompt ends with "<|assistant|>\\n"). The
    markers are plain text: any tokenizer can spell them."""
    spans: Spans = []
    for m in messages:
        if m["role"] == "assistant":
            spans += [("<|assistant|>\n", False), (m["content"], True), (EOS, True)]
        else:
            spans.append((f"<|{m['role']}|>\n{m['content']}\n", False))
    return spans


def check_messages(msgs, where: str) -> None:  # a non-empty list of {role, content}
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f'{where}: "messages" must be a non-empty list of '
                        f'{{"role": ..., "content": ...}} objects')
    for j, m in enumerate(msgs):
        at = f"{where}: messages[{j}]"
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f'{at} needs the fields "role" and "content"')
        if m["role"] not in CHAT_ROLES:
            raise DataError(f"{at} has role {m['role']!r}; the roles are {', '.join(CHAT_ROLES)}")
        if not isinstance(m["content"], str):
            raise DataError(f'{at}["content"] is a {type(m["content"]).__name__}, not a string')


def sft_spans(obj, where: str, template: ChatTemplate | None = None) -> Spans:
    """The (text, trained) spans of one JSONL object of either shape; `where` names its line.
    Chat is rendered by `template` (a HuggingFace tokenizer's), else by ours. A prompt/completion
    pair gets no template: the completion continues the prompt's text as written (as TRL
    does), followed by EOS."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a JSON {type(obj).__name__}, not an object; each line is "
                        f"{SFT_SHAPES}")
    if "messages" in obj:
        msgs = obj["messages"]
        check_messages(msgs, where)
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{where}: no assistant turn, so nothing to train on")
        return template.spans(msgs, where) if template else chat_spans(msgs)
    for key in ("prompt", "completion"):
        if key not in obj:
            raise DataError(f"{where}: missing field {key!r}; each line is {SFT_SHAPES}")
        if not isinstance(obj[key], str):
            raise DataError(f"{where}: field {key!r} is a {type(obj[key]).__name__}, not a string")
    return [(obj["prompt"], False), (obj["completion"], True), (EOS, True)]


def jsonl_file(path: str, flag: str, noun: str, shape: str) -> list[tuple[str, object]]:
    """`jsonl_objects` of the file that `flag` names, which must exist and hold a `noun`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path!r}: no such file; it is a JSONL file with one "
                                f"{noun} per line, {shape}")
    if not (lines := list(jsonl_objects(path))):
        raise DataError(f"{flag} {path!r} holds no {noun}s; each line is {shape}")
    return lines


def read_sft_jsonl(path: str, flag: str = "--data.path",
                   template: ChatTemplate | None = None) -> list[Spans]:
    return [sft_spans(obj, where, template)
            for where, obj in jsonl_file(path, flag, "example", SFT_SHAPES)]


PAIR_SHAPES = ('{"prompt": ..., "chosen": ..., "rejected": ...} or '
               '{"messages": [...], "chosen": ..., "rejected": ...}')


def preference_spans(obj, where: str, template: ChatTemplate | None = None) -> tuple[Spans, Spans]:
    """(chosen, rejected) spans of one preference line, each rendered as `sft_spans` renders
    the prompt with that answer as its completion, or the messages with it as a last assistant
    turn; only that answer is trained (an earlier assistant turn is context)."""
    for key in ("chosen", "rejected"):
        if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
            raise DataError(f"{where}: field {key!r} is missing or not a string; each line is "
                            f"{PAIR_SHAPES}")
    if isinstance(obj.get("messages"), list):
        check_messages(obj["messages"], where)
    pair = [sft_spans({"messages": [*obj["messages"], {"role": "assistant", "content": obj[k]}]}
                      if "messages" in obj else {"prompt": obj.get("prompt"), "completion": obj[k]},
                      where, template) for k in ("chosen", "rejected")]
    last = [max(i for i, (_, t) in enumerate(spans) if t and not (i and spans[i - 1][1]))
            for spans in pair]   # where the last run of trained spans begins
    return tuple([(x, t and i >= j) for i, (x, t) in enumerate(spans)]
                 for spans, j in zip(pair, last))


def read_preference_jsonl(path: str, flag: str = "--data.path",
                          template: ChatTemplate | None = None) -> list[tuple[Spans, Spans]]:
    return [preference_spans(obj, where, template)
            for where, obj in jsonl_file(path, flag, "pair", PAIR_SHAPES)]


@dataclass
class Example:
    tokens: np.ndarray   # int32 [n]
    trained: np.ndarray  # bool [n]: the token is part of a completion or an assistant turn

    @property
    def prompt(self) -> np.ndarray:
        """The tokens before the first trained one: what a generated answer starts from."""
        return self.tokens[:int(np.argmax(self.trained)) if self.trained.any() else None]

    @property
    def answer(self) -> np.ndarray:
        """The first run of trained tokens: the completion, or the first assistant turn."""
        rest = self.trained[len(self.prompt):]
        return self.tokens[len(self.prompt):][:len(rest) if rest.all() else int(np.argmin(rest))]


def tokenize_examples(examples: list[Spans], sp: spm.SentencePieceProcessor) -> list[Example]:
    """Spans -> tokens. Neighbouring spans with the same flag are encoded as one text, so that
    pieces merge as in running text and a mask edge is a token edge. A HuggingFace chat
    rendering (no EOS span) is encoded whole, as transformers does; a token is trained where
    its first character is."""
    if hasattr(sp, "encode_offsets") and examples and all(
            t is not EOS for spans in examples for t, _ in spans):
        return [_encode_whole(spans, sp) for spans in examples]
    merged = []
    for spans in examples:
        runs: Spans = []
        for text, trained in spans:
            if text is not EOS and runs and runs[-1][0] is not EOS and runs[-1][1] == trained:
                text = runs.pop()[0] + text
            runs.append((text, trained))
        merged.append(runs)
    encoded = iter(sp.encode([t for runs in merged for t, _ in runs if t is not EOS],
                             num_threads=os.cpu_count() or 1))
    out = []
    for runs in merged:
        pieces = [([sp.eos_id()] if text is EOS else next(encoded), t) for text, t in runs]
        out.append(Example(np.asarray([i for ids, _ in pieces for i in ids], np.int32),
                           np.asarray([t for ids, t in pieces for _ in ids], bool)))
    return out


def _encode_whole(spans: Spans, tok) -> Example:
    ids, offsets = tok.encode_offsets("".join(t for t, _ in spans))
    trained_c = np.concatenate([np.full(len(t), f, bool) for t, f in spans])
    return Example(np.asarray(ids, np.int32),
                   np.asarray([trained_c[min(a, len(trained_c) - 1)] for a, _ in offsets], bool))


@dataclass
class Packed:
    """SFT examples packed into rows of seq_len positions; every array is [rows, seq_len]. An
    example of n tokens fills n - 1 consecutive positions of one row: its tokens [:-1] are the
    inputs there and its tokens [1:] the targets, so no target crosses into the next example.
    segment_ids number a row's examples 1, 2, ... (0 = padding); positions restart at 0 in each
    example; weights are each target's loss weight (0 on prompts and padding)."""
    inputs: np.ndarray = field(repr=False)       # int32
    targets: np.ndarray = field(repr=False)      # int32
    weights: np.ndarray = field(repr=False)      # float32
    segment_ids: np.ndarray = field(repr=False)  # int32
    positions: np.ndarray = field(repr=False)    # int32
    packed: bool = True  # False: one example per row, for which the causal mask suffices
    stats: dict = field(default_factory=dict)

    num_rows = property(lambda self: self.inputs.shape[0])
    seq_len = property(lambda self: self.inputs.shape[1])


def pack_examples(examples: list[Example], seq_len: int, *, train_on: str = "completion",
                  loss_average: str = "token", overlong: str = "truncate", pack: bool = True,
                  name: str = "examples") -> Packed:
    """Loss weights, the over-long rule, then rows (see `Packed`). Weights: 1 per trained
    target ("token": the batch's loss is the mean over its trained tokens), or 1/k for an
    example with k trained targets ("example": the mean over examples of their own means).
    The loss divides the weighted sum by the batch's total weight either way."""
    stats = dict(examples=len(examples), truncated=0, dropped_overlong=0, dropped_untrained=0)
    kept: list[tuple[np.ndarray, np.ndarray]] = []
    for ex in examples:
        tokens, trained = ex.tokens, np.ones_like(ex.trained) if train_on == "all" else ex.trained
        if len(tokens) - 1 > seq_len:
            if overlong == "drop":
                stats["dropped_overlong"] += 1
                continue
            tokens, trained = tokens[:seq_len + 1], trained[:seq_len + 1]
            stats["truncated"] += 1
        w = trained[1:].astype(np.float32)  # the weight of predicting token t + 1
        if not w.any():  # the truncation cut the whole answer, or a one-token example
            stats["dropped_untrained"] += 1
            continue
        kept.append((tokens, w / w.sum() if loss_average == "example" else w))
    if not kept:
        raise DataError(f"{name}: no example is left to train on ({_describe(stats)}); "
                        f"raise --train.seq-len or use --data.overlong truncate")
    lengths = [len(t) - 1 for t, _ in kept]
    rows = _best_fit(lengths, seq_len) if pack else [[i] for i in range(len(kept))]
    arrays = {f: np.zeros((len(rows), seq_len), np.float32 if f == "weights" else np.int32)
              for f in PACKED_FIELDS}
    for r, members in enumerate(rows):
        col = 0
        for seg, i in enumerate(members, 1):
            (tokens, w), n = kept[i], lengths[i]
            for f, v in zip(PACKED_FIELDS, (tokens[:-1], tokens[1:], w, seg, np.arange(n))):
                arrays[f][r, col:col + n] = v
            col += n
    stats |= {"rows": len(rows), "seq_len": seq_len, "kept": len(kept),
              "non_pad": sum(lengths) / (len(rows) * seq_len),
              "trained": float((arrays["weights"] > 0).mean())}
    return Packed(**arrays, packed=pack, stats=stats)


def _best_fit(lengths: list[int], seq_len: int) -> list[list[int]]:
    """The examples of each row, by best-fit decreasing: longest first, each into the row it
    fills most tightly. Deterministic, and within 11/9 of the fewest rows (plus one)."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free positions, row), ascending
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        j = bisect_left(free, (n, -1))
        room, r = free.pop(j) if j < len(free) else (seq_len, len(rows))  # else a new row
        if r == len(rows):
            rows.append([])
        rows[r].append(i)
        if room > n:
            insort(free, (room - n, r))
    return rows


def _describe(s: dict) -> str:
    return (f"{_count(s['examples'], 'example')}: {s['truncated']:,} truncated to seq_len + 1 "
            f"tokens, {s['dropped_overlong']:,} dropped as too long, "
            f"{s['dropped_untrained']:,} dropped with nothing left to train")


def epoch_order(num_rows: int, first: int, n: int, *seed: int) -> np.ndarray:
    """Places first..first + n - 1 of a run of epochs, each a permutation of the rows drawn
    from default_rng([*seed, epoch]): every row once per epoch, and a resumed run needs
    nothing but where it is."""
    epoch, k = np.divmod(first + np.arange(n, dtype=np.int64), num_rows)
    perms = {e: np.random.default_rng([*seed, e]).permutation(num_rows)
             for e in set(epoch.tolist())}
    return np.array([perms[e][i] for e, i in zip(epoch.tolist(), k.tolist())], np.int64)


def packed_rows(num_rows: int, *, seed: int, step: int, batch_size: int) -> np.ndarray:
    if num_rows < 1 or batch_size < 1 or seed < 0 or step < 0:
        raise ValueError(f"num_rows ({num_rows}) and batch_size ({batch_size}) must be >= 1, "
                         f"seed ({seed}) and step ({step}) >= 0")
    return epoch_order(num_rows, step * batch_size, batch_size, seed)


def packed_batch(packed: Packed, rows: np.ndarray,
                 sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
    """Rows `rows` of `packed` (-1: an empty row, all weights 0), {field: [len(rows), seq_len]}
    laid out by `sharding`. Unpacked rows leave out segment_ids and positions: one example per
    row, then padding, needs only the causal mask (which keeps every attention kernel open)."""
    def block(table: np.ndarray, r: slice, c: slice) -> np.ndarray:  # row -1: all zeros
        return table[np.maximum(rows[r], 0)][:, c] * (rows[r] >= 0)[:, None]
    return {name: _sharded((len(rows), packed.seq_len), sharding, getattr(packed, name).dtype,
                           functools.partial(block, getattr(packed, name)))
            for name in (PACKED_FIELDS if packed.packed else PACKED_FIELDS[:3])}


def held_out_batches(packed: Packed, batch_size: int,
                     sharding: jax.sharding.Sharding) -> Iterator[dict[str, jax.Array]]:
    """Every row of `packed` once, in order, batch_size at a time (the last filled up with
    empty rows): an eval of the whole held-out split."""
    for start in range(0, packed.num_rows, batch_size):
        rows = np.arange(start, start + batch_size)
        yield packed_batch(packed, np.where(rows < packed.num_rows, rows, -1), sharding)


def pack_pairs(pairs: list[tuple[Example, Example]], seq_len: int, *, overlong: str = "truncate",
               name: str = "pairs") -> Packed:
    """One preference pair to a row: the chosen answer's example in the first half (segment
    1), the rejected one's in the second (segment 2), each packed as `pack_examples` packs one
    example to a row of seq_len // 2 (truncated or dropped when longer); a pair loses both
    halves when it loses either. Weights are 1 on each answer's targets."""
    half = seq_len // 2
    long = lambda ex: len(ex.tokens) - 1 > half
    gone = lambda ex: overlong == "drop" and long(ex) or not ex.trained[1:half + 1].any()
    kept = [p for p in pairs if not (gone(p[0]) or gone(p[1]))]
    a, b = (pack_examples([p[i] for p in kept], half, overlong=overlong, pack=False, name=name)
            for i in (0, 1))
    arrays = {f: np.concatenate([getattr(a, f), getattr(b, f) * (2 if f == "segment_ids" else 1)],
                                axis=1) for f in PACKED_FIELDS}
    n_long = [sum(long(c) or long(r) for c, r in ps) for ps in (pairs, kept)]
    drop = (overlong == "drop") * n_long[0]
    stats = a.stats | dict(examples=len(pairs), rows=len(kept), seq_len=seq_len,
                           truncated=n_long[1], dropped_overlong=drop,
                           dropped_untrained=len(pairs) - len(kept) - drop,
                           non_pad=(arrays["segment_ids"] > 0).mean(),
                           trained=float((arrays["weights"] > 0).mean()))
    return Packed(**arrays, stats=stats)


@dataclass
class SFTDataset(Dataset):
    """`train` and `eval` are `Packed` rows; the trainer completes `eval_examples`' prompts."""
    eval_examples: list[Example] = field(default_factory=list, repr=False)


class PreferenceDataset(SFTDataset):
    """`train` and `eval` are rows of pairs (`pack_pairs`); `eval_examples` the held-out
    prompts with their chosen answers."""


def tokenizer_path(cfg: DataConfig) -> str:
    """The sentencepiece model that a run with data config `cfg` tokenizes with."""
    if cfg.format != "text" and cfg.tokenizer:
        return cfg.tokenizer
    folder = (cfg.format == "text" and cfg.path) or _stdlib_corpus(_cache_root(cfg.cache_dir),
                                                                   vocab_size=cfg.vocab_size)
    return os.path.join(folder, "tokenizer.model")


def run_tokenizer(run_dir: str) -> str:
    """The tokenizer the train_dense.py run in `run_dir` used; a fine-tune (SFT, DPO) that
    named none used its --init-from's."""
    saved = read_run_config(run_dir, "--init-from", True)
    known = {f.name for f in fields(DataConfig)}
    theirs = DataConfig(**{k: v for k, v in saved.get("data", {}).items() if k in known})
    if theirs.format != "text" and not theirs.tokenizer and saved.get("init_from"):
        return run_tokenizer(saved["init_from"])
    return tokenizer_path(theirs)


def load_sft(cfg: DataConfig, seq_len: int) -> SFTDataset:
    """--data.path (and --data.eval-path) read, split, tokenized and packed into rows of
    seq_len, the same on every process."""
    dpo = cfg.format == "dpo"
    if not cfg.path:
        raise DataError(f"--data.format {cfg.format} needs --data.path: a JSONL file with one "
                        f"{'pair' if dpo else 'example'} per line, "
                        f"{PAIR_SHAPES if dpo else SFT_SHAPES}")
    if not cfg.eval_path and not 0.0 < cfg.eval_fraction < 1.0:
        raise DataError(f"--data.eval-fraction {cfg.eval_fraction}: must be strictly between "
                        f"0 and 1 (or give --data.eval-path)")
    tok = tokenizer_path(cfg)
    if not os.path.isfile(tok):
        raise FileNotFoundError(f"--data.tokenizer {tok!r}: no such file; give a sentencepiece "
                                f".model, or leave it empty for the embedded corpus's")
    try:
        sp = open_tokenizer(tok)
    except (OSError, RuntimeError, ValueError) as e:
        raise DataError(f"--data.tokenizer {tok!r} is neither a sentencepiece model nor a "
                        f"HuggingFace tokenizer.json ({e})") from None
    # A HuggingFace tokenizer's folder brings its chat template: the model answers in it.
    template = ChatTemplate.find(os.path.dirname(tok)) if tok.endswith(".json") else None
    if template:
        print(f"data: sft chat rendered with the chat template of {os.path.dirname(tok)}")
    read = read_preference_jsonl if dpo else read_sft_jsonl
    train = read(cfg.path, template=template)
    if cfg.eval_path:
        held = read(cfg.eval_path, "--data.eval-path", template)
    elif len(train) < 2:
        raise DataError(f"--data.path {cfg.path!r} holds one example: too few to hold one out; "
                        f"add examples or give --data.eval-path")
    else:
        is_eval = _held_out(len(train), cfg.eval_fraction, cfg.seed)
        held, train = [[ex for ex, e in zip(train, is_eval) if e == want] for want in (True, False)]
    rules = {k: getattr(cfg, k) for k in ("train_on", "loss_average", "overlong", "pack")}
    pack = functools.partial(pack_examples, **rules)
    tokenize = functools.partial(tokenize_examples, sp=sp)
    if dpo:  # pairs: chosen, rejected, chosen, ... tokenized, then paired again
        pack = functools.partial(pack_pairs, overlong=cfg.overlong)
        tokenize = lambda pairs: list(zip(*[iter(tokenize_examples(sum(map(list, pairs), []),
                                                                   sp))] * 2))
    held = tokenize(held)
    ds = (PreferenceDataset if dpo else SFTDataset)(
        train=pack(tokenize(train), seq_len, name=cfg.path),
        eval=pack(held, seq_len, name=f"{cfg.path} (held out)"), vocab_size=sp.get_piece_size(),
        tokenizer_path=tok, eval_examples=[p[0] if dpo else p for p in held])
    for split in ("train", "eval"):
        s = getattr(ds, split).stats
        print(f"data: {cfg.format} {split}: {_count(s['kept'], 'pair' if dpo else 'example')} in "
              f"{s['rows']:,} rows of {seq_len} ("
              f"{'one pair per row' if dpo else 'packed' if cfg.pack else 'one per row'}; "
              f"{100 * s['non_pad']:.1f}% of positions hold tokens, {100 * s['trained']:.1f}% "
              f"are trained targets) | of {_describe(s)}", flush=True)
    return ds


# --- Command line -----------------------------------------------------------------------------
def main(args: list[str] | None = None) -> None:
    try:
        out = tyro.extras.subcommand_cli_from_dict({"prepare": prepare},
                                                   prog="python -m common.data", args=args)
    except (FileNotFoundError, ValueError) as e:  # bad input: the reason, exit 2, no traceback
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {out}:")
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json") + PREPARED_FILES[1:]:
        if os.path.isfile(path := os.path.join(out, name)):
            line = f"  {name:21s} {os.path.getsize(path) / 1e6:10.2f} MB"
            if name in ("train.json", "eval.json"):
                meta = json.loads(Path(path).read_text())
                line += (f"  {meta['num_tokens']:,} {meta['dtype']} tokens, "
                         f"{meta['num_documents']:,} documents")
            print(line)


if __name__ == "__main__":
    main()

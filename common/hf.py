"""HuggingFace checkpoint folders: safetensors files, their index, and config.json.

Model-agnostic on purpose: each trainer states its family's name mapping in plain sight (at the
end of its file) as a tree shaped like its parameters, every leaf a pair (HF tensor name, layout):

    ("model.layers.{l}.self_attn.q_proj.weight", "(n h) d -> l d n h")

The layout says how HuggingFace's tensor becomes ours, einops-style: the left side is the tensor in
the file (a group "(n h)" is one axis of size n*h, split in two), the right side our axis order. An
axis only the right side names ("l" above) stacks many file tensors, one per value, named by putting
the value into "{l}". An atom "2:0" on the left is an axis of size 2 of which this leaf is index 0:
two leaves interleaved in one file tensor, as GPT-OSS's "e d (f 2:0)" (gate) and "(f 2:1)" (up).
A bracket "[a b|a b|c]:i" is an axis of unequal parts one after another (sizes a*b, a*b, c), of
which this leaf is the i-th, split into that part's atoms: "([k q|k q|k v]:1) d" takes the keys
of query, key and value rows fused in one tensor.
A name may offset a stacking axis, "{l+3}": a second stack of layers that starts at file layer 3,
and stride it, "{l*2+1}": a stack of every second layer, or "{l*6//5}": all but every sixth.
Sizes come from a dict ({"l": 32, "n": 32, "h": 128, ...}) built from the
model's config. Loading and saving read the same mapping, so they cannot drift apart.

Reading is sliced: each device's block of a tensor is copied from the memory-mapped file, cast
to float32 and placed (`jax.make_array_from_callback`); a 70B model is never whole in host memory.

The format, from the safetensors specification: 8 bytes, little-endian u64 N; N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}; then the byte
buffer, offsets relative to its start. A sharded checkpoint adds `model.safetensors.index.json`
({"weight_map": {name: file}}). We need neither torch nor `safetensors` (the tests compare with it).
"""
from __future__ import annotations

import filecmp
import functools
import json
import math
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import jax
import ml_dtypes
import numpy as np

from common.observe import write_json

INDEX, SINGLE, CONFIG = "model.safetensors.index.json", "model.safetensors", "config.json"
# What a model folder may ship besides its weights and config; copied along on export.
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                   "generation_config.json", "chat_template.jinja")
# Keys of a source config.json that an export drops, as they would contradict the config it
# writes: per-layer attention kinds, a quantisation recipe, the rope settings.
CONTRADICTING = ("layer_types", "quantization_config", "transformers_version", "rope_scaling",
                 "rope_parameters")

DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
          "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
          "I64": np.dtype(np.int64)}  # DeepSeek-V4's token -> experts tables
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # a header larger than this is a damaged or foreign file


class HFError(ValueError):
    """A HuggingFace folder we cannot read faithfully; the message says what and the fix."""


# --- Layouts: "(n h) d -> l d n h" ------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    file_shape: tuple[int, ...]   # the tensor as stored
    split_shape: tuple[int, ...]  # the same bytes, every group split into its axes
    stack: tuple[str, ...]        # axes that index file tensors ("l", "e"), outermost first
    perm: tuple[int, ...]         # ours = split[pick].transpose(perm): split axis of each of ours
    shape: tuple[int, ...]        # ours, stack axes first
    pick: tuple[tuple[int, int], ...] = ()  # (split axis, index) of each "2:0" atom
    coarse: tuple[int, ...] = ()  # the file tensor with each bracket one axis, when it has any
    window: tuple[slice, ...] = ()  # on those axes, this leaf's part of each bracket


def parse_layout(pattern: str, sizes: dict[str, int]) -> Layout:
    left, arrow, right = pattern.partition("->")
    size = lambda a: int(a.split(":")[0]) if ":" in a else sizes[a]
    file_shape, coarse, window, atoms_left = [], [], [], []
    for g, a in re.findall(r"\(([^)]*)\)|(\w+)", left):
        n = 1
        for tok in re.findall(r"\[[^\]]*\]:\d+|[^\s\[]+", g or a):
            if tok[0] == "[":  # parts one after another: this leaf's is the i-th, split
                body, i = tok[1:].split("]:")
                parts = [p.split() for p in body.split("|")]
                lens = [math.prod(size(x) for x in p) for p in parts]
                at = sum(lens[:int(i)])
                window.append((len(coarse), slice(at, at + lens[int(i)])))
                coarse.append(sum(lens))
                atoms_left += parts[int(i)]
            else:
                coarse.append(size(tok))
                atoms_left.append(tok)
            n *= coarse[-1]
        file_shape.append(n)
    atoms_right = right.split()
    pick = tuple((i, int(a.split(":")[1])) for i, a in enumerate(atoms_left) if ":" in a)
    kept = [a for a in atoms_left if ":" not in a]
    stack = tuple(a for a in atoms_right if a not in atoms_left)
    data = [a for a in atoms_right if a in atoms_left]
    if (not arrow or sorted(data) != sorted(kept) or pick and window or
            tuple(atoms_right[:len(stack)]) != stack):
        raise ValueError(f"bad layout {pattern!r}: the right side must list every axis of the "
                         "left once, after the stacking axes (and a leaf picks or takes a part, "
                         "not both)")
    win = [slice(None)] * len(coarse)
    for axis, s in window:
        win[axis] = s
    return Layout(tuple(file_shape), tuple(size(a) for a in atoms_left), stack,
                  tuple(kept.index(a) for a in data), tuple(sizes[a] for a in atoms_right), pick,
                  tuple(coarse) if window else (), tuple(win) if window else ())


def _is_entry(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and all(isinstance(s, str) for s in x)


def _name(template: str, values: dict[str, int]) -> str:
    """The template with its "{l}", "{l+3}", "{l*2+1}" and "{l*6//5}" filled in from `values`."""
    return re.sub(r"\{(\w+)(?:\*(\d+))?(?://(\d+))?(?:\+(\d+))?\}", lambda m: str(
        values[m[1]] * int(m[2] or 1) // int(m[3] or 1) + int(m[4] or 0)), template)


def _file_names(template: str, layout: Layout, sizes: dict) -> Iterator[tuple[tuple, str]]:
    """(stack index, file tensor name) for every file tensor that makes one of our leaves."""
    for idx in np.ndindex(*(sizes[a] for a in layout.stack)):
        yield idx, _name(template, dict(zip(layout.stack, idx)))


# --- Reading ----------------------------------------------------------------------------------
def read_config(path: str, text: bool = True) -> dict:
    """config.json; of a multimodal folder (Llama 4's, Gemma 3's) its language model's part."""
    file = os.path.join(path, CONFIG)
    if not os.path.isdir(path):
        raise HFError(f"{path}: no such folder. Give the folder of a HuggingFace model (with "
                      "config.json and *.safetensors), e.g. a `huggingface-cli download` target.")
    if not os.path.isfile(file):
        raise HFError(f"{path} has no config.json, so it is not a HuggingFace model folder.")
    with open(file) as f:
        try:
            cfg = json.load(f)
        except ValueError as e:
            raise HFError(f"{file} is not valid JSON ({e}).") from None
    if not isinstance(cfg, dict):
        raise HFError(f"{file} does not hold a JSON object.")
    return _text_part(cfg) if text else cfg


def _text_part(cfg: dict) -> dict:
    inner = cfg.get("text_config")
    if not isinstance(inner, dict):
        return cfg
    return {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg} | inner


def _language_model(name: str) -> str | None:
    """A multimodal folder's tensor as its language model names it alone (None: another tower's,
    as vision_model.* or multi_modal_projector.*)."""
    for outer, inner in (("language_model.", ""), ("model.language_model.", "model.")):
        if name.startswith(outer):
            return inner + name.removeprefix(outer)
    return name if name == "lm_head.weight" else None


def rope_parameters(c: dict, default_theta: float, where: str) -> tuple[float, str, dict]:
    """(rope_theta, rope type, the type's parameters) from a config.json in either spelling:
    transformers 5 writes rope_parameters with rope_theta inside; 4.x wrote rope_theta beside
    a rope_scaling dict ("type" before 4.43, "rope_type" after)."""
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in rope.values()):
        raise HFError(f"{where}: rope parameters per layer type ({', '.join(rope)}) are not "
                      "implemented.")
    theta = float(rope.pop("rope_theta", c.get("rope_theta", default_theta)))
    return theta, rope.pop("rope_type", rope.pop("type", "default")), rope


def _read_header(file: str) -> dict[str, tuple[np.dtype, tuple[int, ...], int]]:
    """name -> (dtype, shape, file offset) of one safetensors file's tensors, each checked
    against the file, so a truncated or foreign file fails here, not later as garbage weights."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(_MAX_HEADER, size - 8):
            raise HFError(f"{file} is not a safetensors file (bad header length).")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise HFError(f"{file}: the safetensors header is not JSON ({e}).") from None
    header.pop("__metadata__", None)
    start, tensors = 8 + n, {}
    for name, t in header.items():
        if t.get("dtype") not in DTYPES | PACKED:
            raise HFError(f"{file}: tensor {name} has dtype {t.get('dtype')}; only "
                          f"{', '.join(DTYPES)} load, and MXFP4 and F8_E4M3 scaled by blocks "
                          "(DeepSeek's) or channels (fbgemm's); other quantized checkpoints "
                          "do not.")
        shape, (begin, end) = tuple(t["shape"]), t["data_offsets"]
        dtype = (DTYPES | PACKED)[t["dtype"]]
        if end - begin != math.prod(shape) * dtype.itemsize or end > size - start:
            raise HFError(f"{file}: tensor {name} {list(shape)} {t['dtype']} does not fit its "
                          f"offsets [{begin}, {end}] in a {size}-byte file: truncated?")
        tensors[name] = (dtype, shape, start + begin)
    return tensors


class Checkpoint:
    """A HuggingFace folder opened for reading: config.json and its safetensors, one file or
    several with an index. Opening checks that every shard the index names exists and holds
    the tensors it is said to; tensors are memory-mapped and read only when asked."""

    def __init__(self, path: str):
        whole = read_config(path, text=False)
        self.path, self.config, self._maps = path, _text_part(whole), {}
        self.config_file = os.path.join(path, CONFIG)
        index, weight_map = os.path.join(path, INDEX), None
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise HFError(f"{index} has no weight_map.")
        elif not os.path.isfile(os.path.join(path, SINGLE)):
            found = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".gguf"))]
            hint = (f" (found {', '.join(sorted(found)[:3])}: only safetensors load; convert with "
                    "transformers' save_pretrained(..., safe_serialization=True))" if found else "")
            raise HFError(f"{path} has neither {SINGLE} nor {INDEX}{hint}.")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        if missing := [f for f in files if not os.path.isfile(os.path.join(path, f))]:
            raise HFError(f"{path}: {len(missing)} of the {len(files)} shards named in {INDEX} "
                          f"are missing: {', '.join(missing[:5])}. The download is incomplete; "
                          "fetch those files again.")
        self._tensors = {name: (file, *t) for file in files
                         for name, t in _read_header(os.path.join(path, file)).items()}
        lost = [n for n, f in (weight_map or {}).items() if self._tensors.get(n, (None,))[0] != f]
        if lost:
            raise HFError(f"{path}: {INDEX} places {lost[0]} in {weight_map[lost[0]]}, "
                          f"which does not hold it ({len(lost)} such tensors).")
        self.other_towers = []  # a multimodal folder's tensors that are not its language model
        if whole is not self.config:
            named = {n: _language_model(n) for n in self._tensors}
            self.other_towers = sorted(n for n, t in named.items() if t is None)
            self._tensors = {t: self._tensors[n] for n, t in named.items() if t}
        self._mxfp4 = mxfp4_pairs(self._tensors, path)   # name -> (its blocks, its scales)
        quant = self.config.get("quantization_config") or {}
        self._block = tuple(quant.get("weight_block_size") or (128, 128))
        self._fp8 = fp8_pairs(self._tensors, path, self._block)  # name -> its scales

    def names(self) -> set[str]:
        packed = {n for pair in self._mxfp4.values() for n in pair} | set(self._fp8.values())
        return set(self._tensors) - packed | set(self._mxfp4)

    def shape(self, name: str) -> tuple[int, ...]:
        return (MXFP4.logical_shape(self._tensors[self._mxfp4[name][0]][2]) if name in self._mxfp4
                else self._tensors[name][2])

    def array(self, name: str):
        """The whole tensor as a read-only memory map: nothing is read until it is sliced (an
        MXFP4 pair as an `MXFP4`, a float8 matrix and its scales as `FP8Blocks`)."""
        if name in self._mxfp4:
            return MXFP4(*(self._raw(n) for n in self._mxfp4[name]))
        if name in self._fp8 and self._fp8[name].endswith("_scale"):
            return FP8Channels(self._raw(name), self._raw(self._fp8[name]))
        if name in self._fp8:
            return FP8Blocks(self._raw(name), self._raw(self._fp8[name]), self._block)
        return self._raw(name)

    def _raw(self, name: str) -> np.ndarray:
        file, dtype, shape, offset = self._tensors[name]
        if file not in self._maps:
            self._maps[file] = np.memmap(os.path.join(self.path, file), np.uint8, mode="r")
        n = math.prod(shape) * dtype.itemsize
        return self._maps[file][offset:offset + n].view(dtype).reshape(shape)

    def check(self, expected: dict[str, tuple[int, ...]], ignore: Callable[[str], bool],
              what: str) -> None:
        """Every expected tensor is present with its shape, and nothing is left unused: a
        tensor we do not know (a bias, an extra norm) would otherwise be dropped silently."""
        if missing := sorted(set(expected) - self.names()):
            raise HFError(f"{self.path}: {len(missing)} tensors that a {what} has are missing, "
                          f"e.g. {', '.join(missing[:3])}. Is config.json right for these "
                          "weights, and is the download complete?")
        for name, shape in expected.items():
            if self.shape(name) != tuple(shape):
                raise HFError(f"{self.path}: tensor {name} has shape {list(self.shape(name))} "
                              f"but config.json implies {list(shape)} for a {what}; the "
                              "config and the weights disagree.")
        if extra := sorted(n for n in self.names() - set(expected) if not ignore(n)):
            raise HFError(f"{self.path}: {len(extra)} tensors have no place in a {what}: "
                          f"{', '.join(extra[:4])}. This model has parts our trainer does not "
                          "implement; loading it would silently change what it computes.")

    def read_block(self, template: str, layout: Layout, sizes: dict, index: tuple) -> np.ndarray:
        """Our float32 block `index` (a tuple of slices into our shape) of one leaf."""
        ranges = [range(*s.indices(n)) for s, n in zip(index, layout.shape)]
        k = len(layout.stack)
        out = np.empty([len(r) for r in ranges], np.float32)
        # Our data axis j is split axis perm[j]: slice the file tensor there, then transpose.
        file_index = [index[k + j] for j in np.argsort(layout.perm)]
        for axis, i in layout.pick:
            file_index.insert(axis, i)
        for pos in np.ndindex(*out.shape[:k]):
            name = _name(template, {a: r[i] for a, r, i in zip(layout.stack, ranges, pos)})
            x = self.array(name)
            if layout.window:  # this leaf's part of each bracket first (a view, or read)
                x = _take(x, layout.coarse, layout.window)
            x = _take(x, layout.split_shape, file_index)
            out[pos] = x.transpose(layout.perm)
        return out


def _take(x, shape: tuple, index) -> np.ndarray:
    """x.reshape(shape)[index] of a memory-mapped or a quantised (`Dequantised`) tensor."""
    return x.reshape(shape)[tuple(index)] if isinstance(x, np.ndarray) else x.read(shape, index)


def load(ckpt: Checkpoint, mapping, sizes: dict, shardings, what: str,
         ignore: Callable[[str], bool] = lambda name: False):
    """Our parameter tree from `ckpt`: float32 jax.Arrays with `shardings`, read block by block.
    First every file tensor the mapping names is checked for, with the shape it must have."""
    leaves = [(t, parse_layout(p, sizes)) for t, p in jax.tree.leaves(mapping, is_leaf=_is_entry)]
    ckpt.check({name: layout.file_shape for template, layout in leaves
                for _, name in _file_names(template, layout, sizes)}, ignore, what)

    def one(entry, sharding):
        layout = parse_layout(entry[1], sizes)
        read = functools.partial(ckpt.read_block, entry[0], layout, sizes)  # (index) -> block
        return jax.make_array_from_callback(layout.shape, sharding, read, dtype=np.float32)
    return jax.tree.map(one, mapping, shardings, is_leaf=_is_entry)


# --- MXFP4: reading OpenAI's quantized experts (GPT-OSS) -------------------------------------
PACKED = {"U8": np.dtype(np.uint8), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}
# E2M1, the OCP microscaling FP4: a sign bit, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def mxfp4_pairs(tensors: dict, path: str) -> dict[str, tuple[str, str]]:
    """name -> (name_blocks, name_scales) of each MXFP4 tensor; any other uint8 tensor is a
    quantization we do not read, which must fail here rather than load as garbage."""
    u8 = {n for n, t in tensors.items() if t[1] == PACKED["U8"]}   # t: (file, dtype, shape, at)
    pairs = {n[:-7]: (n, n[:-7] + "_scales") for n in u8
             if n.endswith("_blocks") and n[:-7] + "_scales" in u8}
    if lone := sorted(u8 - {n for pair in pairs.values() for n in pair}):
        raise HFError(f"{path}: tensor {lone[0]} is uint8 but not half of an MXFP4 pair "
                      "(*_blocks and *_scales); only MXFP4 quantization is read.")
    for blocks, scales in pairs.values():
        b, s = tensors[blocks][2], tensors[scales][2]
        if len(b) < 3 or b[:-1] != s or b[-1] != 16:
            raise HFError(f"{path}: {blocks} {list(b)} and {scales} {list(s)} are not MXFP4 "
                          "(blocks [..., rows, groups, 16] bytes, scales [..., rows, groups]).")
    return pairs


class Dequantised:
    """A quantised tensor read by blocks: a subclass gives its float32 `shape` and `take`."""

    def read(self, split_shape: tuple, file_index: list) -> np.ndarray:
        """`reshape(split_shape)[file_index]` of the dequantised tensor, for a layout's block:
        each file axis's wanted positions, from the split axes it was cut into."""
        coords, j = [], 0
        for n in self.shape:
            flat, first = np.zeros((), np.int64), j
            while j == first or math.prod(split_shape[first:j]) < n:
                s = file_index[j]
                r = np.arange(split_shape[j])[s] if isinstance(s, slice) else np.array([s])
                flat, j = flat[..., None] * split_shape[j] + r, j + 1
            coords.append(flat.ravel())
        out = [len(np.arange(n)[s]) for n, s in zip(split_shape, file_index)
               if isinstance(s, slice)]
        return self.take(coords).reshape(out)


class MXFP4(Dequantised):
    """A tensor stored as MXFP4: blocks [..., O, G, 16] uint8 hold 32 E2M1 values per group,
    two per byte, the low nibble first; scales [..., O, G] uint8 one power of two per group,
    2^(s - 127). As transformers dequantises them (integrations/mxfp4.py), the tensor is
    [..., G * 32, O]: the last two axes swapped, so that it reads as the parameter it stands
    for (GPT-OSS's gate_up_proj [E, D, 2F]) and one layout serves both kinds of checkpoint."""

    def __init__(self, blocks: np.ndarray, scales: np.ndarray):
        self.blocks, self.scales = blocks, scales
        self.shape = self.logical_shape(blocks.shape)

    @staticmethod
    def logical_shape(blocks_shape) -> tuple[int, ...]:
        *pre, rows, groups, nbytes = blocks_shape
        return (*pre, groups * nbytes * 2, rows)

    def take(self, coords: list[np.ndarray]) -> np.ndarray:
        """x[np.ix_(*coords)] in float32, reading only the groups that hold those values."""
        *pre, i_in, i_out = coords
        g = np.unique(i_in // 32)
        packed = self.blocks[np.ix_(*pre, i_out, g)]                    # [..., O', G', 16]
        vals = FP4_VALUES[np.stack([packed & 15, packed >> 4], axis=-1)]  # low nibble first
        exp = self.scales[np.ix_(*pre, i_out, g)].astype(np.int32) - 127
        vals = np.ldexp(vals.reshape(*packed.shape[:-1], 32), exp[..., None])
        cols = np.searchsorted(g, i_in // 32) * 32 + i_in % 32
        return vals.reshape(*packed.shape[:-2], -1)[..., cols].swapaxes(-1, -2)


# --- Block-scaled float8: DeepSeek-V3's and Kimi K2's releases -------------------------------
def fp8_pairs(tensors: dict, path: str, block: tuple[int, int]) -> dict[str, str]:
    """name -> its scales' name, for each float8 tensor: an e4m3 matrix [O, I] with one
    float scale per block x block tile, name_scale_inv [ceil(O / block), ceil(I / block)]
    (weight_block_size in quantization_config; 128 x 128 in DeepSeek-V3), or (fbgemm's, Llama 4
    Maverick's) one per output channel, name_scale (`FP8Channels`). Any other fails here."""
    pairs = {}
    for n in sorted(n for n, t in tensors.items() if t[1] == PACKED["F8_E4M3"]):
        shape, scale = tensors[n][2], tensors.get(n + "_scale_inv", (None, None, None))
        want = tuple(-(-d // b) for d, b in zip(shape, block))
        if FP8Channels.scale_shape(shape, tensors.get(n + "_scale", (None, None, ()))[2]):
            pairs[n] = n + "_scale"
        elif len(shape) != 2 or scale[2] != want or scale[1] not in DTYPES.values():
            raise HFError(f"{path}: float8 tensor {n} {list(shape)} has no {n}_scale_inv of "
                          f"shape {list(want)} (tiles of {block[0]} x {block[1]}), nor a "
                          f"{n}_scale per output channel: only DeepSeek-V3's block-scaled and "
                          "fbgemm's channel-scaled float8 are read.")
        else:
            pairs[n] = n + "_scale_inv"
    return pairs


class FP8Blocks(Dequantised):
    """An e4m3 matrix and its tiles' scales: w[i, j] = q[i, j] * scale[i // b0, j // b1], as
    DeepSeek's and transformers' dequantisation (weight_dequant) computes it."""

    def __init__(self, q: np.ndarray, scale: np.ndarray, block: tuple[int, int]):
        self.q, self.scale, self.block, self.shape = q, scale, block, q.shape

    def take(self, coords: list[np.ndarray]) -> np.ndarray:
        i, j = coords
        tile = self.scale[np.ix_(i // self.block[0], j // self.block[1])].astype(np.float32)
        return self.q[np.ix_(i, j)].astype(np.float32) * tile


class FP8Channels(Dequantised):
    """fbgemm's float8 (transformers' FbgemmFp8Linear and its Llama 4 experts): w = q * scale,
    one float32 scale per output channel: a Linear's weight [O, I] with weight_scale [O, 1],
    experts [E, I, O] with scales [E, 1, O], or [E, O, 1] as down_proj's are stored."""

    def __init__(self, q: np.ndarray, scale: np.ndarray):
        self.q, self.shape = q, q.shape
        self.scale = scale.reshape(self.scale_shape(q.shape, scale.shape))

    @staticmethod
    def scale_shape(shape: tuple, scale: tuple) -> tuple | None:
        """The scales' shape on the tensor's axes, or None if they are not one per channel."""
        if len(shape) == 2 and scale == (shape[0], 1):
            return scale
        if len(shape) == 3 and scale in ((shape[0], 1, shape[2]), (shape[0], shape[2], 1)):
            return shape[0], 1, shape[2]
        return None

    def take(self, coords: list[np.ndarray]) -> np.ndarray:
        at = [c if n > 1 else np.zeros(1, np.int64) for c, n in zip(coords, self.scale.shape)]
        return self.q[np.ix_(*coords)].astype(np.float32) * self.scale[np.ix_(*at)].astype(
            np.float32)


# --- Writing ----------------------------------------------------------------------------------
def _write_file(file: str, tensors: list[tuple[str, tuple, np.dtype, Callable]]) -> None:
    """One safetensors file; each tensor's bytes are made (fetched from the devices) only
    when its turn comes, so a shard is never whole in memory."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype, _ in tensors:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the buffer starts 8-byte aligned, as the spec advises
    with open(file + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape, dtype, make in tensors:
            x = np.ascontiguousarray(make(), dtype=dtype)
            assert x.shape == tuple(shape), (name, x.shape, shape)
            f.write(x.tobytes())
    os.replace(file + ".tmp", file)


def save(path: str, params, mapping, sizes: dict, config: dict, base: dict | None = None, *,
         dtype: str = "float32", max_shard_bytes: int = 5 * 2**30,
         names: tuple[str, str] = (SINGLE, CONFIG)) -> list[str]:
    """Writes `params` as a HuggingFace folder: config.json (`config` over the keys of `base`,
    the config.json the run started from, that do not contradict it), and the tensors in
    shards of at most `max_shard_bytes` (one `model.safetensors` if they fit, else numbered
    files and the index). Returns the files written. The folder must be new or empty: stale
    shards of another model beside ours would be read as part of it."""
    if jax.process_count() > 1:
        raise HFError("save_hf writes from one process; export from a single host "
                      "(export-hf restores the checkpoint there).")
    if os.path.isdir(path) and os.listdir(path):
        raise HFError(f"{path} is not empty; export into a new folder (old shards beside new "
                      "ones would be loaded as one model).")
    out_dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    if out_dtype not in DTYPE_NAMES:
        raise HFError(f"dtype {dtype!r}: choose float32, bfloat16 or float16.")
    os.makedirs(path, exist_ok=True)

    entries, want = jax.tree.flatten(mapping, is_leaf=_is_entry)
    leaves, have = jax.tree.flatten(params)
    if want != have:
        raise HFError(f"the parameters are not the tree this config makes (have {have}, "
                      f"want {want}): pass the config the parameters were made with.")

    @functools.lru_cache(maxsize=1)  # so a leaf's stack slice leaves the devices only once
    def fetch(i: int, outer: int | None) -> np.ndarray:
        return np.asarray(jax.device_get(leaves[i] if outer is None else leaves[i][outer]))

    def make(i: int, idx: tuple, layout: Layout) -> np.ndarray:
        """The file tensor at stack index `idx` of leaf i (its part, when it picks one)."""
        x = fetch(i, idx[0] if idx else None)[idx[1:]].transpose(np.argsort(layout.perm))
        part = layout.pick or layout.window  # `merge` puts it in place
        return x if part else x.reshape(layout.file_shape).astype(out_dtype)

    def merge(parts: list) -> np.ndarray:
        """One file tensor from the leaves that each pick ("2:0", "2:1") or take ("[..]:i") a
        part of it."""
        out = np.zeros(parts[0][0].coarse or parts[0][0].split_shape, out_dtype)
        for layout, part in parts:
            if layout.window:  # its atoms in file order: merged back into the bracket's axis
                out[layout.window] = part().reshape(out[layout.window].shape)
                continue
            where = [slice(None)] * len(layout.split_shape)
            for axis, i in layout.pick:
                where[axis] = i
            out[tuple(where)] = part()
        return out.reshape(parts[0][0].file_shape)
    tensors, picked = [], {}  # (name, shape, dtype, make); name -> [(layout, make)]
    for i, ((template, pattern), leaf) in enumerate(zip(entries, leaves)):
        layout = parse_layout(pattern, sizes)
        if tuple(leaf.shape) != layout.shape:
            raise HFError(f"parameter {template} has shape {tuple(leaf.shape)}, the config "
                          f"implies {layout.shape}.")
        for idx, name in _file_names(template, layout, sizes):
            part = functools.partial(make, i, idx, layout)
            if (layout.pick or layout.window) and name in picked:
                picked[name].append((layout, part))
                continue
            if layout.pick or layout.window:
                picked[name] = [(layout, part)]
                part = functools.partial(merge, picked[name])
            tensors.append((name, layout.file_shape, out_dtype, part))

    shards, size = [[]], 0
    for t in tensors:
        n = math.prod(t[1]) * out_dtype.itemsize
        if shards[-1] and size + n > max_shard_bytes:
            shards, size = shards + [[]], 0
        shards[-1].append(t)
        size += n
    single, config_file = names
    names = ([single] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards):
        _write_file(os.path.join(path, name), shard)
    if len(shards) > 1:
        total = sum(math.prod(t[1]) for t in tensors)
        write_json(os.path.join(path, INDEX), {
            "metadata": {"total_size": total * out_dtype.itemsize, "total_parameters": total},
            "weight_map": {t[0]: n for n, shard in zip(names, shards) for t in shard}})
    base = {k: v for k, v in (base or {}).items() if k not in CONTRADICTING}
    write_json(os.path.join(path, config_file), base | config)
    return names + ([INDEX] if len(shards) > 1 else []) + [config_file]


def save_adapter(path: str, adapters: dict, mapping: dict, sizes: dict, rank: int, alpha: float,
                 base_model: str = "", dtype: str = "float32") -> list[str]:
    """A LoRA run's adapters (common/train.py `lora_table`) as a folder that `peft` loads onto
    the HuggingFace model (PeftModel.from_pretrained): adapter_config.json, and each adapted
    Linear's lora_A [r, in] and lora_B [out, r] in adapter_model.safetensors, named after its
    weight. `mapping`: the model's (its HF name and layout of each weight, [out, in] in the
    file); peft's scale is ours, lora_alpha / r."""
    def entry(template: str, layout: str, half: str) -> tuple[str, str]:
        left, right = layout.split("->")
        groups = re.findall(r"\([^)]*\)|\w+", left)
        if len(groups) != 2 or not template.endswith(".weight"):
            raise HFError(f"{template}: peft adapts Linear layers; this weight ({layout}) is not "
                          "one. Export the merged model (without --adapter).")
        (out_g, in_g), atoms = groups, lambda g: g.strip("()").split()
        stack = " ".join(right.split()[:len(right.split()) - len(atoms(out_g) + atoms(in_g))])
        name = f"base_model.model.{template[:-len('.weight')]}.lora_{half.upper()}.weight"
        return name, (f"r {in_g} -> {stack} {' '.join(atoms(in_g))} r" if half == "a" else
                      f"{out_g} r -> {stack} r {' '.join(atoms(out_g))}")
    pick = lambda ad, mp: {k: pick(v, mp[k]) if "a" not in v else {
        h: entry(*mp[k], h) for h in "ab"} for k, v in ad.items()}
    amap = pick(adapters, mapping)
    modules = sorted({n.split(".")[-3] for n, _ in jax.tree.leaves(amap, is_leaf=_is_entry)})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": modules, "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True,
              "base_model_name_or_path": base_model}
    return save(path, adapters, amap, sizes | {"r": rank}, config, dtype=dtype,
                max_shard_bytes=2**62, names=("adapter_model.safetensors", "adapter_config.json"))


def copy_tokenizer(src: str, dst: str) -> list[str]:  # those of TOKENIZER_FILES src has
    copied = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(src, name))]
    for name in copied:
        shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
    return copied


# --- Runs that start from, or end as, a HuggingFace folder (what the trainers' CLIs share) ----
def check_tokenizer(model_dir: str, tokenizer_path: str, data_flag: str) -> str:
    """Training data must be token ids of the model's own tokenizer, or the model reads other
    words. `prepare --tokenizer` copies the model's tokenizer.model or tokenizer.json byte for
    byte, so a byte comparison decides. Raises on a mismatch; returns a note ("" if none)."""
    shipped = [p for p in (os.path.join(model_dir, n) for n in
                           ("tokenizer.model", "tokenizer.json")) if os.path.isfile(p)]
    if not shipped:
        return (f"note: {model_dir} ships no tokenizer.model or tokenizer.json, so the data's "
                f"tokenizer ({tokenizer_path}) cannot be checked against the model's.")
    if not any(filecmp.cmp(p, tokenizer_path, shallow=False) for p in shipped):
        raise HFError(f"--init-from-hf {model_dir} ships {os.path.basename(shipped[0])}, but the "
                      f"data ({data_flag}) was tokenized with another one ({tokenizer_path}). "
                      "Tokenize it with the model's: python -m common.data prepare --input <text> "
                      f"--tokenizer {shipped[-1]} --out data/x, then --data.path data/x.")
    return ""


def tokenizer(path: str, prefer_json: bool = False) -> tuple[str, int, int]:
    """The folder's own tokenizer file (tokenizer.model, else tokenizer.json; the other way
    round with `prefer_json`, as transformers picks), its end-of-sequence id and the id after
    which a document begins (BOS for Llama; Qwen has none and separates documents with EOS).
    Generation stops at EOS, so a folder without one is refused."""
    from common.data import open_tokenizer
    names = ("tokenizer.json", "tokenizer.model") if prefer_json else (
        "tokenizer.model", "tokenizer.json")
    files = [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]
    if not files:
        raise FileNotFoundError(
            f"--init-from-hf {path} has no tokenizer.model or tokenizer.json; completions are "
            "decoded with the model's own tokenizer. Copy its tokenizer files into the folder.")
    try:  # sentencepiece first: it needs no optional package
        tok = open_tokenizer(files[0])
    except (ValueError, OSError, RuntimeError) as e:
        raise HFError(f"--init-from-hf {path}: cannot read {files[0]} ({e}).") from None
    eos = tok.eos_id()
    if eos < 0:  # tokenizer.json without tokenizer_config.json: config.json may still say
        ids = read_config(path).get("eos_token_id")
        ids = ids if isinstance(ids, list) else [ids]  # instruct models list several
        eos = ids[0] if ids and isinstance(ids[0], int) else -1
    if eos < 0:
        raise HFError(f"--init-from-hf {path}: no end-of-sequence token in its tokenizer files "
                      "or config.json; generation stops at it, so set eos_token in "
                      "tokenizer_config.json or eos_token_id in config.json.")
    return files[0], eos, tok.bos_id() if tok.bos_id() >= 0 else eos

"""Runs and HuggingFace folders: a run's checkpoint on its way out (export-hf, the trainers'
save_hf writes it) and a folder's weights placed on the mesh (the trainers' load_hf); the files
themselves are common/hf.py's."""
import contextlib
import dataclasses
import os
import re
from typing import Literal

import jax
import jax.numpy as jnp

from common import hf
from common.checkpoint import read_checkpoint, read_run_config, run_path
from common.config import ConfigError
from common.data import load_dataset, open_tokenizer, run_tokenizer
from common.lora import LoRAConfig, lora_table, merged, weights
from common.mesh import MeshConfig, make_mesh
from common.train import check_divides, is_entry, join, log, named, table_specs

ExportDtype = Literal["float32", "bfloat16"]
# A trainer's `export_hf(run_dir, out, step, dtype, model_type, max_shard_gb)`: what tyro shows.
EXPORT_HF_DOC = """\
Write a run's checkpoint as a HuggingFace folder (config.json, safetensors, tokenizer).

Args:
    run_dir: The run directory: its config.json and checkpoints/.
    out: The folder to create (new or empty).
    step: The checkpoint to export; -1 = the latest.
    dtype: Of the weights written (checkpoints hold float32).
    model_type: The family; "" = the run's source's, else the one its knobs say.
    max_shard_gb: The largest safetensors file.
"""


@contextlib.contextmanager
def run_config(run_dir: str):
    """export-hf: the run's saved config.json, for the trainer to read its configs from inside
    the block; a key it lacks or one it does not know (KeyError, TypeError) is a ConfigError."""
    saved = read_run_config(run_dir, "--run-dir")
    try:
        yield saved
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{run_path(run_dir, 'config.json')} is not a run config this trainer "
                          f"reads ({e}).") from None


@dataclasses.dataclass
class Export:
    """A run's checkpoint on its way to a HuggingFace folder (see `export`): the trainer's
    save_hf(params, model, out, model_type=..., **hf_args) writes it, `written` reports."""
    run_dir: str
    step: int
    params: dict                # float32, the buffers joined in
    hf_args: dict               # base_config (the source's keys, or the tokenizer's ids), dtype
    tokenizer_dir: str | None   # the folder to copy tokenizer files from
    lora: LoRAConfig | None = None
    adapters: dict | None = None  # a LoRA run's, unmerged (`params` holds them merged)

    def written(self, files: list[str], out: str) -> list[str]:
        """save_hf wrote `files` to `out`: the tokenizer joins them; one line says what."""
        if self.tokenizer_dir:
            files += hf.copy_tokenizer(self.tokenizer_dir, out)
        size = sum(os.path.getsize(os.path.join(out, f)) for f in files)
        print(f"export-hf: step {self.step} of {self.run_dir} -> {out} ({len(files)} files, "
              f"{size / 1e9:.2f} GB, {self.hf_args['dtype']}): {', '.join(files)}", flush=True)
        return files


def export(run_dir: str, step: int, saved: dict, tables: dict, dtype: str, max_shard_gb: float,
           *, tokenizer_run: str = "", data=None, dims: dict | None = None) -> Export:
    """The checkpoint `step` (-1 the latest) of the run whose config.json is `saved`, shaped
    by `tables` ({"params": table[, "buffers": table]}) and read split over every local device
    (fsdp) when the model's sizes allow; what its export keeps: a run started from a
    HuggingFace folder keeps that folder's config keys and tokenizer files, else the tokenizer
    of the run `tokenizer_run` (following its --init-from) or of the data config `data` ships."""
    tables = {k: v for k, v in tables.items() if v}  # no buffers: none saved
    lora = LoRAConfig(**saved.get("lora", {}))
    if lora.rank:  # a LoRA run saved its frozen model and the adapters (`dims`: their axes)
        tables |= {"base": tables["params"], "params": lora_table(tables["params"], dims, lora)}
    mesh = make_mesh(MeshConfig(fsdp=len(jax.devices())))
    try:
        check_divides(tables, mesh, run_dir)
    except ConfigError:
        mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    abstract = jax.tree.map(
        lambda e, sh: jax.ShapeDtypeStruct(e[0], jnp.float32, sharding=sh), tables,
        named(mesh, table_specs(tables)), is_leaf=is_entry)
    state, at = read_checkpoint(run_dir, abstract, f"--run-dir {run_dir} has no checkpoint to "
                                "export.", step)
    src, tok, base, tokenizer_dir = hf_origin(saved), None, {}, None
    # The data may be gone: then the export ships no tokenizer.
    with contextlib.suppress(FileNotFoundError, ValueError, OSError):
        if not src and tokenizer_run:
            tok = run_tokenizer(tokenizer_run)
        elif not src and data is not None:
            tok = load_dataset(data).tokenizer_path
    if src and os.path.isfile(os.path.join(src, hf.CONFIG)):  # its config: token ids, chat
        base, tokenizer_dir = hf.read_config(src), src
    elif tok and os.path.isfile(tok):  # one trained from scratch: its data's tokenizer and ids
        sp = open_tokenizer(tok)
        base = {"bos_token_id": sp.bos_id() if sp.bos_id() >= 0 else None,
                "eos_token_id": sp.eos_id()}
        tokenizer_dir = os.path.dirname(tok)
    return Export(run_dir, at, join(merged(weights(state, lora)), state.get("buffers", {})), dict(
        base_config=base, dtype=dtype, max_shard_bytes=int(max_shard_gb * 2**30)), tokenizer_dir,
        lora, state["params"] if lora.rank else None)


def hf_origin(saved: dict) -> str:
    """The HuggingFace folder a run descends from, through its --init-from runs (an SFT or GRPO
    run of a fine-tune of it), or "": its export keeps that folder's config and tokenizer."""
    seen = set()
    while not saved.get("init_from_hf") and saved.get("init_from") not in (None, "", *seen):
        seen.add(saved["init_from"])
        try:
            saved = read_run_config(saved["init_from"], "--init-from")
        except (FileNotFoundError, ValueError, OSError):  # moved or deleted since
            return ""
    return saved.get("init_from_hf") or ""


def hf_params(ckpt: hf.Checkpoint, mesh, table: dict, mapping: dict, sizes: dict,
              unused=lambda name: False) -> dict:
    """The float32 parameters of an opened HuggingFace folder, placed as the parameter `table`
    says on `mesh` (default the first device); `mapping` and `sizes` are the family's names and
    layouts (common/hf.py), `unused` says which tensors its releases carry that its model
    never reads. Each device reads only its own block."""
    mesh = mesh or make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    check_divides(table, mesh, ckpt.path)
    mt = ckpt.config["model_type"]
    # Some exports keep lm_head.weight although it is tied (so the mapping has none), older ones
    # rotary tables; layers past num_hidden_layers that the mapping does not read are DeepSeek-
    # V3's multi-token-prediction module, which the model we train leaves out (config says 0).
    layer = lambda n: int(m[1]) if (m := re.match(r"model\.layers\.(\d+)\.", n)) else -1
    last = max([layer(n) for t, p in jax.tree.leaves(mapping, is_leaf=hf._is_entry) for _, n in
                hf._file_names(t, hf.parse_layout(p, sizes), sizes)] + [
        ckpt.config["num_hidden_layers"] - 1])
    extra = lambda n: layer(n) > last
    ignore = lambda n: (n == "lm_head.weight" or n.endswith("rotary_emb.inv_freq") or extra(n)
                        or unused(n))
    if ckpt.other_towers:
        log(f"{ckpt.path}: a multimodal folder: its language model is loaded, and not the "
            f"{len(ckpt.other_towers)} tensors of its other towers ({ckpt.other_towers[0]}, ...)")
    if skipped := sorted(n for n in ckpt.names() if extra(n)):
        log(f"{ckpt.path}: {len(skipped)} tensors of layers past num_hidden_layers (a multi-"
            f"token-prediction module) are not loaded, e.g. {skipped[0]}")
    return hf.load(ckpt, mapping, sizes, named(mesh, table_specs(table)),
                   what=f"{mt} model of this config", ignore=ignore)


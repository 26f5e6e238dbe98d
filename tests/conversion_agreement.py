"""Do transformers, megatron-core and vLLM compute the same model from one checkpoint?

    python -m tests.conversion_agreement megatron OUT.json HF_DIR [HF_DIR ...]
        [--layouts 1x1] [--export-root DIR] [--dist-ckpt CKPT]
    torchrun --nproc-per-node 2 -m tests.conversion_agreement megatron ... --layouts 2x1,1x2
    python -m tests.conversion_agreement vllm OUT.json HF_DIR [HF_DIR ...] --sync-root DIR

`megatron`: for each TP x PP layout (each uses the whole gloo world; tied models are skipped at
PP=2 or more, which megatron-core cannot build on CPU) and each folder, the model is built, loaded
from the folder (streaming), and its log-probs of a fixed token sequence are compared with
transformers' (float64 log-softmax of float32 logits). Negative controls differ from the real load
in one property each: `gate_up_swapped` (linear_fc1 = [up; gate]) and `kv_heads_swapped` (the k and
v heads swapped in each group of the fused QKV, i.e. a wrong q/k/v split); both must disagree. With
--export-root the loaded model is exported again and compared with the source tensor by tensor
(values, dtype) and field by field (config.json). With --dist-ckpt the model of the first folder is
also loaded from that megatron-core distributed checkpoint (written at any layout) and compared
with the folder load. `vllm`: the exported or source folder in vLLM (CPU, float32, in-process), its
prompt log-probs of the same sequence against transformers', also after a weight sync (with a
gate/up-swapped control first). Rank 0 writes OUT.json.
Run by tests/test_conversion_megatron.py (one launch per world size: imports cost ~7 s).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def fixed_sequence(vocab_size: int, length: int = 24, seed: int = 1234) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


def hf_logprobs(model_dir: str | Path, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 under transformers (float64 log-softmax)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokens = torch.tensor([ids])
    with torch.no_grad():
        logits = model(tokens).logits.double()
    return torch.log_softmax(logits, -1)[0, :-1].gather(1, tokens[0, 1:, None])[:, 0]


def _max_abs(a, b) -> float:
    return float((torch.as_tensor(a).double() - torch.as_tensor(b).double()).abs().max())


def _megatron_logprobs(chunks, ids: list[int]) -> torch.Tensor:
    from megatron_ba.megatron.grpo_step import compute_logprobs

    lp, _ = compute_logprobs(chunks, torch.tensor([ids]))
    return lp[0, 1:]


def _negative_read(table, spec, ckpt, control: str):
    """The real per-tensor read with one property changed (see the module docstring)."""
    from megatron_ba.conversion import family_table

    def read(name: str) -> torch.Tensor:
        t = family_table.megatron_tensor(table, spec, name, ckpt.get)
        if control == "gate_up_swapped" and name.endswith("mlp.linear_fc1.weight"):
            gate, up = family_table.split_gated(t)
            return family_table.merge_gated(up, gate)
        if control == "kv_heads_swapped" and ".linear_qkv." in name:
            r = spec.num_attention_heads // spec.num_query_groups
            g = t.reshape(spec.num_query_groups, r + 2, spec.head_dim, *t.shape[1:]).clone()
            g[:, [r, r + 1]] = g[:, [r + 1, r]]
            return g.reshape(t.shape)
        return t

    return read


def compare_folders(src: Path, out: Path) -> dict:
    """Tensor-by-tensor (values and dtype) and field-by-field comparison of two HF folders."""
    from megatron_ba.conversion.hf_folder import HFCheckpoint

    a, b = HFCheckpoint(src), HFCheckpoint(out)
    same_keys = set(a.keys()) == set(b.keys())

    def same(k: str) -> bool:
        if k not in b.files:
            return False
        x, y = a.get(k), b.get(k)
        return x.dtype == y.dtype and torch.equal(x, y)

    unequal = [k for k in a.keys() if not same(k)]
    ca, cb = a.config(), b.config()
    config_diff = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
    side = [n for n in ("tokenizer.json", "tokenizer_config.json") if (src / n).is_file()]
    side_equal = all((src / n).read_bytes() == (out / n).read_bytes() for n in side)
    return {
        "same_keys": same_keys,
        "num_tensors": len(a.keys()),
        "unequal_tensors": unequal,
        "config_diff": config_diff,
        "side_files_equal": side_equal and bool(side),
    }


def _check_model(d: Path, spec, ids, ref, layout: str, export_root, dist_ckpt, ctx) -> dict:
    from megatron_ba.conversion import export_chunks_to_hf, load_hf_into_chunks
    from megatron_ba.conversion.dist_checkpoint import load_dist_checkpoint
    from megatron_ba.conversion.families import table_for
    from megatron_ba.conversion.hf_folder import HFCheckpoint
    from megatron_ba.megatron import model as mm
    from megatron_ba.parallel import full_shape

    chunks = mm.build_model_chunks(spec, ddp=False)
    load_hf_into_chunks(chunks, d, spec)
    r = {"megatron_vs_hf_max_abs": _max_abs(_megatron_logprobs(chunks, ids), ref)}
    table, ckpt = table_for(spec), HFCheckpoint(d)
    for control in ("gate_up_swapped", "kv_heads_swapped"):
        wrong = mm.build_model_chunks(spec, ddp=False)
        full_shape.load_full_tensors(wrong, _negative_read(table, spec, ckpt, control))
        r[f"{control}_vs_hf_max_abs"] = _max_abs(_megatron_logprobs(wrong, ids), ref)
        del wrong
    if export_root is not None:
        out = Path(export_root) / f"{d.name}-{layout}"
        export_chunks_to_hf(chunks, spec, out, source_dir=d)
        ctx.barrier()
        if ctx.is_main:
            r["export"] = compare_folders(d, out)
    if dist_ckpt is not None:
        again = mm.build_model_chunks(spec, ddp=False)
        load_dist_checkpoint(again, dist_ckpt)
        a, b = full_shape.gather_full_state_dict(chunks), full_shape.gather_full_state_dict(again)
        r["dist_ckpt_equal"] = set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
        r["dist_ckpt_vs_hf_max_abs"] = _max_abs(_megatron_logprobs(again, ids), ref)
    return r


def run_megatron(
    out_json: str, dirs: list[str], layouts: list[tuple[int, int]], export_root, dist_ckpt
) -> None:
    """Every folder under every (tp, pp) layout, one after the other in this launch (the
    parallel state is rebuilt between layouts). dist_ckpt belongs to the first folder."""
    from megatron.core import parallel_state

    from megatron_ba.conversion import spec_from_hf_dir
    from megatron_ba.megatron.startup import setup, teardown
    from megatron_ba.parallel.parallel_layout import ParallelLayout

    specs = {d: spec_from_hf_dir(d) for d in dirs}
    refs = {}
    results: dict = {"layouts": {}}
    for tp, pp in layouts:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        ctx = setup(ParallelLayout(tp=tp, pp=pp, dp=None), seed=0)
        layout = f"tp{tp}pp{pp}"
        models = results["layouts"].setdefault(layout, {})
        for i, d in enumerate(dirs):
            spec = specs[d]
            if spec.tie_word_embeddings and pp > 1:
                # megatron-core 0.16.1 moves the last stage's embedding copy to .cuda() at build.
                models[Path(d).name] = {"skipped": "tied embeddings need PP=1 on CPU"}
                continue
            ids = fixed_sequence(spec.vocab_size)
            if d not in refs:
                refs[d] = hf_logprobs(d, ids)
            models[Path(d).name] = _check_model(
                Path(d), spec, ids, refs[d], layout, export_root, dist_ckpt if i == 0 else None, ctx
            )
    if ctx.is_main:
        Path(out_json).write_text(json.dumps(results, indent=2))
    teardown()


def run_vllm(out_json: str, dirs: list[str], sync_root: str) -> None:
    """vLLM's prompt log-probs of each folder, then through the weight sync (the trainer's path:
    `hf_named_tensors` of the full megatron state dict into `VLLMEngine.load_weights`), first
    with gate/up swapped (negative control), then with the right weights."""
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "2")
    from megatron_ba.conversion import (
        family_table,
        hf_named_tensors,
        megatron_state_dict_from_hf,
        spec_from_hf_dir,
    )
    from megatron_ba.generation.vllm_engine import VLLMEngine

    results: dict = {"models": {}}
    for d in dirs:
        spec = spec_from_hf_dir(d)
        ids = fixed_sequence(spec.vocab_size)
        ref = hf_logprobs(d, ids)
        full = megatron_state_dict_from_hf(d, spec)
        wrong = {
            k: family_table.merge_gated(*reversed(family_table.split_gated(v)))
            if "linear_fc1" in k
            else v
            for k, v in full.items()
        }
        engine = VLLMEngine(  # weights refit in memory (no sync folder)
            str(d), in_process=True, max_model_len=64, seed=0, kv_cache_gb=1
        )
        try:
            r = {"vllm_vs_hf_max_abs": _max_abs(engine.prompt_logprobs(ids), ref)}
            engine.load_weights(hf_named_tensors(wrong, spec))
            r["synced_gate_up_swapped_vs_hf_max_abs"] = _max_abs(engine.prompt_logprobs(ids), ref)
            engine.load_weights(hf_named_tensors(full, spec))
            r["synced_vs_hf_max_abs"] = _max_abs(engine.prompt_logprobs(ids), ref)
        finally:
            engine.close()
        r["start_seconds"] = engine.start_seconds
        results["models"][Path(d).name] = r
    Path(out_json).write_text(json.dumps(results, indent=2))


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tests.conversion_agreement")
    p.add_argument("what", choices=("megatron", "vllm"))
    p.add_argument("out_json")
    p.add_argument("dirs", nargs="+")
    p.add_argument("--export-root")
    p.add_argument(
        "--layouts",
        default="1x1",
        help="megatron: comma-separated TPxPP layouts, each using the whole world (e.g. 2x1,1x2)",
    )
    p.add_argument("--dist-ckpt")
    p.add_argument("--sync-root", help="vllm: where the weight-sync files go")
    a = p.parse_args(argv)
    if a.what == "megatron":
        layouts = [tuple(int(x) for x in lay.split("x")) for lay in a.layouts.split(",")]
        run_megatron(a.out_json, a.dirs, layouts, a.export_root, a.dist_ckpt)
    else:
        if a.sync_root is None:
            p.error("vllm: --sync-root is required")
        run_vllm(a.out_json, a.dirs, a.sync_root)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

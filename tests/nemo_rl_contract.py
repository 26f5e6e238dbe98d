"""The NeMo-RL facts BalancedPGLossFn and run_grpo_balanced rely on, extracted by `ast` and checked.

NeMo-RL cannot be installed here, so its source is read instead. `extract` parses the few files we
depend on and keeps only signatures, enum values, dict keys, call shapes and one assignment:
a small JSON (tests/fixtures/nemo_rl/contract.json), not NeMo-RL's code. `check` compares such
facts with what our adapter assumes and returns the broken assumptions (empty: the contract holds).

    python -m tests.nemo_rl_contract GIT_DIR COMMIT OUT.json   # re-extract
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

PINNED = {
    "repo": "NVIDIA-NeMo/RL",
    "tag": "v0.7.0",
    "commit": "81aa43dda4765b0429cf31dab44441e4e4383911",
}

INTERFACES = "nemo_rl/algorithms/loss/interfaces.py"
LOSS_FUNCTIONS = "nemo_rl/algorithms/loss/loss_functions.py"
LOSS_UTILS = "nemo_rl/algorithms/loss/utils.py"
WRAPPER = "nemo_rl/algorithms/loss/wrapper.py"
GRPO = "nemo_rl/algorithms/grpo.py"
AUTOMODEL_TRAIN = "nemo_rl/models/automodel/train.py"
RUN_GRPO = "examples/run_grpo.py"
FILES = (INTERFACES, LOSS_FUNCTIONS, LOSS_UTILS, WRAPPER, GRPO, AUTOMODEL_TRAIN, RUN_GRPO)
# The classes / functions whose facts are kept (everything else in those files is dropped).
SELECT = {
    INTERFACES: {"LossFunction", "LossType", "LossInputType"},
    LOSS_FUNCTIONS: {"ClippedPGLossFn"},
    LOSS_UTILS: {"prepare_loss_input"},
    GRPO: {"setup"},
    RUN_GRPO: {"nemo_rl.algorithms.grpo"},
}


def _signature(fn: ast.FunctionDef) -> dict:
    a = fn.args
    return {
        "args": [x.arg for x in a.posonlyargs + a.args],
        "kwonly": [x.arg for x in a.kwonlyargs],
        "vararg": a.vararg.arg if a.vararg else None,
        "kwarg": a.kwarg.arg if a.kwarg else None,
    }


def _call_shape(call: ast.Call) -> dict:
    return {
        "args": [ast.unparse(x) for x in call.args],
        "keywords": [k.arg for k in call.keywords],  # None: a **mapping
    }


def extract_file(text: str) -> dict:
    """Facts of one source file: classes (bases, annotations, enum values, method signatures),
    functions (signature, tuple-return names, string keys of data[...] and of dict literals),
    call shapes of selected callees, selected assignments, from-imports."""
    tree = ast.parse(text)
    facts: dict = {"classes": {}, "functions": {}, "calls": {}, "assigns": {}, "imports": {}}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            cls = {
                "bases": [ast.unparse(b) for b in node.bases],
                "annotations": [],
                "values": {},
                "methods": {},
            }
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    cls["annotations"].append(item.target.id)
                elif isinstance(item, ast.Assign) and isinstance(item.value, ast.Constant):
                    for t in item.targets:
                        if isinstance(t, ast.Name):
                            cls["values"][t.id] = item.value.value
                elif isinstance(item, ast.FunctionDef):
                    cls["methods"][item.name] = _signature(item) | _body_facts(item)
            facts["classes"][node.name] = cls
        elif isinstance(node, ast.FunctionDef):
            facts["functions"][node.name] = _signature(node) | _body_facts(node)
        elif isinstance(node, ast.ImportFrom) and node.module:
            facts["imports"].setdefault(node.module, []).extend(a.name for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = ast.unparse(node.func)
            if callee in ("loss_fn", "self.loss_fn", "policy.train") or callee.endswith(
                ".repeat_interleave"
            ):
                facts["calls"].setdefault(callee, []).append(_call_shape(node))
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = ast.unparse(node.targets[0])
            if target == "loss" and "dp_size" in ast.unparse(node.value):
                facts["assigns"].setdefault(target, []).append(ast.unparse(node.value))
    for calls in facts["calls"].values():
        calls.sort(key=json.dumps)
    return facts


def _body_facts(fn: ast.FunctionDef) -> dict:
    keys, dict_keys, returns = set(), set(), []
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id == "data"
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, str)
        ):
            keys.add(node.slice.value)
        elif isinstance(node, ast.Dict):
            dict_keys.update(
                k.value
                for k in node.keys
                if isinstance(k, ast.Constant) and isinstance(k.value, str)
            )
        elif isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
            returns.append([ast.unparse(e) for e in node.value.elts])
    return {"data_keys": sorted(keys), "dict_keys": sorted(dict_keys), "tuple_returns": returns}


def extract(read) -> dict:
    """{"source": PINNED, "files": {path: facts}} with read(path) -> source text."""
    files = {}
    for path in FILES:
        facts = extract_file(read(path))
        keep = SELECT.get(path, set())
        for section in ("classes", "functions", "imports"):
            facts[section] = {k: v for k, v in facts[section].items() if k in keep}
        if path == LOSS_FUNCTIONS:  # only the method whose data keys we mirror
            cls = facts["classes"].get("ClippedPGLossFn")
            if cls:
                cls["methods"] = {k: v for k, v in cls["methods"].items() if k == "__call__"}
        files[path] = facts
    return {"source": dict(PINNED), "files": files}


def extract_from_git(git_dir: str, commit: str) -> dict:
    def read(path):
        return subprocess.run(
            ["git", "-C", git_dir, "show", f"{commit}:{path}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    out = extract(read)
    out["source"]["commit"] = commit
    return out


# --- what we rely on ----------------------------------------------------------------------------


def _get(facts, *path):
    node = facts
    for p in path:
        if not isinstance(node, dict) or p not in node:
            return None
        node = node[p]
    return node


def check(facts: dict) -> list[str]:
    """Broken assumptions of BalancedPGLossFn / run_grpo_balanced about these facts ([] = holds)."""
    f = facts.get("files", {})
    problems: list[str] = []

    def need(ok, what):
        if not ok:
            problems.append(what)

    proto = _get(f, INTERFACES, "classes", "LossFunction")
    need(
        proto and {"loss_type", "input_type"} <= set(proto["annotations"]),
        "LossFunction: declares loss_type and input_type",
    )
    call = _get(proto or {}, "methods", "__call__")
    need(
        call
        and call["args"][:4] == ["self", "data", "global_valid_seqs", "global_valid_toks"]
        and call["kwarg"] is not None,
        "LossFunction.__call__(self, data, global_valid_seqs, global_valid_toks, **kwargs)",
    )
    need(
        _get(f, INTERFACES, "classes", "LossType", "values", "TOKEN_LEVEL") == "token_level",
        "LossType.TOKEN_LEVEL == 'token_level'",
    )
    need(
        _get(f, INTERFACES, "classes", "LossInputType", "values", "LOGPROB") == "logprob",
        "LossInputType.LOGPROB == 'logprob'",
    )
    need(
        "next_token_logprobs"
        in (_get(f, LOSS_UTILS, "functions", "prepare_loss_input", "dict_keys") or []),
        "prepare_loss_input: passes next_token_logprobs to LOGPROB losses",
    )
    calls = (_get(f, WRAPPER, "calls", "self.loss_fn") or []) + (
        _get(f, WRAPPER, "calls", "loss_fn") or []
    )
    need(
        calls
        and all(
            {"data", "global_valid_seqs", "global_valid_toks"} <= set(c["keywords"])
            for c in calls
            if c["args"] == []
        ),
        "wrapper: calls loss_fn(data=, global_valid_seqs=, global_valid_toks=, **loss_input)",
    )
    used = (
        _get(f, LOSS_FUNCTIONS, "classes", "ClippedPGLossFn", "methods", "__call__", "data_keys")
        or []
    )
    need(
        {"token_mask", "sample_mask", "advantages", "prev_logprobs"} <= set(used),
        "ClippedPGLossFn reads data token_mask, sample_mask, advantages, prev_logprobs",
    )
    need(
        any("dp_size" in a for a in _get(f, AUTOMODEL_TRAIN, "assigns", "loss") or []),
        "automodel train: loss = result * dp_size * cp_size (micro-batch losses are summed)",
    )
    rets = _get(f, GRPO, "functions", "setup", "tuple_returns") or []
    need(
        any(
            len(r) > 10 and r[0] == "policy" and r[6] == "loss_fn" and r[10] == "master_config"
            for r in rets
        ),
        "grpo.setup returns (policy, ..., loss_fn at 6, ..., master_config at 10, ...)",
    )
    need(
        any(
            c["args"][:2] == ["train_data", "loss_fn"]
            for c in _get(f, GRPO, "calls", "policy.train") or []
        ),
        "grpo_train calls policy.train(train_data, loss_fn, ...)",
    )
    need(
        any(
            "num_generations_per_prompt" in " ".join(c["args"])
            for k, cs in (_get(f, GRPO, "calls") or {}).items()
            if k.endswith("repeat_interleave")
            for c in cs
        ),
        "grpo: prompts repeated num_generations_per_prompt times, consecutively",
    )
    need(
        {"setup", "grpo_train"}
        <= set(_get(f, RUN_GRPO, "imports", "nemo_rl.algorithms.grpo") or []),
        "examples/run_grpo.py imports setup and grpo_train from nemo_rl.algorithms.grpo",
    )
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__)
        return 2
    git_dir, commit, out = argv
    facts = extract_from_git(git_dir, commit)
    Path(out).write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
    problems = check(facts)
    print(f"wrote {out}; contract {'holds' if not problems else 'broken: ' + '; '.join(problems)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

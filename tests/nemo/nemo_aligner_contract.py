"""What our NeMo-Aligner subclasses rely on in nemo-aligner 0.7.0, checked on its source text.

The GRPO actor and trainer (actor.py, grpo_trainer.py) subclass NeMo-Aligner's REINFORCE classes,
override some methods and call others. A NeMo-Aligner release that renamed a method, changed a
signature, stopped calling one of our overrides, or stopped reading a config key we ship would
break them silently (an override nobody calls is dead code that still "works"). `check_source`
parses the pure-Python wheel with `ast` (nothing is imported: no GPU stack needed) and returns
one message per broken expectation, naming the file, class, member and what was expected.

Each entry below is one fact about 0.7.0 that our code depends on, with the reason in a comment.
"""

from __future__ import annotations

import ast
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ACTOR_MODULE = "nemo_aligner/models/nlp/gpt/megatron_gpt_reinforce_actor.py"
TRAINER_MODULE = "nemo_aligner/algorithms/reinforce.py"
TRAIN_UTILS = "nemo_aligner/utils/train_utils.py"
PARALLEL_STATE = "nemo_aligner/utils/parallel_state.py"
PPO_UTILS = "nemo_aligner/utils/ppo_utils.py"


@dataclass(frozen=True)
class Method:
    """A function or method that must exist with exactly these leading parameter names."""

    module: str
    qualname: str  # "Class.method" or "function"
    params: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class Bases:
    module: str
    cls: str
    bases: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class Calls:
    """`qualname`'s body calls `self.<callee>(...)` (or `<callee>(...)`) with these keywords."""

    module: str
    qualname: str
    callee: str
    keywords: tuple[str, ...] = ()
    why: str = ""


@dataclass(frozen=True)
class Keys:
    """`qualname`'s body uses these string keys (subscripts or dict literals): batch keys."""

    module: str
    qualname: str
    keys: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class ConfigKeys:
    """`qualname`'s body reads these dotted attribute paths (e.g. "self.cfg.reinforce.x")."""

    module: str
    qualname: str
    paths: tuple[str, ...]
    why: str


@dataclass
class Contract:
    items: list = field(default_factory=list)


A, T = ACTOR_MODULE, TRAINER_MODULE
ACTOR = "MegatronGPTReinforceActorModel"
TRAINER = "ReinforceTrainer"

CONTRACT: tuple = (
    # --- the actor ----------------------------------------------------------------------------
    Bases(
        A,
        ACTOR,
        ("NLPAdapterModelMixin", "MegatronGPTModel", "AlignableGenerativeInterface"),
        "our actor is a MegatronGPTModel (model building, tokenizer, optimizer set-up)",
    ),
    Method(
        A, f"{ACTOR}.__init__", ("self", "cfg", "trainer"), "we call super().__init__(cfg, trainer)"
    ),
    Method(
        A,
        f"{ACTOR}.get_loss_and_metrics",
        ("self", "batch", "forward_only"),
        "we override it; ReinforceTrainer.run_training calls it by these keywords",
    ),
    Method(
        A,
        f"{ACTOR}.get_actor_forward_output_and_loss_func",
        ("self",),
        "we override it (our loss replaces the per-micro-batch REINFORCE mean)",
    ),
    Method(
        A,
        f"{ACTOR}.get_ltor_masks_and_position_ids",
        ("self", "tokens"),
        "we build attention masks and position ids with it, like the parent",
    ),
    Method(A, f"{ACTOR}.prepare_for_training", ("self",), "the trainer calls it before updates"),
    Method(
        A,
        f"{ACTOR}.finish_training_step",
        ("self",),
        "its grad_reductions averages gradients over DP: the DP factor our loss cancels",
    ),
    Method(
        A,
        f"{ACTOR}.get_inference_log_probs",
        ("self", "response_tokens", "forward_micro_batch_size"),
        "our trainer computes the old (rollout-policy) log-probs with it",
    ),
    Method(
        A,
        f"{ACTOR}.get_init_policy_logprobs",
        ("self", "response_tokens"),
        "our trainer's optional KL reads the reference log-probs from it",
    ),
    Method(A, f"{ACTOR}.infer", ("self", "inference_batch"), "our trainer generates with it"),
    Method(A, f"{ACTOR}.prepare_for_inference", ("self",), "called around generation"),
    Method(A, f"{ACTOR}.finish_inference", ("self",), "called around generation"),
    Keys(
        A,
        f"{ACTOR}.infer",
        ("text", "length", "response_tokens", "response_lengths", "prompt_lengths", "is_end"),
        "the prompt batch it reads and the rollout batch it returns (our trainer's inputs)",
    ),
    Calls(
        A,
        f"{ACTOR}.get_loss_and_metrics",
        "get_iterator_k_split",
        why="the parent splits the batch into micro-batches by rows (we keep that layout)",
    ),
    Calls(
        A,
        f"{ACTOR}.get_loss_and_metrics",
        "set_sync_funcs",
        why="our override keeps the parent's sync-function set-up",
    ),
    Calls(
        A,
        f"{ACTOR}.get_loss_and_metrics",
        "fwd_bwd_function",
        (
            "forward_step_func",
            "data_iterator",
            "model",
            "num_microbatches",
            "forward_only",
            "seq_length",
            "micro_batch_size",
        ),
        "the megatron-core schedule call our override makes the same way",
    ),
    Calls(
        A,
        f"{ACTOR}.get_loss_and_metrics",
        "_make_data_iterator_list",
        why="virtual-pipeline-aware data iterators, as the parent uses them",
    ),
    ConfigKeys(
        A,
        f"{ACTOR}.__init__",
        (
            "self.cfg.reinforce.length_params",
            "self.cfg.reinforce.sampling_params",
            "self.cfg.reinforce.offload_adam_states",
            "self.cfg.reinforce.forward_micro_batch_size",
        ),
        "model.reinforce.* keys conf/gpt_grpo_balanced.yaml must provide",
    ),
    ConfigKeys(
        A,
        f"{ACTOR}.prepare_for_training",
        ("self.cfg.micro_batch_size", "self.cfg.global_batch_size"),
        "the micro-batch calculator is configured from these",
    ),
    # --- the trainer --------------------------------------------------------------------------
    Method(
        T,
        f"{TRAINER}.__init__",
        (
            "self",
            "cfg",
            "model",
            "optimizer",
            "scheduler",
            "train_dataloader_builder",
            "val_dataloader_builder",
            "collate_fn",
            "rm",
            "batch_iterator_cls",
            "logger",
            "ckpt_callback",
            "run_timer",
        ),
        "our trainer passes these through super().__init__",
    ),
    Method(
        T,
        f"{TRAINER}.generate_reinforce_data",
        ("self", "rollout_batch"),
        "we override it: group-normalised advantages from explicit group ids",
    ),
    Method(
        T,
        f"{TRAINER}._run_inference",
        ("self", "dataloader_builder", "consumed_samples", "is_validation"),
        "we override it: local rollouts per DP rank, in-process rewards",
    ),
    Method(
        T,
        f"{TRAINER}.run_training",
        ("self", "dataloader_iter"),
        "the parent's update loop we reuse",
    ),
    Method(T, f"{TRAINER}.generate_rollouts", ("self",), "the parent's rollout step we reuse"),
    Method(T, f"{TRAINER}.fit", ("self",), "the parent's outer loop we reuse"),
    Method(T, "compute_num_rollout_microbatches", ("dataloader",), "our _run_inference calls it"),
    Method(
        T,
        "ReinforceRolloutBatch.from_rollout_batches",
        ("cls", "rollout_batches", "eos_id", "rollout_batch_seq_length"),
        "our _run_inference stacks and pads the local rollouts with it",
    ),
    Method(
        T,
        f"{TRAINER}.compute_rollout_metrics",
        ("self", "rollout_batch"),
        "our _run_inference takes the logging table from it",
    ),
    Keys(
        T,
        f"{TRAINER}.compute_rollout_metrics",
        ("table",),
        "the logging table the parent's fit pops",
    ),
    Calls(T, f"{TRAINER}.generate_rollouts", "_run_inference", why="our override must be called"),
    Calls(
        T,
        f"{TRAINER}.generate_rollouts",
        "generate_reinforce_data",
        why="our override must be called",
    ),
    Calls(T, f"{TRAINER}.run_validation", "_run_inference", why="validation uses our rollouts too"),
    Calls(
        T,
        f"{TRAINER}.run_training",
        "get_loss_and_metrics",
        ("batch", "forward_only"),
        "our actor's loss is reached through this call",
    ),
    Calls(
        T,
        f"{TRAINER}.run_training",
        "log_metrics",
        ("step", "prefix"),
        "metrics go to NeMo's logger",
    ),
    Keys(
        T,
        f"{TRAINER}.generate_rollouts",
        ("rollout_size",),
        "the parent counts consumed samples from our rollout metrics' rollout_size",
    ),
    Keys(
        T,
        f"{TRAINER}.fit",
        ("response_tokens", "table"),
        "the parent sizes the update from response_tokens and pops a logging table",
    ),
    Keys(
        T,
        f"{TRAINER}.compute_rollout_metrics",
        ("prompt_lengths", "response_lengths", "response_tokens", "rewards", "is_end"),
        "our rollout batch provides what the parent's rollout metrics read",
    ),
    ConfigKeys(
        T,
        f"{TRAINER}.__init__",
        (
            "self.cfg.initial_policy_kl_penalty",
            "self.cfg.rollout_batch_seq_length",
            "self.cfg.max_epochs",
        ),
        "trainer.reinforce.* keys conf/gpt_grpo_balanced.yaml must provide",
    ),
    ConfigKeys(
        T,
        f"{TRAINER}.fit",
        ("self.cfg.model_gbs", "self.cfg.val_check_interval", "self.cfg.save_interval"),
        "trainer.reinforce.* keys the parent's loop reads",
    ),
    ConfigKeys(
        T,
        f"{TRAINER}._run_inference",
        ("self.cfg.num_rollouts_per_prompt",),
        "the group size G (our override reads the same key)",
    ),
    # --- helpers ------------------------------------------------------------------------------
    Method(TRAIN_UTILS, "set_sync_funcs", ("ptl_model", "forward_only"), "called by our actor"),
    Method(
        TRAIN_UTILS,
        "grad_reductions",
        ("ptl_model",),
        "averages gradients over DP (factor cancelled)",
    ),
    Calls(
        TRAIN_UTILS,
        "grad_reductions",
        "allreduce_gradients",
        why="the plain (no distributed Adam, no O2) path: NeMo's DP mean of the gradients",
    ),
    Method(PARALLEL_STATE, "get_data_parallel_world_size", (), "DP size for sharding and scaling"),
    Method(PARALLEL_STATE, "get_data_parallel_rank", (), "this rank's rollout share"),
    Method(PARALLEL_STATE, "get_pipeline_model_parallel_world_size", (), "PP-safe batch keys"),
    Method(
        PPO_UTILS,
        "create_mask",
        ("values", "prompt_lengths", "response_lengths"),
        "the response mask of log-prob positions, as the parent builds it",
    ),
)


# --- the checker ------------------------------------------------------------------------------


def _find(tree: ast.Module, qualname: str):
    node = tree
    for part in qualname.split("."):
        body = getattr(node, "body", [])
        found = [
            n
            for n in body
            if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and n.name == part
        ]
        if not found:
            return None
        node = found[0]
    return node


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _check(item, tree: ast.Module) -> str | None:
    where = f"{item.module}: "
    if isinstance(item, Bases):
        node = _find(tree, item.cls)
        if not isinstance(node, ast.ClassDef):
            return f"{where}class {item.cls} is missing"
        got = tuple(_dotted(b) or ast.unparse(b) for b in node.bases)
        if got != item.bases:
            return f"{where}class {item.cls} has bases {got}, expected {item.bases} ({item.why})"
        return None
    if "." in item.qualname:  # a method: a missing class is one problem, not one per method
        cls = item.qualname.split(".")[0]
        if not isinstance(_find(tree, cls), ast.ClassDef):
            return f"{where}class {cls} is missing"
    node = _find(tree, item.qualname)
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return f"{where}{item.qualname} is missing ({item.why})"
    if isinstance(item, Method):
        args = node.args
        got = tuple(a.arg for a in (*args.posonlyargs, *args.args))
        if got[: len(item.params)] != item.params or (
            len(got) > len(item.params) and len(args.defaults) < len(got) - len(item.params)
        ):
            return (
                f"{where}{item.qualname} has parameters {got}, expected {item.params} ({item.why})"
            )
        return None
    body = list(ast.walk(node))
    if isinstance(item, Calls):
        calls = [
            n
            for n in body
            if isinstance(n, ast.Call) and (_dotted(n.func) or "").split(".")[-1] == item.callee
        ]
        if not calls:
            return f"{where}{item.qualname} no longer calls {item.callee}(...) ({item.why})"
        for call in calls:
            if set(item.keywords) <= {k.arg for k in call.keywords}:
                return None
        return (
            f"{where}{item.qualname} calls {item.callee} without the keywords "
            f"{item.keywords} ({item.why})"
        )
    if isinstance(item, Keys):
        strings = {
            n.value for n in body if isinstance(n, ast.Constant) and isinstance(n.value, str)
        }
        missing = [k for k in item.keys if k not in strings]
        if missing:
            return f"{where}{item.qualname} no longer uses the keys {missing} ({item.why})"
        return None
    if isinstance(item, ConfigKeys):
        seen = {_dotted(n) for n in body if isinstance(n, ast.Attribute)}
        # cfg.get("x") counts as reading cfg.x
        for n in body:
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "get"
            ):
                base = _dotted(n.func.value)
                if base and n.args and isinstance(n.args[0], ast.Constant):
                    seen.add(f"{base}.{n.args[0].value}")
        missing = [p for p in item.paths if p not in seen]
        if missing:
            return f"{where}{item.qualname} no longer reads {missing} ({item.why})"
        return None
    raise TypeError(f"unknown contract item {item!r}")


def read_sources(wheel_or_dir: str | Path) -> dict[str, str]:
    """{path inside the package: source} of every module the contract names."""
    wanted = {item.module for item in CONTRACT}
    src = Path(wheel_or_dir)
    out: dict[str, str] = {}
    if src.is_dir():
        for name in wanted:
            p = src / name
            if p.is_file():
                out[name] = p.read_text()
        return out
    with zipfile.ZipFile(src) as zf:
        names = set(zf.namelist())
        for name in wanted:
            if name in names:
                out[name] = zf.read(name).decode()
    return out


def check_source(sources: dict[str, str], contract=CONTRACT) -> list[str]:
    """One message per expectation of `contract` that `sources` break (empty: all hold)."""
    problems: list[str] = []
    trees: dict[str, ast.Module] = {}
    for item in contract:
        if item.module not in sources:
            problems.append(f"{item.module}: file is missing from the package")
            continue
        if item.module not in trees:
            trees[item.module] = ast.parse(sources[item.module], filename=item.module)
        msg = _check(item, trees[item.module])
        if msg:
            problems.append(msg)
    return sorted(set(problems), key=problems.index)

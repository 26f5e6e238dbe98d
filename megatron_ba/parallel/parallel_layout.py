"""The parallel layout of a run: how its ranks split the model and the batch. One type, checked
once, passed whole (the trainer's start-up, the process groups, the model build, the planner, the
launcher, the layout check, checkpoints, the engine translations).

    layout = ParallelLayout(tp=2, pp=1, cp=1, dp=4, ep=2, etp=1, sequence_parallel=True)
    layout = ParallelLayout(tp=2).for_world(8)      # dp: what the world leaves (here 4)
    layout.check_model(shape)                       # the model's sizes against the splits
    layout.check_training(shape)                    # ... and what training on it needs
    ParallelLayout(pp=2, pp_first_stage_layers=2).stage_layers(5)   # (2, 3): uneven stages
    ParallelLayout.from_dict(meta["layout"])        # a checkpoint's record (layout.to_dict())

The world is tp x pp x cp x dp ranks (megatron-core's order tp-cp-ep-dp-pp). Expert parallelism
(mixture-of-experts models) is carved out of the ranks of one pipeline stage: the experts' grid is
etp x ep x expert-DP x pp over the same ranks (parallel_state.initialize_model_parallel), so
etp x ep must divide tp x cp x dp. etp None is megatron-core's default, tp.

Pipeline stages hold num_layers / pp layers each, or, with `pp_first_stage_layers` and / or
`pp_last_stage_layers` (megatron-core's num_layers_in_first_pipeline_stage /
num_layers_in_last_pipeline_stage), those on the first / last stage and the rest split evenly over
the stages between (`stage_layers`): a layer count pp does not divide, or lighter first and last
stages for the embedding and the output layer they also hold.

Every rule is here, once. A broken one raises LayoutError (a SettingError) naming the field; a
caller whose users spell it otherwise renames it: a recipe's `parallel.ep` (RECIPE_KEYS), a
command's `--ep` (FLAGS). `dp` is None until the world is known (a recipe before its launch):
the rules that need it wait for `for_world`. Pure Python: the recipe loader and the planner read
it without torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from megatron_ba.errors import SettingError

FIELDS = (
    *("tp", "pp", "cp", "dp", "ep", "etp", "sequence_parallel"),
    *("pp_first_stage_layers", "pp_last_stage_layers"),
)
# How users name the fields (and the micro-batching key a layout rule involves): a recipe's
# keys and the commands' flags.
RECIPE_KEYS = {name: f"parallel.{name}" for name in (*FIELDS, "max_tokens_per_microbatch")}
RECIPE_KEYS["world"] = "parallel"
FLAGS = {name: "--" + name.replace("_", "-") for name in FIELDS}
FLAGS["max_tokens_per_microbatch"] = "--token-budget"


UNEVEN = ("pp_first_stage_layers", "pp_last_stage_layers")


def balanced_stages(num_layers: int, pp: int) -> dict[str, int]:
    """The uneven-stage fields that split `num_layers` over `pp` stages as evenly as
    megatron-core allows ({} when pp divides them): the stages between the first and last hold
    ceil(num_layers / pp) each (or fewer, down to one, until at least one layer is left for
    each end), the first and last share what is left, the first taking the smaller half (it also
    holds the embedding, the last the output layer). LayoutError (key "pp") when pp exceeds the
    layers."""
    if pp > num_layers:
        raise LayoutError("pp", f"{pp} stages are more than the num_layers={num_layers}")
    if num_layers % pp == 0:
        return {}
    middle = -(-num_layers // pp)
    while num_layers - (pp - 2) * middle < 2:
        middle -= 1
    ends = num_layers - (pp - 2) * middle
    return {"pp_first_stage_layers": ends // 2, "pp_last_stage_layers": ends - ends // 2}


class LayoutError(SettingError):
    """A layout megatron-core cannot build: `key` names the field at fault (FIELDS, or "world"
    for a world size the model-parallel ranks do not divide)."""


def _positive(name: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = " or null" if optional else ""
        raise LayoutError(name, f"must be an integer >= 1{extra}, got {value!r}")


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int | None = 1  # None: not known until the world is (for_world)
    ep: int = 1  # expert parallelism, carved out of DP x CP
    etp: int | None = None  # expert tensor parallelism; None: megatron-core's default, tp
    # megatron-core's sequence parallelism: the sequence split over the TP ranks outside the
    # attention and MLP (norms, dropout; MoE routing)
    sequence_parallel: bool = False
    # uneven pipeline stages: the first / last stage's layers (None: an even share)
    pp_first_stage_layers: int | None = None
    pp_last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            _positive(name, getattr(self, name))
        for name in ("dp", "etp", *UNEVEN):
            _positive(name, getattr(self, name), optional=True)
        for name in UNEVEN:
            if getattr(self, name) is not None and self.pp < 2:
                raise LayoutError(name, f"needs pp >= 2 (a pipeline to split), got pp={self.pp}")
        if not isinstance(self.sequence_parallel, bool):
            raise LayoutError(
                "sequence_parallel", f"must be true or false, got {self.sequence_parallel!r}"
            )
        if self.sequence_parallel and self.tp < 2:
            raise LayoutError(
                "sequence_parallel",
                f"needs tp > 1 (it splits the sequence over the tensor-parallel ranks), "
                f"got tp={self.tp}",
            )
        if self.dp is not None and self.stage_ranks % (self.expert_tp * self.ep):
            # the field at fault: an explicit etp where ep alone would divide the ranks
            at_fault = "etp" if self.etp is not None and not self.stage_ranks % self.ep else "ep"
            raise LayoutError(
                at_fault,
                f"etp*ep = {self.expert_tp * self.ep} does not divide the {self.stage_ranks} "
                "ranks of a pipeline stage (tp*cp*dp); megatron-core carves expert parallelism "
                "out of them",
            )

    # -- sizes ------------------------------------------------------------------------------
    @property
    def model_parallel(self) -> int:
        """tp x pp x cp: the ranks of one model replica."""
        return self.tp * self.pp * self.cp

    @property
    def world(self) -> int:
        return self.model_parallel * self._dp("world")

    @property
    def stage_ranks(self) -> int:
        """tp x cp x dp: the ranks of one pipeline stage (expert parallelism's pool)."""
        return self.tp * self.cp * self._dp("stage_ranks")

    @property
    def expert_tp(self) -> int:
        """The experts' tensor parallelism: etp, or megatron-core's default tp."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """The ranks holding the same experts' shards (the experts' data-parallel group)."""
        return self.stage_ranks // (self.expert_tp * self.ep)

    @property
    def has_experts(self) -> bool:
        """Whether the layout splits experts (ep > 1 or an explicit etp)."""
        return self.ep != 1 or self.etp is not None

    def _dp(self, what: str) -> int:
        if self.dp is None:
            raise ValueError(f"{what}: unknown until the world size is (ParallelLayout.for_world)")
        return self.dp

    # -- the world and the model ------------------------------------------------------------
    def for_world(self, world_size: int) -> ParallelLayout:
        """This layout on `world_size` ranks: dp is what tp x pp x cp leaves (a dp already set
        must be that)."""
        if world_size % self.model_parallel:
            raise LayoutError(
                "world",
                f"the world size {world_size} is not a multiple of tp*pp*cp = "
                f"{self.tp}*{self.pp}*{self.cp} = {self.model_parallel}",
            )
        dp = world_size // self.model_parallel
        if self.dp is not None and self.dp != dp:
            raise LayoutError(
                "dp", f"{self.dp}, but the world of {world_size} ranks leaves dp = {dp}"
            )
        return replace(self, dp=dp)

    @property
    def uneven_stages(self) -> bool:
        """Whether the first or last stage's layers are given (module docstring)."""
        return self.pp_first_stage_layers is not None or self.pp_last_stage_layers is not None

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers of each pipeline stage, first to last; LayoutError naming the field when
        `num_layers` does not split so (megatron-core's rules: every stage at least one layer,
        the stages between the first and last an equal share)."""
        first, last = self.pp_first_stage_layers, self.pp_last_stage_layers
        if not self.uneven_stages:
            if num_layers % self.pp:
                raise LayoutError(
                    "pp",
                    f"num_layers={num_layers} is not a multiple of pp={self.pp} (uneven stages: "
                    "give the first and / or last stage's layers)",
                )
            return (num_layers // self.pp,) * self.pp
        given = {name: getattr(self, name) for name in UNEVEN if getattr(self, name) is not None}
        others, rest = self.pp - len(given), num_layers - sum(given.values())
        at_fault = list(given)[-1]
        said = " + ".join(f"{n} (the {name.split('_')[1]} stage's)" for name, n in given.items())
        if others == 0 and rest != 0:
            raise LayoutError(
                at_fault, f"{said} layers are not the model's num_layers={num_layers}"
            )
        if rest < others or (others and rest % others):
            raise LayoutError(
                at_fault,
                f"num_layers={num_layers} less {said} leaves {rest} layer(s) for the {others} "
                "other stage(s): they need an equal share of at least one each",
            )
        counts = [rest // others if others else 0] * self.pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return tuple(counts)

    def layer_offset(self, num_layers: int, stage: int) -> int:
        """The global index of pipeline `stage`'s first layer."""
        return sum(self.stage_layers(num_layers)[:stage])

    def check_model(self, model) -> None:
        """LayoutError naming the field when `model`'s sizes do not split this way. `model`:
        anything with a ModelShape's size fields (megatron_ba.model_shape; a size that is None
        is not known yet and not checked)."""
        size = {
            key: getattr(model, key, None)
            for key in (
                *("num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size"),
                *("num_layers", "num_experts", "moe_ffn_hidden_size"),
            )
        }
        self._check_tensor_split(size)
        if getattr(model, "has_linear_attention", False):
            self._check_linear_attention(model)
        layers = size["num_layers"]
        if layers is not None:
            self.stage_layers(layers)
        self._check_experts(size)

    def _check_tensor_split(self, size: dict) -> None:
        """TP splits the heads, the MLP and the vocabulary. The KV heads (num_query_groups) may
        also be fewer than tp when tp is a multiple of them, as megatron-core allows (its
        TransformerConfig: "a multiple or divisor"): every rank then all-gathers the fused QKV
        and keeps its group's one KV head beside its share of the query heads
        (transformer/attention.py, get_query_key_value_tensors)."""
        keys = ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size")
        problems = [
            f"{key}={size[key]} is not a multiple of tp={self.tp}"
            + (" (nor a divisor)" if key == "num_query_groups" else "")
            for key in keys
            if size[key] is not None
            and size[key] % self.tp
            and not (key == "num_query_groups" and self.tp % size[key] == 0)
        ]
        if problems:
            raise LayoutError("tp", "; ".join(problems))

    _LINEAR_HEADS = ("linear_num_key_heads", "linear_num_value_heads")

    def _check_linear_attention(self, model) -> None:
        """Gated DeltaNet layers (Qwen3.5): TP and CP split their key and value heads.
        megatron-core 0.19.2 (the GPU stack's pin, requirements/gpu.txt) asks both head counts
        to be multiples of tp * cp (TransformerConfig's gated_delta_net check), its CP being
        all-to-alls from sequence shards to head shards and back (ssm/gated_delta_net/
        common.py). 0.16.1, the CPU stack's, has no CP for these layers, but on CPU the model
        sees whole sequences and CP is the loss's (cp_mode "loss"), so nothing there needs it."""
        split = self.tp * self.cp
        problems = [
            f"{key}={getattr(model, key)} is not a multiple of "
            + (f"tp={self.tp}" if self.cp == 1 else f"tp*cp={self.tp}*{self.cp}")
            for key in self._LINEAR_HEADS
            if getattr(model, key) % split
        ]
        if problems:
            # the flag to change: tp where tp alone does not divide the heads, else cp
            tp_alone = any(getattr(model, key) % self.tp for key in self._LINEAR_HEADS)
            raise LayoutError("tp" if self.cp == 1 or tp_alone else "cp", "; ".join(problems))

    def _check_experts(self, size: dict) -> None:
        experts = size["num_experts"] or 0
        if not experts:
            if self.has_experts:
                key = "ep" if self.ep != 1 else "etp"
                raise LayoutError(key, "needs a mixture-of-experts model; this one is dense")
            return
        if experts % self.ep:
            raise LayoutError("ep", f"{self.ep} does not divide the {experts} experts")
        ffn = size["moe_ffn_hidden_size"]
        if ffn is not None and ffn % self.expert_tp:
            raise LayoutError("etp", f"{self.expert_tp} does not divide moe_ffn_hidden_size={ffn}")

    def check_training(self, model) -> None:
        """check_model, and what training on the layout needs besides: a mixture of experts at
        tp > 1 trains only with sequence parallelism. Without it every TP rank holds the same
        tokens and the MoE layer routes each of them once per TP rank: the experts' gradients
        come out TP times too large (measured: exactly 2x at TP2 x EP2, ETP 2 or 1; the forward
        is right, so converting or evaluating such a layout is fine)."""
        self.check_model(model)
        if getattr(model, "num_experts", 0) and self.tp > 1 and not self.sequence_parallel:
            raise LayoutError(
                "tp",
                f"{self.tp} with a mixture-of-experts model needs sequence parallelism "
                "(megatron-core's MoE layer): turn it on, or use tp=1 (expert TP, etp, is "
                "allowed)",
            )

    def check_micro_batching(self, *, token_budget: bool) -> None:
        """LayoutError when token-budget micro-batches meet expert parallelism: the experts'
        token exchange is a collective per micro-batch over EP ranks on different DP ranks, whose
        micro-batches must then agree in number and tokens; a token budget cuts each rank's by
        its own sequences' lengths."""
        if token_budget and self.ep > 1:
            raise LayoutError(
                "max_tokens_per_microbatch",
                f"token-budget micro-batches differ between the DP ranks that ep={self.ep} "
                "exchanges tokens between at every micro-batch; use a fixed micro-batch size",
            )

    # -- records ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The layout as a checkpoint records it: tp, pp, cp, dp, then ep and etp only when the
        layout splits experts, sequence_parallel only when on and the uneven stages' layers only
        when given (a record of a run without them reads as one written before they existed)."""
        out = {k: getattr(self, k) for k in ("tp", "pp", "cp", "dp")}
        if self.has_experts:
            out.update(ep=self.ep, etp=self.etp)
        if self.sequence_parallel:
            out["sequence_parallel"] = True
        out.update({k: getattr(self, k) for k in UNEVEN if getattr(self, k) is not None})
        return out

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> ParallelLayout:
        """The layout of a record (to_dict's, or any older subset of FIELDS)."""
        unknown = set(record) - set(FIELDS)
        if unknown:
            raise LayoutError(sorted(unknown)[0], f"not a layout field (known: {FIELDS})")
        return cls(**record)

    def fields(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        sp = "+SP" if self.sequence_parallel else ""
        dp = "?" if self.dp is None else self.dp
        split = ", ".join(
            f"{name.split('_')[1]} {getattr(self, name)}" for name in UNEVEN if getattr(self, name)
        )
        split = f"({split})" if split else ""
        out = f"TP{self.tp}{sp}xPP{self.pp}{split}xCP{self.cp}xDP{dp}"
        if self.has_experts:
            out += f" EP{self.ep}" + (f" ETP{self.etp}" if self.etp is not None else "")
        return out

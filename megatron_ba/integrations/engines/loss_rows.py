"""The engines' table: the GRPO step and its loss (`grpo.*`, `loss.*`).

verl runs the balanced rules as this project's estimator + policy-loss pairs (integrations/verl/
adapter.py registers PLAN_RULES in verl's registries) and token / sequence as its own `grpo`
with a loss_agg_mode; NeMo-RL runs every rule through BalancedPGLossFn (`loss_fn.ba_*`);
NeMo-Aligner through this project's actor (`model.grpo.*`).
"""

from __future__ import annotations

from megatron_ba.integrations.engines.cells import Absent, Dropped, Need, Put, Row, Set, put
from megatron_ba.integrations.engines.data_rows import data_parallel
from megatron_ba.integrations.engines.model_rows import A

# The rules verl runs as this project's estimator + policy-loss pairs: the plan rules verl cannot
# express (per group and sign), and the per-group token mean (verl's token-mean pools the
# mini-batch). The others verl translates run as its own `grpo` estimator.
PLAN_RULES = ("balanced", "balanced_mass", "group_token_mean")
# recipe `loss.dual_clip: null` (no dual clip): verl's losses always apply clip_ratio_c; at this
# bound -c A never binds (a ratio above 1e9 would be needed)
NO_DUAL_CLIP = 1.0e9
CORRECTION = "the local backend's rollout correction"
REG_BY_AGG = "verl aggregates KL and entropy by loss_agg_mode (token-mean: token, batch)"
REG_KEPT = "BalancedPGLossFn keeps NeMo-RL's KL term: a token mean over the batch"


def step_sequences(job) -> int:
    """Sequences per optimizer step over all data-parallel ranks."""
    g = job.grpo
    return g.prompts_per_step * g.group_size // g.mini_batches


def _plan(job) -> bool:
    return job.loss.rule in PLAN_RULES


def _sample_std_note(who_divides: str):
    """The note on grpo.std: population (the engine divides by the sample std)."""

    def note(job) -> str | None:
        g = job.grpo
        if not (g.normalize_std and g.std == "population"):
            return None
        factor = (g.group_size / (g.group_size - 1)) ** 0.5
        return (
            f"grpo.std: population; {who_divides} by the sample std, so every advantage is "
            f"{factor:.4f} times the recipe's "
            f"(sqrt(G/(G-1)), G={g.group_size}); grpo.std=sample is exact"
        )

    return note


def _no_correction(backend: str) -> Need:
    """The rollout correction is the local backend's: an engine's own is its own setting."""
    return Need(
        lambda j: j.loss.rollout_correction.mode == "none",
        f"the local backend's (the {backend} backend has none); use none",
    )


ROWS: dict[str, Row] = {
    "grpo.steps": Row(
        put("trainer.total_training_steps"),
        Put(
            (Set("grpo.max_num_steps"), Set("grpo.max_num_epochs")),
            doc="grpo.max_num_steps (grpo.max_num_epochs = the same: the steps bound binds)",
        ),
        put("trainer.reinforce.max_steps"),
    ),
    "grpo.prompts_per_step": Row(
        put("data.train_batch_size"),
        put("grpo.num_prompts_per_step"),
        put(
            "model.reinforce.num_rollout_samples",
            Set(
                "model.reinforce.rollout_micro_batch_size",
                lambda j: j.grpo.prompts_per_step // data_parallel(j),
                note="a DP rank's prompts: one generate call",
            ),
            need=Need(
                lambda j: j.grpo.prompts_per_step % data_parallel(j) == 0,
                lambda j: (
                    f"{j.grpo.prompts_per_step} prompts do not split over "
                    f"{data_parallel(j)} data-parallel ranks (each rank generates and trains "
                    "on its own prompts)"
                ),
            ),
        ),
    ),
    "grpo.group_size": Row(
        put("actor_rollout_ref.rollout.n"),
        put("grpo.num_generations_per_prompt"),
        put("trainer.reinforce.num_rollouts_per_prompt"),
    ),
    "grpo.max_new_tokens": Row(
        put("data.max_response_length"),
        put("policy.generation.max_new_tokens"),
        put("model.reinforce.length_params.max_length"),
    ),
    "grpo.temperature": Row(
        put("actor_rollout_ref.rollout.temperature"),
        put("policy.generation.temperature"),
        put("model.reinforce.sampling_params.temperature"),
    ),
    "grpo.mini_batches": Row(
        Put(
            (
                Set(
                    f"{A}.ppo_mini_batch_size",
                    lambda j: j.grpo.prompts_per_step // j.grpo.mini_batches,
                ),
                Set(f"{A}.ppo_epochs", 1),
            ),
            doc=f"{A}.ppo_mini_batch_size = prompts_per_step / mini_batches, {A}.ppo_epochs=1",
        ),
        Put(
            (Set("policy.train_global_batch_size", step_sequences),),
            doc="policy.train_global_batch_size = prompts_per_step x group_size / mini_batches "
            "(NeMo-RL cuts the rollout batch into consecutive steps of whole groups; "
            "BalancedPGLossFn plans each step)",
        ),
        put(
            Set("model.global_batch_size", step_sequences),
            Set("trainer.reinforce.model_gbs", step_sequences),
            note="sequences per optimizer step, prompts_per_step x group_size / mini_batches",
        ),
    ),
    "grpo.normalize_std": Row(
        put("algorithm.norm_adv_by_std_in_grpo"),
        put("grpo.normalize_rewards", Set("grpo.use_leave_one_out_baseline", False)),
        put("model.grpo.normalize_std"),
    ),
    "grpo.std": Row(
        Put(
            approx=_sample_std_note("verl's estimators divide"),
            doc="verl's estimators divide by the sample std: sample is exact, population (the "
            "default) becomes sample (every advantage x sqrt(G/(G-1)))",
        ),
        Put(
            approx=_sample_std_note("NeMo-RL divides"),
            doc="NeMo-RL divides by the sample std: sample is exact, population (the default) "
            "becomes sample (every advantage x sqrt(G/(G-1)))",
        ),
        put("model.grpo.std"),
    ),
    "grpo.drop_zero_variance": Row(
        Absent("verl's GRPO has no such option"),
        Absent("NeMo-RL's GRPO keeps every group in the batch"),
        put("model.grpo.drop_zero_variance"),
    ),
    "grpo.dynamic_sampling": Row(
        Absent("verl's filter_groups belongs to its DAPO recipe, not to main_ppo"),
        Absent(
            "NeMo-RL's use_dynamic_sampling assembles a batch from several generation "
            "rounds; not checked with BalancedPGLossFn's plan here"
        ),
        Dropped("NeMo-Aligner's loop generates one round per step (no dynamic sampling here yet)"),
    ),
    "grpo.max_sampling_rounds": Row(
        Absent("dynamic sampling's (not available under verl)"),
        Absent("dynamic sampling's (not translated for NeMo-RL)"),
        Dropped("dynamic sampling's (not translated)"),
    ),
    "loss.rule": Row(
        Put(
            (
                Set("algorithm.adv_estimator", lambda j: j.loss.rule if _plan(j) else "grpo"),
                Set(f"{A}.policy_loss.loss_mode", lambda j: j.loss.rule if _plan(j) else "vanilla"),
                Set(
                    f"{A}.loss_agg_mode",
                    lambda j: "seq-mean-token-mean" if j.loss.rule == "sequence" else "token-mean",
                ),
            ),
            (
                Need(
                    lambda j: j.loss.rule in (*PLAN_RULES, "token", "sequence"),
                    lambda j: (
                        f"{j.loss.rule!r} is not translated for verl (balanced, "
                        "balanced_mass, group_token_mean, token, sequence are)"
                    ),
                ),
            ),
            doc="balanced / balanced_mass / group_token_mean: algorithm.adv_estimator and "
            f"{A}.policy_loss.loss_mode = the rule; token: grpo + vanilla + {A}.loss_agg_mode "
            "token-mean; sequence: grpo + vanilla + seq-mean-token-mean; dr_grpo refused",
        ),
        put("++loss_fn.ba_rule", note="BalancedPGLossFn"),
        put("model.grpo.rule"),
    ),
    "loss.scope": Row(
        Put(
            needs=(
                Need(
                    lambda j: _plan(j) or j.loss.scope == "batch",
                    lambda j: (
                        f"verl's {j.loss.rule} aggregation (loss_agg_mode) pools the "
                        "batch: set loss.scope=batch, or loss.rule=group_token_mean for a "
                        "per-group token mean"
                    ),
                ),
            ),
            env=(Set("MEGATRON_BA_SCOPE", when=lambda j: _plan(j) and j.loss.scope != "group"),),
            doc="the balanced rules: MEGATRON_BA_SCOPE (set by the command when batch); "
            "token / sequence: batch only (verl pools the batch)",
        ),
        put("++loss_fn.ba_scope"),
        put("model.grpo.scope"),
    ),
    # Written as attribute reads (not the row's value by its dotted name): the local trainer
    # hands these sections on whole, so these are the code's named reads of the keys
    # (tests/test_recipe.py finds them statically).
    "loss.reg_rule": Row(
        Absent(REG_BY_AGG),
        Absent(REG_KEPT),
        put(Set("model.grpo.reg_rule", lambda j: j.loss.reg_rule)),
    ),
    "loss.reg_scope": Row(
        Absent(REG_BY_AGG),
        Absent(REG_KEPT),
        put(Set("model.grpo.reg_scope", lambda j: j.loss.reg_scope)),
    ),
    "loss.max_length": Row(
        Absent("dr_grpo's constant (dr_grpo is not translated)"),
        put(
            Set(
                "++loss_fn.ba_max_length",
                lambda j: j.loss.max_length or j.grpo.max_new_tokens,
                when=lambda j: j.loss.rule == "dr_grpo",
            ),
            note="dr_grpo; default grpo.max_new_tokens",
        ),
        put(
            Set(
                "model.grpo.max_length",
                lambda j: j.grpo.max_new_tokens if j.loss.max_length is None else j.loss.max_length,
            ),
            note="default grpo.max_new_tokens",
        ),
    ),
    "loss.neutral_eps": Row(
        Put(
            needs=(
                Need(
                    lambda j: _plan(j) or j.loss.neutral_eps == 0, "the balanced rules' only; use 0"
                ),
            ),
            env=(
                Set(
                    "MEGATRON_BA_NEUTRAL_EPS",
                    lambda j: str(j.loss.neutral_eps),
                    when=lambda j: _plan(j) and j.loss.neutral_eps != 0,
                ),
            ),
            doc="MEGATRON_BA_NEUTRAL_EPS (the balanced rules; set when not 0)",
        ),
        put("++loss_fn.ba_neutral_eps"),
        put("model.grpo.neutral_eps"),
    ),
    # Written as attribute reads (not the row's value by its dotted name): the local trainer
    # hands these sections on whole, so these are the code's named reads of the keys
    # (tests/test_recipe.py finds them statically).
    "loss.clip_low": Row(
        put(Set(f"{A}.clip_ratio_low", lambda j: j.loss.clip_low)),
        put(Set("loss_fn.ratio_clip_min", lambda j: j.loss.clip_low)),
        put(Set("model.grpo.clip_low", lambda j: j.loss.clip_low)),
    ),
    "loss.clip_high": Row(
        put(Set(f"{A}.clip_ratio_high", lambda j: j.loss.clip_high)),
        put(Set("loss_fn.ratio_clip_max", lambda j: j.loss.clip_high)),
        put(Set("model.grpo.clip_high", lambda j: j.loss.clip_high)),
    ),
    "loss.dual_clip": Row(
        put(
            Set(
                f"{A}.clip_ratio_c",
                lambda j: NO_DUAL_CLIP if j.loss.dual_clip is None else j.loss.dual_clip,
            ),
            note="null: 1e9, a bound that never binds",
        ),
        put("loss_fn.ratio_clip_c", note="null: none"),
        put("model.grpo.dual_clip"),
    ),
    "loss.kl_coef": Row(
        put(
            Set(f"{A}.use_kl_loss", lambda j: j.loss.kl_coef > 0),
            f"{A}.kl_loss_coef",
            Set(f"{A}.kl_loss_type", "k3"),
            Set("algorithm.use_kl_in_reward", False),
        ),
        put("loss_fn.reference_policy_kl_penalty", note="NeMo-RL's k3, its clamps 20 / 10"),
        put("model.grpo.kl_coef"),
    ),
    "loss.entropy_coef": Row(
        put(f"{A}.entropy_coeff"),
        Absent("NeMo-RL's ClippedPGLossFn has no entropy bonus"),
        Absent(
            "the NeMo-Aligner GRPO actor has no entropy bonus",
            said=lambda j: (
                "loss.entropy_coef: the NeMo-Aligner GRPO actor has no entropy bonus (use 0)"
            ),
        ),
    ),
    "loss.rollout_correction.mode": Row(
        Put(needs=(_no_correction("verl"),), doc="none only"),
        Put(needs=(_no_correction("nemo_rl"),), doc="none only"),
        Put(needs=(_no_correction("nemo_aligner"),), doc="none only"),
    ),
    **{
        f"loss.rollout_correction.{k}": Row(
            Absent(CORRECTION), Absent(CORRECTION), Dropped(f"{CORRECTION} (its mode is none here)")
        )
        for k in ("cap", "low", "high")
    },
}

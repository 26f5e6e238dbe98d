"""run_grpo_balanced against NeMo-RL's own GRPO: `grpo_train`, `MasterConfig`, the stock yaml.

- One real `grpo_train` step (NeMo-RL's own test fixture `mock_grpo_components`: its mocked
  generation, environment, logger and data loader) with BalancedPGLossFn installed the way
  run_grpo_balanced installs it (`balanced_setup`), and a policy whose `train` is NeMo-RL's own
  training step on a small model (worker_loop.py): the plan reaches the step with GRPO's group
  layout, and every metric grpo_train reads is there.
- `balanced_setup` and `check_master_config` on the `MasterConfig` that examples/run_grpo.py builds
  from NeMo-RL's stock examples/configs/grpo_math_1B.yaml with the documented overrides.
- The documented command, as docs/integrations.md writes it, gets past configuration.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from unittest.mock import MagicMock

import pytest

pytest.importorskip(
    "nemo_rl.algorithms.loss", reason="NeMo-RL is not installed: bash scripts/run_nemorl_tests.sh"
)

import torch
from conftest import nemo_rl_root
from nemo_rl.algorithms.grpo import _default_grpo_save_state, grpo_train
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from reference import plan_weights
from tests.unit.algorithms.test_grpo import (  # noqa: F401  (NeMo-RL's own fixture)
    _mock_policy_generation,
    mock_grpo_components,
)
from torchdata.stateful_dataloader import StatefulDataLoader
from worker_loop import TokenModel, policy_config, policy_train

from megatron_ba.integrations.nemo_rl import BalancedPGLossFn
from megatron_ba.integrations.nemo_rl.run_grpo_balanced import (
    SETUP_LOSS_FN,
    SETUP_MASTER_CONFIG,
    SETUP_POLICY,
    balanced_setup,
)

REPO = Path(__file__).resolve().parents[2]
G, PROMPTS, VOCAB = 4, 3, 17
# Rewards per response (prompt-major, as GRPO repeats prompts): a lone correct answer, a lone
# wrong one, and a group that is all wrong (advantage 0: no weight under BA).
REWARDS = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
RESPONSE_LENGTHS = [3, 6, 2, 5, 4, 1, 7, 2, 3, 3, 5, 2]


def _prompts() -> BatchedDataDict:
    return BatchedDataDict({
        "message_log": [[{"role": "user", "content": f"q{i}",
                          "token_ids": torch.tensor([1 + i, 5, 9][: 2 + i % 2])}]
                        for i in range(PROMPTS)],
        "task_name": ["math"] * PROMPTS,
        "extra_env_info": [{} for _ in range(PROMPTS)],
        "loss_multiplier": torch.ones(PROMPTS),
        "idx": torch.arange(PROMPTS),
        "length": torch.tensor([2 + i % 2 for i in range(PROMPTS)]),
        "total_reward": torch.zeros(PROMPTS),
    })  # fmt: skip


def _rollout(*, input_batch, **kwargs):
    """Stands in for run_multi_turn_rollout: one assistant turn per row, fixed rewards."""
    g = torch.Generator().manual_seed(1)
    logs = []
    for i, log in enumerate(input_batch["message_log"]):
        n = RESPONSE_LENGTHS[i]
        reply = {
            "role": "assistant",
            "content": "a",
            "token_ids": torch.randint(1, VOCAB, (n,), generator=g),
            "generation_logprobs": -torch.rand(n, generator=g),
        }
        logs.append([*log, reply])
    out = BatchedDataDict(dict(input_batch))
    out["message_log"] = logs
    out["total_reward"] = torch.tensor(REWARDS)
    return out, {"mean_gen_tokens_per_sample": sum(RESPONSE_LENGTHS) / len(REWARDS)}


def _logprobs(model):
    """NeMo-RL's convention: position t holds log p(x_t | x_<t), position 0 holds 0."""

    def get(data, timer=None, **kwargs):
        ids = data["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(model(ids[:, :-1]), -1).gather(-1, ids[:, 1:, None])[..., 0]
        return torch.cat([torch.zeros(ids.shape[0], 1), lp], dim=1)

    return get


def _stock_master_config(*overrides: str):
    """What examples/run_grpo.py builds from the stock yaml and these overrides, built the way it
    builds it: NeMo-RL's load_config, parse_hydra_overrides, resolvers, MasterConfig."""
    from nemo_rl.algorithms.grpo import MasterConfig
    from nemo_rl.utils.config import load_config, parse_hydra_overrides
    from nemo_rl.utils.config import register_omegaconf_resolvers as register
    from omegaconf import OmegaConf

    register()
    config = load_config(Path(nemo_rl_root()) / "examples" / "configs" / "grpo_math_1B.yaml")
    config = parse_hydra_overrides(config, list(overrides))
    return MasterConfig(**OmegaConf.to_container(config, resolve=True))


def test_one_grpo_train_step_with_the_balanced_loss(
    mock_grpo_components,  # noqa: F811  (NeMo-RL's fixture, imported above)
    gloo_world,
    local_ray,
    monkeypatch,
):
    c = mock_grpo_components
    master = c["master_config"]
    master.grpo.update(num_prompts_per_step=PROMPTS, num_generations_per_prompt=G)
    master.grpo.update(max_num_steps=1, max_num_epochs=1, val_period=0, val_at_start=False)
    master.policy.update(policy_config("plain"), train_global_batch_size=PROMPTS * G)
    master.loss_fn = _stock_master_config("++loss_fn.ba_rule=balanced").loss_fn
    master.policy["generation"]["vllm_cfg"]["async_engine"] = False  # run_multi_turn_rollout
    loader = MagicMock(spec=StatefulDataLoader)
    loader.__iter__ = lambda self: iter([_prompts()] * 2)
    loader.__len__ = MagicMock(return_value=2)
    monkeypatch.setattr("nemo_rl.algorithms.grpo.run_multi_turn_rollout", _rollout)

    model, reference = TokenModel(VOCAB), TokenModel(VOCAB, seed=1)
    policy, seen = c["policy"], {}
    policy.get_logprobs.side_effect = lambda d, **k: {"logprobs": _logprobs(model)(d)}
    policy.get_reference_policy_logprobs.side_effect = lambda d, **k: {
        "reference_logprobs": _logprobs(reference)(d)
    }

    def train(data, loss_fn, *args, **kwargs):  # the worker's step on this process
        seen["data"] = data
        return policy_train(model, data, loss_fn, master.policy)

    policy.train = train
    result = [None] * 13
    result[SETUP_POLICY], result[SETUP_LOSS_FN] = policy, c["loss_fn"]
    result[SETUP_MASTER_CONFIG] = master
    setup = balanced_setup(lambda master_config, *a, **k: tuple(result))
    installed = setup(master, None, None, None)
    policy, loss_fn = installed[SETUP_POLICY], installed[SETUP_LOSS_FN]
    assert isinstance(loss_fn, BalancedPGLossFn)

    grpo_train(policy, _mock_policy_generation(), loader, c["val_dataloader"], c["tokenizer"],
               loss_fn, c["task_to_env"], c["val_task_to_env"], c["logger"], c["checkpointer"],
               _default_grpo_save_state(), master)  # fmt: skip

    data = seen["data"]  # the plan follows GRPO's layout: prompt-major blocks of G responses
    rewards = torch.tensor(REWARDS).view(PROMPTS, G)
    centred = (rewards - rewards.mean(1, keepdim=True)).reshape(-1)
    expected = plan_weights("balanced", RESPONSE_LENGTHS, centred, G)
    torch.testing.assert_close(data["ba_weights"], expected, rtol=1e-12, atol=0)
    calls = c["logger"].log_metrics.call_args_list
    logged = [m.args[0] for m in calls if "token_mult_prob_error" in m.args[0]]
    assert len(logged) == 1
    assert {"loss", "gen_kl_error", "probs_ratio", "ba_weight_pos_sum"} <= set(logged[0])
    assert logged[0]["token_mult_prob_error"] >= 1.0  # mean exp|generation - prev|: a real figure


def test_setup_on_the_master_config_of_the_stock_yaml():
    """balanced_setup on what run_grpo.py builds from the stock yaml and the documented overrides
    (a pydantic MasterConfig, not a dict)."""
    master = _stock_master_config("++loss_fn.ba_rule=balanced", "++loss_fn.ba_scope=group")
    assert type(master).__name__ == "MasterConfig"
    policy = MagicMock()
    result = [None] * 13
    result[SETUP_POLICY], result[SETUP_MASTER_CONFIG] = policy, master
    out = balanced_setup(lambda master_config, *a, **k: tuple(result))(master, None, None, None)
    loss_fn = out[SETUP_LOSS_FN]
    assert isinstance(loss_fn, BalancedPGLossFn)
    assert (loss_fn.aggregation.rule, loss_fn.group_size) == ("balanced", 16)
    assert loss_fn.reference_policy_kl_penalty == 0.01  # the stock KL term, kept
    assert loss_fn.step_size == master.policy["train_global_batch_size"]
    per_batch = master.grpo["num_prompts_per_step"] * master.grpo["num_generations_per_prompt"]
    master.policy["train_global_batch_size"] = per_batch // 2  # two optimizer steps per batch
    out = balanced_setup(lambda master_config, *a, **k: tuple(result))(master, None, None, None)
    assert out[SETUP_LOSS_FN].step_size == per_batch // 2
    for size in (24, 3 * per_batch // 4 + 16):  # not whole groups of 16; not dividing the batch
        master.policy["train_global_batch_size"] = size
        with pytest.raises(ValueError, match=r"^policy\.train_global_batch_size: must be whole"):
            balanced_setup(lambda master_config, *a, **k: tuple(result))(master, None, None, None)


def test_the_documented_command_gets_past_configuration(tmp_path):
    """docs/integrations.md's command, as written, from a NeMo-RL checkout (its examples/ linked
    into a scratch folder, so that run_grpo.py's log folder lands there): the config is checked and
    the preflight starts on NeMo-RL's own code; it stops where the model's tokenizer must be
    downloaded (no network in tests), in NeMo-RL's get_tokenizer, not in a check of ours."""
    text = (REPO / "docs" / "integrations.md").read_text()
    (block,) = re.findall(r"```bash\ncd <NeMo-RL checkout> && (.*?)```", text, re.S)
    command = block.replace("\\\n", " ").split()
    assert command[:3] == ["uv", "run", "python"]
    (tmp_path / "examples").symlink_to(Path(nemo_rl_root()) / "examples")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, *command[3:]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "[megatron-ba] checked: BalancedPGLossFn rule=balanced scope=group" in out, out[-3000:]
    # the preflight (before run_grpo.py) asks NeMo-RL's get_tokenizer for the model's tokenizer
    assert proc.returncode != 0 and "in get_tokenizer" in out, out[-3000:]
    assert "preflight.py" in out and "offline mode" in out, out[-3000:]

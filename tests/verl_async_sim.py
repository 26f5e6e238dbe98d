"""verl 0.9.1's fully asynchronous rollouter and trainer driven on CPU, without Ray or GPUs, for
tests/test_integration_verl_async.py.

    sim = Sim(prompts=24, n=4, cut={"1-0", "1-2"})
    steps = asyncio.run(run(config, sim, steps=4))   # [Step(batch, version)]

What runs is verl's own code: the rollouter's feed (`_feed_samples`: one RolloutSample of rollout.n
rows per prompt), its processing loop with the staleness gate (`_processor_worker`,
`_should_pause_generation`, `set_max_required_samples`, `reset_staleness`), the uid it gives a
sample (`_process_single_sample_streaming`), the message queue (MessageQueue's own class, in this
event loop), the partial-rollout resume of FullyAsyncLLMServerClient.generate, the trainer's step
batch (`_get_samples_from_queue`: assemble_batch_from_rollout_samples with `_balance_batch`), its
reward and advantage steps (`_fit_compute_reward`, `_fit_compute_advantage`, which call the
`balanced` estimator) and its version counter (`_fit_update_local_step`).

Stand-ins: the rollout server (FakeServer: each response's length, reward and log-probs follow
from its prompt and index; a request named in `cut` is aborted at half its tokens by the next
weight sync and resumed under the new weights, as verl's checkpoint engine aborts requests at a
sync), the agent loop (rows built from the client's TokenOutputs), the actor's old_log_prob
recomputation (the rollout log-probs, shifted), and Ray (each actor class's own methods run on an
instance whose fields are set here to what those methods read).
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
from verl import DataProto
from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncRollouter
from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer
from verl.experimental.fully_async_policy.message_queue import MessageQueue
from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient
from verl.workers.rollout.replica import TokenOutput

PROMPT_LEN, RESPONSE_LEN = 4, 12


def own_class(actor_class):
    """The class a @ray.remote decorator wrapped: its methods, callable without Ray."""
    return actor_class.__ray_metadata__.modified_class


@dataclass
class Sim:
    """The fake rollout servers' state: per (prompt, response) a length, a 0/1 reward and
    log-probs (seeded); the weights' version they hold; the requests a sync cuts."""

    prompts: int
    n: int
    seed: int = 0
    cut: set = field(default_factory=set)  # request ids "PROMPT-J" aborted at half by a sync
    version: int = 0
    sync: asyncio.Condition | None = None  # made in the running event loop (run)

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        self.lengths = torch.randint(1, RESPONSE_LEN + 1, (self.prompts, self.n), generator=g)
        self.scores = torch.randint(0, 2, (self.prompts, self.n), generator=g).float()
        self.scores[::5] = 1.0  # some groups all right: advantage 0, weight 0
        self.logp = -torch.rand(self.prompts, self.n, RESPONSE_LEN, generator=g) * 2

    async def synced_after(self, version: int) -> None:
        """Wait until a weight sync has moved the servers past `version`."""
        async with self.sync:
            await self.sync.wait_for(lambda: self.version > version)

    async def set_version(self, version: int) -> None:
        async with self.sync:
            self.version = version
            self.sync.notify_all()

    def batch(self, *prompts: int) -> dict:
        """Prompts as verl's dataloader yields them (RLHFDataset's rows: a dummy tensor, the rest
        non-tensors; the agent loop tokenizes)."""
        return {
            "dummy_tensor": torch.zeros(len(prompts), 1, dtype=torch.uint8),
            "index": np.array(prompts, dtype=object),
        }


class FakeServer(LLMServerClient):
    """The server side of the client: FullyAsyncLLMServerClient.generate's `super().generate`."""

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        sim = self.sim
        prompt, j = (int(x) for x in request_id.split("-"))
        total, done, version = (
            int(sim.lengths[prompt, j]),
            len(prompt_ids) - PROMPT_LEN,
            sim.version,
        )
        end = total
        if request_id in sim.cut and done == 0:
            end = total // 2
            await sim.synced_after(version)  # the sync comes while the request runs
        tokens = list(range(done + 1, end + 1))
        return TokenOutput(
            token_ids=tokens,
            log_probs=sim.logp[prompt, j, done:end].tolist(),
            stop_reason="aborted" if end < total else "completed",
            extra_fields={"global_steps": version},
        )


class Client(FullyAsyncLLMServerClient, FakeServer):
    """verl's partial-rollout client over the fake server (no load balancer)."""

    def __init__(self, config, sim):
        self.config, self.sim = config, sim


class FakeAgentLoop:
    """verl's agent loop manager's generate_sequences_single: each row of the sample through the
    client, then the rows verl's trainer reads."""

    def __init__(self, client: Client):
        self.client = client

    async def generate_sequences_single(self, full_batch: DataProto) -> DataProto:
        prompts = [int(p) for p in full_batch.non_tensor_batch["index"]]
        params = {"max_tokens": RESPONSE_LEN}
        outs = await asyncio.gather(
            *(
                self.client.generate(f"{p}-{j}", prompt_ids=_prompt_ids(p), sampling_params=params)
                for j, p in enumerate(prompts)
            )
        )
        return rows(self.client.sim, prompts, outs)

    async def generate_sequences(self, batch: DataProto) -> DataProto:
        """A batch of prompts x n rows (repeated, interleaved), one prompt's rows at a time."""
        n = len(batch) // len(set(batch.non_tensor_batch["index"]))
        parts = [batch[i : i + n] for i in range(0, len(batch), n)]
        return DataProto.concat([await self.generate_sequences_single(p) for p in parts])


def _prompt_ids(prompt: int) -> list[int]:
    return [7 + prompt] * PROMPT_LEN


def rows(sim: Sim, prompts: list[int], outs: list[TokenOutput]) -> DataProto:
    """The DataProto of a sample's responses: right-padded responses, masks, rollout log-probs,
    the outcome reward on the last token (rm_scores), the versions each response ran under."""
    n = len(prompts)
    responses = torch.zeros(n, RESPONSE_LEN, dtype=torch.long)
    mask = torch.zeros(n, RESPONSE_LEN, dtype=torch.long)
    logp = torch.zeros(n, RESPONSE_LEN)
    scores = torch.zeros(n, RESPONSE_LEN)
    for i, out in enumerate(outs):
        t = len(out.token_ids)
        responses[i, :t], mask[i, :t] = torch.tensor(out.token_ids), 1
        logp[i, :t] = torch.tensor(out.log_probs)
        scores[i, t - 1] = sim.scores[prompts[i], i]
    prompt = torch.tensor([_prompt_ids(p) for p in prompts])
    return DataProto.from_dict(
        tensors={
            "prompts": prompt,
            "responses": responses,
            "input_ids": torch.cat([prompt, responses], dim=1),
            "attention_mask": torch.cat([torch.ones_like(prompt), mask], dim=1),
            "rollout_log_probs": logp,
            "rm_scores": scores,
        },
        non_tensors={
            "index": np.array(prompts, dtype=object),
            "resp": np.arange(n, dtype=object),
            "min_global_steps": np.array([o.extra_fields["min_global_steps"] for o in outs]),
            "max_global_steps": np.array([o.extra_fields["max_global_steps"] for o in outs]),
        },
        meta_info={"metrics": [{"generate_sequences": 0.0, "tool_calls": 0.0}] * n},
    )


class LocalQueueClient:
    """MessageQueueClient's calls, awaited on the queue in this event loop (no Ray actor)."""

    def __init__(self, queue):
        self.queue = queue

    async def put_sample(self, sample):
        return await self.queue.put_sample(sample)

    async def get_sample(self):
        return await self.queue.get_sample()

    async def get_queue_size(self):
        return await self.queue.get_queue_size()

    async def get_statistics(self):
        return await self.queue.get_statistics()


class Rollouter(own_class(FullyAsyncRollouter)):
    """verl's rollouter's methods over the fields they read (no dataset, servers or Ray)."""

    def __init__(self, config, sim: Sim, agent_loop: FakeAgentLoop):
        self.config, self.sim, self.async_rollout_manager = config, sim, agent_loop
        self.message_queue_client = None
        self.staleness_threshold = config.async_training.staleness_threshold
        self.required_samples = (
            config.actor_rollout_ref.actor.ppo_mini_batch_size
            * config.async_training.require_batches
        )
        self.concurrent_samples_per_replica = config.async_training.concurrent_samples_per_replica
        self.total_rollout_steps = sim.prompts
        self.llm_server_manager = SimpleNamespace(get_active_server_count=lambda: 1)
        self.max_required_samples = self.max_concurrent_samples = self.max_queue_size = None
        self.total_generated_samples = self.staleness_samples = self.dropped_stale_samples = 0
        self.processed_sample_count = self._step_generated_samples = 0
        self._STEP_HISTORY_SIZE, self._completed_steps, self.global_steps = 10, 1, 1
        self._step_samples_history = collections.deque(maxlen=10)
        self.idle_start_time = self.step_start_time = time.time()
        self.paused, self.running = False, True
        self.pending_queue = asyncio.Queue(maxsize=128)
        self.active_tasks = set()
        self._active_count_history = [(time.time(), 0, 0)]
        self._init_async_objects()

    def _create_continuous_iterator(self):
        for prompt in range(self.sim.prompts):
            yield 0, self.sim.batch(prompt)

    async def get_statistics(self) -> dict:
        return {}  # rollout_status: metrics only


class Trainer(own_class(FullyAsyncTrainer)):
    """verl's fully async trainer's methods over the fields they read; `dp` data-parallel ranks
    (what _balance_batch balances over)."""

    def __init__(self, config, queue_client, dp: int):
        self.config, self.tokenizer, self.message_queue_client = config, None, queue_client
        self.required_samples = (
            config.actor_rollout_ref.actor.ppo_mini_batch_size
            * config.async_training.require_batches
        )
        self.trigger_parameter_sync_step = config.async_training.trigger_parameter_sync_step
        self.dynamic_schedule_enabled, self.use_prefix_grouper, self.use_rm = False, False, False
        self._step_wait_times, self._step_wait_samples = [], []
        self.actor_rollout_wg = SimpleNamespace(_dispatch_info={"actor": list(range(dp))})
        self.global_steps, self.local_trigger_step, self.current_param_version = 1, 1, 0

    async def step(self, seed: int) -> DataProto:
        """One step up to the advantages: the queue read and batch assembly, the reward, the
        proximal log-probs (the actor's stand-in) and the advantage step."""
        self.metrics, self.timing_raw = {}, {}
        _, batch = await self._get_samples_from_queue()
        batch = self._fit_compute_reward(batch)
        g = torch.Generator().manual_seed(seed)
        shift = 0.05 * torch.randn(batch.batch["rollout_log_probs"].shape, generator=g)
        batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"] + shift
        return self._fit_compute_advantage(batch)


@dataclass
class Step:
    batch: DataProto  # the trainer's step batch, with verl's advantages
    version: int  # the trainer's parameter version it trained at


async def _training_time(rollouter: Rollouter) -> None:
    """The actor's update, which takes seconds in verl: meanwhile the rollouter's drain loop
    reaps the tasks that have finished (reset_staleness counts those still in active_tasks)."""
    for _ in range(100):
        if not any(task.done() for task in rollouter.active_tasks):
            return
        await asyncio.sleep(0.01)


async def run(config, sim: Sim, steps: int, dp: int = 2) -> list[Step]:
    """`steps` trainer steps against verl's rollouter loop, as verl's two fit() loops run: the
    trainer's weight sync (every trigger_parameter_sync_step steps) moves the servers' version
    and calls the rollouter's reset_staleness."""
    sim.sync = asyncio.Condition()
    rollouter = Rollouter(config, sim, FakeAgentLoop(Client(config, sim)))
    await rollouter.set_max_required_samples()
    queue = LocalQueueClient(own_class(MessageQueue)(config, rollouter.get_max_queue_size()))
    rollouter.message_queue_client = queue
    trainer = Trainer(config, queue, dp)
    loops = [asyncio.create_task(rollouter._feed_samples()),
             asyncio.create_task(rollouter._processor_worker())]  # fmt: skip
    out = []
    try:
        for k in range(steps):
            out.append(Step(await trainer.step(seed=k), trainer.current_param_version))
            trainer._fit_update_local_step()
            await _training_time(rollouter)
            if trainer.local_trigger_step == 1:  # verl's _fit_update_weights syncs here
                await sim.set_version(trainer.current_param_version)
                await rollouter.reset_staleness()
    finally:
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
    return out

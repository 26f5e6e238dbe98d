"""Exit statuses the engines' entry points (verl's main_ppo, NeMo-RL's run_grpo_balanced) share
with the Slurm launcher (slurm/lib.sh), which reports them by name."""

# The entry's preflight passed (config, data, reward through the engine's own code) and training
# needs a CUDA GPU this node lacks. sysexits' EX_UNAVAILABLE ("a service is unavailable"): not
# 1 (an error), 2 (a refusal, or the launcher's "the Ray cluster did not form") nor 75
# (preempted: the launcher requeues the job).
NEEDS_GPU = 69

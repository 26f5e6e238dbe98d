"""The layout equivalence check behind `megatron-ba check-layout`: a parallel layout gives the
single-process loss, gradients and optimiser step (gloo, CPU). A room of its own above the
megatron-core adapters: it runs the production step (megatron_ba.megatron.grpo_step) on a layout
and on one process, and compares.

- check: the launcher (spawns the reference and the layout's ranks, compares their records);
- cases: what is checked (cases and their negative controls on a ParallelLayout, the synthetic
  batch, the results' records);
- controls: the negative controls (the production step with one property broken on purpose);
- workers: the spawned ranks' bodies.
"""

# The models the check builds (cases.tiny_spec); here, torch-free, for the CLI's choices.
MODELS = ("debug", "tiny-moe", "tiny-qwen3.5", "tiny-qwen3.5-moe")

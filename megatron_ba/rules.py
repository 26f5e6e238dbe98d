"""The names of the aggregation rules and scopes (megatron_ba.aggregation defines them).

Kept apart from aggregation.py, which imports torch, so that the command line can offer them as
choices in `--help` and argument errors without importing torch.
"""

RULES = ("token", "sequence", "dr_grpo", "balanced", "balanced_mass")
SCOPES = ("group", "batch")

"""Subcommands of the `megatron-ba` CLI (one module each: `add_arguments`, `run`)."""

"""Training tasks: prompts with verifiable answers (synthetic for CPU runs, real sets later)."""

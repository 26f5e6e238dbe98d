"""The project's error for bad input from a user, which the command line reports without a trace.

    raise UserError("src: '/data/x' is not a folder")

A UserError is a ValueError, so callers that catch ValueError keep working. When one reaches
`megatron-ba` (megatron_ba/cli.py), its message is printed alone on stderr and the exit status is
2, as for an argument error; any other exception keeps its traceback, which then means a bug.
Subclasses name the input at fault: recipe.RecipeError (a recipe), data.records.SchemaError (a
data set's layout), planning.cluster_layout.NoLayoutFits (a cluster too small for the model).
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input: a message that names the argument (or file) and what is wrong with it."""


class SettingError(UserError):
    """A bad value of one setting of a settings object: `key` is the field's name, `problem` what
    is wrong. A caller whose users spell the key differently (a recipe's `loss.rule`, NeMo-RL's
    `loss_fn.ba_rule`) re-raises it under their name with `renamed`."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key, self.problem = key, problem

    def renamed(self, names: dict[str, str] | None = None, prefix: str = "") -> str:
        """The message with the key as the caller's users spell it."""
        return f"{prefix}{(names or {}).get(self.key, self.key)}: {self.problem}"

"""The project's error for bad input from a user, which the command line reports without a trace.

    raise UserError("src: '/data/x' is not a folder")

A UserError is a ValueError, so callers that catch ValueError keep working. When one reaches
`megatron-ba` (megatron_ba/cli.py), its message is printed alone on stderr and the exit status is
2, as for an argument error; any other exception keeps its traceback, which then means a bug.
Subclasses name the input at fault: recipe.RecipeError (a recipe), data.records.SchemaError (a
data set's layout), planning.layout.NoLayoutFits (a cluster too small for the model).
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input: a message that names the argument (or file) and what is wrong with it."""

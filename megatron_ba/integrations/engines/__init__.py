"""The engines this project launches a recipe on: verl, NeMo-RL and NeMo-Aligner, as data.

One table (table.py; its rows in model_rows.py, data_rows.py, loss_rows.py, run_rows.py) says,
for every recipe key and each engine, where the key goes in the engine's config, which values
the engine cannot honour and why, or that it has no counterpart. Each engine's module (verl.py,
nemo_rl.py, nemo_aligner.py) is that table's column in the engine's order (engine.py) and the
engine's command; launch.py is what `megatron-ba train RECIPE backend=ENGINE` does with them:
print the translation, or write what the run needs and become the engine's command.

Nothing here imports an engine or torch: the modules run in any environment.
"""

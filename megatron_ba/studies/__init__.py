"""Studies: a recipe trained over a grid of keys and seeds, declared before it runs, and reported
(`megatron-ba study`, `compare`, `report`).

- grid: the grid, its run folders and manifest, running it here (one run after another);
- design: the declared design (study.json: the recipe's hashes, the grid, the seeds, the deciding
  comparison), written before anything runs and checked before each run;
- reporting, figures: report.md / report.json and its figures, from the run folders;
- slurm_array: one Slurm job array of the grid.
"""

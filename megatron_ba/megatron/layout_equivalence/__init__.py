"""The layout equivalence check behind `megatron-ba check-layout`: a parallel layout gives the
single-process loss, gradients and optimiser step (gloo, CPU).

- check: the launcher (spawns the reference and the layout's ranks, compares their records);
- cases: what is checked (layouts, cases and their negative controls, the synthetic batch);
- workers: the spawned ranks' bodies.
"""

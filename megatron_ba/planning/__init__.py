"""Planning a cluster run before it starts: does the layout fit the allocation (launch.py), how
much memory does it need per GPU (memory.py), which TP/PP/CP/DP to use (cluster_layout.py).
Arithmetic only: no megatron-core, no GPU, so the Slurm launchers can call it on a login or batch
node."""

"""Starting a run: preflight, doctor, requirements, DeepSpeed op builds, launch and supervision, slurm."""

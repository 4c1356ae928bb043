"""The run directory: its layout and files, the lock, checkpoints and the resume key."""

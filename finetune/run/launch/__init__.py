"""Launching the per-rank runner and watching it: the command lines (`commands`), the running processes (`supervision`) and what they came to (`outcome`)."""

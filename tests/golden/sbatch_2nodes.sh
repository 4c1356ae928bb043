#!/bin/bash
# Written by `finetune slurm 70b_qlora_8xh100.yaml`. Submit with: sbatch THIS_FILE
# 2 node(s) x 8 GPU(s); run directory /shared/runs/llama3-70b
# Exit 75: stopped by SIGTERM (time limit, preemption) with a checkpoint saved; the job is requeued
# and `finetune train` resumes from that checkpoint.
#SBATCH --job-name=llama3-70b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --partition=gpu
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=TERM@300
#SBATCH --requeue

set -u
cd /work
# Node 0 of the allocation hosts the rendezvous (torchrun's static store).
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=29500
export MASTER_ADDR MASTER_PORT PYTHONUNBUFFERED=1

srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --export=ALL \
  bash -c 'exec "$0" "$@" --node-rank "$SLURM_NODEID"' /work/.venv/bin/python -m finetune.cli train /work/recipes/llama3/70b_qlora_8xh100.yaml --output-dir /shared/runs/llama3-70b --nnodes 2 --set training.max_steps=1000 --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
status=$?
if [ "$status" -eq 75 ]; then
  # Stopped before the time limit (or preempted) with a checkpoint: queue again to resume.
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"

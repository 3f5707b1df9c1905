#!/bin/bash
# One learner rank per Slurm task: the torch.distributed variables from the task's Slurm ones, then the command
# (grpo learner ...). MASTER_ADDR and MASTER_PORT come from the template (--export): the first learner node's
# address and a port free there. The same on real Slurm and on the stand-ins (deploy/slurm/standins/).
set -euo pipefail
: "${SLURM_PROCID:?learner-rank.sh runs as an srun task (SLURM_PROCID is not set)}"
: "${MASTER_ADDR:?MASTER_ADDR is not set (the template exports the first learner node address)}"
: "${MASTER_PORT:?MASTER_PORT is not set}"
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
exec "$@"

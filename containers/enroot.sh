#!/usr/bin/env bash
# Build the nemo-orch image and turn it into the squashfs file pyxis runs (--container-image):
#   containers/enroot.sh JOB_DIR            # docker + enroot on this machine
#   containers/enroot.sh JOB_DIR REGISTRY   # or import REGISTRY/nemo-orch:0.1.0, pushed elsewhere
# JOB_DIR is launcher.slurm.job_dir (the cluster's shared filesystem); the image lands where the
# launcher looks by default: JOB_DIR/containers/nemo-orch+0.1.0.sqsh (enroot's own name for
# nemo-orch:0.1.0).
set -euo pipefail
IMAGE=nemo-orch:0.1.0
JOB_DIR=${1:?usage: containers/enroot.sh JOB_DIR [REGISTRY]}
REGISTRY=${2:-}
OUT="$JOB_DIR/containers/${IMAGE/:/+}.sqsh"
mkdir -p "$JOB_DIR/containers"
cd "$(dirname "$0")/.."
if [[ -z "$REGISTRY" ]]; then
    docker build -f containers/Dockerfile -t "$IMAGE" .
    enroot import -o "$OUT" "dockerd://$IMAGE"
else
    # enroot's syntax: REGISTRY#IMAGE (credentials in ~/.config/enroot/.credentials).
    enroot import -o "$OUT" "docker://$REGISTRY#$IMAGE"
fi
# A quick look inside, without GPUs: the package and its entry point.
enroot create --name nemo-orch-check "$OUT"
enroot start nemo-orch-check nemo-orch --help > /dev/null
enroot remove -f nemo-orch-check
echo "wrote $OUT"

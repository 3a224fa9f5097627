#!/bin/bash
# MoCo v2 vs FGVR on MoCo v2 vs FGVR-random (and SimSiam vs SimSiam+FGVR) at the same budget,
# each arm starting from the same MoCo v2-pretrained encoder (the paper starts from ImageNet
# weights), two seeds each. Run it from an empty directory (it writes ray_results/ and mlflow.db
# there): bash benchmarks/fgvr_compare.sh; results in docs/benchmarks.md.
set -e
REPO=${REPO:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${PY:-$REPO/.venv/bin/python}
export PYTHONPATH=$REPO
S=$REPO/searches/fgvr_eps.yaml
common=(--set 'tune.search_space={}' --num-samples 2)
# 1. The shared starting point: MoCo v2 for 10 epochs (one seed).
$PY -m raycl.tune $S --set method=mocov2 --set train.epochs=10 --set 'tune.search_space={}' \
    --num-samples 1 --name pretrain > pretrain.log 2>&1
W=$(ls -d $PWD/ray_results/pretrain/*/checkpoint_* | sort | tail -1)/state.pt
echo "weights: $W"
for arm in mocov2 fgvr fgvr_random simsiam fgvr_simsiam; do
  case $arm in
    mocov2) extra=(--set method=mocov2) ;;
    fgvr) extra=(--set method=fgvr) ;;
    fgvr_random) extra=(--set method=fgvr --set fgvr.perturbation=random) ;;
    simsiam) extra=(--set method=simsiam) ;;
    fgvr_simsiam) extra=(--set method=fgvr --set fgvr.base=simsiam) ;;
  esac
  $PY -m raycl.tune $S "${common[@]}" "${extra[@]}" --set model.pretrained=$W --name $arm \
      > $arm.log 2>&1
  echo "$arm done $(date +%T)"
done

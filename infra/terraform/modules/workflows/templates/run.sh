#!/bin/sh
# One scheduled run of a specbatch workflow, started by its CronJob:
#   1. generation: create the RayJob on today's dated output prefix and wait for it;
#   2. follow-up: when it succeeded, create the cost-report RayJob on the same prefix and wait.
# The CronJob's concurrencyPolicy (Forbid) holds because this pod lives as long as the run.
# Inputs (environment): WORKFLOW, NAMESPACE, POLL_SECONDS, TEMPLATES (default /etc/specbatch-workflow).
set -eu

TEMPLATES="${TEMPLATES:-/etc/specbatch-workflow}"
RUN_DATE="$(date -u +%Y-%m-%d)"
STAMP="$(date -u +%Y%m%d-%H%M%S)"
POLL_SECONDS="${POLL_SECONDS:-30}"

render() { # template rayjob-name
  sed -e "s|__RUN_DATE__|$RUN_DATE|g" -e "s|__RAYJOB_NAME__|$2|g" "$TEMPLATES/$1"
}

run_rayjob() { # template rayjob-name; returns 0 when the Ray job SUCCEEDED
  render "$1" "$2" | kubectl create -n "$NAMESPACE" -f -
  while :; do
    deployment="$(kubectl get rayjob "$2" -n "$NAMESPACE" -o jsonpath='{.status.jobDeploymentStatus}' 2>/dev/null || true)"
    case "$deployment" in
      Complete | Failed) break ;;
    esac
    sleep "$POLL_SECONDS"
  done
  status="$(kubectl get rayjob "$2" -n "$NAMESPACE" -o jsonpath='{.status.jobStatus}')"
  echo "rayjob $2: deployment $deployment, job $status"
  [ "$status" = "SUCCEEDED" ]
}

echo "workflow $WORKFLOW, run date $RUN_DATE"
run_rayjob rayjob-generate.yaml "$WORKFLOW-$STAMP"
run_rayjob rayjob-report.yaml "$WORKFLOW-report-$STAMP"

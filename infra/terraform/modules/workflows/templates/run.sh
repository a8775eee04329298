#!/bin/sh
# One scheduled run of a specbatch workflow, started by its CronJob:
#   0. deletes this workflow's finished RayJobs older than its last KEEP_RUNS run dates;
#   1. a date whose _job.json says finished, with no error rows left to retry, starts nothing;
#      with OUTPUT_MODE=per_dataset (one output location per data set), nor does a location
#      whose job has every Parquet file of its input_uri already (a run adds only new files);
#   2. generation: creates RayJob WORKFLOW-YYYYMMDD-N on the dated output prefix and waits;
#      N is one more than the date's last attempt, so a second scheduler of the same date
#      gets AlreadyExists from the API instead of a second run, and an active run of the
#      date is refused;
#   3. when it succeeded, the cost report on the same prefix: WORKFLOW-YYYYMMDD-N-report.
# A wait ends on every terminal state (Complete, Failed, ValidationFailed) and when the RayJob
# is gone. Exit 0: succeeded, or nothing to do; 1: anything else.
# The CronJob's concurrencyPolicy (Forbid) holds because this pod lives as long as the run.
# Environment: WORKFLOW, NAMESPACE, OUTPUT_URI (with __RUN_DATE__, unless per_dataset); optional
# OUTPUT_MODE (dated, per_dataset), POLL_SECONDS, KEEP_RUNS, TEMPLATES (default
# /etc/specbatch-workflow), RUN_DATE (default today, UTC).
set -eu

TEMPLATES="${TEMPLATES:-/etc/specbatch-workflow}"
RUN_DATE="${RUN_DATE:-$(date -u +%Y-%m-%d)}"
DAY="$(echo "$RUN_DATE" | tr -d -)"
POLL_SECONDS="${POLL_SECONDS:-30}"
KEEP_RUNS="${KEEP_RUNS:-14}"
MAX_READ_ERRORS="${MAX_READ_ERRORS:-20}"
OUTPUT_MODE="${OUTPUT_MODE:-dated}"
OUTPUT="$(echo "$OUTPUT_URI" | sed "s|__RUN_DATE__|$RUN_DATE|g")"
SELECTOR="specbatch.io/workflow=$WORKFLOW"

log() { echo "$(date -u +%H:%M:%S) $*"; }

terminal() { case "$1" in Complete | Failed | ValidationFailed) return 0 ;; esac; return 1; }

render() { # template rayjob-name
  sed -e "s|__RUN_DATE__|$RUN_DATE|g" -e "s|__RAYJOB_NAME__|$2|g" "$TEMPLATES/$1"
}

cleanup() {
  kubectl get rayjobs -n "$NAMESPACE" -l "$SELECTOR" \
    -o jsonpath='{range .items[*]}{.metadata.labels.specbatch\.io/run-date} {.metadata.name} {.status.jobDeploymentStatus}{"\n"}{end}' |
    sort -r |
    awk -v keep="$KEEP_RUNS" '
      $1 != last { dates++; last = $1 }
      dates > keep && ($3 == "Complete" || $3 == "Failed" || $3 == "ValidationFailed") { print $2 }' |
    while read -r old; do
      kubectl delete rayjob "$old" -n "$NAMESPACE" --wait=false
    done
}

finished() { # 0 when the date's _job.json says done and no error row is left to retry
  if ! command -v aws >/dev/null || ! command -v jq >/dev/null; then
    log "no aws or jq in the scheduler image: not checking ${OUTPUT}_job.json"
    return 1
  fi
  if ! manifest="$(aws s3 cp "${OUTPUT}_job.json" - 2>/dev/null)"; then
    log "no readable ${OUTPUT}_job.json: a first run of $RUN_DATE"
    return 1
  fi
  log "${OUTPUT}_job.json: $(echo "$manifest" | jq -c '{status, retryable_error_rows: .totals.retryable_error_rows}')"
  echo "$manifest" | jq -e '(.status == "succeeded" or .status == "completed_with_errors")
    and ((.totals.retryable_error_rows // 0) == 0)' >/dev/null || return 1
  [ "$OUTPUT_MODE" != per_dataset ] || ! new_inputs "$manifest"
}

new_inputs() { # manifest; 0 when input_uri holds a Parquet file the job does not have (or it cannot tell)
  input="$(echo "$1" | jq -r '.config.input_uri // empty')"
  case "$input" in
    s3://*/*) ;;
    *) log "input_uri ${input:-unknown} is not an s3:// folder this check lists: running"; return 0 ;;
  esac
  case "$input" in *"*"* | *"?"* | *"["*) log "input_uri $input is a glob: running"; return 0 ;; esac
  bucket="$(echo "$input" | sed 's|^s3://\([^/]*\)/.*|\1|')"
  if ! listing="$(aws s3 ls --recursive "${input%/}/" 2>&1)"; then
    log "cannot list $input: $listing; running"
    return 0
  fi
  known="$(echo "$1" | jq -r '.input_files[].uri')"
  new="$(echo "$listing" | awk -v b="s3://$bucket/" '$4 ~ /\.parquet$/ { print b $4 }' | while read -r uri; do
    echo "$known" | grep -qxF "$uri" || echo "$uri"
  done)"
  if [ -n "$new" ]; then
    log "new input files since the last run: $(echo "$new" | wc -l | tr -d ' ') (e.g. $(echo "$new" | head -1))"
    return 0
  fi
  log "every Parquet file of $input is generated already"
  return 1
}

create() { # template rayjob-name
  if ! out="$(render "$1" "$2" | kubectl create -n "$NAMESPACE" -f - 2>&1)"; then
    case "$out" in
      *AlreadyExists* | *"already exists"*)
        log "refused: RayJob $2 already exists, another scheduler started this run of $RUN_DATE" ;;
      *) log "cannot create RayJob $2: $out" ;;
    esac
    exit 1
  fi
  log "$out"
  # Helm never upgrades CRDs: an older rayjobs.ray.io drops fields it does not know.
  kept="$(kubectl get rayjob "$2" -n "$NAMESPACE" -o jsonpath='{.spec.preRunningDeadlineSeconds}' 2>/dev/null || true)"
  [ -n "$kept" ] || log "WARNING: the cluster's RayJob CRD dropped preRunningDeadlineSeconds: it predates KubeRay 1.6 (docs/infra.md: upgrading the CRDs)"
}

wait_for() { # rayjob-name; 0 when the Ray job SUCCEEDED
  errors=0
  while :; do
    if out="$(kubectl get rayjob "$1" -n "$NAMESPACE" -o jsonpath='{.status.jobDeploymentStatus} {.status.jobStatus}' 2>&1)"; then
      errors=0
      deployment="${out%% *}"
      status="${out#* }"
      if terminal "$deployment"; then break; fi
    else
      case "$out" in
        *NotFound* | *"not found"*)
          log "RayJob $1 is gone: deleted while the scheduler waited for it"
          return 1 ;;
      esac
      errors=$((errors + 1))
      if [ "$errors" -ge "$MAX_READ_ERRORS" ]; then
        log "giving up on RayJob $1 after $errors failed reads: $out"
        return 1
      fi
    fi
    sleep "$POLL_SECONDS"
  done
  log "RayJob $1: deployment $deployment, job ${status:-none}"
  if [ "$deployment" = Complete ] && [ "$status" = SUCCEEDED ]; then return 0; fi
  log "reason: $(kubectl get rayjob "$1" -n "$NAMESPACE" -o jsonpath='{.status.reason}: {.status.message}' 2>/dev/null || true)"
  return 1
}

log "workflow $WORKFLOW, run date $RUN_DATE, output $OUTPUT"
cleanup || log "could not clean up old RayJobs; going on"

if finished; then
  log "$OUTPUT is finished and nothing is left to do: no RayJob created, no GPU started"
  exit 0
fi

runs="$(kubectl get rayjobs -n "$NAMESPACE" -l "$SELECTOR,specbatch.io/run-date=$RUN_DATE,app.kubernetes.io/component=generate" \
  -o jsonpath='{range .items[*]}{.metadata.name} {.status.jobDeploymentStatus}{"\n"}{end}')"
active="$(echo "$runs" | awk '$1 != "" && $2 != "Complete" && $2 != "Failed" && $2 != "ValidationFailed" { print $1 }')"
if [ -n "$active" ]; then
  log "refused: $(echo "$active" | tr '\n' ' ')of $RUN_DATE is still running; not starting another run"
  exit 1
fi
attempt="$(echo "$runs" | awk '$1 != "" { n = $1; sub(/.*-/, "", n); if (n + 0 > max) max = n + 0 } END { print max + 1 }')"
name="$WORKFLOW-$DAY-$attempt"

create rayjob-generate.yaml "$name"
wait_for "$name" || exit 1
create rayjob-report.yaml "$name-report"
wait_for "$name-report" || exit 1
log "done: $OUTPUT"

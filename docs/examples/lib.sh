# Sourced before every block of docs output (launcher/docs.py): what the example scripts share.
# The block shows what they print; `show` prints a command as typed, then runs it.

show() {  # show CMD: "$ CMD", then what it prints
    printf '$ %s\n' "$*"
    eval "$*"
}

say() {  # say TEXT: a line shown as typed, not run (a kill sent by the script, a comment)
    printf '$ %s\n' "$*"
}

wait_step() {  # wait_step RUN_DIR N: until RUN_DIR/metrics.jsonl has step N (or 300 s)
    local i
    for i in $(seq 3000); do
        if [ -f "$1/metrics.jsonl" ] && python - "$1/metrics.jsonl" "$2" <<'PY'
import json, sys
steps = [json.loads(l).get("step", 0) for l in open(sys.argv[1]) if l.strip().endswith("}")]
sys.exit(0 if steps and max(steps) >= int(sys.argv[2]) else 1)
PY
        then return 0; fi
        sleep 0.1
    done
    echo "wait_step: $1 never reached step $2" >&2
    return 1
}

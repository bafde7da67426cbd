# Sourced by scripts/main.sh. `forwarding COMMAND ARGS...` runs one step of the script and makes an interrupt of
# the script an interrupt of the step. Without it, bash waits for a running step to end before it acts on SIGINT
# sent to the script alone (`kill -INT`, a scheduler), and SIGTERM ends bash but leaves the step running on its own.
# The step runs in the background, and the script waits for it. On SIGINT or SIGTERM the step gets SIGTERM, which
# `vaswani-tx` takes as Ctrl-C: training stops (the next run resumes from its last checkpoint). A background step
# of a script ignores SIGINT, so SIGTERM is sent for both. The script then exits 130 (SIGINT) or 143 (SIGTERM)
# once the step has ended. Otherwise it returns the step's exit status.
forwarding() {
    FORWARDING_SIGNAL="" FORWARDING_STEP=""
    trap 'FORWARDING_SIGNAL=130; [ -z "$FORWARDING_STEP" ] || kill -TERM "$FORWARDING_STEP" 2>/dev/null || true' INT
    trap 'FORWARDING_SIGNAL=143; [ -z "$FORWARDING_STEP" ] || kill -TERM "$FORWARDING_STEP" 2>/dev/null || true' TERM
    "$@" &
    FORWARDING_STEP=$!
    if [ -n "$FORWARDING_SIGNAL" ]; then  # the signal came while the step was being started
        kill -TERM "$FORWARDING_STEP" 2>/dev/null || true
    fi
    local status
    while true; do
        status=0
        wait "$FORWARDING_STEP" || status=$?
        # a trapped signal ends `wait` early: wait again while the step is still stopping
        kill -0 "$FORWARDING_STEP" 2>/dev/null || break
    done
    trap - INT TERM
    if [ -n "$FORWARDING_SIGNAL" ]; then
        exit "$FORWARDING_SIGNAL"
    fi
    return "$status"
}

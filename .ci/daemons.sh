# Daemons tracked by their pid files, for .ci/setup_slurm.sh and .ci/setup_multinode.sh (sourced, not run).
# Nothing is ever killed by name: only the pid a daemon wrote, and only while that pid still runs the named program.
# The sourcing script defines log().

# alive PIDFILE COMM: the pid in PIDFILE runs and is the named program (a stale pid may have been reused).
alive() {
    local pid
    pid="$(cat "$1" 2>/dev/null)" || return 1
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

# stop_by_pidfile PIDFILE COMM: SIGTERM, up to 10 s to exit, then SIGKILL and up to 5 s more; the pid file is removed
# once the daemon is gone. Returns 1 when it still runs after that.
stop_by_pidfile() {
    alive "$1" "$2" || { rm -f "$1"; return 0; }
    local pid _
    pid="$(cat "$1")"
    log "stopping $2 (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || { rm -f "$1"; return 0; }; sleep 0.2; done
    log "$2 (pid $pid) did not stop within 10 s: SIGKILL"
    kill -9 "$pid" 2>/dev/null || true
    for _ in $(seq 1 25); do kill -0 "$pid" 2>/dev/null || { rm -f "$1"; return 0; }; sleep 0.2; done
    return 1
}

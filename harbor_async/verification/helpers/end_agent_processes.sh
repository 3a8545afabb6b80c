# end_agent_processes.sh: run by the sandbox's root before a strict verify (--strict-verify).
# Ends every process of the sandbox but its init (PID 1), the init's oldest child and its
# descendants (a container's main command, `sh -c "sleep infinity"`, which Docker's init
# exits with) and this shell. Each round stops them all first (nothing can fork away),
# then kills them; until none is left but the dead (zombies no signal can reach). Only the shell's builtins and /proc: any image
# (no `sleep`: a binary the agent planted would run as root, as this shell's child). A killed process leaves only once the
# kernel has run its exit (freeing a large memory takes a while, longer on a loaded machine), which can outlast many
# rounds: rounds go on for 10 s by /proc/uptime (at least 20 rounds), well inside the exec's 30 s timeout.
me=$$
oldest=""
oldest_start=""
pairs=""
for stat in /proc/[0-9]*/stat; do
    { read -r line < "$stat"; } 2>/dev/null || continue
    pid=${line%% *}
    set -- ${line##*) }
    pairs="$pairs $pid:$2"
    if [ "$2" = 1 ] && { [ -z "$oldest_start" ] || [ "${20}" -lt "$oldest_start" ]; }; then
        oldest=$pid
        oldest_start=${20}
    fi
done
main=" $oldest "
grown=1
while [ -n "$oldest" ] && [ "$grown" = 1 ]; do  # the main command's descendants, as they were before any kill
    grown=0
    for pair in $pairs; do
        case "$main" in *" ${pair#*:} "*) case "$main" in *" ${pair%%:*} "*) ;; *) main="$main${pair%%:*} "; grown=1 ;; esac ;; esac
    done
done
keep=" 1 $me$main"
read -r began _ < /proc/uptime
began=${began%.*}
round=0
while :; do
    round=$((round + 1))
    others=""
    for stat in /proc/[0-9]*/stat; do
        { read -r line < "$stat"; } 2>/dev/null || continue
        pid=${line%% *}
        set -- ${line##*) }
        case "$keep" in *" $pid "*) continue ;; esac
        [ "$2" = "$me" ] && continue
        if [ "$1" = Z ] || [ "$1" = X ]; then  # dead, but a leader that exited alone lists as Z with its threads running
            live=""
            for task in /proc/$pid/task/[0-9]*; do [ "${task##*/}" = "$pid" ] || live=1; done
            [ -z "$live" ] && continue  # dead: only its parent's wait is left (an init busy on a loaded machine)
        fi
        others="$others $pid"
    done
    [ -z "$others" ] && exit 0
    kill -STOP $others 2>/dev/null
    kill -KILL $others 2>/dev/null
    read -r now _ < /proc/uptime
    [ "$round" -ge 20 ] && [ "${now%.*}" -ge $((began + 10)) ] && break
done
echo "processes still running after $round rounds:$others" >&2
exit 1

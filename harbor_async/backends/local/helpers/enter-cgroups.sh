#!/bin/sh
# enter-cgroups.sh PROCS_FILE... -- COMMAND [ARG...]
# Joins the calling process to each cgroup (writes its pid to each cgroup.procs
# file) and then becomes COMMAND, so that COMMAND and everything it forks starts
# inside the sandbox's cgroups: a limit set after a fork would miss the children.
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
    echo "$$" > "$1" || { echo "enter-cgroups: cannot join $1" >&2; exit 125; }
    shift
done
shift
exec "$@"

# transfer.sh MODE PATH [NAME PERMS]: one file transfer, run INSIDE the sandbox
# (its namespaces, its root, its uid), so every path, symlinks included,
# resolves as the sandbox sees it and can never lead to a host file.
#   put-tree PATH         extract the tar stream on stdin into folder PATH (made if missing)
#   put-file PATH N P     write stdin to PATH (to PATH/N when PATH is a folder), mode P
#   get-file PATH         write regular file PATH to stdout
#   get-tree PATH         write a tar stream of PATH's regular files (file symlinks followed) to stdout
# Exit codes the host maps to errors: 2 not found, 3 not writable, 4 not a folder.
set -u
mode=$1
path=$2
case "$mode" in
put-tree)
    mkdir -p -- "$path" 2>/dev/null
    [ -d "$path" ] || exit 4
    [ -w "$path" ] || exit 3
    exec tar -x -f - -C "$path" --no-same-owner
    ;;
put-file)
    [ -d "$path" ] && path="$path/$3"
    # a symlink at PATH is followed (inside the sandbox): make its target's folder
    dir=$(dirname -- "$(readlink -m -- "$path")")
    mkdir -p -- "$dir" 2>/dev/null
    [ -d "$dir" ] || exit 4
    [ -w "$dir" ] || exit 3
    cat > "$path" || exit 3
    exec chmod "$4" "$path"
    ;;
get-file)
    [ -f "$path" ] || exit 2
    exec cat -- "$path"
    ;;
get-tree)
    [ -d "$path" ] || exit 2
    cd -- "$path" || exit 2
    find . \( -type f -o \( -type l -xtype f \) \) -print0 \
        | tar -c -f - --null --no-recursion --dereference -T -
    ;;
*)
    echo "transfer.sh: unknown mode $mode" >&2
    exit 64
    ;;
esac

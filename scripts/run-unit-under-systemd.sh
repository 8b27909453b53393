#!/bin/bash
# Provenance: copied unchanged (but for this line) from the fleet project's shared tools
# (tools/run-unit-under-systemd.sh) on 2026-11-30; used by tests/systemd/ (cargo test --test systemd).
# run-unit-under-systemd.sh - run a real systemd (PID 1 of private namespaces)
# with ONLY the given unit(s) (+ journald), on a host whose PID 1 is not systemd.
#
# One-shot mode (default):
#   run-unit-under-systemd.sh UNIT_FILE [SECONDS] [EXTRA_UNIT_FILE...]
#     boots a private systemd that starts UNIT_FILE (plus extra unit files, which
#     are installed but only started if something pulls them in), lets it run
#     SECONDS (default 10), prints `systemctl status`, key properties and the
#     journal of the unit, then tears everything down.
#
# Step-wise mode (for tests that want to poll/assert in between):
#   S=$(run-unit-under-systemd.sh up UNIT_FILE [EXTRA_UNIT_FILE...])  # prints state dir
#   run-unit-under-systemd.sh exec "$S" systemctl show -p NRestarts foo.service
#   run-unit-under-systemd.sh report "$S" foo.service
#   run-unit-under-systemd.sh down "$S"
#
# Environment knobs:
#   SYSD_SHARE_NET=1   share the host network namespace (default: private netns, only lo)
#   SYSD_KEEP_STATE=1  do not delete the state directory on teardown
#   SYSD_LOG_LEVEL     log level of the private PID 1 (default: info)
#   SYSD_BASE          where state dirs are created (default: $TMPDIR/sysd-try, TMPDIR defaulting to /tmp)
#   SYSD_OVERLAYS      dirs overlaid with a throw-away tmpfs layer (default: "/etc /var")
#   SYSD_BOOT_TIMEOUT  seconds to wait for the boot (incl. the unit's start job) (default: 60)
#   SYSD_STOP_TIMEOUT  seconds to wait for a graceful poweroff before SIGKILL (default: 20)
#
# Prerequisites: root with CAP_SYS_ADMIN (CAP_SYS_RESOURCE not needed); systemd
# (252 tested: /lib/systemd/systemd, systemctl, journalctl); util-linux (unshare,
# nsenter, mount, setsid) and bsdutils (`script`, for the pty used as /dev/console);
# a kernel with cgroup2 (a cgroup2 mount at /sys/fs/cgroup/unified or /sys/fs/cgroup),
# overlayfs, CONFIG_CGROUP_BPF (DeviceAllow=, IPAddressDeny=), CONFIG_SECCOMP_FILTER
# (SystemCallFilter=).  No extra packages (no systemd-container/nspawn, no dbus).
#
# Exit status: 0 if the private systemd booted and was torn down (whatever the unit
# did -- parse the `systemctl show` block), 1 on infrastructure failure.
#
# Isolation: new pid/mount/uts/ipc/cgroup(/net) namespaces; private /run and /dev
# (tmpfs with bind-mounted null/zero/full/random/urandom/tty, new devpts, /dev/console
# = a pty logged to STATE/console.log); /etc and /var are overlays with a throw-away
# tmpfs upper layer (StateDirectory=, ConfigurationDirectory=, the journal, ... never
# reach the host disk); /sys and /proc/sys are read-only (PID 1 cannot bump global
# sysctls); the private systemd lives in its own cgroup2 sub-tree
# (/sys/fs/cgroup/unified/sysd-try.*), mounted as /sys/fs/cgroup inside.  Only the
# unit(s) given, journald and the standard targets exist (SYSTEMD_UNIT_PATH), no
# generators run.  The rest of the host file system (incl. /tmp) is shared, so
# ExecStart= scripts and ReadWritePaths= under /tmp work and their effects are
# visible from the host (PrivateTmp= dirs are created in the host /tmp and removed
# when the unit stops).
#
# Limits seen on this kind of machine (systemd 252, a VM whose cgroup controllers sit on
# v1 mounts): resource controls (MemoryMax=, CPUQuota=, TasksMax=, IOWeight=) and the
# BPF-framework directives (RestrictFileSystems=, SocketBindDeny=,
# RestrictNetworkInterfaces=) are accepted but NOT enforced; without CAP_SYS_RESOURCE a
# negative OOMScoreAdjust= and AmbientCapabilities=CAP_SYS_RESOURCE are ignored and
# LimitNOFILE= is capped; no udev (.device/.swap/.automount units), no dbus (Type=dbus);
# the journal is in memory only (read it before `down`). PrivateTmp=yes together with a
# ReadWritePaths= under /tmp fails with 226/NAMESPACE: keep test paths outside /tmp.
# Verified working: Type=notify, WatchdogSec=, Restart=, ProtectSystem=, ReadWritePaths=,
# PrivateTmp=, NoNewPrivileges=, CapabilityBoundingSet=, DeviceAllow=, SystemCallFilter=,
# StateDirectory=, LoadCredential=, User=/DynamicUser=, the Protect*/Restrict* settings.
# If the caller is SIGKILLed the private systemd keeps running: `down STATE`, or write 1
# to /sys/fs/cgroup/unified/sysd-try.*/cgroup.kill.
set -euo pipefail

SELF=$(readlink -f "$0")
BASE=${SYSD_BASE:-${TMPDIR:-/tmp}/sysd-try}
CG_PARENT=/sys/fs/cgroup/unified   # host cgroup2 mount (hybrid host layout)
[ -f "$CG_PARENT/cgroup.procs" ] || CG_PARENT=/sys/fs/cgroup   # pure cgroup2 host

die() { echo "run-unit-under-systemd: $*" >&2; exit 1; }

# ---------------------------------------------------------------------------
# stage2/3: run as PID 1 of the new pid namespace, set up mounts, exec systemd
# ---------------------------------------------------------------------------
stage2() {
    # PID 1 of the new pid ns: join our cgroup, then a new cgroup ns rooted there
    local S=$1
    echo $$ > "$(cat "$S/cgroup")/cgroup.procs"
    exec unshare --cgroup -- "$SELF" __stage3 "$S"
}

stage3() {
    local S=$1 D
    mount --make-rprivate /

    # private /dev
    D=$S/devstage
    mount -t tmpfs -o mode=755,nosuid,size=64k tmpfs "$D"
    for n in null zero full random urandom tty; do
        touch "$D/$n"; mount --bind "/dev/$n" "$D/$n"
    done
    touch "$D/console"; mount --bind "$(tty)" "$D/console"   # the pty of `script`
    ln -s /proc/self/fd "$D/fd"
    ln -s /proc/self/fd/0 "$D/stdin"; ln -s /proc/self/fd/1 "$D/stdout"; ln -s /proc/self/fd/2 "$D/stderr"
    ln -s pts/ptmx "$D/ptmx"
    mkdir "$D/pts" "$D/shm" "$D/mqueue"
    mount --move "$D" /dev
    mount -t devpts -o newinstance,ptmxmode=0666,mode=620,gid=5 devpts /dev/pts
    mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm
    mount -t mqueue -o nosuid,nodev,noexec mqueue /dev/mqueue

    # private /run
    mount -t tmpfs -o mode=755,nosuid,nodev tmpfs /run
    mkdir -p /run/systemd/system.conf.d /run/lock
    cat > /run/systemd/system.conf.d/50-sysd-try.conf <<'EOF'
[Manager]
ShowStatus=no
DefaultTimeoutStartSec=30s
DefaultTimeoutStopSec=10s
EOF

    # /etc, /var: overlays with a tmpfs upper layer (StateDirectory=,
    # ConfigurationDirectory=, journal, ... never reach the host disk)
    mount -t tmpfs -o mode=755 tmpfs "$S/ovl"
    local d n
    for d in ${SYSD_OVERLAYS-/etc /var}; do
        n=$(echo "$d" | tr / _)
        mkdir "$S/ovl/$n.upper" "$S/ovl/$n.work"
        mount -t overlay overlay -o "lowerdir=$d,upperdir=$S/ovl/$n.upper,workdir=$S/ovl/$n.work" "$d"
    done

    # cgroup2: the cgroup namespace root is our delegated sub-cgroup
    umount -R /sys/fs/cgroup 2>/dev/null || umount -l /sys/fs/cgroup 2>/dev/null || true
    mount -o remount,bind,ro /sys
    mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 /sys/fs/cgroup

    # read-only /proc/sys (keeps PID 1 from bumping global sysctls like fs.nr_open)
    mount --bind /proc/sys /proc/sys
    if [ "${SYSD_SHARE_NET:-0}" != 1 ]; then mount --bind /proc/sys/net /proc/sys/net; fi
    mount -o remount,bind,ro /proc/sys
    if [ -e /proc/sysrq-trigger ]; then
        mount --bind /proc/sysrq-trigger /proc/sysrq-trigger
        mount -o remount,bind,ro /proc/sysrq-trigger
    fi

    # like a real host: shared propagation *inside* our (already private) mount
    # namespace; needed e.g. for LoadCredential=/SetCredential= (mounted from a
    # helper child namespace) -- does not propagate to the host
    mount --make-rshared /

    exec env -i \
        container=sysd-try \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        SYSTEMD_UNIT_PATH="$S/units" \
        SYSTEMD_GENERATOR_PATH="$S/empty" \
        SYSTEMD_ENVIRONMENT_GENERATOR_PATH="$S/empty" \
        /lib/systemd/systemd --system --unit=sysd-try.target \
            --log-level="${SYSD_LOG_LEVEL:-info}" --log-target=journal \
            </dev/null >/dev/console 2>&1
}

# ---------------------------------------------------------------------------
pid1_of() {  # host pid of the private PID 1 (the process in our cgroup whose NSpid is "<host> 1")
    local cg p; cg=$(cat "$1/cgroup" 2>/dev/null) || return 0
    for p in $(cat "$cg/init.scope/cgroup.procs" "$cg/cgroup.procs" 2>/dev/null); do
        if awk '$1=="NSpid:" && NF==3 && $3==1 {f=1} END {exit !f}' "/proc/$p/status" 2>/dev/null; then
            echo "$p"; return 0
        fi
    done
}

nsexec() {  # nsexec STATE cmd...  -> run cmd inside the private namespaces
    local S=$1; shift
    local p; p=$(pid1_of "$S")
    [ -n "$p" ] || die "private systemd is not running (state $S)"
    nsenter -t "$p" -m -u -i -n -p --wd=/ -- "$@"
}

up() {
    [ $# -ge 1 ] || die "usage: $0 up UNIT_FILE [EXTRA_UNIT_FILE...]"
    local f
    for f in "$@"; do [ -f "$f" ] || die "no such unit file: $f"; done
    [ -x /lib/systemd/systemd ] || die "/lib/systemd/systemd missing (apt-get install systemd)"
    mkdir -p "$BASE"
    [ -x /usr/bin/script ] || die "script(1) missing (apt-get install bsdutils)"
    local S; S=$(mktemp -d "$BASE/inst.XXXXXX")
    chmod 755 "$S"
    mkdir "$S/units" "$S/empty" "$S/devstage" "$S/ovl"
    : > "$S/console.log"

    # --- minimal unit set: all targets (without their .wants), journald, shutdown services
    local u
    for u in /lib/systemd/system/*.target; do ln -s "$u" "$S/units/"; done
    for u in systemd-journald.service systemd-journald.socket systemd-journald-dev-log.socket \
             systemd-poweroff.service systemd-halt.service systemd-reboot.service systemd-exit.service; do
        ln -s "/lib/systemd/system/$u" "$S/units/$u"
    done
    mkdir "$S/units/sockets.target.wants" "$S/units/sysinit.target.wants"
    ln -s ../systemd-journald.socket "$S/units/sockets.target.wants/"
    ln -s ../systemd-journald-dev-log.socket "$S/units/sockets.target.wants/"
    ln -s ../systemd-journald.service "$S/units/sysinit.target.wants/"

    # --- the unit(s) under test; first one is started by the boot target
    local main; main=$(basename "$1")
    for f in "$@"; do cp "$f" "$S/units/"; done
    echo "$main" > "$S/main-unit"
    cat > "$S/units/sysd-try.target" <<EOF
[Unit]
Description=sysd-try boot target
Requires=basic.target
After=basic.target
Wants=$main
AllowIsolate=yes
EOF

    # --- cgroup2 sub-tree for the private systemd
    local cg="$CG_PARENT/sysd-try.${S##*.}"
    mkdir "$cg"
    echo "$cg" > "$S/cgroup"

    local netopt=--net; [ "${SYSD_SHARE_NET:-0}" = 1 ] && netopt=
    # setsid: detach from the caller's session; `script` provides a pty that
    # becomes the private /dev/console (logged to console.log) and runs unshare.
    # Only the new PID 1 moves into $cg (see stage2), so that cgroup sub-tree
    # holds nothing but the private systemd and its services.
    local inner
    inner=$(printf '%q ' exec unshare --pid --fork --kill-child --mount --mount-proc --uts --ipc \
                $netopt -- "$SELF" __stage2 "$S")
    setsid env SHELL=/bin/bash script -qfec "$inner" "$S/console.log" \
        </dev/null >/dev/null 2>"$S/launcher.log" &
    echo $! > "$S/launcher.pid"
    date +%s.%N > "$S/t_start"

    # --- wait for boot to finish (incl. the main unit's start job)
    local i st=""
    for i in $(seq 1 $(( ${SYSD_BOOT_TIMEOUT:-60} * 10 ))); do
        if ! kill -0 "$(cat "$S/launcher.pid")" 2>/dev/null; then
            echo "private systemd died during boot (state dir $S); console log:" >&2
            cat "$S/console.log" "$S/launcher.log" >&2
            down "$S" >&2 || true
            exit 1
        fi
        if [ -n "$(pid1_of "$S")" ] && [ -S "/proc/$(pid1_of "$S")/root/run/systemd/private" ]; then
            st=$(nsexec "$S" systemctl is-system-running 2>/dev/null || true)
            case "$st" in running|degraded) break ;; esac
        fi
        sleep 0.1
    done
    echo "$st" > "$S/boot-state"
    echo "$S"
}

report() {
    local S=$1 unit=${2:-$(cat "$1/main-unit")}
    echo "===== systemctl is-system-running: $(nsexec "$S" systemctl is-system-running 2>&1 || true)"
    echo "===== systemctl status $unit"
    nsexec "$S" env SYSTEMD_COLORS=0 systemctl --no-pager -l --lines=0 status "$unit" || true
    echo "===== systemctl show $unit (selected properties)"
    nsexec "$S" systemctl show -p Type,ActiveState,SubState,Result,NRestarts,MainPID,ExecMainStatus,ExecMainCode,WatchdogUSec,StatusText "$unit" || true
    echo "===== failed units"
    nsexec "$S" systemctl --no-pager --failed --plain --no-legend || true
    echo "===== journalctl -u $unit"
    nsexec "$S" journalctl --no-pager -o short-precise -u "$unit" || true
}

down() {
    local S=$1 upid p i
    case "$S" in "$BASE"/inst.*) ;; *) die "not a state dir: $S" ;; esac
    upid=$(cat "$S/launcher.pid" 2>/dev/null || true)
    if [ -n "$upid" ] && kill -0 "$upid" 2>/dev/null; then
        p=$(pid1_of "$S")
        # graceful: SIGRTMIN+4 = poweroff (stops units, then PID 1 exits the container)
        [ -n "$p" ] && kill -s RTMIN+4 "$p" 2>/dev/null || true
        for i in $(seq 1 $(( ${SYSD_STOP_TIMEOUT:-20} * 10 ))); do kill -0 "$upid" 2>/dev/null || break; sleep 0.1; done
    fi
    local cg; cg=$(cat "$S/cgroup" 2>/dev/null || true)
    if [ -n "$upid" ] && kill -0 "$upid" 2>/dev/null; then
        echo "graceful poweroff timed out, killing" >&2
        p=$(pid1_of "$S"); [ -n "$p" ] && kill -9 "$p" 2>/dev/null || true   # kills the whole pid ns
        [ -n "$cg" ] && [ -e "$cg/cgroup.kill" ] && echo 1 > "$cg/cgroup.kill" 2>/dev/null || true
        for i in $(seq 1 50); do kill -0 "$upid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$upid" 2>/dev/null || true
    fi
    # remove the cgroup sub-tree (bottom-up); processes may take a moment to vanish
    if [ -n "$cg" ] && [ -d "$cg" ]; then
        for i in $(seq 1 50); do
            find "$cg" -depth -type d -exec rmdir {} + 2>/dev/null || true
            [ -d "$cg" ] || break
            sleep 0.1
        done
        [ -d "$cg" ] && echo "warning: could not remove $cg" >&2
    fi
    if [ "${SYSD_KEEP_STATE:-0}" != 1 ]; then
        # only unmounted leftovers remain (all mounts lived in the dead mount ns)
        rm -rf "$S"
    fi
}

case "${1:-}" in
    __stage2) shift; stage2 "$@" ;;
    __stage3) shift; stage3 "$@" ;;
    up)       shift; up "$@" ;;
    exec)     shift; S=$1; shift; nsexec "$S" "$@" ;;
    report)   shift; report "$@" ;;
    down)     shift; down "$1" ;;
    ""|-h|--help) sed -n '2,/^set -euo/p' "$SELF" | sed '$d'; exit 2 ;;
    *)
        unit_file=$1; secs=${2:-10}; shift; [ $# -gt 0 ] && shift
        [ "$(id -u)" = 0 ] || die "must run as root"
        S=$(up "$unit_file" "$@")
        trap 'down "$S"' EXIT
        trap 'exit 130' INT TERM HUP
        t0=$(cat "$S/t_start"); now=$(date +%s.%N)
        echo "===== private systemd booted in $(awk "BEGIN{printf \"%.2f\", $now - $t0}") s (state: $(cat "$S/boot-state")); running $secs s"
        sleep "$secs" & wait $!    # (interruptible, so INT/TERM tear down at once)
        report "$S"
        ;;
esac

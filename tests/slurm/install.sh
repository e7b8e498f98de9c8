#!/usr/bin/env bash
# Install SLURM (Debian's slurm-wlm) and munge for the tests in tests/slurm, if missing.
# Exit 0 when they are there (or now installed); non-zero, with a reason, when they cannot be
# installed (not root, no apt-get); the tests then skip. Quiet unless something fails.
set -u

installed() {
    for pkg in slurm-wlm munge; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || return 1
    done
}
binaries() {  # SLURM from elsewhere (not a Debian package) does just as well
    for bin in slurmctld slurmd munged sbatch; do
        PATH="$PATH:/usr/sbin:/sbin" command -v "$bin" >/dev/null || return 1
    done
}

if installed || binaries; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "tests/slurm/install.sh: slurm-wlm and munge are missing; run this as root to install them" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null; then
    echo "tests/slurm/install.sh: no apt-get here; install slurm-wlm and munge by hand" >&2
    exit 1
fi
log=$(mktemp)
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -qq slurm-wlm munge >"$log" 2>&1; then
    apt-get update -qq >>"$log" 2>&1
    if ! apt-get install -y -qq slurm-wlm munge >>"$log" 2>&1; then
        tail -20 "$log" >&2
        echo "tests/slurm/install.sh: apt-get install slurm-wlm munge failed" >&2
        rm -f "$log"
        exit 1
    fi
fi
rm -f "$log"

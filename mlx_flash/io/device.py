"""The block device under a file, by its own counters: how fast the disk delivered while a
run read from it (this machine's disk drifts ~2x within an hour, so a rate probed before a
run can be far from the one the run got). Linux only (/sys/dev/block/MAJ:MIN/stat);
elsewhere, or for a file system on no block device (tmpfs, overlay), there is no rate.

What the rate is: bytes read over the time the device had a request in flight, at the
queue depth the run itself kept; so a run that reads with fewer requests at once than the
profile's probe sees a lower rate. It times the disk the run got, not the disk's best.

No imports from the package: `benchmark peers` loads this file by path in its child, which
runs llama.cpp in an environment without mlx_flash.
"""

import os

MIN_BYTES = 32 << 20  # less read between two counters gives no rate (too little to time) ...
MIN_BUSY_S = 0.25  # ... or less busy time (io_ticks counts in jiffies: a few ms each)
MAX_WRITE_SHARE = 0.125  # a window that wrote more than this share of what it read gives none
# (the device's busy time counts writes too: they would pass for a slower read)


def counters(path):
    """(bytes read, seconds busy, bytes written) so far of the block device holding `path`, or
    None. Its sectors are 512 bytes whatever the device's; "busy" is io_ticks, the time it had
    a request in flight (anyone's: another process reading the same disk counts too)."""
    try:
        st = os.stat(path)
        with open(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat") as f:
            v = f.read().split()
        return int(v[2]) * 512, int(v[9]) / 1e3, int(v[6]) * 512
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def rate(before, after):
    """GB/s the device delivered between two counters() while it was busy, or None (no
    counters, too little read or busy time to time, or busy writing too)."""
    if before is None or after is None:
        return None
    nbytes, busy, written = (a - b for a, b in zip(after, before))
    if nbytes < MIN_BYTES or busy < MIN_BUSY_S or written > MAX_WRITE_SHARE * nbytes:
        return None
    return nbytes / busy / 1e9

"""The block device under a file, by its own counters: how fast the disk delivered while a
run read from it (this machine's disk drifts ~2x within an hour, so a rate probed before a
run can be far from the one the run got). Linux only (/sys/dev/block/MAJ:MIN/stat);
elsewhere, or for a file system on no block device (tmpfs, overlay), there is no rate.

No imports from the package: `benchmark peers` loads this file by path in its child, which
runs llama.cpp in an environment without mlx_flash.
"""

import os

MIN_BYTES = 32 << 20  # less read between two counters gives no rate (too little to time)


def counters(path):
    """(bytes read, seconds busy) so far of the block device holding `path`, or None. Its
    sectors are 512 bytes whatever the device's; "busy" is io_ticks, the time it had a
    request in flight (anyone's: another process reading the same disk counts too)."""
    try:
        st = os.stat(path)
        with open(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat") as f:
            v = f.read().split()
        return int(v[2]) * 512, int(v[9]) / 1e3
    except (OSError, ValueError, IndexError):
        return None


def rate(before, after):
    """GB/s the device delivered between two counters() while it was busy, or None (no
    counters, or too little read to time)."""
    if before is None or after is None:
        return None
    nbytes, busy = after[0] - before[0], after[1] - before[1]
    return nbytes / busy / 1e9 if nbytes >= MIN_BYTES and busy > 0 else None

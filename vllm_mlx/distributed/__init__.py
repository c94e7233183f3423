"""More than one rank: tensor and pipeline parallelism, forming the ring, launching
and supervising ranks, and the watchdog."""

"""The supervisor: launches a training job as one torchrun agent per node, watches its processes, stops it
gracefully and starts it again on a chosen node set. `view` holds what it saw (exits, process states) in the
form the healer's detectors read."""

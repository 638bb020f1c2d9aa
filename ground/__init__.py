"""The ground: what every other package of megaheal stands on, importing none of them (a test checks it).

Names and their checks, this host's processes, typed YAML configs and durations, secret files, commands run as
argument lists with a timeout, outbound HTTP with a timeout, the Slurm client, JSON lines, the GPU fault sets.
"""
